"""The generation role's one place that changes receive-session and writer states.

A receive session waits for one final answer per context rank that may write (its *writers*). Every move of a
session (``RxSession.transition``) and of a writer (``RxSession.settle``, or a claim where no table move
applies) is made here; ``answer_outcome`` maps a context's failed or cancelled word to a session state, once.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

from kvcore import errors as E
from kvcore.control import wire
from kvcore.params import InternalId
from kvcore.transceiver.link import Link
from kvcore.transceiver.peers import CtxInstance
from kvcore.transceiver.role import Role
from kvcore.transceiver.sessions import RxSession, SessionState, SessionTable, TimerHeap, WriterState
from kvcore.transport import bounce

log = logging.getLogger("kvcore.transceiver")

#: How many times one request is asked again after "not registered" answers before it fails.
_MAX_REASKS = 3


def answer_outcome(status: wire.ResultStatus, error: E.KvcoreError, *, timeouts: bool = True) -> SessionState:
    """The state a context's "failed" or "cancelled" word ends a receive session in (the one mapping).

    "cancelled" is CANCELLED; a timeout (``TransferTimeoutError``, ``LeaseExpiredError``) TIMED_OUT; anything else
    FAILED. ``timeouts=False``: the context gave the request up while our READ ran: CANCELLED or FAILED.
    """
    if status == "cancelled":
        return SessionState.CANCELLED
    if timeouts and isinstance(error, E.TransferTimeoutError):
        return SessionState.TIMED_OUT
    return SessionState.FAILED


class RecvSettle(Role):
    """The generation role's state and its one settle path; the concern modules build on it."""

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.rx: SessionTable[RxSession] = SessionTable()
        self.instances: dict[str, CtxInstance] = {}  # current incarnation (or refusal) per context endpoint
        self.retired: list[CtxInstance] = []  # lost or replaced instances, unloaded once no request needs them
        # Agent loads waiting for a retired instance to let go of their agent name: (instance, name, the load to
        # retry); retried once no retired instance holds the name any more.
        self.awaiting_name: list[tuple[CtxInstance, str, Callable[[], None]]] = []
        self.quarantined: set[InternalId] = set()
        self.reasks: dict[InternalId, int] = {}
        # Requests cancelled before their instance was ready: (endpoint) -> [(request id, ctx dp rank)]; the
        # context ranks are told once the instance is ready, so they let go of the request's pages at once.
        self.declines: dict[str, list[tuple[InternalId, int, bytes]]] = {}
        self.counters = link.counters
        self.arena: bounce.Arena | None = link.arena
        # (ctx endpoint, ctx rank) -> (fragments per block, mean fragment bytes) of its unmerged plans
        self._plan_shape: dict[tuple[str, int], tuple[float, float]] = {}
        self.reads: dict[tuple[int, int], tuple[RxSession, int]] = {}  # pull: (id(session), ctx rank) -> in flight
        self._renew_scan = 0.0
        self._renewals = TimerHeap()  # request ids under their next lease renewal

    @property
    def sessions(self) -> SessionTable[Any]:
        return self.rx

    def _note_quarantine(self, s: RxSession) -> None:
        if s.terminal and not s.quiescent and s.request_id not in self.quarantined:
            self.quarantined.add(s.request_id)
            self.link.metrics.quarantined(self.peer_name(s))

    def _take_aux(self, s: RxSession, r: int, aux: bytes) -> bool:
        """Keep a writer's aux payload (the first one that came); False (session FAILED) when it is too large."""
        if len(aux) > self.config.max_aux_bytes:
            self._move(
                s,
                SessionState.FAILED,
                E.PayloadTooLargeError(
                    f"request {s.request_id}: context rank {r} sent an aux payload of {len(aux)} bytes; "
                    f"this rank accepts max_aux_bytes={self.config.max_aux_bytes}"
                ),
            )
            return False
        if aux and not s.aux:
            s.aux = aux
        return True

    def _move(self, s: RxSession, state: SessionState, error: E.KvcoreError | None = None) -> bool:
        """Move ``s`` along the session table; False (nothing changes) once it is terminal (lock held)."""
        return s.transition(state, error)

    def _settle_writer(self, s: RxSession, r: int, state: WriterState) -> bool:
        """Move writer ``r`` of ``s`` along the writer table; False for late or duplicate news (lock held)."""
        return s.settle(r, state)

    def _put_writer(self, s: RxSession, r: int, state: WriterState) -> None:
        """Set writer ``r`` of ``s`` where no table move applies (lock held): a writer asked or claimed for a read
        (ASKED, READING; new, or asked again after NOT_ASKED), told it never will be (NOT_ASKED, CANCELLED), or
        failed with a read that was never posted (FAILED)."""
        s.writers[r] = state

    def _forget_writers(self, s: RxSession) -> None:
        """Every writer of ``s`` proved it never took the request: ask the instance's next incarnation afresh."""
        s.instance = None
        s.writers.clear()
        s.nonces.clear()
        s.unpack.clear()

    # --- provided by the modules above this one (the role class has every concern) -------------------------

    @abstractmethod
    def _ask(self, s: RxSession, inst: CtxInstance, ranks: list[int] | None = None) -> None:
        """Ask context ranks (default: every overlapping one) for ``s`` with fresh nonces (:mod:`.push`)."""

    @abstractmethod
    def _kick_pulls(self, inst: CtxInstance) -> None:
        """Post a read for every pull request of ``inst`` that waits only for its writers (:mod:`.pull`)."""
