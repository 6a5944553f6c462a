"""The context role: serve instance info, accept generation ranks, and write each finished request into them.

A send session holds one task per generation rank (incarnation) that asked
for the request. A task ends with exactly one final answer to its receiver,
sent only when nothing of it is in flight at the transport; the session is
quiescent when every task has its final answer. A terminal session never keeps
an idle task: a receiver that asks after the outcome is answered at once, and
after release a tombstone answers for it. Pages go back to the engine only
when the session is quiescent: no transfer can still read them.

Why one module of this length: the context role's handlers (registration, push requests, pull reports,
renewals, cancels), its transfers and its timers all move the same send sessions and tasks under one lock; the
state machines themselves are in :mod:`.sessions` and :mod:`.peers`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import RateLimitedLog, Source
from kvcore.layout.blocks import decode_group_ids, normalize_block_ids, normalize_state_slot
from kvcore.layout.mapping import validate_compatible
from kvcore.layout.page import PageTable
from kvcore.layout.peer import peer_ranks
from kvcore.params import BytesId, InternalId, TransferParams, api_id, check_ticket
from kvcore.transceiver.early import EarlyRequests
from kvcore.transceiver.link import Handler, Link, error_from
from kvcore.transceiver.peers import GenPeer, PeerState, writer_fenced
from kvcore.transceiver.planning import plan_request
from kvcore.transceiver.role import Role
from kvcore.transceiver.sessions import (
    IDLE_TASK_STATES,
    ReceiverTask,
    SessionState,
    SessionTable,
    TaskState,
    Tombstones,
    TxSession,
)
from kvcore.transport import bounce
from kvcore.transport.agent import TransferAgent, TransferOp, TransferStatus

__all__ = ["Sender", "blocks_digest"]


def blocks_digest(block_ids: Any, state_slot: int, incarnation: str) -> bytes:
    """What a pull receiver must have read: the context blocks (per group), state slot and incarnation (16 bytes)."""
    h = hashlib.blake2b(digest_size=16)
    groups = dict(block_ids) if isinstance(block_ids, Mapping) else {"": block_ids}
    if len(groups) <= 1:  # one group travels as a plain list: both sides hash just the ids
        groups = {"": next(iter(groups.values()), np.zeros(0, np.int64))}
    for name in sorted(groups):
        h.update(name.encode() + b"\0" + np.asarray(groups[name], dtype="<i8").tobytes())
    h.update(int(state_slot).to_bytes(8, "little", signed=True))
    h.update(incarnation.encode())
    return h.digest()


log = logging.getLogger("kvcore.transceiver")

_Key = tuple[str, int]


def _event_done(event: Any) -> bool:
    """Whether a CUDA event (anything with ``query()``) completed; an event that raises counts as done (logged)."""
    try:
        return bool(event.query())
    except Exception as exc:  # a broken event must not stall the request: the deadline still bounds it
        log.warning("layers_ready event raised %s: treating it as complete", exc)
        return True


class SliceKind(Enum):
    """What a receiver task writes next."""

    WHOLE = "whole"  # every layer of the request at once (not layer-wise): the common, fastest case
    LAYERS = "layers"  # the layer range the engine marked ready since the last slice
    NOT_READY = "not_ready"  # layer-wise, and no layer became ready for this task since its last slice


@dataclass(frozen=True)
class NextSlice:
    """The answer of ``Sender._next_slice``: a kind, and the global layers ``[start, stop)`` for ``LAYERS``."""

    kind: SliceKind
    layers: tuple[int, int] | None = None


class Sender(Role):
    """Context role of a transceiver."""

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        cfg = self.config
        self.tx: SessionTable[TxSession] = SessionTable()
        self.peers: dict[_Key, GenPeer] = {}  # current incarnation (or refusal) per generation rank
        self.retired: list[GenPeer] = []  # lost peers waiting for their transfers to end before unloading
        self.refused: OrderedDict[_Key, None] = OrderedDict()  # keys of REFUSED peers, oldest first (capped)
        # Peers dropped for idleness after they had asked: their next ask admits them again (capped, oldest out).
        self.dormant: OrderedDict[_Key, GenPeer] = OrderedDict()
        self._idle_check_at = 0.0
        # RequestData (push) and PullDone (pull: read before start_send ran) that came before start_send
        self.early = EarlyRequests(
            cfg.max_early_requests,
            cfg.max_early_per_peer,
            cfg.max_early_bytes,
            cfg.max_early_bytes_per_peer or max(1, cfg.max_early_bytes // 8),
        )
        # Outcomes this rank's engine made (releases, its cancels before start_send), and apart, with a cap of
        # their own, those peers made (declines, cancels before start_send): a flood of the second kind never
        # evicts the first, so the engine's cancel of a request not started yet still holds at its start_send.
        self.tombstones = Tombstones(cfg.max_tombstones, cfg.request_timeout_s)
        self.peer_tombstones = Tombstones(cfg.max_peer_tombstones, cfg.request_timeout_s)
        self._rlog = RateLimitedLog(logger=log)  # lines a peer can cause at will (each is counted too)
        self.inflight: dict[int, tuple[TxSession, ReceiverTask]] = {}  # id(task) -> its submitted write
        self.orphans: list[Any] = []  # handles of abandoned transfers to dead peers, released once terminal
        self.staging: bounce.Arena | None = None
        self.events: list[tuple[Any, int, Any]] = []  # (request, layers upto, CUDA event) from layers_ready
        self.bounce_on = link.bounce_on
        self.counters = link.counters
        # Pull mode describes a request for the whole instance: one page table per distinct shape of the ranks'
        # tables (groups, their slots, state slots) is enough to check every group's ids and the state slot.
        shapes: dict[Any, PageTable] = {}
        for info in link.instance_ranks:
            pt = info.page_table
            shape = (tuple((g, pt.group_slots(g)) for g in pt.groups()), pt.state_slots())
            shapes.setdefault(shape, pt)
        self.instance_tables = list(shapes.values())
        self.instance_groups = sorted({g for pt in self.instance_tables for g in pt.groups()})

    @property
    def sessions(self) -> SessionTable[Any]:
        return self.tx

    def handlers(self) -> dict[type, Handler]:
        return {
            wire.InstanceInfoRequest: self.on_info_request,
            wire.RegisterRankInfo: self.on_register,
            wire.ExposeRequest: self.on_expose_request,
            wire.RequestData: self.on_request_data,
            wire.Cancel: self.on_cancel,
            wire.PullDone: self.on_pull_done,
            wire.Renew: self.on_renew,
            wire.Goodbye: self.on_goodbye,
        }

    # --- engine API ----------------------------------------------------------------------------

    def start_send(
        self,
        rid: Any,
        block_ids: Any,
        prompt_len: int,
        state_slot: int,
        layers_ready: int | None,
        *,
        mode: str | None = None,
        ticket: bytes | str | None = None,
        aux: bytes | None = None,
    ) -> TransferParams:
        blocks = normalize_block_ids(block_ids, self.link.page_table, f"request {rid} block_ids")
        slot = normalize_state_slot(state_slot, self.link.page_table, f"request {rid} state_slot")
        given_slot, state_slot = state_slot, -1 if slot is None else slot
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)):
            raise E.SessionError(f"request {rid}: prompt_len must be an integer (-1: unknown), got {prompt_len!r}")
        mode = mode or self.config.transfer_mode
        if mode not in ("push", "pull"):
            raise E.SessionError(f"request {rid}: mode must be 'push' or 'pull', got {mode!r}")
        if mode == "pull":
            if layers_ready is not None:
                raise E.SessionError(
                    f"request {rid}: layer-wise sending (layers_ready) needs push mode; in pull mode the generation "
                    "side reads every layer at once, after start_send"
                )
            if not self.link.agent.capabilities.read:
                raise E.UnsupportedOperationError(
                    f"request {rid}: pull mode needs an agent that can READ; {self.link.agent.backend!r} cannot"
                )
        whole: dict[str, np.ndarray] = {}
        whole_slot = -1
        if mode == "pull":
            whole, whole_slot = self._whole_description(rid, block_ids, given_slot)
        tk = self.link.request_ticket(rid) if ticket is None else check_ticket(ticket, f"request {rid!r} ticket")
        payload = self._check_aux(rid, aux)
        info0 = self.link.instance_ranks[0]
        now = time.monotonic()
        with self.link.lock:
            if rid in self.tx:
                raise E.SessionError(f"request {rid} is already being sent")
            self.admit()
            s = TxSession(
                request_id=rid,
                deadline=now + self.config.request_timeout_s,
                block_ids=blocks,
                state_slot=int(state_slot),
                prompt_len=int(prompt_len),
                layers_upto=self._layers_upto(layers_ready),
                ticket=tk,
                mode=mode,
                aux=payload,
                hold_until=now + self.config.max_lease_s,
            )
            if mode == "pull":
                s.blocks_digest = blocks_digest(whole, whole_slot, info0.incarnation)
            self.tx[rid] = s
            self.link.metrics.request_started()
            for tomb in (self.tombstones.pop(rid), self.peer_tombstones.pop(rid)):
                if tomb is not None and tomb.state is SessionState.CANCELLED and self._ticket_ok(tk, tomb.ticket):
                    self._end(
                        s, SessionState.CANCELLED, E.RequestCancelledError(f"request {rid} was cancelled earlier")
                    )
                    break
            for _, req, source in self.early.pop(rid):
                if isinstance(req, wire.PullDone):
                    self._take_pull_done(s, req, source)
                elif isinstance(req, wire.ExposeRequest):
                    self._expose_for(s, req, source)
                else:
                    self._attach(s, req, source)
        self.link.post(self._drive, rid)
        topo = self.link.topology
        return TransferParams.make(
            api_id(rid),
            info0.endpoint,
            ticket=tk,
            mode=mode,  # type: ignore[arg-type]
            dp_rank=topo.dp_rank if topo.attention_dp else 0,
            prompt_len=int(prompt_len),
            block_ids=_single(whole).tolist() if mode == "pull" and len(whole) <= 1 else (),
            group_block_ids={g: v.tolist() for g, v in whole.items()} if mode == "pull" and len(whole) > 1 else None,
            state_slot=whole_slot,
            incarnation=info0.incarnation if mode == "pull" else "",
            lease_ms=int(self.config.lease_s * 1000),
        )

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

    def _check_aux(self, rid: Any, aux: Any) -> bytes:
        if aux is None:
            return b""
        if not isinstance(aux, (bytes, bytearray, memoryview)):
            raise E.SessionError(f"request {rid}: aux must be bytes, got {type(aux).__name__}")
        data = bytes(aux)
        if len(data) > self.config.max_aux_bytes:
            raise E.PayloadTooLargeError(
                f"request {rid}: aux payload of {len(data)} bytes exceeds max_aux_bytes={self.config.max_aux_bytes}"
            )
        return data

    def set_aux(self, rid: Any, aux: bytes) -> None:
        data = self._check_aux(rid, aux)
        with self.link.lock:
            s = self.tx.get(rid)
            if s is None:
                raise E.SessionError(f"request {rid} is not being sent; call start_send first")
            told = [t.peer for t in s.tasks.values() if t.state is TaskState.DONE]
            if told:
                raise E.SessionError(
                    f"request {rid}: {told[0]} already has its KV and its final answer; set aux at start_send or "
                    "before the last layers are ready"
                )
            s.aux = data

    def layers_ready(self, rid: Any, upto: int, event: Any = None) -> None:
        if event is not None and not callable(getattr(event, "query", None)):
            raise E.SessionError(
                f"request {rid}: event must have a query() method (a torch.cuda.Event), got {type(event).__name__}"
            )
        with self.link.lock:
            s = self.tx.get(rid)
            if s is None:
                raise E.SessionError(f"request {rid} is not being sent; call start_send first")
            if event is not None and not _event_done(event):
                # The layers are complete once the GPU passed the event: the worker applies it then, no sync here.
                if len(self.events) >= self.config.max_inflight_requests * 64:
                    raise E.ResourceExhaustedError(f"{len(self.events)} layers_ready events wait already")
                self.events.append((rid, int(upto), event))
                return
            self._raise_layers(s, upto)
        self.link.post(self._drive, rid)

    def _raise_layers(self, s: TxSession, upto: int) -> None:
        if s.layers_upto is not None:
            new = self._layers_upto(upto)
            s.layers_upto = None if new is None else max(s.layers_upto, new)

    def _check_events(self) -> None:
        """Worker: apply the layers_ready calls whose CUDA events completed, in the order they were made."""
        ready: list[Any] = []
        with self.link.lock:
            keep: list[tuple[Any, int, Any]] = []
            for rid, upto, event in self.events:
                s = self.tx.get(rid)
                if s is None or s.terminal:
                    continue
                if not keep and _event_done(event):  # a later event never overtakes an earlier one
                    self._raise_layers(s, upto)
                    ready.append(rid)
                else:
                    keep.append((rid, upto, event))
            self.events = keep
        for rid in ready:
            self._drive(rid)

    def _layers_upto(self, upto: int | None) -> int | None:
        """None once every layer this rank holds is ready."""
        if upto is None or upto >= self.link.topology.layer_range[1]:
            return None
        return int(upto)

    def cancel(self, rid: InternalId, reason: str) -> bool:
        with self.link.lock:
            s = self.tx.get(rid)
            if s is None:
                prior = self.tombstones.get(rid)
                # Not started here (yet): a later start_send ends CANCELLED; waiting receivers are told now.
                self.tombstones.put(rid, SessionState.CANCELLED, E.RequestCancelledError(f"request {rid}: {reason}"))
                for _, req, source in self.early.pop(rid):
                    if isinstance(req, wire.ExposeRequest):
                        self._refuse_exposure(source, req, "RequestCancelledError", f"cancelled: {reason}")
                    else:
                        self._answer_unheld(req, source, self.tombstones.get(rid))
                # True: remembered for a start_send to come; False: the request already ended and was released here.
                # (A cancel remembered earlier has no ticket; a released request's tombstone has its ticket.)
                return prior is None or (prior.state is SessionState.CANCELLED and prior.ticket is None)
            if s.terminal:
                return False
            self._end(s, SessionState.CANCELLED, E.RequestCancelledError(f"request {rid}: {reason}"))
        self.link.post(self._drive, rid)
        return True

    def release(self, rid: InternalId) -> None:
        s = self.tx.pop(rid, None)
        if s is not None:
            self.tombstones.put(rid, s.state, s.error, ticket=s.ticket)

    def busy(self) -> bool:
        return bool(self.inflight) or bool(self.orphans) or bool(self.events)

    def peer_name(self, session: Any) -> str:
        return next((t.peer.name for t in session.tasks.values()), "")

    # --- sessions and tasks (lock held) ------------------------------------------------------------

    def _end(self, s: TxSession, state: SessionState, error: E.KvcoreError | None = None) -> None:
        """Make ``s`` terminal and give every idle task its final answer at once (nothing of it is in flight)."""
        moved = s.transition(state, error)
        if not s.terminal:
            return
        for t in s.tasks.values():
            if t.state in IDLE_TASK_STATES:
                self._finish_for_session(s, t)
        if moved and s.state is not SessionState.DONE:
            # Receivers that renewed a lease but never asked hear now that the request is gone.
            err = s.error or E.SessionError(f"request {s.request_id} ended {s.state.value}")
            status = "cancelled" if s.state is SessionState.CANCELLED else "failed"
            for key, nonce in s.renewers.items():
                peer = self.peers.get(key)
                if key in s.tasks or peer is None:
                    continue
                self._tell(
                    peer, self._result(s.request_id, nonce, status=status, kind=type(err).__name__, error=str(err))
                )

    def _finish_for_session(self, s: TxSession, t: ReceiverTask) -> None:
        cancelled = s.state is SessionState.CANCELLED
        err = s.error or E.SessionError(f"request {s.request_id} ended {s.state.value}")
        self._finish(
            s, t, TaskState.CANCELLED if cancelled else TaskState.FAILED, kind=type(err).__name__, error=str(err)
        )

    def _finish(
        self,
        s: TxSession,
        t: ReceiverTask,
        state: TaskState,
        *,
        kind: str = "",
        error: str = "",
    ) -> None:
        """Give a task its one final answer (the receiver may ask again: the same answer is re-sent)."""
        t.move(state)
        status = {TaskState.DONE: "ok", TaskState.CANCELLED: "cancelled"}.get(state, "failed")
        if state is TaskState.DONE:
            s.nbytes += t.total_bytes
        t.final = self._result(
            s.request_id,
            t.nonce,
            status=status,
            kind=kind,
            error=error,
            nbytes=t.total_bytes,
            fragments=t.total_fragments,
            bounced=t.bounced,
            aux=s.aux if state is TaskState.DONE else b"",
        )
        self._send_to(t, t.final)
        self.link.metrics.writer_service(t.peer.name, time.monotonic() - t.attached_at)

    def _result(self, rid: InternalId, nonce: bytes, *, status: str, kind: str = "", error: str = "", **kw: Any) -> Any:
        return wire.TransferResult(
            v=wire.PROTOCOL_VERSION,
            request_id=rid,
            ctx_rank=self.link.topology.rank,
            ctx_incarnation=self.link.incarnation,
            status=status,  # type: ignore[arg-type]
            error_kind=kind,
            error=error[:1000],
            nonce=nonce,
            **kw,
        )

    def _send_to(self, t: ReceiverTask, msg: wire.Message) -> None:
        self._tell(t.peer, msg)

    def _tell(self, peer: GenPeer, msg: wire.Message) -> None:
        """Send ``msg`` to a generation rank: to its endpoint once it is registered (READY, or SUSPECT), before that
        over the connection it registered on: no socket is opened toward an endpoint a rank not admitted named."""
        if peer.gone or peer.info is None:
            return  # nobody left to tell
        if peer.state in (PeerState.READY, PeerState.SUSPECT):
            self.link.send(peer.info.endpoint, msg)
        elif peer.identity is not None:
            self.link.reply(Source(identity=peer.identity), msg)

    def _id_type_hint(self, rid: Any) -> tuple[str, bytes | None]:
        """A hint when this rank holds the same request id under another type (int 5 vs str "5"), lock held.

        Returns the hint and the ticket that request holds here: the asker is told only if its ticket may speak
        for that request (a stranger learns nothing of requests it cannot read; the log always says it).
        """
        text = rid.b.decode(errors="replace") if isinstance(rid, BytesId) else str(rid)
        others: list[Any] = [text, BytesId(text.encode())]
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

    def _answer_unheld(self, req: wire.RequestData | wire.PullDone, source: Source, tomb: Any, hint: str = "") -> None:
        """Answer a receiver asking for a request this rank does not hold, from its tombstone (lock held)."""
        rid = req.request_id
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

    # --- control-plane handlers (messenger I/O thread) ------------------------------------------

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
                    link.post(self._confirm, old)  # it asks again: it may have missed our confirmation
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
            peer = GenPeer(info=info, identity=source.identity)
            peer.move(PeerState.CONNECTING)
            self.peers[key] = peer
            if link.auth is not None:
                link.learn_key(info, proven=source.peer_key)
        link.post(self._load_peer, peer)

    def on_request_data(self, source: Source, msg: wire.RequestData) -> None:
        key = (msg.gen_instance, msg.gen_rank)
        link = self.link
        with link.lock:
            peer = self.peers.get(key) or self._readmit(key, msg.gen_incarnation, source)
            if peer is None or peer.incarnation != msg.gen_incarnation or peer.gone:
                if peer is not None and peer.state is PeerState.REFUSED and peer.incarnation == msg.gen_incarnation:
                    err = peer.error or E.IncompatiblePeerError("refused")
                    link.reply(
                        source,
                        self._result(
                            msg.request_id, msg.nonce, status="failed", kind=type(err).__name__, error=str(err)
                        ),
                    )
                    s0 = self.tx.get(msg.request_id)
                    if s0 is not None and not s0.terminal and msg.ticket and hmac.compare_digest(msg.ticket, s0.ticket):
                        # Its receiver is one this rank refused: nobody else will take the request; end it now.
                        self._end(
                            s0, SessionState.FAILED, error_from(type(err).__name__, f"request {s0.request_id!r}: {err}")
                        )
                else:
                    self._not_registered(source, msg, f"generation rank {key} is not registered with this context rank")
                return
            if source.identity is not None:
                peer.identity = source.identity  # the connection it speaks on now (it may have reconnected)
            peer.asked_at = time.monotonic()
            if msg.ctx_incarnation and msg.ctx_incarnation != link.incarnation:
                self._not_registered(
                    source, msg, f"asked of context incarnation {msg.ctx_incarnation}; this is {link.incarnation}"
                )
                return
            s = self.tx.get(msg.request_id)
            if s is None:
                tomb = self._tombstone_for(msg.request_id, msg.ticket)
                if tomb is not None:
                    self._answer_unheld(msg, source, tomb)
                    return
                self._keep_early(msg, source, min(msg.timeout_ms / 1000.0, self.config.request_timeout_s))
                return
            self._attach(s, msg, source)
        link.post(self._drive, msg.request_id)

    def _ticket_ok(self, expected: bytes, presented: bytes | None) -> bool:
        """Whether a peer's ticket may speak for a request (``None``: this rank's own engine, always)."""
        return presented is None or not self.config.require_tickets or hmac.compare_digest(expected, presented)

    def _tomb(self, rid: Any) -> Any:
        """The tombstone of ``rid``: this rank's engine's, else a peer's (lock held); None if neither holds one."""
        tomb = self.tombstones.get(rid)
        return self.peer_tombstones.get(rid) if tomb is None else tomb

    def _tombstone_for(self, rid: Any, ticket: bytes) -> Any:
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

    def _attach(self, s: TxSession, msg: wire.RequestData, source: Source) -> None:
        """A receiver asked for ``s`` (lock held): add its task, or answer at once if ``s`` is already terminal."""
        peer = self.peers[(msg.gen_instance, msg.gen_rank)]
        key = (msg.gen_instance, msg.gen_rank)
        old = s.tasks.get(key)
        if old is not None:
            if old.peer is peer and old.nonce == msg.nonce:
                if old.final is not None:
                    self._send_to(old, old.final)  # asked again: same final answer
                return
            if old.peer is peer or old.state not in IDLE_TASK_STATES | {TaskState.SUBMITTED}:
                return  # one task per receiver incarnation; a second ask with another secret is ignored
        if self._refused_ticket(s, msg.ticket, msg.nonce, source):
            return
        if s.mode == "pull":
            self._refuse_request(
                source,
                s.request_id,
                msg.nonce,
                "SessionError",
                f"request {s.request_id} is sent in pull mode: the receiver reads it (start_receive with "
                "the transfer parameters)",
            )
            return
        t = ReceiverTask(
            peer=peer,
            block_ids={},
            state_slot=msg.state_slot,
            prompt_len=msg.prompt_len,
            nonce=msg.nonce,
            reply_to=source,
            deadline=time.monotonic() + min(msg.timeout_ms / 1000.0, self.config.request_timeout_s),
            bounce_addr=msg.bounce_addr,
            bounce_bytes=msg.bounce_bytes,
            bounce_digest=msg.bounce_digest,
            cached_tokens=max(0, msg.cached_tokens),
        )
        s.tasks[key] = t
        assert peer.info is not None
        if s.expected_receivers is None:
            s.expected_receivers = len(peer_ranks(self.link.topology, peer.info.topology, peer.info.topology.dp_rank))
        if s.terminal:
            self._finish_for_session(s, t)
            return
        try:
            raw: Any = (
                decode_group_ids(msg.group_block_ids, max_blocks=wire.MAX_BLOCKS_PER_REQUEST)
                if msg.group_block_ids
                else np.frombuffer(msg.block_ids, dtype="<i8")
            )
            t.block_ids = normalize_block_ids(
                raw, peer.info.page_table, f"request {s.request_id} destination block_ids"
            )
            if s.prompt_len >= 0 and msg.prompt_len >= 0 and s.prompt_len != msg.prompt_len:
                raise E.MappingError(
                    f"request {s.request_id} prompt_len: context {s.prompt_len}, generation {msg.prompt_len}"
                )
            windowed = {v.group for v in self.link.page_table.views if v.window is not None}
            for g, ids in t.block_ids.items():
                held = s.block_ids.get(g)
                if held is not None and g not in windowed and len(ids) > len(held):
                    raise E.MappingError(
                        f"request {s.request_id} block count of layer group {g!r}: the generation side expects "
                        f"{len(ids)} blocks, the context side holds {len(held)}"
                    )
        except E.KvcoreError as exc:
            log.warning("request %r from %s: %s", s.request_id, str(peer), exc)
            self._finish(s, t, TaskState.FAILED, kind=type(exc).__name__, error=str(exc))
            self._end(s, SessionState.FAILED, exc)

    def _refuse_request(self, source: Source, rid: Any, nonce: bytes, kind: str, error: str) -> None:
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
                status = "cancelled" if tomb is not None and tomb.state is SessionState.CANCELLED else "failed"
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

    def _registered(self, key: _Key, incarnation: str) -> GenPeer | None:
        """The registered, not refused, generation rank ``key`` of that incarnation (lock held)."""
        peer = self.peers.get(key)
        if peer is None or peer.gone or peer.incarnation != incarnation or peer.state is PeerState.REFUSED:
            return None
        return peer

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
            if s.state in (SessionState.INIT, SessionState.READY):
                s.transition(SessionState.TRANSFERRING)
            self._finish(s, t, TaskState.DONE)
        elif msg.status == "cancelled":
            self._finish(s, t, TaskState.CANCELLED, kind="RequestCancelledError", error=msg.error)
        else:
            exc2 = E.TransferFailedError(f"request {rid}: {peer} could not read it: {msg.error_kind}: {msg.error}")
            self._finish(s, t, TaskState.FAILED, kind=type(exc2).__name__, error=str(exc2))
            self._end(s, SessionState.FAILED, exc2)

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
                    status = "cancelled" if tomb.state is SessionState.CANCELLED else "failed"
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
                    status = "cancelled" if s.state is SessionState.CANCELLED else "failed"
                    self.link.reply(
                        source, self._result(rid, msg.nonce, status=status, kind=type(err).__name__, error=str(err))
                    )
                return
            if key not in s.renewers and len(s.renewers) >= 4096:
                return
            s.renewers[key] = msg.nonce
            self.tx.set_deadline(s, min(max(s.deadline, now + self.config.lease_s), s.hold_until))

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
                status = "cancelled" if tomb is None or tomb.state is not SessionState.DONE else "failed"
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
                    t.move(TaskState.FAILED)  # nobody to answer
                self._end(s, SessionState.FAILED, error)
        self.early.drop_peer(key)

    # --- worker thread -----------------------------------------------------------------------------

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
        with self.link.lock:
            peer.agent_name = name
            if peer.state is PeerState.CONNECTING:
                peer.move(PeerState.READY)
                peer.ready_at = time.monotonic()
                self.link.metrics.first_contact(peer.name, peer.ready_at - peer.created)
            rids = [rid for rid, s in self.tx.items() if peer.key in s.tasks]
        self._confirm(peer)
        for rid in rids:
            self._drive(rid)

    def _confirm(self, peer: GenPeer) -> None:
        """Tell a generation rank its agent is loaded here: from now on it may READ from this rank (pull mode)."""
        if peer.identity is not None and not peer.gone:
            # Over the connection it registered on: it arrives on that rank's own link to us, so it cannot be forged.
            self.link.reply(
                Source(identity=peer.identity),
                wire.RegisterResult(
                    v=wire.PROTOCOL_VERSION, ctx_rank=self.link.topology.rank, ok=True, info=self.link.accepted_info
                ),
            )

    def _drive_all(self) -> None:
        with self.link.lock:
            rids = list(self.tx)
        for rid in rids:
            self._drive(rid)

    def _drive(self, rid: InternalId) -> None:
        """Submit every ready task of a send session; settle the session when all are final."""
        with self.link.lock:
            s = self.tx.get(rid)
            if s is None:
                return
            todo = []
            for t in s.tasks.values():
                if t.state not in IDLE_TASK_STATES:
                    continue
                if s.terminal:
                    self._finish_for_session(s, t)
                    continue
                if t.peer.state is not PeerState.READY:
                    continue  # descriptor still loading, or the peer is suspect
                nxt = self._next_slice(s, t)
                if nxt.kind is SliceKind.NOT_READY:
                    continue  # layer-wise: nothing new is ready for this receiver
                # Claimed under the lock: from here a write may be in flight, so a cancel that arrives now
                # waits for the transport's final word instead of answering (and releasing) at once.
                t.move(TaskState.SUBMITTED)
                todo.append((t, nxt.layers))
            if todo and s.state in (SessionState.INIT, SessionState.READY):
                s.transition(SessionState.TRANSFERRING)
        for t, layers in todo:
            self._submit(s, t, layers)
        self._settle(s)

    def _next_slice(self, s: TxSession, t: ReceiverTask) -> NextSlice:
        """What to write next for ``t``: the whole request, a global layer range, or nothing yet."""
        start, stop = self.link.topology.layer_range
        lo = max(t.sent_upto, start)
        hi = stop if s.layers_upto is None else s.layers_upto
        if t.sent_upto < 0 and s.layers_upto is None:
            return NextSlice(SliceKind.WHOLE)  # everything at once: the common, fastest case
        return NextSlice(SliceKind.LAYERS, (lo, hi)) if hi > lo else NextSlice(SliceKind.NOT_READY)

    def _slice_done(self, s: TxSession, t: ReceiverTask) -> None:
        """A slice landed (or was empty): answer the task, or wait for more layers (lock held)."""
        t.total_bytes += t.nbytes
        t.total_fragments += t.fragments
        if t.sent_upto >= self.link.topology.layer_range[1]:
            self._finish(s, t, TaskState.DONE)
        else:
            t.move(TaskState.PARTIAL)
            if s.terminal:
                self._finish_for_session(s, t)
            else:
                self.link.post(self._drive, s.request_id)  # more layers may be ready already

    def _plan(self, s: TxSession, t: ReceiverTask, *, layers: tuple[int, int] | None, merge: bool) -> Any:
        assert t.peer.info is not None
        return plan_request(
            self.link.placement,
            t.peer.info.placement,
            s.block_ids,
            t.block_ids,
            mappers=self.link.mappers,
            src_state_slot=s.state_slot,
            dst_state_slot=t.state_slot,
            prompt_len=s.prompt_len if s.prompt_len >= 0 else t.prompt_len,
            layer_range=layers,
            merge=merge,
            cached_tokens=t.cached_tokens,
        )

    def _fail_task(self, s: TxSession, t: ReceiverTask, exc: E.KvcoreError) -> None:
        log.warning("request %r to %s: %s", s.request_id, str(t.peer), exc)
        with self.link.lock:
            self._finish(s, t, TaskState.FAILED, kind=type(exc).__name__, error=str(exc))
            self._end(s, SessionState.FAILED, exc)

    def _submit(self, s: TxSession, t: ReceiverTask, layers: tuple[int, int] | None) -> None:
        """Write the claimed task's next slice, ``layers`` or (``None``) the whole request (worker thread; SUBMITTED)."""
        t0 = time.monotonic()
        self.link.metrics.queued(t.peer.name, max(0.0, t0 - max(s.created, t.attached_at, t.peer.ready_at)))
        if layers is None and t.bounce_addr and self.bounce_on and self._submit_bounced(s, t, t0):
            return
        try:
            plan = self._plan(s, t, layers=layers, merge=True)
            t1 = time.monotonic()
            upto = self.link.topology.layer_range[1] if layers is None else layers[1]
            if plan.count == 0:
                with self.link.lock:
                    t.sent_upto = upto
                    t.nbytes = t.fragments = 0
                    self._slice_done(s, t)
                return
            assert t.peer.agent_name is not None
            handle = self.link.submit_transfer(
                TransferOp.WRITE, t.peer.agent_name, plan.src, plan.dst, plan.sizes, self._done_hook(s, t)
            )
        except E.KvcoreError as exc:
            self._fail_task(s, t, exc)
            return
        t2 = time.monotonic()
        self.link.metrics.transfer_posted(t.peer.name, plan.nbytes, plan.count, t1 - t0, t2 - t1)
        self._track(s, t, handle, plan.nbytes, plan.count, upto)

    def _track(self, s: TxSession, t: ReceiverTask, handle: Any, nbytes: int, count: int, upto: int) -> None:
        with self.link.lock:
            t.handle, t.nbytes, t.fragments, t.sent_upto = handle, nbytes, count, upto
            t.posted_at = time.monotonic()
            t.peer.inflight += 1
            self.inflight[id(t)] = (s, t)
            t.deadline = min(t.deadline, time.monotonic() + self.config.transfer_timeout_s)
        self._check_transfer(s, t, time.monotonic())  # same-host transports are often done already

    def _done_hook(self, s: TxSession, t: ReceiverTask) -> Any:
        """What the data plane calls (worker thread) when the task's transfer ends: answer the receiver now."""
        return lambda: self._check_transfer(s, t, time.monotonic())

    def _submit_bounced(self, s: TxSession, t: ReceiverTask, t0: float) -> bool:
        """Gather the unmerged plan into staging and write it with one fragment; False: use the direct path."""
        try:
            plan = self._plan(s, t, layers=None, merge=False)
        except E.KvcoreError:
            return False  # the direct path reports the error
        if plan.nbytes != t.bounce_bytes or bounce.plan_digest(plan.dst, plan.sizes) != t.bounce_digest:
            self.counters["bounce_fallback_plan_mismatch"] += 1
            log.warning(
                "request %r: receiver's bounce plan differs from ours; writing fragments directly", s.request_id
            )
            return False
        if self.staging is None:
            self.staging = self.link.new_arena()
        off = self.staging.lease(plan.nbytes)
        if off is None:
            self.counters["bounce_fallback_staging_full"] += 1
            return False
        staging = self.staging.address + off
        try:
            bounce.gather(plan.src, plan.sizes, staging)
            t1 = time.monotonic()  # the gather counts as planning
            assert t.peer.agent_name is not None
            handle = self.link.submit_transfer(
                TransferOp.WRITE,
                t.peer.agent_name,
                np.array([staging], np.uint64),
                np.array([t.bounce_addr], np.uint64),
                np.array([plan.nbytes], np.uint64),
                self._done_hook(s, t),
            )
        except E.KvcoreError as exc:
            self.staging.release(off)
            self._fail_task(s, t, exc)
            return True
        t.staging, t.bounced = off, True
        self.counters["bounced_writes_total"] += 1
        self.link.metrics.transfer_posted(
            t.peer.name, plan.nbytes, plan.count, t1 - t0, time.monotonic() - t1, bounced=True
        )
        self._track(s, t, handle, plan.nbytes, plan.count, self.link.topology.layer_range[1])
        return True

    def _check_transfer(self, s: TxSession, t: ReceiverTask, now: float) -> None:
        """Poll one submitted write; answer the receiver as soon as the transport says it is terminal."""
        x = t.handle
        if x is None:
            return  # already answered (the data plane's hook and a timer can both look)
        status = self.link.poll_transfer(x)
        if status is TransferStatus.PENDING:
            if now > t.deadline and not t.doubt_sent:
                # Logical timeout; the write may still land, so the receiver keeps its pages quarantined.
                t.doubt_sent = True
                self.link.stop_transfer(x, "its deadline passed")  # nothing more is started for it
                with self.link.lock:
                    self._end(
                        s,
                        SessionState.TIMED_OUT,
                        E.TransferTimeoutError(
                            f"request {s.request_id}: transfer to {t.peer} still pending at its deadline"
                        ),
                    )
                    self._send_to(
                        t,
                        self._result(
                            s.request_id,
                            t.nonce,
                            status="failed",
                            kind="TransferTimeoutError",
                            error="transfer still in flight at its deadline",
                            in_doubt=True,
                        ),
                    )
            return
        err = x.error
        self.link.metrics.transfer_finished(t.peer.name, status is TransferStatus.DONE, now - t.posted_at)
        self.link.release_transfer(x)
        if t.staging is not None and self.staging is not None:
            self.staging.release(t.staging)  # the transport no longer reads it
            t.staging = None
        with self.link.lock:
            self.inflight.pop(id(t), None)
            t.peer.inflight -= 1
            t.handle = None
            if status is TransferStatus.DONE:
                self._slice_done(s, t)
            else:
                exc = err or E.TransferFailedError("transfer failed")
                self._finish(s, t, TaskState.FAILED, kind=type(exc).__name__, error=str(exc))
                self._end(s, SessionState.FAILED, exc)
        self._settle(s)

    def _settle(self, s: TxSession) -> None:
        with self.link.lock:
            if s.terminal or s.expected_receivers is None or len(s.tasks) < s.expected_receivers:
                return
            states = {t.state for t in s.tasks.values()}
            if states <= {TaskState.DONE}:
                s.transition(SessionState.DONE)
            elif not states & (IDLE_TASK_STATES | {TaskState.SUBMITTED}):
                if TaskState.FAILED in states:
                    self._end(s, SessionState.FAILED, E.TransferFailedError(f"request {s.request_id}: a write failed"))
                else:
                    self._end(
                        s,
                        SessionState.CANCELLED,
                        E.RequestCancelledError(f"request {s.request_id} was cancelled by its receivers"),
                    )

    # --- timers (worker thread) ------------------------------------------------------------------

    def tick(self, now: float) -> None:
        if self.events:
            self._check_events()
        with self.link.lock:
            inflight = list(self.inflight.values())
        for s, t in inflight:
            self._check_transfer(s, t, now)
        self._reap_orphans()
        with self.link.lock:
            self._reap(now)
            unload = [p for p in self.retired if p.inflight == 0]
            self.retired = [p for p in self.retired if p.inflight > 0]
        for peer in unload:
            self._unload(peer)
        if unload:  # a restarted rank may have waited for its predecessor's agent name (``_free_agent_name``)
            with self.link.lock:
                waiting = [p for p in self.peers.values() if p.state is PeerState.CONNECTING and not p.agent_name]
            for peer in waiting:
                self._load_peer(peer)

    def _reap(self, now: float) -> None:
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
                    self.link.stop_transfer(t.handle, f"{peer} was lost")  # no new chunk into its memory
                    self.orphans.append(t.handle)
                    t.handle = None
                    peer.inflight -= 1
                    if t.staging is not None:
                        t.staging = None  # leaked deliberately: the transport may still read it
                    t.move(TaskState.FAILED)
                    self.counters["abandoned_transfers"] += 1

    def _reap_orphans(self) -> None:
        keep = []
        for h in self.orphans:
            if self.link.poll_transfer(h) is TransferStatus.PENDING:
                keep.append(h)
            else:
                self.link.release_transfer(h)
        self.orphans = keep

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

    # --- stats and close ---------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self.link.lock:
            return {
                "tx_sessions": len(self.tx),
                "early_requests": len(self.early),
                "early_request_bytes": self.early.bytes,
                "pending_events": len(self.events),
                "tombstones": len(self.tombstones) + len(self.peer_tombstones),
                "gen_peers": sum(1 for p in self.peers.values() if not p.gone),
                "retired_peers": len(self.retired),
                "staging_leases": self.staging.leased if self.staging else 0,
                "orphan_transfers": len(self.orphans),
            }

    def close(self) -> None:
        for peer in list(self.peers.values()) + self.retired:
            if peer.agent_name:
                self.link.unload_agent(
                    peer.agent_name, peer.incarnation, peer.info.agent_descriptor if peer.info else b""
                )


def _single(ids: dict[str, np.ndarray]) -> np.ndarray:
    """The ids of a rank's only group (or none)."""
    return next(iter(ids.values()), np.zeros(0, np.int64))
