"""Hybrid models (Mamba2 + attention): attention-only KV, n_groups sharding, vLLM's state arrangement, PP stages.

The expectation is computed independently of kvcore's mappers: the request's
logical KV and state are random bytes, each rank's tensors are filled by plain
numpy indexing (which heads / channels a TP rank holds is written out from
vLLM's weight loader, ``mamba_v2_sharded_weight_loader``), plans run as memcpy on
the tensors' real memory, and every destination byte is compared and
write-counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvcore.errors import IncompatiblePeerError, LayoutError, TopologyError
from kvcore.layout.blocks import normalize_block_ids, normalize_state_slot
from kvcore.layout.builders import (
    allocate_kv_cache,
    allocate_mamba_state,
    build_kv_page_table,
    build_mamba_state,
    build_page_table,
)
from kvcore.layout.mapping import RankPlacement, plan_transfer, validate_compatible
from kvcore.layout.page import PageTable
from kvcore.layout.peer import peer_ranks
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology
from kvcore.testing.oracle import Memory

SENTINEL = 0x5A
D_STATE = 3


def mamba_geometry(layers: tuple[int, ...], n_groups: int, nheads: int = 8, head_dim: int = 2) -> MambaGeometry:
    d_inner = nheads * head_dim
    return MambaGeometry(
        layers=layers,
        conv_sections=(d_inner, n_groups * D_STATE, n_groups * D_STATE),
        d_conv=4,
        nheads=nheads,
        head_dim=head_dim,
        d_state=D_STATE,
        conv_dtype="float16",
        ssm_dtype="float32",
        n_groups=n_groups,
    )


# --- the oracle: which channels and heads a rank holds, from the model definition --------------


def vllm_loader_channels(tp: int, rank: int, d_inner: int, n_groups: int) -> list[int]:
    """Global conv channels (x|B|C) TP rank ``rank`` holds, as vLLM's ``mamba_v2_sharded_weight_loader`` slices them.

    vLLM widens the groups by ``extra_groups_for_head_shards`` (``tp - n_groups``
    unless ``n_groups % tp == 0``) and, for ``n_groups == 1``, has every rank read
    group 0. It accepts only ``n_groups == 1`` or ``n_groups % tp == 0``.
    """
    assert n_groups == 1 or n_groups % tp == 0
    extra = 0 if n_groups % tp == 0 else tp - n_groups
    bc_full = (n_groups + extra) * D_STATE
    spec = [(d_inner, 0, False), (bc_full, extra * D_STATE, n_groups == 1), (bc_full, extra * D_STATE, n_groups == 1)]
    out: list[int] = []
    loaded_boundary = 0
    for full_dim, extra_dims, duplicate in spec:
        shard = full_dim // tp
        skip = (0 if duplicate else rank) * shard
        take = min(shard, full_dim - extra_dims - skip)
        out.extend(range(loaded_boundary + skip, loaded_boundary + skip + take))
        loaded_boundary += full_dim - extra_dims
    return out


def head_group_channels(tp: int, rank: int, d_inner: int, n_groups: int, nheads: int) -> list[int]:
    """Conv channels by the model's definition: x of the rank's heads, B and C of the group those heads use."""
    heads = list(range(rank * nheads // tp, (rank + 1) * nheads // tp))
    head_dim = d_inner // nheads
    x = [h * head_dim + i for h in heads for i in range(head_dim)]
    groups = sorted({h // (nheads // n_groups) for h in heads})
    b = [d_inner + g * D_STATE + i for g in groups for i in range(D_STATE)]
    c = [d_inner + n_groups * D_STATE + g * D_STATE + i for g in groups for i in range(D_STATE)]
    return x + b + c


def rank_conv_channels(topo: Topology, mg: MambaGeometry) -> list[int]:
    tp, rank = topo.attention_tp
    d_inner = mg.conv_sections[0]
    if mg.n_groups == 1 or mg.n_groups % tp == 0:
        chans = vllm_loader_channels(tp, rank, d_inner, mg.n_groups)
        # the model's definition agrees wherever vLLM accepts the configuration
        assert chans == head_group_channels(tp, rank, d_inner, mg.n_groups, mg.nheads)
        return chans
    return head_group_channels(tp, rank, d_inner, mg.n_groups, mg.nheads)


def rank_ssm_heads(topo: Topology, mg: MambaGeometry) -> list[int]:
    tp, rank = topo.attention_tp
    return list(range(rank * mg.nheads // tp, (rank + 1) * mg.nheads // tp))


def rank_kv_heads(topo: Topology, geom: AttentionGeometry) -> list[int]:
    tp, rank = topo.attention_tp
    if geom.num_kv_heads >= tp:
        per = geom.num_kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // geom.num_kv_heads)]


# --- byte helpers --------------------------------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().reshape(-1)


def put(view: torch.Tensor, data: np.ndarray) -> None:
    """Copy raw bytes into a (possibly strided) tensor view of any dtype."""
    src = torch.from_numpy(np.ascontiguousarray(data).reshape(-1)).view(view.dtype).reshape(view.shape)
    view.copy_(src)


def same_view(t: torch.Tensor, raw_twin: torch.Tensor) -> torch.Tensor:
    """The view ``t`` has, taken over another raw buffer of the same size."""
    return torch.as_strided(raw_twin.view(t.dtype), t.shape, t.stride(), t.storage_offset())


class Recorder:
    """An allocator that keeps every buffer it hands out (the raw memory behind vLLM-style strided views)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        raw_bytes(t)[:] = SENTINEL
        self.buffers.append(t)
        return t


# --- one instance's rank ----------------------------------------------------------------------


@dataclass
class Rank:
    topo: Topology
    kv: Any
    conv: Any
    ssm: Any
    alloc: Recorder
    placement: RankPlacement


def build_rank(
    topo: Topology,
    geom: AttentionGeometry,
    attn_layers: tuple[int, ...],
    mg: MambaGeometry,
    *,
    kv_arrangement: str,
    mamba_arrangement: str,
    num_blocks: int,
    num_slots: int,
) -> Rank:
    alloc = Recorder()
    kv = allocate_kv_cache(topo, geom, num_blocks, arrangement=kv_arrangement, allocator=alloc, layers=attn_layers)
    kv_table = build_kv_page_table(kv, topology=topo, geometry=geom, arrangement=kv_arrangement, layers=attn_layers)
    conv, ssm = allocate_mamba_state(topo, mg, num_slots, allocator=alloc, arrangement=mamba_arrangement)
    state_table = build_mamba_state(conv, ssm, topology=topo, geometry=mg, arrangement=mamba_arrangement)
    table = PageTable.combine([kv_table, state_table])
    return Rank(topo, kv, conv, ssm, alloc, RankPlacement(topology=topo, geometry=geom, page_table=table, mamba=mg))


def fill_rank(
    rank: Rank,
    geom: AttentionGeometry,
    attn_layers: tuple[int, ...],
    mg: MambaGeometry,
    kv_arrangement: str,
    mamba_arrangement: str,
    logical: dict[str, np.ndarray],
    blocks: np.ndarray,
    first_block: int,
    slot: int | None,
    twin: dict[int, torch.Tensor] | None = None,
) -> None:
    """Write the request's logical bytes into ``rank``'s tensors (or into ``twin`` raw buffers, same views)."""

    def v(t: torch.Tensor) -> torch.Tensor:
        if twin is None:
            return t
        for buf in rank.alloc.buffers:
            start = buf.data_ptr()
            if start <= t.data_ptr() < start + buf.numel() * buf.element_size():
                return torch.as_strided(
                    twin[start].view(t.dtype),
                    t.shape,
                    t.stride(),
                    (t.data_ptr() - start) // t.element_size(),
                )
        raise AssertionError("view outside every buffer")

    topo, tpb = rank.topo, geom.tokens_per_block
    start, stop = topo.layer_range
    local_attn = [layer for layer in attn_layers if start <= layer < stop]
    heads = rank_kv_heads(topo, geom)
    for j, blk in enumerate(blocks.tolist()):
        toks = slice((first_block + j) * tpb, (first_block + j + 1) * tpb)
        for li, layer in enumerate(local_attn):
            for k in range(geom.kv_factor):
                part = logical["kv"][layer, k][heads][:, toks]  # [heads, tpb, D*eb]
                if kv_arrangement == "head_major_pool":
                    put(v(rank.kv)[blk, li, k], part)
                else:  # token_major_layers_kv_first: [kv, blocks, tokens, heads, dim]
                    put(v(rank.kv[li])[k, blk], part.transpose(1, 0, 2))
    if slot is None:
        return
    chans, sheads = rank_conv_channels(topo, mg), rank_ssm_heads(topo, mg)
    for li, layer in enumerate(mg.local_layers(topo)):
        gi = mg.layers.index(layer)
        rows = logical["conv"][gi][:, chans]  # [d_conv-1, channels, eb]: vLLM's orientation
        if mamba_arrangement == "vllm":
            put(v(rank.conv[li])[slot], rows)
            put(v(rank.ssm[li])[slot], logical["ssm"][gi][sheads])
        else:
            put(v(rank.conv)[li, slot], rows.transpose(1, 0, 2))
            put(v(rank.ssm)[li, slot], logical["ssm"][gi][sheads])


def run_hybrid(
    ctx: tuple[int, int, list[int] | None],
    gen: tuple[int, int, list[int] | None],
    geom: AttentionGeometry,
    attn_layers: tuple[int, ...],
    mg: MambaGeometry,
    *,
    kv_arrangement: str = "head_major_pool",
    mamba_arrangement: str = "layer_major",
    prompt_len: int = 10,
    seed: int = 0,
) -> dict[int, int]:
    """Move one request between two instances; check every byte; return bytes planned per generation rank."""
    rng = np.random.default_rng(seed)
    tpb = geom.tokens_per_block
    total = -(-prompt_len // tpb)
    num_blocks, num_slots, ctx_slot, gen_slot = total + 2, 3, 2, 1
    ctx_ids = rng.permutation(num_blocks)[:total].astype(np.int64)
    gen_ids = rng.permutation(num_blocks)[:total].astype(np.int64)
    ceb, seb = 2, 4
    logical = {
        "kv": rng.integers(
            0, 255, (geom.num_layers, 2, geom.num_kv_heads, total * tpb, geom.head_dim * 2), dtype=np.uint8
        ),
        "conv": rng.integers(0, 255, (len(mg.layers), mg.d_conv - 1, sum(mg.conv_sections), ceb), dtype=np.uint8),
        "ssm": rng.integers(0, 255, (len(mg.layers), mg.nheads, mg.head_dim * mg.d_state * seb), dtype=np.uint8),
    }

    def instance(side: tuple[int, int, list[int] | None]) -> list[Rank]:
        tp, pp, lpp = side
        return [
            build_rank(
                Topology.create(tp, pp, r, geom.num_layers, lpp),
                geom,
                attn_layers,
                mg,
                kv_arrangement=kv_arrangement,
                mamba_arrangement=mamba_arrangement,
                num_blocks=num_blocks,
                num_slots=num_slots,
            )
            for r in range(tp * pp)
        ]

    ctx_ranks, gen_ranks = instance(ctx), instance(gen)
    mem = Memory()
    for rank in ctx_ranks + gen_ranks:
        for buf in rank.alloc.buffers:
            mem.add(buf)
    for rank in ctx_ranks:
        fill_rank(rank, geom, attn_layers, mg, kv_arrangement, mamba_arrangement, logical, ctx_ids, 0, ctx_slot)
    planned: dict[int, int] = {}
    for g in gen_ranks:
        planned[g.topo.rank] = 0
        for c in peer_ranks(g.topo, ctx_ranks[0].topo):
            # every rank gets the same arguments: stages without KV or Mamba layers ignore what they lack
            plan = plan_transfer(
                ctx_ranks[c].placement,
                g.placement,
                ctx_ids,
                gen_ids,
                src_state_slot=ctx_slot,
                dst_state_slot=gen_slot,
                prompt_len=prompt_len,
            )
            planned[g.topo.rank] += plan.nbytes
            mem.execute(plan)
    ones = {key: np.ones_like(a) for key, a in logical.items()}
    for g in gen_ranks:
        exp = {buf.data_ptr(): buf.clone() for buf in g.alloc.buffers}
        mask = {buf.data_ptr(): torch.zeros_like(buf) for buf in g.alloc.buffers}
        for t in exp.values():
            raw_bytes(t)[:] = SENTINEL
        fill_rank(g, geom, attn_layers, mg, kv_arrangement, mamba_arrangement, logical, gen_ids, 0, gen_slot, twin=exp)
        fill_rank(g, geom, attn_layers, mg, kv_arrangement, mamba_arrangement, ones, gen_ids, 0, gen_slot, twin=mask)
        for buf in g.alloc.buffers:
            key = buf.data_ptr()
            if not buf.numel():
                continue
            assert np.array_equal(raw_bytes(buf), raw_bytes(exp[key])), (
                f"gen rank {g.topo.rank}: {np.count_nonzero(raw_bytes(buf) != raw_bytes(exp[key]))} bytes differ"
            )
            assert np.array_equal(mem.count_of(buf), raw_bytes(mask[key]).astype(np.int32)), (
                f"gen rank {g.topo.rank}: write counts {np.unique(mem.count_of(buf))} (each byte exactly once)"
            )
    return planned


def expected_bytes(topo: Topology, geom: AttentionGeometry, attn_layers, mg: MambaGeometry, blocks: int) -> int:
    """Bytes one generation rank must receive: its attention KV and its Mamba state, nothing else."""
    start, stop = topo.layer_range
    n_attn = sum(1 for layer in attn_layers if start <= layer < stop)
    kv = n_attn * geom.kv_factor * len(rank_kv_heads(topo, geom)) * geom.tokens_per_block * geom.head_dim * 2
    n_mamba = len(mg.local_layers(topo))
    state = len(rank_conv_channels(topo, mg)) * (mg.d_conv - 1) * 2
    state += len(rank_ssm_heads(topo, mg)) * mg.head_dim * mg.d_state * 4
    return kv * blocks + n_mamba * state


# --- a real hybrid shape: Mamba, attention, Mamba, attention ----------------------------------

GEOM = AttentionGeometry(num_layers=4, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float16")
ATTN = (1, 3)
HYBRID = mamba_geometry((0, 2), n_groups=1)


@pytest.mark.parametrize(
    ("ctx", "gen"),
    [
        ((1, 1, None), (1, 1, None)),
        ((1, 1, None), (2, 1, None)),
        ((2, 1, None), (1, 1, None)),
        ((1, 2, [1, 3]), (2, 1, None)),  # context stage 0 holds only layer 0 (Mamba): no KV at all
        ((1, 2, [2, 2]), (1, 2, [3, 1])),  # generation stage 1 holds only layer 3 (attention): no state
    ],
    ids=str,
)
@pytest.mark.parametrize("kv_arrangement", ["head_major_pool", "token_major_layers_kv_first"])
@pytest.mark.parametrize("mamba_arrangement", ["layer_major", "vllm"])
def test_hybrid_moves_attention_kv_and_state_and_nothing_else(ctx, gen, kv_arrangement, mamba_arrangement):
    geom = GEOM
    if kv_arrangement != "head_major_pool":
        geom = AttentionGeometry(
            num_layers=4, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float16", block_order="token_major"
        )
    planned = run_hybrid(
        ctx, gen, geom, ATTN, HYBRID, kv_arrangement=kv_arrangement, mamba_arrangement=mamba_arrangement
    )
    for r, nbytes in planned.items():
        topo = Topology.create(gen[0], gen[1], r, 4, gen[2])
        assert nbytes == expected_bytes(topo, geom, ATTN, HYBRID, blocks=3)


def test_attention_only_cache_holds_no_mamba_layers():
    topo = Topology.create(1, 1, 0, 4)
    kv = allocate_kv_cache(topo, GEOM, 8, layers=ATTN)
    assert tuple(kv.shape) == (8, 2, 2, 2, 4, 4)  # two attention layers, not four
    table = build_page_table("head_major_pool", kv, topology=topo, geometry=GEOM, layers=ATTN, group="full")
    (view,) = table.views
    assert view.layers == ATTN and view.group == "full" and table.groups() == {"full": ATTN}
    assert sum(n for _, n in table.regions()) == kv.numel() * 2
    # a stage holding none of the listed layers gets an empty table and accepts any block ids
    stage0 = Topology.create(1, 2, 0, 4, [1, 3])
    empty = allocate_kv_cache(stage0, GEOM, 8, layers=ATTN)
    assert tuple(empty.shape) == (8, 0, 2, 2, 4, 4)
    none = build_kv_page_table(empty, topology=stage0, geometry=GEOM, layers=ATTN)
    assert none.views == () and none.groups() == {}
    assert normalize_block_ids([3, 4, 5], none) == {}
    with pytest.raises(LayoutError, match=r"layers: expected distinct global layers in 0\.\.3"):
        allocate_kv_cache(topo, GEOM, 8, layers=(1, 4))
    with pytest.raises(LayoutError, match=r"kv_caches: expected 1 tensors \(local layers \[3\]\), got 2"):
        tm = AttentionGeometry(
            num_layers=4, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float16", block_order="token_major"
        )
        stage1 = Topology.create(1, 2, 1, 4, [2, 2])
        build_kv_page_table(allocate_kv_cache(stage1, tm, 4), topology=stage1, geometry=tm, layers=ATTN)


def test_pp_stage_without_mamba_layers_ignores_the_state_slot():
    stage1 = Topology.create(1, 2, 1, 4, [2, 2])  # layers 2, 3
    mg = mamba_geometry((0, 1), n_groups=1)
    conv, ssm = allocate_mamba_state(stage1, mg, 4)
    table = build_mamba_state(conv, ssm, topology=stage1, geometry=mg)
    assert table.views == ()
    assert normalize_state_slot(7, table) is None and normalize_state_slot(-1, table) is None
    stage0 = Topology.create(1, 2, 0, 4, [2, 2])
    conv, ssm = allocate_mamba_state(stage0, mg, 4)
    held = build_mamba_state(conv, ssm, topology=stage0, geometry=mg)
    assert normalize_state_slot(3, held) == 3 and normalize_state_slot(-1, held) is None
    with pytest.raises(LayoutError, match=r"state_slot: expected a slot in 0\.\.3, got 4"):
        normalize_state_slot(4, held)
    with pytest.raises(LayoutError, match=r"state_slot: expected an integer \(-1: none\), got True"):
        normalize_state_slot(True, held)
    with pytest.raises(LayoutError, match=r"expected -1 \(none\) or a slot >= 0, got -2"):
        normalize_state_slot(-2, held)


# --- n_groups: 1, fewer than TP, at least TP -------------------------------------------------------


@pytest.mark.parametrize(
    ("n_groups", "ctx_tp", "gen_tp"),
    [
        (1, 1, 2),
        (1, 2, 4),
        (1, 4, 1),
        (1, 4, 2),
        (2, 1, 4),  # fewer groups than TP on the generation side: ranks 0,1 hold group 0, ranks 2,3 group 1
        (2, 4, 2),
        (2, 4, 1),
        (4, 2, 4),  # at least TP: whole groups sharded
        (4, 4, 1),
        (4, 1, 2),
    ],
)
@pytest.mark.parametrize("mamba_arrangement", ["layer_major", "vllm"])
def test_n_groups_state_moves_exactly_between_tp_sizes(n_groups, ctx_tp, gen_tp, mamba_arrangement):
    mg = mamba_geometry((0, 1), n_groups=n_groups)
    geom = AttentionGeometry(num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float16")
    planned = run_hybrid((ctx_tp, 1, None), (gen_tp, 1, None), geom, (), mg, mamba_arrangement=mamba_arrangement)
    for r, nbytes in planned.items():
        topo = Topology.create(gen_tp, 1, r, 2)
        assert nbytes == expected_bytes(topo, geom, (), mg, blocks=0)


def test_n_groups_below_tp_replicates_groups_like_vllm():
    mg = mamba_geometry((0,), n_groups=1)
    d_inner = 16
    for tp in (2, 4):
        topo = Topology.create(tp, 1, tp - 1, 1)
        # vLLM: conv_dim = d_inner + 2 * (n_groups + extra_groups_for_head_shards) * d_state, divided by TP
        assert mg.conv_dim(topo) == (d_inner + 2 * tp * D_STATE) // tp
        assert mg.conv_shape(topo) == (mg.conv_dim(topo), 3)
        assert mg.group_position(topo) == (1, 0, tp, tp - 1)
    four = mamba_geometry((0,), n_groups=4)
    assert four.group_position(Topology.create(2, 1, 1, 1)) == (2, 1, 1, 0)
    two = mamba_geometry((0,), n_groups=2)
    assert two.group_position(Topology.create(4, 1, 3, 1)) == (2, 1, 2, 1)
    three = mamba_geometry((0,), n_groups=3, nheads=6)
    with pytest.raises(TopologyError, match="n_groups: expected a divisor or a multiple of the TP size 2, got 3"):
        three.conv_dim(Topology.create(2, 1, 0, 1))
    with pytest.raises(LayoutError, match=r"conv_sections: expected \(d_inner, n_groups\*d_state"):
        MambaGeometry(
            layers=(0,),
            conv_sections=(16, 4, 4),
            d_conv=4,
            nheads=8,
            head_dim=2,
            d_state=3,
            conv_dtype="float16",
            ssm_dtype="float32",
            n_groups=1,
        )


def test_vllm_state_arrangement_addresses_are_the_tensors_own():
    topo = Topology.create(2, 1, 1, 2)
    mg = mamba_geometry((0, 1), n_groups=1)
    convs, ssms = allocate_mamba_state(topo, mg, 5, arrangement="vllm", page_bytes=512)
    assert tuple(convs[0].shape) == (5, 3, mg.conv_dim(topo)) and tuple(ssms[1].shape) == (5, 4, 2, 3)
    table = build_page_table("mamba_state", convs, ssms, topology=topo, geometry=mg, arrangement="vllm")
    roles = [v.role for v in table.views]
    assert roles == ["mamba_conv", "mamba_conv_groups", "mamba_ssm"]
    x_view, bc_view, _ = table.views
    assert x_view.buffers_per_layer == 3 and bc_view.sharding.num_replicas == 2 and bc_view.sharding.num_shards == 1
    for li in range(2):
        for slot in (0, 4):
            x_addr = table.entry_addresses(0, np.array([li * 3 + 2]), np.array([slot]))[0, 0]
            assert x_addr == convs[li][slot, 2].data_ptr()
            bc_addr = table.entry_addresses(1, np.array([li * 3 + 1]), np.array([slot]))[0, 0]
            assert bc_addr == convs[li][slot, 1, 8:].data_ptr()  # after the rank's 8 x channels
            assert table.entry_addresses(2, np.array([li]), np.array([slot]))[0, 0] == ssms[li][slot].data_ptr()
    # conv and SSM of one layer share one page buffer: one registered region per layer
    page_used = 14 * 3 * 2 + 4 * 2 * 3 * 4  # conv (14 channels x 3 rows, fp16) then SSM (4 heads x 2 x 3, fp32)
    assert table.regions() == [(c.data_ptr(), 4 * 512 + page_used) for c in sorted(convs, key=lambda t: t.data_ptr())]
    with pytest.raises(
        LayoutError, match=r"conv_state\[0\] \(layer 0\): expected shape \[5, 3, 14\], got \[5, 14, 3\]"
    ):
        build_mamba_state([c.transpose(1, 2) for c in convs], ssms, topology=topo, geometry=mg, arrangement="vllm")
    gappy = [convs[0], torch.zeros(5, 3, 28, dtype=torch.float16)[..., ::2]]
    with pytest.raises(LayoutError, match=r"conv_state\[1\] \(layer 1\): expected each slot contiguous"):
        build_mamba_state(gappy, ssms, topology=topo, geometry=mg, arrangement="vllm")
    with pytest.raises(LayoutError, match=r"page_bytes: expected >= "):
        allocate_mamba_state(topo, mg, 5, arrangement="vllm", page_bytes=8)
    with pytest.raises(LayoutError, match=r"arrangement: expected one of \['layer_major', 'vllm'\], got 'dim_first'"):
        build_mamba_state(convs, ssms, topology=topo, geometry=mg, arrangement="dim_first")


def test_arrangements_of_the_two_sides_must_agree():
    mg = mamba_geometry((0, 1), n_groups=1)
    geom = AttentionGeometry(num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float16")
    topo = Topology.create(1, 1, 0, 2)
    a = build_rank(
        topo, geom, (), mg, kv_arrangement="head_major_pool", mamba_arrangement="vllm", num_blocks=2, num_slots=2
    )
    b = build_rank(
        topo, geom, (), mg, kv_arrangement="head_major_pool", mamba_arrangement="layer_major", num_blocks=2, num_slots=2
    )
    with pytest.raises(IncompatiblePeerError, match="view 'mamba_conv' buffers_per_layer: context 3, generation 1"):
        validate_compatible(a.placement, b.placement)
    other = RankPlacement(
        topology=topo, geometry=geom, page_table=b.placement.page_table, mamba=mamba_geometry((0, 1), 2)
    )
    with pytest.raises(IncompatiblePeerError, match="mamba geometry"):
        validate_compatible(a.placement, other)


def test_a_vllm_state_page_moves_as_one_fragment_between_equal_ranks():
    """x rows, B|C rows and the SSM state of one page are adjacent: in address order they merge into one copy."""
    mg = mamba_geometry((0, 1), n_groups=1)
    geom = AttentionGeometry(num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float16")
    topo = Topology.create(2, 1, 1, 2)
    a, b = (
        build_rank(
            topo, geom, (), mg, kv_arrangement="head_major_pool", mamba_arrangement="vllm", num_blocks=2, num_slots=3
        )
        for _ in range(2)
    )
    plan = plan_transfer(a.placement, b.placement, [], [], src_state_slot=2, dst_state_slot=0)
    page_used = mg.conv_dim(topo) * 3 * 2 + 4 * 2 * 3 * 4
    assert plan.sizes.tolist() == [page_used, page_used]
    assert sorted(plan.src.tolist()) == sorted(c[2].data_ptr() for c in a.conv)
    assert sorted(plan.dst.tolist()) == sorted(c[0].data_ptr() for c in b.conv)
