"""The plan cache (issue 16): a cached peer pair plans exactly what an uncached one does, for any block ids.

The request-independent part of ``plan_transfer`` is cached per (source, destination) placement parts; only the
block ids change between requests. These tests compare a cache hit with a fresh computation (cache emptied)
and with an independent expectation computed from the pools' base addresses and strides.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcore.errors import LayoutError
from kvcore.extension.plugins import make_plugin_manager
from kvcore.layout import mapping
from kvcore.layout.builders import allocate_kv_cache, build_page_table
from kvcore.layout.mapping import RankPlacement, plan_transfer
from kvcore.layout.page import table_bytes
from kvcore.layout.topology import AttentionGeometry, Topology

CORE = make_plugin_manager(load_entry_points=False).layout_mappers
LAYERS, BLOCKS = 3, 16


def _placement() -> tuple[RankPlacement, torch.Tensor]:
    topo = Topology.create(tp_size=1, pp_size=1, rank=0, num_layers=LAYERS)
    geo = AttentionGeometry(
        num_layers=LAYERS, num_kv_heads=2, head_dim=4, tokens_per_block=2, dtype="float16", block_order="head_major"
    )
    caches = allocate_kv_cache(topo, geo, BLOCKS)
    table = build_page_table("head_major_pool", caches, topology=topo, geometry=geo)
    return RankPlacement(topology=topo, geometry=geo, page_table=table), caches


def _plan(src: RankPlacement, dst: RankPlacement, s: np.ndarray, d: np.ndarray, **kw: object) -> tuple[list[int], ...]:
    p = plan_transfer(src, dst, s, d, mappers=CORE, prompt_len=2 * len(s), **kw)  # type: ignore[arg-type]
    return p.src.tolist(), p.dst.tolist(), p.sizes.tolist()


def test_a_cache_hit_plans_what_a_fresh_computation_plans() -> None:
    (a, _ka), (b, _kb) = _placement(), _placement()
    rng = np.random.default_rng(7)
    for i in range(40):
        n = int(rng.integers(1, BLOCKS + 1))
        s, d = rng.permutation(BLOCKS)[:n], rng.permutation(BLOCKS)[:n]
        kw = {"layer_range": (1, 3)} if i % 3 == 0 else {}
        hit = _plan(a, b, s, d, **kw)
        mapping.clear_plan_cache()
        fresh = _plan(a, b, s, d, **kw)
        assert hit == fresh
        # the same parts in new RankPlacement objects (as RankInfo.placement builds them) plan the same bytes
        again = RankPlacement(topology=b.topology, geometry=b.geometry, page_table=b.page_table)
        assert _plan(a, again, s, d, **kw) == fresh


def test_a_whole_request_matches_the_pools_addresses() -> None:
    (a, ka), (b, kb) = _placement(), _placement()
    s, d = np.array([3, 0, 7]), np.array([5, 9, 1])
    _plan(a, b, s, d)  # warm the cache: the next call is a hit
    src, dst, sizes = _plan(a, b, s, d)
    assert sum(sizes) == 3 * ka.numel() * ka.element_size() // BLOCKS
    # Head-major pools: one block of every layer is one contiguous slot of the pool.
    slot = ka.numel() * ka.element_size() // BLOCKS
    got = sorted(zip(src, dst, sizes, strict=True))
    want = sorted((ka.data_ptr() + int(i) * slot, kb.data_ptr() + int(j) * slot, slot) for i, j in zip(s, d))
    assert got == want


def test_another_page_table_is_never_served_a_stale_plan() -> None:
    (a, _ka), (b, _kb), (c, _kc) = _placement(), _placement(), _placement()
    s, d = np.array([1, 2]), np.array([3, 4])
    to_b, to_c = _plan(a, b, s, d), _plan(a, c, s, d)
    assert to_b[1] != to_c[1]  # different destination memory
    assert _plan(a, b, s, d) == to_b and _plan(a, c, s, d) == to_c


def test_bad_block_ids_still_raise_on_a_cache_hit() -> None:
    (a, _ka), (b, _kb) = _placement(), _placement()
    _plan(a, b, np.array([0]), np.array([0]))
    with pytest.raises(LayoutError):
        _plan(a, b, np.array([BLOCKS]), np.array([0]))
    with pytest.raises(LayoutError):
        _plan(a, b, np.array([0]), np.array([-1]))


def test_the_cache_is_bounded_in_bytes_and_counts_what_it_keeps_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries count their arrays and the page tables they keep alive; over the byte cap the least recently used
    go first, and an entry larger than the cap is planned but never kept."""
    mapping.clear_plan_cache()
    (a, _ka), (b, _kb) = _placement(), _placement()
    s = d = np.array([1, 2])
    _plan(a, b, s, d)
    ((parts, plans, one),) = mapping._plan_cache.values()
    assert one == mapping._entry_bytes(parts, plans.plans) and one >= 2 * table_bytes(a.page_table)
    assert mapping._plan_cache_bytes == one
    # room for two entries: a third pair evicts the least recently used (the first), never more than the cap
    monkeypatch.setattr(mapping, "_PLAN_CACHE_BYTES", 2 * one + one // 2)
    (c, _kc), (e, _ke) = _placement(), _placement()
    _plan(a, c, s, d)
    _plan(a, b, s, d)  # a hit: now the most recently used
    _plan(a, e, s, d)
    kept = [entry[0][4] for entry in mapping._plan_cache.values()]  # each entry's destination page table
    assert len(kept) == 2 and kept[0] is b.page_table and kept[1] is e.page_table
    assert mapping._plan_cache_bytes == sum(entry[2] for entry in mapping._plan_cache.values()) <= 2.5 * one
    # an entry larger than the whole cap: planned exactly as before, not kept, nothing else evicted
    monkeypatch.setattr(mapping, "_PLAN_CACHE_BYTES", one - 1)
    mapping.clear_plan_cache()
    first = _plan(a, b, s, d)
    assert _plan(a, b, s, d) == first and first[2] == [first[2][0]] * len(first[2])  # planned again, alike
    assert mapping._plan_cache == {} and mapping._plan_cache_bytes == 0


def test_the_byte_count_stays_exact_under_concurrent_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads planning many pairs at once, with room for a few entries: the cache's byte count stays the sum of
    what it holds, within the cap, and every plan matches a fresh one."""
    import threading

    mapping.clear_plan_cache()
    (a, _ka), (b, _kb) = _placement(), _placement()
    s = d = np.array([0, 5, 9])
    _plan(a, b, s, d)
    one = mapping._plan_cache_bytes
    monkeypatch.setattr(mapping, "_PLAN_CACHE_BYTES", 3 * one)
    dests = [_placement() for _ in range(12)]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(30):
                dst = dests[(k + i) % len(dests)][0]
                assert _plan(a, dst, s, d) == _plan(a, dst, s, d)
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    held = sum(entry[2] for entry in mapping._plan_cache.values())
    assert mapping._plan_cache_bytes == held <= 3 * one and len(mapping._plan_cache) >= 1


def test_the_cache_is_bounded() -> None:
    (a, _ka), (b, _kb) = _placement(), _placement()
    for lo in range(2 * mapping._PLAN_CACHE_ENTRIES // LAYERS + 10):
        for start in range(LAYERS):
            _plan(a, b, np.array([0]), np.array([0]), layer_range=(start, LAYERS + lo))
    assert len(mapping._plan_cache) <= mapping._PLAN_CACHE_ENTRIES


class _OwnMap(mapping.MatchingHeadsMapper):
    """A matching-heads mapper that plans through its own ``map`` (the contract's body, called explicitly)."""

    calls = 0

    def map(self, pair: mapping.ViewPair) -> mapping.FragmentPlan:
        type(self).calls += 1
        return mapping.LayoutMapper.map(self, pair)


class _Lookup:
    def __init__(self, cls: type[mapping.LayoutMapper]) -> None:
        self.cls = cls

    def get(self, name: str) -> type[mapping.LayoutMapper]:
        assert name == mapping.MATCHING_HEADS
        return self.cls


def test_precomputed_buffer_fragments_plan_what_the_mappers_own_map_plans() -> None:
    """The planner keeps a mapper's buffer fragments with the cached pair and applies them itself; a mapper that
    overrides ``map`` is still asked per request, and both plan the same bytes."""
    (a, _ka), (b, _kb) = _placement(), _placement()
    own = _Lookup(_OwnMap)
    rng = np.random.default_rng(11)
    for i in range(30):
        n = int(rng.integers(1, BLOCKS + 1))
        s, d = rng.permutation(BLOCKS)[:n], rng.permutation(BLOCKS)[:n]
        kw = {"layer_range": (0, 2)} if i % 4 == 0 else {}
        before = _OwnMap.calls
        fast = plan_transfer(a, b, s, d, mappers=CORE, prompt_len=2 * n, **kw)  # type: ignore[arg-type]
        slow = plan_transfer(a, b, s, d, mappers=own, prompt_len=2 * n, **kw)  # type: ignore[arg-type]
        assert _OwnMap.calls > before  # the overriding map ran for this request
        for name in ("src", "dst", "sizes"):
            got, want = getattr(fast, name), getattr(slow, name)
            assert got.dtype == want.dtype == np.uint64 and got.flags.c_contiguous
            assert got.tolist() == want.tolist()
