"""The context role: serve instance info, accept generation ranks, and write each finished request into them.

This class only dispatches: the engine's calls, the message handlers and the timers go to the concern modules
(:mod:`.peers`, :mod:`.asks`, :mod:`.leases`, :mod:`.push`, :mod:`.bounce`, :mod:`.pull`), and every state
change to :mod:`.settle`. Pages go back to the engine only when a session is quiescent: no transfer can still
read them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from kvcore import errors as E
from kvcore.control import wire
from kvcore.layout.blocks import normalize_block_ids, normalize_state_slot
from kvcore.params import InternalId, TransferParams, api_id, check_ticket, is_transfer_mode
from kvcore.transceiver.digests import blocks_digest
from kvcore.transceiver.link import Handler
from kvcore.transceiver.peers import PeerState
from kvcore.transceiver.send.bounce import SendBounce
from kvcore.transceiver.send.leases import SendLeases
from kvcore.transceiver.send.pull import SendPull
from kvcore.transceiver.sessions import (
    FINAL_TASK_STATES,
    RequestStatus,
    SessionState,
    TaskState,
    TxSession,
)

log = logging.getLogger("kvcore.transceiver")

_Key = tuple[str, int]


class Sender(SendBounce, SendPull, SendLeases):
    """Context role of a transceiver."""

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

    def start_send(
        self,
        rid: InternalId,
        block_ids: object,
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
        if not is_transfer_mode(mode):
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
            early = self.early.pop(rid)
            native = self.link.native
            if native is not None and not s.terminal:
                # A receiver asking on the native lane is served there, in C; or told to ask on the Python path.
                offer = native.offer(s, "a receiver asked on the Python path already" if early else "")
                s.lane = offer == "offered"
                if offer == "cancelled":
                    self._end(s, SessionState.CANCELLED, E.RequestCancelledError(f"request {rid} was cancelled by "
                              "its receiver (on the native lane) before start_send"))  # fmt: skip
            for _, req, source in early:
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
            mode=mode,
            dp_rank=topo.dp_rank if topo.attention_dp else 0,
            prompt_len=int(prompt_len),
            block_ids=_single(whole).tolist() if mode == "pull" and len(whole) <= 1 else (),
            group_block_ids={g: v.tolist() for g, v in whole.items()} if mode == "pull" and len(whole) > 1 else None,
            state_slot=whole_slot,
            incarnation=info0.incarnation if mode == "pull" else "",
            lease_ms=int(self.config.lease_s * 1000),
        )

    def _check_aux(self, rid: InternalId, aux: object) -> bytes:
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

    def set_aux(self, rid: InternalId, aux: bytes) -> None:
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
            native = self.link.native
            if s.lane and native is not None:
                if not native.withdraw(s):
                    raise E.SessionError(
                        f"request {rid}: the native lane is writing it (or wrote it) already; set aux at start_send"
                    )
                s.lane = False
                native.decline(s, "the request carries an aux payload: ask on the Python path")
            s.aux = data

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

    def _live_status(self, s: TxSession) -> RequestStatus:
        """TRANSFERRING once a write was claimed or a receiver has its KV; READY when every receiver asked (their
        memory is allocated) and nothing was written yet; WAITING before that."""
        states = {t.state for t in s.tasks.values()}
        if states - {TaskState.WAITING} - FINAL_TASK_STATES or TaskState.DONE in states:
            return RequestStatus.TRANSFERRING
        if s.expected_receivers is not None and len(s.tasks) >= s.expected_receivers:
            return RequestStatus.READY
        return RequestStatus.WAITING

    def tick(self, now: float) -> None:
        self.lane_drain()
        if self.link.native is not None:
            self.link.native.expire(now)
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
        """The timers that need the lock: leases, early asks and tombstones, peers (in that order)."""
        self._expire_leases(now)
        self._expire_asks(now)
        self._reap_peers(now)

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
