"""The generation role's peers: context instances from first contact to unloading, refusals, loss and fencing.

A session is released only when every writer is settled: it answered, proved it never took the request, or is
fenced (dead on this host, or lost past the fencing grace on another). A quarantined writer of a live context
is asked again for its final word on a timer, so a lost message cannot pin pages forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.layout.mapping import validate_compatible
from kvcore.layout.peer import peer_ranks
from kvcore.metrics import FenceReason
from kvcore.params import InternalId
from kvcore.transceiver.link import error_from
from kvcore.transceiver.peers import CtxInstance, PeerState, writer_fenced
from kvcore.transceiver.receive.settle import RecvSettle
from kvcore.transceiver.sessions import RxSession, SessionState, WriterState

log = logging.getLogger("kvcore.transceiver")


class RecvPeers(RecvSettle):
    """Context instances as this generation rank knows them (``self.instances``), and the fencing of their writers."""

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
                self._move(s, SessionState.FAILED, exc)
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
                self._forget_writers(s)
                continue
            if s.instance is inst or (s.instance is None and not replaced and s.ctx_endpoint == inst.endpoint):
                self._move(s, SessionState.FAILED, E.PeerLostError(f"request {s.request_id}: {error}"))
                self._note_quarantine(s)

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
                    native = self.link.native
                    if native is not None:
                        native.learn(inst.endpoint, r, msg.info, msg.lane_endpoint, msg.lane_token, msg.lane_key)
                    self.link.post(self._registered, inst, r)
            return
        err = error_from(msg.error_kind, f"context rank {msg.ctx_rank} refused this generation rank: {msg.error}")
        with self.link.lock:
            for inst in list(self.instances.values()):
                if inst.rank_of_endpoint(source.endpoint) is not None and not inst.gone:
                    self._refuse(inst, err, tell=inst.ranks)

    def on_error_reply(self, source: Source, msg: wire.ErrorReply) -> None:
        log.warning("peer %s answered with %s: %s", source.endpoint or "?", msg.kind, msg.error)

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

    def _load_instance(self, inst: CtxInstance) -> None:
        """Register with the context ranks this rank exchanges with (each answers with its own RankInfo)."""
        link = self.link
        lane = link.native.descriptor if link.native is not None else b""
        for r in inst.peers:
            link.send(
                inst.ranks[r].endpoint, wire.RegisterRankInfo(v=wire.PROTOCOL_VERSION, info=link.rank_info, lane=lane)
            )

    def _registered(self, inst: CtxInstance, r: int) -> None:
        """Worker: context rank ``r`` accepted us; load its identity (where the transport needs one) and, once every
        rank we exchange with did, ask the requests that waited for the instance.

        The identity descriptor carries no key to the context's memory: in push mode this rank reads nothing of it
        (``_pull`` asks for access per rank, with a request's ticket). Loading it with ``expose=True`` lets that rank
        write into our memory (the shm agent hands its memfds only to loaded, exposed peers).
        """
        link = self.link
        desc = inst.ranks[r].agent_descriptor
        if desc and not self._free_agent_name(inst, desc, lambda: self._registered(inst, r)):
            return  # a request still needs the predecessor's agent under that name: ``tick`` retries
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

    def _free_agent_name(self, inst: CtxInstance, desc: bytes, retry: Callable[[], None]) -> bool:
        """Unload the retired instances holding the agent name ``desc`` announces, before a rank of ``inst`` is
        loaded under it (worker).

        A restart at the same endpoint is learnt from the new incarnation's info, and its ranks may answer before
        ``tick`` unloaded the old incarnation; the agent refuses a second agent under a loaded name. An old
        incarnation no request needs is unloaded here and now. While a request still needs one (a writer of it not
        yet settled: answered, proven dead or fenced): False, and ``retry`` waits in ``awaiting_name`` for ``tick``
        to call it once no retired instance holds the name.
        """
        if not self.retired:
            inst.name_held = ""
            return True  # nothing retired (the common case): no descriptor to decode twice
        try:
            name = self.link.agent_name(desc)
        except E.KvcoreError:
            return True  # an undecodable descriptor: the load refuses it
        with self.link.lock:
            held = [i for i in self.retired if name in i.agents.values()]
            if not held:
                inst.name_held = ""
                return True
            in_use = {id(s.instance) for s in self.rx.values() if s.instance is not None}
            if any(id(i) in in_use for i in held):
                self.awaiting_name.append((inst, name, retry))
                if not inst.name_held:
                    log.info("%s restarted: its agent %r is loaded once %s", inst, name, self._held_because())
                inst.name_held = name
                return False
            inst.name_held = ""
            self.retired = [i for i in self.retired if all(i is not h for h in held)]
        for old in held:
            self._unload(old)
        return True

    def _held_because(self) -> str:
        """Why a restarted instance's agent name is still held by its predecessor, for logs and errors."""
        return (
            "the previous incarnation's writers are settled (a request of it is still open; fenced at once if its "
            f"process is gone on this host, else after fencing_grace_s={self.config.fencing_grace_s}s)"
        )

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
                self._settle_writer(s, r, WriterState.FENCED)
                self.counters["fenced_dead" if how == "dead" else "fenced_grace"] += 1
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
        if self.link.native is not None:
            self.link.native.drop_routes({i.incarnation for i in inst.ranks})
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

    def _reap_instances(self, now: float) -> list[CtxInstance]:
        """Instance timers (lock held): lose the silent and the unreachable, forget old refusals; returns the
        retired instances no request needs any more (to unload outside the lock)."""
        cfg = self.config
        unload: list[CtxInstance] = []
        for endpoint, inst in list(self.instances.items()):
            if inst.deadline is None or now <= inst.deadline:
                continue
            if inst.state is PeerState.CONNECTING and inst.name_held:
                self._lose(
                    inst,
                    E.PeerLostError(
                        f"{inst} restarted and could not be loaded within {cfg.first_contact_timeout_s}s: its agent "
                        f"name {inst.name_held!r} is still held until {self._held_because()}"
                    ),
                )
            elif inst.state is PeerState.CONNECTING:
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
        return unload

    def _forget_plan_shapes(self, endpoint: str) -> None:
        """Drop the cached plan shapes of an instance that is gone (a new one there may have another layout)."""
        for key in [k for k in self._plan_shape if k[0] == endpoint]:
            del self._plan_shape[key]

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
                if self.link.native is not None:
                    self.link.native.cancel(s.nonces[r])  # asked on the lane: its writer hears it there first
                self.link.send(
                    inst.ranks[r].endpoint,
                    self._cancel(s.request_id, reason, nonce=s.nonces[r]),
                )


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
