"""Leases: renew each request we wait for at a third of the context's lease; its answer means the request is gone."""

from __future__ import annotations

import logging

from kvcore import errors as E
from kvcore.control import wire
from kvcore.layout.peer import peer_ranks
from kvcore.transceiver.link import error_from
from kvcore.transceiver.peers import PeerState
from kvcore.transceiver.receive.pull import RecvPull
from kvcore.transceiver.receive.settle import answer_outcome
from kvcore.transceiver.sessions import RxSession

log = logging.getLogger("kvcore.transceiver")


class RecvLeases(RecvPull):
    """Lease renewals and their answers."""

    def _renew(self, now: float) -> None:
        """Renew the leases of requests we still wait for (lock held): at a third of the context's lease."""
        if now - self._renew_scan < 0.1:
            return  # leases are seconds long: a scan every 100 ms is plenty, even when the worker ticks faster
        self._renew_scan = now
        renewals = self._renewals
        for rid in renewals.take(now):  # only the requests whose renewal is due, not every live one
            s = self.rx.get(rid)
            if s is None or s.terminal or not s.ticket:
                continue  # gone, ended or never leased: not filed again
            if now - s.last_renew < s.renew_every:
                renewals.file(rid, s.last_renew + s.renew_every)
                continue
            inst = self.instances.get(s.ctx_endpoint)
            if inst is None or inst.state is not PeerState.READY:
                renewals.file(rid, now + 0.1)  # renewed once its instance is (again) ready
                continue
            s.last_renew = now
            renewals.file(rid, now + s.renew_every)
            try:
                ranks = list(s.nonces) or peer_ranks(self.link.topology, inst.ranks[0].topology, s.ctx_dp_rank)
            except E.KvcoreError:
                continue
            for r in ranks:
                self.link.send(
                    inst.ranks[r].endpoint,
                    wire.Renew(
                        v=wire.PROTOCOL_VERSION,
                        request_id=s.request_id,
                        gen_instance=self.link.instance_name,
                        gen_rank=self.link.topology.rank,
                        gen_incarnation=self.link.incarnation,
                        ticket=s.ticket,
                        nonce=s.renew_nonce,
                    ),
                )

        if len(renewals) > 2 * len(self.rx) + 1024:
            renewals.rebuild(
                (x.last_renew + x.renew_every, k) for k, x in self.rx.items() if not x.terminal and x.ticket
            )

    def _lease_answer(self, s: RxSession, msg: wire.TransferResult) -> None:
        """The context answered a lease renewal: the request is gone there (lock held)."""
        if msg.status == "ok" or s.terminal:
            return
        err = error_from(msg.error_kind, f"context rank {msg.ctx_rank}: {msg.error}")
        self._move(s, answer_outcome(msg.status, err), err)
        if s.mode == "pull" and s.instance is not None:
            self._pull_unread(s, "cancelled", str(err))
        self._note_quarantine(s)
