"""The context role's one place that changes send-session and task states, and the answers that go with them.

A send session holds one task per generation rank (incarnation) that asked for the request. A task ends with
exactly one final answer to its receiver, sent only when nothing of it is in flight at the transport; the
session is quiescent when every task has its final answer. A terminal session never keeps an idle task. Every
move of a session (``TxSession.transition``) and of a task (``ReceiverTask.move``) is made here, through the
tables in :mod:`kvcore.transceiver.sessions`; ``answer_status`` maps an end to the wire's status, once.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections import OrderedDict
from typing import Any

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import RateLimitedLog, Source
from kvcore.layout.page import PageTable
from kvcore.params import InternalId
from kvcore.transceiver.early import EarlyRequests
from kvcore.transceiver.link import Link, Transfer
from kvcore.transceiver.peers import GenPeer, PeerState
from kvcore.transceiver.role import Role
from kvcore.transceiver.sessions import (
    IDLE_TASK_STATES,
    ReceiverTask,
    SessionState,
    SessionTable,
    TaskState,
    Tombstones,
    TxSession,
)
from kvcore.transport import bounce

log = logging.getLogger("kvcore.transceiver")

_Key = tuple[str, int]


def answer_status(state: SessionState | TaskState) -> wire.ResultStatus:
    """The wire status of an end: DONE is "ok", CANCELLED "cancelled", anything else "failed" (the one mapping)."""
    if state.value == "DONE":
        return "ok"
    return "cancelled" if state.value == "CANCELLED" else "failed"


class SendSettle(Role):
    """The context role's state and its one settle path; the concern modules build on it."""

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        cfg = self.config
        self.tx: SessionTable[TxSession] = SessionTable()
        self.peers: dict[_Key, GenPeer] = {}  # current incarnation (or refusal) per generation rank
        self.retired: list[GenPeer] = []  # lost peers waiting for their transfers to end before unloading
        self.refused: OrderedDict[_Key, None] = OrderedDict()  # keys of REFUSED peers, oldest first (capped)
        # Peers dropped for idleness after they had asked: their next ask admits them again (capped, oldest out).
        self.dormant: OrderedDict[_Key, GenPeer] = OrderedDict()
        self._idle_check_at = 0.0
        # RequestData (push) and PullDone (pull: read before start_send ran) that came before start_send
        self.early = EarlyRequests(
            cfg.max_early_requests,
            cfg.max_early_per_peer,
            cfg.max_early_bytes,
            cfg.max_early_bytes_per_peer or max(1, cfg.max_early_bytes // 8),
        )
        # Outcomes this rank's engine made (releases, its cancels before start_send), and apart, with a cap of
        # their own, those peers made (declines, cancels before start_send): a flood of the second kind never
        # evicts the first, so the engine's cancel of a request not started yet still holds at its start_send.
        self.tombstones = Tombstones(cfg.max_tombstones, cfg.request_timeout_s)
        self.peer_tombstones = Tombstones(cfg.max_peer_tombstones, cfg.request_timeout_s)
        self._rlog = RateLimitedLog(logger=log)  # lines a peer can cause at will (each is counted too)
        self.inflight: dict[int, tuple[TxSession, ReceiverTask]] = {}  # id(task) -> its submitted write
        self.orphans: list[Transfer] = []  # handles of abandoned transfers to dead peers, released once terminal
        self.staging: bounce.Arena | None = None
        self.events: list[tuple[Any, int, Any]] = []  # (request, layers upto, CUDA event) from layers_ready
        self.bounce_on = link.bounce_on
        self.counters = link.counters
        # Pull mode describes a request for the whole instance: one page table per distinct shape of the ranks'
        # tables (groups, their slots, state slots) is enough to check every group's ids and the state slot.
        shapes: dict[Any, PageTable] = {}
        for info in link.instance_ranks:
            pt = info.page_table
            shape = (tuple((g, pt.group_slots(g)) for g in pt.groups()), pt.state_slots())
            shapes.setdefault(shape, pt)
        self.instance_tables = list(shapes.values())
        self.instance_groups = sorted({g for pt in self.instance_tables for g in pt.groups()})

    @property
    def sessions(self) -> SessionTable[Any]:
        return self.tx

    def _end(self, s: TxSession, state: SessionState, error: E.KvcoreError | None = None) -> None:
        """Make ``s`` terminal and give every idle task its final answer at once (nothing of it is in flight)."""
        moved = s.transition(state, error)
        if not s.terminal:
            return
        native = self.link.native
        if native is not None:
            native.end(s)  # its offer goes (or, being written, stays until the lane's completion)
        for t in s.tasks.values():
            if t.state in IDLE_TASK_STATES:
                self._finish_for_session(s, t)
        if moved and s.state is not SessionState.DONE:
            # Receivers that renewed a lease but never asked hear now that the request is gone.
            err = s.error or E.SessionError(f"request {s.request_id} ended {s.state.value}")
            status = answer_status(s.state)
            for key, nonce in s.renewers.items():
                peer = self.peers.get(key)
                if key in s.tasks or peer is None:
                    continue
                self._tell(
                    peer, self._result(s.request_id, nonce, status=status, kind=type(err).__name__, error=str(err))
                )

    # --- the native lane (kvcore.transceiver.native) -------------------------------------------------------------

    def _lane_completion(self, c: Any) -> None:
        native = self.link.native
        assert native is not None
        self._lane_end(native.take_offer(c.ticket), c)

    def _lane_end(self, rid: InternalId | None, c: Any) -> None:
        """The lane ended its write of request ``rid`` into poster peer ``c.peer`` (lock held): the session gets
        the task the lane served (its final answer kept for a receiver that asks again, never sent: the lane
        answered) and settles as a task ended on the Python path would."""
        native = self.link.native
        s = self.tx.get(rid) if rid is not None else None
        if native is None or s is None or not s.lane:
            self.counters["late_results"] += 1
            return
        s.lane = False
        key = native.slots.get(c.peer)
        peer = self.peers.get(key) if key is not None else None
        ok = c.status == "ok"
        if peer is not None and key not in s.tasks:
            t = ReceiverTask(peer=peer, block_ids={}, state_slot=-1, prompt_len=s.prompt_len, nonce=c.nonce)
            s.tasks[peer.key] = t
            if s.expected_receivers is None:
                s.expected_receivers = 1
            if ok:
                self._begin(s)
                t.move(TaskState.SUBMITTED)
                t.total_bytes = native.offered_bytes(s)
            state = TaskState.DONE if ok else TaskState.CANCELLED if c.status == "cancelled" else TaskState.FAILED
            t.move(state)
            if ok:
                s.nbytes += t.total_bytes
            kind = "" if ok else "RequestCancelledError" if c.status == "cancelled" else "TransferFailedError"
            t.final = self._result(
                s.request_id, c.nonce, status=answer_status(state), kind=kind, error=c.error, nbytes=t.total_bytes
            )
            self.link.metrics.writer_service(peer.name, time.monotonic() - t.attached_at)
        if peer is None and c.status != "cancelled":
            # Its receiver was lost meanwhile: nobody is left to take the bytes (the Python path fails it alike).
            self._end(s, SessionState.FAILED, E.PeerLostError(f"request {s.request_id}: its receiver was lost"))
        elif ok:
            self._settle(s)
        elif c.status == "cancelled":
            self._end(s, SessionState.CANCELLED, E.RequestCancelledError(f"request {s.request_id}: {c.error}"))
        else:
            err = E.TransferFailedError(f"request {s.request_id}: the native lane's write failed: {c.error}")
            self._end(s, SessionState.FAILED, err)

    def _finish_for_session(self, s: TxSession, t: ReceiverTask) -> None:
        cancelled = s.state is SessionState.CANCELLED
        err = s.error or E.SessionError(f"request {s.request_id} ended {s.state.value}")
        self._finish(
            s, t, TaskState.CANCELLED if cancelled else TaskState.FAILED, kind=type(err).__name__, error=str(err)
        )

    def _finish(
        self,
        s: TxSession,
        t: ReceiverTask,
        state: TaskState,
        *,
        kind: str = "",
        error: str = "",
    ) -> None:
        """Give a task its one final answer (the receiver may ask again: the same answer is re-sent)."""
        t.move(state)
        status = answer_status(state)
        if state is TaskState.DONE:
            s.nbytes += t.total_bytes
        t.final = self._result(
            s.request_id,
            t.nonce,
            status=status,
            kind=kind,
            error=error,
            nbytes=t.total_bytes,
            fragments=t.total_fragments,
            bounced=t.bounced,
            aux=s.aux if state is TaskState.DONE else b"",
        )
        self._send_to(t, t.final)
        self.link.metrics.writer_service(t.peer.name, time.monotonic() - t.attached_at)

    def _result(
        self, rid: InternalId, nonce: bytes, *, status: wire.ResultStatus, kind: str = "", error: str = "", **kw: Any
    ) -> wire.TransferResult:
        return wire.TransferResult(
            v=wire.PROTOCOL_VERSION,
            request_id=rid,
            ctx_rank=self.link.topology.rank,
            ctx_incarnation=self.link.incarnation,
            status=status,
            error_kind=kind,
            error=error[:1000],
            nonce=nonce,
            **kw,
        )

    def _send_to(self, t: ReceiverTask, msg: wire.Message) -> None:
        self._tell(t.peer, msg)

    def _tell(self, peer: GenPeer, msg: wire.Message) -> None:
        """Send ``msg`` to a generation rank: to its endpoint once it is registered (READY, or SUSPECT), before that
        over the connection it registered on: no socket is opened toward an endpoint a rank not admitted named."""
        if peer.gone or peer.info is None:
            return  # nobody left to tell
        if peer.state in (PeerState.READY, PeerState.SUSPECT):
            self.link.send(peer.info.endpoint, msg)
        elif peer.identity is not None:
            self.link.reply(Source(identity=peer.identity), msg)

    def _settle(self, s: TxSession) -> None:
        with self.link.lock:
            if s.terminal or s.expected_receivers is None or len(s.tasks) < s.expected_receivers:
                return
            states = {t.state for t in s.tasks.values()}
            if states <= {TaskState.DONE}:
                s.transition(SessionState.DONE)
            elif not states & (IDLE_TASK_STATES | {TaskState.SUBMITTED}):
                if TaskState.FAILED in states:
                    self._end(s, SessionState.FAILED, E.TransferFailedError(f"request {s.request_id}: a write failed"))
                else:
                    self._end(
                        s,
                        SessionState.CANCELLED,
                        E.RequestCancelledError(f"request {s.request_id} was cancelled by its receivers"),
                    )

    def _slice_done(self, s: TxSession, t: ReceiverTask) -> None:
        """A slice landed (or was empty): answer the task, or wait for more layers (lock held)."""
        t.total_bytes += t.nbytes
        t.total_fragments += t.fragments
        if t.sent_upto >= self.link.topology.layer_range[1]:
            self._finish(s, t, TaskState.DONE)
        else:
            t.move(TaskState.PARTIAL)
            if s.terminal:
                self._finish_for_session(s, t)
            else:
                self.link.post(self._drive, s.request_id)  # more layers may be ready already

    def _begin(self, s: TxSession) -> None:
        """A write was claimed or a read reported: ``s`` is TRANSFERRING, from INIT or READY (lock held)."""
        if s.state in (SessionState.INIT, SessionState.READY):
            s.transition(SessionState.TRANSFERRING)

    def _claim(self, t: ReceiverTask) -> None:
        """Claim an idle task for the write about to be posted (lock held): a cancel now waits for the transport."""
        t.move(TaskState.SUBMITTED)

    def _abandon(self, t: ReceiverTask) -> None:
        """End a task nobody is left to answer (its receiver is lost, lock held): FAILED, no message sent."""
        t.move(TaskState.FAILED)

    # --- provided by the push module (the role class has every concern; these are called from below it) ---------

    @abstractmethod
    def _drive(self, rid: InternalId) -> None:
        """Submit every ready task of a send session; settle it when all are final (:mod:`.push`)."""

    @abstractmethod
    def _drive_all(self) -> None:
        """``_drive`` every held session (:mod:`.push`)."""
