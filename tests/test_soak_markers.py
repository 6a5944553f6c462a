"""A soak that checks every byte of every reused slot: nothing lands after release, everything is there at DONE.

The generation side plays an engine that reuses pages: when a request is
released, its slot is overwritten at once with a marker of its own (as the
engine's next prefill would); when the slot is handed to a later request, the
marker must still be intact (no write of an earlier request landed after its
release); when a request is reported DONE, the slot must hold exactly the
context's per-request pattern. Requests are cancelled at random moments from
either side, so some writes race their cancel.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from _instances import ContextProcess, fill_value, make_rank, ticket_for

from kvcore.transceiver import SessionState

pytestmark = pytest.mark.timeout(240)


def _freed_marker(rid: int, nbytes: int) -> np.ndarray:
    """What the engine writes into a slot it took back from request ``rid`` (never a kvcore pattern)."""
    b = np.arange(nbytes, dtype=np.int64)
    return ((rid * 97 + b * 13 + 5) % 253 + 1).astype(np.uint8)


def test_soak_reused_slots_hold_the_right_bytes_at_done_and_nothing_after_release() -> None:
    total, window, slots_n = 600, 24, 32
    ctx = ContextProcess(num_blocks=slots_n, timeout=30.0)
    agent, cache, tx = make_rank("generation", "gen-soak-markers", num_blocks=slots_n, timeout=30.0)
    flat = cache.view(slots_n, -1).view(torch.uint8)
    nbytes = flat.shape[1]
    rng = np.random.default_rng(11)
    picked = rng.choice(total, total // 8 + total // 16, replace=False).tolist()
    cancel_at, ctx_cancel_at = set(picked[: total // 8]), set(picked[total // 8 :])  # generation / context side
    free_dst = list(range(slots_n))
    free_src = list(range(slots_n))
    owner: dict[int, tuple[int, int]] = {}  # rid -> (dst slot, src block)
    last_freed: dict[int, int] = {}  # dst slot -> rid whose freed marker it holds
    outcomes: dict[int, SessionState] = {}
    released: set[int] = set()
    done_checked = 0
    started = 0
    try:
        flat.zero_()
        last_progress, n_seen = time.monotonic(), 0
        while len(released) < total:
            if len(released) != n_seen:
                last_progress, n_seen = time.monotonic(), len(released)
            # Every request ends within its 30 s timeout; a minute without any release is a leak, not slowness.
            if time.monotonic() - last_progress > 60:
                stuck = sorted(set(owner))
                pytest.fail(
                    f"stuck: {len(released)} of {total} released; never released: "
                    f"{[(r, outcomes.get(r)) for r in stuck[:8]]}; generation stats {tx.stats()}"
                )
            while started < total and started - len(released) < window and free_dst and free_src:
                r = started
                d, s = free_dst.pop(0), free_src.pop(0)
                if d in last_freed:  # the slot must still hold what the engine wrote at the last release
                    prev = last_freed[d]
                    assert np.array_equal(flat[d].numpy(), _freed_marker(prev, nbytes)), (
                        f"slot {d} changed after request {prev} released it"
                    )
                owner[r] = (d, s)
                if r % 2:
                    ctx.send(r, [s])
                    tx.start_receive(r, ctx.endpoint, [d], ticket=ticket_for(r))
                else:
                    tx.start_receive(r, ctx.endpoint, [d], ticket=ticket_for(r))
                    ctx.send(r, [s])
                if r in cancel_at:
                    tx.cancel(r)
                elif r in ctx_cancel_at:
                    ctx.cancel(r)
                started += 1
            res = tx.poll()
            for o in res.outcomes:
                assert o.request_id not in outcomes, f"request {o.request_id} reported twice"
                outcomes[o.request_id] = o.state
                if o.state is SessionState.DONE:  # checked now, before the engine may reuse anything
                    d, _ = owner[o.request_id]
                    want = fill_value(o.request_id, [0], nbytes)[0]
                    assert np.array_equal(flat[d].numpy(), want), f"request {o.request_id}: wrong bytes at DONE"
                    done_checked += 1
            for rid in res.released:
                assert rid in outcomes and rid not in released
                released.add(rid)
                d, s = owner.pop(rid)
                flat[d] = torch.from_numpy(_freed_marker(rid, nbytes))  # the engine reuses the slot at once
                last_freed[d] = rid
                free_dst.append(d)
                free_src.append(s)  # the context block is not read for this request any more
            time.sleep(0.0005)
        for d, rid in last_freed.items():  # nothing landed in any free slot at the very end either
            if d in free_dst:
                assert np.array_equal(flat[d].numpy(), _freed_marker(rid, nbytes)), f"slot {d} changed after release"
        states = list(outcomes.values())
        assert len(outcomes) == total and set(states) <= {SessionState.DONE, SessionState.CANCELLED}
        assert done_checked == states.count(SessionState.DONE) >= total - len(cancel_at) - len(ctx_cancel_at)
        assert states.count(SessionState.CANCELLED) > 0, "no cancel won its race: the soak tested no cancel"
        assert tx.leaks() == {}
    finally:
        ctx.close()
        tx.close()
        agent.close()
