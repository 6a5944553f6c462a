"""The ``matrix`` case: GB/s over request size x fragment size x requests in flight, kvcore, bare and memcpy."""

from __future__ import annotations

from typing import Any

from kvcore.tools.bench.bare import _baselines
from kvcore.tools.bench.cases.common import _summarize
from kvcore.tools.bench.run import BackendRun, register_case
from kvcore.tools.bench.spec import BenchSpec, Shape


def matrix_cells(spec: BenchSpec) -> list[tuple[int, int, int]]:
    """The matrix's (fragment bytes, request tokens, in flight) cells that run (the others exceed matrix_max_bytes)."""
    out = []
    block = spec.matrix_block_bytes()
    per_token = block // spec.tokens_per_block
    for f in spec.matrix_fragment_bytes:
        for tokens in sorted(spec.matrix_tokens):
            for n in sorted(spec.matrix_inflight):
                if n * tokens * per_token <= spec.matrix_max_bytes or n == 1:
                    out.append((f or block, tokens, n))
    return out


@register_case("matrix", units=lambda spec: len(matrix_cells(spec)))
def case_matrix(run: BackendRun) -> dict[str, Any]:
    """GB/s over request size x fragment size x requests in flight: kvcore, the bare transport and memcpy.

    A request of ``t`` tokens moves the bytes of ``t`` tokens of a Llama-3-70B-shaped cache (all layers, K and V),
    cut into fragments of ``f`` bytes (as per-layer, per-head or per-token pools would cut them; 0 = one whole
    block of the model per fragment). Each fragment size is one pool shape on both ranks (one fragment per
    block, blocks scattered on both sides), opened once; within it every request size runs the bare modes
    (one request) and kvcore with each in-flight count. In-flight requests cycle through request-sized slots
    (``matrix_pool_bytes`` per side), so concurrent writes to one slot carry identical bytes and stay checkable.
    """
    from kvcore.layout.topology import dtype_bytes

    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    block = spec.matrix_block_bytes()
    per_token = block // spec.tokens_per_block
    native = _baselines().matrix_mode(run.backend)
    bare = ["agent"] + ([native] if native else []) + ["memcpy", "memcpy_scattered"]
    cells: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "model": {
            "name": "Llama-3-70B-shaped",
            "layers": spec.matrix_layers,
            "kv_heads": spec.kv_heads,
            "head_dim": spec.head_dim,
            "dtype": spec.dtype,
            "tokens_per_block": spec.tokens_per_block,
            "block_bytes": block,
            "bytes_per_token": per_token,
        },
        "iterations": spec.matrix_iterations,
        "cells": cells,
        "skipped": [],
        "leaks": {},
        "first_contact_ms": {},
    }
    todo = matrix_cells(spec)
    ok = True
    for frag in dict.fromkeys(f for f, _, _ in todo):
        sizes = sorted({t for f, t, _ in todo if f == frag})
        max_req = max(sizes) * per_token
        max_n = max(n for f, _, n in todo if f == frag)
        slot_blocks = -(-max_req // frag)
        slots = max(1, min(max_n, spec.matrix_pool_bytes // max(1, slot_blocks * frag)))
        head_dim = frag // (2 * dtype_bytes("bfloat16"))  # 1 layer, K and V, 1 head, 1 token per block: f bytes
        shape = Shape(f"matrix-{frag}", slots * slot_blocks, 1, 1, head_dim, 1, "bfloat16")
        opened = run.open(shape)
        out["first_contact_ms"][str(frag)] = opened["first_contact_ms"]
        ok = ok and opened["first_contact_verified"]
        try:
            for tokens in sizes:
                nbytes = tokens * per_token
                count = -(-nbytes // frag)
                moved = count * frag
                base = {"fragment_bytes": frag, "request_tokens": tokens, "request_bytes": moved, "fragments": count}
                for mode in bare:
                    run.say(f"{run.backend} matrix: {tokens} tokens, {frag} B fragments, {mode}")
                    prep = run.ctx.call("prepare", mode=mode, region="big", count=count)
                    admitted = None
                    if prep.get("descriptor"):  # the bare agent: the generation side loads it first
                        admitted = run.gen.call("admit", descriptor=prep["descriptor"])["name"]
                    try:
                        r = run.ctx.call("xfer", mode=mode, repeat=spec.matrix_iterations + 1)
                        if mode.startswith("memcpy"):
                            good = run.ctx.call("check", mode=mode)["ok"]
                        else:
                            good = run.gen.call("verify_slots", count=count, slot_blocks=slot_blocks, slots=1)["ok"]
                    finally:
                        run.ctx.call("unprepare", mode=mode)
                        if admitted is not None:
                            run.gen.call("dismiss", name=admitted)
                    cells.append(
                        {**base, "mode": mode, "inflight": 1, "verified": good}
                        | _summarize(moved, r["seconds"][1:], r["seconds"][0])
                    )
                    ok = ok and good
                for n in sorted({n for f, t, n in todo if f == frag and t == tokens}):
                    run.say(f"{run.backend} matrix: {tokens} tokens, {frag} B fragments, kvcore x{n}")
                    times, first = [], 0.0
                    good = True
                    for it in range(spec.matrix_iterations + 1):
                        rid = run.rids(n)
                        run.ctx.call("send", rid0=rid, n=n, region="big", count=count, slot_blocks=slot_blocks)
                        rr = run.gen.call(
                            "receive",
                            endpoint=run.endpoint,
                            rid0=rid,
                            n=n,
                            region="big",
                            pipelined=True,
                            count=count,
                            slot_blocks=slot_blocks,
                        )
                        v = run.gen.call("verify_slots", count=count, slot_blocks=slot_blocks, slots=min(n, slots))
                        good = good and v["ok"] and not rr["not_done"]
                        if it == 0:
                            first = rr["elapsed_s"]
                        else:
                            times.append(rr["elapsed_s"])
                    cell = {**base, "mode": "kvcore", "inflight": n, "verified": good}
                    cell |= _summarize(moved * n, times, first)
                    cells.append(cell)
                    ok = ok and good
                    run.tick()
        finally:
            checks = run.close_shape()
        out["leaks"].update({f"{frag}.{k}": v for k, v in checks["leaks"].items()})
        ok = ok and checks["pool_verified"] and not checks["context_errors"]
    for f in spec.matrix_fragment_bytes:
        for tokens in spec.matrix_tokens:
            for n in spec.matrix_inflight:
                if (f or block, tokens, n) not in todo:
                    out["skipped"].append({"fragment_bytes": f or block, "request_tokens": tokens, "inflight": n})
    out["verified"] = ok
    return out
