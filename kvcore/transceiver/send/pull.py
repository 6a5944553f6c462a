"""Pull mode: receivers read this rank's blocks and report with ``PullDone``; exposure of memory to them."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.layout.blocks import normalize_block_ids, normalize_state_slot
from kvcore.layout.peer import peer_ranks
from kvcore.transceiver.peers import GenPeer, PeerState
from kvcore.transceiver.send.asks import SendAsks
from kvcore.transceiver.send.settle import answer_status
from kvcore.transceiver.sessions import (
    ReceiverTask,
    SessionState,
    TaskState,
    TxSession,
)

log = logging.getLogger("kvcore.transceiver")

_Key = tuple[str, int]


class SendPull(SendAsks):
    """Exposure (who may read this rank's memory) and the receivers' read reports."""

    def _whole_description(self, rid: Any, block_ids: Any, state_slot: Any) -> tuple[dict[str, np.ndarray], int]:
        """Pull mode: the request's block ids for every layer group of the *instance*, and its state slot.

        What the parameters carry and the receiver's read is checked against: built from the engine's arguments
        and the instance's page tables, not this rank's alone, so every context rank returns the same
        parameters (a PP stage without attention layers still names the attention blocks; a stage with one of
        two groups names both) and any rank's may be forwarded. The engine passes the same ``block_ids`` and
        ``state_slot`` on every rank.
        """
        what = f"request {rid!r} block_ids"
        if len(self.instance_groups) > 1 and not isinstance(block_ids, Mapping):
            raise E.LayoutError(
                f"{what}: this instance holds layer groups {self.instance_groups}; pull mode needs every group's "
                "ids on every context rank (a mapping of group name to block ids), got one list"
            )
        whole: dict[str, np.ndarray] = {}
        for pt in self.instance_tables:
            whole.update(normalize_block_ids(block_ids, pt, f"{what} (the instance's layer groups)"))
        slot = -1
        tables = [pt for pt in self.instance_tables if pt.state_slots()]
        if tables:
            table = min(tables, key=lambda pt: pt.state_slots())
            got = normalize_state_slot(state_slot, table, f"request {rid!r} state_slot (the instance's state pools)")
            slot = -1 if got is None else got
        return whole, slot

    def on_pull_done(self, source: Source, msg: wire.PullDone) -> None:
        """A receiver's read of a pull request ended: count it, answer it; the session settles when all did."""
        key = (msg.gen_instance, msg.gen_rank)
        rid = msg.request_id
        with self.link.lock:
            if key not in self.peers:
                self._readmit(key, msg.gen_incarnation, source)
            asker = self._registered(key, msg.gen_incarnation)
            if asker is None:
                why = f"generation rank {key} is not registered with this context rank"
                self._refuse_request(source, rid, msg.nonce, "NotRegisteredError", why)
                return
            asker.asked_at = time.monotonic()
            s = self.tx.get(rid)
            if msg.ctx_incarnation != self.link.incarnation:
                why = f"read from context incarnation {msg.ctx_incarnation[:8]}; this is {self.link.incarnation[:8]}"
                self._refuse_request(source, rid, msg.nonce, "PeerLostError", why)
                return
            if s is None:
                tomb = self._tombstone_for(rid, msg.ticket)
                if tomb is None and msg.status == "ok":
                    # Read before start_send ran here (the engine handed out the parameters first, as vLLM's
                    # request_finished does): kept until start_send, which checks it like any other.
                    self._keep_early(msg, source, self.config.request_timeout_s)
                    return
                if tomb is not None and tomb.state is SessionState.DONE:
                    tomb = None  # released after every receiver reported: this one is not among them
                kind = tomb.error_kind if tomb is not None else "SessionError"
                why = tomb.message if tomb is not None else f"request {rid} is not held here (any more)"
                status = answer_status(tomb.state) if tomb is not None else "failed"
                self.link.reply(source, self._result(rid, msg.nonce, status=status, kind=kind, error=why))
                return
            self._take_pull_done(s, msg, source)
        self._settle(s)

    def on_expose_request(self, source: Source, msg: wire.ExposeRequest) -> None:
        """A registered generation rank asks to read this rank's memory for a pull request whose ticket it shows.

        The exposure rule: this rank's memory is given (its full agent descriptor, and on shm its memfds) only to
        a generation rank registered here, over the connection it registered on, that presents the ticket of a
        pull request held here (or kept until ``start_send`` starts it). Push requests never expose anything.
        """
        key = (msg.gen_instance, msg.gen_rank)
        with self.link.lock:
            if key not in self.peers:
                self._readmit(key, msg.gen_incarnation, source)  # dropped while idle: loaded again first (FIFO)
            peer = self._registered(key, msg.gen_incarnation)
            if peer is None or source.identity != peer.identity:
                self._refuse_exposure(source, msg, "NotRegisteredError", f"generation rank {key} is not registered")
                return
            peer.asked_at = time.monotonic()
            s = self.tx.get(msg.request_id)
            if s is None:
                tomb = self._tombstone_for(msg.request_id, msg.ticket)
                if tomb is not None:  # its outcome, as a late receiver's RequestData would hear it
                    kind = tomb.error_kind or ("RequestCancelledError" if tomb.state is SessionState.CANCELLED else "")
                    self._refuse_exposure(
                        source, msg, kind or "SessionError", tomb.message or "the request is not held here any more"
                    )
                    return
                self._keep_early(msg, source, self.config.request_timeout_s)  # before start_send (vLLM's order)
                return
            self._expose_for(s, msg, source)

    def _expose_for(self, s: TxSession, msg: wire.ExposeRequest, source: Source) -> None:
        """Answer an ExposeRequest for the held request ``s`` (lock held)."""
        peer = self._registered((msg.gen_instance, msg.gen_rank), msg.gen_incarnation)
        if peer is None:
            self._refuse_exposure(source, msg, "NotRegisteredError", "the generation rank is not registered")
        elif s.mode != "pull":
            self._refuse_exposure(source, msg, "SessionError", "the request is a push request: nothing is read")
        elif s.terminal:
            self._refuse_exposure(source, msg, "SessionError", "the request is not held here any more")
        elif not self._ticket_ok(s.ticket, msg.ticket):
            self.counters["tickets_refused"] += 1
            self._refuse_exposure(source, msg, "TicketError", "the ticket presented is not the request's")
        else:
            self.link.post(self._expose, peer, msg, source)

    def _expose(self, peer: GenPeer, msg: wire.ExposeRequest, source: Source) -> None:
        """Worker: let ``peer`` access this rank's memory and send it the full descriptor."""
        link = self.link
        try:
            # Its agent was loaded before this ran (the worker runs _load_peer, posted at registration, first).
            if peer.state is not PeerState.READY or peer.agent_name is None:
                raise E.NotRegisteredError(f"{peer} is not registered (its agent is not loaded here)")
            link.agent.expose_to(peer.agent_name)
            desc = link.agent.descriptor()
        except E.KvcoreError as exc:
            with link.lock:
                self._refuse_exposure(source, msg, type(exc).__name__, str(exc))
            return
        with link.lock:
            self.counters["exposed_to_peers"] += 1
            self._answer_exposure(source, msg, descriptor=desc)

    def _take_pull_done(self, s: TxSession, msg: wire.PullDone, source: Source) -> None:
        """Count one receiver's read of ``s`` and give it its final answer (lock held)."""
        key = (msg.gen_instance, msg.gen_rank)
        rid = s.request_id
        peer = self._registered(key, msg.gen_incarnation)
        if peer is None:
            why = f"generation rank {key} is not registered with this context rank (any more)"
            self._refuse_request(source, rid, msg.nonce, "NotRegisteredError", why)
            return
        old = s.tasks.get(key)
        if old is not None:
            if old.peer is peer and old.nonce == msg.nonce and old.final is not None:
                self._send_to(old, old.final)  # the answer was lost: the same answer again
            return
        if self._refused_ticket(s, msg.ticket, msg.nonce, source):
            return
        if s.mode != "pull":
            self._refuse_request(source, rid, msg.nonce, "SessionError", f"request {rid} is sent in push mode")
            return
        t = ReceiverTask(
            peer=peer,
            block_ids={},
            state_slot=-1,
            prompt_len=-1,
            nonce=msg.nonce,
            reply_to=source,
        )
        t.total_bytes, t.total_fragments = max(0, msg.nbytes), max(0, msg.fragments)
        s.tasks[key] = t
        s.renewers.pop(key, None)
        assert peer.info is not None
        if s.expected_receivers is None:
            try:
                s.expected_receivers = len(
                    peer_ranks(self.link.topology, peer.info.topology, peer.info.topology.dp_rank)
                )
            except E.KvcoreError:
                s.expected_receivers = 1
        if s.terminal:
            self._finish_for_session(s, t)
        elif msg.status == "ok" and 0 <= s.prompt_len != msg.prompt_len >= 0:
            exc = E.MappingError(
                f"request {rid!r} prompt_len: context {s.prompt_len}, generation {msg.prompt_len} ({peer} read "
                "blocks for another prompt length)"
            )
            self._finish(s, t, TaskState.FAILED, kind=type(exc).__name__, error=str(exc))
            self._end(s, SessionState.FAILED, exc)
        elif msg.status == "ok" and not hmac.compare_digest(msg.blocks_digest, s.blocks_digest):
            exc = E.MappingError(
                f"request {rid!r}: {peer} read other blocks or another state slot than this context rank was given "
                "(pull mode: pass the same block_ids and state_slot to start_send on every context rank, and "
                "forward its parameters unchanged)"
            )
            self._finish(s, t, TaskState.FAILED, kind=type(exc).__name__, error=str(exc))
            self._end(s, SessionState.FAILED, exc)
        elif msg.status == "ok":
            self._begin(s)
            self._finish(s, t, TaskState.DONE)
        elif msg.status == "cancelled":
            self._finish(s, t, TaskState.CANCELLED, kind="RequestCancelledError", error=msg.error)
        else:
            exc2 = E.TransferFailedError(f"request {rid}: {peer} could not read it: {msg.error_kind}: {msg.error}")
            self._finish(s, t, TaskState.FAILED, kind=type(exc2).__name__, error=str(exc2))
            self._end(s, SessionState.FAILED, exc2)
