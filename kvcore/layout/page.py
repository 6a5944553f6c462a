"""A cache-manager-independent description of one rank's KV storage; turns block ids into addresses.

Model (see docs in each class):

* A :class:`Pool` is a run of equally strided *slots* in memory: slot ``s``
  starts at ``base + s*slot_stride`` and is ``slot_bytes`` long. A slot holds
  one KV block (token views) or one request's state (state views).
* A :class:`PoolView` is one logical kind of data (its opaque ``role``: ``kv``,
  ``mla``, ``mamba_conv``, ``mamba_ssm``, ...) for a set of global layers. It
  is a list of *entries*, ``buffers_per_layer`` per layer (K and V for ``kv``),
  each ``buffer_bytes`` long at ``offsets[e]`` inside a slot of pool
  ``pools[e]``. Entry ``e`` belongs to layer ``layers[e // buffers_per_layer]``.
* A :class:`ViewSharding` declares how one buffer is laid out and sharded over the
  attention TP group (kind, shard count/index, replica count/index, unit bytes,
  section bytes). Mappers read only this, never TP sizes.

The table is a msgspec struct, so it travels in msgpack as is; ``decode``
bounds the input size and the table bounds its own counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from kvcore.errors import LayoutError

__all__ = [
    "DEFAULT_GROUP",
    "MAX_GROUP_NAME",
    "MAX_ENTRIES_PER_VIEW",
    "MAX_POOLS",
    "MAX_TABLE_BYTES",
    "MAX_VIEWS",
    "PageTable",
    "Pool",
    "PoolView",
    "SHARDING_KINDS",
    "ViewSharding",
    "check_group_name",
    "table_bytes",
]

HEAD_MAJOR = "head_major_sharded"
TOKEN_MAJOR = "token_major_sharded"
REPLICATED = "replicated"
SECTIONED = "sectioned"
#: The kinds of sharding a view may declare (:attr:`ViewSharding.kind`).
SHARDING_KINDS = (HEAD_MAJOR, TOKEN_MAJOR, REPLICATED, SECTIONED)

#: The layer group of views whose builder named none; a plain block-id list means this group.
DEFAULT_GROUP = "default"
#: Longest layer-group name (characters).
MAX_GROUP_NAME = 64
MAX_POOLS = 16384
MAX_VIEWS = 1024
MAX_ENTRIES_PER_VIEW = 65536
#: Bound on an encoded table accepted from a peer.
MAX_TABLE_BYTES = 16 * 1024 * 1024


def check_group_name(name: object, what: str = "group") -> str:
    """``name`` if it is a usable layer-group name (1..64 printable characters), else ``LayoutError``."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_GROUP_NAME or not name.isprintable():
        shown = repr(name) if not isinstance(name, str) else repr(name[:80])
        raise LayoutError(f"{what}: expected a name of 1..{MAX_GROUP_NAME} printable characters, got {shown}")
    return name


class ViewSharding(msgspec.Struct, frozen=True, kw_only=True):
    """How one buffer of a view is laid out and sharded; the only thing mappers read.


    Kinds:

    ``head_major_sharded``  buffer = ``[units][...]``: the rank's shard of the units
        (KV heads, SSM heads) is one contiguous run; ``unit_bytes`` = bytes of one
        unit. Re-sharding slices the buffer at unit granularity.
    ``token_major_sharded`` buffer = ``rows`` rows (tokens) of ``[units][...]``;
        ``unit_bytes`` = bytes of one unit in one row. Re-sharding slices every row.
    ``replicated``          every rank of the group holds the same bytes
        (``num_shards == 1``; ``num_replicas`` = group size).
    ``sectioned``           buffer = sections of ``section_bytes[i]`` bytes each (this
        rank's share); every section is sharded on its own, contiguously.

    The group of ``num_shards*num_replicas`` ranks holds ``num_shards`` distinct
    shards; ``shard_index = group_rank // num_replicas``,
    ``replica_index = group_rank % num_replicas``.
    """

    kind: str
    num_shards: int = 1
    shard_index: int = 0
    num_replicas: int = 1
    replica_index: int = 0
    unit_bytes: int = 0
    rows: int = 1
    section_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in SHARDING_KINDS:
            raise LayoutError(f"sharding kind: expected one of {list(SHARDING_KINDS)}, got {self.kind!r}")
        if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
            raise LayoutError(f"shard_index: expected 0 <= shard_index < {self.num_shards}, got {self.shard_index}")
        if self.num_replicas < 1 or not 0 <= self.replica_index < self.num_replicas:
            raise LayoutError(
                f"replica_index: expected 0 <= replica_index < {self.num_replicas}, got {self.replica_index}"
            )
        if self.kind == REPLICATED and self.num_shards != 1:
            raise LayoutError(f"num_shards: expected 1 for replicated sharding, got {self.num_shards}")
        if self.kind in (HEAD_MAJOR, TOKEN_MAJOR) and self.unit_bytes < 1:
            raise LayoutError(f"unit_bytes: expected >= 1 for {self.kind}, got {self.unit_bytes}")
        if self.rows < 1:
            raise LayoutError(f"rows: expected >= 1, got {self.rows}")
        if self.kind == SECTIONED and (not self.section_bytes or min(self.section_bytes) < 1):
            raise LayoutError(
                f"section_bytes: expected positive sizes for sectioned sharding, got {self.section_bytes}"
            )
        if not isinstance(self.section_bytes, tuple):
            msgspec.structs.force_setattr(self, "section_bytes", tuple(self.section_bytes))

    @property
    def group_size(self) -> int:
        return self.num_shards * self.num_replicas

    def check_buffer(self, buffer_bytes: int) -> None:
        """Raise ``LayoutError`` unless a buffer of ``buffer_bytes`` fits this declaration."""
        if self.kind == HEAD_MAJOR and buffer_bytes % self.unit_bytes:
            raise LayoutError(f"buffer_bytes: expected a multiple of unit_bytes {self.unit_bytes}, got {buffer_bytes}")
        if self.kind == TOKEN_MAJOR and buffer_bytes % (self.rows * self.unit_bytes):
            raise LayoutError(
                f"buffer_bytes: expected a multiple of rows*unit_bytes {self.rows * self.unit_bytes}, got {buffer_bytes}"
            )
        if self.kind == SECTIONED and sum(self.section_bytes) != buffer_bytes:
            raise LayoutError(
                f"section_bytes: expected a sum of buffer_bytes {buffer_bytes}, got {list(self.section_bytes)}"
            )

    def shape_key(self) -> tuple[object, ...]:
        """Everything except this rank's shard/replica indices: equal keys mean an identical per-buffer sharding."""
        return (self.kind, self.num_shards, self.num_replicas, self.unit_bytes, self.rows, self.section_bytes)


class Pool(msgspec.Struct, frozen=True, kw_only=True):
    """A run of ``num_slots`` slots: slot ``s`` is ``[base + s*slot_stride, +slot_bytes)``."""

    base: int
    slot_bytes: int
    slot_stride: int
    num_slots: int

    def __post_init__(self) -> None:
        if self.base < 0:
            raise LayoutError(f"pool base: expected a non-negative address, got {self.base}")
        if self.slot_bytes < 1 or self.num_slots < 1:
            raise LayoutError(
                f"pool: expected slot_bytes >= 1 and num_slots >= 1, got {self.slot_bytes} and {self.num_slots}"
            )
        if self.num_slots > 1 and self.slot_stride < self.slot_bytes:
            raise LayoutError(f"slot_stride: expected >= slot_bytes ({self.slot_bytes}), got {self.slot_stride}")

    @property
    def nbytes(self) -> int:
        """Bytes from the first slot's start to the last slot's end."""
        return (self.num_slots - 1) * self.slot_stride + self.slot_bytes

    def slot_addresses(self, block_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Start address of each slot in ``block_ids`` (uint64); ids outside ``[0, num_slots)`` raise ``LayoutError``."""
        ids = np.asarray(block_ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise LayoutError(f"block ids: expected integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        bad = (ids < 0) | (ids >= self.num_slots)
        if bad.any():
            shown = ids[bad][:16].tolist()
            raise LayoutError(
                f"block ids: expected 0 <= id < {self.num_slots} (num_slots), got {shown}"
                + (f" and {int(bad.sum()) - 16} more" if bad.sum() > 16 else "")
            )
        return np.uint64(self.base) + ids.astype(np.uint64) * np.uint64(self.slot_stride)


class PoolView(msgspec.Struct, frozen=True, kw_only=True):
    """One role's buffers for a set of global layers: entry ``e`` is layer ``layers[e // buffers_per_layer]``.

    ``tokens_per_slot`` is the tokens one slot holds (a KV block), or ``None``
    for state views (one slot per request). ``window`` is the sliding-window
    size in tokens for windowed attention layers, else ``None``. ``mapper`` is
    the mapper kind both peers must declare for this role (see kvcore.layout.mapping).

    ``group`` names the layer group the view belongs to (vLLM's KV cache group,
    TensorRT-LLM's layer group): token views of one group share one block-id
    list per request, each group its own (e.g. ``"full"`` and ``"swa"``).
    Both peers must put a shared layer in the same group.

    ``sharding`` travels under the wire key ``layout``.
    """

    role: str
    mapper: str
    layers: tuple[int, ...]
    buffers_per_layer: int
    buffer_bytes: int
    pools: tuple[int, ...]
    offsets: tuple[int, ...]
    sharding: ViewSharding = msgspec.field(name="layout")
    tokens_per_slot: int | None = None
    window: int | None = None
    dtype: str = ""  # element type of the buffers ("" when the builder does not say): peers must agree
    group: str = DEFAULT_GROUP

    def __post_init__(self) -> None:
        check_group_name(self.group, f"view {self.role!r} group")
        for name in ("layers", "pools", "offsets"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                msgspec.structs.force_setattr(self, name, tuple(value))
        if not self.role or not self.mapper:
            raise LayoutError(f"view: expected a non-empty role and mapper kind, got {self.role!r}, {self.mapper!r}")
        if self.buffers_per_layer < 1 or self.buffer_bytes < 1:
            raise LayoutError(
                f"view {self.role!r}: expected buffers_per_layer >= 1 and buffer_bytes >= 1, "
                f"got {self.buffers_per_layer} and {self.buffer_bytes}"
            )
        n = len(self.layers) * self.buffers_per_layer
        if n > MAX_ENTRIES_PER_VIEW:
            raise LayoutError(f"view {self.role!r}: expected at most {MAX_ENTRIES_PER_VIEW} entries, got {n}")
        if len(self.pools) != n or len(self.offsets) != n:
            raise LayoutError(
                f"view {self.role!r}: expected {n} pools and offsets (layers*buffers_per_layer), "
                f"got {len(self.pools)} and {len(self.offsets)}"
            )
        if len(set(self.layers)) != len(self.layers) or any(layer < 0 for layer in self.layers):
            raise LayoutError(f"view {self.role!r} layers: expected distinct non-negative ids, got {list(self.layers)}")
        if self.tokens_per_slot is not None and self.tokens_per_slot < 1:
            raise LayoutError(f"tokens_per_slot: expected >= 1 or None, got {self.tokens_per_slot}")
        if self.window is not None and self.window < 1:
            raise LayoutError(f"window: expected >= 1 or None, got {self.window}")
        self.sharding.check_buffer(self.buffer_bytes)

    @property
    def num_entries(self) -> int:
        return len(self.layers) * self.buffers_per_layer

    @property
    def is_state(self) -> bool:
        """True for state views (one slot per request), False for token (block) views."""
        return self.tokens_per_slot is None


class PageTable(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's KV storage: pools and the views over them. Serializable with msgspec msgpack."""

    pools: tuple[Pool, ...]
    views: tuple[PoolView, ...]

    def __post_init__(self) -> None:
        for name in ("pools", "views"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                msgspec.structs.force_setattr(self, name, tuple(value))
        if len(self.pools) > MAX_POOLS:
            raise LayoutError(f"pools: expected at most {MAX_POOLS}, got {len(self.pools)}")
        if len(self.views) > MAX_VIEWS:
            raise LayoutError(f"views: expected at most {MAX_VIEWS}, got {len(self.views)}")
        seen: dict[tuple[int, str], int] = {}
        for vi, view in enumerate(self.views):
            for pool_idx, off in zip(view.pools, view.offsets):
                if not 0 <= pool_idx < len(self.pools):
                    raise LayoutError(f"view {view.role!r}: pool index expected < {len(self.pools)}, got {pool_idx}")
                slot = self.pools[pool_idx].slot_bytes
                if off < 0 or off + view.buffer_bytes > slot:
                    raise LayoutError(
                        f"view {view.role!r}: buffer [{off}, {off + view.buffer_bytes}) expected inside "
                        f"slot_bytes {slot} of pool {pool_idx}"
                    )
            for layer in view.layers:
                other = seen.setdefault((layer, view.role), vi)
                if other != vi:
                    raise LayoutError(
                        f"layer {layer} role {view.role!r}: expected in one view, got views {other} and {vi}"
                    )

    # --- addresses --------------------------------------------------------------------------

    def block_addresses(self, pool: int, block_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Slot start address of each block id in pool ``pool`` (vectorized); invalid ids raise ``LayoutError``."""
        if not 0 <= pool < len(self.pools):
            raise LayoutError(f"pool: expected 0 <= pool < {len(self.pools)}, got {pool}")
        return self.pools[pool].slot_addresses(block_ids)

    def entry_addresses(self, view: int, entries: np.ndarray, block_ids: np.ndarray) -> np.ndarray:
        """Address of buffer ``entries[i]`` of view ``view`` in slot ``block_ids[j]``, shape ``(len(entries), len(block_ids))``."""
        v = self.views[view]
        entries = np.asarray(entries, dtype=np.int64)
        pool_idx = np.asarray(v.pools, dtype=np.int64)[entries]
        offsets = np.asarray(v.offsets, dtype=np.uint64)[entries]
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        used = np.unique(pool_idx).tolist()
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            for p in used:
                if lo < 0 or hi >= self.pools[p].num_slots:
                    self.pools[p].slot_addresses(ids)  # raises, naming the bad ids
        base = np.fromiter((p.base for p in self.pools), dtype=np.uint64, count=len(self.pools))
        stride = np.fromiter((p.slot_stride for p in self.pools), dtype=np.uint64, count=len(self.pools))
        start = base[pool_idx] + offsets
        out: np.ndarray = start[:, None] + ids.astype(np.uint64)[None, :] * stride[pool_idx][:, None]
        return out

    def regions(self) -> list[tuple[int, int]]:
        """Every ``(address, length)`` the table covers, sorted, overlapping ranges merged.

        Adjacent but separate ranges stay separate: they may be different
        allocations (shm segments, CUDA allocations) that cannot be registered as one.

        Register exactly these with the transfer agent.
        """
        spans = sorted((p.base, p.base + p.nbytes) for p in self.pools)
        merged: list[list[int]] = []
        for start, stop in spans:
            if merged and start < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        return [(start, stop - start) for start, stop in merged]

    # --- queries -----------------------------------------------------------------------------

    def layers(self) -> set[int]:
        """Every global layer any view holds."""
        return {layer for view in self.views for layer in view.layers}

    def roles(self) -> set[str]:
        return {view.role for view in self.views}

    def groups(self) -> dict[str, tuple[int, ...]]:
        """Layer groups of the token (block) views: name -> the sorted global layers this table holds of it.

        State views (one slot per request) are not listed: they take the state
        slot, not block ids. A table without token views has no groups.
        """
        out: dict[str, set[int]] = {}
        for view in self.views:
            if not view.is_state:
                out.setdefault(view.group, set()).update(view.layers)
        return {name: tuple(sorted(layers)) for name, layers in sorted(out.items())}

    def group_slots(self, group: str) -> int:
        """Block ids valid in token group ``group``: the fewest slots of any pool its views use (0 if none)."""
        pools = {p for v in self.views if not v.is_state and v.group == group for p in v.pools}
        return min((self.pools[p].num_slots for p in pools), default=0)

    def state_slots(self) -> int:
        """State slots valid in every state view: the fewest slots of their pools (0 without state views)."""
        pools = {p for v in self.views if v.is_state for p in v.pools}
        return min((self.pools[p].num_slots for p in pools), default=0)

    # --- composition and wire ----------------------------------------------------------------

    @staticmethod
    def combine(tables: Iterable[PageTable]) -> PageTable:
        """One table holding the pools and views of all ``tables`` (e.g. attention KV + Mamba state)."""
        pools: list[Pool] = []
        views: list[PoolView] = []
        for table in tables:
            shift = len(pools)
            pools.extend(table.pools)
            for view in table.views:
                views.append(msgspec.structs.replace(view, pools=tuple(p + shift for p in view.pools)))
        return PageTable(pools=tuple(pools), views=tuple(views))

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes, *, max_bytes: int = MAX_TABLE_BYTES) -> PageTable:
        """Decode a table from msgpack; over ``max_bytes`` or malformed raises ``LayoutError``."""
        if len(data) > max_bytes:
            raise LayoutError(f"page table: expected at most {max_bytes} bytes encoded, got {len(data)}")
        try:
            return msgspec.msgpack.decode(data, type=PageTable)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise LayoutError(f"page table: could not decode: {exc}") from exc


def table_bytes(table: PageTable | None) -> int:
    """An upper estimate of what ``table`` takes in memory: its tuples of Python ints, its pools and views (the
    caches that keep peers' tables alive count them with it)."""
    if table is None:
        return 0
    ints = sum(len(v.layers) + len(v.pools) + len(v.offsets) for v in table.views)
    return 36 * ints + 512 * (len(table.views) + len(table.pools)) + 256
