"""``MooncakeAgent``: the kvcore transfer agent on Mooncake's transfer engine (``mooncake.engine.TransferEngine``).

One engine per agent, initialised in P2P-handshake mode (no etcd or metadata server): a peer is reached by its
segment name ``host:rpc_port``, which its descriptor carries; the engine exchanges buffer lists with the peer on
the first transfer by itself. Memory is registered with ``register_memory``; the engine's own threads move the
bytes (TCP lanes, or RDMA queue pairs) and the target's CPU does no per-fragment work in Python.

Mooncake's Python API has one non-blocking batch call (``batch_transfer_async_*``) but no non-blocking way to ask
whether a whole batch finished (``get_batch_transfer_status`` waits, ``transfer_check_status`` looks at the first
entry only), so ``submit`` hands each transfer to one of the agent's submit threads, which runs it with
``batch_transfer_sync`` (the GIL released) and announces its end to the completion listener
(``async_submit=True``). A notification rides on the transfer's last batch (``TransferNotify``): the engine
sends it only once that batch completed, so data always lands before its notice.

Options (``TransceiverConfig.agent_options``): :class:`MooncakeOptions`, one docstring per field, converted by
:func:`kvcore.extension.convert.convert_options`; a field not in the mapping may come from
``KVCORE_MOONCAKE_<FIELD>`` in the environment (``KVCORE_MOONCAKE_BIND_ADDRESS=auto``), converted there too.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import ipaddress
import logging
import os
import queue
import socket
import struct
import threading
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from kvcore.errors import (
    ConfigError,
    PeerLostError,
    RegistrationError,
    RemoteAgentError,
    TransferError,
    TransferFailedError,
)
from kvcore.extension.convert import convert_options, from_text
from kvcore.hostinfo import host_identity, process_alive, process_start_time
from kvcore.transport.agent import (
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
from kvcore.transport.fragments import merge_runs
from kvcore_mooncake.plugin import CAPABILITIES

__all__ = [
    "MooncakeAgent",
    "MooncakeOptions",
    "CAPABILITIES",
    "engine_settings",
    "resolve_addresses",
    "dial_target",
    "decode_peer",
]

log = logging.getLogger("kvcore_mooncake")

#: Version of the Mooncake part of the descriptor payload.
_PAYLOAD_VERSION = 1
#: Prefix of a kvcore notification's text (Mooncake notifications are strings): others' notices are dropped.
_NOTIFY_PREFIX = "kvcore1:"
_ENV_PREFIX = "KVCORE_MOONCAKE_"
_SIOCGIFADDR = 0x8915


class MooncakeOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The mooncake agent's options: ``TransceiverConfig.agent_options`` with ``backend = "mooncake"``."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    """Mooncake's transport. ``tcp`` works everywhere (on one host it goes through the loopback stack);
    ``rdma`` needs RDMA NICs (``device_names``) and memory the NIC can register. ``rdma_twosided`` is compiled
    into the wheel but not offered here (untested)."""
    device_names: list[str] = []
    """RDMA devices the engine may use (``["mlx5_0", "mlx5_1"]``); empty: every device it discovers. Ignored by
    ``tcp``."""
    bind_address: str = "127.0.0.1"
    """The address this engine calls itself (its segment name ``address:rpc_port``, set as ``MC_TCP_BIND_ADDRESS``
    too) and the only one its descriptor offers peers. The loopback default reaches peers on this host only; set
    an address of this host that remote peers reach, or ``"auto"``: every IPv4 address of this host's interfaces
    (loopback first), a remote peer dialing the first non-loopback one. Mooncake 0.3.13 listens on every
    interface whatever this says (README, "Security")."""
    metadata: Literal["P2PHANDSHAKE"] = "P2PHANDSHAKE"
    """Mooncake's metadata mode. Only ``P2PHANDSHAKE`` (peers exchange segment descriptors over the engine's RPC
    port, no etcd/redis/HTTP metadata server): kvcore carries the segment name in its own descriptor."""
    max_queued_transfers_per_peer: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    """``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``: transfers the TCP transport queues per peer. ``None``: the
    environment's value, else 16384 (Mooncake's default of 1024 makes a 4096-fragment batch fail with "TCP lane
    queue-full"; 0.3.13 ignores values over 65535)."""
    max_pending_admissions_per_peer: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    """``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``: the same bound on admissions. ``None``: the environment's
    value, else 16384."""
    batch_entries: Annotated[int, msgspec.Meta(ge=1)] = 8192
    """Most fragments (after merging contiguous ones) in one engine batch; a larger transfer runs as several
    batches in turn, its notification on the last. Keep it within the two queue depths above."""
    log_level: Literal["INFO", "WARNING", "ERROR"] | None = None
    """``MC_LOG_LEVEL`` of the engine's glog output on stderr. ``None``: the environment's value, else
    ``WARNING`` (Mooncake's ``INFO`` writes a dozen lines per engine and per peer)."""
    transfer_timeout_s: Annotated[int, msgspec.Meta(ge=5)] = 30
    """``MC_TRANSFER_TIMEOUT``: the engine fails a batch after this many seconds plus one per GiB (Mooncake's
    floor is 5)."""
    submit_threads: Annotated[int, msgspec.Meta(ge=1, le=16)] = 2
    """Threads that run transfers (each blocks in ``batch_transfer_sync``, spinning in C++ with the GIL
    released): how many transfers of this agent are in flight at once."""
    close_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    """Bound on joining the submit threads in ``close()``; an engine a thread is still inside is kept, not
    destroyed under it (``resources()`` then reports the thread)."""
    max_notification_bytes: Annotated[int, msgspec.Meta(ge=1)] = 16 * 1024
    """Largest notification accepted (sent base64-encoded through the engine's notify RPC)."""
    engine_env: dict[str, str] = {}
    """Further Mooncake settings as environment variables (``{"MC_TCP_LANES_PER_PEER": "4"}``), set before the
    engine is created. Mooncake reads them per process: agents of one process should agree."""


def options_from_env(options: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``options`` plus every field it lacks that ``KVCORE_MOONCAKE_<FIELD>`` sets, converted from text in
    :mod:`kvcore.extension.convert` (a bad value is a ``ConfigError`` naming the variable)."""
    env = os.environ if env is None else env
    out = dict(options or {})
    hints = typing.get_type_hints(MooncakeOptions, include_extras=True)
    for name in MooncakeOptions.__struct_fields__:
        key = _ENV_PREFIX + name.upper()
        if name in out or key not in env:
            continue
        tp = hints[name]
        for _ in range(3):  # Annotated[int, Meta] | None -> int; Literal[...] -> str (the struct checks the value)
            args = typing.get_args(tp)
            if typing.get_origin(tp) is Annotated:
                tp = args[0]
            elif typing.get_origin(tp) is Literal:
                tp = str
            elif type(None) in args:
                tp = next(a for a in args if a is not type(None))
        out[name] = from_text(env[key], tp, name=key)
    return out


def engine_settings(opts: MooncakeOptions, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``MC_*`` environment variables the engine of ``opts`` is created under (the one derivation)."""
    env = os.environ if env is None else env
    out = {"MC_TRANSFER_TIMEOUT": str(opts.transfer_timeout_s)}
    for key, value in (
        ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", opts.max_queued_transfers_per_peer),
        ("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", opts.max_pending_admissions_per_peer),
    ):
        if value is not None:
            out[key] = str(value)
        elif key not in env:
            out[key] = "16384"
    if opts.log_level is not None or "MC_LOG_LEVEL" not in env:
        out["MC_LOG_LEVEL"] = opts.log_level or "WARNING"
    out.update(opts.engine_env)
    return out


def _interface_addresses() -> list[str]:
    """Every IPv4 address of this host's interfaces (``SIOCGIFADDR``), loopback first."""
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            addr = socket.inet_ntoa(raw[20:24])
            if addr not in found:
                found.append(addr)
    return sorted(found, key=lambda a: not ipaddress.ip_address(a).is_loopback)


def resolve_addresses(bind_address: str) -> list[str]:
    """The addresses a descriptor offers for ``bind_address``: itself, or for ``"auto"`` every interface's."""
    if bind_address != "auto":
        return [bind_address]
    found = _interface_addresses()
    if not found:
        raise ConfigError("mooncake agent option bind_address='auto': this host has no IPv4 address")
    return found


class _Payload(msgspec.Struct, array_like=True, frozen=True):
    version: int
    addresses: list[str]  # where this engine's RPC port answers, loopback first
    rpc_port: int
    protocol: str
    pid: int
    start_time: int  # process start time of ``pid`` (clock ticks since boot): a recycled pid differs
    host_identity: str  # kvcore.hostinfo.host_identity(): same host iff equal to ours
    engine_id: bytes  # random per engine: the endpoint's identity for its life


_payload_decoder = msgspec.msgpack.Decoder(_Payload)
_payload_encoder = msgspec.msgpack.Encoder()


def decode_peer(descriptor: AgentDescriptor) -> _Payload:
    """The Mooncake payload of a peer's descriptor, checked as ``TransferAgent.decode_payload`` checks it."""
    return TransferAgent.decode_payload(descriptor, _payload_decoder, version=_PAYLOAD_VERSION)


def dial_target(name: str, payload: _Payload, same_host: bool) -> str:
    """The segment name to dial for a peer: a loopback address on this host, else its first other address."""
    loop = [a for a in payload.addresses if _is_loopback(a)]
    other = [a for a in payload.addresses if not _is_loopback(a)]
    if same_host and loop:
        return f"{loop[0]}:{payload.rpc_port}"
    if other:
        return f"{other[0]}:{payload.rpc_port}"
    raise RemoteAgentError(
        f"peer {name!r} is on another host but offers only {payload.addresses} (its mooncake bind_address); set "
        "agent option bind_address to an address of that host this one reaches, or 'auto' "
        "(KVCORE_MOONCAKE_BIND_ADDRESS=auto)"
    )


@dataclass(eq=False)
class _Peer:
    name: str
    engine_id: bytes
    target: str  # the segment name this agent dials: "address:rpc_port"
    pid: int
    start_time: int
    same_host: bool
    lost: str = ""  # why the peer is provably gone ("" while it may be alive)


@dataclass(eq=False)
class _Xfer:
    handle_id: int
    peer: _Peer
    op: TransferOp
    chunks: list[tuple[list[int], list[int], list[int]]]
    notify: Any  # mooncake.engine.TransferNotify for the last chunk, or None
    finished: bool = False
    error: TransferError | None = None
    batches: int = field(default=0)


#: Engines a submit thread was still inside at close: kept referenced (destroying one under a thread crashes).
_ORPHANS: list[Any] = []


class MooncakeAgent(TransferAgent):
    """Transfer agent on Mooncake's transfer engine: one engine per agent, transfers run on submit threads."""

    backend = "mooncake"
    capabilities = CAPABILITIES
    options_type = MooncakeOptions

    def __init__(self, name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(name, options)
        opts = self.opts = convert_options(MooncakeOptions, options_from_env(options), owner="mooncake agent")
        self._addresses = resolve_addresses(opts.bind_address)
        # The engine calls itself by the address remote peers dial (for "auto": the first non-loopback one).
        self._hostname = next((a for a in self._addresses if not _is_loopback(a)), self._addresses[0])
        self._host_identity = host_identity()
        self._engine_id = os.urandom(16)
        self._pid = os.getpid()
        self._start_time = process_start_time(self._pid) or 0
        self._peers: dict[str, _Peer] = {}
        self._engine_regs: dict[tuple[int, int], int] = {}  # (address, length) -> registrations of it
        self._notify_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Xfer | None] = queue.SimpleQueue()
        self._stopping = False
        self._threads: list[threading.Thread] = []

        for key, value in engine_settings(opts).items():
            os.environ[key] = value
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self._hostname)
        try:
            from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
        except ImportError as exc:
            raise TransferError(f"mooncake agent: import mooncake.engine failed: {exc}") from exc
        self._notify_cls = TransferNotify
        self._opcodes = {TransferOp.WRITE: TransferOpcode.Write, TransferOp.READ: TransferOpcode.Read}
        engine = TransferEngine()
        rc = engine.initialize(self._hostname, opts.metadata, opts.protocol, ",".join(opts.device_names))
        if rc != 0:
            raise TransferError(
                f"mooncake agent {name!r}: TransferEngine.initialize({self._hostname!r}, {opts.metadata!r}, "
                f"{opts.protocol!r}, {','.join(opts.device_names)!r}) returned {rc}; the engine's log on stderr "
                "says why (rdma: no usable device among device_names?)"
            )
        self._engine: Any = engine
        self._rpc_port = int(engine.get_rpc_port())
        for i in range(opts.submit_threads):
            t = threading.Thread(target=self._submit_loop, name=f"kvcore-mooncake-{name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    # --- memory ------------------------------------------------------------------------------------

    def _register(self, region: MemoryRegion, keepalive: Any) -> Any:
        key = (region.address, region.length)
        if key not in self._engine_regs:
            rc = self._engine.register_memory(region.address, region.length, "*")
            if rc != 0:
                raise RegistrationError(
                    f"mooncake agent {self.name!r}: register_memory({region.address:#x}, {region.length}) returned "
                    f"{rc}; Mooncake refuses a range overlapping one it holds (register the whole pool once)"
                )
        self._engine_regs[key] = self._engine_regs.get(key, 0) + 1
        return key

    def _deregister(self, registration: Registration) -> None:
        key = registration.native
        left = self._engine_regs.get(key, 0) - 1
        if left > 0:
            self._engine_regs[key] = left
            return
        self._engine_regs.pop(key, None)
        rc = self._engine.unregister_memory(key[0])
        if rc != 0:
            log.warning("mooncake agent %r: unregister_memory(%#x) returned %d", self.name, key[0], rc)

    # --- descriptors and peers ---------------------------------------------------------------------

    def _descriptor_payload(self) -> bytes:
        return _payload_encoder.encode(
            _Payload(
                _PAYLOAD_VERSION,
                self._addresses,
                self._rpc_port,
                self.opts.protocol,
                self._pid,
                self._start_time,
                self._host_identity,
                self._engine_id,
            )
        )

    def _decode(self, descriptor: AgentDescriptor) -> _Payload:
        return decode_peer(descriptor)

    def _load_remote(self, descriptor: AgentDescriptor, previous: RemoteAgent | None) -> Any:
        payload = self._decode(descriptor)
        if payload.engine_id == self._engine_id or (
            descriptor.name == self.name
            and (payload.pid == self._pid or descriptor.incarnation == process_incarnation())
        ):
            # A replayed own descriptor (RankInfo) would make this agent write into its own memory.
            raise RemoteAgentError(
                f"peer {descriptor.name!r}: the descriptor is this agent's own (a replay?); an agent never loads itself"
            )
        if payload.protocol != self.opts.protocol:
            raise RemoteAgentError(
                f"peer {descriptor.name!r} runs mooncake protocol {payload.protocol!r}; this agent runs "
                f"{self.opts.protocol!r} (agent option protocol must match on both sides)"
            )
        if not 0 < payload.rpc_port < 65536 or not payload.addresses:
            raise RemoteAgentError(f"peer {descriptor.name!r}: mooncake payload names no usable endpoint")
        for a in payload.addresses:
            try:
                ipaddress.ip_address(a)
            except ValueError:
                raise RemoteAgentError(f"peer {descriptor.name!r}: mooncake address {a!r} is not an IP") from None
        same_host = bool(self._host_identity) and payload.host_identity == self._host_identity
        old: _Peer | None = previous.native if previous is not None else None
        if old is not None and old.engine_id == payload.engine_id:
            return old  # the same engine with new registrations: the regions are the base class's to check
        peer = _Peer(
            descriptor.name,
            payload.engine_id,
            dial_target(descriptor.name, payload, same_host),
            payload.pid,
            payload.start_time,
            same_host,
        )
        self._peers[descriptor.name] = peer
        return peer

    def _same_agent(self, loaded: RemoteAgent, descriptor: AgentDescriptor) -> bool:
        """The same engine: one process may hold two agents of one name (an engine rebuilt in place)."""
        old: _Peer = loaded.native
        return old.engine_id == self._decode(descriptor).engine_id

    def _peer_gone(self, loaded: RemoteAgent) -> bool:
        """Gone when its process on this host exited (pid and start time), or a transfer proved it unreachable."""
        peer: _Peer = loaded.native
        return bool(peer.lost) or (peer.same_host and not process_alive(peer.pid, peer.start_time or None))

    def _describe_agent(self, descriptor: AgentDescriptor) -> str:
        payload = self._decode(descriptor)
        engine = hashlib.blake2b(payload.engine_id, digest_size=6).hexdigest()
        return f"{descriptor.incarnation[:8]}, pid {payload.pid}, engine {engine}"

    def _unload_remote(self, remote: RemoteAgent) -> None:
        peer: _Peer = remote.native
        if self._peers.get(peer.name) is peer:
            del self._peers[peer.name]

    # --- transfers ---------------------------------------------------------------------------------

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        peer: _Peer = remote.native
        if peer.lost:
            raise PeerLostError(f"mooncake peer {peer.name!r} is gone: {peer.lost}")
        note = handle.notification
        notify = None
        if note is not None:
            if len(note) > self.opts.max_notification_bytes:
                raise TransferError(
                    f"notification is {len(note)} bytes; the mooncake agent allows {self.opts.max_notification_bytes} "
                    "(agent option max_notification_bytes)"
                )
            notify = self._notify_cls(self.name, _NOTIFY_PREFIX + base64.b64encode(note).decode())
        local, remote_addrs, sizes, _ = merge_runs(local, remote_addrs, sizes)
        step = self.opts.batch_entries
        chunks = [
            (local[i : i + step].tolist(), remote_addrs[i : i + step].tolist(), sizes[i : i + step].tolist())
            for i in range(0, int(sizes.size), step)
        ]
        xfer = _Xfer(handle.id, peer, handle.op, chunks, notify)
        self._jobs.put(xfer)
        return xfer

    def _submit_loop(self) -> None:
        while True:
            xfer = self._jobs.get()
            if xfer is None:
                return
            try:
                if self._stopping:
                    xfer.error = TransferFailedError(f"mooncake agent {self.name!r} closed before the transfer ran")
                else:
                    self._run(xfer)
            except Exception as exc:  # a bug or an engine exception must end the transfer, not the thread
                xfer.error = TransferFailedError(f"mooncake transfer to {xfer.peer.name!r} failed: {exc}")
            finally:
                xfer.finished = True
                self._announce(xfer.handle_id)

    def _run(self, xfer: _Xfer) -> None:
        opcode = self._opcodes[xfer.op]
        last = len(xfer.chunks) - 1
        for i, (src, dst, lengths) in enumerate(xfer.chunks):
            notify = xfer.notify if i == last else None
            rc = self._engine.batch_transfer_sync(xfer.peer.target, src, dst, lengths, opcode, notify)
            xfer.batches += 1
            if rc != 0:
                xfer.error = self._failure(xfer, rc, i)
                return

    def _failure(self, xfer: _Xfer, rc: int, batch: int) -> TransferError:
        """The typed error of a failed batch: ``PeerLostError`` when the peer provably died or cannot be reached."""
        peer = xfer.peer
        what = (
            f"mooncake {xfer.op.value} to peer {peer.name!r} ({peer.target}) failed: batch_transfer_sync returned "
            f"{rc} (batch {batch + 1} of {len(xfer.chunks)})"
        )
        if peer.same_host and not process_alive(peer.pid, peer.start_time or None):
            peer.lost = f"its process {peer.pid} exited"
            return PeerLostError(f"{what}; the peer process {peer.pid} exited")
        if not peer.same_host and self._engine.send_probe(peer.target) != 0:
            peer.lost = f"{peer.target} does not answer Mooncake's probe"
            return PeerLostError(f"{what}; the peer does not answer Mooncake's RPC probe (died or unreachable)")
        return TransferFailedError(
            f"{what}; the peer is alive: Mooncake's log on stderr says why (a range the peer no longer registers, "
            "a full queue: agent options max_queued_transfers_per_peer / batch_entries, or its transfer timeout)"
        )

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        xfer: _Xfer = handle.native
        if not xfer.finished:
            return TransferStatus.PENDING
        if xfer.error is not None:
            raise xfer.error
        return TransferStatus.DONE

    def _release(self, handle: TransferHandle) -> None:
        """Nothing native to free: the engine freed the batch when ``batch_transfer_sync`` returned."""

    def _get_notifications(self) -> list[Notification]:
        with self._notify_lock:
            raw = self._engine.get_notifies()
        out = []
        for n in raw:
            msg: str = n.msg
            if not msg.startswith(_NOTIFY_PREFIX):
                log.warning("mooncake agent %r: dropped a notification not sent by kvcore (from %r)", self.name, n.name)
                continue
            try:
                out.append(Notification(n.name, base64.b64decode(msg[len(_NOTIFY_PREFIX) :], validate=True)))
            except ValueError:
                log.warning("mooncake agent %r: dropped a malformed notification from %r", self.name, n.name)
        return out

    # --- life --------------------------------------------------------------------------------------

    def _close(self) -> None:
        self._stopping = True
        for _ in self._threads:
            self._jobs.put(None)
        deadline = self.opts.close_timeout_s
        for t in self._threads:
            t.join(deadline)
        alive = [t for t in self._threads if t.is_alive()]
        self._threads = alive
        self._peers.clear()
        if alive:
            # Destroying the engine under a thread inside batch_transfer_sync would crash the process.
            _ORPHANS.append(self._engine)
            log.warning(
                "mooncake agent %r: %d submit thread(s) still inside the engine after %.1fs; the engine is kept",
                self.name,
                len(alive),
                deadline,
            )
        self._engine = None

    def _native_resources(self) -> dict[str, int]:
        return {
            "mooncake_engines": int(self._engine is not None),
            "mooncake_registrations": len(self._engine_regs),
            "mooncake_peers": len(self._peers),
            "submit_threads": sum(t.is_alive() for t in self._threads),
        }

    @property
    def segment(self) -> str:
        """This engine's segment name as Mooncake knows it (``address:rpc_port``)."""
        return f"{self._hostname}:{self._rpc_port}"


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
