"""From two ranks' page tables and aligned block lists to a fragment plan (src ptr, dst ptr, size arrays).

Mapper-kind selection (both peers declare the same kind, independently of the peer):

* Every view declares ``mapper``: the kind able to re-shard its sharding
  (``head_mismatch_head_major`` for head-major KV, ``head_mismatch_token_major``
  for token-major KV, ``replicated`` for MLA / index keys, ``mamba_conv``,
  ``mamba_ssm``), or ``matching_heads`` for views that may never be re-sharded.
  The builders choose it from the sharding alone, so both peers agree whatever
  their TP sizes. Different declared kinds raise ``PoolMismatchError``.
* When the two views' per-buffer shardings are identical except for this rank's
  shard/replica indices (``ViewSharding.shape_key()`` and ``buffer_bytes``
  equal: a homogeneous deployment), the core's ``matching_heads`` mapper is
  used whatever was declared. Otherwise the declared kind is looked up in the
  layout-mapper registry; if no installed plugin provides it, a ``MappingError``
  names the kind and the distribution to install (``kvcore-mixers``).

Owner election (:func:`kvcore.layout.peer.owns`) is applied per view pair before any
mapper runs, so mappers only compute *where* bytes go, never *whether*.

The mapper contract (``LayoutMapper``, ``FragmentPlan``, ``ViewPair``, the matching-heads mapper) lives in
:mod:`kvcore.layout.mappers`, below both this module and the plugin registry; its names import from here too.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import msgspec
import numpy as np

from kvcore.errors import (
    IncompatiblePeerError,
    MappingError,
    PoolMismatchError,
    TopologyError,
    UnknownBackendError,
)
from kvcore.layout.blocks import BlockIds, as_id_array
from kvcore.layout.mappers import (
    MATCHING_HEADS,
    FragmentPlan,
    LayoutMapper,
    MatchingHeadsMapper,
    ViewPair,
    shard_split,
)
from kvcore.layout.page import DEFAULT_GROUP, REPLICATED, SECTIONED, PageTable, PoolView, table_bytes
from kvcore.layout.peer import owns, peer_ranks
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology, require_no_cp

__all__ = [
    "MATCHING_HEADS",
    "FragmentPlan",
    "LayoutMapper",
    "MatchingHeadsMapper",
    "RankPlacement",
    "ViewPair",
    "align_blocks",
    "check_destination_covers",
    "plan_transfer",
    "select_mapper_kind",
    "shard_split",
    "validate_compatible",
]


class RankPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a peer needs to plan transfers with a rank: topology, geometry, page table."""

    topology: Topology
    geometry: AttentionGeometry
    page_table: PageTable
    mamba: MambaGeometry | None = None


# --- compatibility ---------------------------------------------------------------------------


def _view_index(table: PageTable) -> dict[tuple[int, str], tuple[int, int]]:
    """(global layer, role) -> (view index, layer position in that view)."""
    out: dict[tuple[int, str], tuple[int, int]] = {}
    for vi, view in enumerate(table.views):
        for pos, layer in enumerate(view.layers):
            out[(layer, view.role)] = (vi, pos)
    return out


def _view_diffs(role: str, cv: PoolView, gv: PoolView) -> list[str]:
    diffs: list[str] = []
    pre = f"view {role!r}"

    def cmp(field: str, c: object, g: object) -> None:
        if c != g:
            diffs.append(f"{pre} {field}: context {c!r}, generation {g!r}")

    cmp("mapper kind", cv.mapper, gv.mapper)
    cmp("state vs token view (tokens_per_slot)", cv.tokens_per_slot, gv.tokens_per_slot)
    cmp("buffers_per_layer", cv.buffers_per_layer, gv.buffers_per_layer)
    cmp("window", cv.window, gv.window)
    cmp("layer group", cv.group, gv.group)
    if cv.dtype or gv.dtype:
        cmp("dtype", cv.dtype or "(not declared)", gv.dtype or "(not declared)")
    cl, gl = cv.sharding, gv.sharding
    cmp("sharding kind", cl.kind, gl.kind)
    if cl.kind != gl.kind:
        return diffs
    cmp("unit_bytes", cl.unit_bytes, gl.unit_bytes)
    cmp("rows", cl.rows, gl.rows)
    ns, nd = cl.num_shards, gl.num_shards
    if max(ns, nd) % min(ns, nd):
        diffs.append(f"{pre} num_shards: expected one to divide the other, got context {ns}, generation {nd}")
    elif cl.kind == SECTIONED:
        if len(cl.section_bytes) != len(gl.section_bytes):
            cmp("section count", len(cl.section_bytes), len(gl.section_bytes))
        else:
            cmp("total section bytes", [s * ns for s in cl.section_bytes], [s * nd for s in gl.section_bytes])
    else:
        cmp("buffer bytes x num_shards", cv.buffer_bytes * ns, gv.buffer_bytes * nd)
    if cl.kind == REPLICATED and cv.is_state and cl.num_replicas != gl.num_replicas:
        diffs.append(
            f"{pre}: replicated state cannot move between different TP groups "
            f"(context group {cl.num_replicas}, generation group {gl.num_replicas})"
        )
    return diffs


def validate_compatible(ctx: RankPlacement, gen: RankPlacement) -> None:
    """Raise ``IncompatiblePeerError`` listing every field that prevents ``ctx`` -> ``gen`` transfers; else None."""
    diffs: list[str] = []
    cg, gg = ctx.geometry, gen.geometry
    for field in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "dtype", "kv_factor", "block_order"):
        c, g = getattr(cg, field), getattr(gg, field)
        if c != g:
            diffs.append(f"{field}: context {c!r}, generation {g!r}")
    if ctx.mamba != gen.mamba:
        diffs.append(f"mamba geometry: context {ctx.mamba!r}, generation {gen.mamba!r}")
    for side, lay in (("context", ctx), ("generation", gen)):
        if lay.topology.cp_size != 1:
            diffs.append(
                f"{side} cp_size: expected 1 (context parallelism is not supported), got {lay.topology.cp_size}"
            )
        if lay.topology.num_layers != lay.geometry.num_layers:
            diffs.append(
                f"{side} layers_per_pp: expected a sum of num_layers {lay.geometry.num_layers}, "
                f"got {list(lay.topology.layers_per_pp)}"
            )
    a, b = ctx.topology.tp_per_dp, gen.topology.tp_per_dp
    if max(a, b) % min(a, b):
        diffs.append(f"TP per DP group: expected one to divide the other, got context {a}, generation {b}")
    cidx, gidx = _view_index(ctx.page_table), _view_index(gen.page_table)
    common = ctx.page_table.layers() & gen.page_table.layers()
    only_c = sorted(k for k in cidx if k[0] in common and k not in gidx)
    only_g = sorted(k for k in gidx if k[0] in common and k not in cidx)
    if only_c or only_g:
        diffs.append(f"pool roles on shared layers: only context has {only_c[:8]}, only generation has {only_g[:8]}")
    seen: set[tuple[int, int]] = set()
    for key, (cvi, _) in cidx.items():
        if key in gidx and key[0] in common:
            gvi = gidx[key][0]
            if (cvi, gvi) not in seen:
                seen.add((cvi, gvi))
                diffs.extend(_view_diffs(key[1], ctx.page_table.views[cvi], gen.page_table.views[gvi]))
    if diffs:
        raise IncompatiblePeerError("incompatible peer:\n  " + "\n  ".join(diffs))


# --- blocks ----------------------------------------------------------------------------------


def align_blocks(
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    tokens_per_block: int,
    *,
    prompt_len: int | None = None,
    window: int | None = None,
    cached_tokens: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Aligned ``(src, dst)`` block ids to copy; both lists are suffixes of the request's ``T`` blocks.

    ``T = ceil(prompt_len/tokens_per_block)`` (or ``len(src_ids)`` without
    ``prompt_len``). The destination must cover every block from the first
    one it does not hold already: its cached prefix is ``cached_tokens`` (the
    receiver states it; 0 by default, so a short destination list is an error,
    never a silent cached prefix), that is ``cached_tokens // tokens_per_block``
    whole blocks (all ``T`` when ``cached_tokens >= prompt_len``). A longer
    destination list (up to ``T``) is fine: its leading, cached blocks are not
    written. With a sliding ``window``, blocks before
    ``(prompt_len+1-window)//tokens_per_block`` are stale and skipped (peers.md
    B5). A destination list shorter than that, or a source list that starts
    after the first block the destination needs, raises ``MappingError`` naming
    the numbers.
    """
    ns, nd = len(src_ids), len(dst_ids)
    if isinstance(cached_tokens, bool) or not isinstance(cached_tokens, (int, np.integer)) or cached_tokens < 0:
        raise MappingError(f"cached_tokens: expected an integer >= 0, got {cached_tokens!r}")
    if prompt_len is None:
        if window is not None:
            raise MappingError("prompt_len: expected a value when a sliding window applies, got None")
        total = ns
    else:
        if prompt_len < 0:
            raise MappingError(f"prompt_len: expected >= 0, got {prompt_len}")
        if cached_tokens > prompt_len:
            raise MappingError(f"cached_tokens: expected at most prompt_len {prompt_len}, got {cached_tokens}")
        total = -(-prompt_len // tokens_per_block)
    if ns > total or nd > total:
        raise MappingError(
            f"block ids: expected at most {total} blocks (ceil(prompt_len/tokens_per_block)), "
            f"got {ns} (source) and {nd} (destination)"
        )
    cached = (
        total
        if prompt_len is not None and cached_tokens >= prompt_len
        else min(total, cached_tokens // tokens_per_block)
    )
    first = cached
    if window is not None:
        first = max(first, max(0, (prompt_len + 1 - window) // tokens_per_block))  # type: ignore[operator]
    if nd < total - first:
        length = f"prompt_len {prompt_len}" if prompt_len is not None else f"the source's {ns} blocks"
        raise MappingError(
            f"destination block ids: {nd} blocks do not cover the request: {length} minus cached_tokens "
            f"{cached_tokens} needs {total - first} blocks (blocks {first}..{total - 1} of {total}, "
            f"{tokens_per_block} tokens a block)"
        )
    if total - ns > first:
        # the destination would keep holes: blocks it waits for that the source does not hold
        raise MappingError(
            f"block ids: the destination needs blocks {first}..{total - 1} of the request, the source holds only "
            f"blocks {total - ns}..{total - 1} ({ns} ids)"
        )
    return src_ids[first - (total - ns) :], dst_ids[first - (total - nd) :]


def check_destination_covers(
    page_table: PageTable, block_ids: Mapping[str, np.ndarray], *, prompt_len: int, cached_tokens: int, what: str
) -> None:
    """``MappingError`` (prefixed ``what``) unless each token group's destination ids cover the prompt's uncached part.

    The receiver's own check at its receive call, with the arithmetic of :func:`align_blocks`: every group's list
    must cover blocks ``cached_tokens // tokens_per_block`` (or the window's first live block) to the last one of
    ``prompt_len`` tokens, and be at most ``ceil(prompt_len / tokens_per_block)`` long.
    """
    seen: set[tuple[str, int, int | None]] = set()
    for view in page_table.views:
        if view.is_state or view.tokens_per_slot is None:
            continue
        key = (view.group, view.tokens_per_slot, view.window)
        if key in seen or view.group not in block_ids:
            continue
        seen.add(key)
        total = -(-prompt_len // view.tokens_per_slot)
        try:
            align_blocks(
                np.zeros(total, np.int64),
                block_ids[view.group],
                view.tokens_per_slot,
                prompt_len=prompt_len,
                window=view.window,
                cached_tokens=cached_tokens,
            )
        except MappingError as exc:
            raise MappingError(f"{what} (layer group {view.group!r}): {exc}") from None


# --- planning --------------------------------------------------------------------------------


def select_mapper_kind(src: PoolView, dst: PoolView) -> str:
    """``matching_heads`` for identical per-buffer shardings, else the kind both views declare."""
    if src.mapper != dst.mapper:
        raise PoolMismatchError(
            f"view {src.role!r}: mapper kind differs: source {src.mapper!r}, destination {dst.mapper!r}"
        )
    if src.sharding.shape_key() == dst.sharding.shape_key() and src.buffer_bytes == dst.buffer_bytes:
        return MATCHING_HEADS
    return src.mapper


_INSTANCES: dict[type, LayoutMapper] = {}


class MapperLookup(Protocol):
    """What planning needs of the layout-mapper registry: the mapper class of a kind.

    ``kvcore.extension.registry.LayoutMapperRegistry`` is one; naming the protocol here keeps this module from importing
    the registry (the registry's types refer to ``LayoutMapper``: importing back would close a circle).
    """

    def get(self, name: str) -> type[LayoutMapper]: ...


def _mapper(kind: str, mappers: MapperLookup, role: str) -> LayoutMapper:
    try:
        cls = mappers.get(kind)
    except UnknownBackendError as exc:
        raise MappingError(f"view {role!r} needs layout mapper {kind!r}, which is not installed:\n{exc}") from exc
    inst = _INSTANCES.get(cls)
    if inst is None:
        inst = _INSTANCES.setdefault(cls, cls())
    return inst


def _group_ids(
    ids: BlockIds | None, table: PageTable, what: str, groups: tuple[str, ...] | None = None
) -> dict[str, np.ndarray]:
    """Block ids per token group of ``table``: a mapping as given, a plain list for the table's only group.

    Range checks happen where addresses are computed; duplicates are the
    caller's to refuse (:func:`kvcore.layout.blocks.normalize_block_ids`).
    """
    if type(ids) is dict or isinstance(ids, Mapping):  # a dict (normalized ids) skips the ABC check
        return {name: as_id_array(v, f"{what}[{name!r}]") for name, v in ids.items()}
    arr = as_id_array(ids, what)
    if groups is None:
        groups = tuple(table.groups())
    if len(groups) > 1:
        raise MappingError(
            f"{what}: the page table holds layer groups {list(groups)}; expected a mapping of group name to "
            f"block ids, got one list"
        )
    return {groups[0] if groups else DEFAULT_GROUP: arr}


#: Up to this many block ids the per-request checks run on Python ints (a one-block request is the common case).
_SMALL_IDS = 16


@dataclass(frozen=True, slots=True, eq=False)
class _Entries:
    """One side's matched buffers of a view pair: where entry ``e`` starts in slot 0 and the slot stride."""

    view: int
    entries: np.ndarray
    start: np.ndarray  # uint64: pool base + buffer offset, per entry
    stride: np.ndarray  # uint64: the slot stride of each entry's pool
    slots: int  # the fewest slots among the pools used: ids below it are valid in all of them

    @classmethod
    def build(cls, table: PageTable, view: int, entries: np.ndarray) -> _Entries:
        v = table.views[view]
        pool_idx = np.asarray(v.pools, dtype=np.int64)[entries]
        base = np.fromiter((p.base for p in table.pools), dtype=np.uint64, count=len(table.pools))
        stride = np.fromiter((p.slot_stride for p in table.pools), dtype=np.uint64, count=len(table.pools))
        slots = min(table.pools[p].num_slots for p in np.unique(pool_idx).tolist()) if entries.size else 0
        start = base[pool_idx] + np.asarray(v.offsets, dtype=np.uint64)[entries]
        return cls(view, entries, start, stride[pool_idx], slots)

    def addresses(self, table: PageTable, ids: np.ndarray) -> np.ndarray:
        """``table.entry_addresses(view, entries, ids)``, without recomputing what does not depend on ``ids``."""
        if ids.size <= _SMALL_IDS:
            few = ids.tolist()  # a numpy reduction on a handful of ids costs more than the Python one
            bad = bool(few) and (min(few) < 0 or max(few) >= self.slots)
        else:
            bad = bool(ids.size) and (int(ids.min()) < 0 or int(ids.max()) >= self.slots)
        if bad:
            return table.entry_addresses(self.view, self.entries, ids)  # raises, naming the bad ids
        out: np.ndarray = self.start[:, None] + ids.astype(np.uint64)[None, :] * self.stride[:, None]
        return out


@dataclass(frozen=True, slots=True, eq=False)
class _PairPlan:
    """What a plan for one matched view pair needs that does not depend on the request (cached per peer pair)."""

    sv: PoolView
    dv: PoolView
    kind: str  # the mapper kind, looked up per request (as before caching: only for pairs with blocks)
    src: _Entries
    dst: _Entries
    group: int
    #: The mapper's ``buffer_fragments`` of this pair, as uint64 arrays, when its class plans with the contract's own
    #: ``map`` (request-independent: worked out once); ``None``: the mapper is asked per request, as before.
    frags: tuple[type[LayoutMapper], np.ndarray, np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True, slots=True)
class _Deferred:
    """A layout error met while building: raised per request at its place, after the per-request checks before it."""

    cls: type[Exception]
    message: str


_PLAN_CACHE_ENTRIES = 256
#: The most bytes the plan cache may hold (its arrays and, by estimate, the page tables its entries keep alive).
_PLAN_CACHE_BYTES = 64 * 1024 * 1024


class _Steps(NamedTuple):
    """The request-independent part of a plan between two ranks: the view pairs, and each table's token groups."""

    plans: tuple[_PairPlan | _Deferred, ...]
    src_groups: tuple[str, ...]
    dst_groups: tuple[str, ...]


_CacheEntry = tuple[tuple[object, ...], _Steps, int]
_plan_cache: dict[tuple[int, ...], _CacheEntry] = {}
_plan_cache_bytes = 0
_plan_cache_lock = threading.Lock()


def clear_plan_cache() -> None:
    """Empty the plan cache (tests, and a process that wants its memory back)."""
    global _plan_cache_bytes
    with _plan_cache_lock:
        _plan_cache.clear()
        _plan_cache_bytes = 0


def _entry_bytes(parts: tuple[object, ...], plans: tuple[_PairPlan | _Deferred, ...]) -> int:
    """Bytes one cache entry accounts for: its arrays, and the peer's and our page tables it keeps alive."""
    arrays = sum(
        a.nbytes
        for pp in plans
        if isinstance(pp, _PairPlan)
        for side in (pp.src, pp.dst)
        for a in (side.entries, side.start, side.stride)
    ) + sum(a.nbytes for pp in plans if isinstance(pp, _PairPlan) and pp.frags for a in pp.frags[1:])
    tables = sum(table_bytes(p) for p in parts if isinstance(p, PageTable))
    return 256 + arrays + tables


def _pair_plans(
    src: RankPlacement, dst: RankPlacement, mappers: MapperLookup, layer_range: tuple[int, int] | None
) -> _Steps:
    """The request-independent part of :func:`plan_transfer`, cached per (source, destination, mappers, layers).

    Keyed by the identity of the placements' parts (a peer's ``RankInfo`` keeps them for its lifetime); the cache
    holds them, so an id is never reused while its entry lives. At most 256 entries and ``_PLAN_CACHE_BYTES`` (an
    entry counts its arrays and the page tables it keeps alive), least recently used out; one entry larger than
    that is not kept at all.
    Topology errors are raised, never cached; layout errors are kept as ``_Deferred`` steps, so every call
    raises the error the uncached planner raised, in the same order as the per-request checks.
    """
    parts: tuple[object, ...] = (
        src.topology,
        src.page_table,
        src.mamba,
        dst.topology,
        dst.page_table,
        dst.mamba,
        mappers,
    )
    key = (*map(id, parts), *(layer_range or (-1, -1)))
    global _plan_cache_bytes
    with _plan_cache_lock:
        hit = _plan_cache.pop(key, None)
        if hit is not None:
            if all(a is b for a, b in zip(hit[0], parts, strict=True)):
                _plan_cache[key] = hit  # most recently used last
                return hit[1]
            _plan_cache_bytes -= hit[2]  # another pair under the same ids (cannot happen while held): dropped
    plans = _Steps(
        tuple(_with_fragments(pp, mappers) for pp in _build_pair_plans(src, dst, layer_range)),
        tuple(src.page_table.groups()),
        tuple(dst.page_table.groups()),
    )
    size = _entry_bytes(parts, plans.plans)
    if size > _PLAN_CACHE_BYTES:
        return plans  # planned, not kept: a single peer cannot make the cache exceed its bytes
    with _plan_cache_lock:
        old = _plan_cache.pop(key, None)  # another thread planned the same pair meanwhile
        if old is not None:
            _plan_cache_bytes -= old[2]
        _plan_cache[key] = (parts, plans, size)
        _plan_cache_bytes += size
        while len(_plan_cache) > 1 and (
            len(_plan_cache) > _PLAN_CACHE_ENTRIES or _plan_cache_bytes > _PLAN_CACHE_BYTES
        ):
            _plan_cache_bytes -= _plan_cache.pop(next(iter(_plan_cache)))[2]
    return plans


def _with_fragments(pp: _PairPlan | _Deferred, mappers: MapperLookup) -> _PairPlan | _Deferred:
    """``pp`` with its mapper's buffer fragments worked out once, when the mapper plans with ``LayoutMapper.map``.

    Anything that goes wrong here (no such mapper, fragments it refuses) leaves ``frags`` empty: the request then
    asks the mapper itself, which raises the error at the place and in the order the uncached planner did.
    """
    if not isinstance(pp, _PairPlan):
        return pp
    try:
        mapper = _mapper(pp.kind, mappers, pp.sv.role)
        if type(mapper).map is not LayoutMapper.map:
            return pp  # a mapper with its own map: asked per request
        so, do, sz = (
            np.ascontiguousarray(a, dtype=np.uint64).reshape(-1) for a in mapper.buffer_fragments(pp.sv, pp.dv)
        )
    except Exception:
        return pp
    if not (so.size == do.size == sz.size) or not sz.size:
        return pp  # the contract's map refuses it per request (MappingError from FragmentPlan)
    return replace(pp, frags=(type(mapper), so, do, sz))


def _outer(
    frags: tuple[np.ndarray, np.ndarray, np.ndarray], sa: np.ndarray, da: np.ndarray, group: int
) -> FragmentPlan:
    """``LayoutMapper.map`` on precomputed buffer fragments: the same arithmetic, the same fragment order."""
    so, do, sz = frags
    e, b = sa.shape
    g = group if group >= 1 and e % group == 0 else 1
    sa = sa.reshape(e // g, g, b).transpose(0, 2, 1)
    da = da.reshape(e // g, g, b).transpose(0, 2, 1)
    src = (sa[..., None] + so).reshape(-1)
    dst = (da[..., None] + do).reshape(-1)
    if sz.size == 1:  # one fragment per buffer (matching heads): every fragment has the same size
        sizes = np.full(src.size, sz[0], dtype=np.uint64)
    else:
        sizes = np.ascontiguousarray(np.broadcast_to(sz, sa.shape + sz.shape).reshape(-1))
    return FragmentPlan.trusted(src, dst, sizes)


def _build_pair_plans(
    src: RankPlacement, dst: RankPlacement, layer_range: tuple[int, int] | None
) -> tuple[_PairPlan | _Deferred, ...]:
    require_no_cp(src.topology, dst.topology, what="plan_transfer")
    contacted = peer_ranks(dst.topology, src.topology, src.topology.dp_rank)
    if src.topology.rank not in contacted:
        raise TopologyError(
            f"source rank {src.topology.rank} is not a peer of destination rank {dst.topology.rank} "
            f"(destination contacts {contacted})"
        )
    st, dt = src.page_table, dst.page_table
    sidx, didx = _view_index(st), _view_index(dt)
    common = st.layers() & dt.layers()
    if layer_range is not None:
        common = {layer for layer in common if layer_range[0] <= layer < layer_range[1]}
    missing = sorted(
        [("source", k) for k in sidx if k[0] in common and k not in didx]
        + [("destination", k) for k in didx if k[0] in common and k not in sidx]
    )
    if missing:
        shown = ", ".join(f"layer {k[0]} role {k[1]!r} only on {side}" for side, k in missing[:8])
        return (_Deferred(PoolMismatchError, f"pool roles differ on shared layers: {shown}"),)
    # (src view, dst view) -> [(src pos, dst pos)] in source physical order
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for key, (svi, spos) in sidx.items():
        if key[0] in common:
            dvi, dpos = didx[key]
            pairs.setdefault((svi, dvi), []).append((spos, dpos))
    dst_dp = dst.topology.dp_rank
    out: list[_PairPlan | _Deferred] = []
    for (svi, dvi), positions in pairs.items():
        sv, dv = st.views[svi], dt.views[dvi]
        try:
            kind = select_mapper_kind(sv, dv)
        except PoolMismatchError as exc:
            out.append(_Deferred(PoolMismatchError, str(exc)))
            break
        if sv.buffers_per_layer != dv.buffers_per_layer or sv.is_state != dv.is_state:
            out.append(
                _Deferred(
                    PoolMismatchError,
                    f"view {sv.role!r}: buffers_per_layer/tokens_per_slot differ: source "
                    f"{sv.buffers_per_layer}/{sv.tokens_per_slot}, destination "
                    f"{dv.buffers_per_layer}/{dv.tokens_per_slot}",
                )
            )
            break
        if sv.group != dv.group:
            out.append(
                _Deferred(
                    PoolMismatchError,
                    f"view {sv.role!r} layers {sorted(set(sv.layers) & set(dv.layers))[:8]}: layer group differs: "
                    f"source {sv.group!r}, destination {dv.group!r}",
                )
            )
            break
        if not owns(sv.sharding, dv.sharding, dst_dp):
            continue
        bf = sv.buffers_per_layer
        pos = np.asarray(positions, dtype=np.int64)
        sub = np.arange(bf, dtype=np.int64)
        s_entries = (pos[:, 0:1] * bf + sub).reshape(-1)
        d_entries = (pos[:, 1:2] * bf + sub).reshape(-1)
        # order entries by (source pool, offset) so each pool's buffers form one run
        s_pools = np.asarray(sv.pools, dtype=np.int64)[s_entries]
        order = np.lexsort((np.asarray(sv.offsets, dtype=np.int64)[s_entries], s_pools))
        s_entries, d_entries, s_pools = s_entries[order], d_entries[order], s_pools[order]
        runs = np.unique(s_pools, return_counts=True)[1]
        group = int(runs[0]) if (runs == runs[0]).all() else 1
        out.append(
            _PairPlan(sv, dv, kind, _Entries.build(st, svi, s_entries), _Entries.build(dt, dvi, d_entries), group)
        )
    return tuple(out)


def plan_transfer(
    src: RankPlacement,
    dst: RankPlacement,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    *,
    mappers: MapperLookup | None = None,
    src_state_slot: int | None = None,
    dst_state_slot: int | None = None,
    sliding_window: int | None = None,
    prompt_len: int | None = None,
    layer_range: tuple[int, int] | None = None,
    merge: bool = True,
    cached_tokens: int = 0,
) -> FragmentPlan:
    """The fragments source rank ``src`` writes into destination rank ``dst`` for one request (merged).

    ``merge=False`` keeps the mapper's fragment order unmerged: the order the
    bounce path packs and unpacks in, which both sides can compute alike.

    Block lists are the resident suffixes of the request's blocks on each side
    (see :func:`align_blocks`; ``cached_tokens`` is the destination's cached
    prefix, 0: it holds none and its lists cover the whole prompt), one per layer group: a mapping ``{group: ids}``
    or, for a table with a single token group, a plain list. Each token view
    uses its group's list; a group a side lacks raises ``MappingError`` naming
    it, and a shared layer in different groups on the two sides raises
    ``PoolMismatchError``. State views (Mamba) use the state slots; a pair
    without state views ignores them. Views
    are matched by ``(global layer, role)``; roles or mapper kinds that differ
    raise ``PoolMismatchError``. Only bytes ``src`` owns for ``dst`` are planned
    (:func:`kvcore.layout.peer.owns`); the result may be empty. ``layer_range``
    restricts to global layers ``[start, stop)`` (layer-wise slices).
    """
    if mappers is None:
        from kvcore.extension.plugins import get_plugin_manager

        mappers = get_plugin_manager().layout_mappers
    steps, src_groups, dst_groups = _pair_plans(src, dst, mappers, layer_range)  # raises the topology errors
    st, dt = src.page_table, dst.page_table
    s_groups = _group_ids(src_block_ids, st, "src_block_ids", src_groups)
    d_groups = _group_ids(dst_block_ids, dt, "dst_block_ids", dst_groups)
    plans: list[FragmentPlan] = []
    state_plans: list[FragmentPlan] = []
    for pp in steps:
        if isinstance(pp, _Deferred):
            raise pp.cls(pp.message)  # a layout error, raised where the uncached planner raised it
        sv, dv = pp.sv, pp.dv
        if sv.is_state:
            if src_state_slot is None or dst_state_slot is None:
                raise MappingError(
                    f"view {sv.role!r} holds per-request state: src_state_slot and dst_state_slot needed"
                )
            sb, db = np.array([src_state_slot], np.int64), np.array([dst_state_slot], np.int64)
        else:
            if sv.tokens_per_slot != dv.tokens_per_slot:
                raise PoolMismatchError(
                    f"view {sv.role!r} tokens_per_slot: source {sv.tokens_per_slot}, destination {dv.tokens_per_slot}"
                )
            s_ids, d_ids = s_groups.get(sv.group), d_groups.get(dv.group)
            if s_ids is None or d_ids is None:
                side, have = ("source", s_groups) if s_ids is None else ("destination", d_groups)
                raise MappingError(
                    f"{side} block ids: expected ids for layer group {sv.group!r} (view {sv.role!r}), "
                    f"got ids for {sorted(have)}"
                )
            window = sv.window if sv.window is not None else sliding_window
            tps = sv.tokens_per_slot
            assert tps is not None  # a token view
            sb, db = align_blocks(s_ids, d_ids, tps, prompt_len=prompt_len, window=window, cached_tokens=cached_tokens)
            if not len(sb):
                continue
        sa, da = pp.src.addresses(st, sb), pp.dst.addresses(dt, db)
        if pp.frags is not None and type(_mapper(pp.kind, mappers, sv.role)) is pp.frags[0]:
            frag = _outer(pp.frags[1:], sa, da, pp.group)
        else:
            frag = _mapper(pp.kind, mappers, sv.role).map(ViewPair(sv, dv, sa, da, group=pp.group))
        (state_plans if sv.is_state else plans).append(frag)
    if state_plans:
        state = FragmentPlan.concat(state_plans)
        if merge:
            # a slot's state is a handful of fragments spread over views (conv rows of x and of B|C, SSM);
            # in address order the ones adjacent in memory (one vLLM page) merge into one
            order = np.argsort(state.src, kind="stable")
            state = FragmentPlan(state.src[order], state.dst[order], state.sizes[order])
        plans.append(state)
    plan = FragmentPlan.concat(plans)
    return plan.merge_contiguous() if merge else plan
