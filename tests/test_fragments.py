"""``kvcore.transport.fragments.merge_runs``: the one fragment-merge helper every planner and agent uses."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.transport.fragments import merge_runs

U64 = np.uint64


def _copy(src_mem: np.ndarray, a: np.ndarray, b: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """What a transport would write: fragment i copies src_mem[a[i]:a[i]+n] to out[b[i]:b[i]+n] (offsets)."""
    out = np.zeros_like(src_mem)
    for s, d, n in zip(a.tolist(), b.tolist(), sizes.tolist()):
        out[d : d + n] = src_mem[s : s + n]
    return out


def test_contiguous_neighbours_merge_and_order_is_kept() -> None:
    a = np.array([0, 4, 8, 20, 24], dtype=U64)
    b = np.array([100, 104, 108, 50, 54], dtype=U64)
    sizes = np.array([4, 4, 4, 4, 8], dtype=U64)
    ma, mb, ms, keys = merge_runs(a, b, sizes)
    assert (ma.tolist(), mb.tolist(), ms.tolist(), keys) == ([0, 20], [100, 50], [12, 12], [])
    assert ms.dtype == U64


def test_contiguous_on_one_side_only_does_not_merge() -> None:
    a = np.array([0, 4], dtype=U64)
    b = np.array([0, 8], dtype=U64)  # a gap on the destination side
    sizes = np.array([4, 4], dtype=U64)
    ma, mb, ms, _ = merge_runs(a, b, sizes)
    assert ma is a and mb is b and ms is sizes  # nothing merged: the inputs themselves come back


def test_keys_split_runs() -> None:
    a = np.array([0, 4, 8], dtype=U64)
    b = np.array([0, 4, 8], dtype=U64)
    sizes = np.array([4, 4, 4], dtype=U64)
    region = np.array([1, 1, 2])  # the third fragment lies in another registration
    ma, mb, ms, (k,) = merge_runs(a, b, sizes, region)
    assert (ma.tolist(), mb.tolist(), ms.tolist(), k.tolist()) == ([0, 8], [0, 8], [8, 4], [1, 2])


@pytest.mark.parametrize("seed", range(5))
def test_merged_plan_moves_exactly_the_same_bytes(seed: int) -> None:
    """Random plans with runs: the merged plan writes the destination byte for byte like the original."""
    rng = np.random.default_rng(seed)
    n, unit = 200, 16
    slots = rng.permutation(n)
    # sort by destination so that neighbours are often contiguous on both sides
    order = np.sort(rng.choice(n, size=n // 2, replace=False))
    a = (order * unit).astype(U64)
    b = (np.sort(slots[: n // 2]) * unit).astype(U64)
    b[::3] = (order[::3] * unit).astype(U64)  # some runs contiguous on both sides
    sizes = np.full(a.size, unit, dtype=U64)
    src = rng.integers(0, 255, size=n * unit, dtype=np.uint8)
    ma, mb, ms, _ = merge_runs(a, b, sizes)
    assert int(ms.sum()) == int(sizes.sum()) and ms.size <= sizes.size
    np.testing.assert_array_equal(_copy(src, ma, mb, ms), _copy(src, a, b, sizes))


def test_empty_and_single() -> None:
    e = np.zeros(0, dtype=U64)
    assert merge_runs(e, e, e)[2].size == 0
    one = np.array([5], dtype=U64)
    assert merge_runs(one, one, one)[2].tolist() == [5]
