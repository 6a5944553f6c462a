"""Leases: a receiver keeps a request's pages held with ``Renew``; a request whose lease ran out ends TIMED_OUT."""

from __future__ import annotations

import hmac
import logging
import time

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.transceiver.send.asks import SendAsks
from kvcore.transceiver.send.settle import answer_status
from kvcore.transceiver.sessions import (
    SessionState,
    TaskState,
)

log = logging.getLogger("kvcore.transceiver")

_Key = tuple[str, int]


class SendLeases(SendAsks):
    """Lease renewals and lease expiry."""

    def on_renew(self, source: Source, msg: wire.Renew) -> None:
        """A receiver keeps a request's lease alive while it waits (only with the request's ticket)."""
        key = (msg.gen_instance, msg.gen_rank)
        rid = msg.request_id
        now = time.monotonic()
        with self.link.lock:
            peer = self.peers.get(key) or self._readmit(key, msg.gen_incarnation, source)
            if peer is None or peer.gone or peer.incarnation != msg.gen_incarnation:
                self.counters["ignored_renewals"] += 1
                return
            peer.asked_at = now
            s = self.tx.get(rid)
            if s is None:
                tomb = self._tombstone_for(rid, msg.ticket)
                if tomb is not None and tomb.state is not SessionState.DONE:
                    status = answer_status(tomb.state)
                    self.link.reply(
                        source, self._result(rid, msg.nonce, status=status, kind=tomb.error_kind, error=tomb.message)
                    )
                return  # not started yet (the lease begins at start_send), or done: nothing to keep
            if self.config.require_tickets and not hmac.compare_digest(msg.ticket, s.ticket):
                self.counters["tickets_refused"] += 1
                return  # no answer: a stranger learns nothing about the request
            if s.terminal:
                if s.state is not SessionState.DONE:
                    err = s.error or E.SessionError(f"request {rid} ended {s.state.value}")
                    status = answer_status(s.state)
                    self.link.reply(
                        source, self._result(rid, msg.nonce, status=status, kind=type(err).__name__, error=str(err))
                    )
                return
            if key not in s.renewers and len(s.renewers) >= 4096:
                return
            s.renewers[key] = msg.nonce
            self.tx.set_deadline(s, min(max(s.deadline, now + self.config.lease_s), s.hold_until))

    def _expire_leases(self, now: float) -> None:
        """End the sessions whose lease ran out (lock held): only those whose deadline passed, not every live one."""
        cfg = self.config
        for s in self.tx.due(now):  # only the sessions whose deadline passed, not every live one
            if not s.terminal:
                done = sum(1 for t in s.tasks.values() if t.state is TaskState.DONE)
                want = "?" if s.expected_receivers is None else s.expected_receivers
                self._end(
                    s,
                    SessionState.TIMED_OUT,
                    E.LeaseExpiredError(
                        f"request {s.request_id}: its lease ran out ({done} of {want} receivers had it after "
                        f"{now - s.created:.1f}s; request_timeout_s={cfg.request_timeout_s}, lease_s={cfg.lease_s})"
                    ),
                )
