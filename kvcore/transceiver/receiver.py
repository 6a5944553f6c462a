"""The generation role: fetch context instances, ask their ranks for requests, and settle each writer.

A receive session waits for one final answer per context rank that may write
(its *writers*). Answers count only when they echo the secret nonce this rank
put in its request, so a stranger cannot settle, fail or cancel a request. A
session is released only when every writer is settled: it answered, proved it
never took the request, or is fenced (dead on this host, or lost past the
fencing grace on another). A quarantined writer of a live context is asked
again for its final word on a timer, so a lost message cannot pin pages forever.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from kvcore import bounce, wire
from kvcore import errors as E
from kvcore.mapping import plan_transfer, validate_compatible
from kvcore.messenger import Source
from kvcore.metrics import FenceReason
from kvcore.peer import peer_ranks
from kvcore.transceiver.link import Handler, Link, error_from
from kvcore.transceiver.peers import CtxInstance, PeerState, writer_fenced
from kvcore.transceiver.role import Role, check_block_ids, check_request_id, max_slot
from kvcore.transceiver.sessions import RxSession, SessionState, WriterState

__all__ = ["Receiver"]

log = logging.getLogger("kvcore.transceiver")

#: How many times one request is asked again after "not registered" answers before it fails.
_MAX_REASKS = 3


class Receiver(Role):
    """Generation role of a transceiver."""

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.rx: dict[int, RxSession] = {}
        self.instances: dict[str, CtxInstance] = {}  # current incarnation (or refusal) per context endpoint
        self.retired: list[CtxInstance] = []  # lost or replaced instances, unloaded once no request needs them
        self.quarantined: set[int] = set()
        self.reasks: dict[int, int] = {}
        self.counters = link.counters
        self.arena: bounce.Arena | None = link.arena
        # (ctx endpoint, ctx rank) -> (fragments per block, mean fragment bytes) of its unmerged plans
        self._plan_shape: dict[tuple[str, int], tuple[float, float]] = {}

    @property
    def sessions(self) -> dict[int, Any]:
        return self.rx

    def handlers(self) -> dict[type, Handler]:
        return {
            wire.InstanceInfo: self.on_instance_info,
            wire.RegisterResult: self.on_register_result,
            wire.TransferResult: self.on_transfer_result,
            wire.ErrorReply: self.on_error_reply,
        }

    # --- engine API ----------------------------------------------------------------------------

    def start_receive(
        self, request_id: int, ctx_endpoint: str, block_ids: Any, prompt_len: int, state_slot: int, ctx_dp_rank: int
    ) -> None:
        rid = check_request_id(request_id)
        blocks = check_block_ids(block_ids, max_slot(self.link), f"request {rid} block_ids")
        self.check_state_slot(rid, state_slot)
        wire.parse_endpoint(ctx_endpoint)
        for name, value in (("prompt_len", prompt_len), ("ctx_dp_rank", ctx_dp_rank)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise E.SessionError(f"request {rid}: {name} must be an integer, got {value!r}")
        now = time.monotonic()
        with self.link.lock:
            if rid in self.rx:
                raise E.SessionError(f"request {rid} is already being received")
            self.admit()
            s = RxSession(
                request_id=rid,
                deadline=now + self.config.request_timeout_s,
                ctx_endpoint=ctx_endpoint,
                block_ids=blocks,
                state_slot=int(state_slot),
                prompt_len=int(prompt_len),
                ctx_dp_rank=int(ctx_dp_rank),
            )
            self.rx[rid] = s
            self.link.metrics.request_started()
            inst = self.instances.get(ctx_endpoint)
            if inst is None:
                inst = CtxInstance(endpoint=ctx_endpoint)
                inst.move(PeerState.CONNECTING, deadline=now + self.config.first_contact_timeout_s)
                self.instances[ctx_endpoint] = inst
                self._fetch(inst)
            if inst.state is PeerState.REFUSED:
                s.transition(SessionState.FAILED, inst.error)
            elif inst.state is PeerState.READY:
                self._ask(s, inst)
            # CONNECTING / SUSPECT: asked once the instance is (again) ready

    def cancel(self, rid: int, reason: str) -> bool:
        with self.link.lock:
            s = self.rx.get(rid)
            if s is None or s.terminal:
                return False
            s.transition(SessionState.CANCELLED, E.RequestCancelledError(f"request {rid}: {reason}"))
            self._query_writers(s, reason)
            self._note_quarantine(s)
        return True

    def release(self, rid: int) -> None:
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
        return False

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
        if ranks is None:
            try:
                ranks = peer_ranks(self.link.topology, inst.ranks[0].topology, s.ctx_dp_rank)
            except E.KvcoreError as exc:
                s.transition(SessionState.FAILED, exc)
                return
            s.instance = inst
        now = time.monotonic()
        for r in ranks:
            s.writers[r] = WriterState.ASKED
            s.nonces[r] = os.urandom(16)
            s.asked_at[r] = now
        s.transition(SessionState.TRANSFERRING)
        if len(ranks) == len(s.writers) and self.arena is not None and self._may_bounce(inst, ranks, len(s.block_ids)):
            self.link.post(self._ask_bounced, s.request_id)  # plans are computed off the caller's thread
        else:
            self._send_requests(s, inst, ranks, {})

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
            link.send(
                inst.ranks[r].endpoint,
                wire.RequestData(
                    v=wire.PROTOCOL_VERSION,
                    request_id=s.request_id,
                    gen_instance=link.instance_name,
                    gen_rank=link.topology.rank,
                    gen_incarnation=link.incarnation,
                    block_ids=s.block_ids.astype("<i8").tobytes(),
                    state_slot=s.state_slot,
                    prompt_len=s.prompt_len,
                    timeout_ms=remaining_ms,
                    bounce_addr=addr,
                    bounce_bytes=nbytes,
                    bounce_digest=digest,
                    ctx_incarnation=inst.ranks[r].incarnation,
                    nonce=s.nonces[r],
                ),
            )

    def _query_writers(self, s: RxSession, reason: str) -> None:
        """Ask every writer that may still write for its final word (a Cancel carrying the request's nonce)."""
        inst = s.instance
        if inst is None or inst.gone:
            return
        s.last_query = time.monotonic()
        for r, w in s.writers.items():
            if w is WriterState.ASKED:
                self.link.send(
                    inst.ranks[r].endpoint,
                    wire.Cancel(
                        v=wire.PROTOCOL_VERSION,
                        request_id=s.request_id,
                        instance=self.link.instance_name,
                        rank=self.link.topology.rank,
                        reason=reason,
                        nonce=s.nonces[r],
                    ),
                )

    def _note_quarantine(self, s: RxSession) -> None:
        if s.terminal and not s.quiescent and s.request_id not in self.quarantined:
            self.quarantined.add(s.request_id)
            self.link.metrics.quarantined(self.peer_name(s))

    def peer_name(self, session: Any) -> str:
        inst = session.instance
        return inst.name if inst is not None else ""

    def _refuse(self, inst: CtxInstance, exc: E.KvcoreError) -> None:
        log.error("refusing %s: %s", inst, exc)
        inst.move(PeerState.REFUSED, deadline=time.monotonic() + self.config.refused_peer_ttl_s, error=exc)
        for s in self.rx.values():
            if s.ctx_endpoint == inst.endpoint and s.instance in (None, inst) and not s.terminal:
                s.transition(SessionState.FAILED, exc)
                self._note_quarantine(s)

    def _lose(self, inst: CtxInstance, error: E.KvcoreError, *, replaced: bool = False) -> None:
        """A context incarnation is gone: its requests fail; its writers are fenced by the timer."""
        if not inst.move(PeerState.LOST, error=error):
            return
        inst.lost_at = time.monotonic()
        self.counters["peers_lost"] += 1
        log.warning("%s", error)
        if self.instances.get(inst.endpoint) is inst:
            del self.instances[inst.endpoint]
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
                self._refuse(inst, exc)
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
            ctx_topo = ranks[0].topology
            inst.peers = sorted(
                {p for d in range(ctx_topo.dp_size) for p in peer_ranks(self.link.topology, ctx_topo, d)}
            )
        self.link.post(self._load_instance, inst)

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
            validate_compatible(ranks[r].layout, link.layout)
            if ranks[r].backend != link.agent.backend:
                raise E.IncompatiblePeerError(
                    f"transfer backend: context rank {r} uses {ranks[r].backend!r}, this rank uses {link.agent.backend!r}"
                )
        return ranks

    def on_register_result(self, source: Source, msg: wire.RegisterResult) -> None:
        if msg.ok or source.endpoint is None:
            return
        err = error_from(msg.error_kind, f"context rank {msg.ctx_rank} refused this generation rank: {msg.error}")
        with self.link.lock:
            for inst in list(self.instances.values()):
                if inst.rank_of_endpoint(source.endpoint) is not None and not inst.gone:
                    self._refuse(inst, err)

    def on_error_reply(self, source: Source, msg: wire.ErrorReply) -> None:
        log.warning("peer %s answered with %s: %s", source.endpoint or "?", msg.kind, msg.error)

    def on_transfer_result(self, source: Source, msg: wire.TransferResult) -> None:
        with self.link.lock:
            s = self.rx.get(msg.request_id)
            if s is None or s.instance is None or msg.ctx_rank not in s.writers:
                self.counters["late_results"] += 1
                return
            if not msg.nonce or msg.nonce != s.nonces.get(msg.ctx_rank):
                self.counters["forged_messages"] += 1  # only the writer we asked knows the nonce
                return
            inst, r = s.instance, msg.ctx_rank
            if r in s.asked_at and s.writers[r] is WriterState.ASKED:
                self.link.metrics.writer_round_trip(inst.name, time.monotonic() - s.asked_at[r])
            if msg.error_kind == "NotRegisteredError":
                self._not_taken(s, inst, r, msg)
                return
            if s.writers[r] is not WriterState.ASKED:
                return  # already settled
            if msg.status == "ok":
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

    def on_disconnect(self, endpoint: str) -> None:
        now = time.monotonic()
        with self.link.lock:
            for inst in list(self.instances.values()):
                r = inst.rank_of_endpoint(endpoint)
                if r is None and inst.endpoint != endpoint:
                    continue
                if r is not None and writer_fenced(inst.ranks[r], None, self.config.fencing_grace_s, now)[0]:
                    self._lose(inst, E.PeerLostError(f"context rank {r} at {endpoint} died"))
                elif inst.state in (PeerState.READY, PeerState.CONNECTING):
                    first_contact = inst.state is PeerState.CONNECTING and not inst.ranks
                    if not first_contact:
                        inst.move(PeerState.SUSPECT, deadline=now + self.config.peer_lost_timeout_s)

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
        """Load the agents of the context ranks this rank exchanges with, register with them, ask waiting requests."""
        link = self.link
        try:
            for r in inst.peers:
                if r not in inst.agents:
                    inst.agents[r] = link.agent.load_remote_agent(inst.ranks[r].agent_descriptor)
        except E.KvcoreError as exc:
            with link.lock:
                self._refuse(inst, exc)
            return
        for r in inst.peers:
            link.send(inst.ranks[r].endpoint, wire.RegisterRankInfo(v=wire.PROTOCOL_VERSION, info=link.rank_info))
        with link.lock:
            if inst.state is PeerState.CONNECTING:
                inst.move(PeerState.READY)
                link.metrics.first_contact(inst.name, time.monotonic() - inst.created)
                self._resume(inst)

    def _resume(self, inst: CtxInstance) -> None:
        """The instance is ready: ask requests that waited for it and writers that proved they never took one."""
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

    def _ask_bounced(self, rid: int) -> None:
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
        n_src = -(-s.prompt_len // tpb) if s.prompt_len >= 0 else len(s.block_ids)
        for r in writers:
            try:
                # The destination side of the unmerged plan does not depend on the source's block ids,
                # only on how many there are: the context rank computes the same order with its real ids.
                plan = plan_transfer(
                    inst.ranks[r].layout,
                    link.layout,
                    np.zeros(n_src, np.int64),
                    s.block_ids,
                    mappers=link.mappers,
                    src_state_slot=0 if s.state_slot >= 0 else None,
                    dst_state_slot=s.state_slot if s.state_slot >= 0 else None,
                    prompt_len=s.prompt_len if s.prompt_len >= 0 else None,
                    merge=False,
                )
            except E.KvcoreError as exc:
                log.debug("request %d: no bounce for context rank %d: %s", rid, r, exc)
                continue
            if plan.count and len(s.block_ids):
                self._plan_shape[(inst.endpoint, r)] = (plan.count / len(s.block_ids), plan.nbytes / plan.count)
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
                log.debug("request %d: bounce arena full, context rank %d writes fragments directly", rid, r)
                continue
            with link.lock:
                s.leases[r] = off
                s.unpack[r] = (plan.dst, plan.sizes)
            bounce_args[r] = (self.arena.address + off, plan.nbytes, bounce.plan_digest(plan.dst, plan.sizes))
        with link.lock:
            if not s.terminal:
                self._send_requests(s, inst, writers, bounce_args)

    def _unpack(self, rid: int) -> None:
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
            for s in self.rx.values():
                if not s.terminal and now > s.deadline:
                    asked = ", ".join(f"{r}={w.value}" for r, w in s.writers.items()) or "none contacted"
                    s.transition(
                        SessionState.TIMED_OUT,
                        E.TransferTimeoutError(
                            f"request {s.request_id} not complete after {cfg.request_timeout_s}s (writers: {asked})"
                        ),
                    )
                if s.terminal and not s.quiescent:
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
                    self.retired.append(inst)
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
            if w is not WriterState.ASKED:
                continue
            fenced, how = writer_fenced(inst.ranks[r], inst.lost_at, self.config.fencing_grace_s, now)
            if fenced:
                s.settle(r, WriterState.FENCED)
                self.counters[f"fenced_{how}"] += 1
                reason = FenceReason.SAME_HOST_PID if how == "dead" else FenceReason.GRACE_EXPIRED
                self.link.metrics.fenced(reason, inst.name)
                if how == "grace":
                    log.warning(
                        "request %d: context rank %d on another host lost %.1fs ago; its pages are released after "
                        "the fencing grace",
                        s.request_id,
                        r,
                        now - (inst.lost_at or now),
                    )
        if not inst.gone and not s.quiescent and now - s.last_query > self.config.quarantine_query_interval_s:
            self._query_writers(s, "asking for the final word on a quarantined request")

    def _unload(self, inst: CtxInstance) -> None:
        for r, name in inst.agents.items():
            self.link.unload_agent(name, inst.ranks[r].incarnation)
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
            }

    def close(self) -> None:
        for inst in list(self.instances.values()) + self.retired:
            for r, name in inst.agents.items():
                self.link.unload_agent(name, inst.ranks[r].incarnation)
