"""The bounce path is proven by counters, not by private attributes: taken when forced, and each fallback counted.

``Transceiver.stats()`` carries ``bounced_writes_total`` (writes sent packed on the
context side, leases unpacked on the generation side) and one counter per promised
fallback: ``bounce_fallback_arena_full`` (the receiver could not lease arena space)
and ``bounce_fallback_plan_mismatch`` (the sender's plan differs from the receiver's).
In every case the bytes are checked against the context's pattern.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _faults import RankGroup, fault_plugin_manager, halves_plugin_manager
from _instances import fill_value, ticket_for

from kvcore.transceiver import SessionState

pytestmark = pytest.mark.timeout(120)

FORCE: dict[str, Any] = dict(bounce_min_fragments=1, bounce_max_fragment_bytes=1 << 20)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def _counter(stats: list[dict[str, int]], name: str) -> int:
    """A cumulative counter summed over both sides; missing on both sides is a failure, not a zero."""
    assert any(name in s for s in stats), f"Transceiver.stats() has no {name!r} counter: {sorted(stats[0])}"
    return sum(s.get(name, 0) for s in stats)


def _move(ctx: RankGroup, gen: RankGroup, rid: int, src: list[int], dst: list[int]) -> None:
    """Send ``rid`` and check DONE on both sides with the context's pattern in the destination blocks."""
    cflat, gflat = _flat(ctx.caches[0]), _flat(gen.caches[0])
    want = fill_value(rid, src, cflat.shape[1])
    cflat[src] = torch.from_numpy(want)
    ctx.txs[0].start_send(rid, src, ticket=ticket_for(rid))
    gen.txs[0].start_receive(rid, ctx.info_endpoint, dst, ticket=ticket_for(rid))
    assert gen.txs[0].wait_all([rid], 30)[rid].state is SessionState.DONE
    assert ctx.txs[0].wait_all([rid], 30)[rid].state is SessionState.DONE
    assert np.array_equal(gflat[dst].numpy(), want), f"request {rid}: bytes differ"


def _pair(**cfg: Any) -> tuple[RankGroup, RankGroup]:
    pm = fault_plugin_manager()
    common = dict(bounce_buffer_bytes=1 << 20, **cfg)
    return RankGroup.build("context", pm=pm, **common), RankGroup.build("generation", pm=pm, **common)


def test_forced_bounce_is_taken_on_both_sides() -> None:
    ctx, gen = _pair(**FORCE)
    try:
        _move(ctx, gen, 1, [3, 7, 1], [0, 9, 4])
        c, g = ctx.txs[0].stats(), gen.txs[0].stats()
        assert c["bounced_writes_total"] == 1, c  # one packed write
        assert g["bounced_writes_total"] == 1, g  # one lease unpacked
        assert c["staging_leases"] == 0 and g["bounce_leases"] == 0
    finally:
        gen.close()
        ctx.close()


def test_bounce_off_moves_the_same_bytes_without_bouncing() -> None:
    ctx, gen = _pair(bounce_enabled=False)
    try:
        _move(ctx, gen, 1, [3, 7, 1], [0, 9, 4])
        assert ctx.txs[0].stats()["bounced_writes_total"] == gen.txs[0].stats()["bounced_writes_total"] == 0
    finally:
        gen.close()
        ctx.close()


def _arena_full() -> tuple[RankGroup, RankGroup]:
    """The receiver's arena (4 KiB) is smaller than any request (16 KiB a block): it can lease nothing."""
    pm = fault_plugin_manager()
    ctx = RankGroup.build("context", pm=pm, bounce_buffer_bytes=1 << 20, **FORCE)
    return ctx, RankGroup.build("generation", pm=pm, bounce_buffer_bytes=4096, **FORCE)


def _plan_mismatch() -> tuple[RankGroup, RankGroup]:
    """The receiver's mapper plugin plans each buffer in two fragments (another version of it): digests differ."""
    ctx = RankGroup.build("context", pm=fault_plugin_manager(), bounce_buffer_bytes=1 << 20, **FORCE)
    return ctx, RankGroup.build("generation", pm=halves_plugin_manager(), bounce_buffer_bytes=1 << 20, **FORCE)


SCENARIOS = {"arena_full": _arena_full, "plan_mismatch": _plan_mismatch}


@pytest.mark.parametrize("why", list(SCENARIOS))
def test_fallback_writes_fragments_directly_with_the_same_bytes(why: str) -> None:
    ctx, gen = SCENARIOS[why]()
    try:
        _move(ctx, gen, 1, [3, 7], [0, 9])
        stats = [ctx.txs[0].stats(), gen.txs[0].stats()]
        # Bouncing with disagreeing plans would scatter bytes into the wrong places; an arena lease that does not
        # exist cannot be written: either way the write must have gone directly.
        assert [s["bounced_writes_total"] for s in stats] == [0, 0], stats
        assert stats[0]["staging_leases"] == 0 and stats[1]["bounce_leases"] == 0
    finally:
        gen.close()
        ctx.close()


@pytest.mark.parametrize("why", list(SCENARIOS))
def test_each_fallback_is_counted(why: str) -> None:
    """``bounce_fallback_<why>`` counts the fallback; the other fallback counter stays at zero."""
    ctx, gen = SCENARIOS[why]()
    other = next(w for w in SCENARIOS if w != why)
    try:
        _move(ctx, gen, 1, [3, 7], [0, 9])
        _move(ctx, gen, 2, [4, 8], [1, 10])
        stats = [ctx.txs[0].stats(), gen.txs[0].stats()]
        assert _counter(stats, f"bounce_fallback_{why}") == 2
        assert _counter(stats, f"bounce_fallback_{other}") == 0
    finally:
        gen.close()
        ctx.close()


def test_the_receiver_forgets_a_lost_instances_plan_shape() -> None:
    """The receiver caches each writer's plan shape for its bounce pre-check; an instance that is lost takes its
    entries with it, so the cache holds live instances only (and a new instance there is planned afresh)."""
    import time

    ctx = RankGroup.build("context", pm=fault_plugin_manager(), bounce_buffer_bytes=1 << 20, **FORCE)
    gen = RankGroup.build(
        "generation", pm=fault_plugin_manager(), bounce_buffer_bytes=1 << 20, peer_lost_timeout_s=0.5, **FORCE
    )
    try:
        _move(ctx, gen, 1, [3, 7, 1], [0, 9, 4])
        shapes = gen.txs[0]._role._plan_shape  # private: no counter says what this cache holds
        assert [k[0] for k in shapes] == [ctx.info_endpoint]
        ctx.close()
        deadline = time.monotonic() + 30
        while gen.txs[0].stats()["peers_closed"] < 1 and time.monotonic() < deadline:
            gen.txs[0].poll()
            time.sleep(0.05)
        assert gen.txs[0].stats()["peers_closed"] >= 1, "the closed context instance was never let go"
        assert shapes == {}
    finally:
        gen.close()
        ctx.close()
