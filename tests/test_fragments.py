"""``kvcore.transport.fragments.merge_runs``: the one fragment-merge helper every planner and agent uses."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.transport.agent import ranges_inside
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


def _reference_merge(a: np.ndarray, b: np.ndarray, s: np.ndarray, k: np.ndarray) -> list[list[int]]:
    """The merge from its definition, one fragment at a time in Python integers (no kvcore code)."""
    out: list[list[int]] = [[], [], [], []]
    for i in range(s.size):
        joins = i > 0 and a[i] == a[i - 1] + s[i - 1] and b[i] == b[i - 1] + s[i - 1] and k[i] == k[i - 1]
        if joins:
            out[2][-1] += int(s[i])
        else:
            for col, v in zip(out, (a[i], b[i], s[i], k[i]), strict=True):
                col.append(int(v))
    return out


@pytest.mark.parametrize("n", [2, 3, 5, 16, 17, 40])
def test_short_and_long_lists_merge_alike(n: int) -> None:
    """Lists of up to 16 fragments merge in Python, longer ones in numpy: both equal the definition."""
    rng = np.random.default_rng(n)
    for _ in range(300):
        s = rng.integers(1, 4, n).astype(np.uint64) * 8
        a = np.cumsum(np.concatenate(([0], s[:-1]))).astype(np.uint64) + 4096
        a += np.cumsum(rng.random(n) < 0.4).astype(np.uint64) * 64
        b = a + np.uint64(1 << 20) + np.cumsum(rng.random(n) < 0.2).astype(np.uint64) * 64
        k = np.cumsum(rng.random(n) < 0.1).astype(np.int64)
        ma, mb, ms, (mk,) = merge_runs(a, b, s, k)
        want = _reference_merge(a, b, s, k)
        assert [ma.tolist(), mb.tolist(), ms.tolist(), mk.tolist()] == want
        assert ms.dtype == s.dtype
        assert (ms is s) == (len(want[2]) == n), "the inputs come back as they are exactly when nothing merged"


@pytest.mark.parametrize("n", [1, 2, 4, 5, 12])
def test_ranges_inside_short_and_long_lists_agree_with_the_definition(n: int) -> None:
    """Up to 4 ranges are checked in Python, more in numpy; both equal "inside one interval", wrap-around refused."""
    rng = np.random.default_rng(100 + n)
    for trial in range(400):
        m = int(rng.integers(1, 5))
        starts = np.sort(rng.choice(1000, m, replace=False)).astype(U64) * U64(100)
        ends = starts + rng.integers(1, 100, m).astype(U64)
        addrs = rng.integers(0, 100_100, n).astype(U64)
        sizes = rng.integers(1, 60, n).astype(U64)
        if trial % 40 == 0:
            addrs[0] = U64(2**64 - 5)  # addr + size wraps around: never inside
        want = [
            any(lo <= x and x + sz <= hi for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True))
            for x, sz in zip(addrs.tolist(), sizes.tolist(), strict=True)
        ]
        assert ranges_inside(addrs, sizes, starts, ends).tolist() == want
