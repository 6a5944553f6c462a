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
through the returned ``Transfer`` (``poll_transfer``, and an ``on_done``
callback on the worker thread as soon as the transfer is terminal). An agent
whose ``submit`` returns before the bytes move (``async_submit``: the shm
agent's copy threads) gets the plan at once and announces its end; the worker
then reports it without waiting for a timer. An agent whose ``submit`` moves
the bytes itself (NIXL or UCX over CMA) gets a large plan in chunks, one at a
time, and the worker serves new requests, results and timers between chunks: a
small request waits for at most one chunk of a large one, never for all of it.
The chunk adapts: ``CHUNK_BYTES`` while this rank has nothing else to do (fewer
submits, full speed), ``FINE_CHUNK_BYTES`` while other requests come and go
(a message or a work item beside a chunked transfer within the last
``BUSY_WINDOW_S``), so that they wait
for a shorter copy. When the first chunk is still in flight after ``submit``
returned (the transport posts asynchronously: RDMA, TCP lanes), the rest of the
plan follows as one chunk.
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

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
from kvcore.transport import bounce
from kvcore.transport.agent import (
    MemoryKind,
    MemoryRegion,
    TransferAgent,
    TransferHandle,
    TransferOp,
    TransferStatus,
    process_incarnation,
)

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
    "BUSY_WINDOW_S",
    "PUMP_BUDGET_S",
    "chunk_plan",
]

#: The events a transceiver counts (``Link.counters``; ``stats()`` reports them, ``COUNTERS`` names those that only grow).
RoleCounter = Literal[
    "abandoned_transfers",
    "agent_errors",
    "bounce_fallback_arena_full",
    "bounce_fallback_plan_mismatch",
    "bounce_fallback_staging_full",
    "bounced_writes_total",
    "chunks_back_to_back",
    "early_requests_expired",
    "exposed_to_peers",
    "fenced_dead",
    "fenced_grace",
    "forged_messages",
    "idle_peers_dropped",
    "idle_peers_readmitted",
    "ignored_cancels",
    "ignored_messages",
    "ignored_renewals",
    "late_results",
    "peers_closed",
    "peers_lost",
    "tickets_refused",
    "unexpected_messages",
    "worker_errors",
]

log = logging.getLogger("kvcore.transceiver")

Handler = Callable[[Source, Any], None]

#: The first piece of a plan posted to an agent whose submit moves the bytes itself, before this rank has
#: measured how fast that agent copies (16 MiB: about 2.5 ms of CMA copy on a small box).
CHUNK_BYTES = 16 * 1024 * 1024
#: How long one piece may copy while the rank is quiet, once the agent's copy rate is known: the longest a
#: request arriving beside a large one waits before the pieces turn fine (8 ms: 40-44 MiB over NIXL and UCX on
#: this box, 12-13 pieces for a 512 MiB request instead of 32 of 16 MiB; a faster copy gets larger pieces).
QUIET_PIECE_S = 0.008
#: The most fine chunks in one quiet piece (256 MiB).
MAX_QUIET_CHUNKS = 64
#: The chunk while other requests are active on this rank: the longest copy a newcomer can wait behind (4 MiB:
#: about half a millisecond of CMA copy on a small box).
FINE_CHUNK_BYTES = 4 * 1024 * 1024
#: How recent (seconds) a message or a work item must be for the rank to count as busy (fine chunks).
BUSY_WINDOW_S = 0.01
#: How long (seconds) the worker may post chunks of a transfer back to back while nothing else waits for it.
PUMP_BUDGET_S = 0.01
#: Work items the worker runs per I/O-loop turn before it serves the sockets again.
_MAX_WORK_PER_TURN = 4096


def chunk_plan(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Split a plan into consecutive chunks of about ``limit`` bytes: ``(src, dst, sizes, bounds)``.

    Fragments larger than ``limit`` are cut into ``limit``-byte pieces first; chunk ``i`` is fragments
    ``bounds[i]:bounds[i+1]`` and holds at most ``2 * limit`` bytes. Every byte of the plan is in exactly one
    chunk, in the plan's order.
    """
    src, dst, sizes = (np.asarray(a, dtype=np.uint64) for a in (src, dst, sizes))
    lim = np.uint64(limit)
    if sizes.size and int(sizes.max()) > limit:
        pieces = (sizes + lim - np.uint64(1)) // lim
        which = np.repeat(np.arange(sizes.size), pieces.astype(np.int64))
        first = np.concatenate(([0], np.cumsum(pieces)[:-1])).astype(np.int64)
        k = (np.arange(which.size, dtype=np.int64) - first[which]).astype(np.uint64) * lim
        src, dst = src[which] + k, dst[which] + k
        sizes = np.minimum(lim, sizes[which] - k)
    before = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64) if sizes.size else sizes
    window = before // lim
    bounds = [0, *(np.flatnonzero(np.diff(window)) + 1).tolist(), int(sizes.size)]
    return src, dst, sizes, bounds


@dataclass(eq=False)
class Transfer:
    """One plan as the data plane moves it: consecutive chunks through the agent, one in flight at a time.

    ``bounds`` cut the plan into fine chunks; the piece in flight is fine chunks ``chunk`` to ``chunk + span``
    (several fine chunks go as one submit while the rank is quiet).

    ``status`` is PENDING until every chunk is terminal at the transport; then DONE (every byte landed) or
    FAILED (``error``; no chunk is in flight and none is posted after it).
    """

    op: TransferOp
    remote: str
    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    bounds: list[int]
    on_done: Callable[[], None] | None
    nbytes: int
    chunk: int = 0  # the first fine chunk of the piece in flight
    span: int = 1  # fine chunks in the piece in flight
    posted_at: float = float("inf")  # when the piece in flight was submitted (none yet: nothing came beside it)
    handle: TransferHandle | None = None
    status: TransferStatus = TransferStatus.PENDING
    error: E.TransferError | None = None
    pumped: bool = False  # chunks left and the transport copies inside submit: the worker posts them without sleeping
    stopped: str = ""  # why no further chunk may be posted (the writer gave up): it ends FAILED

    @property
    def chunks(self) -> int:
        return len(self.bounds) - 1

    @property
    def more(self) -> bool:
        """Fine chunks remain after the piece in flight."""
        return self.chunk + self.span < self.chunks


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
        self.metrics = TransceiverMetrics(
            backend=agent.backend, role=role, rank=topology.rank, instance=self.instance_name
        )
        self._last_tick = 0.0
        self.messenger.set_driver(self._turn)
        self.messenger.set_turn_end(self._turn_end)
        # The data plane (worker thread only): transfers not yet terminal, and the one behind each agent handle.
        self._xfers: dict[int, Transfer] = {}
        self._by_handle: dict[int, Transfer] = {}
        self._chunked = 0  # transfers with chunks still to post (pumped by the worker loop)
        self._chunk_ready = False  # the last pump posted a chunk: the loop does not sleep before the next
        self.chunk_bytes = 0 if agent.capabilities.async_submit else CHUNK_BYTES
        self.fine_chunk_bytes = FINE_CHUNK_BYTES
        #: Worker only: per peer, bytes/s of the last piece the agent copied on this thread (absent: not known yet).
        self.copy_rates: dict[str, float] = {}
        self._last_other = 0.0  # worker only: when a message or work last came beside a chunked transfer
        if agent.capabilities.async_submit:
            agent.set_completion_listener(self._agent_event)

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
        if self._chunked:
            self._last_other = time.monotonic()  # traffic beside a chunked transfer: the next chunks are fine
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
        if self._work and self._chunked:
            self._last_other = now
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
            if self._chunked:
                self._chunk_ready = self._pump()
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

    def _polling(self) -> bool:
        """Whether the worker must poll transfers at its fast period (0.5 ms) rather than every 20 ms.

        Not with an agent that announces every end (``async_submit``): its completions wake the worker
        through the queue, and a fast tick would only take CPU from its copy threads.
        """
        return self._busy() and not self.agent.capabilities.async_submit

    # --- data plane (worker thread) ------------------------------------------------------------

    def submit_transfer(
        self,
        op: TransferOp,
        remote: str,
        src: np.ndarray,
        dst: np.ndarray,
        sizes: np.ndarray,
        on_done: Callable[[], None] | None = None,
    ) -> Transfer:
        """Start moving a plan to (WRITE) or from (READ) loaded peer ``remote``; returns its ``Transfer``.

        Raises the agent's ``TransferError`` when the first chunk is refused (then nothing moved). ``on_done``
        runs on the worker thread as soon as the worker sees the transfer end after this returned; a transfer
        that ended inside ``submit`` is seen by the caller's first ``poll_transfer``.
        """
        nbytes = int(np.asarray(sizes, dtype=np.uint64).sum())
        fine = min(self.fine_chunk_bytes, self.chunk_bytes) if self.chunk_bytes else 0
        if fine and nbytes > fine:
            src, dst, sizes, bounds = chunk_plan(src, dst, sizes, fine)
        else:
            bounds = [0, len(sizes)]
        x = Transfer(op, remote, src, dst, sizes, bounds, None, nbytes)
        self._post_chunk(x)  # the first chunk's refusal is the caller's error
        if x.more and x.handle is not None and self.agent.poll(x.handle) is TransferStatus.PENDING:
            # The transport did not move the chunk inside submit (RDMA, a remote lane): it does not hold
            # this thread, so the rest goes as one more chunk rather than paying a submit per chunk.
            x.bounds, x.span = [0, x.bounds[x.span], x.bounds[-1]], 1
        elif x.more:
            x.pumped = True
            self._chunked += 1
        self._xfers[id(x)] = x
        x.on_done = on_done
        return x

    def _span(self, x: Transfer) -> int:
        """Fine chunks in ``x``'s next submit: one while other requests are active (traffic or work came while its
        last piece copied, or within ``BUSY_WINDOW_S``), so they wait for less; else as many as the agent copies in
        ``QUIET_PIECE_S`` at its measured rate (``chunk_bytes`` until a rate is known), at most ``MAX_QUIET_CHUNKS``.
        """
        if self._last_other >= x.posted_at or time.monotonic() - self._last_other < BUSY_WINDOW_S:
            return 1
        fine = max(1, self.fine_chunk_bytes)
        rate = self.copy_rates.get(x.remote, 0.0)
        quiet = rate * QUIET_PIECE_S if rate > 0 else self.chunk_bytes
        return max(1, min(MAX_QUIET_CHUNKS, int(quiet) // fine))

    def _post_chunk(self, x: Transfer) -> None:
        x.span = min(self._span(x), x.chunks - x.chunk)
        a, b = x.bounds[x.chunk], x.bounds[x.chunk + x.span]
        x.posted_at = time.monotonic()
        try:
            h = self.agent.submit(x.op, x.remote, x.src[a:b], x.dst[a:b], x.sizes[a:b])
        except E.KvcoreError:
            raise
        except Exception as exc:
            # An agent bug (its contract says TransferError): it fails this transfer, never the worker's loop,
            # and no handle exists to poll, so the request ends FAILED instead of waiting for its deadline.
            self.counters["agent_errors"] += 1
            log.error(
                "agent %s: submit to %r raised %s", self.agent.backend, x.remote, type(exc).__name__, exc_info=True
            )
            raise E.TransferFailedError(
                f"the {self.agent.backend} agent's submit to {x.remote!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        x.handle = h
        self._by_handle[h.id] = x
        if x.chunks > 1:
            self._note_rate(x, h, a, b)

    def _note_rate(self, x: Transfer, h: TransferHandle, a: int, b: int) -> None:
        """A piece that is DONE at its first poll was copied on this thread (inside ``submit``, or inside that poll
        as the UCX agent's progress does): its rate, from submit to that poll, sizes this peer's next quiet pieces."""
        try:
            done = self.agent.poll(h) is TransferStatus.DONE
        except E.KvcoreError:
            return  # the piece's end (and error) is the worker's to see when it advances the transfer
        took = time.monotonic() - x.posted_at
        if done and took > 0:
            if len(self.copy_rates) >= 4096:
                self.copy_rates.clear()  # bounded: peers come and go
            self.copy_rates[x.remote] = float(x.sizes[a:b].sum(dtype=np.uint64)) / took

    def poll_transfer(self, x: Transfer) -> TransferStatus:
        """Advance ``x`` (post its next chunk when one ended) and report its state; never calls ``on_done``.

        A transfer the worker loop pumps chunk by chunk is only reported: one chunk per loop turn, with the
        work queue served between chunks, whoever polls.
        """
        if not x.pumped:
            self._advance(x, notify=False)
        return x.status

    def stop_transfer(self, x: Transfer, why: str) -> None:
        """Post no further chunk of ``x``: it ends FAILED once the chunk in flight is terminal (any thread)."""
        x.stopped = why or "stopped"

    def release_transfer(self, x: Transfer) -> None:
        """Check that ``x`` may be forgotten: terminal (its agent handles were released as its chunks ended)."""
        if x.status is TransferStatus.PENDING:
            raise E.TransferError(f"transfer to {x.remote!r} is still in flight; poll it until it is terminal")

    def _advance(self, x: Transfer, *, notify: bool = True) -> None:
        h = x.handle
        if h is None:
            return
        status = self.agent.poll(h)
        if status is TransferStatus.PENDING:
            return
        error = h.error
        self._by_handle.pop(h.id, None)
        x.handle = None
        self.agent.release(h)
        if status is TransferStatus.DONE and x.more and x.stopped:
            status = TransferStatus.FAILED
            moved = int(x.sizes[: x.bounds[x.chunk + x.span]].sum(dtype=np.uint64))
            error = E.TransferFailedError(
                f"transfer to {x.remote!r} stopped after {moved} of {x.nbytes} bytes: {x.stopped}"
            )
        if status is TransferStatus.DONE and x.more:
            x.chunk += x.span
            try:
                self._post_chunk(x)
                return
            except E.TransferError as exc:
                status, error = TransferStatus.FAILED, exc
        if x.pumped:
            x.pumped = False
            self._chunked -= 1
        self._xfers.pop(id(x), None)
        x.status = status
        if status is TransferStatus.FAILED:
            x.error = error or E.TransferFailedError(f"transfer to {x.remote!r} failed")
        if notify and x.on_done is not None:
            x.on_done()

    def _pump(self) -> bool:
        """Post the next chunk of every chunked transfer whose current chunk ended.

        One chunk each per turn while several transfers are chunked (they take turns). A transfer chunked alone
        whose chunks end inside ``submit`` (a copy on this thread) gets its next chunk at once, for up to
        ``PUMP_BUDGET_S``, as long as no message, wake-up or work waits for this thread: a trip round the loop
        between two chunks cost 0.07-0.12 ms over NIXL on this box, back to back 0.035-0.075 ms.
        True when a chunk was posted: the loop comes back without sleeping. When every current chunk is still
        in flight (a remote that must progress first), the loop sleeps as for any busy wait.
        """
        posted = False
        alone = self._chunked == 1
        until = time.monotonic() + PUMP_BUDGET_S
        for x in list(self._xfers.values()):
            if not x.pumped:
                continue
            chained = False
            while True:
                before = x.chunk
                self._advance(x)
                if x.chunk == before:
                    break  # still in flight, or finished
                posted = True
                if chained:
                    self.counters["chunks_back_to_back"] += 1
                if not (alone and x.pumped) or self._work or self._stop.is_set() or self.messenger.has_input():
                    break
                if time.monotonic() > until:
                    break
                chained = True
        return posted

    def _agent_event(self, handle_id: int) -> None:
        """The agent says a transfer may have ended (any thread): look at it on the worker at once."""
        self.post(self._agent_done, handle_id)

    def _agent_done(self, handle_id: int) -> None:
        x = self._by_handle.get(handle_id)
        if x is not None:
            self._advance(x)
        else:
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
