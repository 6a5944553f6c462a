"""The engine-facing transceiver: start sending, start receiving, poll, cancel.

One ``Transceiver`` per rank. The context side (``role="context"``) writes a
finished request's KV into the memory of every generation rank that asks for
it; the generation side (``role="generation"``) asks the context ranks that
hold its layers/heads and waits until every one of them reported.

Threads: the engine's thread calls the public methods; the messenger's I/O
thread decodes control messages and updates state; one worker thread owns the
transfer agent (submits, polls, progresses) and enforces deadlines on a timer.
All shared state is guarded by one lock; nothing blocks while holding it.

Memory safety: ``poll()`` reports an outcome once every rank of the instance
agrees the request is terminal, and reports the request as *released* only
when no write into its pages can still land (every writer reported a final
result or is known dead). Engines reuse pages on release, never earlier.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvcore import bounce, wire
from kvcore import errors as E
from kvcore.agent import MemoryKind, MemoryRegion, TransferAgent, TransferOp, TransferStatus, process_incarnation
from kvcore.collective import Collective, LocalCollective
from kvcore.config import TransceiverConfig
from kvcore.mapping import RankLayout, plan_transfer, validate_compatible
from kvcore.messenger import Messenger, Source
from kvcore.page import PageTable
from kvcore.peer import peer_ranks
from kvcore.session import IDLE_TASK_STATES, ReceiverTask, RxSession, SessionState, TxSession, WriterState
from kvcore.topology import AttentionGeometry, Topology

__all__ = ["Transceiver", "PollResult", "Outcome"]

log = logging.getLogger("kvcore.transceiver")

_STATUS_CODE = {SessionState.DONE: 0, SessionState.CANCELLED: 1, SessionState.TIMED_OUT: 2, SessionState.FAILED: 3}
_CODE_STATUS = {v: k for k, v in _STATUS_CODE.items()}


@dataclass(frozen=True)
class Outcome:
    """The agreed terminal outcome of one request on this instance."""

    request_id: int
    state: SessionState
    error: E.KvcoreError | None = None
    nbytes: int = 0


@dataclass
class PollResult:
    """What ``poll()`` learned: outcomes agreed by every rank, and requests whose pages may now be reused."""

    done: list[Outcome] = field(default_factory=list)
    failed: list[Outcome] = field(default_factory=list)  # FAILED and TIMED_OUT
    cancelled: list[Outcome] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    @property
    def outcomes(self) -> list[Outcome]:
        return self.done + self.failed + self.cancelled


class _Agreement(msgspec.Struct, array_like=True):
    group: int  # ranks with equal group agree on a request (the attention-DP group; 0 without attention DP)
    terminal: dict[int, int]
    quiescent: list[int]


def _error_from(kind: str, message: str) -> E.KvcoreError:
    cls = getattr(E, kind, None)
    if isinstance(cls, type) and issubclass(cls, E.KvcoreError):
        return cls(message)
    return E.TransferFailedError(f"{kind}: {message}" if kind else message)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(eq=False)
class _CtxInstance:
    """What a generation rank knows about one context instance (cached per endpoint)."""

    endpoint: str
    state: str = "fetching"  # fetching | ready | refused
    ranks: list[wire.RankInfo] = field(default_factory=list)
    peers: list[int] = field(default_factory=list)  # ctx ranks this gen rank exchanges with
    error: E.KvcoreError | None = None
    asked_at: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _GenPeer:
    """A generation rank registered with this context rank."""

    info: wire.RankInfo
    agent_name: str | None = None
    lost: bool = False


class Transceiver:
    """Moves KV between a context instance and generation instances; one per rank."""

    def __init__(
        self,
        config: TransceiverConfig,
        *,
        role: str,
        agent: TransferAgent,
        topology: Topology,
        geometry: AttentionGeometry,
        page_table: PageTable,
        collective: Collective | None = None,
        instance_name: str | None = None,
        pm: Any = None,
        device: str = "cpu",
    ) -> None:
        if role not in ("context", "generation"):
            raise E.ConfigError(f"role must be 'context' or 'generation', got {role!r}")
        from kvcore.plugins import get_plugin_manager

        self.config = config
        self.role = role
        self.agent = agent
        self.topology = topology
        self.geometry = geometry
        self.page_table = page_table
        self.collective = collective or LocalCollective()
        self._pm = pm or get_plugin_manager()
        self._mappers = self._pm.registries.layout_mappers
        self._lock = threading.RLock()
        self._work: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._closed = False
        self.incarnation = process_incarnation()
        # Engine-visible sessions and their bookkeeping.
        self._rx: dict[int, RxSession] = {}
        self._tx: dict[int, TxSession] = {}
        self._early: dict[int, list[tuple[float, wire.RequestData]]] = {}  # RequestData before start_send
        self._tombstones: dict[int, float] = {}  # cancels for requests not started yet
        self._reported_terminal: set[int] = set()
        # Peers.
        self._ctx_instances: dict[str, _CtxInstance] = {}
        self._gen_peers: dict[tuple[str, int], _GenPeer] = {}
        self._refused: dict[tuple[str, int], E.KvcoreError] = {}
        self._quarantined: set[int] = set()
        # Memory: the pools where the engine put them (``device``: "cpu", "cuda" or "cuda:N").
        kind, dev_id = MemoryKind.DRAM, 0
        if device.startswith("cuda"):
            kind, dev_id = MemoryKind.VRAM, int(device.partition(":")[2] or 0)
        elif device != "cpu":
            raise E.ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        self._registrations = [
            agent.register_memory(MemoryRegion(addr, length, kind, dev_id)) for addr, length in page_table.regions()
        ]
        # Bounce path (DRAM only): the receiver's arena is registered now so that its descriptor carries it;
        # the sender's staging buffer is allocated on first use.
        self._bounce_on = config.bounce_enabled and kind is MemoryKind.DRAM
        self._arena: bounce.Arena | None = None
        self._staging: bounce.Arena | None = None
        self._bounce_tensors: list[Any] = []
        # (ctx endpoint, ctx rank) -> (fragments per block, mean fragment bytes) of its unmerged plans
        self._plan_shape: dict[tuple[str, int], tuple[float, float]] = {}
        # context: writes sent packed; generation: leases unpacked
        self._bounced_writes_total = 0
        self._inflight: dict[int, tuple[TxSession, ReceiverTask]] = {}  # id(task) -> its submitted write
        if self._bounce_on and role == "generation":
            self._arena = self._new_arena()
        self.messenger = Messenger(
            self._on_message,
            host=config.host,
            port=config.port if self.collective.rank == 0 or not config.port else 0,
            max_message_bytes=config.max_message_bytes,
            on_disconnect=self._on_disconnect,
            name=f"{role}{self.topology.rank}",
        )
        # Agree on the instance name and gather every rank's info (rank 0 serves it to peers).
        name = instance_name or f"{role}-{uuid.uuid4().hex[:8]}"
        names = self.collective.allgather(name.encode())
        self.instance_name = names[0].decode()
        self.rank_info = wire.RankInfo(
            instance_name=self.instance_name,
            rank=self.topology.rank,
            incarnation=self.incarnation,
            protocol_version=wire.PROTOCOL_VERSION,
            backend=agent.backend,
            endpoint=self.messenger.endpoint,
            topology=topology,
            geometry=geometry,
            page_table=page_table,
            agent_descriptor=agent.descriptor(),
            pid=os.getpid(),
            hostname=socket.gethostname(),
        )
        enc = msgspec.msgpack.Encoder()
        dec = msgspec.msgpack.Decoder(wire.RankInfo)
        gathered = self.collective.allgather(enc.encode(self.rank_info))
        self.instance_ranks = sorted((dec.decode(b) for b in gathered), key=lambda r: r.rank)
        self._worker = threading.Thread(target=self._work_loop, name=f"{role}{self.topology.rank}-worker", daemon=True)
        self.messenger.start()
        self._worker.start()

    # --- engine API ------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint. Rank 0's is the instance's ``disagg_info_endpoint``."""
        return self.messenger.endpoint

    @property
    def info_endpoint(self) -> str:
        """The endpoint generation workers contact first (context rank 0)."""
        return self.instance_ranks[0].endpoint

    def start_send(
        self,
        request_id: int,
        block_ids: Iterable[int],
        *,
        prompt_len: int = -1,
        state_slot: int = -1,
        layers_ready: int | None = None,
    ) -> None:
        """Context side: the request's KV lives in ``block_ids`` (in token order); send it.

        By default every layer is complete. For layer-wise sending while prefill
        still runs, pass ``layers_ready=L`` (global layers below ``L`` are complete)
        and call :meth:`layers_ready` as more layers finish; each slice is written
        as soon as a receiver asked for the request.
        """
        rid, blocks = self._admit_args("context", request_id, block_ids, state_slot)
        with self._lock:
            if rid in self._tx:
                raise E.SessionError(f"request {rid} is already being sent")
            self._admit()
            s = TxSession(
                request_id=rid,
                deadline=time.monotonic() + self.config.request_timeout_s,
                block_ids=blocks,
                state_slot=state_slot,
                prompt_len=prompt_len,
                layers_upto=self._layers_upto(layers_ready),
            )
            self._tx[rid] = s
            if self._tombstones.pop(rid, None) is not None:
                s.transition(
                    SessionState.CANCELLED, E.RequestCancelledError(f"request {rid} was cancelled by the receiver")
                )
            for _, req in self._early.pop(rid, []):
                self._attach_receiver(s, req)
        self._work.put(("tx", rid))

    def layers_ready(self, request_id: int, upto: int) -> None:
        """Context side, layer-wise: global layers below ``upto`` are complete; they are written at once."""
        self._require("context")
        rid = self._check_rid(request_id)
        with self._lock:
            s = self._tx.get(rid)
            if s is None:
                raise E.SessionError(f"request {rid} is not being sent; call start_send first")
            if s.layers_upto is not None:
                new = self._layers_upto(upto)
                s.layers_upto = None if new is None else max(s.layers_upto, new)
        self._work.put(("tx", rid))

    def _layers_upto(self, upto: int | None) -> int | None:
        """None once every layer this rank holds is ready."""
        if upto is None or upto >= self.topology.layer_range[1]:
            return None
        return int(upto)

    def start_receive(
        self,
        request_id: int,
        ctx_endpoint: str,
        block_ids: Iterable[int],
        *,
        prompt_len: int = -1,
        state_slot: int = -1,
        ctx_dp_rank: int = 0,
    ) -> None:
        """Generation side: fetch request ``request_id`` from the context instance at ``ctx_endpoint``.

        ``block_ids`` are this rank's destination blocks in token order; when the
        generation side already holds a cached prefix, pass only the suffix blocks.
        ``ctx_dp_rank`` names the context attention-DP group that ran the prefill.
        """
        rid, blocks = self._admit_args("generation", request_id, block_ids, state_slot)
        wire.parse_endpoint(ctx_endpoint)
        with self._lock:
            if rid in self._rx:
                raise E.SessionError(f"request {rid} is already being received")
            self._admit()
            s = RxSession(
                request_id=rid,
                deadline=time.monotonic() + self.config.request_timeout_s,
                ctx_endpoint=ctx_endpoint,
                block_ids=blocks,
                state_slot=state_slot,
                prompt_len=prompt_len,
                ctx_dp_rank=ctx_dp_rank,
            )
            self._rx[rid] = s
            inst = self._ctx_instances.get(ctx_endpoint)
            if inst is None:
                inst = self._ctx_instances[ctx_endpoint] = _CtxInstance(ctx_endpoint)
                self.messenger.send(
                    ctx_endpoint,
                    wire.InstanceInfoRequest(
                        v=wire.PROTOCOL_VERSION,
                        min_version=wire.MIN_PROTOCOL_VERSION,
                        max_version=wire.PROTOCOL_VERSION,
                        asker=f"{self.instance_name}/{self.topology.rank}",
                    ),
                )
            elif inst.state == "refused":
                s.transition(SessionState.FAILED, inst.error)
            elif inst.state == "ready":
                self._request_data(s, inst)

    def cancel(self, request_id: int, reason: str = "cancelled by the engine") -> bool:
        """Cancel a request (logical). Its pages are released only once no write can still land."""
        rid = self._check_rid(request_id)
        with self._lock:
            if self.role == "generation":
                s = self._rx.get(rid)
                if s is None or s.terminal:
                    return False
                s.transition(SessionState.CANCELLED, E.RequestCancelledError(f"request {rid}: {reason}"))
                inst = self._ctx_instances.get(s.ctx_endpoint)
                for ctx_rank, w in s.writers.items():
                    if w is WriterState.ASKED and inst is not None:
                        self.messenger.send(
                            inst.ranks[ctx_rank].endpoint,
                            wire.Cancel(
                                v=wire.PROTOCOL_VERSION,
                                request_id=rid,
                                instance=self.instance_name,
                                rank=self.topology.rank,
                                reason=reason,
                            ),
                        )
                return True
            s2 = self._tx.get(rid)
            if s2 is None or s2.terminal:
                self._tombstones.setdefault(rid, time.monotonic())
                return False
            s2.transition(SessionState.CANCELLED, E.RequestCancelledError(f"request {rid}: {reason}"))
        self._work.put(("tx", rid))
        return True

    def poll(self) -> PollResult:
        """Outcomes every rank agrees on, and requests whose memory is now safe to reuse.

        Collective: every rank of the instance calls ``poll`` the same number of times.
        """
        with self._lock:
            sessions: dict[int, Any] = self._rx if self.role == "generation" else self._tx
            terminal = {rid: _STATUS_CODE[s.state] for rid, s in sessions.items() if s.terminal and not s.reported}
            quiescent = [rid for rid, s in sessions.items() if s.terminal and s.quiescent and not s.released]
        group = self.topology.dp_rank if self.topology.attention_dp else 0
        payload = msgspec.msgpack.encode(_Agreement(group, terminal, quiescent))
        everyone = [msgspec.msgpack.decode(b, type=_Agreement) for b in self.collective.allgather(payload)]
        # Under attention DP a request lives on one DP group only: those ranks must agree, not the whole instance.
        gathered = [g for g in everyone if g.group == group]
        result = PollResult()
        agreed_terminal = set(terminal)
        for g in gathered:
            agreed_terminal &= set(g.terminal)
        agreed_quiet = set(quiescent)
        for g in gathered:
            agreed_quiet &= set(g.quiescent)
        with self._lock:
            for rid in sorted(agreed_terminal):
                state = _CODE_STATUS[max(g.terminal[rid] for g in gathered)]  # worst outcome wins
                s = sessions.get(rid)
                if s is None:
                    continue
                s.reported = True
                err = s.error
                if state is not s.state and err is None:
                    err = E.SessionError(f"request {rid} ended {state.value} on another rank of this instance")
                out = Outcome(rid, state, err if state is not SessionState.DONE else None, s.nbytes)
                if state is SessionState.DONE:
                    result.done.append(out)
                elif state is SessionState.CANCELLED:
                    result.cancelled.append(out)
                else:
                    result.failed.append(out)
            for rid in sorted(agreed_quiet):
                s = sessions.get(rid)
                if s is None or not s.reported:
                    continue
                s.released = True
                result.released.append(rid)
                del sessions[rid]
                if isinstance(s, RxSession) and self._arena is not None:
                    for off in s.leases.values():
                        self._arena.release(off)  # every writer is terminal: nothing can land here any more
                    s.leases.clear()
                self._quarantined.discard(rid)
        return result

    def wait_all(self, request_ids: Iterable[int], timeout: float) -> dict[int, Outcome]:
        """Poll until every id is reported and released (single-rank helper for tests and tools)."""
        want = set(request_ids)
        outcomes: dict[int, Outcome] = {}
        released: set[int] = set()
        deadline = time.monotonic() + timeout
        while not (want <= released and want <= set(outcomes)):
            r = self.poll()
            outcomes.update({o.request_id: o for o in r.outcomes})
            released.update(r.released)
            if time.monotonic() > deadline:
                missing = sorted((want - released) | (want - set(outcomes)))
                raise E.TransferTimeoutError(
                    f"{len(missing)} request(s) not reported and released after {timeout}s: {missing[:8]} "
                    "(wait_all sees only outcomes reported during its own polls)"
                )
            time.sleep(0.001)
        return outcomes

    def stats(self) -> dict[str, int]:
        """Live counts for leak checks: all return to zero (but peers) once every request is released."""
        with self._lock:
            return {
                "bounce_leases": self._arena.leased if self._arena else 0,
                "bounced_writes_total": self._bounced_writes_total,
                "staging_leases": self._staging.leased if self._staging else 0,
                "rx_sessions": len(self._rx),
                "tx_sessions": len(self._tx),
                "early_requests": sum(len(v) for v in self._early.values()),
                "tombstones": len(self._tombstones),
                "quarantined": len(self._quarantined),
                "ctx_instances": len(self._ctx_instances),
                "gen_peers": len(self._gen_peers),
                "agent_transfers": self.agent.resources().get("transfers", 0),
            }

    def close(self, timeout: float = 5.0) -> None:
        """Stop threads, drop peers and deregister memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._work.put(("stop", None))
        self._worker.join(timeout)
        self.messenger.close(timeout)
        for peer in list(self._gen_peers.values()):
            if peer.agent_name and peer.agent_name in self.agent.remote_agents:
                self.agent.unload_remote_agent(peer.agent_name)
        for inst in self._ctx_instances.values():
            for info in inst.ranks:
                name = self._agent_name(info)
                if name in self.agent.remote_agents:
                    self.agent.unload_remote_agent(name)
        for reg in self._registrations:
            try:
                self.agent.deregister_memory(reg)
            except E.TransferError:
                pass
        self._registrations.clear()

    def __enter__(self) -> Transceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers -----------------------------------------------------------------------------

    @property
    def layout(self) -> RankLayout:
        return RankLayout(topology=self.topology, geometry=self.geometry, page_table=self.page_table)

    def _require(self, role: str) -> None:
        if self._closed:
            raise E.SessionError("transceiver is closed")
        if self.role != role:
            raise E.SessionError(f"this is a {self.role} transceiver; that call is for the {role} side")

    @staticmethod
    def _check_rid(request_id: int) -> int:
        if not isinstance(request_id, (int, np.integer)) or not (0 <= int(request_id) <= wire.MAX_U64):
            raise E.SessionError(f"request_id must be an integer in 0..2**64-1, got {request_id!r}")
        return int(request_id)

    def _admit(self) -> None:
        live = len(self._rx) + len(self._tx)
        if live >= self.config.max_inflight_requests:
            raise E.ResourceExhaustedError(
                f"{live} requests in flight reach max_inflight_requests={self.config.max_inflight_requests}"
            )

    def _max_slot(self, state: bool = False) -> int:
        """Slots of the token views' pools (block ids), or of the state views' pools (``state=True``)."""
        pools = {p for v in self.page_table.views if v.is_state == state for p in v.pools}
        return min((self.page_table.pools[p].num_slots for p in pools), default=0)

    def _admit_args(
        self, role: str, request_id: int, block_ids: Iterable[int], state_slot: int
    ) -> tuple[int, np.ndarray]:
        """Validate a start_send/start_receive call: role, 64-bit id, block ids and state slot in range."""
        self._require(role)
        rid = self._check_rid(request_id)
        blocks = np.asarray(list(block_ids) if not isinstance(block_ids, np.ndarray) else block_ids, dtype=np.int64)
        self._check_slots(rid, blocks, state_slot)
        return rid, blocks

    def _check_slots(self, rid: int, blocks: np.ndarray, state_slot: int) -> None:
        """Refuse block ids or a state slot outside this rank's pools before anything is sent."""
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self._max_slot()):
            raise E.LayoutError(f"request {rid}: block ids must be in 0..{self._max_slot() - 1}")
        if state_slot >= 0 and state_slot >= self._max_slot(state=True):
            raise E.LayoutError(
                f"request {rid}: state_slot {state_slot} is outside 0..{self._max_slot(state=True) - 1} "
                "(or this rank holds no state pools)"
            )

    def _new_arena(self) -> bounce.Arena:
        import torch

        t = self.agent.allocate_tensor((self.config.bounce_buffer_bytes,), torch.uint8)
        self._bounce_tensors.append(t)
        self._registrations.append(self.agent.register_memory(t))
        return bounce.Arena(t.data_ptr(), t.numel())

    @staticmethod
    def _agent_name(info: wire.RankInfo) -> str:
        return msgspec.msgpack.decode(info.agent_descriptor, type=dict)["name"]

    # --- control-plane handlers (messenger I/O thread) -----------------------------------------

    def _on_message(self, source: Source, msg: wire.Message) -> None:
        if isinstance(msg, wire.InstanceInfoRequest):
            self._on_info_request(source, msg)
        elif isinstance(msg, wire.InstanceInfo):
            self._on_instance_info(source, msg)
        elif isinstance(msg, wire.RegisterRankInfo):
            self._on_register(source, msg)
        elif isinstance(msg, wire.RegisterResult):
            self._on_register_result(source, msg)
        elif isinstance(msg, wire.RequestData):
            self._on_request_data(source, msg)
        elif isinstance(msg, wire.TransferResult):
            self._on_transfer_result(source, msg)
        elif isinstance(msg, wire.Cancel):
            self._on_cancel(source, msg)
        elif isinstance(msg, wire.ErrorReply):
            self._on_error_reply(source, msg)

    def _on_info_request(self, source: Source, msg: wire.InstanceInfoRequest) -> None:
        if self.role != "context":
            self.messenger.reply(
                source,
                wire.ErrorReply(
                    v=wire.PROTOCOL_VERSION, kind="ProtocolError", error="this endpoint is a generation rank"
                ),
            )
            return
        try:
            version = wire.negotiate(msg.min_version, msg.max_version)
        except E.ProtocolVersionError as exc:
            self.messenger.reply(
                source,
                wire.InstanceInfo(v=wire.PROTOCOL_VERSION, instance_name=self.instance_name, ranks=[], error=str(exc)),
            )
            return
        self.messenger.reply(
            source, wire.InstanceInfo(v=version, instance_name=self.instance_name, ranks=self.instance_ranks)
        )

    def _on_instance_info(self, source: Source, msg: wire.InstanceInfo) -> None:
        if self.role != "generation" or source.endpoint is None:
            return
        with self._lock:
            inst = self._ctx_instances.get(source.endpoint)
            if inst is None or inst.state != "fetching":
                return  # duplicate or unsolicited
            try:
                if msg.error:
                    raise E.ProtocolVersionError(f"context instance at {source.endpoint} refused: {msg.error}")
                if not msg.ranks:
                    raise E.ProtocolError(f"context instance at {source.endpoint} sent no rank information")
                ranks = sorted(msg.ranks, key=lambda r: r.rank)
                if [r.rank for r in ranks] != list(range(ranks[0].topology.world_size)):
                    raise E.ProtocolError(f"context instance at {source.endpoint} sent an incomplete rank list")
                # Every rank this rank could exchange with, over all context DP groups.
                ctx_topo = ranks[0].topology
                inst.peers = sorted(
                    {p for d in range(ctx_topo.dp_size) for p in peer_ranks(self.topology, ctx_topo, d)}
                )
                for r in inst.peers:
                    validate_compatible(ranks[r].layout, self.layout)
                    if ranks[r].backend != self.agent.backend:
                        raise E.IncompatiblePeerError(
                            f"transfer backend: context rank {r} uses {ranks[r].backend!r}, this rank uses {self.agent.backend!r}"
                        )
            except E.KvcoreError as exc:
                inst.state, inst.error = "refused", exc
                log.error("refusing context instance at %s: %s", source.endpoint, exc)
                for s in self._rx.values():
                    if s.ctx_endpoint == source.endpoint and not s.terminal:
                        s.transition(SessionState.FAILED, exc)
                return
            inst.ranks, inst.state = ranks, "ready"
        self._work.put(("load_ctx", source.endpoint))

    def _on_register(self, source: Source, msg: wire.RegisterRankInfo) -> None:
        info = msg.info
        key = (info.instance_name, info.rank)
        if self.role != "context":
            return
        try:
            validate_compatible(self.layout, info.layout)
            if info.backend != self.agent.backend:
                raise E.IncompatiblePeerError(
                    f"transfer backend: generation rank uses {info.backend!r}, this context rank uses {self.agent.backend!r}"
                )
        except E.KvcoreError as exc:
            with self._lock:
                self._refused[key] = exc
            self.messenger.reply(
                source,
                wire.RegisterResult(
                    v=wire.PROTOCOL_VERSION,
                    ctx_rank=self.topology.rank,
                    ok=False,
                    error_kind=type(exc).__name__,
                    error=str(exc),
                ),
            )
            return
        with self._lock:
            old = self._gen_peers.get(key)
            if old is not None and old.info.incarnation == info.incarnation:
                return  # duplicate registration
            self._refused.pop(key, None)
            self._gen_peers[key] = _GenPeer(info)
        self._work.put(("load_gen", key))

    def _on_register_result(self, source: Source, msg: wire.RegisterResult) -> None:
        if msg.ok or source.endpoint is None:
            return
        err = _error_from(msg.error_kind, f"context rank {msg.ctx_rank} refused this generation rank: {msg.error}")
        with self._lock:
            for inst in self._ctx_instances.values():
                if any(r.endpoint == source.endpoint for r in inst.ranks):
                    inst.state, inst.error = "refused", err
                    for s in self._rx.values():
                        if s.ctx_endpoint == inst.endpoint:
                            if msg.ctx_rank in s.writers:
                                s.writers[msg.ctx_rank] = WriterState.FAILED
                            s.transition(SessionState.FAILED, err)

    def _on_request_data(self, source: Source, msg: wire.RequestData) -> None:
        key = (msg.gen_instance, msg.gen_rank)
        with self._lock:
            peer = self._gen_peers.get(key)
            refused = self._refused.get(key)
            if peer is None or peer.info.incarnation != msg.gen_incarnation:
                why = str(refused) if refused else f"generation rank {key} is not registered with this context rank"
                self._send_result(
                    msg.request_id,
                    None,
                    status="failed",
                    kind=type(refused).__name__ if refused else "ProtocolError",
                    error=why,
                    source=source,
                )
                return
            s = self._tx.get(msg.request_id)
            if s is None:
                if msg.request_id in self._tombstones:
                    self._send_result(
                        msg.request_id,
                        peer.info.endpoint,
                        status="cancelled",
                        kind="RequestCancelledError",
                        error="request was cancelled by the context side",
                    )
                    return
                if sum(len(v) for v in self._early.values()) >= self.config.max_inflight_requests:
                    self._send_result(
                        msg.request_id,
                        peer.info.endpoint,
                        status="failed",
                        kind="ResourceExhaustedError",
                        error=f"{self.config.max_inflight_requests} requests already wait for start_send here",
                    )
                    return
                # Kept until the receiver's deadline (bounded by ours); then it is answered with a failure.
                ttl = min(msg.timeout_ms / 1000.0, self.config.request_timeout_s)
                self._early.setdefault(msg.request_id, []).append((time.monotonic() + ttl, msg))
                return
            self._attach_receiver(s, msg)
        self._work.put(("tx", msg.request_id))

    def _attach_receiver(self, s: TxSession, msg: wire.RequestData) -> None:
        key = (msg.gen_instance, msg.gen_rank)
        if key in s.tasks:
            return  # duplicate request
        peer = self._gen_peers[key]
        blocks = np.frombuffer(msg.block_ids, dtype="<i8").astype(np.int64)
        s.tasks[key] = ReceiverTask(
            gen_key=key,
            endpoint=peer.info.endpoint,
            block_ids=blocks,
            state_slot=msg.state_slot,
            prompt_len=msg.prompt_len,
            deadline=time.monotonic() + min(msg.timeout_ms / 1000.0, self.config.request_timeout_s),
            bounce_addr=msg.bounce_addr,
            bounce_bytes=msg.bounce_bytes,
            bounce_digest=msg.bounce_digest,
        )
        if s.expected_receivers is None:
            s.expected_receivers = len(peer_ranks(self.topology, peer.info.topology, peer.info.topology.dp_rank))

    def _on_transfer_result(self, source: Source, msg: wire.TransferResult) -> None:
        with self._lock:
            s = self._rx.get(msg.request_id)
            if s is None or msg.ctx_rank not in s.writers:
                return  # late or unknown: nothing to settle
            inst = self._ctx_instances.get(s.ctx_endpoint)
            if inst is None or inst.ranks[msg.ctx_rank].incarnation != msg.ctx_incarnation:
                return  # an old incarnation cannot settle this request
            if s.writers[msg.ctx_rank] is not WriterState.ASKED:
                return  # already settled
            in_doubt = msg.error_kind == "in_doubt"
            if msg.status == "ok":
                s.writers[msg.ctx_rank] = WriterState.OK
                s.nbytes += msg.nbytes
                if msg.bounced and msg.ctx_rank in s.unpack:
                    s.bounced.add(msg.ctx_rank)
                if s.all_ok():
                    if s.bounced:
                        self._work.put(("unpack", s.request_id))  # DONE once the bytes are in place
                    else:
                        s.transition(SessionState.DONE)
            else:
                if not in_doubt:
                    s.writers[msg.ctx_rank] = WriterState.CANCELLED if msg.status == "cancelled" else WriterState.FAILED
                if msg.status == "cancelled":
                    s.transition(
                        SessionState.CANCELLED,
                        E.RequestCancelledError(
                            f"request {msg.request_id} cancelled by context rank {msg.ctx_rank}: {msg.error}"
                        ),
                    )
                else:
                    kind = "TransferTimeoutError" if in_doubt else msg.error_kind
                    state = SessionState.TIMED_OUT if kind == "TransferTimeoutError" else SessionState.FAILED
                    s.transition(
                        state,
                        _error_from(kind, f"context rank {msg.ctx_rank} failed request {msg.request_id}: {msg.error}"),
                    )
            if s.terminal and not s.quiescent:
                self._quarantined.add(s.request_id)

    def _on_cancel(self, source: Source, msg: wire.Cancel) -> None:
        with self._lock:
            if self.role == "context":
                peer = self._gen_peers.get((msg.instance, msg.rank))
                s = self._tx.get(msg.request_id)
                t = s.tasks.get((msg.instance, msg.rank)) if s is not None else None
                if t is None:
                    # Not started here yet: remember it, and confirm that nothing will be written.
                    self._tombstones.setdefault(msg.request_id, time.monotonic())
                    early = self._early.get(msg.request_id, [])
                    early[:] = [(d, r) for d, r in early if (r.gen_instance, r.gen_rank) != (msg.instance, msg.rank)]
                    if not early:
                        self._early.pop(msg.request_id, None)
                    if peer is not None:
                        self._send_result(
                            msg.request_id,
                            peer.info.endpoint,
                            status="cancelled",
                            kind="RequestCancelledError",
                            error=msg.reason,
                        )
                    return
                if t.state in IDLE_TASK_STATES:
                    t.state = "cancelled"
                    self._send_result(
                        msg.request_id, t.endpoint, status="cancelled", kind="RequestCancelledError", error=msg.reason
                    )
                # A submitted write cannot be recalled: its final result follows when the transport finishes.
            else:
                s2 = self._rx.get(msg.request_id)
                if s2 is not None:
                    s2.transition(
                        SessionState.CANCELLED,
                        E.RequestCancelledError(
                            f"request {msg.request_id} cancelled by the context side: {msg.reason}"
                        ),
                    )
        if self.role == "context":
            self._work.put(("tx", msg.request_id))

    def _on_error_reply(self, source: Source, msg: wire.ErrorReply) -> None:
        log.warning("peer %s answered with %s: %s", source.endpoint, msg.kind, msg.error)
        if msg.request_id < 0:
            return
        with self._lock:
            s = self._rx.get(msg.request_id)
            if s is not None:
                s.transition(SessionState.FAILED, _error_from(msg.kind, msg.error))

    def _on_disconnect(self, endpoint: str) -> None:
        """A peer's control connection dropped: fail what waits on it; fence writers whose process is gone."""
        with self._lock:
            if self.role == "generation":
                for inst in self._ctx_instances.values():
                    for info in inst.ranks:
                        if info.endpoint != endpoint:
                            continue
                        dead = info.hostname == socket.gethostname() and not _pid_alive(info.pid)
                        for s in self._rx.values():
                            if s.ctx_endpoint != inst.endpoint or info.rank not in s.writers:
                                continue
                            if s.writers[info.rank] is WriterState.ASKED:
                                if dead:
                                    s.writers[info.rank] = WriterState.FENCED
                                s.transition(
                                    SessionState.FAILED,
                                    E.PeerLostError(
                                        f"context rank {info.rank} at {endpoint} was lost during request {s.request_id}"
                                        + ("" if dead else "; its pages stay quarantined until it is confirmed dead")
                                    ),
                                )
                                if not s.quiescent:
                                    self._quarantined.add(s.request_id)
            else:
                for key, peer in self._gen_peers.items():
                    if peer.info.endpoint == endpoint:
                        peer.lost = True
                        for tx in self._tx.values():
                            t = tx.tasks.get(key)
                            if t is not None and t.state in IDLE_TASK_STATES:
                                t.state = "failed"
                                tx.transition(
                                    SessionState.FAILED,
                                    E.PeerLostError(f"generation rank {key} at {endpoint} was lost"),
                                )
                self._work.put(("tx_all", None))

    # --- worker thread ---------------------------------------------------------------------------

    def _work_loop(self) -> None:
        last_reap = 0.0
        while not self._stop.is_set():
            busy = self._has_inflight()
            try:
                item = self._work.get(timeout=0.0005 if busy else 0.02)
            except queue.Empty:
                item = None
            try:
                while item is not None:
                    self._handle_work(item)
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        item = None
                self._poll_transfers()
                self.agent.progress()
                now = time.monotonic()
                if now - last_reap > 0.02:
                    last_reap = now
                    self._reap(now)
            except Exception:
                log.exception("transceiver worker: unexpected error")

    def _has_inflight(self) -> bool:
        with self._lock:
            return bool(self._inflight)

    def _handle_work(self, item: tuple[str, Any]) -> None:
        kind, arg = item
        if kind == "tx":
            self._drive_tx(arg)
        elif kind == "tx_all":
            with self._lock:
                rids = list(self._tx)
            for rid in rids:
                self._drive_tx(rid)
        elif kind == "load_gen":
            self._load_gen(arg)
        elif kind == "load_ctx":
            self._load_ctx(arg)
        elif kind == "ask":
            self._ask(arg)
        elif kind == "unpack":
            self._unpack(arg)

    def _load_gen(self, key: tuple[str, int]) -> None:
        with self._lock:
            peer = self._gen_peers.get(key)
        if peer is None:
            return
        try:
            name = self.agent.load_remote_agent(peer.info.agent_descriptor)
        except E.KvcoreError as exc:
            with self._lock:
                self._refused[key] = exc
                self._gen_peers.pop(key, None)
            self.messenger.send(
                peer.info.endpoint,
                wire.RegisterResult(
                    v=wire.PROTOCOL_VERSION,
                    ctx_rank=self.topology.rank,
                    ok=False,
                    error_kind=type(exc).__name__,
                    error=str(exc),
                ),
            )
            return
        with self._lock:
            peer.agent_name = name
            rids = [rid for rid, s in self._tx.items() if key in s.tasks]
        for rid in rids:
            self._drive_tx(rid)

    def _load_ctx(self, endpoint: str) -> None:
        """Register this generation rank with every context rank it exchanges with, then ask for pending requests."""
        with self._lock:
            inst = self._ctx_instances[endpoint]
            peers = list(inst.peers)
            ranks = inst.ranks
        try:
            for r in peers:
                self.agent.load_remote_agent(ranks[r].agent_descriptor)
        except E.KvcoreError as exc:
            with self._lock:
                inst.state, inst.error = "refused", exc
                for s in self._rx.values():
                    if s.ctx_endpoint == endpoint:
                        s.transition(SessionState.FAILED, exc)
            return
        for r in peers:
            self.messenger.send(ranks[r].endpoint, wire.RegisterRankInfo(v=wire.PROTOCOL_VERSION, info=self.rank_info))
        with self._lock:
            for s in self._rx.values():
                if s.ctx_endpoint == endpoint and s.state is SessionState.INIT:
                    self._request_data(s, inst)

    def _request_data(self, s: RxSession, inst: _CtxInstance) -> None:
        """Ask every overlapping context rank for this request (caller holds the lock)."""
        try:
            writers = peer_ranks(self.topology, inst.ranks[0].topology, s.ctx_dp_rank)
        except E.KvcoreError as exc:
            s.transition(SessionState.FAILED, exc)
            return
        for r in writers:
            s.writers[r] = WriterState.ASKED
        s.transition(SessionState.TRANSFERRING)
        if self._arena is not None and self._may_bounce(inst, writers, len(s.block_ids)):
            self._work.put(("ask", s.request_id))  # plans are computed off the caller's thread
        else:
            self._send_requests(s, inst, {})

    def _may_bounce(self, inst: _CtxInstance, writers: list[int], nblocks: int) -> bool:
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

    def _ask(self, rid: int) -> None:
        """Worker: decide per writer whether its fragments go through a bounce lease, then ask."""
        with self._lock:
            s = self._rx.get(rid)
            if s is None or s.terminal:
                return
            inst = self._ctx_instances[s.ctx_endpoint]
            writers = list(s.writers)
        bounce_args: dict[int, tuple[int, int, bytes]] = {}
        tpb = self.geometry.tokens_per_block
        n_src = -(-s.prompt_len // tpb) if s.prompt_len >= 0 else len(s.block_ids)
        for r in writers:
            try:
                # The destination side of the unmerged plan does not depend on the source's block ids,
                # only on how many there are: the context rank computes the same order with its real ids.
                plan = plan_transfer(
                    inst.ranks[r].layout,
                    self.layout,
                    np.zeros(n_src, np.int64),
                    s.block_ids,
                    mappers=self._mappers,
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
            assert self._arena is not None
            off = self._arena.lease(plan.nbytes)
            if off is None:
                log.debug("request %d: bounce arena full, context rank %d writes fragments directly", rid, r)
                continue
            with self._lock:
                s.leases[r] = off
                s.unpack[r] = (plan.dst, plan.sizes)
            bounce_args[r] = (self._arena.address + off, plan.nbytes, bounce.plan_digest(plan.dst, plan.sizes))
        with self._lock:
            if not s.terminal:
                self._send_requests(s, inst, bounce_args)

    def _unpack(self, rid: int) -> None:
        """Worker: scatter every bounced writer's lease into the pools, then the request is DONE."""
        with self._lock:
            s = self._rx.get(rid)
            if s is None or s.terminal:
                return
            work = [(self._arena.address + s.leases[r], *s.unpack[r]) for r in sorted(s.bounced)]  # type: ignore[union-attr]
        try:
            for addr, dst, sizes in work:
                bounce.scatter(addr, dst, sizes)
                self._bounced_writes_total += 1
        except Exception as exc:  # pragma: no cover - addresses were validated when planned
            with self._lock:
                s.transition(SessionState.FAILED, E.TransferFailedError(f"request {rid}: bounce scatter failed: {exc}"))
            return
        with self._lock:
            s.transition(SessionState.DONE)

    def _send_requests(self, s: RxSession, inst: _CtxInstance, bounce_args: dict[int, tuple[int, int, bytes]]) -> None:
        remaining_ms = max(1, int((s.deadline - time.monotonic()) * 1000))
        for r in s.writers:
            addr, nbytes, digest = bounce_args.get(r, (0, 0, b""))
            self.messenger.send(
                inst.ranks[r].endpoint,
                wire.RequestData(
                    v=wire.PROTOCOL_VERSION,
                    request_id=s.request_id,
                    gen_instance=self.instance_name,
                    gen_rank=self.topology.rank,
                    gen_incarnation=self.incarnation,
                    block_ids=s.block_ids.astype("<i8").tobytes(),
                    state_slot=s.state_slot,
                    prompt_len=s.prompt_len,
                    timeout_ms=remaining_ms,
                    bounce_addr=addr,
                    bounce_bytes=nbytes,
                    bounce_digest=digest,
                ),
            )

    def _drive_tx(self, rid: int) -> None:
        """Submit every ready receiver task of a send session; settle the session when all are terminal."""
        with self._lock:
            s = self._tx.get(rid)
            if s is None:
                return
            todo = []
            for t in s.tasks.values():
                if t.state not in IDLE_TASK_STATES:
                    continue
                if s.terminal:
                    t.state = "cancelled" if s.state is SessionState.CANCELLED else "failed"
                    self._send_result(
                        rid,
                        t.endpoint,
                        status="cancelled" if t.state == "cancelled" else "failed",
                        kind=type(s.error).__name__ if s.error else "SessionError",
                        error=str(s.error or "request ended"),
                    )
                    continue
                peer = self._gen_peers.get(t.gen_key)
                if peer is None or peer.agent_name is None:
                    continue  # descriptor still loading
                if self._next_slice(s, t) is False:
                    continue  # layer-wise: nothing new is ready for this receiver
                todo.append((t, peer))
            if todo and s.state in (SessionState.INIT, SessionState.READY):
                s.transition(SessionState.TRANSFERRING)
        for t, peer in todo:
            self._submit(s, t, peer)
        self._settle_tx(s)

    def _next_slice(self, s: TxSession, t: ReceiverTask) -> tuple[int, int] | bool | None:
        """The global layer range to write next: None for the whole request, False when nothing is ready."""
        start, stop = self.topology.layer_range
        lo = max(t.sent_upto, start)
        hi = stop if s.layers_upto is None else s.layers_upto
        if t.sent_upto < 0 and s.layers_upto is None:
            return None  # everything at once: the common, fastest case
        return (lo, hi) if hi > lo else False

    def _slice_done(self, s: TxSession, t: ReceiverTask) -> None:
        """A slice landed (or was empty): report the task, or wait for more layers (caller holds the lock)."""
        t.total_bytes += t.nbytes
        t.total_fragments += t.fragments
        if t.sent_upto >= self.topology.layer_range[1]:
            t.state = "done"
            s.nbytes += t.total_bytes
            self._send_result(
                s.request_id,
                t.endpoint,
                status="ok",
                nbytes=t.total_bytes,
                fragments=t.total_fragments,
                bounced=t.bounced,
            )
        else:
            t.state = "partial"
            self._work.put(("tx", s.request_id))  # more layers may be ready already

    def _submit(self, s: TxSession, t: ReceiverTask, peer: _GenPeer) -> None:
        layers = self._next_slice(s, t)
        if layers is False:
            return
        if layers is None and t.bounce_addr and self._bounce_on and self._submit_bounced(s, t, peer):
            return
        try:
            plan = plan_transfer(
                self.layout,
                peer.info.layout,
                s.block_ids,
                t.block_ids,
                mappers=self._mappers,
                src_state_slot=s.state_slot if s.state_slot >= 0 else None,
                dst_state_slot=t.state_slot if t.state_slot >= 0 else None,
                prompt_len=s.prompt_len if s.prompt_len >= 0 else None,
                layer_range=layers if isinstance(layers, tuple) else None,
            )
            t.sent_upto = self.topology.layer_range[1] if layers is None else layers[1]  # type: ignore[index]
            if plan.count == 0:
                with self._lock:
                    t.nbytes = t.fragments = 0
                    self._slice_done(s, t)
                return
            assert peer.agent_name is not None  # only loaded peers reach _submit
            handle = self.agent.submit(TransferOp.WRITE, peer.agent_name, plan.src, plan.dst, plan.sizes)
        except E.KvcoreError as exc:
            log.warning("request %d to %s: %s", s.request_id, t.gen_key, exc)
            with self._lock:
                t.state = "failed"
                s.transition(SessionState.FAILED, exc)
            self._send_result(s.request_id, t.endpoint, status="failed", kind=type(exc).__name__, error=str(exc))
            return
        with self._lock:
            t.handle, t.state, t.nbytes, t.fragments = handle, "submitted", plan.nbytes, plan.count
            self._inflight[id(t)] = (s, t)
            t.deadline = min(t.deadline, time.monotonic() + self.config.transfer_timeout_s)
        self._check_transfer(s, t, time.monotonic())  # same-host transports are often done already

    def _submit_bounced(self, s: TxSession, t: ReceiverTask, peer: _GenPeer) -> bool:
        """Gather the unmerged plan into staging and write it with one fragment; False: use the direct path."""
        try:
            plan = plan_transfer(
                self.layout,
                peer.info.layout,
                s.block_ids,
                t.block_ids,
                mappers=self._mappers,
                src_state_slot=s.state_slot if s.state_slot >= 0 else None,
                dst_state_slot=t.state_slot if t.state_slot >= 0 else None,
                prompt_len=s.prompt_len if s.prompt_len >= 0 else None,
                merge=False,
            )
        except E.KvcoreError:
            return False  # the direct path reports the error
        if plan.nbytes != t.bounce_bytes or bounce.plan_digest(plan.dst, plan.sizes) != t.bounce_digest:
            log.warning(
                "request %d: receiver's bounce plan differs from ours; writing fragments directly", s.request_id
            )
            return False
        if self._staging is None:
            self._staging = self._new_arena()
        off = self._staging.lease(plan.nbytes)
        if off is None:
            return False
        staging = self._staging.address + off
        try:
            bounce.gather(plan.src, plan.sizes, staging)
            assert peer.agent_name is not None
            handle = self.agent.submit(
                TransferOp.WRITE,
                peer.agent_name,
                np.array([staging], np.uint64),
                np.array([t.bounce_addr], np.uint64),
                np.array([plan.nbytes], np.uint64),
            )
        except E.KvcoreError as exc:
            self._staging.release(off)
            with self._lock:
                t.state = "failed"
                s.transition(SessionState.FAILED, exc)
            self._send_result(s.request_id, t.endpoint, status="failed", kind=type(exc).__name__, error=str(exc))
            return True
        with self._lock:
            t.handle, t.state, t.nbytes, t.fragments = handle, "submitted", plan.nbytes, plan.count
            self._inflight[id(t)] = (s, t)
            t.staging, t.bounced = off, True
            t.sent_upto = self.topology.layer_range[1]
            self._bounced_writes_total += 1
            t.deadline = min(t.deadline, time.monotonic() + self.config.transfer_timeout_s)
        self._check_transfer(s, t, time.monotonic())
        return True

    def _poll_transfers(self) -> None:
        with self._lock:
            inflight = list(self._inflight.values())
        now = time.monotonic()
        for s, t in inflight:
            self._check_transfer(s, t, now)

    def _check_transfer(self, s: TxSession, t: ReceiverTask, now: float) -> None:
        """Poll one submitted write; report it to the receiver as soon as the transport says it is terminal."""
        status = self.agent.poll(t.handle)
        if status is TransferStatus.PENDING:
            if now > t.deadline and not t.doubt_sent:
                # Logical timeout; the write may still land, so the receiver keeps its pages quarantined.
                t.doubt_sent = True
                with self._lock:
                    s.transition(
                        SessionState.TIMED_OUT,
                        E.TransferTimeoutError(
                            f"request {s.request_id}: transfer to {t.gen_key} still pending at its deadline"
                        ),
                    )
                self._send_result(
                    s.request_id,
                    t.endpoint,
                    status="failed",
                    kind="in_doubt",
                    error="transfer still in flight at its deadline",
                )
            return
        err = t.handle.error
        self.agent.release(t.handle)
        with self._lock:
            self._inflight.pop(id(t), None)
        if t.staging is not None and self._staging is not None:
            self._staging.release(t.staging)  # the transport no longer reads it
            t.staging = None
        with self._lock:
            t.handle = None
            if status is TransferStatus.DONE:
                self._slice_done(s, t)
            else:
                t.state = "failed"
                s.transition(SessionState.FAILED, err)
        if status is not TransferStatus.DONE:
            self._send_result(s.request_id, t.endpoint, status="failed", kind=type(err).__name__, error=str(err))
        self._settle_tx(s)

    def _settle_tx(self, s: TxSession) -> None:
        with self._lock:
            if s.terminal or s.expected_receivers is None:
                return
            if len(s.tasks) < s.expected_receivers:
                return
            states = {t.state for t in s.tasks.values()}
            if states <= {"done"}:
                s.transition(SessionState.DONE)
            elif not states & (IDLE_TASK_STATES | {"submitted"}):
                if "failed" in states:
                    s.transition(SessionState.FAILED, E.TransferFailedError(f"request {s.request_id}: a write failed"))
                else:
                    s.transition(
                        SessionState.CANCELLED,
                        E.RequestCancelledError(f"request {s.request_id} was cancelled by its receivers"),
                    )

    def _send_result(
        self,
        rid: int,
        endpoint: str | None,
        *,
        status: str,
        kind: str = "",
        error: str = "",
        nbytes: int = 0,
        fragments: int = 0,
        source: Source | None = None,
        bounced: bool = False,
    ) -> None:
        msg = wire.TransferResult(
            v=wire.PROTOCOL_VERSION,
            request_id=rid,
            ctx_rank=self.topology.rank,
            ctx_incarnation=self.incarnation,
            status=status,  # type: ignore[arg-type]
            nbytes=nbytes,
            fragments=fragments,
            error_kind=kind,
            error=error,
            bounced=bounced,
        )
        try:
            if endpoint is not None:
                self.messenger.send(endpoint, msg)
            elif source is not None:
                self.messenger.reply(source, msg)
        except E.KvcoreError as exc:
            log.warning("could not report request %d: %s", rid, exc)

    def _reap(self, now: float) -> None:
        """Deadlines and garbage, on a timer: nothing waits for new traffic to be cleaned up."""
        with self._lock:
            for s in self._rx.values():
                if not s.terminal and now > s.deadline:
                    s.transition(
                        SessionState.TIMED_OUT,
                        E.TransferTimeoutError(
                            f"request {s.request_id} not complete after {self.config.request_timeout_s}s "
                            f"(writers: {', '.join(f'{r}={w.value}' for r, w in s.writers.items()) or 'none contacted'})"
                        ),
                    )
                if s.terminal and not s.quiescent:
                    for r, w in s.writers.items():
                        if w is WriterState.ASKED:
                            inst = self._ctx_instances.get(s.ctx_endpoint)
                            info = inst.ranks[r] if inst and inst.ranks else None
                            if info is not None and info.hostname == socket.gethostname() and not _pid_alive(info.pid):
                                s.writers[r] = WriterState.FENCED
                    if not s.quiescent:
                        self._quarantined.add(s.request_id)
            for tx in self._tx.values():
                if not tx.terminal and now > tx.deadline:
                    tx.transition(
                        SessionState.TIMED_OUT,
                        E.TransferTimeoutError(
                            f"request {tx.request_id}: receivers did not all ask within {self.config.request_timeout_s}s"
                        ),
                    )
                    for t in tx.tasks.values():
                        if t.state in IDLE_TASK_STATES:
                            t.state = "failed"
                            self._send_result(
                                tx.request_id,
                                t.endpoint,
                                status="failed",
                                kind="TransferTimeoutError",
                                error="context side timed out before writing",
                            )
            ttl = self.config.request_timeout_s
            for rid in [r for r, lst in self._early.items() if lst and now > min(t for t, _ in lst)]:
                for _, req in self._early.pop(rid):
                    peer = self._gen_peers.get((req.gen_instance, req.gen_rank))
                    if peer is not None:
                        self._send_result(
                            rid,
                            peer.info.endpoint,
                            status="failed",
                            kind="TransferTimeoutError",
                            error=f"context side never started sending request {rid}",
                        )
            for rid in [r for r, t0 in self._tombstones.items() if now - t0 > ttl]:
                del self._tombstones[rid]
