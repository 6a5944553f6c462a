"""Address-range arithmetic of the agent contract: fragment arrays as uint64, merged intervals, containment.

Every fragment an agent submits is checked here against the memory registered on both sides before a byte moves.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from kvcore.errors import TransferError

_U64 = np.dtype(np.uint64)


def _as_u64(name: str, values: Any) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == _U64 and values.ndim == 1:
        return values  # a planner's array: nothing to convert or check (every request's three arrays)
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise TransferError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TransferError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise TransferError(f"{name} holds a negative value ({int(arr.min())})")
    return arr.astype(np.uint64, copy=False)


def merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort and merge overlapping or touching ``[start, end)`` intervals."""
    if starts.size == 0:
        return starts.astype(np.uint64), ends.astype(np.uint64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order].astype(np.uint64), ends[order].astype(np.uint64)
    run_end = np.maximum.accumulate(e)
    new_run = np.ones(s.size, dtype=bool)
    new_run[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new_run)
    last = np.append(idx[1:] - 1, s.size - 1)
    return s[idx], run_end[last]


def ranges_inside(addrs: np.ndarray, sizes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Boolean mask: ``[addr, addr+size)`` lies inside one of the merged intervals ``[starts, ends)``."""
    if addrs.size == 0:
        return np.ones(0, dtype=bool)
    if starts.size == 0:
        return np.zeros(addrs.size, dtype=bool)
    if addrs.size <= 4:  # a one-block request: plain Python beats six numpy calls on one-element arrays
        lo, hi = starts.tolist(), ends.tolist()
        mask = []
        for addr, size in zip(addrs.tolist(), sizes.tolist(), strict=True):
            i = bisect.bisect_right(lo, addr) - 1
            end = addr + size
            mask.append(i >= 0 and end < 2**64 and end <= hi[i])
        return np.array(mask, dtype=bool)
    idx = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    ok = idx >= 0
    safe = np.where(ok, idx, 0)
    end = addrs + sizes
    ok &= end >= addrs  # no wrap-around
    ok &= end <= ends[safe]
    return ok
