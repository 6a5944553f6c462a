"""``kvcore bench``: every case on a tiny configuration, through the real CLI and the Python API.

Real rank processes and real transports; the assertions are on the result's
shape and on byte verification, never on wall-clock numbers (the machines are
shared and noisy).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from typing import Any

import pytest

from kvcore.tools.bench import CASES, BenchError, BenchSpec, installed_backends, run_bench

TINY = ["--tokens", "128", "--layers", "2", "--fragments", "32", "--iterations", "2"]
TINY += ["--small-requests", "40", "--latency-requests", "10", "--timeout", "60"]
TRANSPORTS = [b for b in ("shm", "nixl", "ucx") if b in installed_backends()]


def _bench_cli(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m kvcore bench ARGS`` in a process of its own, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "kvcore", "bench", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _check_transfer_case(case: dict[str, Any], backend: str) -> None:
    modes = set(case["modes"])
    assert {"kvcore", "agent", "memcpy", "memcpy_scattered"} <= modes
    if backend == "nixl":
        assert {"nixl_initialize", "nixl_prepped"} <= modes
        assert case["bare_mode"] in ("nixl_initialize", "nixl_prepped")
    elif backend == "ucx":  # kvcore-ucx registers bare UCX (ucp_put_nbx per fragment + one flush)
        assert "ucx_put" in modes and case["bare_mode"] == "ucx_put"
    else:
        assert case["bare_mode"] == "agent"
    for name, mode in case["modes"].items():
        assert mode["verified"] is True, name
        times = mode["times_ms"]
        assert len(times) == case["iterations"] and all(t > 0 for t in times) and mode["first_ms"] > 0
        # The reported rates follow from the raw times and the byte count (recomputed here, not re-read).
        assert mode["gbps_median"] == pytest.approx(case["bytes"] / (statistics.median(times) / 1e3) / 1e9, rel=1e-6)
        assert mode["gbps_best"] == pytest.approx(case["bytes"] / (min(times) / 1e3) / 1e9, rel=1e-6)
    assert case["plan_bytes"] == case["bytes"] and case["fragments"] >= 1
    g = {m: v["gbps_median"] for m, v in case["modes"].items()}
    for key, other in (
        ("kvcore_vs_bare", case["bare_mode"]),
        ("kvcore_vs_agent", "agent"),
        ("kvcore_vs_memcpy", "memcpy"),
        ("kvcore_vs_memcpy_scattered", "memcpy_scattered"),
    ):
        assert case["ratios"][key] == pytest.approx(g["kvcore"] / g[other], rel=1e-6), key
    assert case["pool_verified"] is True and case["first_contact_verified"] is True
    assert case["leaks"] == {} and case["context_errors"] == []
    assert case["verified"] is True


def _check_small_case(case: dict[str, Any], spec: dict[str, Any]) -> None:
    lat, thr = case["latency"], case["throughput"]
    assert lat["requests"] == spec["latency_requests"]
    assert lat["kvcore_ms_p50"] > 0 and lat["agent_ms_p50"] > 0  # measured, not left at a default
    assert lat["overhead_ms_p50"] == pytest.approx(lat["kvcore_ms_p50"] - lat["agent_ms_p50"], abs=1e-9)
    # both floors measured: the bare round trip and the same through an I/O thread and a condition wait
    assert 0 < lat["zmq_round_trip_ms_p50"] <= lat["zmq_round_trip_ms_p99"]
    assert 0 < lat["threaded_round_trip_ms_p50"] <= lat["threaded_round_trip_ms_p99"]
    assert lat["overhead_vs_threaded_round_trip"] == pytest.approx(
        lat["overhead_ms_p50"] / lat["threaded_round_trip_ms_p50"], rel=1e-9
    )
    # the lean floor: the threaded floor plus the least work of a request (kvcore's messages, the bare agent's write)
    assert 0 < lat["lean_round_trip_ms_p50"] <= lat["lean_round_trip_ms_p99"]
    assert lat["lean_overhead_vs_threaded_round_trip"] == pytest.approx(
        (lat["lean_round_trip_ms_p50"] - lat["agent_ms_p50"]) / lat["threaded_round_trip_ms_p50"], rel=1e-9
    )
    assert set(case["lean_cpu_us_per_request"]) == {"context", "generation"}
    # the threaded floor in C (kvcore-native, installed with the plugins)
    assert "native_floor" not in case, case.get("native_floor")
    assert 0 < lat["native_round_trip_ms_p50"] <= lat["native_round_trip_ms_p99"]
    assert set(case["native_cpu_us_per_request"]) == {"context", "generation"}
    assert all(v > 0 for v in case["native_cpu_us_per_request"].values())
    assert all(v > 0 for v in case["lean_cpu_us_per_request"].values())
    assert thr["requests"] == spec["small_requests"] and thr["seconds"] > 0
    assert thr["requests_per_s"] == pytest.approx(thr["requests"] / thr["seconds"], rel=1e-6)
    assert case["not_done"] == [] and case["leaks"] == {} and case["verified"] is True
    cpu = case["cpu_us_per_request"]  # CPU time per one-at-a-time request, by side and thread
    assert set(cpu) == {f"{side}.{t}" for side in ("context", "generation") for t in ("io", "engine", "process")}
    for side in ("context", "generation"):
        # the I/O thread does each request's work on both sides; it is part of its process (some slack: the
        # two clocks are read one after the other)
        assert 0 < cpu[f"{side}.io"] <= cpu[f"{side}.process"] * 1.05 + 50, cpu
    assert set(case["io_stall_us_per_request"]) == {"context", "generation"}
    assert all(v >= 0 for v in case["io_stall_us_per_request"].values())
    w = case["warmth"]  # the same planning, hot and after sleeps: every figure measured
    assert set(w) == {
        "hot_us_p50",
        "after_sleep_0.2ms_us_p50",
        "after_sleep_1ms_us_p50",
        "after_sleep_5ms_us_p50",
        "after_sleep_1ms_vs_hot",
    }
    assert all(v > 0 for v in w.values())
    assert w["after_sleep_1ms_vs_hot"] == pytest.approx(w["after_sleep_1ms_us_p50"] / w["hot_us_p50"], rel=1e-9)


def _check_result(result: dict[str, Any], backends: list[str]) -> None:
    assert result["version"] == 1 and result["machine"]["cpus"] >= 1
    assert list(result["backends"]) == backends
    for backend, entry in result["backends"].items():
        assert entry.get("error") is None, entry.get("error")
        assert set(entry["cases"]) == {"llama8b", "frag16k", "small"}
        _check_transfer_case(entry["cases"]["llama8b"], backend)
        _check_transfer_case(entry["cases"]["frag16k"], backend)
        assert entry["cases"]["frag16k"]["fragment_bytes"] == 16 * 1024
        _check_small_case(entry["cases"]["small"], result["spec"])
        assert entry["ok"] is True
    assert result["ok"] is True


@pytest.mark.timeout(120)
def test_cli_json_every_case_on_every_installed_transport() -> None:
    proc = _bench_cli(
        "--json", "--backend", ",".join(TRANSPORTS), *TINY, timeout=110, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # stdout is JSON only: rank processes' native logs go to stderr
    _check_result(result, TRANSPORTS)
    llama = result["backends"][TRANSPORTS[0]]["cases"]["llama8b"]
    assert llama["bytes"] == 4 * 2 * 2 * 8 * 32 * 128 * 2  # 4 blocks x 2 layers x K,V x 8 heads x 32 x 128 x bf16


@pytest.mark.timeout(60)
def test_python_api_shm() -> None:
    spec = BenchSpec(
        backends=["shm"],
        tokens=64,
        layers=1,
        fragments=16,
        iterations=1,
        small_requests=20,
        latency_requests=5,
        timeout_s=60,
    )
    result = run_bench(spec)
    _check_result(result, ["shm"])


def test_spec_refuses_unknown_case_and_bad_sizes() -> None:
    assert {"llama8b", "frag16k", "small"} <= set(CASES)
    with pytest.raises(BenchError, match="unknown case"):
        BenchSpec(cases=["nope"]).validate()
    with pytest.raises(BenchError, match="iterations"):
        BenchSpec(iterations=0).validate()


def test_cli_reports_an_unknown_backend_as_a_failed_backend() -> None:
    proc = _bench_cli("--json", "--backend", "no-such-agent", "--cases", "small", *TINY, timeout=60)
    assert proc.returncode == 1
    result = json.loads(proc.stdout)
    assert result["ok"] is False
    assert "no-such-agent" in result["backends"]["no-such-agent"]["error"]


def test_a_bench_error_raised_while_handling_another_names_both() -> None:
    """A case that fails, then fails again checking its shape in ``finally``, reports the first failure too."""
    from kvcore.errors import ResourceExhaustedError
    from kvcore.tools.bench.run import _describe
    from kvcore.tools.bench.spec import BenchTimeoutError

    try:
        try:
            raise ResourceExhaustedError("4096 requests in flight reach max_inflight_requests=4096")
        finally:
            raise BenchTimeoutError("context rank: 200 request(s) never released")
    except BenchTimeoutError as exc:
        text = _describe(exc)
    assert text.startswith("BenchTimeoutError: context rank: 200 request(s) never released")
    assert "earlier error: ResourceExhaustedError: 4096 requests in flight" in text
    assert _describe(ValueError("alone")) == "ValueError: alone"


@pytest.mark.serial  # a busy thread's GIL share: with another test loading the cores beside it, it may get none
@pytest.mark.timeout(120)
def test_busy_case_times_each_busy_engine_and_switch_interval() -> None:
    """The ``busy`` case: a row with nothing busy, then each rank busy at the interpreter's switch interval and at
    each lowered one; every row measured, the intervals the ranks really ran with, every byte verified."""
    from kvcore.tools.bench.cases.latency import BUSY_SWITCH_S

    result = run_bench(
        BenchSpec(backends=["shm"], cases=["busy"], tokens=64, layers=1, latency_requests=10, timeout_s=60)
    )
    case = result["backends"]["shm"]["cases"]["busy"]
    rows = case["rows"]
    assert [(r["busy"], pytest.approx(r["switch_interval_s"], rel=1e-6)) for r in rows] == [
        ("none", sys.getswitchinterval())
    ] + [(side, sw) for side in ("context", "generation") for sw in (sys.getswitchinterval(), *BUSY_SWITCH_S)]
    for r in rows:
        assert r["kvcore_ms_p50"] > 0 and r["kvcore_ms_p99"] >= r["kvcore_ms_p50"] and r["zmq_round_trip_ms_p50"] > 0
        assert r["kvcore_vs_idle_p50"] == pytest.approx(r["kvcore_ms_p50"] / rows[0]["kvcore_ms_p50"], rel=1e-9)
        assert all(v >= 0 for v in (*r["io_wake_lag_ms_mean"].values(), *r["io_stall_us_per_request"].values()))
    # The busy side's own metrics see the GIL: at the interpreter's switch interval (5 ms) its I/O thread waits
    # for it at several points of every request, at least a millisecond more than with nothing busy. (An absolute
    # margin, not a ratio: load from outside the run raises the idle row too; with two CPU hogs beside the suite
    # the idle row read 1.2 ms and the busy one 3.0 ms.)
    idle = rows[0]["io_stall_us_per_request"]
    for side, row in (("context", rows[1]), ("generation", rows[1 + 1 + len(BUSY_SWITCH_S)])):
        assert row["busy"] == side and row["switch_interval_s"] == pytest.approx(sys.getswitchinterval())
        stall = row["io_stall_us_per_request"][side]
        assert stall >= 1000 and stall - idle[side] >= 1000, (side, stall, idle)
    assert case["requests_per_row"] == 10 and case["not_done"] == [] and case["leaks"] == {}
    assert case["verified"] is True and result["ok"] is True


def test_threaded_floor_measures_an_echo_and_ends_typed_without_one() -> None:
    """The threaded floor's ping: every round trip timed against a live echo, its thread and sockets gone after;
    no echo (a dead peer) is a BenchTimeoutError at its deadline, an address off loopback a BenchError."""
    import threading

    from kvcore.tools.bench.floor import _Echo, _FloorModes
    from kvcore.tools.bench.spec import BenchError, BenchTimeoutError

    def ping_threads() -> int:
        return sum(t.name == "bench-ping-io" for t in threading.enumerate())

    modes = _FloorModes()
    echo = _Echo()
    try:
        seconds = modes.op_ping_threaded(echo.endpoint, 20, 5.0)["seconds"]
    finally:
        echo.close()
    assert len(seconds) == 20 and all(0 < s < 5.0 for s in seconds)
    assert ping_threads() == 0
    with pytest.raises(BenchTimeoutError, match="no echo"):
        modes.op_ping_threaded(echo.endpoint, 1, 0.3)  # the echo is closed: nobody answers
    assert ping_threads() == 0
    with pytest.raises(BenchError, match="loopback"):
        modes.op_ping_threaded("tcp://10.0.0.1:5555", 1, 0.3)


def test_lean_floor_answers_are_checked_and_its_failures_are_told() -> None:
    """The lean floor's messages are kvcore's own: an answer that is not an ok TransferResult with the request's
    nonce stops the ping at once (BenchError, not the deadline); an echo whose work fails says why when closed; the
    lean echo cannot start without the bare agent prepared."""
    import time

    from kvcore.control import wire
    from kvcore.tools.bench.floor import _LEAN_NONCE, _Echo, _FloorModes, _lean_check, _lean_request
    from kvcore.tools.bench.spec import BenchError, BenchTimeoutError

    def result(**kw: Any) -> bytes:
        base = dict(v=wire.PROTOCOL_VERSION, request_id=1, ctx_rank=0, ctx_incarnation="c", status="ok")
        return wire.encode(wire.TransferResult(**{**base, "nonce": _LEAN_NONCE, **kw}))

    _lean_check(result())
    for bad in (result(status="failed"), result(nonce=b"another-nonce-16"), _lean_request(1)):
        with pytest.raises(BenchError, match="not an ok TransferResult"):
            _lean_check(bad)
    request = wire.decode(_lean_request(3))
    assert isinstance(request, wire.RequestData) and request.nonce == _LEAN_NONCE
    assert request.block_ids == (3).to_bytes(8, "little")

    modes = _FloorModes()
    echo = _Echo()  # a plain echo answers a RequestData with itself: the I/O thread's check refuses it
    try:
        t0 = time.monotonic()
        with pytest.raises(BenchError, match="not an ok TransferResult"):
            modes.op_ping_threaded(echo.endpoint, 1, 30.0, lean=True)
        assert time.monotonic() - t0 < 20
    finally:
        echo.close()

    def broken(frame: bytes) -> bytes:
        raise OSError("injected: the write failed")

    echo = _Echo(broken)
    with pytest.raises(BenchTimeoutError, match="no echo"):
        modes.op_ping_threaded(echo.endpoint, 1, 0.5, lean=True)
    with pytest.raises(BenchError, match="injected: the write failed"):
        echo.close()
    modes.bare = {}
    with pytest.raises(BenchError, match="'agent' mode prepared"):
        modes.op_echo_start(lean=True)

    import threading

    release = threading.Event()

    def stuck(frame: bytes) -> bytes:
        release.wait(30)  # a write that does not end
        return frame

    echo = _Echo(stuck)
    with pytest.raises(BenchTimeoutError, match="no echo"):
        modes.op_ping_threaded(echo.endpoint, 1, 0.5, lean=True)
    with pytest.raises(BenchError, match="did not end within 5 s"):
        echo.close()  # told, and the socket is left to the thread still in its work
    assert not echo.sock.closed
    release.set()
    echo.thread.join(10)
    assert not echo.thread.is_alive()
    echo.sock.close(0)


def test_native_floor_without_its_package_is_told_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native floor's echo says why it did not start where kvcore-native is missing or fails (the small case
    reports it and measures the rest); its ping refuses, naming why; with the package both run."""
    from kvcore.tools.bench import floor
    from kvcore.tools.bench.spec import BenchError

    modes = floor._FloorModes()
    started = modes.op_native_echo_start()
    try:
        assert started["endpoint"] is not None
        assert len(modes.op_ping_native(started["endpoint"], 5, 5.0)["seconds"]) == 5
    finally:
        modes.op_native_echo_stop()

    import kvcore_native

    def broken() -> Any:
        raise kvcore_native.NativeFloorError("injected: no libzmq")

    monkeypatch.setattr(kvcore_native, "echo_start", broken)
    assert modes.op_native_echo_start() == {
        "endpoint": None,
        "missing": "kvcore-native could not start its echo: injected: no libzmq",
    }
    monkeypatch.setattr(floor, "_native", lambda: (None, "kvcore-native is not installed"))
    assert modes.op_native_echo_start() == {"endpoint": None, "missing": "kvcore-native is not installed"}
    with pytest.raises(BenchError, match="cannot run: kvcore-native is not installed"):
        modes.op_ping_native("tcp://127.0.0.1:1", 1, 1.0)


def test_threaded_floor_io_thread_failure_is_raised_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from kvcore.tools.bench.floor import _Echo, _FloorModes, _ThreadedPing
    from kvcore.tools.bench.spec import BenchError

    def broken(self: _ThreadedPing) -> None:
        raise OSError("injected: the socket broke")

    monkeypatch.setattr(_ThreadedPing, "_loop", broken)
    echo = _Echo()
    try:
        t0 = time.monotonic()
        with pytest.raises(BenchError, match="injected: the socket broke"):
            _FloorModes().op_ping_threaded(echo.endpoint, 1, 30.0)
        assert time.monotonic() - t0 < 20  # told at once, not at the 30 s deadline
    finally:
        echo.close()


def _fake_result(ok: bool, overhead: float, agent_ratio: float, cpu: tuple[float, float]) -> dict[str, Any]:
    return {
        "ok": ok,
        "seconds": 1.0,
        "machine": {"loadavg": [0.5, 0.5, 0.5], "loadavg_end": [0.6, 0.5, 0.5]},
        "backends": {
            "nixl": {
                "cases": {
                    "small": {
                        "latency": {
                            "overhead_vs_threaded_round_trip": overhead,
                            "overhead_ms_p50": overhead / 4,
                            "threaded_round_trip_ms_p50": 0.25,
                        },
                        "cpu_us_per_request": {"context.process": cpu[0], "generation.process": cpu[1]},
                    },
                    "frag16k": {"modes": {}, "ratios": {"kvcore_vs_agent": agent_ratio, "kvcore_vs_bare": 0.5}},
                }
            }
        },
    }


def test_invocations_summary_is_the_median_of_each_measure_as_each_result_states_it() -> None:
    from kvcore.tools.bench.repeat import summarize_invocations

    results = [
        _fake_result(True, 3.0, 0.90, (400.0, 300.0)),
        _fake_result(True, 2.0, 0.96, (500.0, 450.0)),
        _fake_result(False, 5.0, 0.80, (600.0, 100.0)),
    ]
    del results[1]["backends"]["nixl"]["cases"]["frag16k"]  # a case one invocation lacks: counted where present
    rows = {(r["case"], r["measure"]): r for r in summarize_invocations(results)["measures"]}
    assert rows[("small", "overhead_vs_threaded_round_trip")]["values"] == [3.0, 2.0, 5.0]
    assert rows[("small", "overhead_vs_threaded_round_trip")]["median"] == 3.0
    assert rows[("small", "cpu_us_per_request_both_processes")]["values"] == [700.0, 950.0, 700.0]
    assert rows[("small", "cpu_us_per_request_both_processes")]["median"] == 700.0
    agent = rows[("frag16k", "kvcore_vs_agent")]
    assert agent["values"] == [0.90, 0.80] and agent["invocations"] == 2 and agent["median"] == pytest.approx(0.85)
    summary = summarize_invocations(results)
    assert summary["ok"] is False and [r["ok"] for r in summary["runs"]] == [True, True, False]
    assert summarize_invocations(results[:2])["ok"] is True


@pytest.mark.timeout(120)
def test_cli_into_a_log_reports_each_step_as_a_line() -> None:
    """stderr not a terminal (CI, a remote machine's log): a line per step and per invocation, so a run stopped by a
    time limit still shows how far it got; the summary on stdout as on a terminal."""
    proc = _bench_cli("--backend", "shm", *TINY, "--cases", "small", "--invocations", "2", timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert [ln for ln in lines if "invocation" in ln] == [
        "kvcore bench: invocation 1 of 2",
        "kvcore bench: invocation 2 of 2",
    ]
    steps = [ln for ln in lines if re.fullmatch(r"kvcore bench \[ *\d+ s\]: .+", ln)]
    assert sum("shm: starting rank processes" in ln for ln in steps) == 2, proc.stderr[-2000:]
    assert any("shm small" in ln for ln in steps), proc.stderr[-2000:]
    assert "median of 2 invocations" in proc.stdout


@pytest.mark.timeout(120)
def test_cli_invocations_run_the_bench_again_and_report_the_medians() -> None:
    proc = _bench_cli("--json", "--backend", "shm", *TINY, "--invocations", "2", timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["ok"] is True and len(out["invocations"]) == 2 and out["summary"]["invocations"] == 2
    for result in out["invocations"]:
        _check_result(result, ["shm"])
    rows = {(r["case"], r["measure"]): r for r in out["summary"]["measures"]}
    # each median is recomputed from the invocations' own results, read here independently of the summarizer
    ratios = [r["backends"]["shm"]["cases"]["frag16k"]["ratios"]["kvcore_vs_agent"] for r in out["invocations"]]
    assert rows[("frag16k", "kvcore_vs_agent")]["median"] == pytest.approx(statistics.median(ratios))
    floors = [
        r["backends"]["shm"]["cases"]["small"]["latency"]["overhead_vs_threaded_round_trip"] for r in out["invocations"]
    ]
    assert rows[("small", "overhead_vs_threaded_round_trip")]["values"] == floors
    bad = _bench_cli("--backend", "shm", "--invocations", "0", timeout=60)
    assert bad.returncode == 1 and "--invocations must be 1..20, got 0" in bad.stderr
