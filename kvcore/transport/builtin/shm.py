"""The built-in same-host shared-memory transfer agent (backend ``shm``): real cross-process copies, no native library.

Memory travels as a capability, never as a name:

* ``allocate_tensor`` puts tensors in anonymous memory files (``memfd_create``)
  sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW``, then
  ``F_SEAL_SEAL``): nobody, the owner included, can truncate what a peer has
  mapped, so a peer never takes a SIGBUS. Nothing is created in ``/dev/shm``;
  the memory disappears with the last process that maps it.
* The descriptor names no file: it lists segment ids with their base address
  in the owner, the exported registrations, the owner's pid and two
  abstract-namespace UNIX sockets (nothing on disk; per network namespace).
* A peer gets the segments' file descriptors over the owner's ``SOCK_SEQPACKET``
  socket with ``SCM_RIGHTS``, lazily, at the first transfer that needs them.
  **Capability rule:** the owner serves its fds only to a connecting process
  whose agent it has itself loaded (``load_remote_agent``) under the name and
  incarnation the request states, with the pid that descriptor declared equal
  to the kernel's ``SO_PEERCRED`` pid. The connecting side in turn checks that
  the socket's ``SO_PEERCRED`` pid and the identity the owner states match the
  descriptor it loaded, and that every fd is a memfd sealed against shrinking
  and at least as large as declared, before mapping anything. kvcore never
  opens, maps or unlinks a path a peer named.
* Each agent owns a control block (one more sealed memfd, passed first): an
  alive flag and one random 63-bit token per exported registration.
  Deregistering zeroes the token first, so a sender still holding an old
  descriptor is refused with ``RemoteRangeError``; a descriptor cannot invent
  an export (its token would not match). The connection that carried the fds
  stays open: when it hangs up the owner closed its agent or died
  (``PeerLostError``).
* Notifications travel on a UNIX datagram socket in the abstract namespace and
  are sent only after the copy returned, so the receiver never sees one before
  its data. The kernel attaches the sender's pid (``SO_PASSCRED``): a
  notification is delivered only when its sender names an agent loaded here
  with that pid. A small thread drains the socket (and serves fds).

Agent names are unique per loading agent: a descriptor with the name of a
loaded peer but another incarnation replaces it only once the loaded one is
provably gone (its process or socket); while it lives, ``RemoteAgentError``.
A refresh (same incarnation) must name the same pid and sockets. The agent
refuses a descriptor of itself.

Why one module of this length: the memfd segments, the fd-passing server with its peer checks, the
notification socket and the copy threads are one agent whose safety rules (who may map what, when a segment may
go) only hold together.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import logging
import math
import mmap
import os
import re
import secrets
import select
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import msgspec
import numpy as np

from kvcore.errors import (
    KvcoreError,
    PeerLostError,
    RegistrationError,
    RemoteAgentError,
    RemoteRangeError,
    TransferError,
    TransferFailedError,
    TransferTimeoutError,
    UnsupportedOperationError,
)
from kvcore.extension.convert import convert_options
from kvcore.hostinfo import host_identity, hostname
from kvcore.msgbounds import check_msgpack_bounds
from kvcore.transport.agent import (
    AgentCapabilities,
    AgentDescriptor,
    MemoryRegion,
    Notification,
    Registration,
    RemoteAgent,
    TransferAgent,
    TransferHandle,
    TransferOp,
    TransferStatus,
    process_incarnation,
)
from kvcore.transport.builtin.hostcheck import require_same_host
from kvcore.transport.builtin.plugin import SHM_CAPABILITIES
from kvcore.transport.fragments import merge_runs

if TYPE_CHECKING:
    import torch

__all__ = ["ShmAgent", "ShmOptions"]

log = logging.getLogger("kvcore.shm")

_PAGE = mmap.PAGESIZE
_SOCK_RE = re.compile(r"\Akvcore-shm-[0-9]{1,10}-[0-9a-f]{8}-[0-9]{1,10}-(fds|notify)\Z")
_MAX_SEGMENT_BYTES = 1 << 40
_MAX_SEGMENTS = 4096
_MAX_NOTIFICATION_BYTES = 60 * 1024  # one datagram, well under the default socket buffer
_MAX_REQUEST_BYTES = 4096
_MAX_REPLY_BYTES = 1 << 20
_FDS_PER_MESSAGE = 250  # the kernel passes at most SCM_MAX_FD (253) fds in one message
_FETCH_TIMEOUT_S = 10.0
# How long a full listen backlog (EAGAIN: the owner is alive but has not accepted yet, e.g. under a connection
# flood or a loaded box) is retried before the fetch gives up with a TransferTimeoutError, not PeerLostError.
_CONNECT_BUSY_S = 10.0
_MAX_SERVER_CONNECTIONS = 1024

# Sealing constants (Linux); Python 3.11's fcntl may lack them.
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1024 + 9)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1024 + 10)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)
_MFD_FLAGS = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

# Control block: uint64 words. The header is followed by one token per export slot.
_MAGIC = 0x6B76636F72657368  # b"kvcoresh"
_LAYOUT_VERSION = 2
_W_MAGIC, _W_VERSION, _W_ALIVE, _W_PID = 0, 1, 2, 3
_HEADER_WORDS = 8
_SLOTS = 4096
_CTL_BYTES = 8 * (_HEADER_WORDS + _SLOTS)

_memmove = ctypes.memmove  # a CFUNCTYPE: releases the GIL while glibc copies
# Transfers up to this size are copied inside submit (a few microseconds; no thread hop), larger ones by the
# copy threads, which take at most _SLICE_BYTES of one transfer before serving the next: a small transfer
# never waits behind the whole of a large one.
_INLINE_BYTES = 256 * 1024
_SLICE_BYTES = 2 * 1024 * 1024
_COPY_THREADS = 2
_agent_seq = itertools.count(1)


class ShmOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The built-in shm agent's options: ``TransceiverConfig.agent_options`` with ``backend = "shm"``."""

    copy_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = _COPY_THREADS
    """Threads that copy transfers over 256 KiB (smaller ones are copied inside ``submit``); each serves
    every transfer in turn, 2 MiB at a time, so a small transfer never waits behind a large one."""


Name = Annotated[str, msgspec.Meta(max_length=1024)]


class _SegmentInfo(msgspec.Struct, array_like=True, frozen=True):
    id: int
    base: int  # address of the segment in the owner process
    size: int


class _ExportInfo(msgspec.Struct, array_like=True, frozen=True):
    address: int
    length: int
    slot: int
    token: int


class _Payload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The shm part of the descriptor: the owner's pid, its two sockets, its segments and exports (no file names)."""

    pid: int
    fds: Name  # abstract SOCK_SEQPACKET socket serving the memfds
    notify: Name  # abstract SOCK_DGRAM socket receiving notifications
    segments: Annotated[list[_SegmentInfo], msgspec.Meta(max_length=_MAX_SEGMENTS)]
    exports: Annotated[list[_ExportInfo], msgspec.Meta(max_length=_SLOTS)]
    host: Name = ""  # kvcore.hostinfo.host_identity() of the owner: a peer on another host is refused at load
    hostname: Name = ""  # for the error message only
    version: int = 1  # _PAYLOAD_VERSION of the owner's kvcore; checked at load


class _FdRequest(msgspec.Struct, array_like=True, frozen=True):
    """Client -> owner: I am agent ``client`` (``incarnation``); send me the memory of ``server``."""

    client: Name
    incarnation: Name
    server: Name
    server_incarnation: Name


class _FdReply(msgspec.Struct, array_like=True, frozen=True):
    """Owner -> client: who answers, and the segment behind each fd that follows the control block's fd."""

    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=4096)]
    server: Name
    incarnation: Name
    segments: Annotated[list[_SegmentInfo], msgspec.Meta(max_length=_MAX_SEGMENTS)]


_payload_decoder = msgspec.msgpack.Decoder(_Payload)
_PAYLOAD_VERSION = 1  # of _Payload; a peer with another one is refused at load
_request_decoder = msgspec.msgpack.Decoder(_FdRequest)
_reply_decoder = msgspec.msgpack.Decoder(_FdReply)
_notif_decoder = msgspec.msgpack.Decoder(tuple[str, bytes])
_encoder = msgspec.msgpack.Encoder()


def _address_of(mm: mmap.mmap) -> int:
    """The address of an mmap's first byte, without keeping a buffer export alive."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _peer_pid(sock: socket.socket) -> int:
    """The pid the kernel recorded for the other end of a connected UNIX socket (``SO_PEERCRED``)."""
    pid, _uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(pid)


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:  # pragma: no cover
            pass


def check_sealed_memfd(fd: int, min_size: int) -> None:
    """``RemoteAgentError`` unless ``fd`` is a regular file sealed against shrinking, of at least ``min_size`` bytes."""
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as exc:
        raise RemoteAgentError(f"the peer passed an fd that cannot be sealed (not a memfd): {exc}") from exc
    if not seals & F_SEAL_SHRINK:
        raise RemoteAgentError(
            f"the peer passed a memfd not sealed against shrinking (seals {seals:#x}): it could truncate it under us"
        )
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < min_size:
        raise RemoteAgentError(f"the peer passed a memfd of {st.st_size} bytes; its descriptor declares {min_size}")


def _merge_runs(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """Merge consecutive fragments that are contiguous on both sides; returns Python lists for the copy loop."""
    d, s, n, _ = merge_runs(dst, src, sizes)
    return d.tolist(), s.tolist(), n.tolist()


@dataclass(eq=False)
class _Segment:
    """A sealed memfd mapped in this process (one we own, with its fd; or one of a peer's, fd already closed)."""

    id: int
    size: int
    mm: mmap.mmap
    local: int  # address of the mapping in this process
    base: int = 0  # address in the owner process (== local for our own)
    fd: int = -1  # kept open for our own segments: it is what we pass to peers
    exports: int = 0  # live exported registrations inside (our own segments)

    def close(self) -> bool:
        """Unmap (and close our fd); False when tensors still hold the memory (freed with the last tensor)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.mm.close()
        except BufferError:
            return False
        return True


@dataclass(eq=False)
class _Export:
    segment: _Segment
    slot: int
    token: int


def _connect_fds(who: str, fds_name: str) -> socket.socket:
    """A connection to a peer's fd socket; ``PeerLostError`` only when nobody is there.

    ECONNREFUSED and ENOENT mean no process listens under that name: the peer closed or died. EAGAIN means the
    listen backlog is full: the owner is alive but has not accepted yet (a flood of idle connections, or a loaded
    box), so it is retried until ``_CONNECT_BUSY_S`` and then is a ``TransferTimeoutError``. Any other error is a
    ``TransferFailedError`` naming it: the peer may well be alive.
    """
    deadline = time.monotonic() + _CONNECT_BUSY_S
    pause = 0.001
    attempts = 0
    while True:
        attempts += 1
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        conn.settimeout(_FETCH_TIMEOUT_S)
        try:
            conn.connect(b"\0" + fds_name.encode())
            return conn
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            conn.close()
            raise PeerLostError(f"{who}: its shm socket is gone ({exc}); the peer agent closed or died") from exc
        except BlockingIOError as exc:
            conn.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(
                    f"{who}: its shm socket's listen backlog stayed full for {_CONNECT_BUSY_S:g} s "
                    f"({attempts} attempts, last: {exc}); the peer is alive but does not accept"
                ) from exc
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)
        except TimeoutError as exc:
            conn.close()
            raise TransferTimeoutError(f"{who}: connecting to its shm socket timed out ({exc})") from exc
        except OSError as exc:
            conn.close()
            raise TransferFailedError(f"{who}: connecting to its shm socket failed ({exc})") from exc


@dataclass(eq=False)
class _Peer:
    """What we keep per loaded peer: its identity, and once fetched its connection, control block and segments."""

    name: str
    incarnation: str
    pid: int
    fds_name: str
    notify: bytes
    payload: _Payload
    conn: socket.socket | None = None
    ctl_mm: mmap.mmap | None = None
    ctl_words: np.ndarray | None = None
    segments: dict[int, _Segment] = field(default_factory=dict)
    unshared: set[int] = field(default_factory=set)  # listed, but the owner no longer shares them (no live export)
    seg_base: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    seg_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    seg_local: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    reg_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    reg_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    reg_slot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    reg_token: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))

    @property
    def fetched(self) -> bool:
        """True when every segment the current descriptor lists is mapped here."""
        return self.ctl_words is not None and all(
            s.id in self.segments or s.id in self.unshared for s in self.payload.segments
        )

    def hung_up(self) -> bool:
        """True when the owner closed the connection that carried its fds (it never sends unsolicited data)."""
        if self.conn is None:
            return False
        p = select.poll()
        p.register(self.conn, select.POLLIN | select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0))
        return bool(p.poll(0))

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments = {}
        self.ctl_words = None  # drop the buffer export before unmapping
        if self.ctl_mm is not None:
            try:
                self.ctl_mm.close()
            except BufferError:  # pragma: no cover - a view escaped; the GC unmaps it
                log.warning("kvcore shm: control block of %r still in use; left to the garbage collector", self.name)
            self.ctl_mm = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@dataclass(eq=False)
class _Xfer:
    """A transfer: its copy job (None once copied inside submit) and a notification the peer's queue has not taken.

    ``pending`` is sent only after every byte landed.
    """

    pending: bytes | None
    address: bytes
    job: _Job | None = None
    error: TransferError | None = None  # set by the copy thread when the notification failed


@dataclass(eq=False)
class _Job:
    """One transfer's copy, run by the copy threads in slices: runs ``(dst, src, n)`` from ``i``/``off`` on."""

    dst: list[int]
    src: list[int]
    n: list[int]
    peer: _Peer
    handle_id: int
    xfer: _Xfer
    i: int = 0  # next run to copy
    off: int = 0  # bytes of run ``i`` already handed out
    active: int = 0  # slices being copied now
    finished: bool = False  # every byte landed

    @property
    def exhausted(self) -> bool:
        return self.i >= len(self.n)

    def take(self, limit: int) -> list[tuple[int, int, int]]:
        """The next slice: whole runs (and at most one part of a run) totalling at most ``limit`` bytes."""
        out: list[tuple[int, int, int]] = []
        left = limit
        while left > 0 and self.i < len(self.n):
            k = min(self.n[self.i] - self.off, left)
            out.append((self.dst[self.i] + self.off, self.src[self.i] + self.off, k))
            left -= k
            self.off += k
            if self.off == self.n[self.i]:
                self.i, self.off = self.i + 1, 0
        return out


class _CopyEngine:
    """Copy threads for the shm agent: every live job gets a slice in turn (round robin), so none waits for another.

    Threads start at the first job and stop at ``stop()``. ``wait_peer`` blocks until no job writes or reads a
    peer's mappings, so they are never unmapped under a copy.
    """

    def __init__(self, name: str, threads: int, on_done: Callable[[_Job], None]) -> None:
        self._name, self._nthreads, self._on_done = name, threads, on_done
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()  # jobs with slices left to hand out
        self._live: set[_Job] = set()  # jobs not finished
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def start(self, job: _Job) -> None:
        with self._cv:
            if self._stopping:
                raise TransferError("the shm agent is closing; no new copies")
            self._live.add(job)
            self._queue.append(job)
            if len(self._threads) < self._nthreads:
                t = threading.Thread(target=self._run, name=f"{self._name}-copy{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                pieces = job.take(_SLICE_BYTES)
                job.active += 1
                if not job.exhausted:
                    self._queue.append(job)  # its next slice after every other job's
            try:
                for d, s, k in pieces:
                    _memmove(d, s, k)
            finally:
                with self._cv:
                    job.active -= 1
                    done = job.exhausted and job.active == 0 and not job.finished
                    if done:
                        job.finished = True
                        self._live.discard(job)
                        self._cv.notify_all()
            if done:
                self._on_done(job)

    def wait_peer(self, peer: _Peer) -> None:
        """Return once no live job touches ``peer``'s mappings (copies always end: memmove cannot block)."""
        with self._cv:
            self._cv.wait_for(lambda: not any(j.peer is peer for j in self._live))

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def threads(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        """Finish every job, then end the threads."""
        with self._cv:
            self._cv.wait_for(lambda: not self._live)
            self._stopping = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)


class ShmAgent(TransferAgent):
    """Same-host agent over sealed memfds: WRITE and READ into peers' ``allocate_tensor`` memory.

    Transfers of up to 256 KiB are copied inside ``submit`` (DONE at the first
    poll); larger ones by the agent's copy threads (option ``copy_threads``,
    default 2), which serve every transfer in turn, 2 MiB at a time, and
    announce each end to the completion listener. A transfer is DONE once
    every byte landed and its notification was queued at the peer; while the
    peer's notification queue is full it stays PENDING and every poll
    retries, so ``wait(timeout)`` bounds it.
    The peer must have loaded this agent's descriptor before our first
    transfer to it (the capability rule in the module docstring).
    """

    backend: ClassVar[str] = "shm"
    capabilities: ClassVar[AgentCapabilities] = SHM_CAPABILITIES  # stated once, where the plugin registers it
    options_type: ClassVar[type[msgspec.Struct] | None] = ShmOptions

    def __init__(self, name: str, options: Mapping[str, Any] | ShmOptions | None = None) -> None:
        super().__init__(name, options)
        self.opts = convert_options(ShmOptions, options, owner="shm agent")
        self._prefix = f"kvcore-shm-{os.getpid()}-{process_incarnation()[:8]}-{next(_agent_seq)}"
        self._segments: dict[int, _Segment] = {}
        self._seg_ids = itertools.count(1)
        self._seg_lock = threading.Lock()  # _segments is read by the serving thread
        self._free_slots = list(range(_SLOTS - 1, -1, -1))
        self._notifications: deque[Notification] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refused = 0  # fd requests and notifications refused (read by tests and operators)
        self._send_lock = threading.Lock()  # a notification is sent once, by a copy thread or by poll
        self._engine = _CopyEngine(f"kvcore-shm-{name}", self.opts.copy_threads, self._copied)

        ctl_fd = self._new_memfd("ctl", _CTL_BYTES)
        try:
            self._ctl_mm = mmap.mmap(ctl_fd, _CTL_BYTES)
        except BaseException:
            os.close(ctl_fd)
            raise
        self._ctl_fd = ctl_fd
        self._ctl = np.frombuffer(self._ctl_mm, dtype=np.uint64)
        self._ctl[_W_VERSION], self._ctl[_W_PID], self._ctl[_W_ALIVE] = _LAYOUT_VERSION, os.getpid(), 1
        self._ctl[_W_MAGIC] = _MAGIC  # last: a reader that sees the magic sees a complete header

        self._notify_name = f"{self._prefix}-notify"
        self._rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._rx.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # the kernel tells us each sender's pid
        self._rx.bind(b"\0" + self._notify_name.encode())
        self._rx.setblocking(False)
        self._tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._tx.setblocking(False)
        self._fds_name = f"{self._prefix}-fds"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind(b"\0" + self._fds_name.encode())
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._conns: dict[socket.socket, bool] = {}  # accepted -> served once; touched by the serving thread only
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve_loop, name=f"kvcore-shm-{name}", daemon=True)
        self._thread.start()

    # --- memory ------------------------------------------------------------------------------

    def _new_memfd(self, what: str, size: int) -> int:
        """A memfd of ``size`` bytes, sealed: it can never shrink or grow, and its seals never change again."""
        fd = os.memfd_create(f"{self._prefix}-{what}", _MFD_FLAGS)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def allocate_tensor(self, shape: Sequence[int], dtype: Any, device: str = "cpu") -> torch.Tensor:
        """A zeroed CPU tensor inside a new sealed shared-memory segment of this agent."""
        import torch

        self._check_open()
        if torch.device(device).type != "cpu":
            raise UnsupportedOperationError(f"shm agent allocates DRAM only; got device {device!r}")
        shape = tuple(int(s) for s in shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        if len(self._segments) >= _MAX_SEGMENTS:
            raise RegistrationError(f"shm agent {self.name!r} already has {_MAX_SEGMENTS} segments")
        seg_id = next(self._seg_ids)
        try:
            fd = self._new_memfd(f"s{seg_id}", size)
        except OSError as exc:
            raise RegistrationError(f"shm agent could not allocate a {size}-byte memfd: {exc}") from exc
        try:
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            raise RegistrationError(f"shm agent could not map a {size}-byte memfd: {exc}") from exc
        local = _address_of(mm)
        with self._seg_lock:
            self._segments[seg_id] = _Segment(seg_id, size, mm, local, local, fd)
        # np.frombuffer holds a buffer export, so the mapping outlives close() while a tensor uses it.
        flat = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=nbytes))
        return flat.view(dtype).reshape(shape)

    def _register(self, region: MemoryRegion, keepalive: Any) -> _Export | None:
        for seg in self._segments.values():
            if seg.local <= region.address and region.end <= seg.local + seg.size:
                break
        else:
            return None  # ordinary memory: usable locally, never offered to peers
        if not self._free_slots:
            raise RegistrationError(f"shm agent {self.name!r} has all {_SLOTS} export slots in use")
        # Random, so a descriptor can only name exports it was given, never guess one.
        export = _Export(seg, self._free_slots.pop(), secrets.randbits(63) + 1)
        self._ctl[_HEADER_WORDS + export.slot] = export.token
        with self._seg_lock:
            seg.exports += 1
        return export

    def _deregister(self, registration: Registration) -> None:
        export: _Export | None = registration.native
        if export is not None:
            # Zeroed before anything else, so a sender holding the old descriptor is refused from now on.
            self._ctl[_HEADER_WORDS + export.slot] = 0
            self._free_slots.append(export.slot)
            with self._seg_lock:
                export.segment.exports -= 1

    def _exported(self, registration: Registration) -> bool:
        return registration.native is not None

    # --- descriptors and peers -----------------------------------------------------------------

    def _descriptor_payload(self) -> bytes:
        exports = [(r.region, r.native) for r in self._registrations.values() if r.native is not None]
        used = {e.segment.id: e.segment for _, e in exports}
        return _encoder.encode(
            _Payload(
                pid=os.getpid(),
                fds=self._fds_name,
                notify=self._notify_name,
                segments=[_SegmentInfo(s.id, s.base, s.size) for s in used.values()],
                exports=[_ExportInfo(r.address, r.length, e.slot, e.token) for r, e in exports],
                host=host_identity(),
                hostname=hostname(),
            )
        )

    def _identity_payload(self) -> bytes:
        # A peer that writes into our memory must be loaded here (we serve fds only to loaded, exposed peers)
        # and so must know our pid and sockets, but it gets no segment and no export of ours to use.
        return _encoder.encode(
            _Payload(
                pid=os.getpid(),
                fds=self._fds_name,
                notify=self._notify_name,
                segments=[],
                exports=[],
                host=host_identity(),
                hostname=hostname(),
            )
        )

    def _load_remote(self, descriptor: AgentDescriptor, previous: RemoteAgent | None) -> _Peer:
        payload = self._decode_payload(descriptor)
        who = f"peer {descriptor.name!r}"
        if payload.fds == self._fds_name or (payload.pid == os.getpid() and descriptor.name == self.name):
            raise RemoteAgentError(
                f"{who}: the descriptor is this agent's own (a replay?); an agent never loads itself"
            )
        require_same_host(
            "shm",
            descriptor.name,
            payload.host,
            peer_hostname=payload.hostname,
            socket_address=b"\0" + payload.notify.encode(),
        )
        # The same owner (pid and sockets, ``_same_agent``): another agent under a loaded name was refused, or its
        # gone predecessor unloaded, by ``load_remote_agent`` before this.
        old: _Peer | None = previous.native if previous is not None else None
        peer = _Peer(
            descriptor.name, descriptor.incarnation, payload.pid, payload.fds, b"\0" + payload.notify.encode(), payload
        )
        if old is not None:
            # Same owner: keep the connection, the control block and every segment it still lists unchanged.
            self._engine.wait_peer(old)  # segments it no longer lists are unmapped below
            peer.conn, peer.ctl_mm, peer.ctl_words = old.conn, old.ctl_mm, old.ctl_words
            wanted = {(s.id, s.base, s.size) for s in payload.segments}
            for sid, seg in old.segments.items():
                if (sid, seg.base, seg.size) in wanted:
                    peer.segments[sid] = seg
                else:
                    seg.close()
            old.conn, old.ctl_mm, old.ctl_words, old.segments = None, None, None, {}
        self._index(peer)
        return peer

    def _same_agent(self, loaded: RemoteAgent, descriptor: AgentDescriptor) -> bool:
        """A refresh names the same pid and sockets: another agent object of the process is another agent."""
        old: _Peer = loaded.native
        payload = self._decode_payload(descriptor)
        return (old.pid, old.fds_name, old.payload.notify) == (payload.pid, payload.fds, payload.notify)

    def _peer_gone(self, loaded: RemoteAgent) -> bool:
        """Gone once its connection hung up, or (not fetched yet) its socket accepts nobody."""
        return not self._still_alive(loaded.native)

    def _describe_agent(self, descriptor: AgentDescriptor) -> str:
        payload = self._decode_payload(descriptor)
        return f"{descriptor.incarnation[:8]}, pid {payload.pid}, socket {payload.fds!r}"

    @staticmethod
    def _still_alive(old: _Peer) -> bool:
        """Whether a loaded peer may still be serving: its connection is up, or its socket still accepts."""
        if old.conn is not None:
            return not old.hung_up()
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        probe.settimeout(1.0)
        try:
            probe.connect(b"\0" + old.fds_name.encode())
            return True
        except BlockingIOError:  # a full backlog: someone is there, only busy
            return True
        except OSError:
            return False
        finally:
            probe.close()

    @staticmethod
    def _index(peer: _Peer) -> None:
        """Rebuild the lookup arrays from the mapped segments and the descriptor's exports."""
        segs = sorted(peer.segments.values(), key=lambda s: s.base)
        peer.seg_base = np.array([s.base for s in segs], dtype=np.uint64)
        peer.seg_end = np.array([s.base + s.size for s in segs], dtype=np.uint64)
        peer.seg_local = np.array([s.local for s in segs], dtype=np.uint64)
        exports = sorted(peer.payload.exports, key=lambda e: e.address)
        peer.reg_start = np.array([e.address for e in exports], dtype=np.uint64)
        peer.reg_end = np.array([e.address + e.length for e in exports], dtype=np.uint64)
        peer.reg_slot = np.array([e.slot for e in exports], dtype=np.int64)
        peer.reg_token = np.array([e.token for e in exports], dtype=np.uint64)

    def _decode_payload(self, descriptor: AgentDescriptor) -> _Payload:
        """Decode and bound-check a peer's payload; every problem is a ``RemoteAgentError`` naming the field."""
        who = f"peer {descriptor.name!r}"
        payload = self.decode_payload(descriptor, _payload_decoder, version=_PAYLOAD_VERSION)
        for what, sock in (("fds", payload.fds), ("notify", payload.notify)):
            if not _SOCK_RE.match(sock) or not sock.endswith(f"-{what}"):
                raise RemoteAgentError(f"{who}: shm {what} socket name {sock!r} is not a kvcore shm name")
        if payload.pid <= 0:
            raise RemoteAgentError(f"{who}: shm pid must be > 0, got {payload.pid}")
        ids = set()
        for s in payload.segments:
            if not (0 < s.size <= _MAX_SEGMENT_BYTES) or s.base <= 0 or s.id <= 0 or s.id in ids:
                raise RemoteAgentError(f"{who}: shm segment {s.id} has base {s.base:#x} size {s.size}")
            ids.add(s.id)
        for e in payload.exports:
            if not 0 <= e.slot < _SLOTS or e.token <= 0:
                raise RemoteAgentError(f"{who}: export slot {e.slot} token {e.token}: expected slot < {_SLOTS}")
            if not any(s.base <= e.address and e.address + e.length <= s.base + s.size for s in payload.segments):
                raise RemoteAgentError(
                    f"{who}: exported range [{e.address:#x}, +{e.length}) lies in none of its shm segments"
                )
        listed = {(r.address, r.length) for r in descriptor.regions}
        exported = {(e.address, e.length) for e in payload.exports}
        if listed != exported:
            raise RemoteAgentError(
                f"{who}: descriptor regions ({len(listed)}) and shm exports ({len(exported)}) disagree"
            )
        return payload

    def _unload_remote(self, remote: RemoteAgent) -> None:
        peer: _Peer = remote.native
        self._engine.wait_peer(peer)  # never unmap under a copy
        peer.close()

    # --- fetching a peer's memory (client side) -------------------------------------------------

    def _fetch(self, remote: RemoteAgent) -> None:
        """Get the peer's control block and segments as sealed memfds over its socket, check them and map them."""
        peer: _Peer = remote.native
        who = f"peer {peer.name!r} (pid {peer.pid})"
        if peer.conn is None:
            conn = _connect_fds(who, peer.fds_name)
            served_by = _peer_pid(conn)
            if served_by != peer.pid:
                conn.close()
                raise RemoteAgentError(
                    f"{who}: the socket its descriptor names is served by pid {served_by}, not {peer.pid}; refused"
                )
            peer.conn = conn
        received: list[int] = []
        try:
            request = _FdRequest(self.name, process_incarnation(), peer.name, peer.incarnation)
            peer.conn.send(_encoder.encode(request))
            data, fds, flags, _ = socket.recv_fds(peer.conn, _MAX_REPLY_BYTES, _FDS_PER_MESSAGE + 3)
            received += fds
            if not data:
                raise PeerLostError(f"{who}: closed the connection instead of answering; the peer agent closed or died")
            check_msgpack_bounds(data, error=RemoteAgentError)
            try:
                reply = _reply_decoder.decode(data)
            except msgspec.DecodeError as exc:
                raise RemoteAgentError(f"{who}: malformed fd reply: {exc}") from exc
            if not reply.ok:
                raise RemoteAgentError(f"{who} refused to share its memory: {reply.error}")
            if (reply.server, reply.incarnation) != (peer.name, peer.incarnation):
                raise RemoteAgentError(
                    f"{who}: the process behind the socket is agent {reply.server!r} (incarnation "
                    f"{reply.incarnation[:8]}), not the one the descriptor names; refused"
                )
            while len(received) < 1 + len(reply.segments) and not flags & socket.MSG_CTRUNC:
                _, more, flags, _ = socket.recv_fds(peer.conn, 16, _FDS_PER_MESSAGE + 3)
                if not more:
                    break
                received += more
            if flags & socket.MSG_CTRUNC or len(received) != 1 + len(reply.segments):
                raise RemoteAgentError(
                    f"{who}: sent {len(received)} fds for a control block and {len(reply.segments)} segments"
                )
            if peer.ctl_words is None:
                self._map_control(who, peer, received[0])
            offered = {s.id: (s, fd) for s, fd in zip(reply.segments, received[1:])}
            for want in peer.payload.segments:
                if want.id in peer.segments:
                    continue
                got = offered.get(want.id)
                if got is None:  # no live export in it any more: every fragment there is refused as stale
                    peer.unshared.add(want.id)
                    continue
                if (got[0].base, got[0].size) != (want.base, want.size):
                    raise RemoteAgentError(
                        f"{who}: shared segment {want.id} at {got[0].base:#x} size {got[0].size}; its descriptor says "
                        f"{want.base:#x} size {want.size}"
                    )
                check_sealed_memfd(got[1], want.size)
                # MAP_POPULATE: map every page now (paid once) rather than a minor fault per page in the first writes.
                mm = mmap.mmap(got[1], want.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                peer.segments[want.id] = _Segment(want.id, want.size, mm, _address_of(mm), want.base)
        except TimeoutError as exc:  # alive (it accepted) but silent: stopped or starved, not gone
            peer.conn.close()
            peer.conn = None
            raise TransferTimeoutError(
                f"{who}: accepted the connection but did not answer the fd request within {_FETCH_TIMEOUT_S:g} s"
            ) from exc
        except OSError as exc:
            peer.conn.close()
            peer.conn = None
            raise PeerLostError(f"{who}: fetching its memory failed: {exc}") from exc
        except KvcoreError:
            peer.conn.close()
            peer.conn = None
            raise
        finally:
            _close_fds(received)  # the mappings keep the memory; no fd of a peer stays open here
        self._index(peer)

    @staticmethod
    def _map_control(who: str, peer: _Peer, fd: int) -> None:
        check_sealed_memfd(fd, _CTL_BYTES)
        mm = mmap.mmap(fd, _CTL_BYTES)
        words = np.frombuffer(mm, dtype=np.uint64)
        if int(words[_W_MAGIC]) != _MAGIC or int(words[_W_VERSION]) != _LAYOUT_VERSION:
            del words
            mm.close()
            raise RemoteAgentError(f"{who}: its control block is not a kvcore shm control block of layout v2")
        peer.ctl_mm, peer.ctl_words = mm, words

    def _check_alive(self, peer: _Peer) -> None:
        """Raise ``PeerLostError`` when the peer closed its agent or its process died."""
        assert peer.ctl_words is not None
        if int(peer.ctl_words[_W_ALIVE]) != 1:
            raise PeerLostError(f"peer {peer.name!r} (pid {peer.pid}) closed its shm agent")
        if peer.hung_up():
            raise PeerLostError(f"peer {peer.name!r} (pid {peer.pid}) died (its shm connection hung up)")

    # --- serving our memory (owner side, on the serving thread) -----------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # BlockingIOError: none pending; anything else: closing
                return
            if len(self._conns) >= _MAX_SERVER_CONNECTIONS:
                # Make room by dropping the oldest connection that was never served (a stranger can open many,
                # but only loaded agents get served); when every one was served, refuse the newcomer.
                idle = next((c for c, served in self._conns.items() if not served), None)
                if idle is None:
                    self.refused += 1
                    conn.close()
                    continue
                self._drop_conn(idle)
            conn.setblocking(False)
            self._conns[conn] = False

    def _serve(self, conn: socket.socket) -> None:
        """Answer one fd request on ``conn``; a refused or broken connection is closed."""
        try:
            data = conn.recv(_MAX_REQUEST_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop_conn(conn)
            return
        try:
            pid = _peer_pid(conn)
            error = self._refusal(data, pid)
        except Exception as exc:  # nothing a client sends may stop this thread
            error = f"malformed request: {type(exc).__name__}"
        try:
            if error:
                self.refused += 1
                log.warning("kvcore shm agent %r refused its memory to pid %s: %s", self.name, pid, error)
                conn.send(_encoder.encode(_FdReply(False, error, self.name, process_incarnation(), [])))
                self._drop_conn(conn)
                return
            with self._seg_lock:
                segs = [s for s in self._segments.values() if s.exports > 0 and s.fd >= 0]
                fds = [self._ctl_fd] + [s.fd for s in segs]
                head = _encoder.encode(
                    _FdReply(
                        True, "", self.name, process_incarnation(), [_SegmentInfo(s.id, s.base, s.size) for s in segs]
                    )
                )
                socket.send_fds(conn, [head], fds[:_FDS_PER_MESSAGE])
                for i in range(_FDS_PER_MESSAGE, len(fds), _FDS_PER_MESSAGE):
                    socket.send_fds(conn, [b"+"], fds[i : i + _FDS_PER_MESSAGE])
            self._conns[conn] = True
        except OSError:
            self._drop_conn(conn)

    def _refusal(self, data: bytes, pid: int) -> str:
        """Why the process ``pid`` may not have our memory ('' when it may): the capability rule."""
        check_msgpack_bounds(data, error=RemoteAgentError)
        req = _request_decoder.decode(data)
        if (req.server, req.server_incarnation) != (self.name, process_incarnation()):
            return f"this is agent {self.name!r}, not {req.server!r} (incarnation {req.server_incarnation[:8]})"
        remote = self._remotes.get(req.client)
        peer = remote.native if remote is not None else None
        if not isinstance(peer, _Peer) or peer.incarnation != req.incarnation:
            return f"agent {req.client!r} (incarnation {req.incarnation[:8]}) is not loaded here"
        if peer.pid != pid:
            return f"agent {req.client!r} is loaded with pid {peer.pid}; the request comes from pid {pid}"
        if not self.exposed_to(req.client):
            return f"agent {req.client!r} is loaded here but not given access to this agent's memory"
        return ""

    def _drop_conn(self, conn: socket.socket) -> None:
        self._conns.pop(conn, None)
        conn.close()

    # --- transfers ---------------------------------------------------------------------------

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> _Xfer:
        peer: _Peer = remote.native
        message = None
        if handle.notification is not None:
            message = _encoder.encode((self.name, handle.notification))
            if len(message) > _MAX_NOTIFICATION_BYTES:
                raise TransferError(
                    f"notification is {len(handle.notification)} bytes; the shm agent carries at most "
                    f"{_MAX_NOTIFICATION_BYTES - len(self.name) - 16}"
                )
        if not peer.fetched:
            self._fetch(remote)
        self._check_alive(peer)
        mapped = self._translate(remote.name, peer, remote_addrs, sizes)
        if handle.op is TransferOp.WRITE:
            dst, src, n = _merge_runs(mapped, local, sizes)
        else:
            dst, src, n = _merge_runs(local, mapped, sizes)
        xfer = _Xfer(message, peer.notify)
        if handle.nbytes > _INLINE_BYTES:
            xfer.job = _Job(dst, src, n, peer, handle.id, xfer)
            self._engine.start(xfer.job)  # DONE once the copy threads moved every byte
            return xfer
        for d, s, k in zip(dst, src, n):
            _memmove(d, s, k)
        self._send_pending(remote.name, xfer)
        return xfer

    def _copied(self, job: _Job) -> None:
        """A copy thread moved every byte of ``job``: queue its notification, tell the listener."""
        try:
            self._send_pending(job.peer.name, job.xfer)
        except TransferError as exc:
            job.xfer.error = exc  # the next poll reports it
        self._announce(job.handle_id)

    def _translate(self, peer_name: str, peer: _Peer, addrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Peer addresses -> addresses of our mappings, refusing any fragment outside a live export."""
        if addrs.size == 0:
            return addrs
        assert peer.ctl_words is not None
        # Stale-descriptor guard first (it needs only the control block): every export a fragment touches must
        # still carry the token we were given. The base class already confined fragments to listed exports.
        ends = addrs + sizes
        live = peer.ctl_words[_HEADER_WORDS + peer.reg_slot] == peer.reg_token
        dead_before = np.concatenate(([0], np.cumsum(~live)))
        lo = np.searchsorted(peer.reg_start, addrs, side="right").astype(np.int64) - 1
        hi = np.searchsorted(peer.reg_start, ends - 1, side="right").astype(np.int64) - 1
        stale = (lo < 0) | (dead_before[hi + 1] - dead_before[np.maximum(lo, 0)] > 0)
        if stale.any():
            i = int(np.flatnonzero(stale)[0])
            raise RemoteRangeError(
                f"fragment {i}: remote range [{int(addrs[i]):#x}, +{int(sizes[i])}) was deregistered by peer "
                f"{peer_name!r} ({int(stale.sum())} of {addrs.size} fragments affected); reload its descriptor; "
                "nothing was moved"
            )
        seg = np.searchsorted(peer.seg_base, addrs, side="right").astype(np.int64) - 1
        ok = seg >= 0
        seg = np.where(ok, seg, 0)
        ok &= ends <= peer.seg_end[seg] if peer.seg_end.size else np.zeros(addrs.size, dtype=bool)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise RemoteRangeError(
                f"fragment {i}: remote range [{int(addrs[i]):#x}, +{int(sizes[i])}) is not inside one shm segment "
                f"of peer {peer_name!r}; nothing was moved"
            )
        out: np.ndarray = peer.seg_local[seg] + (addrs - peer.seg_base[seg])
        return out

    def _send_pending(self, peer_name: str, xfer: _Xfer) -> None:
        with self._send_lock:  # a copy thread and a poll may both try: the notification goes once
            if xfer.pending is None:
                return
            try:
                self._tx.sendto(xfer.pending, xfer.address)
            except BlockingIOError:
                return  # the peer's queue is full; _poll retries until the caller's wait() deadline
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                raise PeerLostError(
                    f"peer {peer_name!r} no longer receives notifications ({exc}); it closed or died"
                ) from exc
            except OSError as exc:
                raise TransferFailedError(f"notification to peer {peer_name!r} failed: {exc}") from exc
            xfer.pending = None

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        xfer: _Xfer = handle.native
        if xfer.job is not None and not xfer.job.finished:
            return TransferStatus.PENDING  # bytes still moving
        if xfer.error is not None:
            raise xfer.error
        self._send_pending(handle.remote, xfer)
        return TransferStatus.PENDING if xfer.pending is not None else TransferStatus.DONE

    def _release(self, handle: TransferHandle) -> None:
        pass  # nothing native: released only when terminal, so its copy has ended

    # --- the serving thread: notifications and fd requests ------------------------------------------

    def _serve_loop(self) -> None:
        fixed = (self._rx.fileno(), self._wake_r.fileno(), self._listener.fileno())
        while not self._stop.is_set():
            try:
                # poll, not select: the fd numbers of up to 1024 connections may exceed FD_SETSIZE.
                poller = select.poll()
                conns = {c.fileno(): c for c in self._conns}
                for fd in (*fixed, *conns):
                    poller.register(fd, select.POLLIN)
                ready = {fd for fd, _ in poller.poll(1000)}
                if fixed[0] in ready:
                    self._drain_socket()
                if fixed[2] in ready:
                    self._accept()
                for fd in ready & conns.keys():
                    self._serve(conns[fd])
            except Exception:  # pragma: no cover - nothing may stop this thread
                if not self._stop.is_set():
                    log.exception("kvcore shm agent %r: serving thread error (kept serving)", self.name)

    def _drain_socket(self) -> None:
        # Under the lock, so the thread and get_notifications() never reorder datagrams between them.
        with self._lock:
            while True:
                try:
                    data, anc, _, _ = self._rx.recvmsg(_MAX_NOTIFICATION_BYTES + 1, socket.CMSG_SPACE(_UCRED.size))
                except OSError:  # BlockingIOError: drained; anything else: closing
                    return
                pid = next(
                    (
                        _UCRED.unpack(d[: _UCRED.size])[0]
                        for lvl, typ, d in anc
                        if lvl == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS and len(d) >= _UCRED.size
                    ),
                    0,
                )
                try:
                    check_msgpack_bounds(data, error=RemoteAgentError)
                    sender, message = _notif_decoder.decode(data)
                except (msgspec.DecodeError, RemoteAgentError) as exc:
                    log.warning(
                        "kvcore shm agent %r dropped a malformed notification (%d bytes): %s", self.name, len(data), exc
                    )
                    continue
                remote = self._remotes.get(sender)
                peer = remote.native if remote is not None else None
                if not isinstance(peer, _Peer) or peer.pid != pid:
                    self.refused += 1
                    log.warning(
                        "kvcore shm agent %r dropped a notification naming %r from pid %d: no such agent loaded here "
                        "with that pid",
                        self.name,
                        sender[:64],
                        pid,
                    )
                    continue
                self._notifications.append(Notification(sender, message))

    def _get_notifications(self) -> list[Notification]:
        self._drain_socket()  # do not wait for the thread's next wake-up
        with self._lock:
            out = list(self._notifications)
            self._notifications.clear()
        return out

    # --- lifecycle -----------------------------------------------------------------------------

    def _close(self) -> None:
        self._engine.stop()  # every copy lands before anything is unmapped
        self._ctl[_W_ALIVE] = 0  # a peer that still maps us sees "closed", not "died"
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._conns.clear()
        for s in (self._rx, self._tx, self._listener, self._wake_r, self._wake_w):
            s.close()
        del self._ctl
        try:
            self._ctl_mm.close()
        except BufferError:  # pragma: no cover - a view escaped; the GC unmaps it
            log.warning("kvcore shm agent %r: control block still in use at close", self.name)
        os.close(self._ctl_fd)
        with self._seg_lock:
            for seg in self._segments.values():
                seg.close()  # memory still used by tensors is freed with the last of them
            self._segments.clear()

    def _native_resources(self) -> dict[str, int]:
        peers = [r.native for r in self._remotes.values() if isinstance(r.native, _Peer)]
        return {
            "shm_segments": len(self._segments),
            "peer_mappings": sum(len(p.segments) for p in peers),
            "peer_connections": sum(p.conn is not None for p in peers),
            "served_connections": len(self._conns),
            "threads": int(self._thread.is_alive()) + self._engine.threads,
            "copy_jobs": self._engine.live,
        }
