"""Latency cases: one-block requests alone and many in flight (``small``, ``small_auth`` with CURVE), head of
line beside a big request (``hol``), and one-block requests beside a busy engine thread (``busy``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from typing import Any

from kvcore.tools.bench.blocks import SMALL_SLOTS
from kvcore.tools.bench.cases.common import shape_verified
from kvcore.tools.bench.floor import floor_summary
from kvcore.tools.bench.run import BackendRun, register_case
from kvcore.tools.bench.spec import _GB, _pct


def _process_cpu_us(cpu0: dict[str, Any], cpu1: dict[str, Any], n: int) -> dict[str, float]:
    """CPU microseconds per round trip of each side's whole process between two ``cpu`` probes of ``n`` trips."""
    return {
        side: (cpu1[side]["process"] - cpu0[side]["process"]) / max(1, n) * 1e6 for side in ("context", "generation")
    }


@register_case("small")
def case_small(run: BackendRun) -> dict[str, Any]:
    """One-block (16 KiB) requests: per-request latency vs the agent alone, and requests/s with many in flight."""
    return _small(run, auth=False)


@register_case("small_auth")
def case_small_auth(run: BackendRun) -> dict[str, Any]:
    """The ``small`` case with CurveZMQ on both control planes (one fresh key pair per instance)."""
    return _small(run, auth=True)


def _small(run: BackendRun, *, auth: bool) -> dict[str, Any]:
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    shape = replace(spec.frag16k_shape(), name="small", tokens=32)
    out: dict[str, Any] = {"shape": asdict(shape), "block_bytes": shape.block_bytes, "auth": auth}
    out.update(run.open(shape, auth=auth))
    try:
        warm = max(1, min(20, spec.latency_requests // 10))
        # warm-up requests, not counted
        rid = run.rids(warm)
        run.ctx.call("send", rid0=rid, n=warm, region="small")
        run.gen.call("receive", endpoint=run.endpoint, rid0=rid, n=warm, region="small", pipelined=False)
        # latency: one at a time
        run.say(f"{run.backend} small: {spec.latency_requests} requests one at a time")
        rid = run.rids(spec.latency_requests)
        run.ctx.call("send", rid0=rid, n=spec.latency_requests, region="small")
        steps0 = {"context": run.ctx.call("steps"), "generation": run.gen.call("steps")}
        cpu0 = {"context": run.ctx.call("cpu"), "generation": run.gen.call("cpu")}
        r = run.gen.call(
            "receive", endpoint=run.endpoint, rid0=rid, n=spec.latency_requests, region="small", pipelined=False
        )
        cpu1 = {"context": run.ctx.call("cpu"), "generation": run.gen.call("cpu")}
        steps1 = {"context": run.ctx.call("steps"), "generation": run.gen.call("steps")}
        lat_ms = [x * 1e3 for x in r["latency_s"]]
        not_done = list(r["not_done"])
        # the transport alone on the same one-block plan
        bare = run.ctx.call("prepare", mode="agent", region="small", count=1)
        admitted = run.gen.call("admit", descriptor=bare["descriptor"])["name"]
        try:
            a = run.ctx.call("xfer", mode="agent", repeat=spec.latency_requests + warm)
            # the lean floor: the threaded floor plus the least work a request needs (kvcore's messages, this agent)
            echo = run.ctx.call("echo_start", lean=True)["endpoint"]
            try:
                lean_cpu0 = {"context": run.ctx.call("cpu"), "generation": run.gen.call("cpu")}
                pl = run.gen.call(
                    "ping_threaded", endpoint=echo, n=spec.latency_requests + warm, timeout_s=spec.timeout_s, lean=True
                )
                lean_cpu1 = {"context": run.ctx.call("cpu"), "generation": run.gen.call("cpu")}
            finally:
                run.ctx.call("echo_stop")
        finally:
            run.ctx.call("unprepare", mode="agent")
            run.gen.call("dismiss", name=admitted)
        agent_ms = [x * 1e3 for x in a["seconds"][warm:]]
        # the control plane's floor: a bare ZeroMQ round trip between the same two processes
        echo = run.ctx.call("echo_start")["endpoint"]
        try:
            p = run.gen.call("ping", endpoint=echo, n=spec.latency_requests + warm, timeout_s=spec.timeout_s)
            pt = run.gen.call("ping_threaded", endpoint=echo, n=spec.latency_requests + warm, timeout_s=spec.timeout_s)
        finally:
            run.ctx.call("echo_stop")
        floor = floor_summary(p["seconds"], warm)
        threaded = floor_summary(pt["seconds"], warm)
        lean = floor_summary(pl["seconds"], warm)
        # the threaded floor in C (kvcore-native): the same hops with no Python on them
        native_echo = run.ctx.call("native_echo_start")
        native: dict[str, Any] = {"missing": native_echo.get("missing")}
        if native_echo["endpoint"] is not None:
            try:
                native_cpu0 = {"context": run.ctx.call("cpu"), "generation": run.gen.call("cpu")}
                pn = run.gen.call(
                    "ping_native",
                    endpoint=native_echo["endpoint"],
                    n=spec.latency_requests + warm,
                    timeout_s=spec.timeout_s,
                )
                native_cpu1 = {"context": run.ctx.call("cpu"), "generation": run.gen.call("cpu")}
            finally:
                run.ctx.call("native_echo_stop")
            native = dict(floor_summary(pn["seconds"], warm))
            native["cpu_us_per_request"] = _process_cpu_us(native_cpu0, native_cpu1, len(pn["seconds"]))
        warmth = run.ctx.call("warmth", n=100)
        # throughput: every request in flight together
        run.say(f"{run.backend} small: {spec.small_requests} requests in flight")
        rid = run.rids(spec.small_requests)
        run.ctx.call("send", rid0=rid, n=spec.small_requests, region="small")
        t = run.gen.call(
            "receive", endpoint=run.endpoint, rid0=rid, n=spec.small_requests, region="small", pipelined=True
        )
        not_done += t["not_done"]
        ok = run.gen.call("verify", region="small")["ok"]
    finally:
        shape_checks = run.close_shape()
    overhead = _pct(lat_ms, 50) - _pct(agent_ms, 50)
    out["latency"] = {
        "requests": len(lat_ms),
        "kvcore_ms_p50": _pct(lat_ms, 50),
        "kvcore_ms_p99": _pct(lat_ms, 99),
        "kvcore_ms_mean": statistics.fmean(lat_ms),
        "agent_ms_p50": _pct(agent_ms, 50),
        "agent_ms_p99": _pct(agent_ms, 99),
        "overhead_ms_p50": overhead,
        "zmq_round_trip_ms_p50": floor["ms_p50"],
        "zmq_round_trip_ms_p99": floor["ms_p99"],
        "overhead_vs_zmq_round_trip": overhead / floor["ms_p50"],
        # the same round trip through an I/O thread and a condition wait, as a request's hand-offs (no kvcore work)
        "threaded_round_trip_ms_p50": threaded["ms_p50"],
        "threaded_round_trip_ms_p99": threaded["ms_p99"],
        "overhead_vs_threaded_round_trip": overhead / threaded["ms_p50"],
        # the threaded floor plus the least work a request needs, in Python (kvcore.tools.bench.floor)
        "lean_round_trip_ms_p50": lean["ms_p50"],
        "lean_round_trip_ms_p99": lean["ms_p99"],
        "lean_overhead_vs_threaded_round_trip": (lean["ms_p50"] - _pct(agent_ms, 50)) / threaded["ms_p50"],
        # the threaded floor in C (kvcore-native); None where that package is not installed (native_floor says why)
        "native_round_trip_ms_p50": native.get("ms_p50"),
        "native_round_trip_ms_p99": native.get("ms_p99"),
        "requests_per_s_one_at_a_time": len(lat_ms) / r["elapsed_s"],
    }
    # The same Python work hot and right after a sleep (kvcore.tools.bench.floor): on a shared VM the steps of
    # a one-block request, each on a thread that just woke, run at the "after sleep" speed.
    out["warmth"] = warmth
    # Mean ms per request of each step the transceivers time, over the one-at-a-time requests only.
    out["steps_ms_mean"] = {
        f"{side}.{name}": (v[0] - steps0[side][name][0]) / (v[1] - steps0[side][name][1]) * 1e3
        for side, names in steps1.items()
        for name, v in names.items()
        if v[1] > steps0[side][name][1]
    }
    # CPU time per one-at-a-time request, by side and thread: the work kvcore does per request, which this shared
    # box's wake-ups and contention do not blur as they blur the latency (the generation's engine thread is the
    # bench loop that starts and waits; the context's is idle but for its engine poll every millisecond).
    n_lat = max(1, len(lat_ms))
    out["cpu_us_per_request"] = {
        f"{side}.{what}": (cpu1[side][what] - cpu0[side][what]) / n_lat * 1e6
        for side in ("context", "generation")
        for what in ("io", "engine", "process")
    }
    # ... the same for the lean floor's round trips (both processes; the context's engine poll is idle meanwhile)
    out["lean_cpu_us_per_request"] = _process_cpu_us(lean_cpu0, lean_cpu1, len(pl["seconds"]))
    if native.get("missing"):
        out["native_floor"] = f"not measured: {native['missing']}"
    else:
        out["native_cpu_us_per_request"] = native["cpu_us_per_request"]
    # ... and the time each I/O thread was ready to run per request but waited (the GIL, a core, a lock).
    out["io_stall_us_per_request"] = {
        side: (cpu1[side]["io_stall"] - cpu0[side]["io_stall"]) / n_lat * 1e6 for side in ("context", "generation")
    }
    out["throughput"] = {
        "requests": spec.small_requests,
        "seconds": t["elapsed_s"],
        "requests_per_s": spec.small_requests / t["elapsed_s"],
        "gbps": spec.small_requests * shape.block_bytes / t["elapsed_s"] / _GB,
    }
    out["not_done"] = not_done
    out.update(shape_checks)
    out["verified"] = (
        ok
        and not not_done
        and shape_verified(out, shape_checks)
        # CURVE on both ranks exactly when asked for, or when the configuration authenticates by default (this
        # user's local key; KVCORE_AUTH_MODE=none runs the small case without authentication)
        and out["curve_ranks"] == (2 if auth or _authenticates_by_default() else 0)
    )
    return out


@register_case("hol", units=lambda spec: spec.iterations + 1)
def case_hol(run: BackendRun) -> dict[str, Any]:
    """Head of line: one-block requests alone, and while the whole ``llama8b`` request moves on the same rank.

    Each round sends ``--hol-requests`` one-block requests one at a time with nothing else in flight, then
    starts the big request and sends as many one-block requests one at a time beside it; only those that
    ended before the big one are counted as ``during``. The first round is the warm-up.
    """
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    shape = replace(spec.llama_shape(), name="hol")
    n = max(spec.hol_requests, SMALL_SLOTS)  # every small slot is written, so the end-of-case check holds
    out: dict[str, Any] = {"shape": asdict(shape), "bytes": shape.nbytes, "block_bytes": shape.block_bytes}
    out.update(run.open(shape))
    alone: list[float] = []
    during: list[float] = []
    big_ms: list[float] = []
    not_done: list[str] = []
    try:
        for it in range(spec.iterations + 1):
            run.say(f"{run.backend} hol: round {it}/{spec.iterations}")
            if it:
                run.tick()
            rid = run.rids(n)
            run.ctx.call("send", rid0=rid, n=n, region="small")
            a = run.gen.call("receive", endpoint=run.endpoint, rid0=rid, n=n, region="small", pipelined=False)
            big, rid = run.rids(1), run.rids(n)
            run.ctx.call("send", rid0=big, n=1, region="big")
            run.ctx.call("send", rid0=rid, n=n, region="small")
            h = run.gen.call("hol", endpoint=run.endpoint, big_rid=big, rid0=rid, n=n)
            not_done += a["not_done"] + h["not_done"]
            if it:
                alone += [x * 1e3 for x in a["latency_s"]]
                during += [x * 1e3 for x, d in zip(h["latency_s"], h["during"], strict=True) if d]
                big_ms.append(h["big_s"] * 1e3)
        ok = run.gen.call("verify", region="small")["ok"] and run.gen.call("verify", region="big")["ok"]
    finally:
        shape_checks = run.close_shape()
    run.tick()
    out["one_block"] = {
        "requests_alone": len(alone),
        "requests_during": len(during),
        "alone_ms_p50": _pct(alone, 50),
        "alone_ms_p99": _pct(alone, 99),
        "during_ms_p50": _pct(during, 50) if during else None,
        "during_ms_p99": _pct(during, 99) if during else None,
        "during_vs_alone_p50": _pct(during, 50) / _pct(alone, 50) if during else None,
    }
    out["big_ms_median"] = statistics.median(big_ms)
    out["big_gbps_median"] = shape.nbytes / (statistics.median(big_ms) / 1e3) / _GB
    out["not_done"] = not_done
    out.update(shape_checks)
    out["verified"] = ok and not not_done and shape_verified(out, shape_checks)
    return out


def _lag_ms(before: dict[str, Any], after: dict[str, Any]) -> float:
    """Mean wake lag (ms) of an I/O thread between two ``cpu`` readings (0.0 when it never slept)."""
    count = after["lag_count"] - before["lag_count"]
    return (after["lag_sum_s"] - before["lag_sum_s"]) / count * 1e3 if count > 0 else 0.0


#: The lowered GIL switch intervals the ``busy`` case measures beside the interpreter's (``gil_switch_interval_s``).
BUSY_SWITCH_S = (0.0005, 0.0001)


@register_case("busy")
def case_busy(run: BackendRun) -> dict[str, Any]:
    """One-block requests one at a time while one rank's engine thread runs Python without pause.

    An engine's step loop is Python that rarely sleeps. The transceiver's I/O thread shares the GIL with it and
    gives it up at every ZeroMQ and transport call; getting it back can take the interpreter's whole switch
    interval (5 ms by default). Rows: nothing busy; the context's engine busy, then the generation's, each at
    the interpreter's interval and at each of ``BUSY_SWITCH_S``. Each row also times the bare ZeroMQ round trip under
    the same conditions. Only one rank is busy at a time, so a spinning thread never has both cores of a small
    box.
    """
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    shape = replace(spec.frag16k_shape(), name="busy", tokens=32)
    n = max(10, min(spec.latency_requests, 100))
    out: dict[str, Any] = {"shape": asdict(shape), "block_bytes": shape.block_bytes, "requests_per_row": n}
    out.update(run.open(shape))
    rows: list[dict[str, Any]] = []
    not_done: list[str] = []
    try:
        rid = run.rids(10)  # warm-up, not counted
        run.ctx.call("send", rid0=rid, n=10, region="small")
        run.gen.call("receive", endpoint=run.endpoint, rid0=rid, n=10, region="small", pipelined=False)
        settings = [("none", 0.0)] + [(side, sw) for side in ("context", "generation") for sw in (0.0, *BUSY_SWITCH_S)]
        for busy, switch in settings:
            run.say(f"{run.backend} busy: {busy} engine thread busy, switch interval {switch or 'default'}")
            rank = run.ctx if busy == "context" else run.gen
            interval = rank.call("busy", on=busy != "none", switch_s=switch)["switch_s"]
            try:
                rid = run.rids(n)
                before = {"context": run.ctx.call("cpu"), "generation": run.gen.call("cpu")}
                run.ctx.call("send", rid0=rid, n=n, region="small")
                r = run.gen.call("receive", endpoint=run.endpoint, rid0=rid, n=n, region="small", pipelined=False)
                after = {"context": run.ctx.call("cpu"), "generation": run.gen.call("cpu")}
                echo = run.ctx.call("echo_start")["endpoint"]
                try:
                    p = run.gen.call("ping", endpoint=echo, n=n, timeout_s=spec.timeout_s)
                finally:
                    run.ctx.call("echo_stop")
            finally:
                rank.call("busy", on=False)
            not_done += r["not_done"]
            lat = [x * 1e3 for x in r["latency_s"]]
            ping = [x * 1e3 for x in p["seconds"]]
            rows.append(
                {
                    "busy": busy,
                    "switch_interval_s": interval,
                    "kvcore_ms_p50": _pct(lat, 50),
                    "kvcore_ms_p99": _pct(lat, 99),
                    "zmq_round_trip_ms_p50": _pct(ping, 50),
                    "zmq_round_trip_ms_p99": _pct(ping, 99),
                    # what each I/O thread's own metrics saw meanwhile (docs/observability.md)
                    "io_wake_lag_ms_mean": {side: _lag_ms(before[side], after[side]) for side in before},
                    "io_stall_us_per_request": {
                        side: (after[side]["io_stall"] - before[side]["io_stall"]) / n * 1e6 for side in before
                    },
                }
            )
        ok = run.gen.call("verify", region="small")["ok"]
    finally:
        shape_checks = run.close_shape()
    base = rows[0]["kvcore_ms_p50"]
    for row in rows:
        row["kvcore_vs_idle_p50"] = row["kvcore_ms_p50"] / base
    out["rows"] = rows
    out["not_done"] = not_done
    out.update(shape_checks)
    out["verified"] = ok and not not_done and shape_verified(out, shape_checks)
    return out


def _authenticates_by_default() -> bool:
    """Whether a rank configured as the bench's are (defaults < ``KVCORE_*`` environment) serves CURVE."""
    from kvcore.config import TransceiverConfig
    from kvcore.control.auth import AuthConfig

    return AuthConfig.from_config(TransceiverConfig.load()) is not None
