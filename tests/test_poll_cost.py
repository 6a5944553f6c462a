"""``poll`` and ``wait`` look only at requests that ended, never at every request in flight.

An engine polls once per iteration with thousands of requests in flight; each poll holds the lock the I/O
thread needs. Real transceivers over real ZeroMQ sockets in one process. The test counts how many sessions
one poll reads on the engine's thread (the ``terminal`` and ``quiescent`` properties), not how long it takes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from _faults import RankGroup, fault_plugin_manager
from _instances import ticket_for

from kvcore.transceiver.sessions import Session, TxSession

pytestmark = pytest.mark.timeout(120)


class _Counting:
    """Counts this thread's reads of a session's ``terminal`` and ``quiescent`` while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads = 0
        me = threading.get_ident()
        for cls, name in ((Session, "terminal"), (TxSession, "quiescent")):
            monkeypatch.setattr(cls, name, property(self._counted(getattr(cls, name).fget, me)))

    def _counted(self, fget: Any, me: int) -> Any:
        def read(s: Session) -> bool:
            if threading.get_ident() == me:
                self.reads += 1
            return bool(fget(s))

        return read


def test_poll_and_wait_read_only_the_requests_that_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = RankGroup.build("context", pm=fault_plugin_manager(), num_blocks=64)
    try:
        c: Any = ctx.txs[0]
        for rid in range(1, 2001):  # in flight: nobody asks for them
            c.start_send(rid, [rid % 64], ticket=ticket_for(rid))
        counting = _Counting(monkeypatch)
        r = c.poll()
        assert not (r.done or r.failed or r.cancelled or r.released)
        assert c.wait(0) is False
        assert counting.reads == 0, f"an idle poll read {counting.reads} of 2000 live sessions"
        # Three end (cancelled before anyone asked): the next poll reads those three, reports and releases them.
        for rid in (5, 700, 1999):
            assert c.cancel(rid)
        assert c.wait(5) is True
        counting.reads = 0
        r = c.poll()
        assert sorted(o.request_id for o in r.cancelled) == [5, 700, 1999]
        assert sorted(r.released) == [5, 700, 1999]
        assert 0 < counting.reads <= 2 * 3, f"the poll read {counting.reads} sessions for 3 that ended"
        counting.reads = 0
        r = c.poll()
        assert not (r.cancelled or r.released) and counting.reads == 0
        assert c.stats()["tx_sessions"] == 1997
    finally:
        ctx.close()


class _IoCounting:
    """Counts the reads of a session's ``terminal`` made on one thread (a transceiver's I/O thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, thread: threading.Thread) -> None:
        self.reads = 0
        fget = Session.terminal.fget
        assert fget is not None

        def read(s: Session) -> bool:
            if threading.current_thread() is thread:
                self.reads += 1
            return bool(fget(s))

        monkeypatch.setattr(Session, "terminal", property(read))


def test_the_worker_timers_read_only_the_requests_that_are_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 2000 requests in flight on each side and none due, the I/O threads' timers (deadlines, lease renewals,
    fencing), which run 50 times a second, read next to no session; a scan of every live session reads 2000 per
    tick on each side."""
    pm = fault_plugin_manager()
    ctx = RankGroup.build("context", pm=pm, num_blocks=64, max_early_per_peer=2048)
    try:
        gen = RankGroup.build("generation", pm=pm, num_blocks=64)
    except BaseException:
        ctx.close()
        raise
    try:
        c: Any = ctx.txs[0]
        g: Any = gen.txs[0]
        for rid in range(1, 2001):  # the context holds them; no receiver asks
            c.start_send(rid, [rid % 64], ticket=ticket_for(rid))
        for rid in range(10_001, 12_001):  # the receiver asks; the context has not started them (early requests)
            g.start_receive(rid, ctx.info_endpoint, [rid % 64], ticket=ticket_for(rid))
        deadline = time.monotonic() + 30
        while c.stats()["early_requests"] < 2000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["early_requests"] == 2000, (c.stats(), g.stats())
        counters = [_IoCounting(monkeypatch, tx._link.messenger._thread) for tx in (c, g)]
        time.sleep(0.5)  # about 25 timer ticks on each side
        reads = [n.reads for n in counters]
        assert reads[0] < 200 and reads[1] < 200, f"idle timers read {reads} sessions (context, generation) in 0.5 s"
        assert c.stats()["tx_sessions"] == 2000 and g.stats()["rx_sessions"] == 2000
    finally:
        gen.close()
        ctx.close()
