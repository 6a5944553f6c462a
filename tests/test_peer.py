"""Peer registrar: overlap (peers.md B2), owner election (B3), shard positions, writer counts."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.errors import TopologyError
from kvcore.layout.page import ViewSharding
from kvcore.layout.peer import (
    aux_writer,
    expected_receivers,
    expected_writers,
    find_overlap,
    owns,
    peer_pp_ranks,
    peer_ranks,
    replica_ratio,
    shard_position,
    shards_paired,
)
from kvcore.layout.topology import Topology


def T(tp, pp, rank, layers=4, lpp=None, adp=False):
    return Topology.create(tp, pp, rank, layers, lpp, attention_dp=adp)


def test_worked_example_pp_and_tp_overlap():
    # peers.md B2: self PP rank 1 owns layers [1, 3), tp=2 rank 1 -> peer pp=4 layers [1,1,1,1], tp=4
    # (the reference's [1, 2] split totals 3 layers; kvcore requires equal totals, so a third stage is added)
    me = Topology(tp_size=2, tp_rank=1, pp_size=3, pp_rank=1, layers_per_pp=(1, 2, 1))
    peer = Topology(tp_size=4, tp_rank=0, pp_size=4, pp_rank=0, layers_per_pp=(1, 1, 1, 1))
    assert list(peer_pp_ranks(me, peer)) == [1, 2]
    assert list(find_overlap(2, 4, 1)) == [2, 3]
    assert peer_ranks(me, peer) == [6, 7, 10, 11]  # pp*4 + tp, CP-minor with cp=1


def test_tp_overlap_directions_and_dp_offset():
    assert [list(find_overlap(4, 2, r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert list(find_overlap(1, 4, 0)) == [0, 1, 2, 3]
    assert list(find_overlap(2, 1, 1, peer_group_offset=3)) == [3]
    with pytest.raises(TopologyError, match="multiple of"):
        find_overlap(2, 3, 0)


def test_attention_dp_selects_the_peer_group():
    gen = T(2, 1, 1)
    ctx = T(4, 1, 0, adp=True)
    assert peer_ranks(gen, ctx, peer_dp_rank=3) == [3]
    # a generation ADP rank talks to every context TP rank of the (single) context group
    assert peer_ranks(T(4, 1, 2, adp=True), T(2, 1, 0)) == [0, 1]
    with pytest.raises(TopologyError, match="peer_dp_rank"):
        peer_ranks(gen, ctx, peer_dp_rank=4)


def test_uneven_pp_overlap_and_layer_total_mismatch():
    assert peer_ranks(T(1, 2, 0, 10, [7, 3]), T(1, 3, 0, 10, [2, 5, 3])) == [0, 1]
    assert peer_ranks(T(1, 2, 1, 10, [7, 3]), T(1, 3, 0, 10, [2, 5, 3])) == [2]
    assert peer_ranks(T(1, 3, 0, 10, [2, 5, 3]), T(1, 2, 0, 10, [7, 3])) == [0]
    with pytest.raises(TopologyError, match="same layers"):
        peer_ranks(T(1, 1, 0, 4), T(1, 1, 0, 5))


def test_cp_refused():
    with pytest.raises(TopologyError, match="context parallelism"):
        peer_ranks(Topology.create(1, 1, 0, 4, cp_size=2), T(1, 1, 0))


def _stages(num_layers: int, lpp: list[int] | None, pp: int) -> list[set[int]]:
    """Global layers of each PP stage, computed here (not by kvcore): uneven splits as given, else ceil-first."""
    if lpp is None:
        base, extra = divmod(num_layers, pp)
        lpp = [base + (1 if p < extra else 0) for p in range(pp)]
    bounds = list(itertools.accumulate([0, *lpp]))
    return [set(range(bounds[p], bounds[p + 1])) for p in range(pp)]


def _oracle_contacts(ctx_cfg, gen_cfg, num_layers, cd, gd):
    """Pairs (generation rank, context rank) that share a layer and a slice of the heads, for DP groups cd, gd.

    A rank's heads are a fraction of [0, 1): all of it under attention DP (its DP group is its TP rank),
    else [tp_rank / tp, (tp_rank + 1) / tp) (one DP group). Ranks are pp_rank * tp + tp_rank.
    """
    from fractions import Fraction

    def ranks(cfg):
        tp, pp, lpp, adp = cfg
        stages = _stages(num_layers, lpp, pp)
        for p in range(pp):
            for t in range(tp):
                dp = t if adp else 0
                lo, hi = (Fraction(0), Fraction(1)) if adp else (Fraction(t, tp), Fraction(t + 1, tp))
                yield p * tp + t, dp, stages[p], lo, hi

    return {
        (g, c)
        for g, g_dp, g_layers, g_lo, g_hi in ranks(gen_cfg)
        if g_dp == gd
        for c, c_dp, c_layers, c_lo, c_hi in ranks(ctx_cfg)
        if c_dp == cd and g_layers & c_layers and max(g_lo, c_lo) < min(g_hi, c_hi)
    }


@st.composite
def _side(draw, num_layers):
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.integers(1, min(4, num_layers)))
    uneven = draw(st.booleans()) and pp > 1
    lpp = None
    if uneven:
        cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=pp - 1, max_size=pp - 1)))
        lpp = [b - a for a, b in zip([0, *cuts], [*cuts, num_layers])]
    return tp, pp, lpp, draw(st.booleans())


@st.composite
def _pair(draw):
    num_layers = draw(st.integers(1, 8))
    return num_layers, draw(_side(num_layers)), draw(_side(num_layers))


@settings(max_examples=300, deadline=None)
@given(_pair())
def test_contact_relation_is_symmetric_and_matches_the_head_and_layer_overlap(pair):
    """Both sides' views of who exchanges with whom agree with each other and with a first-principles oracle."""
    num_layers, ctx_cfg, gen_cfg = pair

    def topos(cfg):
        tp, pp, lpp, adp = cfg
        return [T(tp, pp, r, num_layers, lpp, adp) for r in range(tp * pp)]

    ctx, gen = topos(ctx_cfg), topos(gen_cfg)
    for cd in range(ctx[0].dp_size):
        for gd in range(gen[0].dp_size):
            want = _oracle_contacts(ctx_cfg, gen_cfg, num_layers, cd, gd)
            forward = {(g.rank, c) for g in gen if g.dp_rank == gd for c in peer_ranks(g, ctx[0], cd)}
            backward = {(g, c.rank) for c in ctx if c.dp_rank == cd for g in peer_ranks(c, gen[0], gd)}
            assert forward == want
            assert backward == want
            for g in gen:
                if g.dp_rank == gd:
                    mine = sorted(c for gg, c in want if gg == g.rank)
                    assert expected_writers(ctx[0], g, cd) == len(mine)
                    assert aux_writer(g, ctx[0], cd) == mine[0]
            for c in ctx:
                if c.dp_rank == cd:
                    assert expected_receivers(c, gen[0], gd) == sum(1 for _, cc in want if cc == c.rank)


def test_shard_position_gqa_and_replicated():
    assert [shard_position(4, r, 8) for r in range(4)] == [(4, r, 1, 0) for r in range(4)]
    assert [shard_position(4, r, 2) for r in range(4)] == [(2, 0, 2, 0), (2, 0, 2, 1), (2, 1, 2, 0), (2, 1, 2, 1)]
    assert shard_position(4, 3, None) == (1, 0, 4, 3)
    with pytest.raises(TopologyError, match="divide evenly"):
        shard_position(4, 0, 6)


def L(tp, rank, units):
    n, i, r, j = shard_position(tp, rank, units)
    return ViewSharding(
        kind="head_major_sharded", num_shards=n, shard_index=i, num_replicas=r, replica_index=j, unit_bytes=1
    )


def test_owner_election_exactly_one_writer_per_destination():
    # context TP4 with 2 KV heads (2 replicas per head) -> generation TP1 (contacts all 4)
    writers = [c for c in range(4) if owns(L(4, c, 2), L(1, 0, 2), dst_dp_rank=0)]
    assert writers == [0, 2]
    # rotation with the destination DP rank
    assert [c for c in range(4) if owns(L(4, c, 2), L(1, 0, 2), dst_dp_rank=1)] == [1, 3]
    assert replica_ratio(L(4, 0, 2), L(1, 0, 2)) == 2 and replica_ratio(L(1, 0, 2), L(4, 0, 2)) == 1
    # context TP1 -> generation TP4, 2 heads: duplicated heads, every pair paired
    assert all(shards_paired(L(1, 0, 2), L(4, g, 2)) for g in range(4))
    assert [shards_paired(L(2, c, 8), L(4, 2, 8)) for c in range(2)] == [False, True]
