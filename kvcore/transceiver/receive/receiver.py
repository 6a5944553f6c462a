"""The generation role: fetch context instances, ask their ranks for requests, and settle each writer.

This class only dispatches: the engine's calls, the message handlers and the timers go to the concern modules
(:mod:`.peers`, :mod:`.push`, :mod:`.pull`, :mod:`.bounce`, :mod:`.leases`), and every state change to
:mod:`.settle`. Answers count only when they echo the secret nonce this rank put in its request, so a stranger
cannot settle, fail or cancel a request.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.layout.blocks import as_id_array, normalize_block_ids, normalize_state_slot
from kvcore.layout.mapping import check_destination_covers
from kvcore.params import InternalId, TransferMode
from kvcore.transceiver.link import Handler
from kvcore.transceiver.peers import CtxInstance, PeerState
from kvcore.transceiver.receive.push import RecvPush
from kvcore.transceiver.sessions import RequestStatus, RxSession, SessionState, WriterState

log = logging.getLogger("kvcore.transceiver")


class Receiver(RecvPush):
    """Generation role of a transceiver."""

    def handlers(self) -> dict[type, Handler]:
        return {
            wire.InstanceInfo: self.on_instance_info,
            wire.RegisterResult: self.on_register_result,
            wire.TransferResult: self.on_transfer_result,
            wire.ErrorReply: self.on_error_reply,
            wire.Goodbye: self.on_goodbye,
            wire.Exposure: self.on_exposure,
        }

    def on_transfer_result(self, source: Source, msg: wire.TransferResult) -> None:
        with self.link.lock:
            s = self.rx.get(msg.request_id)
            if s is not None and msg.nonce and hmac.compare_digest(msg.nonce, s.renew_nonce):
                self._lease_answer(s, msg)
                return
            if s is None or s.instance is None or msg.ctx_rank not in s.writers:
                self.counters["late_results"] += 1
                return
            if not msg.nonce or msg.nonce != s.nonces.get(msg.ctx_rank):
                self.counters["forged_messages"] += 1  # only the writer we asked knows the nonce
                return
            native = self.link.native
            if native is not None and msg.nonce in native.asks:
                # Asked on the native lane: its answer comes there. The control plane may say "nothing in flight"
                # while the lane is writing (the two do not see each other's state): never settle on it.
                self.counters["late_results"] += 1
                return
            inst, r = s.instance, msg.ctx_rank
            if r in s.asked_at and s.writers[r] is WriterState.ASKED:
                self.link.metrics.writer_round_trip(inst.name, time.monotonic() - s.asked_at[r])
            if s.mode == "pull":
                self._pull_answer(s, r, msg)
                return
            self._push_answer(s, inst, r, msg)

    def _lane_completion(self, c: Any) -> None:
        """A writer's word on a request asked on the native lane (lock held), read as its ``TransferResult``.

        "declined": nothing was written, the request is asked again on the Python path. "timed_out": the answer
        did not come in time, so the write may still land (the writer stays unsettled, as an in-doubt result
        leaves it, until its final word or its fencing).
        """
        native = self.link.native
        assert native is not None
        ask = native.asks.get(c.nonce)
        if ask is None:
            self.counters["late_results"] += 1
            return
        rid, r, nbytes = ask
        if c.status != "timed_out":
            del native.asks[c.nonce]
        s = self.rx.get(rid)
        if s is None or s.instance is None or r not in s.writers or s.nonces.get(r) != c.nonce:
            self.counters["late_results"] += 1
            return
        inst = s.instance
        if c.status == "declined":
            if s.writers[r] is WriterState.ASKED:
                if s.terminal:
                    self._settle_writer(s, r, WriterState.NOT_ASKED)  # it wrote nothing and never will
                    self._note_quarantine(s)
                else:
                    self._send_requests(s, inst, [r], {}, lane=False)
            return
        if r in s.asked_at and s.writers[r] is WriterState.ASKED:
            self.link.metrics.writer_round_trip(inst.name, time.monotonic() - s.asked_at[r])
        ok = c.status == "ok"
        status: wire.ResultStatus = "ok" if ok else "cancelled" if c.status == "cancelled" else "failed"
        msg = wire.TransferResult(
            v=wire.PROTOCOL_VERSION,
            request_id=rid,
            ctx_rank=r,
            ctx_incarnation=inst.ranks[r].incarnation,
            status=status,
            nbytes=nbytes if ok else 0,
            error_kind="" if ok else "TransferTimeoutError" if c.status == "timed_out" else "TransferFailedError",
            error=c.error[:1000],
            nonce=c.nonce,
            in_doubt=c.status == "timed_out",
        )
        self._push_answer(s, inst, r, msg)

    def start_receive(
        self,
        rid: InternalId,
        ctx_endpoint: str,
        block_ids: object,
        prompt_len: int,
        state_slot: int,
        ctx_dp_rank: int,
        *,
        ticket: bytes = b"",
        mode: TransferMode = "push",
        ctx_block_ids: object = (),
        ctx_state_slot: int = -1,
        ctx_incarnation: str = "",
        expecting: bool = False,
        lease_s: float = 0.0,
        cached_tokens: int = 0,
    ) -> None:
        blocks = normalize_block_ids(block_ids, self.link.page_table, f"request {rid!r} block_ids")
        slot = normalize_state_slot(state_slot, self.link.page_table, f"request {rid} state_slot")
        state_slot = -1 if slot is None else slot
        wire.parse_endpoint(ctx_endpoint)
        for name, value in (
            ("prompt_len", prompt_len),
            ("ctx_dp_rank", ctx_dp_rank),
            ("ctx_state_slot", ctx_state_slot),
            ("cached_tokens", cached_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise E.SessionError(f"request {rid!r}: {name} must be an integer, got {value!r}")
        if cached_tokens < 0:
            raise E.SessionError(f"request {rid!r}: cached_tokens must be >= 0, got {cached_tokens}")
        if prompt_len >= 0 and not expecting:
            if cached_tokens > prompt_len:
                raise E.MappingError(f"request {rid!r}: cached_tokens {cached_tokens} exceeds prompt_len {prompt_len}")
            check_destination_covers(
                self.link.page_table,
                blocks,
                prompt_len=int(prompt_len),
                cached_tokens=int(cached_tokens),
                what=f"request {rid!r} block_ids",
            )
        ctx_blocks: Any = {}
        if mode == "pull":
            ctx_blocks = (
                {g: as_id_array(v, f"request {rid} context block_ids[{g!r}]") for g, v in ctx_block_ids.items()}
                if isinstance(ctx_block_ids, Mapping)
                else as_id_array(ctx_block_ids, f"request {rid} context block_ids")
            )
        if mode == "pull" and not self.link.agent.capabilities.read:
            raise E.UnsupportedOperationError(
                f"request {rid}: pull mode needs an agent that can READ; {self.link.agent.backend!r} cannot"
            )
        now = time.monotonic()
        with self.link.lock:
            old = self.rx.get(rid)
            if old is not None and not (old.expecting and not expecting):
                raise E.SessionError(f"request {rid} is already being received")
            if old is not None:
                # expect() announced it; now the blocks are allocated.
                if old.ctx_endpoint != ctx_endpoint or old.ticket != ticket:
                    raise E.SessionError(f"request {rid}: start_receive names other parameters than expect() did")
                s = old
                s.expecting = False
                s.block_ids, s.state_slot, s.prompt_len = blocks, int(state_slot), int(prompt_len)
                s.cached_tokens = int(cached_tokens)
                s.ctx_block_ids, s.ctx_state_slot, s.ctx_incarnation = ctx_blocks, int(ctx_state_slot), ctx_incarnation
                if not s.terminal:
                    self.rx.set_deadline(s, now + self.config.request_timeout_s)
            else:
                self.admit()
                s = RxSession(
                    request_id=rid,
                    deadline=now + (self.config.max_lease_s if expecting else self.config.request_timeout_s),
                    ctx_endpoint=ctx_endpoint,
                    block_ids=blocks,
                    state_slot=int(state_slot),
                    prompt_len=int(prompt_len),
                    cached_tokens=int(cached_tokens),
                    ctx_dp_rank=int(ctx_dp_rank),
                    ticket=ticket,
                    mode=mode,
                    expecting=expecting,
                    ctx_block_ids=ctx_blocks,
                    ctx_state_slot=int(ctx_state_slot),
                    ctx_incarnation=ctx_incarnation,
                    renew_nonce=os.urandom(16),
                    last_renew=now,
                    renew_every=(lease_s or self.config.lease_s) / 3.0,
                )
                self.rx[rid] = s
                self._renewals.file(rid, now + s.renew_every)
                self.link.metrics.request_started()
            if s.terminal:
                return  # e.g. its lease ran out while it was expected: poll() reports that
            inst = self.instances.get(ctx_endpoint)
            if inst is None:
                inst = CtxInstance(endpoint=ctx_endpoint)
                inst.move(PeerState.CONNECTING, deadline=now + self.config.first_contact_timeout_s)
                self.instances[ctx_endpoint] = inst
                self._fetch(inst)
            if inst.state is PeerState.REFUSED:
                self._move(s, SessionState.FAILED, inst.error)
                if inst.refusal_ranks and inst.error is not None and not s.expecting:
                    self._tell_refusal(s, inst.refusal_ranks, inst.error)
            elif inst.state is PeerState.READY and not s.expecting:
                self._ask(s, inst)

    def cancel(self, rid: InternalId, reason: str) -> bool:
        with self.link.lock:
            s = self.rx.get(rid)
            if s is None or s.terminal:
                return False
            self._move(s, SessionState.CANCELLED, E.RequestCancelledError(f"request {rid}: {reason}"))
            if s.instance is None:
                inst = self.instances.get(s.ctx_endpoint)
                if inst is not None and inst.state is PeerState.READY:
                    self._decline(inst, [(rid, s.ctx_dp_rank, s.ticket)])  # e.g. expected, never started: say so now
                else:
                    pending = self.declines.setdefault(s.ctx_endpoint, [])
                    if len(pending) < self.config.max_inflight_requests:
                        pending.append((rid, s.ctx_dp_rank, s.ticket))
            elif s.mode == "pull":
                self._pull_unread(s, "cancelled", reason)
            else:
                self._decline_unsent(s, reason)
            self._query_writers(s, reason)
            self._note_quarantine(s)
        return True

    def release(self, rid: InternalId) -> None:
        s = self.rx.pop(rid, None)
        self.reasks.pop(rid, None)
        if s is None:
            return
        native = self.link.native
        if native is not None:
            for nonce in s.nonces.values():
                native.drop_ask(nonce)  # a lane answer that never came (the writer was fenced)
        if self.arena is not None:
            for off in s.leases.values():
                self.arena.release(off)  # every writer is settled: nothing can land here any more
            s.leases.clear()
        self.quarantined.discard(rid)

    def busy(self) -> bool:
        return bool(self.reads)

    def peer_name(self, session: Any) -> str:
        inst = session.instance
        return inst.name if inst is not None else ""

    def _live_status(self, s: RxSession) -> RequestStatus:
        """WAITING while expected (no blocks yet), CONNECTING until its instance is known, then TRANSFERRING."""
        if s.expecting:
            return RequestStatus.WAITING
        if s.instance is None:
            return RequestStatus.CONNECTING
        return RequestStatus.TRANSFERRING

    def tick(self, now: float) -> None:
        self.lane_drain()
        cfg = self.config
        unload: list[CtxInstance] = []
        with self.link.lock:
            reads = list(self.reads.values())
        for s, r in reads:
            self._check_read(s, r, now)
        with self.link.lock:
            self._renew(now)
            # Only the sessions whose deadline passed, then those that ended and still wait for a writer's
            # final word (terminal, not quiescent): never a scan of every live session.
            for s in self.rx.due(now):
                asked = ", ".join(f"{r}={w.value}" for r, w in s.writers.items()) or "none contacted"
                self._move(
                    s,
                    SessionState.TIMED_OUT,
                    E.TransferTimeoutError(
                        f"request {s.request_id} not complete after {cfg.request_timeout_s}s (writers: {asked})"
                    ),
                )
            for _, s in self.rx.news():
                if not s.quiescent:
                    self._fence(s, now)
                    self._note_quarantine(s)
            unload = self._reap_instances(now)
            ready: list[Callable[[], None]] = []
            if self.awaiting_name:  # loads whose name no retired instance holds now (no scan of the sessions)
                held = {n for i in self.retired for n in i.agents.values()}
                waits, self.awaiting_name = self.awaiting_name, []
                for inst, name, retry in waits:
                    if name in held and not inst.gone:
                        self.awaiting_name.append((inst, name, retry))
                    elif not inst.gone:
                        ready.append(retry)
        for inst in unload:
            self._unload(inst)
        for retry in ready:
            retry()  # after the unloads above: the name is free (else it waits again)

    def stats(self) -> dict[str, int]:
        with self.link.lock:
            return {
                "rx_sessions": len(self.rx),
                "quarantined": len(self.quarantined),
                "ctx_instances": sum(1 for i in self.instances.values() if not i.gone),
                "retired_instances": len(self.retired),
                "bounce_leases": self.arena.leased if self.arena else 0,
                "pull_reads": len(self.reads),
            }

    def close(self) -> None:
        for inst in list(self.instances.values()) + self.retired:
            for r, name in inst.agents.items():
                self.link.unload_agent(name, inst.ranks[r].incarnation, inst.loaded.get(r, b""))
