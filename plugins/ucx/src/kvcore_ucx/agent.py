"""``UcxAgent``: the kvcore transfer agent on raw UCX RMA (``ucp_put_nbx``/``ucp_get_nbx``) through cffi.

One-sided on the wire: the initiator writes (or reads) straight into memory the
peer mapped with ``ucp_mem_map`` and described by a packed rkey in its agent
descriptor; the peer's CPU does no per-fragment work (on one host UCX moves the
bytes with CMA ``process_vm_writev`` in the initiator's thread). A notification
is a small eager active message sent only after ``ucp_ep_flush_nbx`` reported
every fragment remotely complete, so data always lands before its notice.

Threading: every UCX call happens under one lock (the worker is created
``UCS_THREAD_MODE_SERIALIZED``). A progress thread per agent sleeps on the
worker's event fd and progresses the worker when something arrives (wire-up,
notifications, software-emulated puts on TCP); ``close()`` stops and joins it
within ``close_timeout_s``.

Options (``TransceiverConfig.agent_options``): :class:`UcxOptions`, one docstring per field,
converted by :func:`kvcore.extension.convert.convert_options` (an unknown key or a wrong type is a
``ConfigError`` naming the agent, the key, the type expected and the value given).
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from kvcore.errors import (
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
from kvcore.hostinfo import host_identity
from kvcore.transport.agent import (
    AgentDescriptor,
    CheckedPlan,
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
from kvcore.transport.fragments import merge_runs
from kvcore_ucx import _ucp
from kvcore_ucx._ucp import ptr_status
from kvcore_ucx.plugin import CAPABILITIES

__all__ = ["UcxAgent", "UcxOptions", "CAPABILITIES", "merge_runs"]

log = logging.getLogger("kvcore_ucx")


#: Active-message id of kvcore notifications on a UCX worker.
_AM_NOTIFY_ID = 0x6B76
#: Version of the UCX part of the descriptor payload.
_PAYLOAD_VERSION = 2
_MAX_NAME_BYTES = 1024


class _RkeyInfo(msgspec.Struct, array_like=True, frozen=True):
    address: int
    length: int
    rkey: bytes


class _Payload(msgspec.Struct, array_like=True, frozen=True):
    version: int
    worker_address: bytes
    ucx_version: str
    host: str
    pid: int
    error_handling: str  # the peer's policy: "auto", "none" or "peer"
    rkeys: list[_RkeyInfo]
    host_identity: str  # kvcore.hostinfo.host_identity() of the peer: same host iff equal to ours


_payload_decoder = msgspec.msgpack.Decoder(_Payload)
_payload_encoder = msgspec.msgpack.Encoder()


def ucx_settings(opts: UcxOptions) -> dict[str, str]:
    """``ucx_config`` as ``ucp_config_modify`` takes it: names without the ``UCX_`` prefix, values as text."""
    return {k.removeprefix("UCX_"): str(v) for k, v in opts.ucx_config.items()}


def _resolve_mode(policy: str, same_host: bool) -> str:
    """The UCX error-handling mode an endpoint gets: ``auto`` -> ``none`` on one host, ``peer`` across hosts."""
    if policy == "auto":
        return "none" if same_host else "peer"
    return policy


def _status_error(lib: _ucp.UcpLibrary, status: int, what: str, peer: str) -> TransferError:
    text = f"{what} to peer {peer!r} failed: UCS_ERR_{lib.status_string(status)}"
    if status in _ucp.PEER_LOST_STATUSES or -89 <= status <= -40:
        return PeerLostError(text + "; the peer process died or is unreachable")
    if status == _ucp.UCS_ERR_TIMED_OUT:
        return TransferTimeoutError(text)
    return TransferFailedError(text)


@dataclass(eq=False)
class _LocalMem:
    memh: Any  # ucp_mem_h cdata
    rkey: bytes
    kind: MemoryKind


@dataclass(eq=False)
class _RkeySet:
    """Unpacked rkeys of one descriptor generation; destroyed when no transfer uses them any more."""

    starts: np.ndarray
    ends: np.ndarray
    handles: list[Any]
    users: int = 0
    retired: bool = False


@dataclass(eq=False)
class _Peer:
    name: str
    incarnation: str
    worker_address: bytes
    ep: Any  # ucp_ep_h cdata
    rkeys: _RkeySet
    pid: int
    err_mode: str = "none"  # this endpoint's UCX error-handling mode
    same_host: bool = True
    failed: int = 0  # UCS status from the error handler ("peer" mode), 0 while healthy
    user_handle: Any = None  # ffi.new_handle for the error callback


@dataclass(eq=False)
class _Xfer:
    peer: _Peer
    rkeys: _RkeySet
    requests: list[int] = field(default_factory=list)
    flush: int = 0  # pending flush request (0: none or complete)
    am: int = 0  # pending notification request
    notify: bool = False
    keep: list[Any] = field(default_factory=list)  # buffers UCX reads until the request completes
    error: TransferError | None = None
    done: bool = False


@dataclass(eq=False)
class _PlanIndex:
    """A checked plan's registrations, found once for all its pieces: local memh and remote rkey per fragment."""

    rkeys: _RkeySet  # the peer's rkeys they index (a reloaded peer gets new ones: found again)
    lidx: np.ndarray
    ridx: np.ndarray
    memhs: list[Any]


class UcxOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ucx agent's options: ``TransceiverConfig.agent_options`` with ``backend = "ucx"``."""

    error_handling: Literal["auto", "none", "peer"] = "auto"
    """The UCX error-handling mode of each endpoint (UCX sets it per endpoint, so one worker serves both
    kinds of peer). ``"auto"``: ``none`` for a peer whose descriptor names this host
    (``kvcore.hostinfo.host_identity()``: shared memory + CMA, zero-copy, truly one-sided), ``peer`` for a
    peer on another host (TCP/IB with peer-failure detection: in ``none`` mode a lost remote peer is never
    reported). ``"none"``/``"peer"`` force one mode for every peer. Both ends of a pair must end up with
    the same mode; a mismatch is refused when the descriptor is loaded."""
    ucx_config: dict[str, str | int | float | bool] = {}
    """UCX configuration for this agent's context (``{"TLS": "tcp,sm,cma", "NET_DEVICES": "eth0"}``: names
    without the ``UCX_`` prefix), applied with ``ucp_config_modify`` over the ``UCX_*`` environment. UCX
    reads transports and devices per context, so they cannot differ per peer."""
    progress_thread: bool = True
    """Run the progress thread. Without it the target must call ``progress()`` or ``get_notifications()``
    for notifications and wire-up."""
    progress_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.05
    """Upper bound on the progress thread's sleep."""
    close_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    """Bound on joining the progress thread and closing endpoints in ``close()``."""
    max_notification_bytes: Annotated[int, msgspec.Meta(gt=0)] = 64 * 1024
    """Largest notification accepted (sent as one eager active message)."""


class UcxAgent(TransferAgent):
    """Transfer agent on UCX RMA: one endpoint per peer, rkeys in the descriptor, notifications after a flush."""

    backend = "ucx"
    capabilities = CAPABILITIES
    options_type = UcxOptions

    def __init__(self, name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(name, options)
        opts = self.opts = convert_options(UcxOptions, options, owner="ucx agent")
        self._err_mode_name = opts.error_handling
        self._ucx_config = ucx_settings(opts)
        self._host_identity = host_identity()
        self._interval = opts.progress_interval_s
        self._close_timeout = opts.close_timeout_s
        self._max_notif = opts.max_notification_bytes
        self._name_bytes = name.encode()
        if len(self._name_bytes) > _MAX_NAME_BYTES:
            raise TransferError(f"agent name is {len(self._name_bytes)} bytes; the ucx agent allows {_MAX_NAME_BYTES}")

        self._u = _ucp.load()
        ffi, lib = self._u.ffi, self._u.lib
        self._ffi, self._lib = ffi, lib
        self._lock = threading.Lock()
        self._notifications: list[Notification] = []
        self._peers: dict[str, _Peer] = {}
        self._retired: list[_RkeySet] = []
        self._context: Any = None
        self._worker: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._efd = -1
        try:
            self._init_ucx(opts.progress_thread)
        except BaseException:
            self._teardown_ucx()
            raise

    # --- setup / teardown ------------------------------------------------------------------

    def _check(self, status: int, what: str) -> None:
        if status != _ucp.UCS_OK:
            raise TransferError(f"ucx agent {self.name!r}: {what} failed: UCS_ERR_{self._u.status_string(status)}")

    def _refused(self, key: str, value: str, status: int) -> TransferError:
        return TransferError(
            f"ucx option ucx_config: UCX refused {key}={value!r}: UCS_ERR_{self._u.status_string(status)}"
        )

    def _init_ucx(self, progress_thread: bool) -> None:
        ffi, lib = self._ffi, self._lib
        self._context = _ucp.create_context(
            self._u,
            self._ucx_config,
            features=_ucp.UCP_FEATURE_RMA | _ucp.UCP_FEATURE_AM | _ucp.UCP_FEATURE_WAKEUP,
            name=self._name_bytes,
            check=self._check,
            refused=self._refused,
        )
        attr = ffi.new("ucp_context_attr_t *")
        attr.field_mask = _ucp.UCP_ATTR_FIELD_MEMORY_TYPES
        self._check(lib.ucp_context_query(self._context, attr), "ucp_context_query")
        self._memory_types = int(attr.memory_types)
        self._worker = _ucp.create_worker(
            self._u, self._context, thread_mode=_ucp.UCS_THREAD_MODE_SERIALIZED, check=self._check
        )
        self._address = _ucp.worker_address(self._u, self._worker, check=self._check)

        # The AM callback runs inside ucp_worker_progress, i.e. with self._lock held.
        self._am_cb = ffi.callback("ucp_am_recv_callback_t", self._on_notification, onerror=self._on_cb_error)
        hparams = ffi.new("ucp_am_handler_param_t *")
        hparams.field_mask = (
            _ucp.UCP_AM_HANDLER_PARAM_FIELD_ID
            | _ucp.UCP_AM_HANDLER_PARAM_FIELD_CB
            | _ucp.UCP_AM_HANDLER_PARAM_FIELD_FLAGS
        )
        hparams.id = _AM_NOTIFY_ID
        hparams.flags = _ucp.UCP_AM_FLAG_WHOLE_MSG
        hparams.cb = self._am_cb
        self._check(lib.ucp_worker_set_am_recv_handler(self._worker, hparams), "ucp_worker_set_am_recv_handler")

        self._name_cdata = ffi.from_buffer(self._name_bytes)
        self._param_plain = ffi.new("ucp_request_param_t *")  # no callback: poll requests by status
        self._param_am = ffi.new("ucp_request_param_t *")
        self._param_am.op_attr_mask = _ucp.UCP_OP_ATTR_FIELD_FLAGS
        self._param_am.flags = _ucp.UCP_AM_SEND_FLAG_EAGER | _ucp.UCP_AM_SEND_FLAG_COPY_HEADER
        self._param_rma = ffi.new("ucp_request_param_t *")
        self._param_rma.op_attr_mask = _ucp.UCP_OP_ATTR_FIELD_MEMH
        self._param_close = ffi.new("ucp_request_param_t *")  # "none" endpoints: flush and close politely
        self._param_close.op_attr_mask = _ucp.UCP_OP_ATTR_FIELD_FLAGS
        self._param_close.flags = 0
        self._param_close_force = ffi.new("ucp_request_param_t *")  # "peer" endpoints: the peer may be gone
        self._param_close_force.op_attr_mask = _ucp.UCP_OP_ATTR_FIELD_FLAGS
        self._param_close_force.flags = _ucp.UCP_EP_CLOSE_FLAG_FORCE
        self._err_cb = ffi.callback("ucp_err_handler_cb_t", self._on_ep_error)

        if progress_thread:
            efd = ffi.new("int *")
            self._check(lib.ucp_worker_get_efd(self._worker, efd), "ucp_worker_get_efd")
            self._efd = efd[0]
            self._thread = threading.Thread(
                target=self._progress_loop, name=f"kvcore-ucx-progress-{self.name}", daemon=True
            )
            self._thread.start()

    def _teardown_ucx(self) -> None:
        lib = self._lib
        if self._thread is not None:
            self._stop.set()
            if self._worker is not None:
                lib.ucp_worker_signal(self._worker)
            self._thread.join(self._close_timeout)
            if self._thread.is_alive():
                # Destroying the worker under a live thread would crash it; leak the worker instead.
                raise TransferError(
                    f"ucx agent {self.name!r}: progress thread did not stop within {self._close_timeout}s"
                )
            self._thread = None
        if self._worker is not None:
            lib.ucp_worker_destroy(self._worker)
            self._worker = None
        if self._context is not None:
            lib.ucp_cleanup(self._context)
            self._context = None

    def _progress_loop(self) -> None:
        lib, worker = self._lib, self._worker
        poller = select.poll()
        poller.register(self._efd, select.POLLIN)
        timeout_ms = max(1, int(self._interval * 1000))
        while not self._stop.is_set():
            with self._lock:
                while lib.ucp_worker_progress(worker):
                    pass
                armed = lib.ucp_worker_arm(worker)
            if armed == _ucp.UCS_ERR_BUSY:
                continue  # more events already pending
            if armed != _ucp.UCS_OK:
                self._stop.wait(self._interval)
                continue
            try:
                poller.poll(timeout_ms)
            except InterruptedError:
                pass

    def _progress_locked(self) -> None:
        lib, worker = self._lib, self._worker
        while lib.ucp_worker_progress(worker):
            pass

    # --- callbacks (run inside ucp_worker_progress, lock held) ------------------------------

    def _on_notification(self, arg: Any, header: Any, header_length: int, data: Any, length: int, param: Any) -> int:
        ffi = self._ffi
        if param.recv_attr & _ucp.UCP_AM_RECV_ATTR_FLAG_RNDV:
            log.warning("ucx agent %r dropped a rendezvous notification (senders always use eager)", self.name)
            return _ucp.UCS_OK
        if header_length > _MAX_NAME_BYTES or length > self._max_notif:
            log.warning("ucx agent %r dropped an oversized notification (%d bytes)", self.name, length)
            return _ucp.UCS_OK
        sender = bytes(ffi.buffer(header, header_length)).decode(errors="replace")
        message = bytes(ffi.buffer(data, length)) if length else b""
        self._notifications.append(Notification(sender, message))
        return _ucp.UCS_OK

    def _on_cb_error(self, exc_type: Any, exc: Any, tb: Any) -> None:
        log.error("ucx agent %r: notification callback failed: %s", self.name, exc)

    def _on_ep_error(self, arg: Any, ep: Any, status: int) -> None:
        peer = self._ffi.from_handle(arg) if arg != self._ffi.NULL else None
        if isinstance(peer, _Peer):
            peer.failed = status or -25
            log.warning("ucx agent %r: endpoint to %r failed: %s", self.name, peer.name, self._u.status_string(status))

    # --- memory -----------------------------------------------------------------------------

    def _register(self, region: MemoryRegion, keepalive: Any) -> Any:
        ffi, lib = self._ffi, self._lib
        if region.kind is MemoryKind.VRAM and not self._memory_types & (1 << _ucp.UCS_MEMORY_TYPE_CUDA):
            raise UnsupportedOperationError(
                "this UCX cannot register VRAM: CUDA memory is not among its memory types "
                "(no CUDA driver, or libuct_cuda is not loadable); DRAM works"
            )
        params = _ucp.mem_map_params(
            self._u,
            region.address,
            region.length,
            _ucp.UCS_MEMORY_TYPE_CUDA if region.kind is MemoryKind.VRAM else _ucp.UCS_MEMORY_TYPE_HOST,
        )
        memh = ffi.new("ucp_mem_h *")
        with self._lock:
            status = lib.ucp_mem_map(self._context, params, memh)
            if status != _ucp.UCS_OK:
                raise RegistrationError(
                    f"ucp_mem_map of {region.length} bytes at {region.address:#x} failed: "
                    f"UCS_ERR_{self._u.status_string(status)}"
                )
            buf, size = ffi.new("void **"), ffi.new("size_t *")
            status = lib.ucp_rkey_pack(self._context, memh[0], buf, size)
            if status != _ucp.UCS_OK:
                lib.ucp_mem_unmap(self._context, memh[0])
                raise RegistrationError(f"ucp_rkey_pack failed: UCS_ERR_{self._u.status_string(status)}")
            rkey = bytes(ffi.buffer(buf[0], size[0]))
            lib.ucp_rkey_buffer_release(buf[0])
        return _LocalMem(memh[0], rkey, region.kind)

    def _deregister(self, registration: Registration) -> None:
        mem: _LocalMem = registration.native
        with self._lock:
            status = self._lib.ucp_mem_unmap(self._context, mem.memh)
        if status != _ucp.UCS_OK:
            raise RegistrationError(f"ucp_mem_unmap failed: UCS_ERR_{self._u.status_string(status)}")

    # --- descriptors and peers --------------------------------------------------------------

    def _descriptor_payload(self) -> bytes:
        rkeys = [
            _RkeyInfo(r.region.address, r.region.length, r.native.rkey)
            for r in sorted(self._registrations.values(), key=lambda r: r.region.address)
        ]
        payload = _Payload(
            version=_PAYLOAD_VERSION,
            worker_address=self._address,
            ucx_version=".".join(map(str, self._u.version)),
            host=socket.gethostname(),
            pid=os.getpid(),
            error_handling=self._err_mode_name,
            rkeys=rkeys,
            host_identity=self._host_identity,
        )
        return _payload_encoder.encode(payload)

    def _decode_payload(self, desc: AgentDescriptor) -> _Payload:
        payload = self.decode_payload(desc, _payload_decoder, version=_PAYLOAD_VERSION)
        same_host = bool(self._host_identity) and payload.host_identity == self._host_identity
        mine = _resolve_mode(self._err_mode_name, same_host)
        theirs = _resolve_mode(payload.error_handling, same_host)
        if mine != theirs:
            where = "this host" if same_host else "another host"
            raise RemoteAgentError(
                f"peer {desc.name!r} (on {where}): ucx error_handling: this agent uses {mine!r} "
                f"(option {self._err_mode_name!r}), the peer uses {theirs!r} (option {payload.error_handling!r}); "
                "UCX refuses mixed endpoints"
            )
        regions = sorted((r.address, r.length) for r in desc.regions)
        keyed = sorted((r.address, r.length) for r in payload.rkeys)
        if regions != keyed:
            raise RemoteAgentError(
                f"peer {desc.name!r}: ucx payload describes {len(keyed)} rkeys that do not match its "
                f"{len(regions)} registered regions"
            )
        return payload

    def _unpack_rkeys(self, ep: Any, payload: _Payload, peer_name: str) -> _RkeySet:
        ffi, lib = self._ffi, self._lib
        handles: list[Any] = []
        out = ffi.new("ucp_rkey_h *")
        for info in payload.rkeys:
            status = lib.ucp_ep_rkey_unpack(ep, ffi.from_buffer(info.rkey), out)
            if status != _ucp.UCS_OK:
                for h in handles:
                    lib.ucp_rkey_destroy(h)
                raise RemoteAgentError(
                    f"peer {peer_name!r}: ucp_ep_rkey_unpack of region {info.address:#x} failed: "
                    f"UCS_ERR_{self._u.status_string(status)}"
                )
            handles.append(out[0])
        starts = np.array([r.address for r in payload.rkeys], dtype=np.uint64)
        ends = np.array([r.address + r.length for r in payload.rkeys], dtype=np.uint64)
        return _RkeySet(starts, ends, handles)

    def _load_remote(self, descriptor: AgentDescriptor, previous: RemoteAgent | None) -> Any:
        payload = self._decode_payload(descriptor)
        if payload.worker_address == self._address or (
            descriptor.name == self.name
            and (payload.pid == os.getpid() or descriptor.incarnation == process_incarnation())
        ):
            # A replayed own descriptor (RankInfo) would make this agent write into its own memory.
            raise RemoteAgentError(
                f"peer {descriptor.name!r}: the descriptor is this agent's own (a replay?); an agent never loads itself"
            )
        ffi = self._ffi
        old: _Peer | None = previous.native if previous is not None else None
        with self._lock:
            if (
                old is not None
                and old.incarnation == descriptor.incarnation
                and old.worker_address == payload.worker_address
                and not old.failed
            ):
                # Same process, new registrations: keep the endpoint, swap the rkeys.
                rkeys = self._unpack_rkeys(old.ep, payload, descriptor.name)
                self._retire_rkeys(old.rkeys)
                old.rkeys = rkeys
                return old
            same_host = bool(self._host_identity) and payload.host_identity == self._host_identity
            peer = _Peer(descriptor.name, descriptor.incarnation, payload.worker_address, None, None, payload.pid)  # type: ignore[arg-type]
            peer.same_host = same_host
            peer.err_mode = _resolve_mode(self._err_mode_name, same_host)
            peer.user_handle = ffi.new_handle(peer)

            def check(status: int, what: str) -> None:
                if status != _ucp.UCS_OK:
                    raise RemoteAgentError(
                        f"peer {descriptor.name!r}: {what} failed: UCS_ERR_{self._u.status_string(status)}"
                    )

            peer.ep = _ucp.create_endpoint(
                self._u,
                self._worker,
                payload.worker_address,
                peer_mode=peer.err_mode == "peer",
                check=check,
                err_handler=self._err_cb,
                err_arg=peer.user_handle,
            )
            try:
                peer.rkeys = self._unpack_rkeys(peer.ep, payload, descriptor.name)
            except BaseException:
                self._close_ep_locked(peer)
                raise
            if old is not None:
                self._drop_peer_locked(old)
            self._peers[descriptor.name] = peer
        return peer

    def _same_agent(self, loaded: RemoteAgent, descriptor: AgentDescriptor) -> bool:
        """The same UCX worker: one process may hold two agents of one name (an engine rebuilt in place)."""
        old: _Peer = loaded.native
        return old.worker_address == self._decode_payload(descriptor).worker_address

    def _peer_gone(self, loaded: RemoteAgent) -> bool:
        """Gone once UCX's error handler failed its endpoint ("peer" mode); in "none" mode only unloading frees it."""
        old: _Peer = loaded.native
        return bool(old.failed)

    def _describe_agent(self, descriptor: AgentDescriptor) -> str:
        payload = self.decode_payload(descriptor, _payload_decoder, version=_PAYLOAD_VERSION)
        worker = hashlib.blake2b(payload.worker_address, digest_size=6).hexdigest()
        return f"{descriptor.incarnation[:8]}, pid {payload.pid}, worker {worker}"

    def _unload_remote(self, remote: RemoteAgent) -> None:
        peer: _Peer = remote.native
        with self._lock:
            self._drop_peer_locked(peer)
            if self._peers.get(peer.name) is peer:
                del self._peers[peer.name]

    def _drop_peer_locked(self, peer: _Peer) -> None:
        self._retire_rkeys(peer.rkeys)
        self._collect_retired()
        self._close_ep_locked(peer)

    def _retire_rkeys(self, rkeys: _RkeySet) -> None:
        rkeys.retired = True
        self._retired.append(rkeys)
        self._collect_retired()

    def _collect_retired(self) -> None:
        keep = []
        for rk in self._retired:
            if rk.users:
                keep.append(rk)
                continue
            for h in rk.handles:
                self._lib.ucp_rkey_destroy(h)
            rk.handles = []
        self._retired = keep

    def _close_ep_locked(self, peer: _Peer) -> None:
        if peer.ep is None:
            return
        param = self._param_close_force if peer.err_mode == "peer" else self._param_close
        ep, peer.ep = peer.ep, None
        if not _ucp.close_endpoint(self._u, self._worker, ep, param, timeout_s=self._close_timeout):
            log.warning("ucx agent %r: closing the endpoint to %r did not finish; cancelling", self.name, peer.name)

    # --- transfers --------------------------------------------------------------------------

    def _local_memhs(self, local: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, list[Any]]:
        regs = sorted(self._registrations.values(), key=lambda r: r.region.address)
        starts = np.array([r.region.address for r in regs], dtype=np.uint64)
        ends = np.array([r.region.end for r in regs], dtype=np.uint64)
        idx = np.searchsorted(starts, local, side="right").astype(np.int64) - 1
        bad = (idx < 0) | (local + sizes > ends[np.maximum(idx, 0)])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise RegistrationError(
                f"fragment {i}: local range [{int(local[i]):#x}, +{int(sizes[i])}) spans two registrations of "
                f"agent {self.name!r}; split it at the registration boundary"
            )
        return idx, [r.native.memh for r in regs]

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        peer = self._ready_peer(handle, remote)
        ridx = self._remote_index(peer.rkeys, peer, remote_addrs, sizes)
        lidx, memhs = self._local_memhs(local, sizes)
        local, remote_addrs, sizes, (lidx, ridx) = merge_runs(local, remote_addrs, sizes, lidx, ridx)
        return self._post_puts(handle, peer, (local, remote_addrs, sizes, lidx, ridx), memhs)

    def _submit_piece(
        self, handle: TransferHandle, remote: RemoteAgent, plan: CheckedPlan, start: int, stop: int
    ) -> Any:
        """A piece of a checked plan: the registration of every fragment on both sides is found once per plan (at
        its first piece, for the rkeys of that moment) and each piece takes its slice."""
        peer = self._ready_peer(handle, remote)
        pi: _PlanIndex | None = plan.native
        if pi is None or pi.rkeys is not peer.rkeys:
            ridx = self._remote_index(peer.rkeys, peer, plan.remote_addrs, plan.sizes)
            lidx, memhs = self._local_memhs(plan.local, plan.sizes)
            pi = plan.native = _PlanIndex(peer.rkeys, lidx, ridx, memhs)
        frags = (plan.local[start:stop], plan.remote_addrs[start:stop], plan.sizes[start:stop])
        local, remote_addrs, sizes, (lidx, ridx) = merge_runs(*frags, pi.lidx[start:stop], pi.ridx[start:stop])
        return self._post_puts(handle, peer, (local, remote_addrs, sizes, lidx, ridx), pi.memhs)

    def _ready_peer(self, handle: TransferHandle, remote: RemoteAgent) -> _Peer:
        peer: _Peer = remote.native
        if peer.failed:
            raise _status_error(self._u, peer.failed, "endpoint", peer.name)
        if handle.notification is not None and len(handle.notification) > self._max_notif:
            raise TransferError(
                f"notification is {len(handle.notification)} bytes; the ucx agent allows {self._max_notif}"
            )
        return peer

    @staticmethod
    def _remote_index(rk: _RkeySet, peer: _Peer, remote_addrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """The peer registration (rkey) holding each remote range; ``RemoteRangeError`` for one spanning two."""
        ridx = np.searchsorted(rk.starts, remote_addrs, side="right").astype(np.int64) - 1
        rbad = (ridx < 0) | (remote_addrs + sizes > rk.ends[np.maximum(ridx, 0)])
        if rbad.any():
            i = int(np.flatnonzero(rbad)[0])
            raise RemoteRangeError(
                f"fragment {i}: remote range [{int(remote_addrs[i]):#x}, +{int(sizes[i])}) is not inside one "
                f"registration of peer {peer.name!r}; nothing was moved"
            )
        return ridx

    def _post_puts(
        self,
        handle: TransferHandle,
        peer: _Peer,
        runs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        memhs: list[Any],
    ) -> _Xfer:
        """One put (or get) per merged run, then a flush of the endpoint."""
        local, remote_addrs, sizes, lidx, ridx = runs
        rk = peer.rkeys
        xfer = _Xfer(peer, rk, notify=handle.notification is not None)
        rk.users += 1
        lib = self._lib
        op = lib.ucp_put_nbx if handle.op is TransferOp.WRITE else lib.ucp_get_nbx
        param = self._param_rma
        ep, rkh = peer.ep, rk.handles
        requests = xfer.requests
        with self._lock:
            for la, ra, sz, li, ri in zip(
                local.tolist(), remote_addrs.tolist(), sizes.tolist(), lidx.tolist(), ridx.tolist()
            ):
                param.memh = memhs[li]
                st = op(ep, la, sz, ra, rkh[ri], param)
                if st:
                    if st >= _ucp.PTR_ERR_MIN:
                        xfer.error = _status_error(self._u, st - (1 << 64), f"{handle.op.value}", peer.name)
                        break
                    requests.append(st)
            if xfer.error is None:
                # Remote completion of everything posted on this endpoint so far; the notice waits for it.
                xfer.flush = lib.ucp_ep_flush_nbx(ep, self._param_plain)
                st = ptr_status(xfer.flush)
                if st != _ucp.UCS_INPROGRESS:
                    xfer.flush = 0
                    if st != _ucp.UCS_OK:
                        xfer.error = _status_error(self._u, st, "flush", peer.name)
            self._advance_locked(handle, xfer)
        return xfer

    def _advance_locked(self, handle: TransferHandle, xfer: _Xfer) -> None:
        """Move a transfer along: finished requests -> flush -> notification -> done."""
        lib = self._lib
        if xfer.requests:
            pending = []
            for req in xfer.requests:
                st = lib.ucp_request_check_status(req)
                if st == _ucp.UCS_INPROGRESS:
                    pending.append(req)
                    continue
                lib.ucp_request_free(req)
                if st != _ucp.UCS_OK and xfer.error is None:
                    xfer.error = _status_error(self._u, st, handle.op.value, xfer.peer.name)
            xfer.requests = pending
        if xfer.flush:
            st = lib.ucp_request_check_status(xfer.flush)
            if st == _ucp.UCS_INPROGRESS:
                return
            lib.ucp_request_free(xfer.flush)
            xfer.flush = 0
            if st != _ucp.UCS_OK and xfer.error is None:
                xfer.error = _status_error(self._u, st, "flush", xfer.peer.name)
        if xfer.requests or xfer.error is not None:
            return
        if xfer.notify and handle.notification is not None and not xfer.am:
            if xfer.peer.ep is None:
                xfer.error = PeerLostError(f"peer {xfer.peer.name!r} was unloaded before the notification was sent")
                return
            msg = self._ffi.from_buffer(handle.notification)
            xfer.keep = [msg]
            req = lib.ucp_am_send_nbx(
                xfer.peer.ep,
                _AM_NOTIFY_ID,
                self._name_cdata,
                len(self._name_bytes),
                msg,
                len(handle.notification),
                self._param_am,
            )
            xfer.notify = False
            st = ptr_status(req)
            if st == _ucp.UCS_INPROGRESS:
                xfer.am = req
            elif st != _ucp.UCS_OK:
                xfer.error = _status_error(self._u, st, "notification", xfer.peer.name)
                return
        if xfer.am:
            st = lib.ucp_request_check_status(xfer.am)
            if st == _ucp.UCS_INPROGRESS:
                return
            lib.ucp_request_free(xfer.am)
            xfer.am = 0
            xfer.keep = []
            if st != _ucp.UCS_OK:
                xfer.error = _status_error(self._u, st, "notification", xfer.peer.name)
                return
        xfer.done = True

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        xfer: _Xfer = handle.native
        if not xfer.done and xfer.error is None:
            with self._lock:
                self._progress_locked()
                self._advance_locked(handle, xfer)
        if xfer.peer.failed and not xfer.done and xfer.error is None:
            xfer.error = _status_error(self._u, xfer.peer.failed, "endpoint", xfer.peer.name)
        if xfer.error is not None and not (xfer.requests or xfer.flush or xfer.am):
            raise xfer.error
        if xfer.error is not None:
            return TransferStatus.PENDING  # failed, but UCX still owns buffers of this transfer
        return TransferStatus.DONE if xfer.done else TransferStatus.PENDING

    def _release(self, handle: TransferHandle) -> None:
        xfer: _Xfer | None = handle.native
        if xfer is None:
            return
        with self._lock:
            for req in [*xfer.requests, xfer.flush, xfer.am]:
                if req:
                    self._lib.ucp_request_free(req)  # UCX frees it when it completes
            xfer.requests, xfer.flush, xfer.am = [], 0, 0
            xfer.rkeys.users -= 1
            if xfer.rkeys.retired:
                self._collect_retired()

    def _get_notifications(self) -> list[Notification]:
        with self._lock:
            self._progress_locked()
            out, self._notifications = self._notifications, []
        return out

    def progress(self) -> None:
        """Progress the UCX worker once from the caller's thread."""
        if self._closed:
            return
        with self._lock:
            self._progress_locked()

    def _close(self) -> None:
        with self._lock:
            for peer in list(self._peers.values()):
                self._drop_peer_locked(peer)
            self._peers.clear()
            for rk in self._retired:
                for h in rk.handles:
                    self._lib.ucp_rkey_destroy(h)
            self._retired = []
        self._teardown_ucx()

    def _native_resources(self) -> dict[str, int]:
        return {
            "ucx_endpoints": sum(1 for p in self._peers.values() if p.ep is not None),
            "ucx_retired_rkey_sets": len(self._retired),
            "progress_threads": int(self._thread is not None and self._thread.is_alive()),
        }

    def peer_error_mode(self, remote: str) -> str:
        """The UCX error-handling mode (``"none"`` or ``"peer"``) of the endpoint to a loaded peer."""
        peer: _Peer = self.remote(remote).native
        return peer.err_mode

    @property
    def worker_address(self) -> bytes:
        """This agent's UCX worker address (also inside its descriptor)."""
        return self._address
