"""The ``soak`` case: many one-block requests, many in flight, random cancels from both sides."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvcore.tools.bench.run import BackendRun, register_case
from kvcore.tools.bench.spec import Shape


@register_case("soak")
def case_soak(run: BackendRun) -> dict[str, Any]:
    """Issue 9's soak: ``--requests`` one-block requests, ``--inflight`` at a time, random cancels from both sides.

    Both ranks run their side at once (separate processes). Every request must be reported exactly once and
    released on both sides, DONE ones must hold the right bytes, and once the transceivers have settled every
    live count (sessions, tombstones, quarantine, leases, transfers) must be back to zero.
    """
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    shape = Shape("soak", tokens=spec.inflight * 32, layers=1, kv_heads=1, head_dim=128, tokens_per_block=32)
    out: dict[str, Any] = {
        "shape": asdict(shape),
        "requests": spec.requests,
        "inflight": spec.inflight,
        "cancel_rate": spec.cancel_rate,
        "request_timeout_s": spec.soak_request_timeout_s,
    }
    out.update(run.open(shape, request_timeout_s=spec.soak_request_timeout_s))
    sides: dict[str, dict[str, Any]] = {}
    try:
        rid0 = run.rids(spec.requests)
        # the loop's own bound: at least 50 requests/s, and never below --timeout
        deadline_s = max(spec.timeout_s, spec.requests / 50.0)
        args = {
            "rid0": rid0,
            "requests": spec.requests,
            "inflight": spec.inflight,
            "cancel_rate": spec.cancel_rate,
            "deadline_s": deadline_s,
        }
        run.say(
            f"{run.backend} soak: {spec.requests} requests, {spec.inflight} in flight, cancel rate {spec.cancel_rate}"
        )
        run.ctx.post("soak", **args)
        run.gen.post("soak", endpoint=run.endpoint, **args)
        wait = deadline_s + spec.soak_request_timeout_s + 60.0
        sides["generation"] = run.gen.reply("soak", wait)
        sides["context"] = run.ctx.reply("soak", wait)
    finally:
        shape_checks = run.close_shape()
    out.update(sides)
    out["seconds"] = max(side["seconds"] for side in sides.values())
    out.update(shape_checks)
    out["leaks"] = {
        **{f"{name}.{k}": v for name, side in sides.items() for k, v in side["leaks"].items()},
        **shape_checks["leaks"],
    }
    promises = {
        name: {
            "reported_once": side["duplicate_outcomes"] == 0 and sum(side["outcomes"].values()) == spec.requests,
            "released_after_outcome": side["released_before_outcome"] == 0,
            "all_released": side["unreleased"] == 0,
            "bytes": side["byte_mismatches"] == 0,
        }
        for name, side in sides.items()
    }
    out["promises"] = promises
    out["verified"] = (
        all(all(p.values()) for p in promises.values())
        and shape_checks["pool_verified"]
        and out["first_contact_verified"]
    )
    return out
