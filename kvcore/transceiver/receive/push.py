"""Push mode: ask each writer with ``RequestData`` (and a fresh nonce), and settle it on its final word."""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from kvcore import errors as E
from kvcore.control import wire
from kvcore.layout.blocks import encode_group_ids
from kvcore.layout.peer import peer_ranks
from kvcore.transceiver.link import error_from
from kvcore.transceiver.peers import CtxInstance, PeerState
from kvcore.transceiver.receive.bounce import RecvBounce, _count
from kvcore.transceiver.receive.settle import _MAX_REASKS, answer_outcome
from kvcore.transceiver.sessions import RxSession, SessionState, WriterState

log = logging.getLogger("kvcore.transceiver")


class RecvPush(RecvBounce):
    """Asking writers, declining unsent asks, and the writers' answers."""

    def _ask(self, s: RxSession, inst: CtxInstance, ranks: list[int] | None = None) -> None:
        """Ask context ranks (default: every overlapping one) for ``s`` with fresh nonces."""
        if s.expecting:
            return  # expect(): blocks come with start_receive
        if ranks is None:
            try:
                ranks = peer_ranks(self.link.topology, inst.ranks[0].topology, s.ctx_dp_rank)
            except E.KvcoreError as exc:
                self._move(s, SessionState.FAILED, exc)
                return
            s.instance = inst
        if s.mode == "pull":
            if s.ctx_incarnation != inst.incarnation:
                self._move(
                    s,
                    SessionState.FAILED,
                    E.PeerLostError(
                        f"request {s.request_id}: the context instance at {inst.endpoint} restarted since the "
                        f"transfer parameters were made (incarnation {s.ctx_incarnation[:8]} -> {inst.incarnation[:8]})"
                    ),
                )
                return
            for r in ranks:
                s.nonces[r] = os.urandom(16)
            self._move(s, SessionState.TRANSFERRING)
            if set(ranks) <= inst.registered:
                self.link.post(self._pull, s.request_id)
            return  # read once every writer confirmed it loaded our agent (on_register_result)
        now = time.monotonic()
        for r in ranks:
            self._put_writer(s, r, WriterState.ASKED)
            s.nonces[r] = os.urandom(16)
            s.asked_at[r] = now
        self._move(s, SessionState.TRANSFERRING)
        if (
            len(ranks) == len(s.writers)
            and self.arena is not None
            and self._may_bounce(inst, ranks, _count(s.block_ids))
        ):
            self.link.post(self._ask_bounced, s.request_id)  # plans are computed off the caller's thread
        else:
            self._send_requests(s, inst, ranks, {})

    def _send_requests(
        self,
        s: RxSession,
        inst: CtxInstance,
        ranks: list[int],
        bounce_args: dict[int, tuple[int, int, bytes]],
        *,
        lane: bool = True,
    ) -> None:
        """Ask writers ``ranks`` for ``s``: on the native lane where it serves them (not with ``lane=False``: the
        lane declined), else with a ``RequestData``."""
        remaining_ms = max(1, int((s.deadline - time.monotonic()) * 1000))
        link = self.link
        native = link.native if lane else None
        for r in ranks:
            addr, nbytes, digest = bounce_args.get(r, (0, 0, b""))
            s.sent.add(r)
            if native is not None and not addr and native.ask(s, r):
                continue
            link.send(
                inst.ranks[r].endpoint,
                wire.RequestData(
                    v=wire.PROTOCOL_VERSION,
                    request_id=s.request_id,
                    gen_instance=link.instance_name,
                    gen_rank=link.topology.rank,
                    gen_incarnation=link.incarnation,
                    # one group keeps the plain form; several travel by name
                    block_ids=_single_bytes(s.block_ids),
                    group_block_ids=encode_group_ids(s.block_ids) if len(s.block_ids) > 1 else {},
                    state_slot=s.state_slot,
                    prompt_len=s.prompt_len,
                    cached_tokens=s.cached_tokens,
                    timeout_ms=remaining_ms,
                    bounce_addr=addr,
                    bounce_bytes=nbytes,
                    bounce_digest=digest,
                    ctx_incarnation=inst.ranks[r].incarnation,
                    nonce=s.nonces[r],
                    ticket=s.ticket,
                ),
            )

    def _decline_unsent(self, s: RxSession, reason: str) -> None:
        """Writers we marked ASKED whose RequestData never left (bounce planning pending): decline with the ticket.

        Such a writer cannot write (it was never asked), so it is settled at once. A Cancel with a nonce would
        not do: the context rank has no task to match it and would keep waiting for this receiver until its
        timeout, holding the request's blocks. The ticket-bearing decline ends the context's wait (or, before its
        ``start_send``, leaves the cancel for it).
        """
        inst = s.instance
        unsent = [r for r, w in s.writers.items() if w is WriterState.ASKED and r not in s.sent]
        if inst is None or not unsent:
            return
        for r in unsent:
            self._put_writer(s, r, WriterState.NOT_ASKED)
            if inst.gone:
                continue
            self.link.send(
                inst.ranks[r].endpoint,
                self._cancel(s.request_id, f"cancelled before it was asked for: {reason}", ticket=s.ticket),
            )

    def _not_taken(self, s: RxSession, inst: CtxInstance, r: int, msg: wire.TransferResult) -> None:
        """Writer ``r`` proved it never took the request: settle it; re-register and ask again if worth it."""
        self._settle_writer(s, r, WriterState.NOT_ASKED)
        if s.terminal:
            self._note_quarantine(s)
            return
        n = self.reasks[s.request_id] = self.reasks.get(s.request_id, 0) + 1
        if n > _MAX_REASKS:
            self._move(
                s,
                SessionState.FAILED,
                E.NotRegisteredError(
                    f"context rank {r} still does not know this rank after {_MAX_REASKS} tries: {msg.error}"
                ),
            )
            return
        if inst.state is PeerState.READY:
            # Registration lost, or the context restarted: find out which, then ask again.
            inst.move(PeerState.SUSPECT, deadline=time.monotonic() + self.config.peer_lost_timeout_s)
            self._fetch(inst)

    def _push_answer(self, s: RxSession, inst: CtxInstance, r: int, msg: wire.TransferResult) -> None:
        """Writer ``r``'s final word on a push request (lock held; its nonce checked)."""
        if msg.error_kind == "NotRegisteredError":
            self._not_taken(s, inst, r, msg)
            return
        if s.writers[r] is not WriterState.ASKED:
            return  # already settled
        if msg.status == "ok":
            if not self._take_aux(s, r, msg.aux):
                self._settle_writer(s, r, WriterState.OK)
                return
            self._settle_writer(s, r, WriterState.OK)
            s.nbytes += msg.nbytes
            if msg.bounced and r in s.unpack:
                s.bounced.add(r)
            if s.all_ok() and not s.terminal:
                if s.bounced:
                    self.link.post(self._unpack, s.request_id)  # DONE once the bytes are in place
                else:
                    self._move(s, SessionState.DONE)
        elif msg.in_doubt:
            self._move(
                s,
                SessionState.TIMED_OUT,
                E.TransferTimeoutError(f"context rank {r} timed out request {msg.request_id}: {msg.error}"),
            )
        elif msg.status == "cancelled":
            self._settle_writer(s, r, WriterState.CANCELLED)
            self._move(
                s,
                SessionState.CANCELLED,
                E.RequestCancelledError(f"request {msg.request_id} cancelled by context rank {r}: {msg.error}"),
            )
        else:
            self._settle_writer(s, r, WriterState.FAILED)
            err = error_from(msg.error_kind, f"context rank {r} failed request {msg.request_id}: {msg.error}")
            self._move(s, answer_outcome(msg.status, err), err)
        self._note_quarantine(s)


def _single_bytes(ids: dict[str, np.ndarray]) -> bytes:
    """The only group's ids as little-endian int64 bytes (b"": several groups, or none)."""
    return next(iter(ids.values())).astype("<i8", copy=False).tobytes() if len(ids) == 1 else b""
