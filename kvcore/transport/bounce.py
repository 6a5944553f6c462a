"""The bounce path: many small fragments become one contiguous write.

Token-major head mismatch produces one fragment per token (hundreds of
thousands per request); per-descriptor costs then dominate. With bounce, the
generation rank leases a contiguous range of a registered *arena* per writer
and says so in ``RequestData``; the context rank gathers its fragments, in the
unmerged plan order both sides compute alike, into a registered *staging*
buffer and issues one write into the lease; after every writer reported, the
generation rank scatters the lease into the KV pools. A plan digest sent with
the request guarantees both sides packed the same order; on any disagreement
the writer falls back to direct fragments (never a silent mismatch).

Leases are released only when every writer of the request is terminal (the
session is quiescent); a cancelled or timed-out request keeps its lease
quarantined until then. Host memory (DRAM) only.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from dataclasses import dataclass

import numpy as np

__all__ = ["Arena", "gather", "scatter", "plan_digest", "wants_bounce"]

_ALIGN = 256


def plan_digest(dst: np.ndarray, sizes: np.ndarray) -> bytes:
    """A 16-byte digest of a plan's destination side; equal digests mean equal packing order."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(dst, dtype=np.uint64).tobytes())
    h.update(np.ascontiguousarray(sizes, dtype=np.uint64).tobytes())
    return h.digest()


def wants_bounce(count: int, nbytes: int, *, min_fragments: int, max_fragment_bytes: int) -> bool:
    """The documented rule: at least ``min_fragments`` fragments averaging at most ``max_fragment_bytes``."""
    return count >= min_fragments and count > 0 and nbytes / count <= max_fragment_bytes


def _row_index(addrs: np.ndarray, sizes: np.ndarray) -> tuple[int, int, np.ndarray]:
    """``(base, row_bytes, rows)``: the fragments as whole rows of ``row_bytes`` counted from ``base``."""
    base = int(addrs.min())
    rel = addrs - np.uint64(base)
    g = int(np.gcd.reduce(np.concatenate([sizes, rel[rel > 0]]).astype(np.uint64)))
    g = max(g, 1)
    starts = (rel // np.uint64(g)).astype(np.int64)
    counts = (sizes // np.uint64(g)).astype(np.int64)
    total = int(counts.sum())
    first = np.cumsum(counts) - counts  # where each fragment's rows start in packed order
    rows = np.arange(total, dtype=np.int64) + np.repeat(starts - first, counts)
    return base, g, rows


def _view(address: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def gather(src: np.ndarray, sizes: np.ndarray, out_address: int) -> None:
    """Pack the DRAM fragments ``(src, sizes)`` back to back at ``out_address`` (vectorized, row-granular)."""
    if not sizes.size:
        return
    base, g, rows = _row_index(src, sizes)
    span = int((src + sizes).max()) - base
    memory = _view(base, span).reshape(-1, g)
    out = _view(out_address, rows.size * g).reshape(-1, g)
    np.take(memory, rows, axis=0, out=out)


def scatter(in_address: int, dst: np.ndarray, sizes: np.ndarray) -> None:
    """Unpack bytes packed at ``in_address`` into the DRAM fragments ``(dst, sizes)``."""
    if not sizes.size:
        return
    base, g, rows = _row_index(dst, sizes)
    span = int((dst + sizes).max()) - base
    memory = _view(base, span).reshape(-1, g)
    packed = _view(in_address, rows.size * g).reshape(-1, g)
    memory[rows] = packed


@dataclass
class _Lease:
    offset: int
    nbytes: int


class Arena:
    """First-fit leases over one registered buffer; thread-safe. ``lease`` returns None when full."""

    def __init__(self, address: int, capacity: int) -> None:
        self.address = address
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, length), sorted, coalesced
        self._leases: dict[int, _Lease] = {}
        self._lock = threading.Lock()

    def lease(self, nbytes: int) -> int | None:
        """Offset of a fresh lease of ``nbytes`` (aligned), or None if no free range fits."""
        need = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, length - need)
                    self._leases[off] = _Lease(off, need)
                    return off
        return None

    def release(self, offset: int) -> None:
        """Return a lease; unknown offsets raise ``KeyError`` (a double release is a bug)."""
        with self._lock:
            lease = self._leases.pop(offset)
            self._free.append((lease.offset, lease.nbytes))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((off, length))
            self._free = merged

    @property
    def leased(self) -> int:
        """Live leases (leak checks)."""
        with self._lock:
            return len(self._leases)
