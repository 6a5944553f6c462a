"""Prototype A (for the benchmark and the design record, never registered as a backend): ucxx tag messages.

ucxx's Python API has no RMA, so a WRITE is emulated two-sided, one-sided as
seen from kvcore: the initiator sends a header (destination ranges, sizes,
notification) to the target's worker; the target's progress thread checks every
range against memory it registered (rejecting the whole transfer otherwise),
posts one ``tag_recv`` per fragment straight into the destination memory (no
intermediate copy), answers ACCEPT, and when every fragment has landed queues the
notification and answers DONE. The initiator sends the fragments after ACCEPT
and reports DONE only after the target's DONE, so DONE means the bytes landed.

Not registered as a backend (ucxx-cu12 hard-requires rmm-cu12 and CUDA
packages); see README.md for why design B (``kvcore_ucx.agent``) was chosen.
Install for the benchmark with ``pip install --no-deps ucxx-cu12==0.52.* libucxx-cu12==0.52.*``.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvcore.errors import PeerLostError, RemoteRangeError, TransferError, TransferFailedError
from kvcore.transport.agent import (
    AgentCapabilities,
    AgentDescriptor,
    MemoryKind,
    MemoryRegion,
    Notification,
    Registration,
    RemoteAgent,
    TransferAgent,
    TransferHandle,
    TransferStatus,
)
from kvcore.transport.ranges import ranges_inside

__all__ = ["UcxxProtoAgent", "load_ucxx"]

_HEADER_TAG = 0x4B56_4843_0000_0001  # "KVHC" header mailbox on every target worker
_SLOT_BITS = 20
_ACCEPT = (1 << _SLOT_BITS) - 2
_DONE = (1 << _SLOT_BITS) - 1
_MAX_FRAGMENTS = _ACCEPT
_HEADER_BUF = 1 << 20
_MAX_HEADER_FRAGMENTS = (_HEADER_BUF - 4096) // 16


class _Header(msgspec.Struct, array_like=True):
    tag_base: int
    sender: str
    reply_address: bytes
    dst: bytes  # uint64 little-endian addresses
    sizes: bytes  # uint64 little-endian sizes
    notification: bytes | None


def load_ucxx() -> Any:
    """Import ucxx's core bindings after loading libucx (ucxx's own loader skips it when rmm is absent)."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import libucx

    libucx.load_library()
    from ucxx._lib import libucxx
    from ucxx._lib.arr import Array

    libucxx.Array = Array  # one namespace for the prototype's calls
    return libucxx


def _view(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


@dataclass(eq=False)
class _Incoming:
    sender: str
    ep: Any
    tag_base: int
    requests: list[Any]
    notification: bytes | None
    checked: int = 0


@dataclass(eq=False)
class _Outgoing:
    peer: str
    ep: Any
    tag_base: int
    accept: Any
    done: Any
    local: np.ndarray
    sizes: np.ndarray
    keep: list[Any] = field(default_factory=list)
    sends: list[Any] = field(default_factory=list)
    accept_buf: bytearray = field(default_factory=lambda: bytearray(4096))
    done_buf: bytearray = field(default_factory=lambda: bytearray(8))


class UcxxProtoAgent(TransferAgent):
    """Design A: ucxx tag send/recv, target-side range checks, notification after the last fragment landed."""

    backend = "ucxx-proto"
    capabilities = AgentCapabilities(
        memory_kinds=frozenset({MemoryKind.DRAM}), write=True, read=False, notifications=True, remote=True
    )

    def __init__(self, name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(name, options)
        self._x = load_ucxx()
        x = self._x
        self._ctx = x.UCXContext(feature_flags=(x.Feature.TAG,))
        self._worker = x.UCXWorker(self._ctx)
        self._address: bytes = self._worker.address.tobytes()
        self._lock = threading.Lock()
        self._eps: dict[bytes, Any] = {}
        self._incoming: list[_Incoming] = []
        self._notifications: list[Notification] = []
        self._hdr_buf = bytearray(_HEADER_BUF)
        self._hdr_req = self._worker.tag_recv(x.Array(self._hdr_buf), x.UCXXTag(_HEADER_TAG))
        self._rng = np.random.default_rng()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvcore-ucxx-{name}", daemon=True)
        self._thread.start()

    # --- target side: progress thread ---------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                busy = self._step_locked()
            if not busy:
                time.sleep(0.0002)

    def _endpoint(self, address: bytes) -> Any:
        ep = self._eps.get(address)
        if ep is None:
            x = self._x
            ep = x.UCXEndpoint.create_from_worker_address(self._worker, x.UCXAddress.create_from_buffer(address), False)
            self._eps[address] = ep
        return ep

    def _reply(self, ep: Any, tag: int, data: bytes) -> None:
        x = self._x
        buf = bytearray(data)
        req = ep.tag_send(x.Array(buf), x.UCXXTag(tag))
        while not req.completed:  # replies are eager (<= 4 KiB): completes within a few progress calls
            self._worker.progress()
        req.check_error()

    def _step_locked(self) -> bool:
        x = self._x
        self._worker.progress()
        busy = False
        if self._hdr_req.completed:
            busy = True
            self._hdr_req.check_error()
            (length,) = struct.unpack_from("<Q", self._hdr_buf, 0)
            hdr = msgspec.msgpack.decode(bytes(self._hdr_buf[8 : 8 + length]), type=_Header)
            self._hdr_req = self._worker.tag_recv(x.Array(self._hdr_buf), x.UCXXTag(_HEADER_TAG))
            self._accept(hdr)
        for inc in list(self._incoming):
            reqs = inc.requests
            while inc.checked < len(reqs) and reqs[inc.checked].completed:
                reqs[inc.checked].check_error()
                inc.checked += 1
            if inc.checked == len(reqs):
                busy = True
                self._incoming.remove(inc)
                if inc.notification is not None:
                    self._notifications.append(Notification(inc.sender, inc.notification))
                self._reply(inc.ep, inc.tag_base | _DONE, b"D")
        # While fragments are arriving the target's CPU does the (rendezvous, CMA-read) copies: keep spinning.
        return busy or bool(self._incoming)

    def _accept(self, hdr: _Header) -> None:
        x = self._x
        ep = self._endpoint(hdr.reply_address)
        dst = np.frombuffer(hdr.dst, dtype="<u8")
        sizes = np.frombuffer(hdr.sizes, dtype="<u8")
        bad = ~ranges_inside(dst, sizes, self._local_starts, self._local_ends) if dst.size == sizes.size else None
        if bad is None or bad.any():
            i = 0 if bad is None else int(np.flatnonzero(bad)[0])
            reason = (
                f"target {self.name!r} refused the transfer: fragment {i} [{int(dst[i]):#x}, +{int(sizes[i])}) "
                "is not inside memory it registered; nothing was moved"
            )
            self._reply(ep, hdr.tag_base | _ACCEPT, b"R" + reason.encode()[:4000])
            return
        reqs = [
            self._worker.tag_recv(x.Array(_view(a, s)), x.UCXXTag(hdr.tag_base | i))
            for i, (a, s) in enumerate(zip(dst.tolist(), sizes.tolist()))
        ]
        self._incoming.append(_Incoming(hdr.sender, ep, hdr.tag_base, reqs, hdr.notification))
        self._reply(ep, hdr.tag_base | _ACCEPT, b"A")

    # --- primitives --------------------------------------------------------------------------

    def _register(self, region: MemoryRegion, keepalive: Any) -> Any:
        return None  # tag receives need no registration; the range check uses the base class's table

    def _deregister(self, registration: Registration) -> None:
        pass

    def _descriptor_payload(self) -> bytes:
        return self._address

    def _load_remote(self, descriptor: AgentDescriptor, previous: RemoteAgent | None) -> Any:
        with self._lock:
            return self._endpoint(bytes(descriptor.payload))

    def _unload_remote(self, remote: RemoteAgent) -> None:
        pass  # endpoints are cached per worker address and closed with the agent

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        x = self._x
        from kvcore_ucx.agent import merge_runs

        local, remote_addrs, sizes, _ = merge_runs(local, remote_addrs, sizes)
        if sizes.size > min(_MAX_FRAGMENTS, _MAX_HEADER_FRAGMENTS):
            raise TransferError(f"the ucxx prototype sends at most {_MAX_HEADER_FRAGMENTS} fragments per transfer")
        tag_base = (int(self._rng.integers(1, 1 << 43)) << _SLOT_BITS) & ((1 << 63) - 1)
        hdr = msgspec.msgpack.encode(
            _Header(
                tag_base,
                self.name,
                self._address,
                remote_addrs.astype("<u8").tobytes(),
                sizes.astype("<u8").tobytes(),
                handle.notification,
            )
        )
        out = _Outgoing(remote.name, remote.native, tag_base, None, None, local, sizes)
        buf = bytearray(struct.pack("<Q", len(hdr)) + hdr)
        with self._lock:
            out.accept = self._worker.tag_recv(x.Array(out.accept_buf), x.UCXXTag(tag_base | _ACCEPT))
            out.done = self._worker.tag_recv(x.Array(out.done_buf), x.UCXXTag(tag_base | _DONE))
            out.keep.append(buf)
            out.sends.append(out.ep.tag_send(x.Array(buf), x.UCXXTag(_HEADER_TAG)))
        return out

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        x = self._x
        out: _Outgoing = handle.native
        with self._lock:
            self._step_locked()
            try:
                if out.accept is not None and out.accept.completed:
                    out.accept.check_error()
                    out.accept = None
                    if out.accept_buf[:1] == b"R":
                        raise RemoteRangeError(bytes(out.accept_buf[1:]).rstrip(b"\0").decode(errors="replace"))
                    for i, (a, s) in enumerate(zip(out.local.tolist(), out.sizes.tolist())):
                        out.sends.append(out.ep.tag_send(x.Array(_view(a, s)), x.UCXXTag(out.tag_base | i)))
                if out.accept is None and out.done.completed and all(r.completed for r in out.sends):
                    out.done.check_error()
                    for r in out.sends:
                        r.check_error()
                    return TransferStatus.DONE
            except TransferError:
                raise
            except Exception as exc:
                name = type(exc).__name__
                if "Reset" in name or "Unreachable" in name or "Endpoint" in name:
                    raise PeerLostError(f"ucxx transfer to {out.peer!r}: {exc}") from exc
                raise TransferFailedError(f"ucxx transfer to {out.peer!r}: {name}: {exc}") from exc
        return TransferStatus.PENDING

    def _release(self, handle: TransferHandle) -> None:
        pass

    def _get_notifications(self) -> list[Notification]:
        with self._lock:
            self._step_locked()
            out, self._notifications = self._notifications, []
        return out

    def _close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        if self._thread.is_alive():
            raise TransferError(f"ucxx prototype agent {self.name!r}: progress thread did not stop within 2s")
        with self._lock:
            self._eps.clear()
            self._hdr_req = None
            self._incoming.clear()

    def _native_resources(self) -> dict[str, int]:
        return {"progress_threads": int(self._thread.is_alive()), "incoming": len(self._incoming)}
