"""The built-in same-host shared-memory transfer agent (backend ``shm``): real cross-process copies, no native library.

How it works:

* ``allocate_tensor`` puts tensors in POSIX shared-memory segments this agent
  owns (files under ``/dev/shm`` opened and mapped directly, so Python's
  ``resource_tracker`` is never involved). Registrations inside a segment are
  *exported*: the descriptor names the segment, its base address in the owner
  and a (slot, token) pair in the owner's control block. Registrations of
  ordinary memory are allowed but stay local (a transfer source, or a READ
  destination); they are not listed in the descriptor.
* The initiator maps the peer's segments once per peer and copies every merged
  run of fragments with ``memmove`` (glibc, the GIL released) after validating
  every fragment against the peer's segments and its control block.
* Each agent owns a control segment: a header (magic, alive flag, pid) and one
  token per exported registration. Deregistering zeroes the token first, so a
  sender still holding the old descriptor is refused with ``RemoteRangeError``.
  The owner holds an exclusive ``flock`` on the control file for its whole
  life; a sender that can take a shared lock knows the owner is dead
  (``PeerLostError``) and unlinks the dead owner's segments so they do not
  leak.
* Notifications travel on a UNIX datagram socket in the abstract namespace
  (nothing on disk to leak) and are sent only after the copy returned, so the
  receiver never sees a notification before its data. A small thread drains
  the socket so senders are never blocked by the kernel's short datagram queue.
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
import select
import socket
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import numpy as np

from kvcore.agent import (
    AgentCapabilities,
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
    process_incarnation,
)
from kvcore.errors import (
    PeerLostError,
    RegistrationError,
    RemoteAgentError,
    RemoteRangeError,
    TransferError,
    TransferFailedError,
    UnsupportedOperationError,
)

if TYPE_CHECKING:
    import torch

__all__ = ["ShmAgent"]

log = logging.getLogger("kvcore.shm")

SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE
_NAME_RE = re.compile(r"^kvcore-shm-[0-9]{1,10}-[0-9a-f]{8}-[0-9]{1,10}-(ctl|s[0-9]{1,10})$")
_SOCK_RE = re.compile(r"^kvcore-shm-[0-9]{1,10}-[0-9a-f]{8}-[0-9]{1,10}-notify$")
_MAX_SEGMENT_BYTES = 1 << 40
_MAX_NOTIFICATION_BYTES = 60 * 1024  # one datagram, well under the default socket buffer

# Control block: uint64 words. The header is followed by one token per export slot.
_MAGIC = 0x6B76636F72657368  # b"kvcoresh"
_LAYOUT_VERSION = 1
_W_MAGIC, _W_VERSION, _W_ALIVE, _W_PID = 0, 1, 2, 3
_HEADER_WORDS = 8
_SLOTS = 4096
_CTL_BYTES = 8 * (_HEADER_WORDS + _SLOTS)

_memmove = ctypes.memmove  # a CFUNCTYPE: releases the GIL while glibc copies
_agent_seq = itertools.count(1)


class _SegmentInfo(msgspec.Struct, array_like=True, frozen=True):
    name: str
    base: int  # address of the segment in the owner process
    size: int


class _ExportInfo(msgspec.Struct, array_like=True, frozen=True):
    address: int
    length: int
    slot: int
    token: int


class _Payload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The shm part of the descriptor: where the control block, notification socket and segments are."""

    ctl: str
    sock: str
    pid: int
    segments: list[_SegmentInfo]
    exports: list[_ExportInfo]


_payload_decoder = msgspec.msgpack.Decoder(_Payload)
_notif_decoder = msgspec.msgpack.Decoder(tuple[str, bytes])
_encoder = msgspec.msgpack.Encoder()


_SWEPT_PID = 0
_SWEEP_MIN_AGE_S = 30.0  # never touch files young enough to belong to an agent still being created


def sweep_dead_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink the files of shm agents whose process died without closing (SIGKILL, crash).

    Proof of death is the owner's ``flock`` on its control file: if we can take
    it, nobody holds it. Files younger than 30 s are left alone (the owner may be
    between creating its control file and locking it). Segment files whose
    control file is already gone are removed once their creator pid is gone.
    Returns the unlinked paths. Called once per process by the first ``ShmAgent``.
    """
    import re
    import time

    now = time.time()
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    pattern = re.compile(r"\Akvcore-shm-(\d+)-[0-9a-f]+-\d+")
    by_prefix: dict[str, list[str]] = {}
    for n in names:
        m = pattern.match(n)
        if m:
            by_prefix.setdefault(m.group(0), []).append(n)
    for prefix, files in by_prefix.items():
        paths = [os.path.join(directory, f) for f in files]
        try:
            if any(now - os.stat(p).st_mtime < _SWEEP_MIN_AGE_S for p in paths):
                continue
        except FileNotFoundError:
            continue
        ctl = os.path.join(directory, f"{prefix}-ctl")
        if os.path.exists(ctl):
            try:
                fd = os.open(ctl, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue  # alive: its owner holds the lock
            try:
                _unlink_quietly(paths)
                removed.extend(paths)
            finally:
                os.close(fd)
        else:
            pid = int(prefix.split("-")[2])
            try:
                os.kill(pid, 0)
                continue
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            _unlink_quietly(paths)
            removed.extend(paths)
    if removed:
        log.info("kvcore shm: removed %d file(s) left by dead agents", len(removed))
    return removed


def _address_of(mm: mmap.mmap) -> int:
    """The address of an mmap's first byte, without keeping a buffer export alive."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _unlink_quietly(paths: Sequence[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # pragma: no cover - permissions changed under us
            log.warning("kvcore shm: could not unlink %s: %s", path, exc)


def _merge_runs(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """Merge consecutive fragments that are contiguous on both sides; returns Python lists for the copy loop."""
    if sizes.size > 1:
        joins = (dst[:-1] + sizes[:-1] == dst[1:]) & (src[:-1] + sizes[:-1] == src[1:])
        if joins.any():
            first = np.flatnonzero(np.concatenate(([True], ~joins)))
            totals = np.add.reduceat(sizes, first)
            return dst[first].tolist(), src[first].tolist(), totals.tolist()
    return dst.tolist(), src.tolist(), sizes.tolist()


@dataclass(eq=False)
class _Segment:
    """A shared-memory file mapped in this process (one we own, or one of a peer's)."""

    name: str
    size: int
    mm: mmap.mmap
    local: int  # address of the mapping in this process
    base: int = 0  # address in the owner process (== local for our own)

    def close(self) -> bool:
        """Unmap; False when tensors still hold the memory (it is then freed with the last tensor)."""
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


@dataclass(eq=False)
class _Control:
    """A peer's control block mapped here, with the fd we probe its owner's flock through; shared across refreshes."""

    name: str
    fd: int
    mm: mmap.mmap
    words: np.ndarray | None  # uint64 view; None once closed

    def close(self) -> None:
        if self.words is None:
            return
        self.words = None  # drop the buffer export before unmapping
        try:
            self.mm.close()
        except BufferError:  # pragma: no cover - only if someone kept a view; GC unmaps it later
            log.warning("kvcore shm: control block %s still in use; left to the garbage collector", self.name)
        os.close(self.fd)


@dataclass(eq=False)
class _Peer:
    """What a sender keeps per loaded peer: its control block, notification address and mapped segments."""

    control: _Control
    sock: bytes
    pid: int
    segments: dict[str, _Segment]
    seg_base: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    seg_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    seg_local: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    reg_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    reg_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    reg_slot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    reg_token: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))

    @property
    def ctl(self) -> np.ndarray:
        assert self.control.words is not None, "peer control block already closed"
        return self.control.words


@dataclass(eq=False)
class _Xfer:
    """A transfer whose bytes have landed; ``pending`` holds a notification the peer's queue could not take yet."""

    pending: bytes | None
    address: bytes


class ShmAgent(TransferAgent):
    """Same-host agent over POSIX shared memory: WRITE and READ into peers' ``allocate_tensor`` memory.

    Transfers complete inside ``submit`` (DONE at the first poll) unless the
    peer's notification queue is full; then the transfer stays PENDING and
    every poll retries, so ``wait(timeout)`` bounds it. Takes no options.
    """

    backend: ClassVar[str] = "shm"
    capabilities: ClassVar[AgentCapabilities] = AgentCapabilities(
        memory_kinds=frozenset({MemoryKind.DRAM}), write=True, read=True, notifications=True, remote=False
    )

    def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(name, options)
        global _SWEPT_PID
        if _SWEPT_PID != os.getpid():
            _SWEPT_PID = os.getpid()
            sweep_dead_segments()
        self._prefix = f"kvcore-shm-{os.getpid()}-{process_incarnation()[:8]}-{next(_agent_seq)}"
        self._segments: dict[str, _Segment] = {}
        self._seg_count = itertools.count()
        self._free_slots = list(range(_SLOTS - 1, -1, -1))
        self._tokens = itertools.count(1)
        self._paths: list[str] = []  # files to unlink even if close() is never called
        self._notifications: deque[Notification] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()

        ctl_name = f"{self._prefix}-ctl"
        self._ctl_fd = os.open(os.path.join(SHM_DIR, ctl_name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._paths.append(os.path.join(SHM_DIR, ctl_name))
        self._finalizer = weakref.finalize(self, _unlink_quietly, self._paths)
        # Held for the agent's life: a peer that can take a shared lock knows we are gone.
        fcntl.flock(self._ctl_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(self._ctl_fd, _CTL_BYTES)
        self._ctl_name = ctl_name
        self._ctl_mm = mmap.mmap(self._ctl_fd, _CTL_BYTES)
        self._ctl = np.frombuffer(self._ctl_mm, dtype=np.uint64)
        self._ctl[_W_VERSION], self._ctl[_W_PID], self._ctl[_W_ALIVE] = _LAYOUT_VERSION, os.getpid(), 1
        self._ctl[_W_MAGIC] = _MAGIC  # last: a reader that sees the magic sees a complete header

        self._sock_name = f"{self._prefix}-notify"
        self._rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._rx.bind(b"\0" + self._sock_name.encode())
        self._rx.setblocking(False)
        self._tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._tx.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._drain_loop, name=f"kvcore-shm-notify-{name}", daemon=True)
        self._thread.start()

    # --- memory ------------------------------------------------------------------------------

    def allocate_tensor(self, shape: Sequence[int], dtype: Any, device: str = "cpu") -> torch.Tensor:
        """A zeroed CPU tensor inside a new shared-memory segment of this agent (freed at ``close``)."""
        import torch

        self._check_open()
        if torch.device(device).type != "cpu":
            raise UnsupportedOperationError(f"shm agent allocates DRAM only; got device {device!r}")
        shape = tuple(int(s) for s in shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        name = f"{self._prefix}-s{next(self._seg_count)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._paths.append(path)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            _unlink_quietly([path])
            self._paths.remove(path)
            raise RegistrationError(f"shm agent could not allocate {size} bytes in {path}: {exc}") from exc
        finally:
            os.close(fd)  # mmap keeps its own duplicate
        self._segments[name] = _Segment(name, size, mm, _address_of(mm))
        self._segments[name].base = self._segments[name].local
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
        export = _Export(seg, self._free_slots.pop(), next(self._tokens))
        self._ctl[_HEADER_WORDS + export.slot] = export.token
        return export

    def _deregister(self, registration: Registration) -> None:
        export: _Export | None = registration.native
        if export is not None:
            # Zeroed before anything else, so a sender holding the old descriptor is refused from now on.
            self._ctl[_HEADER_WORDS + export.slot] = 0
            self._free_slots.append(export.slot)

    def _exported(self, registration: Registration) -> bool:
        return registration.native is not None

    # --- descriptors and peers -----------------------------------------------------------------

    def _descriptor_payload(self) -> bytes:
        exports = [(r.region, r.native) for r in self._registrations.values() if r.native is not None]
        used = {e.segment.name: e.segment for _, e in exports}
        return _encoder.encode(
            _Payload(
                ctl=self._ctl_name,
                sock=self._sock_name,
                pid=os.getpid(),
                segments=[_SegmentInfo(s.name, s.base, s.size) for s in used.values()],
                exports=[_ExportInfo(r.address, r.length, e.slot, e.token) for r, e in exports],
            )
        )

    def _load_remote(self, descriptor: AgentDescriptor, previous: RemoteAgent | None) -> _Peer:
        payload = self._decode_payload(descriptor)
        old: _Peer | None = previous.native if previous is not None else None
        peer = self._open_control(descriptor.name, payload, old)
        segments: dict[str, _Segment] = {}
        try:
            self._check_alive(descriptor.name, peer)
            for info in payload.segments:
                prior = old.segments.get(info.name) if old is not None else None
                if prior is not None and prior.base == info.base and prior.size == info.size:
                    segments[info.name] = prior
                else:
                    segments[info.name] = self._map_peer_segment(descriptor.name, info)
        except BaseException:
            for name, seg in segments.items():
                if old is None or old.segments.get(name) is not seg:
                    seg.close()
            if old is None or peer.control is not old.control:
                peer.control.close()
            raise
        if old is not None:
            for name, seg in old.segments.items():
                if segments.get(name) is not seg:
                    seg.close()
            if old.control is not peer.control:
                old.control.close()
        peer.segments = segments
        segs = sorted(segments.values(), key=lambda s: s.base)
        peer.seg_base = np.array([s.base for s in segs], dtype=np.uint64)
        peer.seg_end = np.array([s.base + s.size for s in segs], dtype=np.uint64)
        peer.seg_local = np.array([s.local for s in segs], dtype=np.uint64)
        exports = sorted(payload.exports, key=lambda e: e.address)
        peer.reg_start = np.array([e.address for e in exports], dtype=np.uint64)
        peer.reg_end = np.array([e.address + e.length for e in exports], dtype=np.uint64)
        peer.reg_slot = np.array([e.slot for e in exports], dtype=np.int64)
        peer.reg_token = np.array([e.token for e in exports], dtype=np.uint64)
        return peer

    def _decode_payload(self, descriptor: AgentDescriptor) -> _Payload:
        """Decode and bound-check a peer's payload; every problem is a ``RemoteAgentError`` naming the field."""
        who = f"peer {descriptor.name!r}"
        try:
            payload = _payload_decoder.decode(descriptor.payload)
        except msgspec.DecodeError as exc:
            raise RemoteAgentError(f"{who}: malformed shm descriptor payload: {exc}") from exc
        if not _NAME_RE.match(payload.ctl) or not payload.ctl.endswith("-ctl"):
            raise RemoteAgentError(f"{who}: shm control segment name {payload.ctl!r} is not a kvcore shm name")
        if not _SOCK_RE.match(payload.sock):
            raise RemoteAgentError(f"{who}: shm notification socket name {payload.sock!r} is not a kvcore shm name")
        seg_by_name = {}
        for s in payload.segments:
            if not _NAME_RE.match(s.name) or s.name.endswith("-ctl"):
                raise RemoteAgentError(f"{who}: shm segment name {s.name!r} is not a kvcore shm segment name")
            if not (0 < s.size <= _MAX_SEGMENT_BYTES) or s.base <= 0:
                raise RemoteAgentError(f"{who}: shm segment {s.name!r} has base {s.base:#x} size {s.size}")
            seg_by_name[s.name] = s
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

    def _open_control(self, peer_name: str, payload: _Payload, old: _Peer | None) -> _Peer:
        sock = b"\0" + payload.sock.encode()
        if old is not None and old.control.name == payload.ctl:
            return _Peer(old.control, sock, payload.pid, {})
        path = os.path.join(SHM_DIR, payload.ctl)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise PeerLostError(f"peer {peer_name!r}: control segment {path} is gone; the peer agent closed or died")
        try:
            if os.fstat(fd).st_size < _CTL_BYTES:
                raise RemoteAgentError(f"peer {peer_name!r}: control segment {path} is smaller than {_CTL_BYTES} bytes")
            mm = mmap.mmap(fd, _CTL_BYTES)
        except BaseException:
            os.close(fd)
            raise
        ctl = np.frombuffer(mm, dtype=np.uint64)
        if int(ctl[_W_MAGIC]) != _MAGIC or int(ctl[_W_VERSION]) != _LAYOUT_VERSION:
            del ctl
            mm.close()
            os.close(fd)
            raise RemoteAgentError(f"peer {peer_name!r}: {path} is not a kvcore shm control block of layout v1")
        return _Peer(_Control(payload.ctl, fd, mm, ctl), sock, payload.pid, {})

    def _map_peer_segment(self, peer_name: str, info: _SegmentInfo) -> _Segment:
        path = os.path.join(SHM_DIR, info.name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise PeerLostError(f"peer {peer_name!r}: shm segment {path} is gone; the peer agent closed or died")
        try:
            actual = os.fstat(fd).st_size
            if actual < info.size:
                raise RemoteAgentError(
                    f"peer {peer_name!r}: shm segment {path} is {actual} bytes, expected {info.size}"
                )
            # MAP_POPULATE: map every page now (first contact, paid once) rather than taking a
            # minor fault per page inside the first transfers, which made them ~7x slower.
            mm = mmap.mmap(fd, info.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        return _Segment(info.name, info.size, mm, _address_of(mm), info.base)

    def _unload_remote(self, remote: RemoteAgent) -> None:
        peer: _Peer = remote.native
        dead = self._owner_dead(peer)
        for seg in peer.segments.values():
            seg.close()
        peer.segments = {}
        if dead:
            # Its process died without cleaning up: remove every file of that agent (proven by its flock).
            prefix = peer.control.name[: -len("-ctl")]
            _unlink_quietly([os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-")])
        peer.control.close()

    @staticmethod
    def _owner_dead(peer: _Peer) -> bool:
        """True when the peer's process is gone: its exclusive flock on the control file is free."""
        try:
            fcntl.flock(peer.control.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:
            return False
        fcntl.flock(peer.control.fd, fcntl.LOCK_UN)
        return int(peer.ctl[_W_ALIVE]) == 1  # closed cleanly (alive flag 0): it removed its files itself

    def _check_alive(self, peer_name: str, peer: _Peer) -> None:
        """Raise ``PeerLostError`` when the peer closed its agent or its process died (its flock is gone)."""
        if int(peer.ctl[_W_ALIVE]) != 1:
            raise PeerLostError(f"peer {peer_name!r} (pid {peer.pid}) closed its shm agent")
        try:
            fcntl.flock(peer.control.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # the owner still holds its exclusive lock
        fcntl.flock(peer.control.fd, fcntl.LOCK_UN)
        # Dead without cleaning up: unlink its files so they do not outlive everyone (mappings stay valid).
        _unlink_quietly([os.path.join(SHM_DIR, n) for n in (peer.control.name, *peer.segments)])
        raise PeerLostError(f"peer {peer_name!r} (pid {peer.pid}) died; its shm segments were reclaimed")

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
        self._check_alive(remote.name, peer)
        mapped = self._translate(remote.name, peer, remote_addrs, sizes)
        if handle.op is TransferOp.WRITE:
            dst, src, n = _merge_runs(mapped, local, sizes)
        else:
            dst, src, n = _merge_runs(local, mapped, sizes)
        for d, s, k in zip(dst, src, n):
            _memmove(d, s, k)
        xfer = _Xfer(message, peer.sock)
        self._send_pending(remote.name, xfer)
        return xfer

    def _translate(self, peer_name: str, peer: _Peer, addrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Peer addresses -> addresses of our mappings, refusing any fragment outside a live export."""
        if addrs.size == 0:
            return addrs
        ends = addrs + sizes
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
        # Stale-descriptor guard: every export a fragment touches must still carry the token we were given.
        live = peer.ctl[_HEADER_WORDS + peer.reg_slot] == peer.reg_token
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
        return peer.seg_local[seg] + (addrs - peer.seg_base[seg])

    def _send_pending(self, peer_name: str, xfer: _Xfer) -> None:
        if xfer.pending is None:
            return
        try:
            self._tx.sendto(xfer.pending, xfer.address)
        except BlockingIOError:
            return  # the peer's queue is full; _poll retries until the caller's wait() deadline
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise PeerLostError(f"peer {peer_name!r} no longer receives notifications ({exc}); it closed or died")
        except OSError as exc:
            raise TransferFailedError(f"notification to peer {peer_name!r} failed: {exc}") from exc
        xfer.pending = None

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        xfer: _Xfer = handle.native
        self._send_pending(handle.remote, xfer)
        return TransferStatus.PENDING if xfer.pending is not None else TransferStatus.DONE

    def _release(self, handle: TransferHandle) -> None:
        pass  # nothing native: the bytes moved inside submit

    # --- notifications -------------------------------------------------------------------------

    def _drain_loop(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._rx, self._wake_r], [], [], 1.0)
            if self._rx in ready:
                self._drain_socket()

    def _drain_socket(self) -> None:
        # Under the lock, so the thread and get_notifications() never reorder datagrams between them.
        with self._lock:
            while True:
                try:
                    data = self._rx.recv(_MAX_NOTIFICATION_BYTES + 1)
                except OSError:  # BlockingIOError: drained; anything else: closing
                    return
                try:
                    sender, message = _notif_decoder.decode(data)
                except msgspec.DecodeError as exc:
                    log.warning(
                        "kvcore shm agent %r dropped a malformed notification (%d bytes): %s", self.name, len(data), exc
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
        self._ctl[_W_ALIVE] = 0
        _unlink_quietly(self._paths)  # first: whatever happens below, nothing is left in /dev/shm
        self._paths.clear()
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)
        for s in (self._rx, self._tx, self._wake_r, self._wake_w):
            s.close()
        del self._ctl
        try:
            self._ctl_mm.close()
        except BufferError:  # pragma: no cover - a view escaped; the GC unmaps it
            log.warning("kvcore shm agent %r: control block still in use at close", self.name)
        os.close(self._ctl_fd)  # drops the flock
        for seg in self._segments.values():
            seg.close()  # memory still used by tensors is freed with the last of them
        self._segments.clear()

    def _native_resources(self) -> dict[str, int]:
        mapped = sum(len(r.native.segments) for r in self._remotes.values() if r.native is not None)
        return {
            "shm_segments": len(self._segments),
            "shm_files": len(self._paths),
            "peer_mappings": mapped,
            "threads": int(self._thread.is_alive()),
        }
