"""A bounded walk over msgpack bytes: depth, sizes and counts are checked before any decoder allocates anything.

msgspec decodes nested data recursively; a few KB of nested arrays make it
raise ``RecursionError`` (and an ``Any`` decode of a large frame builds
millions of objects). Every decoder of peer-supplied msgpack in kvcore (control
frames, agent descriptors, transport payloads) calls ``check_msgpack_bounds``
first, so bad input is a typed error and never a crashed thread.
"""

from __future__ import annotations

from kvcore.errors import KvcoreError, ProtocolError

__all__ = ["check_msgpack_bounds", "cannot_exceed_bounds", "MAX_DEPTH", "MAX_CONTAINER_ENTRIES", "MAX_ITEMS"]

#: Bounds on peer-supplied msgpack. The deepest legitimate control message (InstanceInfo -> RankInfo ->
#: PageTable -> PoolView -> ViewSharding -> section_bytes) nests 9 deep.
MAX_DEPTH = 24
#: Entries in one array or map: a page-table view holds at most 65536 entries (page.MAX_ENTRIES_PER_VIEW).
MAX_CONTAINER_ENTRIES = 1 << 17
#: Objects in one message, all levels together.
MAX_ITEMS = 1 << 21


# Bytes that follow a msgpack type byte, for the fixed-size scalars (0xc0..0xdf).
_FIXED: dict[int, int] = {
    0xC0: 0, 0xC2: 0, 0xC3: 0,  # nil, false, true
    0xCA: 4, 0xCB: 8,  # float32, float64
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,  # uint8..64
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,  # int8..64
    0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,  # fixext 1..16 (type byte + data)
}  # fmt: skip
# Length-prefixed bytes (str, bin, ext): width of the length field, and extra bytes (the ext type).
_SIZED: dict[int, tuple[int, int]] = {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),  # bin 8/16/32
    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),  # ext 8/16/32
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),  # str 8/16/32
}  # fmt: skip
# Containers with a length field: width of the field, entries per count (a map entry is a key and a value).
_CONTAINERS: dict[int, tuple[int, int]] = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


#: Above this many bytes ``cannot_exceed_bounds`` answers False at once: its translation costs more than the walk.
_CHEAP_BYTES = 2048

# 1 for every byte value that starts a container (fixmap, fixarray, array 16/32, map 16/32), else 0.
_CONTAINER_STARTS = bytes(1 if 0x80 <= b <= 0x9F or 0xDC <= b <= 0xDF else 0 for b in range(256))


def cannot_exceed_bounds(
    data: bytes,
    *,
    max_depth: int = MAX_DEPTH,
    max_entries: int = MAX_CONTAINER_ENTRIES,
    max_items: int = MAX_ITEMS,
) -> bool:
    """True when ``data`` is too small to break any bound of :func:`check_msgpack_bounds`, whatever it holds.

    A sufficient test at C speed (about 1 µs for a control message, against 10 µs for the walk): an object takes
    at least one byte, so no container or frame of ``n <= min(max_entries, max_items)`` bytes holds more entries
    or objects than the bounds; and every nesting level starts with a container byte, so fewer such byte values
    anywhere in the data (inside strings too: it over-counts, never under-counts) than ``max_depth`` bound the
    depth. It says nothing of well-formedness: the caller's typed decoder must reject truncated, reserved or
    trailing bytes itself (msgspec does, with ``DecodeError``). Data over ``_CHEAP_BYTES`` is answered False at once
    (a 32 KiB RequestData: the translation took 60 µs, the walk takes 12).
    """
    if len(data) > _CHEAP_BYTES:
        return False
    return len(data) <= min(max_entries, max_items) and data.translate(_CONTAINER_STARTS).count(1) < max_depth


def check_msgpack_bounds(
    data: bytes | bytearray | memoryview,
    *,
    max_depth: int = MAX_DEPTH,
    max_entries: int = MAX_CONTAINER_ENTRIES,
    max_items: int = MAX_ITEMS,
    error: type[KvcoreError] = ProtocolError,
    what: str = "",
) -> None:
    """Walk msgpack bytes without building objects; ``error`` unless they hold one bounded object.

    Checked, in one pass with an explicit stack (no recursion): nesting depth
    <= ``max_depth``, entries of one array or map <= ``max_entries``, objects
    in all <= ``max_items``, every declared length inside the data, no
    reserved byte (0xc1) and nothing after the object. ``what`` (e.g. "nixl
    payload of peer 'x'") starts the error message.
    """
    try:
        _walk(data, max_depth, max_entries, max_items)
    except _Invalid as exc:
        raise error(f"{what}: {exc}" if what else str(exc)) from None


class _Invalid(ValueError):
    """Internal: why the walk stopped."""


def _walk(data: bytes | bytearray | memoryview, max_depth: int, max_entries: int, max_items: int) -> None:
    buf = bytes(data) if not isinstance(data, bytes) else data
    end = len(buf)
    if end == 0:
        raise _Invalid("empty msgpack data")
    pos = 0
    items = 0
    stack = [1]  # objects still expected at each open level; the bottom is the top-level object
    while stack:
        if stack[-1] == 0:
            stack.pop()
            continue
        stack[-1] -= 1
        if pos >= end:
            raise _Invalid(f"msgpack data truncated at byte {pos}: an object was expected")
        b = buf[pos]
        pos += 1
        count = -1
        if b <= 0x7F or b >= 0xE0:  # positive / negative fixint
            continue
        if b <= 0x8F:  # fixmap
            count = 2 * (b & 0x0F)
        elif b <= 0x9F:  # fixarray
            count = b & 0x0F
        elif b <= 0xBF:  # fixstr
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            if pos + width > end:
                raise _Invalid(f"msgpack data truncated at byte {pos}: a length field was expected")
            pos += width + extra + int.from_bytes(buf[pos : pos + width], "big")
        elif b in _CONTAINERS:
            width, per = _CONTAINERS[b]
            if pos + width > end:
                raise _Invalid(f"msgpack data truncated at byte {pos}: a length field was expected")
            count = per * int.from_bytes(buf[pos : pos + width], "big")
            pos += width
        else:
            raise _Invalid(f"msgpack byte {b:#04x} at offset {pos - 1} is reserved (never valid)")
        if pos > end:
            raise _Invalid(f"msgpack object at offset {pos} declares more bytes than the {end} present")
        if count >= 0:
            entries = count // 2 if b in (0xDE, 0xDF) or 0x80 <= b <= 0x8F else count
            if entries > max_entries:
                raise _Invalid(f"msgpack container of {entries} entries exceeds the bound of {max_entries}")
            if count > end - pos:  # every object takes at least one byte
                raise _Invalid(f"msgpack container declares {count} objects but only {end - pos} bytes follow")
            items += count
            if items > max_items:
                raise _Invalid(f"msgpack data holds more than {max_items} objects")
            if count:
                if len(stack) >= max_depth:
                    raise _Invalid(f"msgpack nesting deeper than {max_depth} levels")
                stack.append(count)
    if pos != end:
        raise _Invalid(f"{end - pos} trailing byte(s) after the msgpack object")
