"""Plan-build time for a Llama-3-8B-like request (32 layers, 8 KV heads, head_dim 128, 32 tokens/block, 4096 tokens).

Planning touches no KV memory, so the caches live on torch's ``meta`` device.
The bound is generous (a regression to per-fragment Python loops is ~100x slower);
measured on a 2-core CPU box: ~0.2 ms matching heads, ~0.2 ms TP2->TP4
head-major, ~2 ms TP2->TP4 token-major (262,144 fragments).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvcore.extension.plugins import make_plugin_manager
from kvcore.layout.builders import allocate_kv_cache, build_kv_page_table
from kvcore.layout.mapping import RankPlacement, plan_transfer
from kvcore.layout.peer import peer_ranks
from kvcore.layout.topology import AttentionGeometry, Topology

BLOCKS = 128  # 4096 tokens / 32


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _placement(tp: int, rank: int, geom: AttentionGeometry, arrangement: str) -> RankPlacement:
    topo = Topology.create(tp, 1, rank, geom.num_layers)
    kv = allocate_kv_cache(topo, geom, BLOCKS + 32, arrangement=arrangement, allocator=_meta)
    return RankPlacement(
        topology=topo,
        geometry=geom,
        page_table=build_kv_page_table(kv, topology=topo, geometry=geom, arrangement=arrangement),
    )


@pytest.mark.parametrize(
    ("ctx_tp", "gen_tp", "block_order", "fragments"),
    [
        (2, 2, "head_major", 128),
        (2, 4, "head_major", 128 * 32 * 2),
        (2, 4, "token_major", 128 * 32 * 2 * 32),
        (4, 2, "token_major", 128 * 32 * 2 * 32),
    ],
)
def test_llama3_8b_plan_build_time(ctx_tp, gen_tp, block_order, fragments):
    geom = AttentionGeometry(
        num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=32, dtype="bfloat16", block_order=block_order
    )
    tensors = "head_major_pool" if block_order == "head_major" else "token_major_layers"
    gen = _placement(gen_tp, 1, geom, tensors)
    src_rank = peer_ranks(gen.topology, Topology.create(ctx_tp, 1, 0, 32))[-1]
    ctx = _placement(ctx_tp, src_rank, geom, tensors)
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(BLOCKS + 32)[:BLOCKS], rng.permutation(BLOCKS + 32)[:BLOCKS]
    mappers = make_plugin_manager().layout_mappers
    plan = plan_transfer(ctx, gen, src, dst, mappers=mappers, prompt_len=4096)
    assert plan.count == fragments
    assert plan.nbytes == 32 * 2 * 4096 * 128 * 2 * 8 // max(ctx_tp, gen_tp)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        plan_transfer(ctx, gen, src, dst, mappers=mappers, prompt_len=4096)
        times.append(time.perf_counter() - t0)
    # Reported, not asserted: speed is measured by `kvcore bench`, never as a wall-clock limit in tests.
    print(f"\nplan {ctx_tp}->{gen_tp} {block_order}: {plan.count} fragments in {min(times) * 1e3:.2f} ms (best of 5)")
