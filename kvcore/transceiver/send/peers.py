"""The context role's peers: registration of generation ranks, refusals, idleness, loss, loading and unloading."""

from __future__ import annotations

import logging
import time

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.layout.mapping import validate_compatible
from kvcore.transceiver.peers import GenPeer, PeerState, writer_fenced
from kvcore.transceiver.send.settle import SendSettle
from kvcore.transceiver.sessions import (
    IDLE_TASK_STATES,
    SessionState,
    TaskState,
)
from kvcore.transport.agent import TransferAgent

log = logging.getLogger("kvcore.transceiver")

_Key = tuple[str, int]


class SendPeers(SendSettle):
    """Generation ranks as this context rank knows them (``self.peers``), from registration to unloading."""

    def on_info_request(self, source: Source, msg: wire.InstanceInfoRequest) -> None:
        link = self.link
        try:
            version = wire.negotiate(msg.min_version, msg.max_version)
        except E.ProtocolVersionError as exc:
            link.reply(
                source,
                wire.InstanceInfo(v=wire.PROTOCOL_VERSION, instance_name=link.instance_name, ranks=[], error=str(exc)),
            )
            return
        link.reply(source, wire.InstanceInfo(v=version, instance_name=link.instance_name, ranks=link.public_ranks))

    def _refuse(self, source: Source, info: wire.RankInfo, exc: E.KvcoreError) -> None:
        self.link.reply(
            source,
            wire.RegisterResult(
                v=wire.PROTOCOL_VERSION,
                ctx_rank=self.link.topology.rank,
                ok=False,
                error_kind=type(exc).__name__,
                error=str(exc)[:2000],
            ),
        )

    def _keep_refused(self, key: _Key, peer: GenPeer) -> None:
        """Remember a refused generation rank (lock held): at most ``max_peers`` of them, the oldest forgotten."""
        self.peers[key] = peer
        self.refused[key] = None
        self.refused.move_to_end(key)
        while len(self.refused) > self.config.max_peers:
            old_key, _ = self.refused.popitem(last=False)
            old = self.peers.get(old_key)
            if old is not None and old.state is PeerState.REFUSED:
                old.move(PeerState.UNLOADED)
                del self.peers[old_key]

    def _make_room(self, replaced: GenPeer | None = None) -> bool:
        """Whether one more generation rank may register (lock held), evicting one that never asked if need be.

        Full (``max_peers`` live, ``replaced`` not counted): the oldest registered rank that never asked for a
        request and holds nothing here is dropped, so registrations that never ask (a stranger's, which then
        exits) cannot keep the table full for the ranks that come to work. False: every one asked.
        """
        live = sum(1 for p in self.peers.values() if not p.gone and p is not replaced)
        if live < self.config.max_peers:
            return True
        victim = next(
            (
                p
                for p in self.peers.values()
                if p.state in (PeerState.READY, PeerState.CONNECTING)
                and p is not replaced
                and p.asked_at is None
                and p.inflight == 0
                and not self.early.holds(p.key)
            ),
            None,
        )
        if victim is None:
            return False
        self._drop_idle(victim, "it never asked for a request, and a newcomer needs its place (max_peers)")
        self._rlog(logging.INFO, "evict", "%s dropped: it never asked for a request, and the table of generation "
                   "ranks is full (max_peers=%d)", victim, self.config.max_peers)  # fmt: skip
        return True

    def _drop_idle(self, peer: GenPeer, why: str) -> None:
        """Let an idle generation rank go as a lost one is (lock held): LOST now, its agent unloaded at the tick.

        One that had asked before is remembered (``dormant``, capped): its next ask admits it again at once.
        """
        if not peer.move(PeerState.LOST, error=E.PeerLostError(f"{peer} was dropped: {why}")):
            return
        peer.lost_at = time.monotonic()
        self.counters["idle_peers_dropped"] += 1
        key = peer.key
        if self.peers.get(key) is peer:
            del self.peers[key]
        self.retired.append(peer)
        self.early.drop_peer(key)
        if peer.asked_at is not None:
            self.dormant[key] = peer
            self.dormant.move_to_end(key)
            while len(self.dormant) > self.config.max_peers:
                self.dormant.popitem(last=False)

    def _readmit(self, key: _Key, incarnation: str, source: Source) -> GenPeer | None:
        """A generation rank dropped for idleness asks again: register it again from its RankInfo (lock held).

        Only the incarnation that was dropped, and only with room in the table (``_make_room``); its agent is
        loaded again before anything is written to it. None: not such a rank, or no room.
        """
        old = self.dormant.get(key)
        if old is None or old.info is None or old.incarnation != incarnation or key in self.peers:
            return None
        if not self._make_room():
            return None
        del self.dormant[key]
        peer = GenPeer(info=old.info, identity=source.identity)
        peer.move(PeerState.CONNECTING)
        self.peers[key] = peer
        self.counters["idle_peers_readmitted"] += 1
        if self.link.auth is not None and source.peer_key is not None:
            self.link.learn_key(old.info, proven=source.peer_key)
        self.link.post(self._load_peer, peer)
        return peer

    def _drop_idle_peers(self, now: float) -> None:
        """Drop the READY generation ranks that asked for nothing for ``idle_peer_ttl_s`` (lock held).

        Nothing of theirs may be held: no write in flight, no early request, no task or lease renewal in a live
        request. A rank that registers and never asks (or a stranger's registrations, once it exited) would
        otherwise hold its place in ``max_peers``, and its loaded agent, for good.
        """
        ttl = self.config.idle_peer_ttl_s
        idle = [p for p in self.peers.values() if p.state is PeerState.READY and now - p.active_at > ttl]
        if not idle:
            return
        keys = {p.key for p in idle}
        busy: set[_Key] = set()
        for s in self.tx.values():
            if not s.terminal:
                busy.update(s.tasks.keys() & keys, s.renewers.keys() & keys)
        dropped = []
        for p in idle:
            if p.inflight or p.key in busy or self.early.holds(p.key):
                p.asked_at = now  # something of it is held: its idle time starts once that is over
            else:
                dropped.append(p)
        for p in dropped:
            self._drop_idle(p, f"it asked for nothing for {ttl:g}s (idle_peer_ttl_s)")
        if dropped:
            log.info(
                "dropped %d generation ranks that asked for nothing for %gs (idle_peer_ttl_s), e.g. %s; their agents "
                "are unloaded, and one that asks again is admitted again",
                len(dropped),
                ttl,
                dropped[0],
            )

    def on_register(self, source: Source, msg: wire.RegisterRankInfo) -> None:
        info, link = msg.info, self.link
        key = (info.instance_name, info.rank)
        try:
            if info.incarnation == link.incarnation and info.instance_name == link.instance_name:
                raise E.IncompatiblePeerError("a rank cannot register this rank's own identity with it")
            validate_compatible(link.placement, info.placement)
            if info.backend != link.agent.backend:
                raise E.IncompatiblePeerError(
                    f"transfer backend: generation rank uses {info.backend!r}, this context rank uses {link.agent.backend!r}"
                )
            agent_incarnation = TransferAgent.decode_descriptor(info.agent_descriptor).incarnation
            if agent_incarnation != info.incarnation:
                # A rank's agent is of its own process: another incarnation would make its agent one this rank
                # could never unload (unloading checks the incarnation), a way to pile up loaded agents.
                raise E.IncompatiblePeerError(
                    f"the agent descriptor is of incarnation {agent_incarnation[:16]!r}, the rank of "
                    f"{info.incarnation[:16]!r}: a rank registers its own process's agent"
                )
        except E.KvcoreError as exc:
            with link.lock:
                old = self.peers.get(key)
                if old is None or old.state is PeerState.REFUSED:
                    p = GenPeer(info=info)
                    p.move(PeerState.REFUSED, deadline=time.monotonic() + self.config.refused_peer_ttl_s, error=exc)
                    self._keep_refused(key, p)
            self._refuse(source, info, exc)  # over the connection it came on: no socket toward what it named
            return
        with link.lock:
            old = self.peers.get(key)
            if old is not None and old.incarnation == info.incarnation and not old.gone:
                if old.state is PeerState.READY:
                    # It asks again: it may have missed our confirmation, or reconnected (a new connection, after
                    # it dropped ours with an instance of ours it lost): answer on the connection it asks on.
                    link.post(self._confirm, old, source)
                return  # duplicate registration
            replaced = old if old is not None and not old.gone else None
            if not self._make_room(replaced):
                live = sum(1 for p in self.peers.values() if not p.gone)
                exc2 = E.ResourceExhaustedError(
                    f"{live} generation ranks are registered (max_peers={self.config.max_peers}), each of them asked "
                    "for a request or holds one"
                )
                self._refuse(source, info, exc2)
                return
            if replaced is not None:
                self._lose(replaced, E.PeerLostError(f"{replaced} was replaced by a new incarnation (it restarted)"))
            elif old is not None:
                self.peers.pop(key, None)
            self.refused.pop(key, None)
            self.dormant.pop(key, None)
            peer = GenPeer(info=info, identity=source.identity, lane_descriptor=msg.lane)
            peer.move(PeerState.CONNECTING)
            self.peers[key] = peer
            if link.auth is not None:
                link.learn_key(info, proven=source.peer_key)
        link.post(self._load_peer, peer)

    def _registered(self, key: _Key, incarnation: str) -> GenPeer | None:
        """The registered, not refused, generation rank ``key`` of that incarnation (lock held)."""
        peer = self.peers.get(key)
        if peer is None or peer.gone or peer.incarnation != incarnation or peer.state is PeerState.REFUSED:
            return None
        return peer

    def goodbye_endpoints(self) -> list[str]:
        return sorted({p.info.endpoint for p in self.peers.values() if p.info is not None and not p.gone})

    def on_goodbye(self, source: Source, msg: wire.Goodbye) -> None:
        """A generation rank is closing: final once its connection drops (or dropped already)."""
        with self.link.lock:
            peer = self.peers.get((msg.instance, msg.rank))
            if peer is None or peer.gone or peer.incarnation != msg.incarnation:
                self.counters["ignored_messages"] += 1
                return
            if peer.identity is not None and source.identity != peer.identity:
                self.counters["ignored_messages"] += 1  # not over the connection it registered on
                return
            peer.goodbye = True
            if peer.state is PeerState.SUSPECT:  # its connection is down already
                self._lose(peer, E.PeerLostError(f"{peer} closed its transceiver"), orderly=True)

    def on_disconnect(self, endpoint: str) -> None:
        with self.link.lock:
            now = time.monotonic()
            for peer in list(self.peers.values()):
                if peer.gone or peer.info is None or peer.info.endpoint != endpoint:
                    continue
                dead, _ = writer_fenced(peer.info, None, self.config.fencing_grace_s, now)
                if peer.goodbye:
                    self._lose(peer, E.PeerLostError(f"{peer} closed its transceiver"), orderly=True)
                elif dead:
                    self._lose(peer, E.PeerLostError(f"{peer} at {endpoint} died"))
                elif peer.state in (PeerState.READY, PeerState.CONNECTING):
                    peer.move(PeerState.SUSPECT, deadline=now + self.config.peer_lost_timeout_s)

    def on_connect(self, endpoint: str) -> None:
        with self.link.lock:
            for peer in self.peers.values():
                if peer.state is PeerState.SUSPECT and peer.info is not None and peer.info.endpoint == endpoint:
                    peer.move(PeerState.READY if peer.agent_name else PeerState.CONNECTING)
        self.link.post(self._drive_all)

    def _lose(self, peer: GenPeer, error: E.KvcoreError, *, orderly: bool = False) -> None:
        """A generation rank is gone (lock held): its waiting tasks fail, its requests fail, it is unloaded later.

        ``orderly``: it said goodbye and its connection dropped (a normal shutdown): counted and logged as closed.
        """
        if not peer.move(PeerState.LOST, error=error):
            return
        peer.lost_at = time.monotonic()
        if peer.lane is not None and self.link.native is not None:
            self.link.native.forget(peer.lane[1])  # its token opens the lane no more
        self.counters["peers_closed" if orderly else "peers_lost"] += 1
        log.log(logging.INFO if orderly else logging.WARNING, "%s", error)
        key = peer.key
        if self.peers.get(key) is peer:
            del self.peers[key]
        self.retired.append(peer)
        for s in self.tx.values():
            t = s.tasks.get(key)
            if t is not None and t.peer is peer:
                if t.handle is not None:
                    self.link.stop_transfer(t.handle, f"{peer} was lost")  # no new chunk into its memory
                if t.state in IDLE_TASK_STATES:
                    self._abandon(t)  # nobody to answer
                self._end(s, SessionState.FAILED, error)
        self.early.drop_peer(key)

    def _free_agent_name(self, peer: GenPeer) -> bool:
        """Unload the lost incarnations holding the agent name ``peer`` announces, before it is loaded (worker).

        A restart may be learnt from the new incarnation's registration, before ``tick`` unloaded the old one, and
        the agent refuses a second agent under a loaded name. False while one still has transfers in flight.
        """
        assert peer.info is not None
        try:
            name = self.link.agent_name(peer.info)
        except E.KvcoreError:
            return True  # an undecodable descriptor: the load refuses it
        with self.link.lock:
            held = [p for p in self.retired if p.agent_name == name]
            if any(p.inflight for p in held):
                return False
            self.retired = [p for p in self.retired if p.agent_name != name]
        for old in held:
            self._unload(old)
        return True

    def _load_peer(self, peer: GenPeer) -> None:
        assert peer.info is not None
        if peer.state is not PeerState.CONNECTING or not self._free_agent_name(peer):
            return  # not waiting to be loaded, or (``tick`` retries) its predecessor's transfers are still in flight
        try:
            # Not exposed: it may write into nothing of ours, and reads only once it shows a pull request's ticket.
            name = self.link.agent.load_remote_agent(peer.info.agent_descriptor, expose=False)
        except E.KvcoreError as exc:
            with self.link.lock:
                peer.move(PeerState.REFUSED, deadline=time.monotonic() + self.config.refused_peer_ttl_s, error=exc)
                if self.peers.get(peer.key) is peer:
                    self._keep_refused(peer.key, peer)
                for s in list(self.tx.values()):
                    t = s.tasks.get(peer.key)
                    if t is not None and t.peer is peer and t.state in IDLE_TASK_STATES:
                        self._finish(s, t, TaskState.FAILED, kind=type(exc).__name__, error=str(exc))
                        self._end(s, SessionState.FAILED, exc)
            if peer.identity is None:
                return
            # Over the connection it registered on, never a socket of ours toward the endpoint it named: a
            # stranger's registrations with bogus descriptors must not make this rank dial (and hold a socket,
            # four descriptors) toward every endpoint they name.
            self.link.reply(
                Source(identity=peer.identity),
                wire.RegisterResult(
                    v=wire.PROTOCOL_VERSION,
                    ctx_rank=self.link.topology.rank,
                    ok=False,
                    error_kind=type(exc).__name__,
                    error=str(exc)[:2000],
                ),
            )
            return
        native = self.link.native
        lane = native.admit(peer.key, peer.info, peer.lane_descriptor) if native is not None else None
        with self.link.lock:
            peer.agent_name = name
            peer.lane = lane
            if peer.state is PeerState.CONNECTING:
                peer.move(PeerState.READY)
                peer.ready_at = time.monotonic()
                self.link.metrics.first_contact(peer.name, peer.ready_at - peer.created)
            rids = [rid for rid, s in self.tx.items() if peer.key in s.tasks]
        self._confirm(peer)
        for rid in rids:
            self._drive(rid)

    def _confirm(self, peer: GenPeer, to: Source | None = None) -> None:
        """Tell a generation rank its agent is loaded here: from now on it may READ from this rank (pull mode).

        Over the connection it registered on, or ``to``: the one a repeated registration of it came on.
        """
        identity = to.identity if to is not None and to.identity is not None else peer.identity
        if identity is not None and not peer.gone:
            # Over a connection it registered on: it arrives on that rank's own link to us, so it cannot be forged.
            endpoint, token, key = peer.lane or ("", b"", b"")
            self.link.reply(
                Source(identity=identity),
                wire.RegisterResult(
                    v=wire.PROTOCOL_VERSION,
                    ctx_rank=self.link.topology.rank,
                    ok=True,
                    info=self.link.accepted_info,
                    lane_endpoint=endpoint,
                    lane_token=token,
                    lane_key=key,
                ),
            )

    def _unload(self, peer: GenPeer) -> None:
        assert peer.info is not None
        with self.link.lock:
            live = self.peers.get(peer.key)
        # The same rank registered again (the same descriptor) while this one waited to be unloaded: its agent
        # is that rank's now.
        again = (
            live is not None
            and live is not peer
            and not live.gone
            and live.info is not None
            and live.info.agent_descriptor == peer.info.agent_descriptor
        )
        if peer.agent_name and not again:
            self.link.unload_agent(peer.agent_name, peer.incarnation, peer.info.agent_descriptor if peer.info else b"")
        if peer.lane is not None and self.link.native is not None:
            self.link.native.forget(peer.lane[1])
        with self.link.lock:
            in_use = any(p.info is not None and p.info.endpoint == peer.info.endpoint for p in self.peers.values())
            peer.move(PeerState.UNLOADED)
            if not any(p.name == peer.name for p in self.peers.values()):
                self.link.metrics.forget_peer(peer.name)
        if not in_use:
            try:
                self.link.messenger.drop(peer.info.endpoint)
            except E.KvcoreError:
                pass

    def _reap_peers(self, now: float) -> None:
        """Peer timers (lock held): lose the unreachable, forget old refusals, drop the idle, abandon writes to the long lost."""
        cfg = self.config
        for key, peer in list(self.peers.items()):
            if peer.state is PeerState.SUSPECT and peer.deadline is not None and now > peer.deadline:
                self._lose(peer, E.PeerLostError(f"{peer} unreachable for {cfg.peer_lost_timeout_s}s"))
            elif peer.state is PeerState.REFUSED and peer.deadline is not None and now > peer.deadline:
                peer.move(PeerState.UNLOADED)
                del self.peers[key]
                self.refused.pop(key, None)
        if now >= self._idle_check_at:  # at most four times per idle_peer_ttl_s, and once a second
            self._idle_check_at = now + min(1.0, cfg.idle_peer_ttl_s / 4)
            self._drop_idle_peers(now)
        # A lost peer's writes that never end: the transport only *reads* our pages for a WRITE, so once the
        # fencing grace ran out the task may end (its pages go back) while the handle waits to be released.
        for peer in self.retired:
            if peer.lost_at is None or now - peer.lost_at < cfg.fencing_grace_s:
                continue
            for key_t, (_, t) in list(self.inflight.items()):
                if t.peer is peer:
                    del self.inflight[key_t]
                    assert t.handle is not None  # a task is in flight from _track (handle set) to its end
                    self.link.stop_transfer(t.handle, f"{peer} was lost")  # no new chunk into its memory
                    self.orphans.append(t.handle)
                    t.handle = None
                    peer.inflight -= 1
                    if t.staging is not None:
                        t.staging = None  # leaked deliberately: the transport may still read it
                    self._abandon(t)
                    self.counters["abandoned_transfers"] += 1
