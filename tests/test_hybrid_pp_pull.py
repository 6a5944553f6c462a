"""Hybrid models (Mamba + attention) under context PP: pull is as exact as push, through start_send's parameters.

Each context PP stage holds some of the layers: a stage of Mamba layers only, of one of two attention groups, or
without Mamba. Every context rank is called alike (the request's block ids for every group, its state slot) and
must return the same parameters, built from the request's whole description; the test forwards one rank's
(the first or the last stage) to every generation rank. The expectation is computed by plain indexing of a
seeded logical request (``kvcore.testing.oracle``'s head, channel and SSM-head shares), never by kvcore's
mappers, and every destination byte is compared.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from _faults import ThreadCollective

from kvcore.testing.oracle import conv_channels_of_rank, heads_of_rank, ssm_heads_of_rank
from kvcore.transceiver import SessionState

pytestmark = pytest.mark.timeout(180)

TPB, PROMPT, WINDOW = 4, 30, 16
TOTAL = -(-PROMPT // TPB)  # 8 blocks
STALE = (PROMPT + 1 - WINDOW) // TPB  # 3: the window group needs blocks 3..7
SENTINEL = 0x5A
HEADS, HEAD_DIM = 2, 8
SECTIONS, D_CONV, NHEADS, SSM_HD, D_STATE = (16, 8, 8), 4, 8, 2, 4

#: model name -> (number of layers, Mamba layers, attention groups {name: (layers, window)})
MODELS: dict[str, tuple[int, tuple[int, ...], dict[str, tuple[tuple[int, ...], int | None]]]] = {
    "mamba+attn": (2, (0,), {"full": ((1,), None)}),
    "mamba+full+swa": (3, (0,), {"full": ((1,), None), "swa": ((2,), WINDOW)}),
    "mamba+full+mamba+swa": (4, (0, 2), {"full": ((1,), None), "swa": ((3,), WINDOW)}),
}
CTX_IDS = {"full": [9, 2, 14, 0, 5, 11, 7, 3], "swa": [6, 1, 4, 0, 7]}  # swa: the resident window suffix
GEN_IDS = {"full": [1, 8, 3, 12, 15, 0, 6, 10], "swa": [2, 5, 0, 7, 3]}
CTX_SLOT, GEN_SLOT = 3, 1


def _geometry(model: str, ssm_dtype: str = "float32") -> tuple[Any, Any]:
    from kvcore.layout.topology import AttentionGeometry, MambaGeometry

    n, mamba, _ = MODELS[model]
    geo = AttentionGeometry(num_layers=n, num_kv_heads=HEADS, head_dim=HEAD_DIM, tokens_per_block=TPB, dtype="bfloat16")
    mg = MambaGeometry(
        layers=mamba, conv_sections=SECTIONS, d_conv=D_CONV, nheads=NHEADS, head_dim=SSM_HD, d_state=D_STATE,
        conv_dtype="bfloat16", ssm_dtype=ssm_dtype,
    )  # fmt: skip
    return geo, mg


def _logical(model: str, seed: int) -> dict[str, np.ndarray]:
    n, mamba, _ = MODELS[model]
    rng = np.random.default_rng(seed)
    return {
        "kv": rng.integers(0, 255, (n, 2, HEADS, TOTAL * TPB, HEAD_DIM * 2), dtype=np.uint8),
        "conv": rng.integers(0, 255, (len(mamba), sum(SECTIONS), (D_CONV - 1) * 2), dtype=np.uint8),
        "ssm": rng.integers(0, 255, (len(mamba), NHEADS, SSM_HD * D_STATE * 4), dtype=np.uint8),
    }


def _put(view: torch.Tensor, data: np.ndarray) -> None:
    flat = torch.from_numpy(np.ascontiguousarray(data).reshape(-1))
    view.copy_(flat.view(view.dtype).reshape(view.shape))


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@dataclass
class Rank:
    topo: Any
    agent: Any
    kv: dict[str, torch.Tensor]
    conv: Any
    ssm: Any
    tx: Any = None


def _fill(model: str, rank: Rank, kv: dict[str, torch.Tensor], conv: Any, ssm: Any, logical: dict[str, np.ndarray],
          ids: dict[str, list[int]], slot: int, arrangement: str) -> None:  # fmt: skip
    """The request's bytes into one rank's tensors, by plain indexing: its layers, heads, channels, SSM heads."""
    _, mamba, groups = MODELS[model]
    topo = rank.topo
    start, stop = topo.layer_range
    heads = heads_of_rank(HEADS, topo.tp_size, topo.tp_rank, False)
    for name, (layers, _window) in groups.items():
        local = [layer for layer in layers if start <= layer < stop]
        first = TOTAL - len(ids[name])
        for j, blk in enumerate(ids[name]):
            toks = slice((first + j) * TPB, (first + j + 1) * TPB)
            for li, layer in enumerate(local):
                for k in range(2):
                    _put(kv[name][blk, li, k], logical["kv"][layer, k][heads][:, toks])
    chans = conv_channels_of_rank(SECTIONS, topo.tp_size, topo.tp_rank, False)
    sheads = ssm_heads_of_rank(NHEADS, topo.tp_size, topo.tp_rank, False)
    for li, layer in enumerate(layer for layer in mamba if start <= layer < stop):
        gi = mamba.index(layer)
        c = logical["conv"][gi][chans]  # [channels, taps * 2 bytes]
        if arrangement == "vllm":  # per layer [slots, taps, channels]
            _put(conv[li][slot], c.reshape(len(chans), D_CONV - 1, 2).transpose(1, 0, 2))
        else:  # TensorRT-LLM's [layers, slots, channels, taps]
            _put(conv[li][slot], c)
        _put(ssm[li][slot], logical["ssm"][gi][sheads])


def _instance(
    model: str, role: str, tp: int, pp: int, backend: str, arrangement: str, tag: str, ssm_dtype: str = "float32"
) -> list[Rank]:
    from kvcore.config import TransceiverConfig, create_agent
    from kvcore.control.collective import LocalCollective
    from kvcore.layout.builders import allocate_kv_cache, allocate_mamba_state, build_kv_page_table, build_mamba_state
    from kvcore.layout.page import PageTable
    from kvcore.layout.topology import Topology
    from kvcore.transceiver import Transceiver

    geo, mg = _geometry(model, ssm_dtype)
    n, _, groups = MODELS[model]
    world = tp * pp
    colls: list[Any] = ThreadCollective.group(world) if world > 1 else [LocalCollective()]
    cfg = TransceiverConfig(backend=backend, request_timeout_s=30)
    arr = "vllm" if arrangement == "vllm" else None
    ranks, tables = [], []
    for r in range(world):
        topo = Topology.create(tp, pp, r, n)
        agent = create_agent(cfg, f"{tag}-{role}-{r}")
        kv, parts = {}, []
        for name, (layers, window) in groups.items():
            kv[name] = allocate_kv_cache(topo, geo, 16, allocator=agent.allocate_tensor, layers=layers)
            parts.append(
                build_kv_page_table(kv[name], topology=topo, geometry=geo, layers=layers, group=name, window=window)
            )
        conv, ssm = allocate_mamba_state(topo, mg, 4, allocator=agent.allocate_tensor, arrangement=arr)
        parts.append(build_mamba_state(conv, ssm, topology=topo, geometry=mg, arrangement=arr))
        ranks.append(Rank(topo, agent, kv, conv, ssm))
        tables.append(PageTable.combine(parts))

    def make(r: int) -> Any:
        return Transceiver(
            cfg, role=role, agent=ranks[r].agent, topology=ranks[r].topo, geometry=geo, page_table=tables[r],
            collective=colls[r], instance_name=f"{tag}-{role}", mamba=mg,
        )  # fmt: skip

    with ThreadPoolExecutor(world) as pool:
        for rank, tx in zip(ranks, pool.map(make, range(world))):
            rank.tx = tx
    return ranks


def _close(ranks: list[Rank]) -> None:
    for r in ranks:
        if r.tx is not None:
            r.tx.close()
        r.agent.close()


def _settle(*instances: list[Rank], rid: int, timeout: float = 30.0) -> list[Any]:
    """Poll every instance (collectively, its ranks in step) until rank 0 of each reported and released ``rid``."""
    outcome: list[Any] = [None] * len(instances)
    released = [False] * len(instances)
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(8) as pool:
        while not all(released):
            assert time.monotonic() < deadline, f"not settled in {timeout}s: {outcome}"
            for i, ranks in enumerate(instances):
                results = list(pool.map(lambda r: r.tx.poll(), ranks))
                for o in results[0].outcomes:
                    if o.request_id == rid:
                        outcome[i] = o
                released[i] = released[i] or rid in results[0].released
            time.sleep(0.005)
    return outcome


def _sentinel(ranks: list[Rank]) -> None:
    for r in ranks:
        for t in r.kv.values():
            t.view(torch.uint8).fill_(SENTINEL)
        for t in [*r.conv, *r.ssm]:
            t.fill_(0) if not t.is_contiguous() else t.view(torch.uint8).fill_(SENTINEL)


def _run(model: str, ctx_pp: int, gen_tp: int, mode: str, arrangement: str, backend: str, forward: str) -> None:
    _, _, groups = MODELS[model]
    ids_ctx = {g: CTX_IDS[g] for g in groups}
    ids_gen = {g: GEN_IDS[g] for g in groups}
    if len(groups) == 1:  # one group: the engine passes a plain list
        ctx_arg: Any = ids_ctx["full"]
        gen_arg: Any = ids_gen["full"]
    else:
        ctx_arg, gen_arg = ids_ctx, ids_gen
    seed = 23
    logical = _logical(model, seed)
    tag = f"pp{ctx_pp}-{gen_tp}-{mode}-{time.monotonic_ns()}"
    ctx = _instance(model, "context", 1, ctx_pp, backend, arrangement, tag)
    gen: list[Rank] = []
    try:
        gen = _instance(model, "generation", gen_tp, 1, backend, arrangement, tag)
        for r in ctx:
            _fill(model, r, r.kv, r.conv, r.ssm, logical, ids_ctx, CTX_SLOT, arrangement)
        _sentinel(gen)
        before = {id(r): ([t.clone() for t in r.conv], [t.clone() for t in r.ssm]) for r in gen}
        params = [r.tx.start_send(1, ctx_arg, prompt_len=PROMPT, state_slot=CTX_SLOT, mode=mode) for r in ctx]
        for q in params:
            diff = {k: (v, q.to_dict().get(k)) for k, v in params[0].to_dict().items() if q.to_dict().get(k) != v}
            assert not diff, f"context ranks returned different parameters: {diff}"
        p = params[0 if forward == "first" else -1].to_dict()
        for r in gen:
            r.tx.start_receive(params=p, block_ids=gen_arg, prompt_len=PROMPT, state_slot=GEN_SLOT)
        out_ctx, out_gen = _settle(ctx, gen, rid=1)
        assert out_gen.state is SessionState.DONE, out_gen
        assert out_ctx.state is SessionState.DONE, out_ctx
        for r in gen:
            kv = {g: t.clone() for g, t in r.kv.items()}
            conv, ssm = before[id(r)]  # the state outside the request's slot must be as it was
            for t in kv.values():
                t.view(torch.uint8).fill_(SENTINEL)
            _fill(model, r, kv, conv, ssm, logical, ids_gen, GEN_SLOT, arrangement)
            for g in kv:
                assert torch.equal(_raw(r.kv[g]), _raw(kv[g])), f"gen rank {r.topo.rank}: group {g} bytes differ"
            for li in range(len(conv)):
                assert torch.equal(_raw(r.conv[li]), _raw(conv[li])), f"gen rank {r.topo.rank}: conv[{li}] differs"
                assert torch.equal(_raw(r.ssm[li]), _raw(ssm[li])), f"gen rank {r.topo.rank}: ssm[{li}] differs"
        for ranks in (ctx, gen):
            for r in ranks:
                assert r.tx.leaks() == {}, r.tx.leaks()
    finally:
        _close(gen)
        _close(ctx)


CASES = [
    ("mamba+attn", 2, 1),
    ("mamba+attn", 2, 2),
    ("mamba+full+swa", 3, 1),
    ("mamba+full+swa", 3, 2),
    ("mamba+full+mamba+swa", 2, 1),
    ("mamba+full+mamba+swa", 2, 2),
]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("arrangement", ["trtllm", "vllm"])
@pytest.mark.parametrize(("model", "ctx_pp", "gen_tp"), CASES, ids=[f"{m}-ctxPP{p}-genTP{t}" for m, p, t in CASES])
def test_hybrid_under_context_pp_moves_exactly(model: str, ctx_pp: int, gen_tp: int, arrangement: str, mode: str):
    # the parameters of the first stage (Mamba only in two of the models) are forwarded
    _run(model, ctx_pp, gen_tp, mode, arrangement, "shm", "first")


@pytest.mark.parametrize("forward", ["first", "last"])
@pytest.mark.parametrize("backend", ["nixl", "ucx"])
def test_hybrid_pull_under_context_pp3_on_every_backend(backend: str, forward: str) -> None:
    pytest.importorskip(f"kvcore_{backend}")
    _run("mamba+full+swa", 3, 2, "pull", "trtllm", backend, forward)
    _run("mamba+attn", 2, 1, "pull", "vllm", backend, forward)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_an_ssm_dtype_mismatch_is_refused_on_both_sides_at_once(mode: str) -> None:
    """The generation side keeps its SSM state in float16: IncompatiblePeerError there, pools untouched, and the
    context's request (every PP stage) ends with it at once instead of at its lease."""
    from kvcore import errors as E

    tag = f"ssm-{mode}-{time.monotonic_ns()}"
    ctx = _instance("mamba+attn", "context", 1, 2, "shm", "trtllm", tag)
    gen: list[Rank] = []
    try:
        gen = _instance("mamba+attn", "generation", 1, 1, "shm", "trtllm", tag, ssm_dtype="float16")
        _sentinel(gen)
        params = [r.tx.start_send(1, CTX_IDS["full"], prompt_len=PROMPT, state_slot=CTX_SLOT, mode=mode) for r in ctx]
        t0 = time.monotonic()
        gen[0].tx.start_receive(params=params[0], block_ids=GEN_IDS["full"], prompt_len=PROMPT, state_slot=GEN_SLOT)
        out_ctx, out_gen = _settle(ctx, gen, rid=1, timeout=15.0)
        assert out_gen.state is SessionState.FAILED and isinstance(out_gen.error, E.IncompatiblePeerError), out_gen
        assert "ssm" in str(out_gen.error).lower(), out_gen.error
        assert out_ctx.state is SessionState.FAILED and isinstance(out_ctx.error, E.IncompatiblePeerError), out_ctx
        assert time.monotonic() - t0 < 15.0
        assert (gen[0].kv["full"].view(torch.uint8) == SENTINEL).all(), "a refused peer's pools were written"
    finally:
        _close(gen)
        _close(ctx)
