"""``MpiAgent``: the kvcore transfer agent on MPI-3 RMA through mpi4py (MPICH wheel).

Peers meet at first contact: each agent listens on a TCP socket and names it (address, port and a
random token) in its descriptor; a peer that loads the descriptor connects, sends the token, and both
sides call ``MPI_Comm_join`` on that socket (MPICH opens a port, one side accepts, the other connects).
Why not a standing ``MPI_Comm_accept``: while one thread of a process waits in it, no other thread of that
process completes an ``MPI_Comm_connect`` (README: evidence), and an agent must do both. Both sides merge
the intercommunicator and create a *dynamic* window on it: the
acceptor attaches every region it registered (``MPI_Win_attach``, a local call, also for regions registered
later), so the connector addresses them by their absolute addresses, as the descriptor lists them.

A transfer is one ``MPI_Put`` (WRITE) or ``MPI_Get`` (READ) with an hindexed datatype on each side (every
fragment in one call, built from the numpy arrays), then ``MPI_Win_flush``: when it returns every byte is
in the destination. A notification is then sent two-sided (``MPI_Send``, tag ``TAG_NOTIFY``), so it always
arrives after its data. MPICH moves dynamic-window RMA by active messages, which need the target to enter
MPI: each agent's service thread probes its accepted connections every ``progress_interval_s``, which
both delivers notifications and progresses RMA aimed at this process.

Failures: MPI errors return (``MPI_ERRORS_RETURN`` via mpi4py's ``errors="exception"``) and become
``TransferFailedError``. MPICH (5.0, ch4:ucx) reports neither a SIGKILLed nor a SIGSTOPped peer: the
initiator's ``MPI_Win_flush`` waits forever (README: evidence). So every connection has a watchdog: a
transfer that has not completed ``fence_after_s`` (plus its bytes at ``fence_min_bytes_per_s``) after it
started, or whose peer process is provably dead (same host: its pid is gone), fences the connection:
its transfers end ``PeerLostError`` at once, it takes no new ones, and its worker thread (stuck in MPI)
is abandoned. Other peers keep being served.

Options (``TransceiverConfig.agent_options``): :class:`MpiOptions`.
"""

from __future__ import annotations

import enum
import hmac
import logging
import os
import queue
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np

from kvcore.errors import PeerLostError, RegistrationError, RemoteAgentError, TransferError, TransferFailedError
from kvcore.extension.convert import convert_options
from kvcore.hostinfo import host_identity, process_alive, process_start_time, same_host
from kvcore.transport.agent import (
    AgentDescriptor,
    MemoryKind,
    MemoryRegion,
    Notification,
    Registration,
    RemoteAgent,
    TransferAgent,
    TransferHandle,
    TransferOp,
    TransferStatus,
)
from kvcore_mpi._bootstrap import mpi
from kvcore_mpi.plugin import CAPABILITIES

log = logging.getLogger("kvcore.mpi")

#: Version of this agent's descriptor payload.
PAYLOAD_VERSION = 1
#: Tags on a connection's merged communicator: a notification, and the connector's goodbye.
TAG_NOTIFY, TAG_BYE = 7001, 7002
#: Rank of the acceptor (the target) and of the connector (the initiator) in a merged communicator.
TARGET, INITIATOR = 0, 1
#: Largest piece of one fragment in a datatype (block lengths are C ints).
MAX_BLOCK = 1 << 30
#: Longest address accepted from a peer.
MAX_ADDRESS = 255
#: Length of the join token.
TOKEN_BYTES = 16
#: Seconds the acceptor waits for a caller's token: a peer sends it right after connecting, so a silent stranger
#: holds the (one) accept loop this long at most, not ``connect_timeout_s``.
TOKEN_READ_S = 2.0
#: The acceptor's answer to a token: join now (it holds its process's join lock), or busy (retry later).
GO, BUSY = b"G", b"B"
#: Serializes connection setup (``MPI_Comm_join``, merge, window creation) in this process: two joins at once
#: in one process crash MPICH 5.0 (SIGSEGV in 3 of 4 runs of two agents loading each other at the same instant).
_JOIN_LOCK = threading.Lock()


class MpiOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The mpi agent's options: ``TransceiverConfig.agent_options`` with ``backend = "mpi"``."""

    fence_after_s: Annotated[float, msgspec.Meta(gt=0)] = 8.0
    """A transfer still running this long after it started (plus its bytes at ``fence_min_bytes_per_s``)
    fences its peer: MPICH never reports a dead or stopped peer, so this bound is what ends the request."""
    fence_min_bytes_per_s: Annotated[float, msgspec.Meta(gt=0)] = 32.0 * 1024 * 1024
    """The slowest rate a healthy peer is assumed to reach, for the watchdog's bound on large transfers."""
    connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """Bound on the TCP connect, ``MPI_Comm_join``, merge and window creation at first contact."""
    address: str = ""
    """The address this agent listens on and names in its descriptor; empty: this host's name resolved
    (``socket.gethostbyname(socket.gethostname())``), or 127.0.0.1 where that fails."""
    close_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    """Bound on each collective teardown (window free, disconnect) when unloading a peer or closing."""
    progress_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.0005
    """Sleep of the service thread between probes (notifications, and the progress of RMA aimed here)."""
    max_notification_bytes: Annotated[int, msgspec.Meta(gt=0)] = 64 * 1024
    """Largest notification sent or accepted."""


class _Payload(msgspec.Struct, frozen=True, array_like=True):
    """What a peer needs to reach this agent: where it listens, the token it expects, what proves it alive."""

    version: int
    address: str
    port: int
    token: bytes  # the capability: only a holder of the full descriptor can join (and reach the memory)
    agent_id: str  # fixed for the agent object's life (``_same_agent``)
    host: str  # kvcore.hostinfo.host_identity(): pids are comparable where equal
    pid: int
    start_time: int  # of ``pid`` (a recycled pid is another process)


class _Notice(msgspec.Struct, frozen=True, array_like=True):
    """A notification on the wire: the sender's name and the message."""

    sender: str
    message: bytes


_payload_decoder = msgspec.msgpack.Decoder(_Payload)
_notice_decoder = msgspec.msgpack.Decoder(_Notice)
_encoder = msgspec.msgpack.Encoder()


class LinkState(enum.Enum):
    """A connection's life: OPEN (serving), FENCED (peer lost: no MPI call on it again), CLOSED."""

    OPEN = "open"
    FENCED = "fenced"
    CLOSED = "closed"


#: The one place the allowed transitions of a connection live.
_TRANSITIONS = {
    LinkState.OPEN: {LinkState.FENCED, LinkState.CLOSED},
    LinkState.FENCED: {LinkState.CLOSED},
    LinkState.CLOSED: set(),
}


@dataclass(eq=False)
class _Job:
    """One submitted transfer, run by its connection's worker thread."""

    handle_id: int
    op: TransferOp
    local: np.ndarray
    remote: np.ndarray
    sizes: np.ndarray
    nbytes: int
    notification: bytes | None
    done: threading.Event = field(default_factory=threading.Event)
    error: TransferError | None = None


@dataclass(eq=False)
class _Link:
    """This agent's connection to one peer (it connected): the merged communicator, the window, the worker."""

    peer: str
    comm: Any
    inter: Any
    win: Any
    payload: _Payload
    jobs: queue.SimpleQueue[_Job | None] = field(default_factory=queue.SimpleQueue)
    state: LinkState = LinkState.OPEN
    error: TransferError | None = None
    current: _Job | None = None
    deadline: float = 0.0  # when ``current`` fences the link
    pending: set[_Job] = field(default_factory=set)
    thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fenced(self) -> bool:
        """Whether the peer was lost (read afresh: other threads fence a link)."""
        return self.state is LinkState.FENCED

    def move(self, to: LinkState) -> bool:
        """Go to ``to`` if allowed from the current state; False (nothing changes) otherwise."""
        with self.lock:
            if to not in _TRANSITIONS[self.state]:
                return False
            self.state = to
            return True


@dataclass(eq=False)
class _Served:
    """A connection a peer made to this agent: its window holds every region this agent registered."""

    comm: Any
    inter: Any
    win: Any
    attached: dict[int, Any] = field(default_factory=dict)  # registration id -> the attached buffer


def split_fragments(
    local: np.ndarray, remote: np.ndarray, sizes: np.ndarray, limit: int = MAX_BLOCK
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same bytes as fragments of at most ``limit`` bytes each (MPI block lengths are C ints)."""
    if sizes.size == 0 or int(sizes.max()) <= limit:
        return local, remote, sizes
    pieces = (sizes + np.uint64(limit - 1)) // np.uint64(limit)
    owner = np.repeat(np.arange(sizes.size), pieces.astype(np.int64))
    first = np.cumsum(pieces) - pieces
    offset = (np.arange(owner.size, dtype=np.uint64) - first[owner].astype(np.uint64)) * np.uint64(limit)
    size = np.minimum(sizes[owner] - offset, np.uint64(limit))
    return local[owner] + offset, remote[owner] + offset, size


class MpiAgent(TransferAgent):
    """Transfer agent on MPI RMA: a connection per peer (connect/accept), a dynamic window, Put/Get + Flush."""

    backend = "mpi"
    capabilities = CAPABILITIES
    options_type = MpiOptions

    def __init__(self, name: str, options: Mapping[str, Any] | MpiOptions | None = None) -> None:
        super().__init__(name, options)
        self.opts = convert_options(MpiOptions, options, owner="mpi agent")
        self._mpi = mpi()
        self._id = uuid.uuid4().hex
        self._lock = threading.Lock()  # the tables below; never held across a blocking MPI call
        self._served: list[_Served] = []
        self._notifications: list[Notification] = []
        self._stop = threading.Event()
        self._token = os.urandom(TOKEN_BYTES)
        self._address = self.opts.address or _default_address()
        self._listener = socket.create_server((self._address, 0))
        self._listener.settimeout(0.1)
        self._port: int = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, name=f"kvcore-mpi-accept-{name}", daemon=True)
        self._service = threading.Thread(target=self._service_loop, name=f"kvcore-mpi-service-{name}", daemon=True)
        self._accepter.start()
        self._service.start()

    # --- memory ---------------------------------------------------------------------------------

    def _register(self, region: MemoryRegion, keepalive: Any) -> Any:
        if region.kind is MemoryKind.VRAM and not self._cuda_aware():
            raise RegistrationError(
                f"mpi agent: VRAM at {region.address:#x} needs a CUDA-aware MPI; "
                f"{self._mpi.Get_library_version().splitlines()[0]} is not (MPIX_Query_cuda_support)"
            )
        return None  # attached to every accepted connection's window in _registrations_changed (id known)

    def _cuda_aware(self) -> bool:
        query = getattr(self._mpi, "Query_cuda_support", None)
        return bool(query()) if query is not None else False

    def _attach(self, served: _Served, reg_id: int, region: MemoryRegion) -> None:
        buf = self._mpi.buffer.fromaddress(region.address, region.length)
        served.win.Attach(buf)
        served.attached[reg_id] = buf

    def _deregister(self, registration: Registration) -> None:
        with self._lock:
            for served in self._served:
                buf = served.attached.pop(registration.id, None)
                if buf is not None:
                    served.win.Detach(buf)

    def _registrations_changed(self) -> None:
        super()._registrations_changed()
        with self._lock:  # attach what is registered and not yet attached (ids are known only now)
            for served in self._served:
                for reg in self._registrations.values():
                    if reg.id not in served.attached:
                        self._attach(served, reg.id, reg.region)

    # --- peers ------------------------------------------------------------------------------------

    def _descriptor_payload(self) -> bytes:
        pid = os.getpid()
        return _encoder.encode(
            _Payload(
                PAYLOAD_VERSION,
                self._address,
                self._port,
                self._token,
                self._id,
                host_identity(),
                pid,
                process_start_time(pid) or 0,
            )
        )

    def _decode(self, descriptor: AgentDescriptor) -> _Payload:
        payload = self.decode_payload(descriptor, _payload_decoder, version=PAYLOAD_VERSION)
        address = payload.address
        if not address or len(address) > MAX_ADDRESS or not address.isascii() or not address.isprintable():
            raise RemoteAgentError(
                f"peer {descriptor.name!r}: mpi address: expected 1-{MAX_ADDRESS} printable ASCII characters, "
                f"got {len(address)} characters"
            )
        if not 0 < payload.port < 65536:
            raise RemoteAgentError(f"peer {descriptor.name!r}: mpi port: expected 1-65535, got {payload.port}")
        if len(payload.token) != TOKEN_BYTES:
            raise RemoteAgentError(
                f"peer {descriptor.name!r}: mpi token: expected {TOKEN_BYTES} bytes, got {len(payload.token)}"
            )
        return payload

    def _same_agent(self, loaded: RemoteAgent, descriptor: AgentDescriptor) -> bool:
        link: _Link = loaded.native
        return link.payload.agent_id == self._decode(descriptor).agent_id

    def _peer_gone(self, loaded: RemoteAgent) -> bool:
        link: _Link = loaded.native
        return link.state is not LinkState.OPEN or self._process_dead(link.payload)

    def _describe_agent(self, descriptor: AgentDescriptor) -> str:
        try:
            payload = self._decode(descriptor)
        except RemoteAgentError:
            return descriptor.incarnation[:8]
        return f"{descriptor.incarnation[:8]} (pid {payload.pid}, agent {payload.agent_id[:8]})"

    def _load_remote(self, descriptor: AgentDescriptor, previous: RemoteAgent | None) -> Any:
        payload = self._decode(descriptor)
        if previous is not None and previous.native.state is LinkState.OPEN:
            return previous.native  # a refresh (new regions) by the same agent: the connection stays
        return self._connect(descriptor.name, payload)

    def _connect(self, peer: str, payload: _Payload) -> _Link:
        """Join over TCP, merge and create the window, bounded by ``connect_timeout_s``.

        Holds this process's join lock from the TCP connect to the window; the acceptor answers ``BUSY`` when
        its own process is joining (it may be joining us: both back off a random moment and retry).
        """
        result: list[Any] = []
        deadline = time.monotonic() + self.opts.connect_timeout_s

        def attempt() -> bool:
            """One try; True when joined (``result`` holds the objects), False when the acceptor was busy."""
            with socket.create_connection((payload.address, payload.port), timeout=self.opts.connect_timeout_s) as sock:
                sock.sendall(payload.token)
                answer = sock.recv(1)
                if answer != GO:
                    return False
                sock.settimeout(None)
                inter = self._mpi.Comm.Join(sock.fileno())
            comm = inter.Merge(high=True)
            win = self._mpi.Win.Create_dynamic(comm=comm)
            win.Lock_all(self._mpi.MODE_NOCHECK)
            result.append((inter, comm, win))
            return True

        def run() -> None:
            try:
                while time.monotonic() < deadline:
                    if not _JOIN_LOCK.acquire(timeout=max(0.0, deadline - time.monotonic())):
                        break
                    try:
                        if attempt():
                            return
                    finally:
                        _JOIN_LOCK.release()
                    time.sleep(random.uniform(0.005, 0.05))
                result.append(TimeoutError("the peer stayed busy joining others"))
            except Exception as exc:
                result.append(exc)

        thread = threading.Thread(target=run, name=f"kvcore-mpi-connect-{peer}", daemon=True)
        thread.start()
        thread.join(self.opts.connect_timeout_s + 1.0)
        if not result:
            raise RemoteAgentError(
                f"mpi agent {self.name!r}: peer {peer!r} did not join within {self.opts.connect_timeout_s:g}s "
                f"(pid {payload.pid}); the connecting thread is abandoned"
            )
        if isinstance(result[0], Exception):
            raise RemoteAgentError(
                f"mpi agent {self.name!r}: joining peer {peer!r} at {payload.address}:{payload.port} failed: {result[0]}"
            )
        inter, comm, win = result[0]
        link = _Link(peer, comm, inter, win, payload)
        link.thread = threading.Thread(target=self._work, args=(link,), name=f"kvcore-mpi-{peer}", daemon=True)
        link.thread.start()
        return link

    def _unload_remote(self, remote: RemoteAgent) -> None:
        link: _Link = remote.native
        if not link.move(LinkState.CLOSED):
            return
        was_fenced = link.error is not None
        link.jobs.put(None)  # the worker ends after what is queued
        if was_fenced or link.thread is None:
            return  # no collective call with a lost peer: its handles are dropped, not freed
        link.thread.join(self.opts.close_timeout_s)

    def _process_dead(self, payload: _Payload) -> bool:
        return same_host(payload.host) and not process_alive(payload.pid, payload.start_time or None)

    # --- transfers --------------------------------------------------------------------------------

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        link: _Link = remote.native
        if link.state is not LinkState.OPEN:
            raise link.error or PeerLostError(f"mpi agent {self.name!r}: peer {link.peer!r} is {link.state.value}")
        note = handle.notification
        if note is not None and len(note) > self.opts.max_notification_bytes:
            raise TransferError(
                f"notification is {len(note)} bytes, over max_notification_bytes={self.opts.max_notification_bytes}"
            )
        job = _Job(handle.id, handle.op, local, remote_addrs, sizes, handle.nbytes, note)
        with link.lock:
            link.pending.add(job)
            if link.current is None:  # the watchdog counts from now while the worker picks it up
                link.deadline = time.monotonic() + self._bound(job)
        link.jobs.put(job)
        return (link, job)

    def _bound(self, job: _Job) -> float:
        return self.opts.fence_after_s + job.nbytes / self.opts.fence_min_bytes_per_s

    def _work(self, link: _Link) -> None:
        """The link's worker: run its jobs in order; exits on None (unload) or once the link is fenced."""
        while True:
            job = link.jobs.get()
            if job is None or link.fenced():
                break
            with link.lock:
                link.current, link.deadline = job, time.monotonic() + self._bound(job)
            try:
                self._move(link, job)
            except Exception as exc:
                job.error = TransferFailedError(f"mpi transfer {job.handle_id} to {link.peer!r} failed: {exc}")
                job.error.__cause__ = exc
            with link.lock:
                link.current = None
                if link.fenced():
                    return  # the watchdog already failed this job; the link is dead to us
                link.pending.discard(job)
            job.done.set()
            self._announce(job.handle_id)
        if link.state is LinkState.CLOSED and link.error is None:
            self._teardown_link(link)

    def _move(self, link: _Link, job: _Job) -> None:
        """One Put/Get of every fragment (hindexed datatypes on both sides), Flush, then the notification."""
        MPI = self._mpi
        local, remote, sizes = split_fragments(job.local, job.remote, job.sizes)
        blocks = sizes.astype(np.int64).tolist()
        origin = MPI.BYTE.Create_hindexed(blocks, local.astype(np.int64).tolist()).Commit()
        target = MPI.BYTE.Create_hindexed(blocks, remote.astype(np.int64).tolist()).Commit()
        try:
            spec = [MPI.BOTTOM, 1, origin]
            if job.op is TransferOp.WRITE:
                link.win.Put(spec, TARGET, target=(0, 1, target))
            else:
                link.win.Get(spec, TARGET, target=(0, 1, target))
            link.win.Flush(TARGET)
        finally:
            origin.Free()
            target.Free()
        if job.notification is not None:
            link.comm.Send([_encoder.encode(_Notice(self.name, job.notification)), MPI.BYTE], TARGET, TAG_NOTIFY)

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        link, job = handle.native
        if job.done.is_set():
            if job.error is not None:
                raise job.error
            return TransferStatus.DONE
        self._watch(link)
        if link.error is not None:
            raise link.error
        return TransferStatus.PENDING

    def _watch(self, link: _Link) -> None:
        """Fence ``link`` when its peer is provably dead or its running transfer is past its bound."""
        if link.state is not LinkState.OPEN:
            return
        with link.lock:
            busy, overdue = bool(link.pending), time.monotonic() > link.deadline
        if not busy:
            return
        if self._process_dead(link.payload):
            why = f"its process (pid {link.payload.pid}) is gone"
        elif overdue:
            why = (
                f"a transfer made no progress within its bound (fence_after_s={self.opts.fence_after_s:g} plus its "
                "bytes at fence_min_bytes_per_s); MPICH reports neither a dead nor a stopped peer"
            )
        else:
            return
        self._fence(link, PeerLostError(f"mpi agent {self.name!r}: peer {link.peer!r} lost: {why}"))

    def _fence(self, link: _Link, error: PeerLostError) -> None:
        """Fail every transfer of ``link`` and never call MPI on it again (its worker may be stuck inside MPI)."""
        if not link.move(LinkState.FENCED):
            return
        log.warning("%s", error)
        with link.lock:
            link.error = error
            jobs, link.pending = list(link.pending), set()
        for job in jobs:
            job.error = error
            job.done.set()
            self._announce(job.handle_id)
        link.jobs.put(None)

    def _release(self, handle: TransferHandle) -> None:
        handle.native = None

    # --- the acceptor side --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        """Take TCP connections until close; a caller holding the token is joined (``MPI_Comm_join``)."""
        MPI = self._mpi
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            try:
                with sock:
                    sock.settimeout(min(TOKEN_READ_S, self.opts.connect_timeout_s))
                    token = _read_exactly(sock, TOKEN_BYTES)
                    if not hmac.compare_digest(token, self._token):
                        log.warning("mpi agent %r: refused a connection with a wrong token", self.name)
                        continue
                    if not _JOIN_LOCK.acquire(timeout=0.01):
                        sock.sendall(BUSY)  # this process is joining (maybe the caller): it retries
                        continue
                    try:
                        sock.sendall(GO)
                        sock.settimeout(None)
                        inter = MPI.Comm.Join(sock.fileno())
                        comm = inter.Merge(high=False)
                        win = MPI.Win.Create_dynamic(comm=comm)
                        served = _Served(comm, inter, win)
                        with self._lock:
                            for reg in self._registrations.values():
                                self._attach(served, reg.id, reg.region)
                            self._served.append(served)
                    finally:
                        _JOIN_LOCK.release()
            except Exception as exc:
                log.warning("mpi agent %r: joining a peer failed: %s", self.name, exc)

    def _service_loop(self) -> None:
        """Receive notifications and goodbyes; each probe also progresses RMA aimed at this process."""
        MPI = self._mpi
        status = MPI.Status()
        while not self._stop.is_set():
            with self._lock:
                served = list(self._served)
            busy = False
            for conn in served:
                try:
                    while conn.comm.Iprobe(INITIATOR, MPI.ANY_TAG, status):
                        busy = True
                        data = bytearray(status.Get_count(MPI.BYTE))
                        conn.comm.Recv([data, MPI.BYTE], INITIATOR, status.Get_tag())
                        if status.Get_tag() == TAG_BYE:
                            self._retire(conn)
                            break
                        self._take_notice(bytes(data))
                except Exception as exc:
                    log.warning("mpi agent %r: a connection failed while probing: %s", self.name, exc)
                    with self._lock:
                        if conn in self._served:
                            self._served.remove(conn)
            if not busy:
                time.sleep(self.opts.progress_interval_s if served else 0.005)

    def _take_notice(self, data: bytes) -> None:
        if len(data) > self.opts.max_notification_bytes + 4096:
            log.warning("mpi agent %r: dropped a %d-byte notification (over the bound)", self.name, len(data))
            return
        try:
            notice = _notice_decoder.decode(data)
        except msgspec.DecodeError as exc:
            log.warning("mpi agent %r: dropped a malformed notification: %s", self.name, exc)
            return
        with self._lock:
            self._notifications.append(Notification(notice.sender, notice.message))

    def _retire(self, conn: _Served) -> None:
        """The connector said goodbye: detach, then free the window and disconnect with it (collective)."""
        with self._lock:
            if conn in self._served:
                self._served.remove(conn)
            bufs, conn.attached = list(conn.attached.values()), {}
        _bounded(lambda: _teardown(conn.win, conn.comm, conn.inter, bufs), self.opts.close_timeout_s, "retire")

    def _teardown_link(self, link: _Link) -> None:
        """Say goodbye, then free the window and disconnect (collective with the acceptor's service thread)."""

        def run() -> None:
            link.comm.Send([b"", self._mpi.BYTE], TARGET, TAG_BYE)
            link.win.Unlock_all()
            _teardown(link.win, link.comm, link.inter, [])

        _bounded(run, self.opts.close_timeout_s, f"unload of {link.peer!r}")

    def _get_notifications(self) -> list[Notification]:
        with self._lock:
            out, self._notifications = self._notifications, []
        return out

    def _native_resources(self) -> dict[str, int]:
        with self._lock:
            served = len(self._served)
        return {
            "mpi_accepted_connections": served,
            "mpi_threads": int(self._accepter.is_alive()) + int(self._service.is_alive()),
        }

    def _close(self) -> None:
        self._stop.set()
        self._accepter.join(self.opts.close_timeout_s)
        self._service.join(self.opts.close_timeout_s)
        with self._lock:
            served, self._served = self._served, []
        for conn in served:  # peers still connected: detach (local); the window is theirs to free with us
            for buf in conn.attached.values():
                try:
                    conn.win.Detach(buf)
                except Exception as exc:
                    log.warning("mpi agent %r: detach at close failed: %s", self.name, exc)
            conn.attached = {}
        self._listener.close()


def _default_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _teardown(win: Any, comm: Any, inter: Any, bufs: list[Any]) -> None:
    for buf in bufs:
        win.Detach(buf)
    win.Free()
    comm.Disconnect()
    inter.Disconnect()


def _bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """``fn()`` on its own thread, waited for at most ``timeout`` seconds; None (logged) when it did not finish."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except Exception as exc:
            log.warning("kvcore mpi: %s failed: %s", what, exc)
            result.append(None)

    thread = threading.Thread(target=run, name=f"kvcore-mpi-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        log.warning("kvcore mpi: %s did not finish within %gs; its thread is abandoned", what, timeout)
        return None
    return result[0]
