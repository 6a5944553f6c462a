"""The names renamed away from "layout" still work for one release, each with a warning naming its replacement.

kvcore itself uses only the new names; what is checked here is that an engine or plugin written against the old
ones keeps running (same result, a ``DeprecationWarning`` that says what to write instead) and that the wire still
carries the old keys, so peers of the previous release understand it.
"""

from __future__ import annotations

import importlib

import msgspec
import pytest

from kvcore.layout.builders import (
    allocate_kv_cache,
    allocate_mamba_state,
    build_kv_page_table,
    build_mamba_state,
)
from kvcore.layout.page import PageTable, PoolView, ViewSharding
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology

GEOM = dict(num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=2, dtype="float16")


def test_geometry_layout_keyword_is_block_order_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"AttentionGeometry\(layout=\.\.\.\) is deprecated; use block_order="):
        old = AttentionGeometry(**GEOM, layout="token_major")
    assert old == AttentionGeometry(**GEOM, block_order="token_major")
    with pytest.warns(DeprecationWarning, match=r"AttentionGeometry\.layout is deprecated; use .*\.block_order"):
        assert old.layout == "token_major"


def test_giving_both_the_old_and_the_new_keyword_is_refused() -> None:
    with pytest.raises(TypeError, match=r"both layout= \(deprecated\) and block_order="):
        AttentionGeometry(**GEOM, layout="token_major", block_order="head_major")
    topo = Topology.create(1, 1, 0, 2)
    geom = AttentionGeometry(**GEOM)
    with pytest.raises(TypeError, match=r"allocate_kv_cache\(\) got both layout="):
        allocate_kv_cache(topo, geom, 2, arrangement="head_major_pool", layout="head_major_pool")


def test_the_wire_keeps_the_key_layout() -> None:
    """A peer of the previous release reads ``layout`` in geometry and views; both directions decode."""
    geom = AttentionGeometry(**GEOM, block_order="token_major")
    topo = Topology.create(1, 1, 0, 2)
    table = build_kv_page_table(allocate_kv_cache(topo, geom, 2), topology=topo, geometry=geom)
    as_sent = msgspec.msgpack.decode(msgspec.msgpack.encode(geom))
    assert as_sent["layout"] == "token_major" and "block_order" not in as_sent
    view = msgspec.msgpack.decode(table.encode())["views"][0]
    assert view["layout"]["kind"] == "token_major_sharded" and "sharding" not in view
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(as_sent), type=AttentionGeometry) == geom
    assert PageTable.decode(table.encode()) == table


def test_pool_view_layout_keyword_and_attribute() -> None:
    sharding = ViewSharding(kind="head_major_sharded", unit_bytes=4)
    fields = dict(role="kv", mapper="m", layers=(0,), buffers_per_layer=1, buffer_bytes=8, pools=(0,), offsets=(0,))
    with pytest.warns(DeprecationWarning, match=r"PoolView\(layout=\.\.\.\) is deprecated; use sharding="):
        old = PoolView(**fields, layout=sharding)
    assert old == PoolView(**fields, sharding=sharding)
    with pytest.warns(DeprecationWarning, match=r"PoolView\.layout is deprecated; use PoolView\.sharding"):
        assert old.layout is sharding


def test_builder_layout_keywords_are_arrangement() -> None:
    topo = Topology.create(1, 1, 0, 2)
    geom = AttentionGeometry(**GEOM, block_order="token_major")
    with pytest.warns(DeprecationWarning, match=r"allocate_kv_cache\(layout=\.\.\.\) is deprecated; use arrangement="):
        kv = allocate_kv_cache(topo, geom, 3, layout="token_major_layers_kv_first")
    assert tuple(kv[0].shape) == (2, 3, 2, 2, 4)  # kv-first: the old keyword reached the allocator
    with pytest.warns(DeprecationWarning, match=r"build_kv_page_table\(layout=\.\.\.\)"):
        old = build_kv_page_table(kv, topology=topo, geometry=geom, layout="token_major_layers_kv_first")
    new = build_kv_page_table(kv, topology=topo, geometry=geom, arrangement="token_major_layers_kv_first")
    assert old == new and len(new.pools) == 4  # one pool per layer and K/V


def test_mamba_layout_keywords_are_arrangement() -> None:
    topo = Topology.create(1, 1, 0, 2)
    mg = MambaGeometry(
        layers=(0, 1), conv_sections=(4,), d_conv=3, nheads=2, head_dim=2, d_state=2, conv_dtype="float16",
        ssm_dtype="float32",
    )  # fmt: skip
    with pytest.warns(DeprecationWarning, match=r"allocate_mamba_state\(layout=\.\.\.\)"):
        conv, ssm = allocate_mamba_state(topo, mg, 3, layout="vllm")
    assert isinstance(conv, list)  # vLLM's arrangement: one tensor per layer
    with pytest.warns(DeprecationWarning, match=r"build_mamba_state\(layout=\.\.\.\)"):
        old = build_mamba_state(conv, ssm, topology=topo, geometry=mg, layout="vllm")
    assert old == build_mamba_state(conv, ssm, topology=topo, geometry=mg, arrangement="vllm")


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("kvcore.layout.page", "ViewLayout", "ViewSharding"),
        ("kvcore.layout.page", "LAYOUT_KINDS", "SHARDING_KINDS"),
        ("kvcore.layout.mapping", "RankLayout", "RankPlacement"),
        ("kvcore.layout.builders", "kv_view_layout", "kv_view_sharding"),
        ("kvcore.layout.builders", "MAMBA_LAYOUTS", "MAMBA_ARRANGEMENTS"),
    ],
)
def test_old_module_names_import_with_a_warning(module: str, old: str, new: str) -> None:
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated; use {module}\.{new}"):
        assert getattr(mod, old) is getattr(mod, new)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        _ = mod.NoSuchName


def test_transceiver_layout_is_placement_with_a_warning() -> None:
    from kvcore import TransceiverConfig, create_agent
    from kvcore.transceiver import Transceiver

    geom, topo = AttentionGeometry(**GEOM), Topology.create(1, 1, 0, 2)
    cfg = TransceiverConfig(backend="shm")
    agent = create_agent(cfg, "renamed-ctx")
    kv = allocate_kv_cache(topo, geom, 4, allocator=agent.allocate_tensor)
    table = build_kv_page_table(kv, topology=topo, geometry=geom)
    tx = Transceiver(cfg, role="context", agent=agent, topology=topo, geometry=geom, page_table=table)
    try:
        assert tx.placement.page_table == table and tx.placement == tx.rank_info.placement
        with pytest.warns(DeprecationWarning, match=r"Transceiver\.layout is deprecated; use Transceiver\.placement"):
            assert tx.layout is tx.placement
    finally:
        tx.close()
        agent.close()
