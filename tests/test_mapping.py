"""Fragment plans end to end on real memory: homogeneous pairs, prefix cache, SWA, errors."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.errors import IncompatiblePeerError, MappingError, PoolMismatchError, TopologyError
from kvcore.extension.plugins import make_plugin_manager
from kvcore.layout.builders import allocate_kv_cache, build_kv_page_table
from kvcore.layout.mapping import FragmentPlan, RankPlacement, align_blocks, plan_transfer, validate_compatible
from kvcore.layout.page import PageTable
from kvcore.layout.topology import AttentionGeometry, Topology
from kvcore.testing.oracle import Side, run_scenario

HM = AttentionGeometry(num_layers=4, num_kv_heads=4, head_dim=8, tokens_per_block=4, dtype="float16")
TM = AttentionGeometry(
    num_layers=4, num_kv_heads=4, head_dim=8, tokens_per_block=4, dtype="float16", block_order="token_major"
)


@pytest.fixture(scope="module")
def core_mappers():
    """Only the core's built-in mappers: homogeneous pairs must not need any plugin."""
    return make_plugin_manager(load_entry_points=False).layout_mappers


@pytest.mark.parametrize(
    ("ctx", "gen", "geom"),
    [
        (Side(2), Side(2), HM),
        (Side(1, 2), Side(1, 2), HM),
        (Side(1, 2, [1, 3]), Side(1, 2, [3, 1]), HM),
        (Side(2, 2), Side(2, 1), HM),
        (Side(1, 1), Side(1, 4), HM),
        (Side(2, arrangement="token_major_layers"), Side(2, arrangement="token_major_layers"), TM),
        (Side(2, arrangement="token_major_layers"), Side(2, arrangement="token_major_layers_kv_first"), TM),
        (
            Side(1, 2, arrangement="token_major_layers_kv_first"),
            Side(1, 2, [3, 1], arrangement="token_major_layers"),
            TM,
        ),
    ],
    ids=str,
)
@pytest.mark.parametrize("cached", [0, 3])
def test_homogeneous_bytes_land_exactly_once(ctx, gen, geom, cached, core_mappers):
    out = run_scenario(ctx, gen, geom, prompt_len=30, gen_cached_blocks=cached, mappers=core_mappers)
    assert out.nonempty == out.pairs


def test_matching_heads_merges_whole_slots_and_contiguous_blocks(core_mappers):
    topo = Topology.create(1, 1, 0, 4)
    kv = allocate_kv_cache(topo, HM, 8)
    lay = RankPlacement(topology=topo, geometry=HM, page_table=build_kv_page_table(kv, topology=topo, geometry=HM))
    slot = kv[0].numel() * kv.element_size()
    plan = plan_transfer(lay, lay, [1, 2, 3, 6], [4, 5, 6, 0], mappers=core_mappers)
    # blocks 1,2,3 -> 4,5,6 are contiguous on both sides: one fragment, then 6 -> 0
    assert plan.sizes.tolist() == [3 * slot, slot]
    assert plan.src[0] == kv.data_ptr() + slot and plan.dst[0] == kv.data_ptr() + 4 * slot


def test_partial_layer_overlap_under_pp_merges_contiguous_layers(core_mappers):
    ctx = Topology.create(1, 1, 0, 4)
    gen = Topology.create(1, 2, 1, 4, [1, 3])  # layers 1..3
    ckv, gkv = allocate_kv_cache(ctx, HM, 4), allocate_kv_cache(gen, HM, 4)
    cl = RankPlacement(topology=ctx, geometry=HM, page_table=build_kv_page_table(ckv, topology=ctx, geometry=HM))
    gl = RankPlacement(topology=gen, geometry=HM, page_table=build_kv_page_table(gkv, topology=gen, geometry=HM))
    plan = plan_transfer(cl, gl, [0, 1], [2, 3], mappers=core_mappers)
    layer = 2 * HM.buffer_bytes(ctx)
    assert plan.sizes.tolist() == [3 * layer, 3 * layer]
    assert plan.src.tolist() == [ckv.data_ptr() + layer, ckv.data_ptr() + 5 * layer]
    assert plan.dst.tolist() == [gkv.data_ptr() + 2 * 3 * layer, gkv.data_ptr() + 3 * 3 * layer]


def test_sliding_window_skips_stale_blocks(core_mappers):
    run_scenario(Side(2), Side(2), HM, prompt_len=30, window=9, mappers=core_mappers)
    run_scenario(Side(1, 2), Side(1, 1), HM, prompt_len=17, window=100, gen_cached_blocks=2, mappers=core_mappers)


def test_align_blocks_suffix_and_window():
    s, d = align_blocks(np.arange(8), np.arange(10, 15), 4, prompt_len=30, cached_tokens=12)
    assert s.tolist() == [3, 4, 5, 6, 7] and d.tolist() == [10, 11, 12, 13, 14]
    # window 9 at prompt 30: stale_end = (31-9)//4 = 5
    s, d = align_blocks(np.arange(8), np.arange(10, 15), 4, prompt_len=30, window=9)
    assert s.tolist() == [5, 6, 7] and d.tolist() == [12, 13, 14]
    s, d = align_blocks(np.arange(8), np.arange(10, 10), 4, prompt_len=30, cached_tokens=30)
    assert len(s) == len(d) == 0
    with pytest.raises(MappingError, match="5 blocks do not cover the request: prompt_len 30 minus cached_tokens 0"):
        align_blocks(np.arange(8), np.arange(10, 15), 4, prompt_len=30)
    with pytest.raises(MappingError, match="at most 8 blocks"):
        align_blocks(np.arange(9), np.arange(3), 4, prompt_len=30)
    with pytest.raises(MappingError, match="prompt_len"):
        align_blocks(np.arange(8), np.arange(3), 4, window=4)


def _placement(topo, geom, blocks=4, **kw):
    kv = allocate_kv_cache(topo, geom, blocks, **kw)
    return kv, RankPlacement(
        topology=topo, geometry=geom, page_table=build_kv_page_table(kv, topology=topo, geometry=geom, **kw)
    )


def test_validate_compatible_lists_every_difference():
    t = Topology.create(1, 1, 0, 4)
    _, a = _placement(t, HM)
    other = AttentionGeometry(num_layers=4, num_kv_heads=4, head_dim=16, tokens_per_block=8, dtype="bfloat16")
    _, b = _placement(t, other)
    with pytest.raises(IncompatiblePeerError) as exc:
        validate_compatible(a, b)
    msg = str(exc.value)
    for field in ("head_dim: context 8, generation 16", "tokens_per_block", "dtype: context 'float16'", "unit_bytes"):
        assert field in msg
    validate_compatible(a, a)


def test_validate_compatible_refuses_block_order_and_cp():
    t = Topology.create(1, 1, 0, 4)
    _, a = _placement(t, HM)
    _, b = _placement(t, TM)
    with pytest.raises(IncompatiblePeerError, match="block_order: context 'head_major', generation 'token_major'"):
        validate_compatible(a, b)
    cp = Topology.create(1, 1, 1, 4, cp_size=2)
    with pytest.raises(IncompatiblePeerError, match="cp_size: expected 1"):
        validate_compatible(a, RankPlacement(topology=cp, geometry=HM, page_table=a.page_table))
    with pytest.raises(TopologyError, match="context parallelism"):
        plan_transfer(a, RankPlacement(topology=cp, geometry=HM, page_table=a.page_table), [0], [0])


def test_role_and_mapper_mismatch_raise_naming_both_sides(core_mappers):
    t = Topology.create(1, 1, 0, 4)
    _, a = _placement(t, HM)
    view = a.page_table.views[0]
    import msgspec

    renamed = PageTable(pools=a.page_table.pools, views=(msgspec.structs.replace(view, role="mla"),))
    b = RankPlacement(topology=t, geometry=HM, page_table=renamed)
    with pytest.raises(PoolMismatchError, match="role 'kv' only on source"):
        plan_transfer(a, b, [0], [0], mappers=core_mappers)
    remapped = PageTable(pools=a.page_table.pools, views=(msgspec.structs.replace(view, mapper="other"),))
    c = RankPlacement(topology=t, geometry=HM, page_table=remapped)
    with pytest.raises(PoolMismatchError, match="source 'head_mismatch_head_major', destination 'other'"):
        plan_transfer(a, c, [0], [0], mappers=core_mappers)
    with pytest.raises(IncompatiblePeerError, match="mapper kind"):
        validate_compatible(a, c)


def test_missing_mapper_names_the_kind_and_where_to_look(core_mappers):
    """The core names no plugin: the error names the missing kind and points at 'kvcore plugins'."""
    ctx, gen = Topology.create(1, 1, 0, 4), Topology.create(2, 1, 1, 4)
    _, a = _placement(ctx, HM)
    _, b = _placement(gen, HM)
    with pytest.raises(MappingError, match=r"head_mismatch_head_major(.|\n)*run 'kvcore plugins'"):
        plan_transfer(a, b, [0], [0], mappers=core_mappers)


def test_non_peer_pair_is_refused():
    _, a = _placement(Topology.create(1, 2, 0, 4), HM)
    _, b = _placement(Topology.create(1, 2, 1, 4), HM)
    with pytest.raises(TopologyError, match="not a peer"):
        plan_transfer(a, b, [0], [0])


def test_layer_range_restricts_layers(core_mappers):
    t = Topology.create(1, 1, 0, 4)
    kv, a = _placement(t, HM)
    plan = plan_transfer(a, a, [0], [1], mappers=core_mappers, layer_range=(1, 3))
    layer = 2 * HM.buffer_bytes(t)
    assert plan.sizes.tolist() == [2 * layer]
    assert plan.src[0] == kv.data_ptr() + layer


def test_fragment_plan_merge_and_concat():
    p = FragmentPlan(np.array([0, 10, 20, 50]), np.array([100, 110, 125, 135]), np.array([10, 10, 10, 5]))
    m = p.merge_contiguous()
    assert (m.src.tolist(), m.dst.tolist(), m.sizes.tolist()) == ([0, 20, 50], [100, 125, 135], [20, 10, 5])
    assert m.nbytes == p.nbytes == 35 and m.count == len(m) == 3
    c = FragmentPlan.concat([p, FragmentPlan.empty(), m])
    assert c.count == 7 and c.src.dtype == np.uint64
    assert FragmentPlan.concat([]).count == 0
    with pytest.raises(MappingError, match="equal lengths"):
        FragmentPlan(np.zeros(2), np.zeros(3), np.zeros(2))


def test_invalid_block_ids_are_named(core_mappers):
    from kvcore.errors import LayoutError

    t = Topology.create(1, 1, 0, 4)
    _, a = _placement(t, HM)
    with pytest.raises(LayoutError, match=r"got \[7\]"):
        plan_transfer(a, a, [0, 7], [1, 2], mappers=core_mappers)
    with pytest.raises(LayoutError, match=r"got \[-1\]"):
        plan_transfer(a, a, [0, 1], [1, -1], mappers=core_mappers)


def test_view_window_overrides_and_skips_stale_blocks(core_mappers):
    t = Topology.create(1, 1, 0, 4)
    kv = allocate_kv_cache(t, HM, 8)
    from kvcore.layout.builders import build_head_major_pool

    lay = RankPlacement(
        topology=t, geometry=HM, page_table=build_head_major_pool(kv, topology=t, geometry=HM, window=5)
    )
    slot = kv[0].numel() * kv.element_size()
    # prompt 16 tokens, 4 blocks: window 5 -> stale_end = (17-5)//4 = 3, only block 3 moves
    plan = plan_transfer(lay, lay, [0, 1, 2, 3], [4, 5, 6, 7], mappers=core_mappers, prompt_len=16)
    assert plan.src.tolist() == [kv.data_ptr() + 3 * slot] and plan.dst.tolist() == [kv.data_ptr() + 7 * slot]
    with pytest.raises(MappingError, match="prompt_len"):
        plan_transfer(lay, lay, [0], [4], mappers=core_mappers)
