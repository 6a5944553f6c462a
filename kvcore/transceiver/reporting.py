"""What a transceiver tells its engine: outcomes every rank agreed on, releases, news, and live counts.

Memory safety: ``poll()`` reports an outcome once every rank of the instance
agrees the request is terminal, and reports the request as *released* only
when no write into its pages can still land (every writer reported a final
result, proved it never took the request, or is fenced). Engines reuse pages
on release, never earlier.

``Reporting`` is the half of :class:`~kvcore.transceiver.facade.Transceiver`
that reports (``poll``, ``poll_local``, ``wait``, ``wait_all``, ``status``,
``stats``, ``leaks``); the facade adds construction and the calls that start,
change and cancel requests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.collective import Collective
from kvcore.layout.topology import Topology
from kvcore.metrics import TransceiverMetrics
from kvcore.params import InternalId, RequestId, api_id, internal_id
from kvcore.transceiver.counters import COUNTERS, leaks
from kvcore.transceiver.link import Link
from kvcore.transceiver.role import Role
from kvcore.transceiver.sessions import RequestStatus, RxSession, SessionState
from kvcore.transport.agent import TransferAgent

__all__ = ["Outcome", "PollResult", "Reporting"]

_STATUS_CODE = {SessionState.DONE: 0, SessionState.CANCELLED: 1, SessionState.TIMED_OUT: 2, SessionState.FAILED: 3}
_CODE_STATUS = {v: k for k, v in _STATUS_CODE.items()}


def _order(rid: Any) -> tuple[int, Any]:
    """A total order over mixed request ids (ints, then strs, then bytes) so reports are deterministic."""
    if isinstance(rid, int):
        return (0, rid)
    if isinstance(rid, str):
        return (1, rid)
    return (2, rid if isinstance(rid, bytes) else getattr(rid, "b", b""))


def _elsewhere(rid: object, state: SessionState) -> E.KvcoreError:
    """The error of a request that ended ``state`` on another rank of this instance (this rank has none of its own).

    Typed by the agreed state, so every rank reports the same kind of error for one request.
    """
    what = f"request {rid!r} ended {state.value} on another rank of this instance"
    if state is SessionState.CANCELLED:
        return E.RequestCancelledError(what)
    if state is SessionState.TIMED_OUT:
        return E.TransferTimeoutError(what)
    return E.TransferFailedError(what)


@dataclass(frozen=True)
class Outcome:
    """The agreed terminal outcome of one request on this instance (``aux``: the context's payload, with DONE)."""

    request_id: RequestId
    state: SessionState
    error: E.KvcoreError | None = None
    nbytes: int = 0
    aux: bytes = b""


@dataclass
class PollResult:
    """What ``poll()`` learned: outcomes agreed by every rank, and requests whose pages may now be reused."""

    done: list[Outcome] = field(default_factory=list)
    failed: list[Outcome] = field(default_factory=list)  # FAILED and TIMED_OUT
    cancelled: list[Outcome] = field(default_factory=list)
    released: list[RequestId] = field(default_factory=list)

    @property
    def outcomes(self) -> list[Outcome]:
        return self.done + self.failed + self.cancelled


class _Agreement(msgspec.Struct, array_like=True):
    group: int  # ranks with equal group agree on a request (the attention-DP group; 0 without attention DP)
    terminal: list[tuple[wire.RequestId, int]]
    quiescent: list[wire.RequestId]


class Reporting:
    """The reporting half of a transceiver: outcomes agreed across ranks, releases, news and live counts.

    Set up by :class:`~kvcore.transceiver.facade.Transceiver`, which fills in the attributes below.
    """

    topology: Topology
    agent: TransferAgent
    collective: Collective
    _alone: bool  # a single-rank instance: poll exchanges nothing
    metrics: TransceiverMetrics
    _link: Link
    _role: Role
    _poll_lock: threading.Lock
    _closed: bool

    def _check_open(self) -> None:
        if self._closed:
            raise E.SessionError("transceiver is closed")

    def status(self, request_id: RequestId) -> RequestStatus | None:
        """This rank's state of a request (None when unknown here or already released); cheap, not collective.

        Args:
            request_id: the engine's id of the request (an int in 0..2**64-1, a str or bytes).

        Returns:
            A :class:`~kvcore.transceiver.sessions.RequestStatus`: a terminal ``SessionState`` once the request
            ended on this rank (its agreed outcome still comes from ``poll``), else what it waits for; None when
            this rank does not know the request or has released it.

        Raises:
            SessionError: ``request_id`` is not a valid request id.
        """
        return self._role.status(internal_id(request_id))

    def poll(self) -> PollResult:
        """Outcomes every rank agrees on, and requests whose memory is now safe to reuse.

        Collective: every rank of the instance calls ``poll`` the same number of times.
        Safe from several threads: calls take turns and report each outcome once.

        Returns:
            A :class:`PollResult`: ``done``, ``failed`` (FAILED and TIMED_OUT) and ``cancelled`` outcomes agreed
            by every rank (the worst state wins; each reported once), and ``released``: requests whose pages no
            write can reach any more, each reported once, after its outcome. Errors of requests are never
            raised; they are in ``Outcome.error``.

        Raises:
            CollectiveError: the collective that exchanges the ranks' views failed (several ranks only).
        """
        with self._poll_lock:
            return self._poll()

    def poll_local(self) -> PollResult:
        """This rank's own outcomes and releases, with no collective (for engines that aggregate ranks themselves).

        A request is reported by each rank when *that rank* is done with it, so
        outcomes may differ between ranks (one rank DONE, another FAILED): the
        engine combines them (worst wins), as vLLM's KVOutputAggregator does. Use
        either ``poll`` or ``poll_local`` on a transceiver, not both.

        Returns:
            A :class:`PollResult` of this rank's outcomes not reported before and of its requests whose pages
            may now be reused. Raises nothing.
        """
        with self._poll_lock:
            if self._link.native is not None:
                self._role.lane_drain()  # what the native lane ended: no thread hop before the engine sees it
            if not self._role.sessions.ended:
                return PollResult()  # nothing ended: see _poll
            terminal, quiescent = self._local_view()
            return self._report(terminal, set(quiescent))

    def _local_view(self) -> tuple[dict[InternalId, int], list[InternalId]]:
        # Only sessions that ended are looked at (``SessionTable.ended``): a poll costs the same with one request
        # in flight as with thousands, and holds the lock the I/O thread needs for no longer.
        terminal: dict[InternalId, int] = {}
        quiescent: list[InternalId] = []
        with self._link.lock:
            for rid, s in self._role.sessions.news():
                if not s.reported:
                    terminal[rid] = _STATUS_CODE[s.state]
                if not s.released and s.quiescent:
                    quiescent.append(rid)
        return terminal, quiescent

    def _poll(self) -> PollResult:
        if self._link.native is not None:
            self._role.lane_drain()  # what the native lane ended: no thread hop before the engine sees it
        if self._alone and not self._role.sessions.ended:
            # Nothing ended on this rank (the engine's poll between requests, most polls): no lock, nothing to
            # look at. The read is one atomic length test; a session that ends meanwhile is seen by the next
            # poll, as if this one had come a moment earlier. Several ranks still exchange their (empty) views.
            return PollResult()
        terminal, quiescent = self._local_view()
        if self._alone:
            # One rank agrees with itself: no payload to encode, gather and decode (the engine polls every step).
            return self._report(terminal, set(quiescent)) if terminal or quiescent else PollResult()
        group = self.topology.dp_rank if self.topology.attention_dp else 0
        payload = msgspec.msgpack.encode(_Agreement(group, list(terminal.items()), quiescent))
        everyone = [msgspec.msgpack.decode(b, type=_Agreement) for b in self.collective.allgather(payload)]
        # Under attention DP a request lives on one DP group only: those ranks must agree, not the whole instance.
        gathered = [g for g in everyone if g.group == group]
        codes = [dict(g.terminal) for g in gathered]
        agreed = {rid: max(c[rid] for c in codes) for rid in terminal if all(rid in c for c in codes)}  # worst wins
        agreed_quiet = set(quiescent)
        for g in gathered:
            agreed_quiet &= set(g.quiescent)
        return self._report(agreed, agreed_quiet)

    def _report(self, agreed: dict[InternalId, int], agreed_quiet: set[InternalId]) -> PollResult:
        link = self._link
        result = PollResult()
        now = time.monotonic()
        with link.lock:
            sessions = self._role.sessions
            for rid in sorted(agreed, key=_order):
                state = _CODE_STATUS[agreed[rid]]
                s = sessions.get(rid)
                if s is None or s.reported:
                    continue
                s.reported = True
                err = s.error
                if state is not s.state and err is None:
                    err = _elsewhere(rid, state)
                done = state is SessionState.DONE
                aux = s.aux if done and isinstance(s, RxSession) else b""
                out = Outcome(api_id(rid), state, None if done else err, s.nbytes, aux)
                self.metrics.request_finished(
                    state.value, now - s.created, error=out.error, peer=self._role.peer_name(s)
                )
                if done:
                    result.done.append(out)
                elif state is SessionState.CANCELLED:
                    result.cancelled.append(out)
                else:
                    result.failed.append(out)
            for rid in sorted(agreed_quiet, key=_order):
                s = sessions.get(rid)
                if s is None or not s.reported or s.released:
                    continue
                s.released = True
                result.released.append(api_id(rid))
                self._role.release(rid)
        return result

    def wait(self, timeout: float | None = None) -> bool:
        """Block until this rank has news for ``poll``: an outcome not yet reported, or a request to release.

        Not collective and never reports anything itself: it lets an engine thread sleep instead of polling on a
        timer, and wakes it as soon as this rank's I/O thread ended or settled a request. Under several ranks,
        ``poll`` is still called by every rank alike; this rank's news may be agreed on only at a later ``poll``.

        Args:
            timeout: the most seconds to wait; None waits without a bound.

        Returns:
            True when there is news (call ``poll`` or ``poll_local`` now), False when ``timeout`` seconds passed
            without any.

        Raises:
            SessionError: the transceiver is closed (also in a thread blocked here when another thread closes it).
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        link = self._link
        if link.native is not None:
            return self._wait_native(deadline)
        with link.news:
            link.waiters += 1
            try:
                while True:
                    if self._closed:
                        raise E.SessionError("transceiver is closed")
                    if self._has_news():
                        return True
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    # Bounded sleeps: a notify lost to a race costs at most 50 ms, never a hang.
                    link.news.wait(0.05 if left is None else min(left, 0.05))
            finally:
                link.waiters -= 1

    def _wait_native(self, deadline: float | None) -> bool:
        """``wait`` beside a native lane: asleep on the lane's completions, which the I/O thread's news pokes."""
        link = self._link
        native = link.native
        assert native is not None
        with link.lock:
            link.waiters += 1
        try:
            while True:
                if self._closed:
                    raise E.SessionError("transceiver is closed")
                self._role.lane_drain()
                with link.lock:
                    if self._has_news():
                        return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                # Bounded sleeps, as above; the GIL is released while the lane's condition variable waits.
                try:
                    native.wait(0.05 if left is None else min(left, 0.05))
                except E.KvcoreError:
                    raise E.SessionError("transceiver is closed") from None  # the lane closed under this wait
        finally:
            with link.lock:
                link.waiters -= 1

    def _has_news(self) -> bool:
        """An outcome to report or a release to make on this rank (lock held)."""
        for _, s in self._role.sessions.news():
            if not s.released and (not s.reported or s.quiescent):
                return True
        return False

    def wait_all(self, request_ids: Iterable[RequestId], timeout: float) -> dict[RequestId, Outcome]:
        """Poll until every id is reported and released (single-rank helper for tests and tools).

        Args:
            request_ids: the requests to wait for; only outcomes reported during this call's own polls count.
            timeout: the most seconds to wait.

        Returns:
            Each request's :class:`Outcome`, by request id (with any other outcome the polls reported).

        Raises:
            TransferTimeoutError: some request was not both reported and released within ``timeout``; the
                message names up to eight of them.
            SessionError: the transceiver was closed meanwhile.
            CollectiveError: as ``poll`` (several ranks only).
        """
        want = set(request_ids)
        outcomes: dict[RequestId, Outcome] = {}
        released: set[RequestId] = set()
        deadline = time.monotonic() + timeout
        while not (want <= released and want <= set(outcomes)):
            r = self.poll()
            outcomes.update({o.request_id: o for o in r.outcomes})
            released.update(r.released)
            if want <= released and want <= set(outcomes):
                break
            if time.monotonic() > deadline:
                missing = sorted((want - released) | (want - set(outcomes)), key=_order)
                raise E.TransferTimeoutError(
                    f"{len(missing)} request(s) not reported and released after {timeout}s: {missing[:8]} "
                    "(wait_all sees only outcomes reported during its own polls)"
                )
            if self.topology.world_size == 1:
                self.wait(min(0.05, max(0.0, deadline - time.monotonic())))  # poll again as soon as there is news
            else:
                time.sleep(0.001)  # collective: the other ranks poll on their own clocks
        return outcomes

    def _live_gauges(self) -> dict[str, int]:
        """``stats()`` without the counters: what ``kvcore_live_objects`` exports."""
        return {k: v for k, v in self.stats().items() if k not in COUNTERS and not k.endswith("_total")}

    def _event_counts(self) -> dict[str, int]:
        """The counters of ``stats()``: what ``kvcore_control_events_total`` exports."""
        return {k: v for k, v in self.stats().items() if k in COUNTERS or k.endswith("_total")}

    def stats(self) -> dict[str, int]:
        """Live counts for leak checks (all return to zero, but peers, once every request is released) and counters.

        Keys ending in ``_total`` and the keys of ``COUNTERS`` (``fenced_*``, ``bounce_fallback_*``,
        ``forged_messages``, ``peers_lost``, ``tickets_refused``, ``early_requests_expired``) only grow; the
        metrics export those as ``kvcore_control_events_total`` and the rest as ``kvcore_live_objects``.

        Returns:
            A fresh dict of counts by name: the role's sessions, leases and peers, the agent's transfers and
            loaded remote agents, the control connections, and every counter of ``COUNTERS``. Raises nothing.
        """
        res = self.agent.resources()
        out = {
            **self._role.stats(),
            "agent_transfers": res.get("transfers", 0),
            "remote_agents": res.get("remote_agents", 0),
            "control_connections": self._link.messenger.peer_count,
        }
        for key in sorted(COUNTERS):
            out[key] = self._link.counters.get(key, 0)
        native = self._link.native
        if native is not None:
            out.update(native.stats())  # the lane's own: its requests and rejected frames, and what it holds
        return out

    def leaks(self) -> dict[str, int]:
        """Per-request resources still held (``{}`` once every request is released): for leak checks.

        Returns:
            The non-zero entries of ``stats()`` that are neither counters (``COUNTERS``, ``*_total``) nor bounded
            caches (``CACHE_GAUGES``). Raises nothing.
        """
        return leaks(self.stats())
