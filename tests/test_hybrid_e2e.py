"""End to end: a hybrid request (Mamba, full attention, Mamba, sliding-window attention) between two processes.

Each attention group has its own pool and its own block ids; the Mamba state is
in vLLM's per-layer page layout. Only the public API is used; the expectation
is computed from a seeded logical request by plain indexing, in both processes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from kvcore.runtime import Channel, RankProcess

TPB, PROMPT, WINDOW = 4, 30, 16
TOTAL = -(-PROMPT // TPB)  # 8 blocks
STALE = (PROMPT + 1 - WINDOW) // TPB  # 3: the window group needs blocks 3..7
SENTINEL = 0x5A
FULL, SWA, MAMBA = (1,), (3,), (0, 2)


def _geometry() -> tuple[Any, Any]:
    from kvcore.layout.topology import AttentionGeometry, MambaGeometry

    geo = AttentionGeometry(num_layers=4, num_kv_heads=2, head_dim=8, tokens_per_block=TPB, dtype="bfloat16")
    mg = MambaGeometry(
        layers=MAMBA, conv_sections=(16, 4, 4), d_conv=4, nheads=8, head_dim=2, d_state=4,
        conv_dtype="bfloat16", ssm_dtype="float32", n_groups=1,
    )  # fmt: skip
    return geo, mg


def _logical(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "kv": rng.integers(0, 255, (4, 2, 2, TOTAL * TPB, 8 * 2), dtype=np.uint8),
        "conv": rng.integers(0, 255, (2, 3, 24, 2), dtype=np.uint8),  # [mamba layer, d_conv-1, conv_dim, bf16]
        "ssm": rng.integers(0, 255, (2, 8, 2 * 4 * 4), dtype=np.uint8),
    }


def _put(view: torch.Tensor, data: np.ndarray) -> None:
    view.copy_(torch.from_numpy(np.ascontiguousarray(data).reshape(-1)).view(view.dtype).reshape(view.shape))


def _fill(rank: dict[str, Any], logical: dict[str, np.ndarray], ids: dict[str, list[int]], slot: int) -> None:
    """The request's bytes into ``rank``'s tensors: each group's blocks, and the state slot."""
    for name, layer, first in (("full", FULL[0], 0), ("swa", SWA[0], TOTAL - len(ids["swa"]))):
        for j, blk in enumerate(ids[name]):
            toks = slice((first + j) * TPB, (first + j + 1) * TPB)
            for k in range(2):
                _put(rank[name][blk, 0, k], logical["kv"][layer, k][:, toks])
    for li in range(len(MAMBA)):
        _put(rank["conv"][li][slot], logical["conv"][li])
        _put(rank["ssm"][li][slot], logical["ssm"][li])


def _rank(role: str, name: str) -> dict[str, Any]:
    from kvcore.config import TransceiverConfig, create_agent
    from kvcore.layout.builders import allocate_kv_cache, allocate_mamba_state, build_kv_page_table, build_mamba_state
    from kvcore.layout.page import PageTable
    from kvcore.layout.topology import Topology
    from kvcore.transceiver import Transceiver

    geo, mg = _geometry()
    topo = Topology.create(1, 1, 0, 4)
    cfg = TransceiverConfig(backend="shm", request_timeout_s=30)
    agent = create_agent(cfg, name)
    full = allocate_kv_cache(topo, geo, 16, allocator=agent.allocate_tensor, layers=FULL)
    swa = allocate_kv_cache(topo, geo, 8, allocator=agent.allocate_tensor, layers=SWA)
    conv, ssm = allocate_mamba_state(topo, mg, 4, allocator=agent.allocate_tensor, arrangement="vllm")
    table = PageTable.combine(
        [
            build_kv_page_table(full, topology=topo, geometry=geo, layers=FULL, group="full"),
            build_kv_page_table(swa, topology=topo, geometry=geo, layers=SWA, group="swa", window=WINDOW),
            build_mamba_state(conv, ssm, topology=topo, geometry=mg, arrangement="vllm"),
        ]
    )
    tx = Transceiver(cfg, role=role, agent=agent, topology=topo, geometry=geo, page_table=table, mamba=mg)
    return {"agent": agent, "tx": tx, "full": full, "swa": swa, "conv": conv, "ssm": ssm}


CTX_IDS = {"full": [9, 2, 14, 0, 5, 11, 7, 3], "swa": [6, 1, 4, 0, 7]}  # swa: the resident window suffix
GEN_IDS = {"full": [1, 8, 3, 12, 15, 0, 6, 10], "swa": [2, 5, 0, 7, 3]}
CTX_SLOT, GEN_SLOT = 3, 1


def context_main(channel: Channel, seed: int, mode: str) -> None:
    """The context rank process: send request 1, report its parameters, then its outcome (a raise is reported)."""
    rank = _rank("context", f"ctx-hybrid-{os.getpid()}")
    tx = rank["tx"]
    try:
        _fill(rank, _logical(seed), CTX_IDS, CTX_SLOT)
        params = tx.start_send(1, CTX_IDS, prompt_len=PROMPT, state_slot=CTX_SLOT, mode=mode)
        channel.send({"params": params.to_dict()})
        out = tx.wait_all([1], 60)[1]
        channel.send({"state": out.state.value, "error": str(out.error or "")})
    finally:
        tx.close()
        rank["agent"].close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_hybrid_request_with_two_groups_and_state_moves_exactly(mode: str) -> None:
    from kvcore.transceiver import SessionState

    seed = 11
    ctx = RankProcess(
        "test_hybrid_e2e:context_main",
        name="hybrid context",
        kwargs={"seed": seed, "mode": mode},
        path=[os.path.dirname(__file__)],
    )
    gen = None
    try:
        hello = ctx.recv(120, op="start_send")  # a refused start_send raises here, naming the context's error
        assert "params" in hello, hello
        gen = _rank("generation", f"gen-hybrid-{os.getpid()}")
        tensors = {key: gen[key] for key in ("full", "swa")}
        for t in [*tensors.values(), *gen["conv"], *gen["ssm"]]:
            t.view(torch.uint8).fill_(SENTINEL) if t.is_contiguous() else t.fill_(0)
        gen["tx"].start_receive(params=hello["params"], block_ids=GEN_IDS, prompt_len=PROMPT, state_slot=GEN_SLOT)
        out = gen["tx"].wait_all([1], 60)[1]
        assert out.state is SessionState.DONE, out
        ctx_out = ctx.recv(60, op="outcome")
        assert ctx_out["state"] == SessionState.DONE.value, ctx_out

        expected = {key: t.clone() for key, t in tensors.items()}
        for t in expected.values():
            t.view(torch.uint8).fill_(SENTINEL)
        exp_conv = [c.clone() for c in gen["conv"]]
        exp_ssm = [s.clone() for s in gen["ssm"]]
        _fill({**expected, "conv": exp_conv, "ssm": exp_ssm}, _logical(seed), GEN_IDS, GEN_SLOT)
        for key in ("full", "swa"):
            assert torch.equal(tensors[key].view(torch.uint8), expected[key].view(torch.uint8)), key
        for li in range(len(MAMBA)):
            assert torch.equal(gen["conv"][li][GEN_SLOT], exp_conv[li][GEN_SLOT]), f"conv layer {MAMBA[li]}"
            assert torch.equal(gen["ssm"][li][GEN_SLOT], exp_ssm[li][GEN_SLOT]), f"ssm layer {MAMBA[li]}"
        # the window group's stale blocks were never asked for: the generation side gave only blocks 3..7
        assert len(GEN_IDS["swa"]) == TOTAL - STALE
    finally:
        if gen is not None:
            gen["tx"].close()
            gen["agent"].close()
        ctx.close(30.0)
