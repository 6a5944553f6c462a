"""Transfer cases: one request's fragment plan through every mode (``llama8b``, ``frag16k``), push vs pull
(``modes``), and the bounce path vs per-token fragments (``bounce``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from typing import Any

from kvcore.tools.bench.bare import _baselines
from kvcore.tools.bench.cases.common import _summarize, shape_verified
from kvcore.tools.bench.run import BackendRun, register_case
from kvcore.tools.bench.spec import _GB, Shape, _pct


def _transfer_case(run: BackendRun, shape: Shape) -> dict[str, Any]:
    """kvcore vs the bare agent vs NIXL's own API vs memcpy on one request's identical fragment plan."""
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    out: dict[str, Any] = {"shape": asdict(shape), "bytes": shape.nbytes, "iterations": spec.iterations}
    out.update(run.open(shape))
    modes = ["kvcore", "agent"]
    natives = _baselines().for_backend(run.backend)  # the transport's own API, if its plugin registers it
    modes += natives
    modes += ["memcpy", "memcpy_scattered"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    submits: dict[str, list[float]] = {m: [] for m in modes}
    first: dict[str, float] = {}
    verified: dict[str, bool] = {m: True for m in modes}
    setup: dict[str, Any] = {}
    try:
        for m in modes[1:]:
            setup[m] = run.ctx.call("prepare", mode=m, region="big")
            if setup[m]["descriptor"]:
                setup[m]["admitted"] = run.gen.call("admit", descriptor=setup[m]["descriptor"])["name"]
        plan = setup["agent"]
        out.update(fragments=plan["fragments"], fragment_bytes=plan["fragment_bytes"], plan_bytes=plan["bytes"])
        # Round-robin over the modes so that load from other processes hits every mode alike; the first
        # round is the warm-up (registration caches, connections, list preparation), reported apart.
        for it in range(spec.iterations + 1):
            run.say(f"{run.backend} {shape.name}: round {it}/{spec.iterations}")
            if it:
                run.tick()
            for m in modes:
                memcpy = m.startswith("memcpy")
                if not memcpy:
                    run.gen.call("zero", region="big")
                if m == "kvcore":
                    t, s = run.kvcore_once("big"), None
                else:
                    r = run.ctx.call("xfer", mode=m)
                    t, s = r["seconds"][0], r["submit_seconds"][0]
                ok = run.ctx.call("check", mode=m)["ok"] if memcpy else run.gen.call("verify", region="big")["ok"]
                verified[m] = verified[m] and ok
                if it == 0:
                    first[m] = t
                else:
                    times[m].append(t)
                    if s is not None:
                        submits[m].append(s)
    finally:
        for m in setup:
            run.ctx.call("unprepare", mode=m)
            if "admitted" in setup[m]:
                run.gen.call("dismiss", name=setup[m]["admitted"])
        shape_checks = run.close_shape()
    run.tick()
    out["modes"] = {}
    for m in modes:
        res = _summarize(shape.nbytes, times[m], first[m])
        res["verified"] = verified[m]
        if submits[m]:
            res["submit_ms_median"] = statistics.median(submits[m]) * 1e3
        if m in setup:
            res["setup_ms"] = setup[m]["setup_ms"]
        out["modes"][m] = res
    g = {m: out["modes"][m]["gbps_median"] for m in modes}
    bare = max(natives, key=lambda m: g[m]) if natives else "agent"
    out["bare_mode"] = bare
    out["ratios"] = {
        "kvcore_vs_bare": g["kvcore"] / g[bare],
        "kvcore_vs_agent": g["kvcore"] / g["agent"],
        "kvcore_vs_memcpy": g["kvcore"] / g["memcpy"],
        "kvcore_vs_memcpy_scattered": g["kvcore"] / g["memcpy_scattered"],
        "bare_vs_memcpy": g[bare] / g["memcpy"],
        **{f"kvcore_vs_{m}": g["kvcore"] / g[m] for m in natives},
    }
    out.update(shape_checks)
    out["verified"] = all(verified.values()) and shape_verified(out, shape_checks)
    return out


@register_case("llama8b", units=lambda spec: spec.iterations + 1)
def case_llama8b(run: BackendRun) -> dict[str, Any]:
    """The Llama-3-8B-shaped request (``--tokens``/``--layers``... change it): every mode, same plan."""
    return _transfer_case(run, run.spec.llama_shape())


@register_case("frag16k", units=lambda spec: spec.iterations + 1)
def case_frag16k(run: BackendRun) -> dict[str, Any]:
    """``--fragments`` x 16 KiB fragments (4096 = 64 MiB by default): every mode, same plan."""
    return _transfer_case(run, run.spec.frag16k_shape())


@register_case("bounce")
def case_bounce(run: BackendRun) -> dict[str, Any]:
    """Token-major TP2 -> TP4 (one fragment per token) through the bounce path vs per-token fragments, same run.

    Runs ``kvcore demo`` twice on this backend with 6 rank processes (2 context, 4 generation): once with
    the bounce path forced on, once off. ``--tokens`` is split over 4 requests in flight; every byte is
    verified by the demo's independent check.
    """
    from kvcore.layout.topology import dtype_bytes
    from kvcore.tools.demo import DemoSpec, run_demo

    spec = run.spec
    requests = 4
    tokens = max(spec.tokens_per_block, spec.tokens // requests)
    per_rank = spec.layers * 2 * tokens * max(1, spec.kv_heads // 4) * spec.head_dim * dtype_bytes(spec.dtype)
    arena = max(64 << 20, 2 * requests * per_rank)  # every request's lease fits at once
    out: dict[str, Any] = {"topology": "context TP2 -> generation TP4, token-major", "requests": requests}
    modes: dict[str, Any] = {}
    for mode in ("off", "on"):
        run.say(f"{run.backend} bounce: {mode}")
        demo = DemoSpec(
            backend=run.backend,
            requests=requests,
            tokens=tokens,
            layers=spec.layers,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            tokens_per_block=spec.tokens_per_block,
            dtype=spec.dtype,
            block_order="token_major",
            ctx_tp=2,
            gen_tp=4,
            bounce=mode,
            timeout_s=spec.timeout_s,
            extra={"bounce_buffer_bytes": arena},
        )
        r = run_demo(demo, progress=False)
        modes[mode] = {
            "gbps": r.get("gbps", 0.0),
            "seconds": r.get("seconds"),
            "bytes": r.get("bytes"),
            "verified": bool(r.get("ok")),
            "errors": r.get("errors", {}),
        }
    out["modes"] = {"per_token_fragments": modes["off"], "bounce": modes["on"]}
    off = modes["off"]["gbps"]
    out["ratio_bounce_vs_fragments"] = modes["on"]["gbps"] / off if off else None
    out["verified"] = modes["off"]["verified"] and modes["on"]["verified"]
    return out


@register_case("modes", units=lambda spec: spec.iterations + 2)
def case_modes(run: BackendRun) -> dict[str, Any]:
    """Push vs pull, same run: the Llama-3-8B-shaped request and one-block requests, alternating modes."""
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    out: dict[str, Any] = {"push_vs_pull": ["push", "pull"]}
    for label, shape, region, n in (
        ("big", spec.llama_shape(), "big", spec.iterations),
        ("one_block", replace(spec.frag16k_shape(), name="one_block", tokens=32), "first", spec.latency_requests),
    ):
        res: dict[str, Any] = {"shape": asdict(shape), "bytes": shape.nbytes if label == "big" else shape.block_bytes}
        res.update(run.open(shape))
        times: dict[str, list[float]] = {"push": [], "pull": []}
        verified = True
        try:
            run.say(f"{run.backend} modes: {label}, {n} requests per mode")
            for i in range(n):
                for mode in ("push", "pull") if i % 2 == 0 else ("pull", "push"):  # neither always goes first
                    run.gen.call("zero", region=region)
                    times[mode].append(run.kvcore_once(region, mode))
                    verified = verified and run.gen.call("verify", region=region)["ok"]
                if label == "big":
                    run.tick()
        finally:
            res.update(run.close_shape())
        for mode, ts in times.items():
            res[mode] = {
                "ms_median": statistics.median(ts) * 1e3,
                "ms_p90": _pct(ts, 90) * 1e3,
                "gbps_median": res["bytes"] / statistics.median(ts) / _GB,
            }
        res["pull_vs_push_time"] = statistics.median(times["pull"]) / statistics.median(times["push"])
        res["verified"] = verified and res["pool_verified"] and not res["leaks"]
        out[label] = res
        run.tick()
    out["verified"] = out["big"]["verified"] and out["one_block"]["verified"]
    return out
