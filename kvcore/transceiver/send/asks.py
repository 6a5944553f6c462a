"""What a context rank answers about requests it does not serve (yet): tickets, tombstones, early asks, cancels."""

from __future__ import annotations

import hmac
import logging
import time

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.params import BytesId, InternalId, api_id
from kvcore.transceiver.link import error_from
from kvcore.transceiver.peers import GenPeer
from kvcore.transceiver.send.peers import SendPeers
from kvcore.transceiver.sessions import (
    IDLE_TASK_STATES,
    SessionState,
    TaskState,
    Tombstone,
    TxSession,
)

log = logging.getLogger("kvcore.transceiver")

_Key = tuple[str, int]


class SendAsks(SendPeers):
    """Answers from tombstones and to early asks, ticket checks, receivers' declines and cancels."""

    def _id_type_hint(self, rid: InternalId) -> tuple[str, bytes | None]:
        """A hint when this rank holds the same request id under another type (int 5 vs str "5"), lock held.

        Returns the hint and the ticket that request holds here: the asker is told only if its ticket may speak
        for that request (a stranger learns nothing of requests it cannot read; the log always says it).
        """
        text = rid.b.decode(errors="replace") if isinstance(rid, BytesId) else str(rid)
        others: list[InternalId] = [text, BytesId(text.encode())]
        if text.lstrip("-").isdigit():
            others.append(int(text))
        for other in others:
            if type(other) is type(rid):
                continue
            held = self.tx.get(other)
            tomb = self._tomb(other) if held is None else None
            if held is None and tomb is None:
                continue
            mine, theirs = api_id(other), api_id(rid)
            hint = (f" (this context holds request {mine!r} ({type(mine).__name__}) while the receiver named "
                    f"{theirs!r} ({type(theirs).__name__}): both sides must use the same request id type)")  # fmt: skip
            return hint, (held.ticket if held is not None else tomb.ticket if tomb is not None else None)
        return "", None

    def _answer_unheld(
        self, req: wire.RequestData | wire.PullDone, source: Source, tomb: Tombstone | None, hint: str = ""
    ) -> None:
        """Answer a receiver asking for a request this rank does not hold, from its tombstone (lock held)."""
        rid = req.request_id
        status: wire.ResultStatus
        if tomb is None:
            status, kind, error = (
                "failed",
                "TransferTimeoutError",
                f"context side never started sending request {rid!r}{hint}",
            )
        elif tomb.state is SessionState.CANCELLED:
            status, kind, error = "cancelled", tomb.error_kind, tomb.message
        elif tomb.state is SessionState.DONE:
            status, kind, error = (
                "failed",
                "SessionError",
                f"request {rid} was already sent and its pages released here",
            )
        else:
            status, kind, error = "failed", tomb.error_kind or "SessionError", tomb.message
        self.link.reply(source, self._result(rid, req.nonce, status=status, kind=kind, error=error))

    def _ticket_ok(self, expected: bytes, presented: bytes | None) -> bool:
        """Whether a peer's ticket may speak for a request (``None``: this rank's own engine, always)."""
        return presented is None or not self.config.require_tickets or hmac.compare_digest(expected, presented)

    def _tomb(self, rid: InternalId) -> Tombstone | None:
        """The tombstone of ``rid``: this rank's engine's, else a peer's (lock held); None if neither holds one."""
        tomb = self.tombstones.get(rid)
        return self.peer_tombstones.get(rid) if tomb is None else tomb

    def _tombstone_for(self, rid: InternalId, ticket: bytes) -> Tombstone | None:
        """The tombstone of ``rid`` if the asker's ticket may read it (lock held); None otherwise."""
        for tomb in (self.tombstones.get(rid), self.peer_tombstones.get(rid)):
            if tomb is not None and (tomb.ticket is None or self._ticket_ok(tomb.ticket, ticket)):
                return tomb
        return None

    def _keep_early(
        self, msg: wire.RequestData | wire.PullDone | wire.ExposeRequest, source: Source, ttl: float
    ) -> None:
        """Keep a receiver's message for a request not started here yet, within the caps (lock held).

        Kept until ``ttl`` (the receiver's deadline, bounded by ours) less a margin, then answered with a failure:
        the answer (which may name a request id of another type held here) reaches the receiver before its own
        timer ends the request with a bare timeout.
        """
        ttl = max(0.0, ttl - min(0.5, 0.1 * ttl))
        why = self.early.refusal(msg)
        if why is not None:
            if isinstance(msg, wire.ExposeRequest):
                self._refuse_exposure(source, msg, "ResourceExhaustedError", why)
            else:
                self._refuse_request(source, msg.request_id, msg.nonce, "ResourceExhaustedError", why)
            return
        self.early.add(msg, source, time.monotonic() + ttl)

    def _decline(self, peer: GenPeer, msg: wire.Cancel, source: Source) -> None:
        """A receiver that never asked for a request says it never will (lock held).

        Accepted only over the connection the receiver registered on: its ROUTER identity is unguessable, so a
        stranger cannot end other peers' requests this way.
        """
        if peer.identity is None or source.identity != peer.identity:
            self.counters["forged_messages"] += 1
            return
        s = self.tx.get(msg.request_id)
        err = E.RequestCancelledError(f"request {msg.request_id} declined by {peer}: {msg.reason}")
        if s is None:
            if self._tomb(msg.request_id) is None:
                # Honoured by start_send only if the engine's ticket is this one: a peer cannot pre-cancel others'.
                self.peer_tombstones.put(msg.request_id, SessionState.CANCELLED, err, ticket=msg.ticket)
        elif not s.terminal:
            if not self._ticket_ok(s.ticket, msg.ticket):
                self.counters["tickets_refused"] += 1
                return
            self._end(s, SessionState.CANCELLED, err)

    def _not_registered(self, source: Source, msg: wire.RequestData, why: str) -> None:
        self._refuse_request(source, msg.request_id, msg.nonce, "NotRegisteredError", why)

    def _refuse_request(self, source: Source, rid: InternalId, nonce: bytes, kind: str, error: str) -> None:
        """Answer one asker "failed" (``kind``: the kvcore error class) without touching the request (lock held)."""
        self.link.reply(source, self._result(rid, nonce, status="failed", kind=kind, error=error))

    def _refused_ticket(self, s: TxSession, ticket: bytes, nonce: bytes, source: Source) -> bool:
        """True (and the asker told so) when tickets are required and ``ticket`` is not the request's (lock held)."""
        if not self.config.require_tickets or hmac.compare_digest(ticket, s.ticket):
            return False
        self.counters["tickets_refused"] += 1
        why = "no ticket was presented" if not ticket else "the ticket presented is not this request's"
        # Rate-limited: a stranger guessing tickets would otherwise write a line per guess (each is counted).
        self._rlog(logging.WARNING, "ticket", "request %r: refused a receiver: %s", s.request_id, why)
        self._refuse_request(
            source,
            s.request_id,
            nonce,
            "TicketError",
            f"request {s.request_id}: {why} (pass the context's TransferParams to start_receive)",
        )
        return True

    def _refused_by_receiver(self, msg: wire.Cancel) -> None:
        """A receiver will not take a request: it refused this instance, or this rank refused it (lock held).

        Honoured only with the request's own ticket (whatever ``require_tickets`` says: the sender may be a
        rank this one never registered), so only the request's receiver can end it; the request ends FAILED at
        once with the receiver's reason, typed as it reported it.
        """
        s = self.tx.get(msg.request_id)
        if s is None or s.terminal:
            return  # not started here (its start_send meets no receiver and ends by its lease) or already over
        if not msg.ticket or not hmac.compare_digest(msg.ticket, s.ticket):
            self.counters["tickets_refused"] += 1
            return
        who = f"generation rank {(msg.instance, msg.rank)}"
        self._end(s, SessionState.FAILED, error_from(msg.refusal, f"request {s.request_id!r}: {who}: {msg.reason}"))

    def on_cancel(self, source: Source, msg: wire.Cancel) -> None:
        """A receiver cancels (or asks for the final word on) its part of a request."""
        key = (msg.instance, msg.rank)
        with self.link.lock:
            if msg.refusal and not msg.nonce:
                self._refused_by_receiver(msg)
                return
            peer = self.peers.get(key)
            if peer is None or peer.gone:
                self.counters["ignored_cancels"] += 1
                return
            if not msg.nonce:
                self._decline(peer, msg, source)
                return
            s = self.tx.get(msg.request_id)
            t = s.tasks.get(key) if s is not None else None
            if s is not None and s.lane and (t is None or t.peer is not peer):
                # Offered on the native lane: this receiver may have asked there, so only the lane may say whether
                # anything is in flight. Withdrawn before its write started: the request ends here (one receiver);
                # being written (or written): the lane's own answer settles the receiver, not this one.
                native = self.link.native
                if native is None or not native.withdraw(s):
                    return
                s.lane = False
                self._end(s, SessionState.CANCELLED, E.RequestCancelledError(f"cancelled by {peer}"))
            if t is None or t.peer is not peer:
                mine = self.early.take(
                    msg.request_id,
                    lambda e: (e[1].gen_instance, e[1].gen_rank) != key or e[1].nonce != msg.nonce,
                )
                tomb = self._tomb(msg.request_id)
                if s is None and tomb is None and mine:
                    # Cancelled before start_send: remember, so the engine's later start_send ends CANCELLED
                    # (if that start_send has the ticket the receiver asked with).
                    self.peer_tombstones.put(
                        msg.request_id,
                        SessionState.CANCELLED,
                        E.RequestCancelledError(f"cancelled by {peer}"),
                        ticket=mine[0][1].ticket,
                    )
                    tomb = self.peer_tombstones.get(msg.request_id)
                # Nothing of this receiver's is in flight here: say so (the receiver may release its pages).
                status: wire.ResultStatus = (
                    "cancelled" if tomb is None or tomb.state is not SessionState.DONE else "failed"
                )
                self._tell(
                    peer,
                    self._result(
                        msg.request_id,
                        msg.nonce,
                        status=status,
                        kind="RequestCancelledError",
                        error=msg.reason or "nothing in flight for this receiver",
                    ),
                )
                return
            if t.nonce != msg.nonce:
                self.counters["forged_messages"] += 1
                return
            if t.state in IDLE_TASK_STATES:
                self._finish(s, t, TaskState.CANCELLED, kind="RequestCancelledError", error=msg.reason)  # type: ignore[arg-type]
            elif t.final is not None:
                self._send_to(t, t.final)
            # A submitted write cannot be recalled: its final answer follows when the transport finishes.
        self.link.post(self._drive, msg.request_id)

    def _expire_asks(self, now: float) -> None:
        """Answer the early asks whose time ran out and forget old tombstones (lock held)."""
        for _, req, source in self.early.expired(now):
            self.counters["early_requests_expired"] += 1
            if isinstance(req, wire.ExposeRequest):
                self._refuse_exposure(source, req, "TransferTimeoutError", "the request was never started here")
                continue
            hint, held_ticket = self._id_type_hint(req.request_id)
            log.warning("request %r: a receiver asked for it, but it was never started here before the receiver's "
                        "deadline%s", req.request_id, hint)  # fmt: skip
            told = hint if held_ticket is not None and self._ticket_ok(held_ticket, req.ticket) else ""
            self._answer_unheld(req, source, None, told)
        self.tombstones.expire(now)
        self.peer_tombstones.expire(now)

    def _refuse_exposure(self, source: Source, msg: wire.ExposeRequest, kind: str, why: str) -> None:
        self._answer_exposure(source, msg, kind=kind, error=f"request {msg.request_id}: {why}")

    def _answer_exposure(
        self, source: Source, msg: wire.ExposeRequest, *, descriptor: bytes = b"", kind: str = "", error: str = ""
    ) -> None:
        """Answer ``msg``: this rank's full descriptor, or (``kind``, ``error``) why not."""
        link = self.link
        link.reply(
            source,
            wire.Exposure(
                v=wire.PROTOCOL_VERSION,
                request_id=msg.request_id,
                ctx_rank=link.topology.rank,
                ctx_incarnation=link.incarnation,
                nonce=msg.nonce,
                agent_descriptor=descriptor,
                error_kind=kind,
                error=error,
            ),
        )
