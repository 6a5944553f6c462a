"""The mixers' mappers on golden examples (peers.md B6/B7), refusals, and registration through the entry point."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from kvcore_mixers.mappers import (
    HeadMajorShardMapper,
    ReplicatedMapper,
    SectionedMapper,
    TokenMajorShardMapper,
)

from kvcore.errors import IncompatiblePeerError, MappingError
from kvcore.extension.plugins import make_plugin_manager
from kvcore.layout.builders import allocate_kv_cache, build_kv_page_table
from kvcore.layout.mapping import RankPlacement, plan_transfer, validate_compatible
from kvcore.layout.page import PageTable, Pool, PoolView, ViewSharding
from kvcore.layout.peer import shard_position
from kvcore.layout.topology import AttentionGeometry, Topology
from kvcore.testing.oracle import Side, run_scenario


def view(kind, tp, rank, units, buffer_bytes, *, unit=1, rows=1, sections=(), state=False):
    n, i, r, j = shard_position(tp, rank, units)
    lay = ViewSharding(
        kind=kind, num_shards=n, shard_index=i, num_replicas=r, replica_index=j,
        unit_bytes=unit, rows=rows, section_bytes=sections,
    )  # fmt: skip
    return PoolView(
        role="r", mapper="m", layers=(0,), buffers_per_layer=1, buffer_bytes=buffer_bytes,
        pools=(0,), offsets=(0,), sharding=lay, tokens_per_slot=None if state else 4,
    )  # fmt: skip


def test_head_major_worked_example_and_gqa_duplication():
    bph = 100  # bytes of one head in one block
    # B6.3: self TP2 with 4 heads/rank (8 total) -> peer TP4 with 2: rank 0's fragment for peer 1 starts at head 2
    m = HeadMajorShardMapper()
    so, do, sz = m.buffer_fragments(
        view("head_major_sharded", 2, 0, 8, 4 * bph, unit=bph), view("head_major_sharded", 4, 1, 8, 2 * bph, unit=bph)
    )
    assert (so.tolist(), do.tolist(), sz.tolist()) == ([2 * bph], [0], [2 * bph])
    # 2 total heads, TP1 -> TP4: peer ranks need heads 0, 0, 1, 1 (the old formula got this wrong)
    heads = [
        m.buffer_fragments(
            view("head_major_sharded", 1, 0, 2, 2 * bph, unit=bph), view("head_major_sharded", 4, g, 2, bph, unit=bph)
        )[0][0]
        // bph
        for g in range(4)
    ]
    assert heads == [0, 0, 1, 1]
    # finer source lands at its own offset in the coarser destination
    so, do, sz = m.buffer_fragments(
        view("head_major_sharded", 4, 3, 8, 2 * bph, unit=bph), view("head_major_sharded", 2, 1, 8, 4 * bph, unit=bph)
    )
    assert (so.tolist(), do.tolist(), sz.tolist()) == ([0], [2 * bph], [2 * bph])


def test_token_major_one_fragment_per_token():
    row_s, row_d = 4 * 16, 2 * 16  # 4 heads vs 2 heads of 16 bytes per token
    so, do, sz = TokenMajorShardMapper().buffer_fragments(
        view("token_major_sharded", 2, 1, 8, 3 * row_s, unit=16, rows=3),
        view("token_major_sharded", 4, 3, 8, 3 * row_d, unit=16, rows=3),
    )
    assert so.tolist() == [row_d + t * row_s for t in range(3)]
    assert do.tolist() == [t * row_d for t in range(3)] and sz.tolist() == [row_d] * 3
    with pytest.raises(MappingError, match="rows"):
        TokenMajorShardMapper().buffer_fragments(
            view("token_major_sharded", 2, 1, 8, 3 * row_s, unit=16, rows=3),
            view("token_major_sharded", 4, 3, 8, 4 * row_d, unit=16, rows=4),
        )


def test_sectioned_each_section_resharded():
    # B7 conv: sections x|B|C of 8|4|4 bytes at TP1 -> 4|2|2 at TP2 (rank 1)
    so, do, sz = SectionedMapper().buffer_fragments(
        view("sectioned", 1, 0, 1, 16, sections=(8, 4, 4), state=True),
        view("sectioned", 2, 1, 2, 8, sections=(4, 2, 2), state=True),
    )
    assert (so.tolist(), do.tolist(), sz.tolist()) == ([4, 10, 14], [0, 4, 6], [4, 2, 2])


def test_sharding_kind_mismatch_is_refused():
    with pytest.raises(MappingError, match="expected sharding kind 'head_major_sharded'"):
        HeadMajorShardMapper().buffer_fragments(
            view("token_major_sharded", 1, 0, 1, 16, unit=4, rows=4),
            view("token_major_sharded", 1, 0, 1, 16, unit=4, rows=4),
        )


def _state_placement(tp, rank):
    """A rank holding one replicated (pre-scaled) state view, one slot per request."""
    topo = Topology.create(tp, 1, rank, 1)
    geom = AttentionGeometry(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4, dtype="float16", kv_factor=1)
    buf = np.zeros(64, np.uint8)
    n, i, r, j = shard_position(tp, rank, None)
    v = PoolView(
        role="kda_state", mapper="replicated", layers=(0,), buffers_per_layer=1, buffer_bytes=32, pools=(0,), offsets=(0,),
        sharding=ViewSharding(kind="replicated", num_shards=n, shard_index=i, num_replicas=r, replica_index=j),
    )  # fmt: skip
    table = PageTable(pools=(Pool(base=buf.ctypes.data, slot_bytes=32, slot_stride=32, num_slots=2),), views=(v,))
    return buf, RankPlacement(topology=topo, geometry=geom, page_table=table)


def test_replicated_state_under_different_tp_is_refused():
    _, ctx = _state_placement(2, 0)
    _, gen = _state_placement(4, 0)
    with pytest.raises(IncompatiblePeerError, match="replicated state"):
        plan_transfer(ctx, gen, [], [], src_state_slot=0, dst_state_slot=1)
    with pytest.raises(IncompatiblePeerError, match="replicated state cannot move"):
        validate_compatible(ctx, gen)
    # same TP group: fine, one slot copied whole
    cbuf, ctx2 = _state_placement(4, 1)
    plan = plan_transfer(ctx2, _state_placement(4, 1)[1], [], [], src_state_slot=0, dst_state_slot=1)
    assert plan.sizes.tolist() == [32] and plan.src[0] == cbuf.ctypes.data


def test_replicated_mla_one_sender_per_destination():
    mla = AttentionGeometry(num_layers=2, num_kv_heads=1, head_dim=16, tokens_per_block=4, dtype="float16", kv_factor=1)
    out = run_scenario(Side(8), Side(2), mla, prompt_len=13)
    assert out.nonempty == 2 and out.pairs == 8  # each gen rank contacts 4 replicas, one writes
    out = run_scenario(Side(2), Side(8), mla, prompt_len=13)
    assert out.nonempty == out.pairs == 8


def test_replicated_requires_equal_buffers():
    with pytest.raises(MappingError, match="equal replicated buffers"):
        ReplicatedMapper().buffer_fragments(view("replicated", 2, 0, None, 16), view("replicated", 4, 0, None, 32))


@pytest.mark.entrypoints
def test_registered_through_the_entry_point():
    pm = make_plugin_manager()
    rec = pm.record("mixers")
    assert rec is not None and rec.status == "loaded", rec
    for kind in ("head_mismatch_head_major", "head_mismatch_token_major", "replicated", "mamba_conv", "mamba_ssm"):
        assert pm.layout_mappers.entry(kind).plugin == "mixers"
    # and the default registry used by plan_transfer finds them
    topo_c, topo_g = Topology.create(1, 1, 0, 2), Topology.create(2, 1, 1, 2)
    geom = AttentionGeometry(num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=2, dtype="float16")
    kc, kg = allocate_kv_cache(topo_c, geom, 2), allocate_kv_cache(topo_g, geom, 2)
    c = RankPlacement(
        topology=topo_c, geometry=geom, page_table=build_kv_page_table(kc, topology=topo_c, geometry=geom)
    )
    g = RankPlacement(
        topology=topo_g, geometry=geom, page_table=build_kv_page_table(kg, topology=topo_g, geometry=geom)
    )
    plan = plan_transfer(c, g, [0], [1], mappers=pm.layout_mappers)
    assert plan.count == 4 and set(plan.sizes.tolist()) == {16}
    assert msgspec.structs.asdict(g.page_table.views[0].sharding)["num_shards"] == 2
