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
from _instances import fill_value

from kvcore.session import SessionState

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
    ctx.txs[0].start_send(rid, src)
    gen.txs[0].start_receive(rid, ctx.info_endpoint, dst)
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


def test_arena_full_falls_back_to_direct_fragments_and_is_counted() -> None:
    """The receiver's arena is smaller than the request: it leases nothing, the writer writes fragments directly."""
    pm = fault_plugin_manager()
    ctx = RankGroup.build("context", pm=pm, bounce_buffer_bytes=1 << 20, **FORCE)
    gen = RankGroup.build("generation", pm=pm, bounce_buffer_bytes=4096, **FORCE)  # one block is 16 KiB
    try:
        _move(ctx, gen, 1, [3, 7], [0, 9])
        stats = [ctx.txs[0].stats(), gen.txs[0].stats()]
        assert _counter(stats, "bounce_fallback_arena_full") == 1
        assert _counter(stats, "bounce_fallback_plan_mismatch") == 0
        assert _counter(stats, "bounced_writes_total") == 0
        assert stats[1]["bounce_leases"] == 0
    finally:
        gen.close()
        ctx.close()


def test_plans_that_disagree_fall_back_to_direct_fragments_and_are_counted() -> None:
    """The receiver's mapper plugin plans each buffer in two fragments (another version): digests differ."""
    ctx = RankGroup.build("context", pm=fault_plugin_manager(), bounce_buffer_bytes=1 << 20, **FORCE)
    gen = RankGroup.build("generation", pm=halves_plugin_manager(), bounce_buffer_bytes=1 << 20, **FORCE)
    try:
        _move(ctx, gen, 1, [3, 7], [0, 9])
        stats = [ctx.txs[0].stats(), gen.txs[0].stats()]
        assert _counter(stats, "bounce_fallback_plan_mismatch") == 1
        assert _counter(stats, "bounce_fallback_arena_full") == 0
        assert _counter(stats, "bounced_writes_total") == 0, "a bounce with disagreeing plans scatters wrong bytes"
        assert stats[0]["staging_leases"] == 0 and stats[1]["bounce_leases"] == 0
    finally:
        gen.close()
        ctx.close()
