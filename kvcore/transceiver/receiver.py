"""The generation role: fetch context instances, ask their ranks for requests, and settle each writer.

A receive session waits for one final answer per context rank that may write
(its *writers*). Answers count only when they echo the secret nonce this rank
put in its request, so a stranger cannot settle, fail or cancel a request. A
session is released only when every writer is settled: it answered, proved it
never took the request, or is fenced (dead on this host, or lost past the
fencing grace on another). A quarantined writer of a live context is asked
again for its final word on a timer, so a lost message cannot pin pages forever.

Why one module of this length: the generation role's handlers, its push and pull paths, lease renewals and
fencing all move the same sessions and writers under one lock; the state machines themselves are in
:mod:`.sessions` and :mod:`.peers`.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.layout.blocks import as_id_array, encode_group_ids, normalize_block_ids, normalize_state_slot
from kvcore.layout.mapping import check_destination_covers, validate_compatible
from kvcore.layout.peer import peer_ranks
from kvcore.metrics import FenceReason
from kvcore.params import InternalId
from kvcore.transceiver.link import Handler, Link, error_from
from kvcore.transceiver.peers import CtxInstance, PeerState, writer_fenced
from kvcore.transceiver.planning import plan_request
from kvcore.transceiver.role import Role
from kvcore.transceiver.sender import blocks_digest
from kvcore.transceiver.sessions import RxSession, SessionState, SessionTable, TimerHeap, WriterState
from kvcore.transport import bounce
from kvcore.transport.agent import TransferOp, TransferStatus

__all__ = ["Receiver"]

log = logging.getLogger("kvcore.transceiver")

#: How many times one request is asked again after "not registered" answers before it fails.
_MAX_REASKS = 3


class Receiver(Role):
    """Generation role of a transceiver."""

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.rx: SessionTable[RxSession] = SessionTable()
        self.instances: dict[str, CtxInstance] = {}  # current incarnation (or refusal) per context endpoint
        self.retired: list[CtxInstance] = []  # lost or replaced instances, unloaded once no request needs them
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

    def handlers(self) -> dict[type, Handler]:
        return {
            wire.InstanceInfo: self.on_instance_info,
            wire.RegisterResult: self.on_register_result,
            wire.TransferResult: self.on_transfer_result,
            wire.ErrorReply: self.on_error_reply,
            wire.Goodbye: self.on_goodbye,
            wire.Exposure: self.on_exposure,
        }

    # --- engine API ----------------------------------------------------------------------------

    def start_receive(
        self,
        rid: Any,
        ctx_endpoint: str,
        block_ids: Any,
        prompt_len: int,
        state_slot: int,
        ctx_dp_rank: int,
        *,
        ticket: bytes = b"",
        mode: str = "push",
        ctx_block_ids: Any = (),
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
                s.transition(SessionState.FAILED, inst.error)
                if inst.refusal_ranks and inst.error is not None and not s.expecting:
                    self._tell_refusal(s, inst.refusal_ranks, inst.error)
            elif inst.state is PeerState.READY and not s.expecting:
                self._ask(s, inst)
            # CONNECTING / SUSPECT: asked once the instance is (again) ready

    def cancel(self, rid: InternalId, reason: str) -> bool:
        with self.link.lock:
            s = self.rx.get(rid)
            if s is None or s.terminal:
                return False
            s.transition(SessionState.CANCELLED, E.RequestCancelledError(f"request {rid}: {reason}"))
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
        if self.arena is not None:
            for off in s.leases.values():
                self.arena.release(off)  # every writer is settled: nothing can land here any more
            s.leases.clear()
        self.quarantined.discard(rid)

    def busy(self) -> bool:
        return bool(self.reads)

    # --- helpers (lock held) -------------------------------------------------------------------

    def _fetch(self, inst: CtxInstance) -> None:
        self.link.send(
            inst.endpoint,
            wire.InstanceInfoRequest(
                v=wire.PROTOCOL_VERSION,
                min_version=wire.MIN_PROTOCOL_VERSION,
                max_version=wire.PROTOCOL_VERSION,
                asker=f"{self.link.instance_name}/{self.link.topology.rank}",
            ),
        )

    def _ask(self, s: RxSession, inst: CtxInstance, ranks: list[int] | None = None) -> None:
        """Ask context ranks (default: every overlapping one) for ``s`` with fresh nonces."""
        if s.expecting:
            return  # expect(): blocks come with start_receive
        if ranks is None:
            try:
                ranks = peer_ranks(self.link.topology, inst.ranks[0].topology, s.ctx_dp_rank)
            except E.KvcoreError as exc:
                s.transition(SessionState.FAILED, exc)
                return
            s.instance = inst
        if s.mode == "pull":
            if s.ctx_incarnation != inst.incarnation:
                s.transition(
                    SessionState.FAILED,
                    E.PeerLostError(
                        f"request {s.request_id}: the context instance at {inst.endpoint} restarted since the "
                        f"transfer parameters were made (incarnation {s.ctx_incarnation[:8]} -> {inst.incarnation[:8]})"
                    ),
                )
                return
            for r in ranks:
                s.nonces[r] = os.urandom(16)
            s.transition(SessionState.TRANSFERRING)
            if set(ranks) <= inst.registered:
                self.link.post(self._pull, s.request_id)
            return  # read once every writer confirmed it loaded our agent (on_register_result)
        now = time.monotonic()
        for r in ranks:
            s.writers[r] = WriterState.ASKED
            s.nonces[r] = os.urandom(16)
            s.asked_at[r] = now
        s.transition(SessionState.TRANSFERRING)
        if (
            len(ranks) == len(s.writers)
            and self.arena is not None
            and self._may_bounce(inst, ranks, _count(s.block_ids))
        ):
            self.link.post(self._ask_bounced, s.request_id)  # plans are computed off the caller's thread
        else:
            self._send_requests(s, inst, ranks, {})

    def _forget_plan_shapes(self, endpoint: str) -> None:
        """Drop the cached plan shapes of an instance that is gone (a new one there may have another layout)."""
        for key in [k for k in self._plan_shape if k[0] == endpoint]:
            del self._plan_shape[key]

    def _may_bounce(self, inst: CtxInstance, writers: list[int], nblocks: int) -> bool:
        """Cheap pre-check from each writer's cached plan shape: False when no writer could qualify for bounce."""
        for r in writers:
            shape = self._plan_shape.get((inst.endpoint, r))
            if shape is None:
                return True  # unknown yet: plan it once
            per_block, mean_bytes = shape
            if (
                per_block * nblocks >= self.config.bounce_min_fragments
                and mean_bytes <= self.config.bounce_max_fragment_bytes
            ):
                return True
        return False

    def _send_requests(
        self, s: RxSession, inst: CtxInstance, ranks: list[int], bounce_args: dict[int, tuple[int, int, bytes]]
    ) -> None:
        remaining_ms = max(1, int((s.deadline - time.monotonic()) * 1000))
        link = self.link
        for r in ranks:
            addr, nbytes, digest = bounce_args.get(r, (0, 0, b""))
            s.sent.add(r)
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

    def _cancel(self, rid: InternalId, reason: str, *, nonce: bytes = b"", ticket: bytes = b"") -> wire.Cancel:
        """Our Cancel of ``rid``: with the nonce of an ask that went out, or with the ticket for one that did not."""
        link = self.link
        return wire.Cancel(
            v=wire.PROTOCOL_VERSION,
            request_id=rid,
            instance=link.instance_name,
            rank=link.topology.rank,
            reason=reason,
            nonce=nonce,
            ticket=ticket,
        )

    def _query_writers(self, s: RxSession, reason: str) -> None:
        """Ask every writer that may still write for its final word (a Cancel carrying the request's nonce)."""
        inst = s.instance
        if inst is None or inst.gone:
            return
        s.last_query = time.monotonic()
        for r, w in s.writers.items():
            if w is WriterState.PULLED and r in s.pull_done:
                self.link.send(inst.ranks[r].endpoint, s.pull_done[r])  # our report may have been lost
            if w is WriterState.ASKED:
                self.link.send(
                    inst.ranks[r].endpoint,
                    self._cancel(s.request_id, reason, nonce=s.nonces[r]),
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
            s.writers[r] = WriterState.NOT_ASKED
            if inst.gone:
                continue
            self.link.send(
                inst.ranks[r].endpoint,
                self._cancel(s.request_id, f"cancelled before it was asked for: {reason}", ticket=s.ticket),
            )

    def _note_quarantine(self, s: RxSession) -> None:
        if s.terminal and not s.quiescent and s.request_id not in self.quarantined:
            self.quarantined.add(s.request_id)
            self.link.metrics.quarantined(self.peer_name(s))

    def peer_name(self, session: Any) -> str:
        inst = session.instance
        return inst.name if inst is not None else ""

    def _refuse(self, inst: CtxInstance, exc: E.KvcoreError, *, tell: list[wire.RankInfo] | None = None) -> None:
        """Refuse a context instance (lock held): its requests here fail; with ``tell``, its ranks hear it too.

        ``tell`` (the instance's ranks, as its rank 0 described them) is given where the refusal is about
        compatibility (ours or theirs), not about who the peer is: each failed request's context ranks get a
        refusal carrying the request's ticket, so they end it at once with the reason instead of holding its
        pages until the lease runs out. Never after a failed authentication: the ticket goes to no endpoint
        that did not prove who it is.
        """
        log.error("refusing %s: %s", inst, exc)
        inst.move(PeerState.REFUSED, deadline=time.monotonic() + self.config.refused_peer_ttl_s, error=exc)
        if tell:
            inst.refusal_ranks = list(tell)  # requests started while the refusal is remembered are told too
        for s in self.rx.values():
            if s.ctx_endpoint == inst.endpoint and s.instance in (None, inst) and not s.terminal:
                s.transition(SessionState.FAILED, exc)
                self._note_quarantine(s)
                if tell:
                    self._tell_refusal(s, tell, exc)

    def _tell_refusal(self, s: RxSession, ranks: list[wire.RankInfo], exc: E.KvcoreError) -> None:
        """Tell the context ranks that hold ``s`` that this rank will not take it, and why (lock held)."""
        if not s.ticket:
            return  # nothing proves we may speak for the request
        try:
            writers = peer_ranks(self.link.topology, ranks[0].topology, s.ctx_dp_rank)
        except E.KvcoreError:
            writers = list(range(len(ranks)))  # the topologies do not even overlap: tell every rank
        msg = wire.Cancel(
            v=wire.PROTOCOL_VERSION,
            request_id=s.request_id,
            instance=self.link.instance_name,
            rank=self.link.topology.rank,
            reason=str(exc)[:2000],
            ticket=s.ticket,
            refusal=type(exc).__name__,
        )
        for r in writers:
            if r < len(ranks):
                self.link.send(ranks[r].endpoint, msg)

    def _lose(self, inst: CtxInstance, error: E.KvcoreError, *, replaced: bool = False, orderly: bool = False) -> None:
        """A context incarnation is gone: its requests fail; its writers are fenced by the timer.

        ``orderly``: a rank of it said goodbye and its connection dropped (a normal shutdown).
        """
        if not inst.move(PeerState.LOST, error=error):
            return
        inst.lost_at = time.monotonic()
        self.counters["peers_closed" if orderly else "peers_lost"] += 1
        log.log(logging.INFO if orderly else logging.WARNING, "%s", error)
        if self.instances.get(inst.endpoint) is inst:
            del self.instances[inst.endpoint]
        self._forget_plan_shapes(inst.endpoint)
        self.retired.append(inst)
        for s in self.rx.values():
            if s.terminal:
                continue
            if replaced and s.instance is inst and all(w is WriterState.NOT_ASKED for w in s.writers.values()):
                # Every writer proved it never took the request: ask the new incarnation instead.
                s.instance = None
                s.writers.clear()
                s.nonces.clear()
                s.unpack.clear()
                continue
            if s.instance is inst or (s.instance is None and not replaced and s.ctx_endpoint == inst.endpoint):
                s.transition(SessionState.FAILED, E.PeerLostError(f"request {s.request_id}: {error}"))
                self._note_quarantine(s)

    # --- control-plane handlers (messenger I/O thread) ------------------------------------------

    def on_instance_info(self, source: Source, msg: wire.InstanceInfo) -> None:
        endpoint = source.endpoint
        if endpoint is None:
            self.counters["ignored_messages"] += 1  # instance info is only ever an answer on our own link
            return
        with self.link.lock:
            inst = self.instances.get(endpoint)
            if inst is None or inst.state not in (PeerState.CONNECTING, PeerState.SUSPECT):
                return  # duplicate or unsolicited
            try:
                ranks = self._validate_info(endpoint, msg)
            except E.KvcoreError as exc:
                self._refuse(inst, exc, tell=self._describable(endpoint, msg))
                return
            if inst.ranks and ranks[0].incarnation == inst.incarnation:
                inst.move(PeerState.READY)  # came back: the same process
                self._resume(inst)
                return
            if inst.ranks:  # another incarnation at the same endpoint: the old one restarted
                self._lose(
                    inst,
                    E.PeerLostError(
                        f"context instance at {endpoint} restarted (incarnation {inst.incarnation[:8]} -> "
                        f"{ranks[0].incarnation[:8]})"
                    ),
                    replaced=True,
                )
                new = CtxInstance(endpoint=endpoint)
                new.move(PeerState.CONNECTING, deadline=time.monotonic() + self.config.first_contact_timeout_s)
                self.instances[endpoint] = new
                inst = new
            inst.ranks = ranks
            for info in ranks[1:]:
                self.link.learn_key(info)
            ctx_topo = ranks[0].topology
            inst.peers = sorted(
                {p for d in range(ctx_topo.dp_size) for p in peer_ranks(self.link.topology, ctx_topo, d)}
            )
        self.link.post(self._load_instance, inst)

    def _describable(self, endpoint: str, msg: wire.InstanceInfo) -> list[wire.RankInfo] | None:
        """The ranks of a refused instance's info when it is well formed enough to tell them (lock held), else None."""
        ranks = sorted(msg.ranks, key=lambda r: r.rank)
        if msg.error or not ranks or ranks[0].endpoint != endpoint:
            return None
        if [r.rank for r in ranks] != list(range(ranks[0].topology.world_size)):
            return None
        for info in ranks[1:]:
            self.link.learn_key(info)  # as for an accepted instance: rank 0 vouches for its ranks' keys
        return ranks

    def _validate_info(self, endpoint: str, msg: wire.InstanceInfo) -> list[wire.RankInfo]:
        if msg.error:
            raise E.ProtocolVersionError(f"context instance at {endpoint} refused: {msg.error}")
        if not msg.ranks:
            raise E.ProtocolError(f"context instance at {endpoint} sent no rank information")
        ranks = sorted(msg.ranks, key=lambda r: r.rank)
        if [r.rank for r in ranks] != list(range(ranks[0].topology.world_size)):
            raise E.ProtocolError(f"context instance at {endpoint} sent an incomplete rank list")
        if ranks[0].endpoint != endpoint:
            raise E.ProtocolError(
                f"context instance at {endpoint} says its rank 0 is at {ranks[0].endpoint}: "
                "contact the instance at its rank 0's advertised endpoint"
            )
        ctx_topo = ranks[0].topology
        link = self.link
        for r in sorted({p for d in range(ctx_topo.dp_size) for p in peer_ranks(link.topology, ctx_topo, d)}):
            if ranks[r].incarnation == link.incarnation and ranks[r].instance_name == link.instance_name:
                raise E.IncompatiblePeerError("the context instance names this rank's own identity")
            validate_compatible(ranks[r].placement, link.placement)
            if ranks[r].backend != link.agent.backend:
                raise E.IncompatiblePeerError(
                    f"transfer backend: context rank {r} uses {ranks[r].backend!r}, this rank uses {link.agent.backend!r}"
                )
        return ranks

    def on_register_result(self, source: Source, msg: wire.RegisterResult) -> None:
        if source.endpoint is None:
            return
        if msg.ok:
            with self.link.lock:
                for inst in self.instances.values():
                    r = inst.rank_of_endpoint(source.endpoint)
                    if r is None or r != msg.ctx_rank or inst.gone or r in inst.registered or r in inst.loaded:
                        continue
                    why = _accepted_info_mismatch(inst.ranks[r], msg.info)
                    if why:
                        self._refuse(inst, E.ProtocolError(f"context rank {r} of {inst}: {why}"))
                        continue
                    assert msg.info is not None
                    inst.ranks[r] = msg.info  # now with its pid and start time (fencing) and identity descriptor
                    inst.loaded[r] = b""  # claimed: one load per rank
                    self.link.post(self._registered, inst, r)
            return
        err = error_from(msg.error_kind, f"context rank {msg.ctx_rank} refused this generation rank: {msg.error}")
        with self.link.lock:
            for inst in list(self.instances.values()):
                if inst.rank_of_endpoint(source.endpoint) is not None and not inst.gone:
                    self._refuse(inst, err, tell=inst.ranks)

    def on_error_reply(self, source: Source, msg: wire.ErrorReply) -> None:
        log.warning("peer %s answered with %s: %s", source.endpoint or "?", msg.kind, msg.error)

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
            inst, r = s.instance, msg.ctx_rank
            if r in s.asked_at and s.writers[r] is WriterState.ASKED:
                self.link.metrics.writer_round_trip(inst.name, time.monotonic() - s.asked_at[r])
            if s.mode == "pull":
                self._pull_answer(s, r, msg)
                return
            if msg.error_kind == "NotRegisteredError":
                self._not_taken(s, inst, r, msg)
                return
            if s.writers[r] is not WriterState.ASKED:
                return  # already settled
            if msg.status == "ok":
                if not self._take_aux(s, r, msg.aux):
                    s.settle(r, WriterState.OK)
                    return
                s.settle(r, WriterState.OK)
                s.nbytes += msg.nbytes
                if msg.bounced and r in s.unpack:
                    s.bounced.add(r)
                if s.all_ok() and not s.terminal:
                    if s.bounced:
                        self.link.post(self._unpack, s.request_id)  # DONE once the bytes are in place
                    else:
                        s.transition(SessionState.DONE)
            elif msg.in_doubt:
                s.transition(
                    SessionState.TIMED_OUT,
                    E.TransferTimeoutError(f"context rank {r} timed out request {msg.request_id}: {msg.error}"),
                )
            elif msg.status == "cancelled":
                s.settle(r, WriterState.CANCELLED)
                s.transition(
                    SessionState.CANCELLED,
                    E.RequestCancelledError(f"request {msg.request_id} cancelled by context rank {r}: {msg.error}"),
                )
            else:
                s.settle(r, WriterState.FAILED)
                err = error_from(msg.error_kind, f"context rank {r} failed request {msg.request_id}: {msg.error}")
                timed_out = isinstance(err, E.TransferTimeoutError)
                s.transition(SessionState.TIMED_OUT if timed_out else SessionState.FAILED, err)
            self._note_quarantine(s)

    def _take_aux(self, s: RxSession, r: int, aux: bytes) -> bool:
        """Keep a writer's aux payload (the first one that came); False (session FAILED) when it is too large."""
        if len(aux) > self.config.max_aux_bytes:
            s.transition(
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

    def _lease_answer(self, s: RxSession, msg: wire.TransferResult) -> None:
        """The context answered a lease renewal: the request is gone there (lock held)."""
        if msg.status == "ok" or s.terminal:
            return
        err = error_from(msg.error_kind, f"context rank {msg.ctx_rank}: {msg.error}")
        if msg.status == "cancelled":
            s.transition(SessionState.CANCELLED, err)
        else:
            timed_out = isinstance(err, E.TransferTimeoutError)
            s.transition(SessionState.TIMED_OUT if timed_out else SessionState.FAILED, err)
        if s.mode == "pull" and s.instance is not None:
            self._pull_unread(s, "cancelled", str(err))
        self._note_quarantine(s)

    def _pull_answer(self, s: RxSession, r: int, msg: wire.TransferResult) -> None:
        """A context rank's word on our read of its blocks (lock held)."""
        w = s.writers[r]
        if w is not WriterState.PULLED:
            if w is WriterState.READING and msg.status != "ok":
                # The context gave the request up while we read (lease, cancel): the bytes we get are not its KV.
                err = error_from(msg.error_kind, f"context rank {r}: {msg.error}")
                s.transition(SessionState.CANCELLED if msg.status == "cancelled" else SessionState.FAILED, err)
                self._note_quarantine(s)
            return
        if msg.status == "ok":
            if not self._take_aux(s, r, msg.aux):
                s.settle(r, WriterState.FAILED)
                return
            s.settle(r, WriterState.OK)
            if s.all_ok() and not s.terminal:
                s.transition(SessionState.DONE)
            return
        err = error_from(msg.error_kind, f"context rank {r} did not confirm request {msg.request_id}: {msg.error}")
        if msg.status == "cancelled":
            s.settle(r, WriterState.CANCELLED)
            s.transition(SessionState.CANCELLED, err)
        else:
            s.settle(r, WriterState.FAILED)
            timed_out = isinstance(err, E.TransferTimeoutError)
            s.transition(SessionState.TIMED_OUT if timed_out else SessionState.FAILED, err)
        self._note_quarantine(s)

    def _pull_unread(self, s: RxSession, status: str, reason: str) -> None:
        """Tell the context ranks we never read from (and never will) that they may let go (lock held)."""
        inst = s.instance
        if inst is None or inst.gone:
            return
        for r in s.nonces:
            if r in s.writers:
                continue  # a read was posted: its end tells the context
            s.writers[r] = WriterState.CANCELLED
            self._send_pull_done(s, inst, r, status, error=reason)

    def _send_pull_done(
        self, s: RxSession, inst: CtxInstance, r: int, status: str, *, kind: str = "", error: str = ""
    ) -> None:
        nbytes, fragments = s.read_bytes.get(r, (0, 0))
        link = self.link
        msg = wire.PullDone(
            v=wire.PROTOCOL_VERSION,
            request_id=s.request_id,
            gen_instance=link.instance_name,
            gen_rank=link.topology.rank,
            gen_incarnation=link.incarnation,
            ticket=s.ticket,
            nonce=s.nonces[r],
            status=status,  # type: ignore[arg-type]
            ctx_incarnation=inst.ranks[r].incarnation,
            blocks_digest=blocks_digest(s.ctx_block_ids, s.ctx_state_slot, s.ctx_incarnation),
            nbytes=nbytes,
            fragments=fragments,
            error_kind=kind,
            error=error[:1000],
            prompt_len=s.prompt_len,
        )
        s.pull_done[r] = msg
        link.send(inst.ranks[r].endpoint, msg)

    def _not_taken(self, s: RxSession, inst: CtxInstance, r: int, msg: wire.TransferResult) -> None:
        """Writer ``r`` proved it never took the request: settle it; re-register and ask again if worth it."""
        s.settle(r, WriterState.NOT_ASKED)
        if s.terminal:
            self._note_quarantine(s)
            return
        n = self.reasks[s.request_id] = self.reasks.get(s.request_id, 0) + 1
        if n > _MAX_REASKS:
            s.transition(
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

    def goodbye_endpoints(self) -> list[str]:
        out: set[str] = set()
        for inst in self.instances.values():
            if not inst.gone:
                out.update(inst.ranks[r].endpoint for r in inst.peers if r < len(inst.ranks))
        return sorted(out)

    def on_goodbye(self, source: Source, msg: wire.Goodbye) -> None:
        """A context rank is closing: its instance is let go once that rank's connection drops (or dropped)."""
        with self.link.lock:
            inst = next(
                (i for i in self.instances.values()
                 if not i.gone and i.name == msg.instance and i.incarnation == msg.incarnation),
                None,
            )  # fmt: skip
            if inst is None or not 0 <= msg.rank < len(inst.ranks):
                self.counters["ignored_messages"] += 1
                return
            inst.goodbye.add(msg.rank)
            if inst.state is PeerState.SUSPECT:  # a connection of it is down already
                self._lose(inst, E.PeerLostError(f"{inst} closed (rank {msg.rank} said goodbye)"), orderly=True)

    def on_disconnect(self, endpoint: str) -> None:
        now = time.monotonic()
        with self.link.lock:
            for inst in list(self.instances.values()):
                r = inst.rank_of_endpoint(endpoint)
                if r is None and inst.endpoint != endpoint:
                    continue
                if r is not None and r in inst.goodbye:
                    self._lose(inst, E.PeerLostError(f"{inst} closed (rank {r} said goodbye)"), orderly=True)
                elif r is not None and writer_fenced(inst.ranks[r], None, self.config.fencing_grace_s, now)[0]:
                    self._lose(inst, E.PeerLostError(f"context rank {r} at {endpoint} died"))
                elif inst.state in (PeerState.READY, PeerState.CONNECTING):
                    first_contact = inst.state is PeerState.CONNECTING and not inst.ranks
                    if not first_contact:
                        inst.move(PeerState.SUSPECT, deadline=now + self.config.peer_lost_timeout_s)

    def on_auth_failed(self, endpoint: str, why: str) -> None:
        """A context endpoint did not prove the CURVE key we expect (or refused ours): refuse its instance now."""
        with self.link.lock:
            for inst in list(self.instances.values()):
                if not inst.gone and (inst.endpoint == endpoint or inst.rank_of_endpoint(endpoint) is not None):
                    self._refuse(
                        inst, E.IncompatiblePeerError(f"control-plane authentication with {endpoint} failed: {why}")
                    )

    def on_bad_frame(self, source: Any, exc: E.KvcoreError) -> None:
        """An answer on our own link that speaks another protocol version refuses that instance at once."""
        if source.endpoint is None or not isinstance(exc, E.ProtocolVersionError):
            return
        with self.link.lock:
            for inst in list(self.instances.values()):
                if inst.gone or (inst.endpoint != source.endpoint and inst.rank_of_endpoint(source.endpoint) is None):
                    continue
                self._refuse(inst, E.ProtocolVersionError(f"context instance at {inst.endpoint}: {exc}"))

    def on_connect(self, endpoint: str) -> None:
        with self.link.lock:
            inst = next(
                (
                    i
                    for i in self.instances.values()
                    if i.state is PeerState.SUSPECT
                    and (i.endpoint == endpoint or i.rank_of_endpoint(endpoint) is not None)
                ),
                None,
            )
            if inst is not None:
                self._fetch(inst)  # back: the same process, or a restarted one? its info tells

    # --- worker thread -----------------------------------------------------------------------------

    def _load_instance(self, inst: CtxInstance) -> None:
        """Register with the context ranks this rank exchanges with (each answers with its own RankInfo)."""
        link = self.link
        for r in inst.peers:
            link.send(inst.ranks[r].endpoint, wire.RegisterRankInfo(v=wire.PROTOCOL_VERSION, info=link.rank_info))

    def _registered(self, inst: CtxInstance, r: int) -> None:
        """Worker: context rank ``r`` accepted us; load its identity (where the transport needs one) and, once every
        rank we exchange with did, ask the requests that waited for the instance.

        The identity descriptor carries no key to the context's memory: in push mode this rank reads nothing of it
        (``_pull`` asks for access per rank, with a request's ticket). Loading it with ``expose=True`` lets that rank
        write into our memory (the shm agent hands its memfds only to loaded, exposed peers).
        """
        link = self.link
        desc = inst.ranks[r].agent_descriptor
        if desc:
            try:
                name = link.agent.load_remote_agent(desc, expose=True)
            except E.KvcoreError as exc:
                with link.lock:
                    self._refuse(inst, exc, tell=inst.ranks)
                return
        with link.lock:
            if desc:
                inst.agents[r], inst.loaded[r] = name, desc
            if inst.gone:
                return  # _unload (now or later) unloads what we loaded
            inst.registered.add(r)
            if inst.state is PeerState.CONNECTING and set(inst.peers) <= inst.registered:
                inst.move(PeerState.READY)
                link.metrics.first_contact(inst.name, time.monotonic() - inst.created)
                self._resume(inst)
            self._kick_pulls(inst)

    def _kick_pulls(self, inst: CtxInstance) -> None:
        """Post a read for every pull request of ``inst`` that waits only for its writers' registration (lock held)."""
        for s in self.rx.values():
            if (
                s.mode == "pull"
                and s.instance is inst
                and not s.terminal
                and not s.writers
                and set(s.nonces) <= inst.registered
            ):
                self.link.post(self._pull, s.request_id)

    def _ask_exposure(self, s: RxSession, inst: CtxInstance, ranks: list[int]) -> None:
        """Ask the context ranks ``ranks`` for access to their memory for pull request ``s`` (lock held; once per
        rank at a time: the answer lets every waiting request read)."""
        link = self.link
        for r in ranks:
            if r in inst.exposing:
                continue
            nonce = os.urandom(16)
            inst.exposing[r] = nonce
            link.send(
                inst.ranks[r].endpoint,
                wire.ExposeRequest(
                    v=wire.PROTOCOL_VERSION,
                    request_id=s.request_id,
                    gen_instance=link.instance_name,
                    gen_rank=link.topology.rank,
                    gen_incarnation=link.incarnation,
                    ticket=s.ticket,
                    nonce=nonce,
                ),
            )

    def on_exposure(self, source: Source, msg: wire.Exposure) -> None:
        """A context rank's answer to our ExposeRequest: its full descriptor (we may read it), or why not."""
        if source.endpoint is None:
            self.counters["ignored_messages"] += 1
            return
        with self.link.lock:
            for inst in self.instances.values():
                r = inst.rank_of_endpoint(source.endpoint)
                if r is None or r != msg.ctx_rank or inst.gone:
                    continue
                nonce = inst.exposing.get(r)
                if nonce is None or not msg.nonce or not hmac.compare_digest(nonce, msg.nonce):
                    self.counters["forged_messages"] += 1
                    return
                if msg.ctx_incarnation != inst.ranks[r].incarnation:
                    self.counters["forged_messages"] += 1
                    return
                if msg.error_kind or not msg.agent_descriptor:
                    del inst.exposing[r]
                    err = error_from(
                        msg.error_kind or "ProtocolError",
                        f"context rank {r} gave no access to its memory for request {msg.request_id}: "
                        f"{msg.error or 'no descriptor'}",
                    )
                    s = self.rx.get(msg.request_id)
                    if s is not None and s.instance is inst and not s.terminal and not s.writers:
                        s.transition(SessionState.FAILED, err)
                        self._note_quarantine(s)
                    self._kick_pulls(inst)  # another waiting request asks with its own ticket
                    return
                self.link.post(self._load_exposed, inst, r, msg.agent_descriptor, nonce)
                return
        self.counters["ignored_messages"] += 1

    def _load_exposed(self, inst: CtxInstance, r: int, desc: bytes, nonce: bytes) -> None:
        """Worker: load context rank ``r``'s full descriptor (same agent as its identity: a refresh)."""
        link = self.link
        try:
            name = link.agent.load_remote_agent(desc, expose=True)
            if inst.agents.get(r, name) != name:
                raise E.ProtocolError(f"context rank {r} of {inst} exposed another agent than it registered with")
        except E.KvcoreError as exc:
            with link.lock:
                self._refuse(inst, exc, tell=inst.ranks)
            return
        with link.lock:
            inst.agents[r], inst.loaded[r] = name, desc
            if inst.exposing.get(r) == nonce:
                del inst.exposing[r]
            if inst.gone:
                return
            inst.exposed.add(r)
            self._kick_pulls(inst)

    def _decline(self, inst: CtxInstance, requests: list[tuple[Any, int, bytes]]) -> None:
        """Tell the context ranks of requests we never asked for that we never will (lock held; with the ticket)."""
        for rid, dp, ticket in requests:
            try:
                writers = peer_ranks(self.link.topology, inst.ranks[0].topology, dp)
            except E.KvcoreError:
                continue
            for r in writers:
                self.link.send(
                    inst.ranks[r].endpoint,
                    self._cancel(rid, "cancelled before it was asked for", ticket=ticket),
                )

    def _resume(self, inst: CtxInstance) -> None:
        """The instance is ready: ask requests that waited for it and writers that proved they never took one."""
        self._decline(inst, self.declines.pop(inst.endpoint, []))
        for s in self.rx.values():
            if s.terminal or s.ctx_endpoint != inst.endpoint:
                continue
            if s.instance is None:
                self._ask(s, inst)
            elif s.instance is inst:
                again = [r for r, w in s.writers.items() if w is WriterState.NOT_ASKED]
                if again:
                    for r in again:
                        s.unpack.pop(r, None)  # asked again without bounce
                    self._ask(s, inst, again)

    def _ask_bounced(self, rid: InternalId) -> None:
        """Worker: decide per writer whether its fragments go through a bounce lease, then ask."""
        link = self.link
        with link.lock:
            s = self.rx.get(rid)
            if s is None or s.terminal or s.instance is None:
                return
            inst = s.instance
            writers = list(s.writers)
        bounce_args: dict[int, tuple[int, int, bytes]] = {}
        tpb = link.geometry.tokens_per_block
        for r in writers:
            src_ids = {
                g: np.zeros(-(-s.prompt_len // tpb) if s.prompt_len >= 0 else len(s.block_ids.get(g, ())), np.int64)
                for g in inst.ranks[r].placement.page_table.groups()
            }
            try:
                # The destination side of the unmerged plan does not depend on the source's block ids,
                # only on how many there are: the context rank computes the same order with its real ids.
                plan = plan_request(
                    inst.ranks[r].placement,
                    link.placement,
                    src_ids,
                    s.block_ids,
                    mappers=link.mappers,
                    src_state_slot=0 if s.state_slot >= 0 else -1,
                    dst_state_slot=s.state_slot,
                    prompt_len=s.prompt_len,
                    merge=False,
                    cached_tokens=s.cached_tokens,
                )
            except E.KvcoreError as exc:
                log.debug("request %r: no bounce for context rank %d: %s", rid, r, exc)
                continue
            if plan.count and _count(s.block_ids):
                self._plan_shape[(inst.endpoint, r)] = (plan.count / _count(s.block_ids), plan.nbytes / plan.count)
            if not bounce.wants_bounce(
                plan.count,
                plan.nbytes,
                min_fragments=self.config.bounce_min_fragments,
                max_fragment_bytes=self.config.bounce_max_fragment_bytes,
            ):
                continue
            assert self.arena is not None
            off = self.arena.lease(plan.nbytes)
            if off is None:
                self.counters["bounce_fallback_arena_full"] += 1
                log.debug("request %r: bounce arena full, context rank %d writes fragments directly", rid, r)
                continue
            with link.lock:
                s.leases[r] = off
                s.unpack[r] = (plan.dst, plan.sizes)
            bounce_args[r] = (self.arena.address + off, plan.nbytes, bounce.plan_digest(plan.dst, plan.sizes))
        with link.lock:
            if not s.terminal:
                self._send_requests(s, inst, writers, bounce_args)

    def _pull(self, rid: Any) -> None:
        """Worker, pull mode: read the request from every writer rank's blocks (one READ per rank)."""
        link = self.link
        with link.lock:
            s = self.rx.get(rid)
            if s is None or s.terminal or s.instance is None or s.writers:
                return
            inst = s.instance
            ranks = sorted(s.nonces)
            if not set(ranks) <= inst.registered:
                return
            closed = [r for r in ranks if r not in inst.exposed]
            if closed:
                self._ask_exposure(s, inst, closed)  # the answer posts this read again
                return
            for r in ranks:
                s.writers[r] = WriterState.READING  # claimed (not settled: a read may be posted from now on)
        posted: list[int] = []
        for r in ranks:
            try:
                info = inst.ranks[r]
                src_blocks = normalize_block_ids(
                    s.ctx_block_ids, info.page_table, f"request {rid} context block_ids (parameters)"
                )
                t0 = time.monotonic()
                plan = plan_request(
                    info.placement,
                    link.placement,
                    src_blocks,
                    s.block_ids,
                    mappers=link.mappers,
                    src_state_slot=s.ctx_state_slot,
                    dst_state_slot=s.state_slot,
                    prompt_len=s.prompt_len,
                    merge=True,
                    cached_tokens=s.cached_tokens,
                )
                t1 = time.monotonic()
                handle = None
                if plan.count:
                    # Through the link: chunked like a WRITE, and an asynchronous agent's completion wakes us.
                    handle = link.submit_transfer(
                        TransferOp.READ,
                        inst.agents[r],
                        plan.dst,
                        plan.src,
                        plan.sizes,
                        on_done=functools.partial(self._read_ended, s, r),
                    )
                link.metrics.transfer_posted(inst.name, plan.nbytes, plan.count, t1 - t0, time.monotonic() - t1)
            except E.KvcoreError as exc:
                log.warning("request %r: reading from context rank %d: %s", rid, r, exc)
                with link.lock:
                    s.transition(SessionState.FAILED, exc)
                    for r2 in ranks:
                        if r2 not in posted:
                            s.writers[r2] = WriterState.FAILED
                            self._send_pull_done(s, inst, r2, "failed", kind=type(exc).__name__, error=str(exc))
                    self._note_quarantine(s)
                break
            with link.lock:
                s.read_bytes[r] = (plan.nbytes, plan.count)
                s.reads[r] = handle
                s.asked_at[r] = time.monotonic()
                s.writers[r] = WriterState.READING
                self.reads[(id(s), r)] = (s, r)
            posted.append(r)
            self._check_read(s, r, time.monotonic())

    def _read_ended(self, s: RxSession, r: int) -> None:
        """The link saw our READ from rank ``r`` end (worker thread)."""
        self._check_read(s, r, time.monotonic())

    def _check_read(self, s: RxSession, r: int, now: float) -> None:
        """Poll our READ from context rank ``r``; when it ends, tell that rank (worker thread)."""
        handle = s.reads.get(r)
        status = TransferStatus.DONE if handle is None else self.link.poll_transfer(handle)
        inst = s.instance
        assert inst is not None
        if status is TransferStatus.PENDING:
            if now - s.asked_at.get(r, now) > self.config.transfer_timeout_s and not s.terminal:
                assert handle is not None
                self.link.stop_transfer(handle, "read timed out")  # no further chunk; the one in flight may land
                with self.link.lock:
                    s.transition(
                        SessionState.TIMED_OUT,
                        E.TransferTimeoutError(
                            f"request {s.request_id}: read from context rank {r} still pending after "
                            f"{self.config.transfer_timeout_s}s"
                        ),
                    )
                    self._note_quarantine(s)
            return
        err = handle.error if handle is not None else None
        if handle is not None:
            self.link.metrics.transfer_finished(inst.name, status is TransferStatus.DONE, now - s.asked_at.get(r, now))
            self.link.release_transfer(handle)
        with self.link.lock:
            self.reads.pop((id(s), r), None)
            s.reads.pop(r, None)
            if s.writers.get(r) is not WriterState.READING:
                return  # fenced meanwhile
            if status is TransferStatus.DONE and not s.terminal:
                s.settle(r, WriterState.PULLED)
                s.nbytes += s.read_bytes.get(r, (0, 0))[0]
                self._send_pull_done(s, inst, r, "ok")
            elif status is TransferStatus.DONE:
                s.settle(r, WriterState.CANCELLED)  # ended meanwhile: we keep nothing of it
                self._send_pull_done(s, inst, r, "cancelled", error="the receiver gave the request up")
            else:
                exc = err or E.TransferFailedError(f"read from context rank {r} failed")
                s.settle(r, WriterState.FAILED)
                self._send_pull_done(s, inst, r, "failed", kind=type(exc).__name__, error=str(exc))
                s.transition(SessionState.FAILED, exc)
            self._note_quarantine(s)

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

    def _unpack(self, rid: InternalId) -> None:
        """Worker: scatter every bounced writer's lease into the pools, then the request is DONE."""
        with self.link.lock:
            s = self.rx.get(rid)
            if s is None or s.terminal or self.arena is None:
                return
            work = [(self.arena.address + s.leases[r], *s.unpack[r]) for r in sorted(s.bounced)]
        try:
            for addr, dst, sizes in work:
                bounce.scatter(addr, dst, sizes)
                self.counters["bounced_writes_total"] += 1
        except Exception as exc:  # pragma: no cover - addresses were validated when planned
            with self.link.lock:
                s.transition(SessionState.FAILED, E.TransferFailedError(f"request {rid}: bounce scatter failed: {exc}"))
            return
        with self.link.lock:
            s.transition(SessionState.DONE)

    # --- timers (worker thread) ------------------------------------------------------------------

    def tick(self, now: float) -> None:
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
                s.transition(
                    SessionState.TIMED_OUT,
                    E.TransferTimeoutError(
                        f"request {s.request_id} not complete after {cfg.request_timeout_s}s (writers: {asked})"
                    ),
                )
            for _, s in self.rx.news():
                if not s.quiescent:
                    self._fence(s, now)
                    self._note_quarantine(s)
            for endpoint, inst in list(self.instances.items()):
                if inst.deadline is None or now <= inst.deadline:
                    continue
                if inst.state is PeerState.CONNECTING:
                    self._lose(inst, E.PeerLostError(f"no answer from {inst} within {cfg.first_contact_timeout_s}s"))
                elif inst.state is PeerState.SUSPECT:
                    self._lose(inst, E.PeerLostError(f"{inst} unreachable for {cfg.peer_lost_timeout_s}s"))
                elif inst.state is PeerState.REFUSED:
                    del self.instances[endpoint]
                    self._forget_plan_shapes(endpoint)
                    self.retired.append(inst)
            if self.retired:
                in_use = {id(s.instance) for s in self.rx.values() if s.instance is not None}
                unload = [i for i in self.retired if id(i) not in in_use]
                self.retired = [i for i in self.retired if id(i) in in_use]
        for inst in unload:
            self._unload(inst)

    def _fence(self, s: RxSession, now: float) -> None:
        """Settle writers that provably write no more; ask live ones again for their final word (lock held)."""
        inst = s.instance
        if inst is None:
            return
        for r, w in list(s.writers.items()):
            if w not in (WriterState.ASKED, WriterState.READING):
                continue
            fenced, how = writer_fenced(inst.ranks[r], inst.lost_at, self.config.fencing_grace_s, now)
            if fenced:
                s.settle(r, WriterState.FENCED)
                self.counters[f"fenced_{how}"] += 1
                reason = FenceReason.SAME_HOST_PID if how == "dead" else FenceReason.GRACE_EXPIRED
                self.link.metrics.fenced(reason, inst.name)
                if how == "grace":
                    log.warning(
                        "request %r: context rank %d on another host lost %.1fs ago; its pages are released after "
                        "the fencing grace",
                        s.request_id,
                        r,
                        now - (inst.lost_at or now),
                    )
        if not inst.gone and not s.quiescent and now - s.last_query > self.config.quarantine_query_interval_s:
            self._query_writers(s, "asking for the final word on a quarantined request")

    def _unload(self, inst: CtxInstance) -> None:
        for r, name in inst.agents.items():
            self.link.unload_agent(name, inst.ranks[r].incarnation, inst.loaded.get(r, b""))
        with self.link.lock:
            inst.move(PeerState.UNLOADED)
            if not any(i.name == inst.name for i in self.instances.values()):
                self.link.metrics.forget_peer(inst.name)
            current = self.instances.get(inst.endpoint)
            in_use = {i.endpoint for i in current.ranks} if current is not None else set()
            if current is not None:
                in_use.add(current.endpoint)
        for ep in {i.endpoint for i in inst.ranks} | {inst.endpoint}:
            if ep not in in_use:
                try:
                    self.link.messenger.drop(ep)
                except E.KvcoreError:
                    pass

    # --- stats and close ---------------------------------------------------------------------------

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


def _count(ids: dict[str, np.ndarray]) -> int:
    return sum(len(v) for v in ids.values())


def _single_bytes(ids: dict[str, np.ndarray]) -> bytes:
    return next(iter(ids.values()), np.zeros(0, np.int64)).astype("<i8").tobytes() if len(ids) <= 1 else b""


def _accepted_info_mismatch(public: wire.RankInfo, info: wire.RankInfo | None) -> str:
    """Why a context rank's own RankInfo (in its RegisterResult) cannot be the rank its rank 0 described; '' if
    it can. Every field rank 0 told must be the same; only the private ones (descriptor, pid...) are new."""
    if info is None:
        return "accepted this rank without saying who it is (no RankInfo)"
    told = msgspec.structs.replace(info, agent_descriptor=b"", pid=0, start_time=0, host_id="")
    if told != public:
        differ = [f for f in public.__struct_fields__ if getattr(told, f) != getattr(public, f)]
        return f"its RankInfo differs from what its instance's rank 0 said in: {', '.join(differ)}"
    return ""
