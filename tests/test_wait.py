"""``Transceiver.wait``: an engine thread sleeps until this rank has news for ``poll``, and wakes for it.

Real transceivers over real ZeroMQ sockets in one process; the context's shm agent holds its writes
(``_faults.HeldShmAgent``) so that "nothing has happened yet" is a state the test controls.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from _faults import RankGroup, fault_plugin_manager
from _instances import fill_value, ticket_for

from kvcore import errors as E
from kvcore.transceiver import SessionState

pytestmark = pytest.mark.timeout(120)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0], -1).view(torch.uint8)


class _Waiter(threading.Thread):
    """Calls ``tx.wait(timeout)`` on its own thread; keeps what it returned or raised."""

    def __init__(self, tx: Any, timeout: float | None) -> None:
        super().__init__(daemon=True)
        self.tx, self.timeout = tx, timeout
        self.result: bool | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.tx.wait(self.timeout)
        except BaseException as exc:
            self.error = exc


def test_wait_sleeps_while_a_write_is_held_and_wakes_when_it_lands() -> None:
    """Both sides: no news while the write is held; True once it landed; the news is poll's to take, once."""
    pm = fault_plugin_manager()
    ctx = RankGroup.build("context", backend="held-shm", pm=pm, agent_options=[{"closed": True}])
    gen = RankGroup.build("generation", pm=pm, timeout=30.0)
    try:
        c, g = ctx.txs[0], gen.txs[0]
        want = fill_value(1, [3], _flat(ctx.caches[0]).shape[1])
        _flat(ctx.caches[0])[[3]] = torch.from_numpy(want)
        c.start_send(1, [3], ticket=ticket_for(1))
        g.start_receive(1, ctx.info_endpoint, [5], ticket=ticket_for(1))
        assert ctx.agents[0].holding.wait(20), "the context rank never submitted the write"
        assert g.wait(0) is False and c.wait(0) is False, "news before the held write landed"
        gw, cw = _Waiter(g, 30), _Waiter(c, 30)
        gw.start()
        cw.start()
        gw.join(0.3)
        assert gw.is_alive() and cw.is_alive(), "wait() returned while the write was still held"
        ctx.agents[0].gate.set()  # the write lands at the worker's next look
        gw.join(30)
        cw.join(30)
        assert (gw.result, gw.error) == (True, None)
        assert (cw.result, cw.error) == (True, None)
        assert g.wait(0) is True, "wait() took the news that poll() is to report"
        r = g.poll()
        assert [o.request_id for o in r.done] == [1] and r.released == [1]
        assert np.array_equal(_flat(gen.caches[0])[5].numpy(), want[0]), "DONE but the bytes are wrong"
        assert g.wait(0) is False, "news left after poll() reported and released the only request"
        r = c.poll()
        assert [o.request_id for o in r.done] == [1] and r.released == [1]
        assert c.wait(0) is False
        assert g.leaks() == {} and c.leaks() == {}
    finally:
        ctx.agents[0].gate.set()
        gen.close()
        ctx.close()


def test_cancel_on_another_thread_wakes_a_waiter() -> None:
    """A receive the context never started: a thread blocked in wait() wakes when the engine cancels it."""
    ctx = RankGroup.build("context")
    gen = RankGroup.build("generation", timeout=30.0)
    try:
        g = gen.txs[0]
        g.start_receive(4, ctx.info_endpoint, [2], ticket=ticket_for(4))  # kept early by the context, unstarted
        waiter = _Waiter(g, 30)
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive(), "wait() returned before anything ended"
        assert g.cancel(4, "the scheduler dropped it") is True
        waiter.join(30)
        assert (waiter.result, waiter.error) == (True, None)
        out = g.wait_all([4], 30)[4]
        assert out.state is SessionState.CANCELLED
        assert g.leaks() == {}
    finally:
        gen.close()
        ctx.close()


def test_wait_times_out_without_news_and_close_wakes_a_waiter_with_an_error() -> None:
    gen = RankGroup.build("generation", timeout=30.0)
    try:
        g = gen.txs[0]
        assert g.wait(0.05) is False
        assert g.wait(-1) is False  # a past deadline: one look, no sleep
        waiter = _Waiter(g, None)  # no bound: only news or close() ends it
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()
        g.close()
        waiter.join(10)
        assert not waiter.is_alive(), "close() left a thread blocked in wait()"
        assert isinstance(waiter.error, E.SessionError) and "closed" in str(waiter.error)
        with pytest.raises(E.SessionError, match="closed"):
            g.wait(0)
    finally:
        gen.close()


def test_a_context_that_closes_as_soon_as_its_request_is_released_still_delivers_the_result() -> None:
    """The engine wakes after the turn's answers were written, and close() lets them leave: the receiver ends DONE.

    Twenty rounds, each with a fresh context instance that is closed the moment wait() and poll() released its
    request (the race a test process hit under load: the TransferResult was cut off and the receiver ended
    PeerLostError).
    """
    gen = RankGroup.build("generation", timeout=30.0)
    try:
        g = gen.txs[0]
        for rid in range(20):
            ctx = RankGroup.build("context")
            try:
                c = ctx.txs[0]
                want = fill_value(rid, [rid + 1], _flat(ctx.caches[0]).shape[1])
                _flat(ctx.caches[0])[[rid + 1]] = torch.from_numpy(want)
                c.start_send(rid, [rid + 1], ticket=ticket_for(rid))
                g.start_receive(rid, ctx.info_endpoint, [rid + 12], ticket=ticket_for(rid))
                released: list[Any] = []
                while not released:
                    assert c.wait(30), f"request {rid}: the context never had news"
                    released += c.poll().released
            finally:
                ctx.close()  # at once: the receiver may not have read the result yet
            out = g.wait_all([rid], 30)[rid]
            assert out.state is SessionState.DONE, f"request {rid}: {out}"
            assert np.array_equal(_flat(gen.caches[0])[rid + 12].numpy(), want[0])
        assert g.leaks() == {}
    finally:
        gen.close()
