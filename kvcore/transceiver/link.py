"""What both roles share: the control-plane messenger, the transfer agent, the worker thread and this rank's identity.

Threads: the engine's thread calls the facade; the messenger's I/O thread
decodes control messages and runs the role's handler for that message type
(handlers only mutate state and post work); one worker thread owns the
transfer agent (submits, polls, progresses, loads peers) and runs the role's
timers. All shared state is guarded by ``link.lock``; nothing blocks while
holding it except short agent calls on the worker.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from kvcore import errors as E
from kvcore import hostinfo
from kvcore.config import TransceiverConfig
from kvcore.control import wire
from kvcore.control.auth import keys_equal
from kvcore.control.collective import Collective, LocalCollective
from kvcore.control.messenger import Messenger, Source
from kvcore.layout.mapping import RankLayout
from kvcore.layout.page import PageTable
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology
from kvcore.metrics import TransceiverMetrics
from kvcore.transport import bounce
from kvcore.transport.agent import MemoryKind, MemoryRegion, TransferAgent, process_incarnation

if TYPE_CHECKING:
    from kvcore.extension.registry import LayoutMapperRegistry

__all__ = ["Link", "Handler", "error_from"]

log = logging.getLogger("kvcore.transceiver")

Handler = Callable[[Source, Any], None]


def error_from(kind: str, message: str) -> E.KvcoreError:
    """Rebuild a peer-reported error as the kvcore class it names (never anything else), or TransferFailedError."""
    cls = getattr(E, kind, None) if kind in E.__all__ else None
    if isinstance(cls, type) and issubclass(cls, E.KvcoreError):
        return cls(message)
    return E.TransferFailedError(f"{kind}: {message}" if kind else message)


class Link:
    """One rank's messenger, agent, worker and identity; the roles plug their handlers and timers in."""

    def __init__(
        self,
        config: TransceiverConfig,
        *,
        role: str,
        agent: TransferAgent,
        topology: Topology,
        geometry: AttentionGeometry,
        page_table: PageTable,
        mamba: MambaGeometry | None,
        collective: Collective | None,
        instance_name: str | None,
        mappers: LayoutMapperRegistry,
        device: str,
    ) -> None:
        self.config = config
        self.role = role
        self.agent = agent
        self.topology = topology
        self.geometry = geometry
        self.page_table = page_table
        self.mamba = mamba
        self.collective = collective or LocalCollective()
        self.mappers = mappers
        self.lock = threading.RLock()
        self.incarnation = process_incarnation()
        self.counters: Counter[str] = Counter()
        self._work: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue()
        self._stop = threading.Event()
        self._handlers: dict[type, Handler] = {}
        self._tick: Callable[[float], None] = lambda now: None
        self._busy: Callable[[], bool] = lambda: False
        self.on_disconnect: Callable[[str], None] = lambda endpoint: None
        self.on_connect: Callable[[str], None] = lambda endpoint: None
        self.on_bad_frame: Callable[[Source, E.KvcoreError], None] = lambda source, exc: None
        self.on_auth_failed: Callable[[str, str], None] = lambda endpoint, why: None
        # Memory: the pools where the engine put them (``device``: "cpu", "cuda" or "cuda:N").
        kind, dev_id = MemoryKind.DRAM, 0
        if device.startswith("cuda"):
            kind, dev_id = MemoryKind.VRAM, int(device.partition(":")[2] or 0)
        elif device != "cpu":
            raise E.ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        self.memory_kind = kind
        self.registrations = [
            agent.register_memory(MemoryRegion(addr, length, kind, dev_id)) for addr, length in page_table.regions()
        ]
        self._bounce_tensors: list[Any] = []
        # The receiver's bounce arena is registered before the descriptor is taken, so that peers may write it.
        self.bounce_on = config.bounce_enabled and kind is MemoryKind.DRAM
        self.arena = self.new_arena() if self.bounce_on and role == "generation" else None
        from kvcore.control.auth import AuthConfig

        self.auth = AuthConfig.from_config(config)
        self.messenger = Messenger(
            self._on_message,
            host=config.host,
            port=config.control_port(self.collective.rank),
            advertise_host=config.advertise_host or None,
            max_message_bytes=config.max_message_bytes,
            on_disconnect=lambda ep: self.on_disconnect(ep),
            on_connect=lambda ep: self.on_connect(ep),
            on_error=lambda source, exc: self.on_bad_frame(source, exc),
            on_auth_failed=lambda ep, why: self.on_auth_failed(ep, why),
            name=f"{role}{topology.rank}",
            auth=self.auth,
            allow_insecure_bind=config.allow_insecure_bind,
        )
        # Agree on the instance name and gather every rank's info (rank 0 serves it to peers).
        name = instance_name or f"{role}-{uuid.uuid4().hex[:8]}"
        self.instance_name = self.collective.allgather(name.encode())[0].decode()
        self.rank_info = wire.RankInfo(
            instance_name=self.instance_name,
            rank=topology.rank,
            incarnation=self.incarnation,
            protocol_version=wire.PROTOCOL_VERSION,
            backend=agent.backend,
            endpoint=self.messenger.endpoint,
            topology=topology,
            geometry=geometry,
            page_table=page_table,
            agent_descriptor=agent.descriptor(),
            pid=os.getpid(),
            hostname=hostinfo.hostname(),
            host_id=hostinfo.host_identity(),
            start_time=hostinfo.process_start_time(os.getpid()) or 0,
            mamba=mamba,
            curve_public_key=self.auth.public_key_raw if self.auth is not None else b"",
        )
        dec = msgspec.msgpack.Decoder(wire.RankInfo)
        gathered = self.collective.allgather(msgspec.msgpack.encode(self.rank_info))
        self.instance_ranks = sorted((dec.decode(b) for b in gathered), key=lambda r: r.rank)
        self.layout = RankLayout(topology=topology, geometry=geometry, page_table=page_table, mamba=mamba)
        self.metrics = TransceiverMetrics(
            backend=agent.backend, role=role, rank=topology.rank, instance=self.instance_name
        )
        self._worker = threading.Thread(target=self._work_loop, name=f"{role}{topology.rank}-worker", daemon=True)

    # --- wiring ------------------------------------------------------------------------------

    def plug(self, handlers: dict[type, Handler], tick: Callable[[float], None], busy: Callable[[], bool]) -> None:
        """Install the role: one handler per message type it accepts, its timer, its busy test."""
        self._handlers = dict(handlers)
        self._tick, self._busy = tick, busy

    def start(self) -> None:
        self.messenger.start()
        self._worker.start()

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker thread (the only thread that drives the agent)."""
        self._work.put((fn, args))

    # --- messages ----------------------------------------------------------------------------

    def _on_message(self, source: Source, msg: wire.Message) -> None:
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(source, msg)
            return
        self.counters["unexpected_messages"] += 1
        if isinstance(msg, wire.ErrorReply):
            log.warning("peer %s answered with %s: %s", source.endpoint or "?", msg.kind, msg.error)
            return
        try:
            self.messenger.reply(
                source,
                wire.ErrorReply(
                    v=wire.PROTOCOL_VERSION,
                    kind="ProtocolError",
                    error=f"{type(msg).__name__} is not accepted by a {self.role} rank",
                ),
            )
        except E.KvcoreError:
            pass

    def send(self, endpoint: str, msg: wire.Message) -> None:
        """Send, logging instead of raising: a peer that cannot be reached is handled by its lifecycle."""
        try:
            self.messenger.send(endpoint, msg)
        except E.KvcoreError as exc:
            log.warning("could not send %s to %s: %s", type(msg).__name__, endpoint, exc)

    def learn_key(self, info: wire.RankInfo, proven: bytes | None = None) -> None:
        """Expect ``info``'s CURVE key from its endpoint.

        Trusted when it came over an authenticated link from a third party (rank 0 speaking for its instance), or
        when the peer proved exactly that key in its handshake (``proven``: ``Source.peer_key``).
        """
        if proven is not None and not keys_equal(proven, info.curve_public_key):
            log.warning("peer %s/%d claims a CURVE key it did not prove: ignored", info.instance_name, info.rank)
            return
        if self.auth is not None and info.curve_public_key:
            try:
                self.messenger.set_peer_key(info.endpoint, info.curve_public_key)
            except E.KvcoreError as exc:
                log.warning("peer %s/%d: unusable CURVE key: %s", info.instance_name, info.rank, exc)

    def reply(self, source: Source, msg: wire.Message) -> None:
        try:
            self.messenger.reply(source, msg)
        except E.KvcoreError as exc:
            log.warning("could not answer %s: %s", source.endpoint or "a peer", exc)

    # --- worker ------------------------------------------------------------------------------

    def _work_loop(self) -> None:
        last_tick = 0.0
        while not self._stop.is_set():
            try:
                item = self._work.get(timeout=0.0005 if self._busy() else 0.02)
            except queue.Empty:
                item = None
            try:
                while item is not None:
                    fn, args = item
                    fn(*args)
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        item = None
                if self._stop.is_set():
                    return
                self.agent.progress()
                now = time.monotonic()
                busy = self._busy()
                if busy or now - last_tick > 0.02:
                    last_tick = now
                    self._tick(now)
            except Exception:
                self.counters["worker_errors"] += 1
                log.exception("transceiver worker: unexpected error")

    def unload_agent(self, name: str, incarnation: str) -> None:
        """Unload a peer's agent if the one loaded under ``name`` is still that incarnation (worker thread)."""
        if name not in self.agent.remote_agents:
            return
        try:
            if self.agent.remote(name).incarnation != incarnation:
                return  # a newer incarnation took the name over
            self.agent.unload_remote_agent(name)
        except E.KvcoreError as exc:
            log.warning("could not unload peer agent %s: %s", name, exc)

    def new_arena(self) -> bounce.Arena:
        import torch

        t = self.agent.allocate_tensor((self.config.bounce_buffer_bytes,), torch.uint8)
        self._bounce_tensors.append(t)
        self.registrations.append(self.agent.register_memory(t))
        return bounce.Arena(t.data_ptr(), t.numel())

    def close(self, timeout: float) -> None:
        self._stop.set()
        self._work.put(None)
        self._worker.join(timeout)
        self.messenger.close(timeout)

    def deregister(self) -> None:
        for reg in self.registrations:
            try:
                self.agent.deregister_memory(reg)
            except E.TransferError:
                pass
        self.registrations.clear()

    @staticmethod
    def agent_name(info: wire.RankInfo) -> str:
        return TransferAgent.decode_descriptor(info.agent_descriptor).name
