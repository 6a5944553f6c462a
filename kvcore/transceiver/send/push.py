"""Push mode: receivers ask with ``RequestData``; this rank writes each task's slices and answers when they landed."""

from __future__ import annotations

import hmac
import logging
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.layout.blocks import decode_group_ids, normalize_block_ids
from kvcore.layout.mappers import FragmentPlan
from kvcore.layout.peer import peer_ranks
from kvcore.params import InternalId
from kvcore.transceiver.link import Transfer, error_from
from kvcore.transceiver.peers import PeerState
from kvcore.transceiver.planning import plan_request
from kvcore.transceiver.send.asks import SendAsks
from kvcore.transceiver.sessions import (
    IDLE_TASK_STATES,
    ReceiverTask,
    SessionState,
    TaskState,
    TxSession,
)
from kvcore.transport.agent import TransferOp, TransferStatus

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
    """The answer of ``SendPush._next_slice``: a kind, and the global layers ``[start, stop)`` for ``LAYERS``."""

    kind: SliceKind
    layers: tuple[int, int] | None = None


class SendPush(SendAsks):
    """Asks, layer-wise readiness, claiming, planning, submitting and polling writes."""

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
        native = self.link.native
        if s.lane and native is not None:
            if not native.withdraw(s):
                # The lane took a request for it already (its completion is coming): one writer per request.
                self._refuse_request(
                    source,
                    s.request_id,
                    msg.nonce,
                    "SessionError",
                    f"request {s.request_id} is being written on the native lane to another receiver",
                )
                return
            s.lane = False  # asked on the Python path: served there
            native.decline(s, "a receiver asked on the Python path already")
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
            windowed = self.link.windowed_groups
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

    def layers_ready(self, rid: InternalId, upto: int, event: Any = None) -> None:
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
                self._claim(t)
                todo.append((t, nxt.layers))
            if todo:
                self._begin(s)
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

    def _plan(self, s: TxSession, t: ReceiverTask, *, layers: tuple[int, int] | None, merge: bool) -> FragmentPlan:
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
        nbytes = handle.nbytes
        self.link.metrics.transfer_posted(t.peer.name, nbytes, plan.count, t1 - t0, t2 - t1)
        self._track(s, t, handle, nbytes, plan.count, upto)

    def _track(self, s: TxSession, t: ReceiverTask, handle: Transfer, nbytes: int, count: int, upto: int) -> None:
        with self.link.lock:
            t.handle, t.nbytes, t.fragments, t.sent_upto = handle, nbytes, count, upto
            t.posted_at = time.monotonic()
            t.peer.inflight += 1
            self.inflight[id(t)] = (s, t)
            t.deadline = min(t.deadline, time.monotonic() + self.config.transfer_timeout_s)
        self._check_transfer(s, t, time.monotonic())  # same-host transports are often done already

    def _done_hook(self, s: TxSession, t: ReceiverTask) -> Callable[[], None]:
        """What the data plane calls (worker thread) when the task's transfer ends: answer the receiver now."""
        return lambda: self._check_transfer(s, t, time.monotonic())

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

    def _reap_orphans(self) -> None:
        keep = []
        for h in self.orphans:
            if self.link.poll_transfer(h) is TransferStatus.PENDING:
                keep.append(h)
            else:
                self.link.release_transfer(h)
        self.orphans = keep

    @abstractmethod
    def _submit_bounced(self, s: TxSession, t: ReceiverTask, t0: float) -> bool:
        """Gather the unmerged plan into staging and write it with one fragment; False: use the direct path
        (:mod:`.bounce`)."""
