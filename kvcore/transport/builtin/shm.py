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

The agent is spread over one module per side of that rule: ``shm_protocol`` (what agents tell each other),
``shm_memory`` (sealed segments, the memfd check), ``shm_peer`` (the client side: fetching, checking and mapping
a peer's memory), ``shm_serving`` (the owner side: the serving thread) and ``shm_copy`` (the copy threads); this
module holds the agent itself: its options, memory, descriptors, transfers and close.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import math
import mmap
import os
import secrets
import socket
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import msgspec
import numpy as np

from kvcore.errors import (
    PeerLostError,
    RegistrationError,
    RemoteAgentError,
    TransferError,
    TransferFailedError,
    UnsupportedOperationError,
)
from kvcore.extension.convert import convert_options
from kvcore.hostinfo import host_identity, hostname
from kvcore.transport.agent import (
    AgentCapabilities,
    AgentDescriptor,
    MemoryRegion,
    Notification,
    Registration,
    RemoteAgent,
    TransferHandle,
    TransferOp,
    TransferStatus,
    process_incarnation,
)
from kvcore.transport.builtin.hostcheck import require_same_host
from kvcore.transport.builtin.plugin import SHM_CAPABILITIES
from kvcore.transport.builtin.shm_copy import (
    _COPY_THREADS,
    _INLINE_BYTES,
    _CopyEngine,
    _Job,
    _memmove,
    _merge_runs,
    _Xfer,
)
from kvcore.transport.builtin.shm_memory import _address_of, _Export, _Segment
from kvcore.transport.builtin.shm_peer import _check_alive, _fetch, _index, _Peer, _still_alive, _translate
from kvcore.transport.builtin.shm_protocol import (
    _CTL_BYTES,
    _HEADER_WORDS,
    _LAYOUT_VERSION,
    _MAGIC,
    _MAX_NOTIFICATION_BYTES,
    _MAX_SEGMENT_BYTES,
    _MAX_SEGMENTS,
    _MFD_FLAGS,
    _PAYLOAD_VERSION,
    _SLOTS,
    _SOCK_RE,
    _W_ALIVE,
    _W_MAGIC,
    _W_PID,
    _W_VERSION,
    F_ADD_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    _encoder,
    _ExportInfo,
    _Payload,
    _payload_decoder,
    _SegmentInfo,
)
from kvcore.transport.builtin.shm_serving import ShmServing

if TYPE_CHECKING:
    import torch

__all__ = ["ShmAgent", "ShmOptions"]

log = logging.getLogger("kvcore.shm")

_PAGE = mmap.PAGESIZE
_agent_seq = itertools.count(1)


class ShmOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The built-in shm agent's options: ``TransceiverConfig.agent_options`` with ``backend = "shm"``."""

    copy_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = _COPY_THREADS
    """Threads that copy transfers over 256 KiB (smaller ones are copied inside ``submit``); each serves
    every transfer in turn, 2 MiB at a time, so a small transfer never waits behind a large one."""


class ShmAgent(ShmServing):
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
        _index(peer)
        return peer

    def _same_agent(self, loaded: RemoteAgent, descriptor: AgentDescriptor) -> bool:
        """A refresh names the same pid and sockets: another agent object of the process is another agent."""
        old: _Peer = loaded.native
        payload = self._decode_payload(descriptor)
        return (old.pid, old.fds_name, old.payload.notify) == (payload.pid, payload.fds, payload.notify)

    def _peer_gone(self, loaded: RemoteAgent) -> bool:
        """Gone once its connection hung up, or (not fetched yet) its socket accepts nobody."""
        return not _still_alive(loaded.native)

    def _describe_agent(self, descriptor: AgentDescriptor) -> str:
        payload = self._decode_payload(descriptor)
        return f"{descriptor.incarnation[:8]}, pid {payload.pid}, socket {payload.fds!r}"

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
            _fetch(self.name, remote)
        _check_alive(peer)
        mapped = _translate(remote.name, peer, remote_addrs, sizes)
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
