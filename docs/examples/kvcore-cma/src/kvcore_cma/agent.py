"""``CmaAgent``: one-sided same-host transfers into a peer's plain memory with ``process_vm_writev``/``readv``.

The receiver does nothing per transfer: the kernel copies straight between the
two address spaces (one copy, no shared memory). Its descriptor carries its pid,
its process start time (so a recycled pid is never mistaken for the peer) and
the name of a UNIX datagram socket in the abstract namespace that receives
notifications. The kvcore base class has already checked every fragment against
the peer's registered memory before ``_submit`` runs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np

from kvcore import (
    AgentCapabilities,
    MemoryRegion,
    Notification,
    PeerLostError,
    Registration,
    RemoteAgentError,
    TransferAgent,
    TransferFailedError,
    TransferHandle,
    TransferOp,
    TransferStatus,
)
from kvcore.extension.convert import convert_options
from kvcore.transport.agent import AgentDescriptor, RemoteAgent
from kvcore.transport.fragments import merge_runs
from kvcore_cma.plugin import CAPABILITIES

IOV_MAX = 1024  # the kernel refuses more iovecs per call
_libc = ctypes.CDLL(None, use_errno=True)
_IOV_ARGS = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong)
_libc.process_vm_writev.argtypes = _libc.process_vm_readv.argtypes = _IOV_ARGS
_libc.process_vm_writev.restype = _libc.process_vm_readv.restype = ctypes.c_ssize_t
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1).value


class CmaPayload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The transport part of a CMA descriptor."""

    pid: int
    start_time: int  # field 22 of /proc/<pid>/stat: tells a live peer from a recycled pid
    socket: str  # abstract-namespace UNIX datagram socket for notifications


_payload_decoder = msgspec.msgpack.Decoder(CmaPayload)
_decode_notification = msgspec.msgpack.Decoder(tuple[str, bytes]).decode
_encode = msgspec.msgpack.Encoder().encode


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])  # fields after "(comm)"; 22nd overall


def ptrace_scope() -> int:
    """Yama's ``kernel.yama.ptrace_scope`` (0 when Yama is not built in)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except FileNotFoundError:
        return 0


@dataclass
class CmaPeer:
    pid: int
    start_time: int
    address: bytes  # the peer's notification socket


@dataclass
class CmaTransfer:
    pending: bytes | None  # a notification the peer's socket queue could not take yet
    address: bytes


class CmaOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The cma agent's options: ``TransceiverConfig.agent_options`` with ``backend = "cma"``."""

    iovecs_per_call: Annotated[int, msgspec.Meta(ge=1, le=IOV_MAX)] = IOV_MAX
    """Fragments (after merging neighbours) per ``process_vm_writev``/``readv`` call; the kernel takes at most
    1024. Fewer means more system calls for the same bytes: useful only to exercise the batching."""


class CmaAgent(TransferAgent):
    """One-sided WRITE/READ of many fragments into a same-host peer's registered memory, with notifications."""

    backend: ClassVar[str] = "cma"
    capabilities: ClassVar[AgentCapabilities] = CAPABILITIES  # stated once, in the hook module
    options_type: ClassVar[type[msgspec.Struct] | None] = CmaOptions

    def __init__(self, name: str, options: Mapping[str, Any] | CmaOptions | None = None) -> None:
        super().__init__(name, options)
        # One converter for every agent: an unknown key or a wrong type is a ConfigError naming the key.
        self.opts = convert_options(CmaOptions, options, owner="cma agent")
        if ptrace_scope() == 1:
            # Scope 1 only lets ancestors attach; allow same-user peers to reach our registered memory.
            _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0)
        self._socket_name = f"kvcore-cma-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._inbox.bind(b"\0" + self._socket_name.encode())  # abstract: nothing on disk to clean up
        self._inbox.setblocking(False)
        self._outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._outbox.setblocking(False)
        self._start_time = start_time(os.getpid())

    # --- memory: nothing to pin; the kernel resolves addresses at copy time -----------------

    def _register(self, region: MemoryRegion, keepalive: Any) -> None:
        return None

    def _deregister(self, registration: Registration) -> None:
        pass

    # --- descriptors and peers ----------------------------------------------------------------

    def _descriptor_payload(self) -> bytes:
        return _encode(CmaPayload(os.getpid(), self._start_time or 0, self._socket_name))

    def _load_remote(self, descriptor: AgentDescriptor, previous: RemoteAgent | None) -> CmaPeer:
        payload = self.decode_payload(descriptor, _payload_decoder)  # bounds, decoding, typed errors: the core's
        if payload.pid <= 0 or not payload.socket.startswith("kvcore-cma-"):
            raise RemoteAgentError(f"peer {descriptor.name!r}: invalid cma payload {payload!r}")
        peer = CmaPeer(payload.pid, payload.start_time, b"\0" + payload.socket.encode())
        self._check_alive(descriptor.name, peer)
        return peer

    def _unload_remote(self, remote: RemoteAgent) -> None:
        pass

    def _check_alive(self, name: str, peer: CmaPeer) -> None:
        if start_time(peer.pid) != peer.start_time:
            raise PeerLostError(f"peer {name!r} (pid {peer.pid}) is gone")

    # --- transfers ------------------------------------------------------------------------------

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> CmaTransfer:
        peer: CmaPeer = remote.native
        self._check_alive(remote.name, peer)
        local, remote_addrs, sizes, _ = merge_runs(local, remote_addrs, sizes)  # fewer iovecs, same bytes
        # struct iovec { void *base; size_t len; } is two 64-bit words: build all of them at once.
        local_iov = np.ascontiguousarray(np.stack([local, sizes], axis=1), dtype=np.uint64)
        remote_iov = np.ascontiguousarray(np.stack([remote_addrs, sizes], axis=1), dtype=np.uint64)
        call = _libc.process_vm_writev if handle.op is TransferOp.WRITE else _libc.process_vm_readv
        batch = self.opts.iovecs_per_call
        for start in range(0, sizes.size, batch):
            count = min(batch, sizes.size - start)
            expected = int(sizes[start : start + count].sum())
            done = call(peer.pid, local_iov[start:].ctypes.data, count, remote_iov[start:].ctypes.data, count, 0)
            if done != expected:
                raise self._copy_error(remote.name, peer, done, expected, ctypes.get_errno())
        xfer = CmaTransfer(None, peer.address)
        if handle.notification is not None:
            # Sent only after every byte landed, so the peer never sees it early.
            xfer.pending = _encode((self.name, handle.notification))
            self._send(remote.name, xfer)
        return xfer

    def _copy_error(self, name: str, peer: CmaPeer, done: int, expected: int, err: int) -> Exception:
        if done >= 0:
            return TransferFailedError(f"cma copy to peer {name!r} moved {done} of {expected} bytes")
        if err == errno.ESRCH:
            return PeerLostError(f"peer {name!r} (pid {peer.pid}) is gone")
        if err == errno.EPERM:
            return TransferFailedError(
                f"the kernel refused cross-memory attach to peer {name!r} (pid {peer.pid}): EPERM. "
                f"kernel.yama.ptrace_scope is {ptrace_scope()}; CMA needs both processes under the same user "
                "and ptrace_scope 0 or 1 (or CAP_SYS_PTRACE)"
            )
        return TransferFailedError(f"cma copy to peer {name!r} failed: {os.strerror(err)} (errno {err})")

    def _send(self, name: str, xfer: CmaTransfer) -> None:
        try:
            self._outbox.sendto(xfer.pending or b"", xfer.address)
            xfer.pending = None
        except BlockingIOError:
            pass  # the peer's queue is full: _poll tries again, bounded by the caller's wait()
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise PeerLostError(f"peer {name!r} no longer receives notifications: {exc}") from exc

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        xfer: CmaTransfer = handle.native
        if xfer.pending is not None:
            self._send(handle.remote, xfer)
        return TransferStatus.PENDING if xfer.pending is not None else TransferStatus.DONE

    def _release(self, handle: TransferHandle) -> None:
        pass

    # --- notifications and lifecycle ------------------------------------------------------------

    def _get_notifications(self) -> list[Notification]:
        out: list[Notification] = []
        while True:
            try:
                data = self._inbox.recv(65536)
            except BlockingIOError:
                return out
            try:
                sender, message = _decode_notification(data)
            except msgspec.DecodeError:
                continue  # not one of ours: drop it
            out.append(Notification(sender, message))

    def _close(self) -> None:
        self._inbox.close()
        self._outbox.close()

    def _native_resources(self) -> dict[str, int]:
        return {"sockets": int(self._inbox.fileno() >= 0) + int(self._outbox.fileno() >= 0)}
