"""Page tables: addresses, regions, validation, bounds, msgpack, builders' shape checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcore.errors import LayoutError
from kvcore.extension.plugins import make_plugin_manager
from kvcore.layout.builders import (
    allocate_kv_cache,
    build_head_major_pool,
    build_kv_page_table,
    build_page_table,
    build_token_major_layers,
)
from kvcore.layout.page import PageTable, Pool, PoolView, ViewSharding
from kvcore.layout.topology import AttentionGeometry, Topology

HM = AttentionGeometry(num_layers=4, num_kv_heads=4, head_dim=8, tokens_per_block=4, dtype="float16")
TM = AttentionGeometry(
    num_layers=4, num_kv_heads=4, head_dim=8, tokens_per_block=4, dtype="float16", block_order="token_major"
)


def test_pool_addresses_and_invalid_ids():
    p = Pool(base=1000, slot_bytes=10, slot_stride=16, num_slots=4)
    assert p.slot_addresses(np.array([0, 3, 1])).tolist() == [1000, 1048, 1016]
    assert p.nbytes == 58
    with pytest.raises(LayoutError, match=r"0 <= id < 4 \(num_slots\), got \[-1, 4\]"):
        p.slot_addresses([0, -1, 4])
    with pytest.raises(LayoutError, match="integers"):
        p.slot_addresses(np.array([0.5]))
    with pytest.raises(LayoutError, match="slot_stride"):
        Pool(base=0, slot_bytes=10, slot_stride=8, num_slots=2)


def test_head_major_pool_table():
    t = Topology.create(2, 2, 3, 4)  # tp rank 1, layers 2,3
    kv = allocate_kv_cache(t, HM, 5)
    assert tuple(kv.shape) == (5, 2, 2, 2, 4, 8)
    pt = build_head_major_pool(kv, topology=t, geometry=HM)
    (view,) = pt.views
    buf = 2 * 4 * 8 * 2
    assert view.role == "kv" and view.mapper == "head_mismatch_head_major" and view.layers == (2, 3)
    assert view.offsets == (0, buf, 2 * buf, 3 * buf) and view.buffer_bytes == buf
    lay = view.sharding
    assert (lay.kind, lay.num_shards, lay.shard_index, lay.unit_bytes) == ("head_major_sharded", 2, 1, 4 * 8 * 2)
    assert pt.block_addresses(0, [2]).tolist() == [kv.data_ptr() + 2 * 4 * buf]
    assert pt.regions() == [(kv.data_ptr(), kv.numel() * 2)]
    assert pt.entry_addresses(0, np.array([1, 3]), np.array([0, 1])).tolist() == [
        [kv.data_ptr() + buf, kv.data_ptr() + 5 * buf],
        [kv.data_ptr() + 3 * buf, kv.data_ptr() + 7 * buf],
    ]
    assert PageTable.decode(pt.encode()) == pt


@pytest.mark.parametrize("kv_first", [True, False])
def test_token_major_layers_table(kv_first):
    t = Topology.create(1, 1, 0, 4)
    kv = allocate_kv_cache(t, TM, 3, arrangement="token_major_layers_kv_first" if kv_first else "token_major_layers")
    pt = build_token_major_layers(kv, topology=t, geometry=TM)  # order detected from the shape
    (view,) = pt.views
    buf = 4 * 4 * 8 * 2
    assert view.mapper == "head_mismatch_token_major" and view.sharding.rows == 4 and view.sharding.unit_bytes == 16
    assert len(pt.pools) == (8 if kv_first else 4)
    v_addr = pt.entry_addresses(0, np.array([1]), np.array([2]))[0, 0]
    expected = kv[0][1, 2].data_ptr() if kv_first else kv[0][2, 1].data_ptr()
    assert v_addr == expected and view.buffer_bytes == buf
    # adjacent ranges are not merged (they may be separate allocations); overlapping ones are
    assert len(pt.regions()) == len(pt.pools) and sum(n for _, n in pt.regions()) == 4 * 3 * 2 * buf
    overlapping = PageTable(
        pools=(
            Pool(base=0, slot_bytes=8, slot_stride=8, num_slots=2),
            Pool(base=8, slot_bytes=16, slot_stride=16, num_slots=1),
            Pool(base=24, slot_bytes=1, slot_stride=1, num_slots=1),
        ),
        views=(),
    )
    assert overlapping.regions() == [(0, 24), (24, 1)]


def test_builder_shape_errors_name_expected_and_actual():
    t = Topology.create(2, 1, 0, 4)
    with pytest.raises(LayoutError, match=r"expected shape \[3, 4, 2, 2, 4, 8\], got \[3, 4, 2, 4, 4, 8\]"):
        build_head_major_pool(torch.zeros(3, 4, 2, 4, 4, 8, dtype=torch.float16), topology=t, geometry=HM)
    with pytest.raises(LayoutError, match="6 dims"):
        build_head_major_pool(torch.zeros(3, 4, 2, 2, 32, dtype=torch.float16), topology=t, geometry=HM)
    with pytest.raises(LayoutError, match="expected dtype float16, got float32"):
        build_head_major_pool(torch.zeros(3, 4, 2, 2, 4, 8), topology=t, geometry=HM)
    nc = torch.zeros(4, 3, 2, 2, 4, 8, dtype=torch.float16).transpose(0, 1)
    with pytest.raises(LayoutError, match="contiguous"):
        build_head_major_pool(nc, topology=t, geometry=HM)
    with pytest.raises(LayoutError, match="fits both orders"):
        build_token_major_layers([torch.zeros(2, 2, 4, 2, 8, dtype=torch.float16)] * 4, topology=t, geometry=TM)
    with pytest.raises(LayoutError, match="expected 4 tensors"):
        build_token_major_layers([], topology=t, geometry=TM)
    with pytest.raises(LayoutError, match="'token_major'"):
        build_token_major_layers([], topology=t, geometry=HM)


def test_build_page_table_through_registry():
    pm = make_plugin_manager(load_entry_points=False)
    t = Topology.create(1, 1, 0, 4)
    kv = allocate_kv_cache(t, HM, 2)
    assert build_page_table("head_major_pool", kv, topology=t, geometry=HM, pm=pm) == build_kv_page_table(
        kv, topology=t, geometry=HM
    )


def test_custom_allocator_is_used():
    calls = []

    def alloc(shape, dtype):
        calls.append((shape, dtype))
        return torch.zeros(shape, dtype=dtype)

    t = Topology.create(2, 1, 0, 4)
    allocate_kv_cache(t, TM, 3, arrangement="token_major_layers", allocator=alloc)
    assert calls == [((3, 2, 4, 2, 8), torch.float16)] * 4
    with pytest.raises(LayoutError, match=r"expected geometry\.block_order"):
        allocate_kv_cache(t, TM, 3, arrangement="head_major_pool")


def test_view_and_table_validation():
    lay = ViewSharding(kind="head_major_sharded", unit_bytes=4)
    pool = Pool(base=0, slot_bytes=16, slot_stride=16, num_slots=2)
    good = dict(
        role="kv",
        mapper="m",
        layers=(0,),
        buffers_per_layer=2,
        buffer_bytes=8,
        pools=(0, 0),
        offsets=(0, 8),
        sharding=lay,
    )
    PageTable(pools=(pool,), views=(PoolView(**good),))
    with pytest.raises(LayoutError, match="inside slot_bytes 16"):
        PageTable(pools=(pool,), views=(PoolView(**{**good, "offsets": (0, 12)}),))
    with pytest.raises(LayoutError, match="expected 2 pools and offsets"):
        PoolView(**{**good, "pools": (0,)})
    with pytest.raises(LayoutError, match="multiple of unit_bytes"):
        PoolView(**{**good, "buffer_bytes": 6, "offsets": (0, 6)})
    with pytest.raises(LayoutError, match="in one view"):
        PageTable(pools=(pool,), views=(PoolView(**good), PoolView(**good)))
    with pytest.raises(LayoutError, match="sharding kind"):
        ViewSharding(kind="diagonal")
    with pytest.raises(LayoutError, match="num_shards: expected 1"):
        ViewSharding(kind="replicated", num_shards=2)


def test_decode_is_bounded_and_typed():
    with pytest.raises(LayoutError, match="at most 10 bytes"):
        PageTable.decode(b"x" * 11, max_bytes=10)
    with pytest.raises(LayoutError, match="could not decode"):
        PageTable.decode(b"\x93\x01")


def test_mamba_state_builder_through_registry():
    from kvcore.layout.builders import allocate_mamba_state
    from kvcore.layout.topology import MambaGeometry

    mg = MambaGeometry(
        layers=(0, 2, 3), conv_sections=(8, 4, 4), d_conv=4, nheads=4, head_dim=2, d_state=3,
        conv_dtype="float32", ssm_dtype="float16",
    )  # fmt: skip
    t = Topology.create(2, 2, 2, 4)  # tp rank 0, layers 2..3
    conv, ssm = allocate_mamba_state(t, mg, 5)
    pt = build_page_table(
        "mamba_state", conv, ssm, topology=t, geometry=mg, pm=make_plugin_manager(load_entry_points=False)
    )
    cv, sv = pt.views
    assert (cv.role, cv.mapper, cv.layers, cv.is_state) == ("mamba_conv", "mamba_conv", (2, 3), True)
    assert cv.sharding.section_bytes == (4 * 3 * 4, 2 * 3 * 4, 2 * 3 * 4) and cv.buffer_bytes == 8 * 3 * 4
    assert (sv.role, sv.sharding.unit_bytes, sv.buffer_bytes) == ("mamba_ssm", 2 * 3 * 2, 2 * 2 * 3 * 2)
    assert pt.entry_addresses(1, np.array([1]), np.array([4]))[0, 0] == ssm[1, 4].data_ptr()
    assert pt.entry_addresses(0, np.array([0]), np.array([3]))[0, 0] == conv[0, 3].data_ptr()
