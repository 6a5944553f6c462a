"""Topology and geometry: rank ordering, uneven PP, attention DP, GQA heads per rank, validation."""

from __future__ import annotations

import msgspec
import pytest

from kvcore.errors import LayoutError, TopologyError
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology, require_no_cp


def test_create_rank_ordering_is_cp_minor():
    t = Topology.create(tp_size=2, pp_size=2, rank=3, num_layers=5)
    assert (t.pp_rank, t.tp_rank, t.cp_rank, t.rank, t.world_size) == (1, 1, 0, 3, 4)
    assert t.layers_per_pp == (3, 2) and t.layer_range == (3, 5)
    t = Topology.create(tp_size=2, pp_size=2, rank=6, num_layers=4, cp_size=2)
    assert (t.pp_rank, t.tp_rank, t.cp_rank) == (1, 1, 0)
    assert t.rank == 6 and t.rank_of(1, 1, 1) == 7
    for r in range(8):
        assert Topology.create(2, 2, r, 4, cp_size=2).rank == r


def test_uneven_layers_and_with_rank():
    t = Topology.create(1, 3, 0, 10, layers_per_pp=[2, 5, 3])
    assert [t.stage_range(p) for p in range(3)] == [(0, 2), (2, 7), (7, 10)]
    assert t.with_rank(2).layer_range == (7, 10) and t.with_rank(2).num_local_layers == 3
    with pytest.raises(TopologyError, match="sum of 10"):
        Topology.create(1, 3, 0, 10, layers_per_pp=[2, 5, 4])


def test_attention_dp_semantics():
    t = Topology.create(4, 1, 3, 8, attention_dp=True)
    assert (t.dp_size, t.dp_rank, t.tp_per_dp, t.attention_tp) == (4, 3, 1, (1, 0))
    t = Topology.create(4, 1, 3, 8)
    assert (t.dp_size, t.dp_rank, t.tp_per_dp, t.attention_tp) == (1, 0, 4, (4, 3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tp_size=2, tp_rank=2, pp_size=1, pp_rank=0, layers_per_pp=(4,)), "tp_rank"),
        (dict(tp_size=0, tp_rank=0, pp_size=1, pp_rank=0, layers_per_pp=(4,)), "tp_size"),
        (dict(tp_size=1, tp_rank=0, pp_size=2, pp_rank=0, layers_per_pp=(4,)), "2 entries"),
        (dict(tp_size=1, tp_rank=0, pp_size=2, pp_rank=0, layers_per_pp=(4, 0)), ">= 1 layer"),
    ],
)
def test_invalid_topologies(kwargs, match):
    with pytest.raises(TopologyError, match=match):
        Topology(**kwargs)


def test_msgpack_round_trip_and_decode_validation():
    t = Topology.create(2, 2, 1, 6, layers_per_pp=[4, 2], attention_dp=True)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(t), type=Topology) == t
    bad = msgspec.msgpack.encode({"tp_size": 2, "tp_rank": 5, "pp_size": 1, "pp_rank": 0, "layers_per_pp": [2]})
    with pytest.raises(msgspec.ValidationError, match="tp_rank"):
        msgspec.msgpack.decode(bad, type=Topology)
    assert hash(t) == hash(Topology.create(2, 2, 1, 6, layers_per_pp=(4, 2), attention_dp=True))


def test_require_no_cp():
    require_no_cp(Topology.create(2, 1, 0, 2))
    with pytest.raises(TopologyError, match="cp_size: expected 1"):
        require_no_cp(Topology.create(1, 1, 0, 2, cp_size=2), what="x")


def test_geometry_heads_per_rank_gqa_mla_adp():
    g = AttentionGeometry(num_layers=2, num_kv_heads=8, head_dim=128, tokens_per_block=32, dtype="bfloat16")
    assert g.element_bytes == 2 and g.head_bytes() == 32 * 128 * 2
    assert [g.kv_heads_per_rank(Topology.create(tp, 1, 0, 2)) for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]
    assert g.kv_heads_per_rank(Topology.create(4, 1, 1, 2, attention_dp=True)) == 8
    with pytest.raises(TopologyError, match="divisor or a multiple"):
        g.kv_heads_per_rank(Topology.create(3, 1, 0, 2))
    mla = AttentionGeometry(
        num_layers=2, num_kv_heads=1, head_dim=576, tokens_per_block=32, dtype="bfloat16", kv_factor=1
    )
    assert mla.is_mla and mla.kv_heads_per_rank(Topology.create(8, 1, 3, 2)) == 1


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", "float4", "dtype: expected one of"),
        ("dtype", 16, "dtype: expected a dtype name such as 'bfloat16' or a torch.dtype, got int 16"),
        ("dtype", None, "dtype: expected a dtype name"),
        ("kv_factor", 3, "kv_factor"),
        ("block_order", "sideways", "block_order"),
        ("head_dim", 0, "head_dim"),
    ],
)
def test_geometry_validation(field, value, match):
    kw = dict(num_layers=2, num_kv_heads=8, head_dim=128, tokens_per_block=32, dtype="bfloat16")
    kw[field] = value
    with pytest.raises(LayoutError, match=match):
        AttentionGeometry(**kw)


def test_geometry_takes_a_torch_dtype_and_keeps_its_name():
    """Engines hold ``torch.bfloat16``, not ``"bfloat16"``: both (and ``"torch.bfloat16"``) make the same geometry,
    which holds and sends the name; a torch dtype a KV cache cannot use is refused by name."""
    import msgspec
    import torch

    kw = dict(num_layers=2, num_kv_heads=8, head_dim=128, tokens_per_block=32)
    named = AttentionGeometry(**kw, dtype="bfloat16")
    for given in (torch.bfloat16, "torch.bfloat16"):
        g = AttentionGeometry(**kw, dtype=given)
        assert g == named and g.dtype == "bfloat16" and type(g.dtype) is str and g.element_bytes == 2
        assert msgspec.msgpack.encode(g) == msgspec.msgpack.encode(named)
    assert AttentionGeometry(**kw, dtype=torch.float8_e4m3fn).element_bytes == 1
    with pytest.raises(LayoutError, match=r"dtype: expected one of .* got torch.complex64"):
        AttentionGeometry(**kw, dtype=torch.complex64)
    mg = MambaGeometry(
        layers=(1,), conv_sections=(8,), d_conv=4, nheads=4, head_dim=2, d_state=3,
        conv_dtype=torch.float32, ssm_dtype="torch.float16",
    )  # fmt: skip
    assert (mg.conv_dtype, mg.ssm_dtype) == ("float32", "float16")
    with pytest.raises(LayoutError, match="ssm_dtype: expected a dtype name"):
        MambaGeometry(layers=(1,), conv_sections=(8,), d_conv=4, nheads=4, head_dim=2, d_state=3,
                      conv_dtype="float32", ssm_dtype=2)  # fmt: skip


def test_mamba_geometry_shares():
    mg = MambaGeometry(
        layers=(1, 3),
        conv_sections=(8, 4, 4),
        d_conv=4,
        nheads=4,
        head_dim=2,
        d_state=3,
        conv_dtype="float32",
        ssm_dtype="float16",
    )
    t = Topology.create(2, 2, 3, 4)  # pp 1: layers 2, 3
    assert mg.local_layers(t) == (3,)
    assert mg.conv_shape(t) == (8, 3) and mg.ssm_shape(t) == (2, 2, 3)
    assert mg.conv_section_bytes(t) == (4 * 3 * 4, 2 * 3 * 4, 2 * 3 * 4)
    with pytest.raises(TopologyError, match="multiple of the TP size 8"):
        mg.tp_shards(Topology.create(8, 1, 0, 4))
