"""Arithmetic on fragment lists (parallel numpy arrays of source address, destination address, size).

One place for what every planner and transport needs: merging neighbours that
continue each other on both sides, so fewer, larger fragments reach the
transport. Used by ``kvcore.layout.mapping`` (plans), the built-in shm agent and the
transport plugins; it imports nothing from kvcore.
"""

from __future__ import annotations

import numpy as np

__all__ = ["merge_runs"]

#: Below this many fragments the merge runs in plain Python: a numpy call on a tiny array costs more than the
#: whole loop (a one-block request: 2 fragments, 4 numpy calls of about 1-4 us each, one of them ``reduceat``).
_SMALL = 16


def merge_runs(
    a: np.ndarray, b: np.ndarray, sizes: np.ndarray, *keys: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """Merge neighbouring fragments contiguous on both sides (and equal in every ``keys`` array); order kept.

    Fragment ``i`` joins fragment ``i-1`` when ``a[i] == a[i-1] + sizes[i-1]``, the same holds for ``b``, and
    every ``keys[k][i] == keys[k][i-1]`` (a registration index, say: a run must not cross two registrations).
    Returns ``(a, b, sizes, keys)`` of the merged runs, each key array taken at the first fragment of its run.
    When nothing merges, the inputs come back as they are (the same array objects), so a caller can test
    ``merged_sizes is sizes`` to skip work. The bytes described are unchanged: same pairs of ranges.
    """
    n = sizes.size
    if n < 2:
        return a, b, sizes, list(keys)
    if n <= _SMALL:
        return _merge_small(a, b, sizes, keys)
    joins = (a[1:] == a[:-1] + sizes[:-1]) & (b[1:] == b[:-1] + sizes[:-1])
    for k in keys:
        joins &= k[1:] == k[:-1]
    if not joins.any():
        return a, b, sizes, list(keys)
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    return a[first], b[first], np.add.reduceat(sizes, first), [k[first] for k in keys]


def _merge_small(
    a: np.ndarray, b: np.ndarray, sizes: np.ndarray, keys: tuple[np.ndarray, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """:func:`merge_runs` for a few fragments, in Python integers (the same result, the same identity rule)."""
    al, bl, sl = a.tolist(), b.tolist(), sizes.tolist()
    kl = [k.tolist() for k in keys]
    first = [0]
    merged = list(sl[:1])
    for i in range(1, len(sl)):
        if al[i] == al[i - 1] + sl[i - 1] and bl[i] == bl[i - 1] + sl[i - 1] and all(k[i] == k[i - 1] for k in kl):
            merged[-1] += sl[i]
        else:
            first.append(i)
            merged.append(sl[i])
    if len(first) == len(sl):
        return a, b, sizes, list(keys)
    idx = np.array(first, dtype=np.intp)
    return a[idx], b[idx], np.array(merged, dtype=sizes.dtype), [k[idx] for k in keys]
