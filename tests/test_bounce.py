"""The bounce path: pack/unpack primitives, leases, and end to end through a real context process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _instances import ticket_for

from kvcore.transport.bounce import Arena, gather, plan_digest, scatter, wants_bounce


def _fragments(rng: np.random.Generator, buf: torch.Tensor, n: int, unit: int) -> tuple[np.ndarray, np.ndarray]:
    slots = rng.permutation(buf.numel() // (4 * unit))[:n] * 4 * unit
    sizes = rng.integers(1, 4, n).astype(np.uint64) * unit
    return (buf.data_ptr() + slots).astype(np.uint64), sizes


@pytest.mark.parametrize("unit", [1, 64, 256])
def test_gather_then_scatter_moves_exactly_the_fragments(unit: int) -> None:
    rng = np.random.default_rng(unit)
    src = torch.from_numpy(rng.integers(0, 256, 1 << 20, dtype=np.uint8))
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    s_addr, sizes = _fragments(rng, src, 500, unit)
    d_addr, _ = _fragments(rng, dst, 500, unit)
    packed = torch.zeros(int(sizes.sum()), dtype=torch.uint8)
    gather(s_addr, sizes, packed.data_ptr())
    scatter(packed.data_ptr(), d_addr, sizes)
    # Independent expectation: byte-by-byte with Python slicing.
    want = np.zeros(1 << 20, dtype=np.uint8)
    s_np = src.numpy()
    pos = 0
    for sa, da, z in zip(s_addr - src.data_ptr(), d_addr - dst.data_ptr(), sizes):
        sa, da, z = int(sa), int(da), int(z)
        assert np.array_equal(packed.numpy()[pos : pos + z], s_np[sa : sa + z])
        want[da : da + z] = s_np[sa : sa + z]
        pos += z
    assert np.array_equal(dst.numpy(), want)


def test_arena_leases_are_disjoint_and_coalesce() -> None:
    a = Arena(4096, 8192)
    x, y = a.lease(1000), a.lease(3000)
    assert x is not None and y is not None and abs(x - y) >= 1000
    assert a.lease(8192) is None  # full: the caller falls back to direct fragments
    a.release(x)
    a.release(y)
    assert a.leased == 0 and a.lease(8192) == 0
    with pytest.raises(KeyError):
        a.release(12345)


def test_threshold_rule_and_digest() -> None:
    assert wants_bounce(256, 256 * 4096, min_fragments=256, max_fragment_bytes=4096)
    assert not wants_bounce(255, 255, min_fragments=256, max_fragment_bytes=4096)
    assert not wants_bounce(1000, 1000 * 8192, min_fragments=256, max_fragment_bytes=4096)
    d, s = np.arange(4, dtype=np.uint64), np.ones(4, np.uint64)
    assert plan_digest(d, s) == plan_digest(d.copy(), s.copy())
    assert plan_digest(d, s) != plan_digest(d[::-1].copy(), s)


def _pair(block_order: str, gen_tp: int, **cfg: object) -> tuple[list, list, list, list]:
    """A TP1 context rank and ``gen_tp`` generation ranks in this process (one-rank instances each)."""
    from kvcore.config import TransceiverConfig, create_agent
    from kvcore.layout.builders import allocate_kv_cache, build_page_table
    from kvcore.layout.topology import AttentionGeometry, Topology
    from kvcore.transceiver import Transceiver

    geo = AttentionGeometry(
        num_layers=2, num_kv_heads=4, head_dim=16, tokens_per_block=4, dtype="bfloat16", block_order=block_order
    )
    builder = "head_major_pool" if block_order == "head_major" else "token_major_layers"
    config = TransceiverConfig(backend="shm", request_timeout_s=20, bounce_buffer_bytes=1 << 20, **cfg)  # type: ignore[arg-type]
    agents, caches, txs, topos = [], [], [], []
    for role, tp, rank in [("context", 1, 0)] + [("generation", gen_tp, r) for r in range(gen_tp)]:
        topo = Topology.create(tp_size=tp, pp_size=1, rank=rank, num_layers=2)
        agent = create_agent(config, f"{role}{rank}")
        cache = allocate_kv_cache(topo, geo, 16, allocator=agent.allocate_tensor)
        table = build_page_table(builder, cache, topology=topo, geometry=geo)
        agents.append(agent)
        caches.append(cache)
        topos.append(topo)
        # Generation ranks of a TP>1 instance would agree through a collective; each is polled alone here.
        txs.append(
            Transceiver(
                config, role=role, agent=agent, topology=topo, geometry=geo, page_table=table, instance_name=role
            )
        )
    return agents, caches, txs, topos


@pytest.mark.parametrize("force", [True, False])
def test_token_major_head_mismatch_through_bounce_matches_direct(force: bool) -> None:
    """TP1 -> TP2 token-major: every byte lands the same with and without the bounce path; leases return."""
    cfg = {"bounce_min_fragments": 1, "bounce_max_fragment_bytes": 1 << 20} if force else {"bounce_enabled": False}
    agents, caches, txs, _ = _pair("token_major", 2, **cfg)
    ctx, gens = txs[0], txs[1:]
    try:
        for layer in caches[0]:
            layer.copy_(torch.randn(layer.shape).to(layer.dtype))
        ctx.start_send(1, [3, 5, 7], prompt_len=12, ticket=ticket_for(1))
        for g in gens:
            g.start_receive(1, ctx.info_endpoint, [0, 9, 2], prompt_len=12, ticket=ticket_for(1))
        for g in gens:
            assert g.wait_all([1], 20)[1].state.value == "DONE"
        assert ctx.wait_all([1], 20)[1].state.value == "DONE"
        for r, g in enumerate(gens):  # [blocks, kv, tokens, heads, dim]: generation rank r holds heads 2r, 2r+1
            for layer_src, layer_dst in zip(caches[0], caches[1 + r]):
                want = layer_src[[3, 5, 7]][..., 2 * r : 2 * r + 2, :]
                assert torch.equal(layer_dst[[0, 9, 2]], want)
            st = g.stats()
            assert st["bounce_leases"] == 0 and st["rx_sessions"] == 0
        assert ctx.stats()["staging_leases"] == 0
        bounced = ctx.stats()["bounced_writes_total"]
        if force:
            assert bounced == len(gens), "the bounce path was not taken"
            assert all(g.stats()["bounced_writes_total"] == 1 for g in gens), "a receiver did not unpack its lease"
        else:
            assert bounced == 0
    finally:
        for t in txs:
            t.close()
        for a in agents:
            a.close()
