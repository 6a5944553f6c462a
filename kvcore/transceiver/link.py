"""What both roles share: the control-plane messenger, the transfer agent, the worker thread and this rank's identity.

Threads: the engine's thread calls the facade; one thread per rank, the
messenger's I/O thread, does everything else. It decodes control messages and
runs the role's handler for that message type, and it is also the *worker*:
once per loop turn (``Messenger.set_driver``) it runs the work handlers and the
engine posted, drives the transfer agent (submits, polls, progresses, loads
peers) and runs the role's timers, then writes what they sent to the sockets.
So the thread that reads a request also plans, posts and answers it, with no
queue and no wake-up between them. Engine threads (``start_send``,
``start_receive``, ``cancel``...) and an agent's completion listener post work
and wake the loop. All shared state is guarded by ``link.lock``; nothing blocks
while holding it except short agent calls on the worker.

Data plane: a role moves a plan with ``submit_transfer`` and learns the end
through the returned ``Transfer``; how a plan is cut into chunks and advanced
lives in :mod:`kvcore.transceiver.dataplane` (``Link.data``).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvcore import errors as E
from kvcore import hostinfo
from kvcore.config import TransceiverConfig
from kvcore.control import wire
from kvcore.control.auth import keys_equal
from kvcore.control.collective import Collective, LocalCollective
from kvcore.control.messenger import Messenger, Source
from kvcore.layout.mapping import RankPlacement
from kvcore.layout.page import PageTable
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology
from kvcore.metrics import TransceiverMetrics
from kvcore.params import RoleName, api_id, derive_ticket
from kvcore.transceiver.counters import RoleCounter
from kvcore.transceiver.dataplane import (
    BUSY_WINDOW_S,
    CHUNK_BYTES,
    FINE_CHUNK_BYTES,
    MAX_QUIET_CHUNKS,
    PUMP_BUDGET_S,
    QUIET_PIECE_S,
    DataPlane,
    Transfer,
    chunk_plan,
)
from kvcore.transport import bounce
from kvcore.transport.agent import (
    MemoryKind,
    MemoryRegion,
    TransferAgent,
    TransferOp,
    TransferStatus,
    process_incarnation,
)
from kvcore.transport.devices import pool_memory

if TYPE_CHECKING:
    from kvcore.extension.registry import LayoutMapperRegistry

__all__ = [
    "RoleCounter",
    "Link",
    "Handler",
    "Transfer",
    "error_from",
    "CHUNK_BYTES",
    "QUIET_PIECE_S",
    "FINE_CHUNK_BYTES",
    "MAX_QUIET_CHUNKS",
    "BUSY_WINDOW_S",
    "PUMP_BUDGET_S",
    "chunk_plan",
]


log = logging.getLogger("kvcore.transceiver")

Handler = Callable[[Source, Any], None]

#: Work items the worker runs per I/O-loop turn before it serves the sockets again.
_MAX_WORK_PER_TURN = 4096


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
        role: RoleName,
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
        # Engine threads blocked in ``Transceiver.wait`` sleep on ``news``; the worker wakes them after a turn that
        # read a message, ran work or queued a send (anything that can end or settle a session), and at its tick.
        self.news = threading.Condition(self.lock)
        self.waiters = 0  # under ``lock``: threads inside ``Transceiver.wait``
        self._stirred = False  # worker only: this turn dispatched a message
        self._news_due = False  # worker only: wake the waiters once this turn's messages are written
        self._last_news = 0.0
        self.incarnation = process_incarnation()
        self.counters: Counter[RoleCounter] = Counter()
        # Work for the worker (the messenger's I/O thread); appended by any thread, taken by the worker alone.
        self._work: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._stop = threading.Event()
        self._handlers: dict[type, Handler] = {}
        self._tick: Callable[[float], None] = lambda now: None
        self._busy: Callable[[], bool] = lambda: False
        self.on_disconnect: Callable[[str], None] = lambda endpoint: None
        self.on_connect: Callable[[str], None] = lambda endpoint: None
        self.on_bad_frame: Callable[[Source, E.KvcoreError], None] = lambda source, exc: None
        self.on_auth_failed: Callable[[str, str], None] = lambda endpoint, why: None
        # Memory: the pools where the engine put them (``device``: "cpu", "cuda" or "cuda:N"), checked against
        # torch's CUDA allocator where it holds them.
        kind, dev_id = pool_memory(device, page_table.regions())
        self.memory_kind = kind
        self.registrations = [
            agent.register_memory(MemoryRegion(addr, length, kind, dev_id)) for addr, length in page_table.regions()
        ]
        if role == "context" and config.transfer_mode == "pull":
            try:
                self.require_offered("transfer_mode='pull': the generation side READs this context rank's KV pools")
            except E.RegistrationError:
                for reg in self.registrations:
                    agent.deregister_memory(reg)
                raise
        self._bounce_tensors: list[Any] = []
        # The receiver's bounce arena is registered before the descriptor is taken, so that peers may write it.
        self.bounce_on = config.bounce_enabled and kind is MemoryKind.DRAM
        self.arena = self.new_arena() if self.bounce_on and role == "generation" else None
        from kvcore.control.auth import AuthConfig

        self.auth = AuthConfig.from_config(config)
        if self.auth is None:
            why = "auth_mode='none'" if config.auth_mode == "none" else f"host {config.host!r}, allow_insecure_bind"
            log.warning(
                "kvcore %s rank %d runs WITHOUT authentication (%s): any process that can reach its control port, "
                "another local user's included, can register with it (docs/security.md)",
                role,
                topology.rank,
                why,
            )
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
        # Agree on the instance name and on rank 0's ticket secret (it never leaves the instance: tickets of
        # requests started without one are derived from it, the same on every rank), then gather every rank's
        # info (rank 0 serves it to peers).
        name = instance_name or f"{role}-{uuid.uuid4().hex[:8]}"
        agreed = self.collective.allgather(msgspec.msgpack.encode((name, os.urandom(32))))[0]
        name0, self._ticket_secret = msgspec.msgpack.decode(agreed, type=tuple[str, bytes])
        self.instance_name = name0
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
        #: What rank 0 tells anyone who asks (InstanceInfo): no descriptor, pid, start time or host id. Each rank
        #: gives its own only to a generation rank it accepted (``accepted_info``).
        self.public_ranks = [
            msgspec.structs.replace(r, agent_descriptor=b"", pid=0, start_time=0, host_id="")
            for r in self.instance_ranks
        ]
        #: This rank's info for a generation rank it accepted: its agent descriptor identity-only, no memory keys.
        self.accepted_info = msgspec.structs.replace(self.rank_info, agent_descriptor=agent.descriptor(exposed=False))
        self.placement = RankPlacement(topology=topology, geometry=geometry, page_table=page_table, mamba=mamba)
        #: Layer groups of this rank's sliding-window views (their block counts may differ between the sides).
        self.windowed_groups = frozenset(v.group for v in page_table.views if v.window is not None)
        self.metrics = TransceiverMetrics(
            backend=agent.backend, role=role, rank=topology.rank, instance=self.instance_name
        )
        self._last_tick = 0.0
        self.messenger.set_driver(self._turn)
        self.messenger.set_turn_end(self._turn_end)
        #: The data plane (worker thread only): the transfers in flight through the agent, chunk by chunk.
        self.data = DataPlane(
            agent, self.counters, lambda: bool(self._work) or self._stop.is_set() or self.messenger.has_input()
        )
        self._chunk_ready = False  # the last pump posted a chunk: the loop does not sleep before the next
        if agent.capabilities.async_submit:
            agent.set_completion_listener(self._agent_event)
        #: The native lane (``config.native_lane``, opened by the transceiver once this link stands): common push
        #: requests in C; None: every request in Python. A ``kvcore.transceiver.native.NativeLane`` (typed ``Any``
        #: here: that module builds on this one).
        self.native: Any = None

    def request_ticket(self, request_id: Any) -> bytes:
        """The ticket of a request whose engine chose none: the same on every rank of this instance, by construction.

        Derived (``kvcore.params.derive_ticket``: keyed BLAKE2b, 16 bytes) from a 32-byte secret rank 0 drew
        from the OS at construction and shared over the instance's own collective only; it is never sent to a
        peer. So every rank that is told to send request ``r`` agrees on its ticket without the engine
        forwarding anything between its ranks, while anyone outside the instance still cannot compute it: they
        learn it only from the request's parameters. A new incarnation draws a new secret. Within one
        incarnation a request id always has the same ticket, so an engine that reuses request ids for
        different requests should pass its own ``ticket=`` (or ``params=``).
        """
        return derive_ticket(self._ticket_secret, api_id(request_id))

    # --- wiring ------------------------------------------------------------------------------

    def plug(self, handlers: dict[type, Handler], tick: Callable[[float], None], busy: Callable[[], bool]) -> None:
        """Install the role: one handler per message type it accepts, its timer, its busy test."""
        self._handlers = dict(handlers)
        self._tick, self._busy = tick, busy

    def require_offered(self, why: str) -> None:
        """Raise ``RegistrationError`` unless the agent offers every KV pool region to peers (``why``: who needs it).

        A pool the transport cannot expose (the shm agent's ordinary, non-shared memory) would otherwise fail only
        at the first transfer, with a ``RemoteRangeError`` at the peer that names no cause.
        """
        hidden = [r for r in self.registrations if not self.agent.offers(r)]
        if hidden:
            first = hidden[0].region
            raise E.RegistrationError(
                f"{why}, but {len(hidden)} of {len(self.registrations)} pool regions (the first at "
                f"{first.address:#x}, {first.length} bytes) are memory the {self.agent.backend} agent cannot offer to "
                "peers; allocate the pools with agent.allocate_tensor (e.g. allocate_kv_cache(..., "
                "allocator=agent.allocate_tensor))"
            )

    def start(self) -> None:
        self.messenger.start()

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker (the messenger's I/O thread, the only thread that drives the agent).

        From the worker itself (a handler, a timer, other work) it runs later in the same loop turn, after
        the caller returned; from any other thread it wakes the loop.
        """
        self._work.append((fn, args))
        if not self.messenger.in_io_thread():
            self.messenger.wake()

    # --- messages ----------------------------------------------------------------------------

    def _on_message(self, source: Source, msg: wire.Message) -> None:
        self._stirred = True
        if self.data.chunked:
            self.data.last_other = time.monotonic()  # traffic beside a chunked transfer: the next chunks are fine
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

    def _turn(self) -> float:
        """One worker turn on the I/O thread: queued work, chunks, agent progress, timers; returns the next wait.

        The wait (seconds) bounds how long the messenger's poll waits for traffic: 0 while work or a chunk is
        ready, the fast period while transfers must be polled, else until the next timer.
        """
        if self._stop.is_set():
            return 0.02
        stirred = self._stirred or bool(self._work)
        self._stirred = False
        now = time.monotonic()
        if self._work and self.data.chunked:
            self.data.last_other = now
        try:
            # Bounded per turn: work that keeps posting more (or an engine thread flooding us) cannot keep the
            # sockets unread; the rest runs next turn, without waiting.
            for _ in range(_MAX_WORK_PER_TURN):
                if not self._work:
                    break
                fn, args = self._work.popleft()
                fn(*args)
                if self._stop.is_set():
                    return 0.02
            # Answers this turn's work produced (a small request's result) leave now: before the next chunk's
            # copy holds this thread for a few ms, and before the agent's progress and the timers.
            self.messenger.flush()
            if self.data.chunked:
                self._chunk_ready = self.data.pump()
            else:
                self._chunk_ready = False
            self.agent.progress()
            now = time.monotonic()
            busy = self._polling()
            if busy or now - self._last_tick > 0.02:
                self._last_tick = now
                self._tick(now)
        except Exception:
            self.counters["worker_errors"] += 1
            log.exception("transceiver worker: unexpected error")
            return 0.001  # what was left queued runs next turn; never spin hot on a persistent failure
        finally:
            # Waiters are woken at the end of the messenger's turn, once this turn's answers were written: an
            # engine that closes as soon as a request is released must not cut off its final result.
            self._news_due = bool(self.waiters) and (
                stirred or self.messenger.sending() or now - self._last_news > 0.02
            )
        if self._work or self._chunk_ready:
            return 0.0  # the next chunk waits only for traffic already there
        if self._polling():
            return 0.0005
        return max(0.0, 0.02 - (time.monotonic() - self._last_tick))

    def _turn_end(self) -> None:
        if self._news_due:
            self._news_due = False
            self.notify_news()

    def notify_news(self) -> None:
        """Wake the engine threads blocked in ``Transceiver.wait`` (any thread): they look for news again."""
        with self.lock:
            self._last_news = time.monotonic()
            self.news.notify_all()
        if self.native is not None:
            self.native.poke()  # an engine thread may wait on the lane's completions instead

    def _polling(self) -> bool:
        """Whether the worker must poll transfers at its fast period (0.5 ms) rather than every 20 ms.

        Not with an agent that announces every end (``async_submit``): its completions wake the worker
        through the queue, and a fast tick would only take CPU from its copy threads.
        """
        return self._busy() and not self.agent.capabilities.async_submit

    # --- data plane (worker thread; kvcore.transceiver.dataplane) -----------------------------

    def submit_transfer(
        self,
        op: TransferOp,
        remote: str,
        src: np.ndarray,
        dst: np.ndarray,
        sizes: np.ndarray,
        on_done: Callable[[], None] | None = None,
    ) -> Transfer:
        """Start moving a plan to (WRITE) or from (READ) loaded peer ``remote`` (``DataPlane.submit``)."""
        return self.data.submit(op, remote, src, dst, sizes, on_done)

    def poll_transfer(self, x: Transfer) -> TransferStatus:
        """Advance ``x`` and report its state; never calls ``on_done`` (``DataPlane.poll``)."""
        return self.data.poll(x)

    def stop_transfer(self, x: Transfer, why: str) -> None:
        """Post no further chunk of ``x``: it ends FAILED once the chunk in flight is terminal (any thread)."""
        self.data.stop(x, why)

    def release_transfer(self, x: Transfer) -> None:
        """Check that ``x`` may be forgotten (``DataPlane.release``: ``TransferError`` while it is in flight)."""
        self.data.release(x)

    def _agent_event(self, handle_id: int) -> None:
        """The agent says a transfer may have ended (any thread): look at it on the worker at once."""
        self.post(self._agent_done, handle_id)

    def _agent_done(self, handle_id: int) -> None:
        if not self.data.finish(handle_id):
            self._tick(time.monotonic())  # a transfer the role submitted itself: its timer polls it now

    def unload_agent(self, name: str, incarnation: str, descriptor: bytes = b"") -> None:
        """Unload a peer's agent if the one loaded under ``name`` is still that one (worker thread).

        ``descriptor``: the agent descriptor that peer announced. Two agents of one name and one process (an
        engine that rebuilt its transceiver in place) share the process's incarnation; their descriptors differ
        (regions, generation), so a lost peer never unloads the agent its successor loaded under the same name.
        """
        if name not in self.agent.remote_agents:
            return
        try:
            remote = self.agent.remote(name)
            if remote.incarnation != incarnation:
                return  # a newer incarnation took the name over
            if descriptor and remote.descriptor != TransferAgent.decode_descriptor(descriptor):
                return  # a successor of the same process took the name over
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
        """Stop the worker and the messenger (joins the I/O thread) and detach from the agent."""
        self._stop.set()
        self.messenger.close(timeout)
        if self.agent.capabilities.async_submit:
            self.agent.set_completion_listener(None)  # a late completion now wakes nothing (the loop is gone)
        self._work.clear()
        if self.native is not None:
            self.native.close()  # its thread stops; writes in flight end at the poster's close

    def deregister(self) -> None:
        for reg in self.registrations:
            try:
                self.agent.deregister_memory(reg)
            except E.TransferError:
                pass
        self.registrations.clear()

    @staticmethod
    def agent_name(info: wire.RankInfo | bytes) -> str:
        """The agent name a peer's ``RankInfo`` (or agent descriptor) announces; ``RemoteAgentError`` if malformed."""
        desc = info if isinstance(info, bytes) else info.agent_descriptor
        return TransferAgent.decode_descriptor(desc).name
