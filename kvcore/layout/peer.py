"""Peer registrar arithmetic: which peer ranks a rank exchanges with, and who writes which bytes.

Pure functions over :class:`~kvcore.layout.topology.Topology` and
:class:`~kvcore.layout.page.ViewSharding`; no state, no I/O.

Convention the transceiver follows (one request, context instance C, generation instance G):

* The request was prefilled by C's attention DP group ``ctx_dp_rank`` (0 without
  attention DP) and is decoded by G's DP group ``gen_dp_rank``.
* Every generation rank ``g`` of that DP group contacts every context rank in
  ``peer_ranks(g, ctx, peer_dp_rank=ctx_dp_rank)`` with its block ids. The
  relation is symmetric: context rank ``c`` is contacted by exactly the
  generation ranks in ``peer_ranks(c, gen, peer_dp_rank=gen_dp_rank)``
  (``expected_receivers``), so a send session knows how many requests to wait for.
* Every contacted context rank builds its plan with
  :func:`kvcore.layout.mapping.plan_transfer` (which applies owner election, so it may
  own zero bytes for that receiver) and **always** reports completion, even for
  an empty plan. Hence a receive session completes after
  ``expected_writers(ctx, g, ctx_dp_rank) == len(peer_ranks(g, ctx, ctx_dp_rank))``
  completions, and a late or missing writer is never confused with an idle one.
* Owner election makes every destination byte written by exactly one contacted
  context rank; among duplicate holders (GQA replicas, MLA replicas) the writer
  rotates with the destination's DP rank, spreading load under attention DP.
* Aux data (first tokens, draft tokens) for generation rank ``g`` is written by
  ``aux_writer(g, ctx, ctx_dp_rank)`` only: the lowest contacted context rank.
"""

from __future__ import annotations

from kvcore.errors import TopologyError
from kvcore.layout.page import ViewSharding
from kvcore.layout.topology import Topology, require_no_cp

__all__ = [
    "aux_writer",
    "expected_receivers",
    "expected_writers",
    "find_overlap",
    "owns",
    "peer_pp_ranks",
    "peer_ranks",
    "peer_tp_ranks",
    "replica_ratio",
    "shard_position",
    "shards_paired",
]


def find_overlap(self_size: int, peer_size: int, self_rank: int, peer_group_offset: int = 0) -> range:
    """Peer ranks (within a group of ``peer_size``) whose shard overlaps ``self_rank``'s shard (group of ``self_size``).

    With ``a <= b``: the ``b//a`` peers ``[r*b//a, (r+1)*b//a)``; with ``a > b``:
    the one peer ``r // (a//b)``; ``peer_group_offset`` is added (selects a DP group).
    """
    a, b = self_size, peer_size
    if a <= b:
        if b % a:
            raise TopologyError(f"TP per DP group: expected {b} to be a multiple of {a}")
        n = b // a
        start = self_rank * n
    else:
        if a % b:
            raise TopologyError(f"TP per DP group: expected {a} to be a multiple of {b}")
        n = 1
        start = self_rank // (a // b)
    start += peer_group_offset
    return range(start, start + n)


def peer_pp_ranks(self_topo: Topology, peer_topo: Topology) -> range:
    """Peer PP stages whose global layer interval intersects this rank's (uneven splits allowed)."""
    if self_topo.num_layers != peer_topo.num_layers:
        raise TopologyError(
            f"layers_per_pp: expected both instances to total the same layers, "
            f"got {self_topo.num_layers} (self) and {peer_topo.num_layers} (peer)"
        )
    start, stop = self_topo.layer_range
    hits = [p for p in range(peer_topo.pp_size) if _intersects(peer_topo.stage_range(p), (start, stop))]
    return range(hits[0], hits[-1] + 1)


def peer_tp_ranks(self_topo: Topology, peer_topo: Topology, peer_dp_rank: int = 0) -> range:
    """Peer TP ranks (global TP rank) overlapping this rank's attention shard inside peer DP group ``peer_dp_rank``."""
    if not 0 <= peer_dp_rank < peer_topo.dp_size:
        raise TopologyError(f"peer_dp_rank: expected 0 <= peer_dp_rank < {peer_topo.dp_size}, got {peer_dp_rank}")
    a, b = self_topo.tp_per_dp, peer_topo.tp_per_dp
    return find_overlap(a, b, self_topo.tp_rank % a, peer_dp_rank * b)


def peer_ranks(self_topo: Topology, peer_topo: Topology, peer_dp_rank: int = 0) -> list[int]:
    """Instance-global ranks of the peer this rank exchanges with (sorted); CP > 1 raises ``TopologyError``.

    PP by layer-interval overlap, TP by shard overlap within peer DP group
    ``peer_dp_rank`` (peers.md B2). Used by both sides, each against the other (per request: the answer for a
    pair of topologies is kept, at most ``_PEER_RANKS_ENTRIES`` pairs).
    """
    key = (self_topo, peer_topo, peer_dp_rank)
    hit = _peer_ranks.get(key)
    if hit is None:
        require_no_cp(self_topo, peer_topo, what="peer_ranks")
        tps = peer_tp_ranks(self_topo, peer_topo, peer_dp_rank)
        hit = tuple(sorted(peer_topo.rank_of(p, t) for p in peer_pp_ranks(self_topo, peer_topo) for t in tps))
        if len(_peer_ranks) >= _PEER_RANKS_ENTRIES:
            _peer_ranks.clear()  # bounded: a few hundred bytes an entry, peers come and go
        _peer_ranks[key] = hit
    return list(hit)


#: Pairs of topologies whose peer ranks are kept (a Topology is a small frozen struct: about 1 KiB an entry).
_PEER_RANKS_ENTRIES = 1024
_peer_ranks: dict[tuple[Topology, Topology, int], tuple[int, ...]] = {}


def expected_writers(ctx_topo: Topology, gen_topo: Topology, ctx_dp_rank: int = 0) -> int:
    """Completions generation rank ``gen_topo`` waits for: one per contacted context rank."""
    return len(peer_ranks(gen_topo, ctx_topo, ctx_dp_rank))


def expected_receivers(ctx_topo: Topology, gen_topo: Topology, gen_dp_rank: int = 0) -> int:
    """Generation ranks that contact context rank ``ctx_topo`` for a request decoded by DP group ``gen_dp_rank``."""
    return len(peer_ranks(ctx_topo, gen_topo, gen_dp_rank))


def aux_writer(gen_topo: Topology, ctx_topo: Topology, ctx_dp_rank: int = 0) -> int:
    """The single context rank that writes aux data (first/draft tokens) to generation rank ``gen_topo``."""
    return peer_ranks(gen_topo, ctx_topo, ctx_dp_rank)[0]


def _intersects(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


# --- shard declarations and owner election (B1 shard_position, B3 refactor) ----------------------


def shard_position(group_size: int, group_rank: int, units: int | None) -> tuple[int, int, int, int]:
    """``(num_shards, shard_index, num_replicas, replica_index)`` of a rank holding a share of ``units``.

    ``units=None`` means replicated (one shard, every rank a replica). With
    fewer units than ranks (GQA heads < TP) the surplus ranks become replicas.
    """
    if not 0 <= group_rank < group_size:
        raise TopologyError(f"group_rank: expected 0 <= group_rank < {group_size}, got {group_rank}")
    if units is None:
        return 1, 0, group_size, group_rank
    num_shards = max(1, min(group_size, units))
    if group_size % num_shards or units % num_shards:
        raise TopologyError(
            f"units: expected {units} units and a group of {group_size} ranks to divide evenly into {num_shards} shards"
        )
    num_replicas = group_size // num_shards
    return num_shards, group_rank // num_replicas, num_replicas, group_rank % num_replicas


def _ratio(big: int, small: int, what: str) -> int:
    if big % small:
        raise TopologyError(f"{what}: expected {big} to be a multiple of {small}")
    return big // small


def shards_paired(src: ViewSharding, dst: ViewSharding) -> bool:
    """True when ``src``'s shard and ``dst``'s shard share any unit (shard counts must divide)."""
    ns, nd = src.num_shards, dst.num_shards
    if ns <= nd:
        return dst.shard_index // _ratio(nd, ns, "num_shards") == src.shard_index
    return src.shard_index // _ratio(ns, nd, "num_shards") == dst.shard_index


def replica_ratio(src: ViewSharding, dst: ViewSharding) -> int:
    """How many source replicas compete for one destination: ``max(1, R_src // R_dst)``."""
    if src.num_replicas <= dst.num_replicas:
        return 1
    return _ratio(src.num_replicas, dst.num_replicas, "num_replicas")


def owns(src: ViewSharding, dst: ViewSharding, dst_dp_rank: int = 0) -> bool:
    """Whether the source rank writes its share of this view to this destination rank (exactly one writer).

    Shards must pair, and among ``replica_ratio`` competing source replicas the one
    with ``replica_index % ratio == dst_dp_rank % ratio`` writes (rotating with
    the destination's DP rank).
    """
    if not shards_paired(src, dst):
        return False
    ratio = replica_ratio(src, dst)
    return src.replica_index % ratio == dst_dp_rank % ratio
