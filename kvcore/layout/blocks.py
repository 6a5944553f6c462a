"""A request's block ids per layer group and its state slot, checked against a page table.

An engine names a request's cache with one block-id list per layer group (vLLM's
KV cache groups, TensorRT-LLM's layer groups: e.g. ``"full"`` and ``"swa"``) and,
for hybrid models, one state slot. Both arrive here before anything is planned:

* a ``Mapping[str, Sequence[int]]`` gives each group its list;
* a plain sequence (or array) means the table's only token group, so code
  written before layer groups keeps working;
* a rank whose table holds no token views (a PP stage of Mamba layers only)
  ignores whatever block ids it is given, and a rank without state views
  ignores the state slot: every rank of an instance can be called alike.

Errors are ``LayoutError`` naming the argument, the group, the expected and the
actual value.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from kvcore.errors import LayoutError, MessageDecodeError
from kvcore.layout.page import PageTable, check_group_name, table_bytes

__all__ = [
    "MAX_GROUPS",
    "BlockIds",
    "as_id_array",
    "decode_group_ids",
    "encode_group_ids",
    "normalize_block_ids",
    "normalize_state_slot",
]

#: Bound on layer groups in one request's block ids (a message from a peer carrying more is refused).
MAX_GROUPS = 64

#: What an engine passes as a request's block ids: one list (the only group) or one list per group name.
BlockIds = Sequence[int] | np.ndarray | Mapping[str, Sequence[int] | np.ndarray]


_I64 = np.dtype(np.int64)


def as_id_array(value: object, what: str) -> np.ndarray:
    """``value`` as a flat int64 array; ``LayoutError`` for nested lists, bools, floats or other non-integers."""
    if type(value) is np.ndarray and value.dtype == _I64 and value.ndim == 1:
        return value  # already what this returns (the transceiver's own normalized ids: every request)
    if value is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(value, (str, bytes, Mapping)):
        raise LayoutError(f"{what}: expected a sequence of integer block ids, got {type(value).__name__}")
    raw = value if isinstance(value, np.ndarray) else np.asarray(list(value))  # type: ignore[call-overload]
    if raw.ndim != 1:
        raise LayoutError(f"{what}: expected a flat list of block ids, got shape {raw.shape}")
    if raw.size == 0:
        return np.zeros(0, dtype=np.int64)
    if raw.dtype.kind not in "iu":
        bad = next((v for v in raw.tolist() if isinstance(v, bool) or not isinstance(v, int)), raw[0])
        raise LayoutError(f"{what}: expected integer block ids, got {bad!r} ({raw.dtype})")
    return raw.astype(np.int64, copy=False)


#: Largest block id for which duplicates are found with an id-indexed table (8 bytes per slot of address space,
#: faulted in only where ids fall) rather than by sorting.
_MARK_MAX_SLOTS = 1 << 24


def _check_ids(ids: np.ndarray, num_slots: int, what: str) -> None:
    if not ids.size:
        return
    if ids.size <= 64:  # a short request (the common one-block case): plain Python is faster than np.unique's sort
        small = ids.tolist()
        lo, hi = min(small), max(small)
        if lo >= 0 and hi < num_slots and len(set(small)) == len(small):
            return  # the errors below are found (and worded) the same way as for long lists
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_slots:
        raise LayoutError(f"{what}: block ids must be in 0..{num_slots - 1}, got {lo if lo < 0 else hi}")
    if hi < _MARK_MAX_SLOTS:
        # Distinct in O(n), without np.unique's sort (about 10x faster for 4096 ids): write each id's position
        # into a table indexed by id; with a duplicate the later position overwrites the earlier one, which then
        # reads back wrong. np.zeros maps zeroed pages lazily, so only the pages the ids touch cost anything.
        pos = np.arange(ids.size, dtype=np.int64)
        table = np.zeros(hi + 1, dtype=np.int64)
        table[ids] = pos
        if np.array_equal(table[ids], pos):
            return
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != ids.size:
        dup = int(uniq[np.argmax(counts > 1)])
        # a duplicate destination id would let one block overwrite another and still end DONE
        raise LayoutError(f"{what}: block id {dup} appears {int(counts.max())} times; each block may appear once")


def _shared_memory_groups(table: PageTable) -> list[tuple[str, str]]:
    """Pairs of token groups whose views use pools with the same base and slot stride (one id = one memory slot)."""
    keys: dict[str, set[tuple[int, int]]] = {}
    for view in table.views:
        if not view.is_state:
            keys.setdefault(view.group, set()).update(
                (table.pools[p].base, table.pools[p].slot_stride) for p in view.pools
            )
    names = sorted(keys)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if keys[a] & keys[b]]


class _TableFacts(NamedTuple):
    """What checking a request's block ids needs of a page table, worked out once per table."""

    groups: tuple[str, ...]  # the token groups, sorted (PageTable.groups)
    slots: dict[str, int]  # group -> valid ids (PageTable.group_slots)
    shared: tuple[tuple[str, str], ...]  # groups whose pools share memory


#: Tables whose facts are kept (this rank's and its peers'): at most this many, and this many bytes of tables kept
#: alive by the memo (``table_bytes`` estimates); the oldest goes first.
_FACTS_ENTRIES = 64
_FACTS_BYTES = 16 * 1024 * 1024
_facts: dict[int, tuple[PageTable, _TableFacts, int]] = {}
_facts_bytes = 0
_facts_lock = threading.Lock()


def _table_facts(table: PageTable) -> _TableFacts:
    """``table``'s groups, slots and shared-memory pairs (a request's ids are checked against them per request)."""
    global _facts_bytes
    hit = _facts.get(id(table))
    if hit is not None and hit[0] is table:
        return hit[1]
    names = tuple(table.groups())
    facts = _TableFacts(names, {g: table.group_slots(g) for g in names}, tuple(_shared_memory_groups(table)))
    size = table_bytes(table)
    with _facts_lock:
        old = _facts.pop(id(table), None)  # another table under a reused id (the old one is gone), or a race
        if old is not None:
            _facts_bytes -= old[2]
        while _facts and (len(_facts) >= _FACTS_ENTRIES or _facts_bytes + size > _FACTS_BYTES):
            _facts_bytes -= _facts.pop(next(iter(_facts)))[2]
        if size <= _FACTS_BYTES:
            _facts[id(table)] = (table, facts, size)
            _facts_bytes += size
    return facts


def normalize_block_ids(value: object, page_table: PageTable, what: str = "block_ids") -> dict[str, np.ndarray]:
    """A request's block ids as ``{group: int64 array}`` for every token group of ``page_table``; ``LayoutError`` if unusable.

    ``value`` is a mapping (group name -> ids), a plain sequence/array (the
    table's only token group; ``LayoutError`` naming the groups when it has
    several) or ``None`` (no blocks). Every group the table holds must be
    present in a mapping (an empty list is fine: e.g. a fully cached prefix);
    names the table does not hold are ignored, since another PP stage may hold
    them. A table without token views returns ``{}`` whatever ``value`` is (after
    its type is checked). Each group's ids must be distinct integers inside the
    group's pools; groups whose pools share memory may not repeat an id.
    """
    facts = _table_facts(page_table)
    groups = facts.groups
    given: dict[str, np.ndarray]
    if isinstance(value, Mapping):
        given = {}
        for name, ids in value.items():
            check_group_name(name, f"{what} group name")
            given[name] = as_id_array(ids, f"{what}[{name!r}]")
        missing = [g for g in groups if g not in given]
        if missing:
            raise LayoutError(
                f"{what}: expected block ids for layer group {missing[0]!r} (this rank holds groups "
                f"{list(groups)}), got ids for {sorted(given)}"
            )
    else:
        ids = as_id_array(value, what)
        if not groups:
            return {}
        if len(groups) > 1:
            raise LayoutError(
                f"{what}: this rank holds layer groups {list(groups)}; expected a mapping of group name to "
                f"block ids, got one list"
            )
        given = {next(iter(groups)): ids}
    out = {name: given[name] for name in groups}
    for name, ids in out.items():
        _check_ids(ids, facts.slots[name], f"{what}[{name!r}]")
    for a, b in facts.shared:
        both = np.intersect1d(out[a], out[b])
        if both.size:
            raise LayoutError(
                f"{what}: block id {int(both[0])} appears in layer groups {a!r} and {b!r}, whose pools share memory"
            )
    return out


def normalize_state_slot(value: object, page_table: PageTable, what: str = "state_slot") -> int | None:
    """The request's state slot, or ``None`` when there is none (``-1``/``None``) or the table has no state views.

    A rank without state views (a PP stage without Mamba layers) ignores any
    integer; otherwise the slot must lie in ``0..state_slots-1``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LayoutError(f"{what}: expected an integer (-1: none), got {value!r}")
    slot = int(value)
    if slot < -1:
        raise LayoutError(f"{what}: expected -1 (none) or a slot >= 0, got {slot}")
    if slot == -1:
        return None  # no state slot: the table's views need not be looked at (every attention-only request)
    slots = page_table.state_slots()
    if slots == 0:
        return None
    if slot >= slots:
        raise LayoutError(f"{what}: expected a slot in 0..{slots - 1}, got {slot}")
    return slot


def encode_group_ids(ids: Mapping[str, np.ndarray]) -> dict[str, bytes]:
    """Per-group block ids as the wire carries them: ``{group: little-endian int64 bytes}``."""
    return {name: np.asarray(v, dtype="<i8").tobytes() for name, v in ids.items()}


def decode_group_ids(raw: Mapping[str, bytes], *, max_blocks: int) -> dict[str, np.ndarray]:
    """Per-group block ids from a peer's message; ``MessageDecodeError`` unless well formed and bounded.

    At most :data:`MAX_GROUPS` groups with valid names, each a multiple of 8
    bytes, at most ``max_blocks`` ids in all. Ranges and duplicates are
    checked afterwards against the peer's page table
    (:func:`normalize_block_ids`).
    """
    if len(raw) > MAX_GROUPS:
        raise MessageDecodeError(f"group_block_ids: expected at most {MAX_GROUPS} groups, got {len(raw)}")
    out: dict[str, np.ndarray] = {}
    total = 0
    for name, data in raw.items():
        try:
            check_group_name(name, "group_block_ids name")
        except LayoutError as exc:
            raise MessageDecodeError(str(exc)) from None
        if not isinstance(data, bytes) or len(data) % 8:
            raise MessageDecodeError(f"group_block_ids[{name!r}]: expected little-endian int64 bytes")
        total += len(data) // 8
        if total > max_blocks:
            raise MessageDecodeError(f"group_block_ids: expected at most {max_blocks} block ids in all, got more")
        out[name] = np.frombuffer(data, dtype="<i8").astype(np.int64)
    return out
