"""The transfer-agent contract: what every transport (shm, NIXL, UCX, third-party) implements.

A transfer agent moves bytes between memory it registered locally and memory a
peer agent registered, with one-sided WRITE (and READ where declared) of many
``(local address, remote address, size)`` fragments at once. The base class
does everything that is the same for every transport: argument validation,
the check that every fragment lies inside registered memory on both sides
(before any byte moves), descriptor encoding (msgpack, never pickle), handle
book-keeping and leak accounting. A transport implements the ``_``-prefixed
primitives.

Example (two processes, the receiver exported its descriptor ``d``)::

    agent = registry.get("shm")(name="ctx0")
    reg = agent.register_memory(src_tensor)
    peer = agent.load_remote_agent(d)
    h = agent.submit(TransferOp.WRITE, peer, src_addrs, dst_addrs, sizes, notification=b"req-7")
    agent.wait(h, timeout=5.0)
    agent.release(h)

Why one module of this length: it is the whole contract a transport author implements (capabilities,
registration, descriptors, range checks, handles, completion listeners) and the validation every agent inherits;
splitting it would make authors read several modules for one class.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgspec
import numpy as np

from kvcore.errors import (
    RegistrationError,
    RemoteAgentError,
    RemoteRangeError,
    TransferError,
    TransferFailedError,
    TransferTimeoutError,
    UnsupportedOperationError,
)
from kvcore.msgbounds import check_msgpack_bounds

if TYPE_CHECKING:
    import torch

__all__ = [
    "MemoryKind",
    "TransferOp",
    "TransferStatus",
    "AgentCapabilities",
    "MemoryRegion",
    "Registration",
    "RemoteAgent",
    "TransferHandle",
    "Notification",
    "AgentDescriptor",
    "RegionInfo",
    "TransferAgent",
    "DESCRIPTOR_VERSION",
    "process_incarnation",
]

log = logging.getLogger("kvcore.transport.agent")
P = TypeVar("P")

#: Version of the agent-descriptor envelope; bumped on an incompatible change.
DESCRIPTOR_VERSION = 1

_INCARNATION = uuid.uuid4().hex
_INCARNATION_PID = os.getpid()


def process_incarnation() -> str:
    """A random id for this process, new after fork, so a restarted peer is never mistaken for the old one."""
    global _INCARNATION, _INCARNATION_PID
    if os.getpid() != _INCARNATION_PID:
        _INCARNATION, _INCARNATION_PID = uuid.uuid4().hex, os.getpid()
    return _INCARNATION


class MemoryKind(str, Enum):
    """Where registered memory lives (NIXL's memory types)."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class TransferOp(str, Enum):
    """Direction of a one-sided transfer, seen from the initiator."""

    WRITE = "WRITE"  # local -> remote
    READ = "READ"  # remote -> local


class TransferStatus(str, Enum):
    """State of a submitted transfer."""

    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True)
class AgentCapabilities:
    """What a transport can do; checked before an agent is chosen or an operation is submitted."""

    memory_kinds: frozenset[MemoryKind] = frozenset({MemoryKind.DRAM})
    write: bool = True
    read: bool = False
    notifications: bool = True
    remote: bool = False  # False: peers must be on the same host
    can_abort: bool = False  # True: an in-flight transfer can be stopped with a guarantee no more bytes land
    # True: ``submit`` returns before the bytes move (they move on the transport's own threads) and the agent
    # announces each transfer's end to its completion listener. False: ``submit`` may move every byte itself.
    async_submit: bool = False

    def describe(self) -> str:
        """A short human-readable summary, e.g. ``DRAM+VRAM WRITE/READ notif remote``."""
        kinds = "+".join(sorted(k.value for k in self.memory_kinds))
        ops = "/".join(op for op, on in (("WRITE", self.write), ("READ", self.read)) if on)
        parts = [kinds, ops]
        if self.notifications:
            parts.append("notif")
        parts.append("remote" if self.remote else "same-host")
        return " ".join(parts)


@dataclass(frozen=True)
class MemoryRegion:
    """A contiguous range of memory: address, length in bytes, kind and device index."""

    address: int
    length: int
    kind: MemoryKind = MemoryKind.DRAM
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.address <= 0:
            raise RegistrationError(f"memory region address must be positive, got {self.address:#x}")
        if self.length <= 0:
            raise RegistrationError(f"memory region length must be positive, got {self.length}")

    @property
    def end(self) -> int:
        return self.address + self.length

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> MemoryRegion:
        """The region a contiguous tensor occupies (DRAM for CPU tensors, VRAM for CUDA tensors)."""
        if not tensor.is_contiguous():
            raise RegistrationError("only contiguous tensors can be registered; call .contiguous() first")
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type == "cuda":
            return cls(tensor.data_ptr(), nbytes, MemoryKind.VRAM, tensor.device.index or 0)
        if tensor.device.type == "cpu":
            return cls(tensor.data_ptr(), nbytes, MemoryKind.DRAM, 0)
        raise RegistrationError(f"tensor device {tensor.device} is not supported; expected cpu or cuda")


@dataclass(eq=False)
class Registration:
    """A live registration of one region with one agent; pass it back to ``deregister_memory``."""

    id: int
    region: MemoryRegion
    native: Any = None  # the transport's own handle
    keepalive: Any = None  # object kept alive while registered (e.g. the tensor)


class RegionInfo(msgspec.Struct, array_like=True, frozen=True):
    """A registered region as peers see it in a descriptor."""

    address: int
    length: int
    kind: str
    device_id: int


class AgentDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What a peer needs to reach an agent: identity, registered regions and a transport payload.

    Encoded as msgpack; ``payload`` is opaque transport data (NIXL metadata, UCX
    worker address, shm segment names), never a pickled object.
    """

    version: int
    backend: str
    name: str
    incarnation: str
    generation: int
    regions: list[RegionInfo]
    payload: bytes


@dataclass(eq=False)
class RemoteAgent:
    """A peer agent loaded from its descriptor."""

    name: str
    descriptor: AgentDescriptor
    starts: np.ndarray  # merged, sorted region starts (uint64)
    ends: np.ndarray  # matching region ends
    native: Any = None

    @property
    def incarnation(self) -> str:
        return self.descriptor.incarnation


@dataclass(frozen=True)
class Notification:
    """A message a peer attached to a transfer (or sent alone), delivered exactly once."""

    remote: str
    message: bytes


@dataclass(eq=False)
class TransferHandle:
    """A submitted transfer; poll it until it is terminal, then release it."""

    id: int
    op: TransferOp
    remote: str
    count: int
    nbytes: int
    notification: bytes | None
    submitted_at: float
    status: TransferStatus = TransferStatus.PENDING
    error: TransferError | None = None
    native: Any = None
    released: bool = False


_decoder = msgspec.msgpack.Decoder(AgentDescriptor)
_encoder = msgspec.msgpack.Encoder()
_MAX_DESCRIPTOR_BYTES = 16 * 1024 * 1024


def _as_u64(name: str, values: Any) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise TransferError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TransferError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise TransferError(f"{name} holds a negative value ({int(arr.min())})")
    return arr.astype(np.uint64, copy=False)


def merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort and merge overlapping or touching ``[start, end)`` intervals."""
    if starts.size == 0:
        return starts.astype(np.uint64), ends.astype(np.uint64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order].astype(np.uint64), ends[order].astype(np.uint64)
    run_end = np.maximum.accumulate(e)
    new_run = np.ones(s.size, dtype=bool)
    new_run[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new_run)
    last = np.append(idx[1:] - 1, s.size - 1)
    return s[idx], run_end[last]


def ranges_inside(addrs: np.ndarray, sizes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Boolean mask: ``[addr, addr+size)`` lies inside one of the merged intervals ``[starts, ends)``."""
    if addrs.size == 0:
        return np.ones(0, dtype=bool)
    if starts.size == 0:
        return np.zeros(addrs.size, dtype=bool)
    if addrs.size <= 4:  # a one-block request: plain Python beats six numpy calls on one-element arrays
        lo, hi = starts.tolist(), ends.tolist()
        mask = []
        for addr, size in zip(addrs.tolist(), sizes.tolist(), strict=True):
            i = bisect.bisect_right(lo, addr) - 1
            end = addr + size
            mask.append(i >= 0 and end < 2**64 and end <= hi[i])
        return np.array(mask, dtype=bool)
    idx = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    ok = idx >= 0
    safe = np.where(ok, idx, 0)
    end = addrs + sizes
    ok &= end >= addrs  # no wrap-around
    ok &= end <= ends[safe]
    return ok


class TransferAgent(ABC):
    """Abstract transfer agent. Subclasses set ``backend`` and ``capabilities`` and implement the primitives.

    Threading: an agent is driven from one thread at a time (the engine's
    loop); implementations may run their own progress threads internally.

    Names: one identity per peer name. ``load_remote_agent`` refuses a
    descriptor under a loaded name unless it is a refresh by the same agent
    (same incarnation and ``_same_agent``) or ``_peer_gone`` proves the loaded
    one gone; a transport tells these hooks what identifies its endpoint and
    when a peer is provably gone (``_describe_agent`` words the refusal).
    """

    backend: ClassVar[str] = ""
    capabilities: ClassVar[AgentCapabilities] = AgentCapabilities()
    #: The agent's options as a frozen msgspec struct (defaults and a docstring per field), which the agent
    #: builds with :func:`kvcore.extension.convert.convert_options`; ``None`` for an agent that reads the
    #: raw ``options`` mapping itself. Read by tools and docs tests: an agent states its options once.
    options_type: ClassVar[type[msgspec.Struct] | None] = None

    def __init__(self, name: str, options: Mapping[str, Any] | msgspec.Struct | None = None) -> None:
        if not name or not isinstance(name, str):
            raise TransferError(f"agent name must be a non-empty string, got {name!r}")
        self.name = name
        if isinstance(options, msgspec.Struct):  # already typed: keep the mapping view for agents that read it
            options = msgspec.structs.asdict(options)
        #: The options as given (``TransceiverConfig.agent_options``); typed agents read their struct instead.
        self.options: dict[str, Any] = dict(options or {})
        self._registrations: dict[int, Registration] = {}
        self._remotes: dict[str, RemoteAgent] = {}
        self._exposed: set[str] = set()  # loaded peers that may access this agent's memory (``expose_to``)
        self._handles: dict[int, TransferHandle] = {}
        self._ids = itertools.count(1)
        self._generation = 0
        self._local_starts = np.zeros(0, dtype=np.uint64)
        self._local_ends = np.zeros(0, dtype=np.uint64)
        self._closed = False
        self._completion_listener: Callable[[int], None] | None = None

    # --- memory ---------------------------------------------------------------------------

    def allocate_tensor(self, shape: Sequence[int], dtype: Any, device: str = "cpu") -> torch.Tensor:
        """Allocate a zeroed tensor that this agent can expose to peers (e.g. KV pools on the receiver).

        Transports that need special memory (the shm agent needs shared memory)
        override this; the default is an ordinary torch allocation.
        """
        import torch

        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    def register_memory(self, memory: torch.Tensor | MemoryRegion) -> Registration:
        """Register a tensor or raw region so it can be a transfer source or a peer's destination."""
        self._check_open()
        keepalive = None
        if isinstance(memory, MemoryRegion):
            region = memory
        else:
            region = MemoryRegion.from_tensor(memory)
            keepalive = memory
        if region.kind not in self.capabilities.memory_kinds:
            raise UnsupportedOperationError(
                f"{self.backend} agent cannot register {region.kind.value} memory; "
                f"it supports {', '.join(sorted(k.value for k in self.capabilities.memory_kinds))}"
            )
        reg = Registration(next(self._ids), region, keepalive=keepalive)
        try:
            reg.native = self._register(region, keepalive)
        except TransferError:
            raise
        except Exception as exc:
            raise RegistrationError(
                f"{self.backend} agent could not register {region.length} bytes at {region.address:#x}: {exc}"
            ) from exc
        self._registrations[reg.id] = reg
        self._registrations_changed()
        return reg

    def deregister_memory(self, registration: Registration) -> None:
        """Withdraw a registration. Peers must load the new descriptor; the old ranges are refused from then on."""
        reg = self._registrations.pop(registration.id, None)
        if reg is None:
            raise RegistrationError(f"registration {registration.id} is not registered with agent {self.name!r}")
        try:
            self._deregister(reg)
        except BaseException:
            self._registrations[reg.id] = reg  # the transport refused: the memory stays registered and alive
            raise
        reg.keepalive = None
        self._registrations_changed()

    @property
    def registrations(self) -> tuple[Registration, ...]:
        return tuple(self._registrations.values())

    def offers(self, registration: Registration) -> bool:
        """Whether peers may address ``registration`` (it is listed in this agent's descriptor).

        False for memory the transport can only use locally (the shm agent: memory not from its
        ``allocate_tensor``); such memory is a valid local source or destination, never a peer's target.
        """
        return self._exported(registration)

    def _registrations_changed(self) -> None:
        self._generation += 1
        regions = [r.region for r in self._registrations.values()]
        starts = np.array([r.address for r in regions], dtype=np.uint64)
        ends = np.array([r.end for r in regions], dtype=np.uint64)
        self._local_starts, self._local_ends = merge_intervals(starts, ends)

    # --- descriptors and peers ------------------------------------------------------------

    def descriptor(self, *, exposed: bool = True) -> bytes:
        """This agent's descriptor (msgpack bytes) for a peer's ``load_remote_agent``.

        ``exposed=False``: an identity-only descriptor, with no region and no key to any of this agent's memory,
        for a peer that must know this agent but may not access its memory; ``b""`` when the transport needs no
        such thing (``_identity_payload`` returns None: a peer reaches memory only through the keys a full
        descriptor carries, so it need not load this agent at all).
        """
        self._check_open()
        if not exposed:
            identity = self._identity_payload()
            if identity is None:
                return b""
            return _encoder.encode(
                AgentDescriptor(
                    version=DESCRIPTOR_VERSION,
                    backend=self.backend,
                    name=self.name,
                    incarnation=process_incarnation(),
                    generation=0,  # any full descriptor (generation >= 1 once memory is registered) refreshes it
                    regions=[],
                    payload=identity,
                )
            )
        desc = AgentDescriptor(
            version=DESCRIPTOR_VERSION,
            backend=self.backend,
            name=self.name,
            incarnation=process_incarnation(),
            generation=self._generation,
            regions=[
                RegionInfo(r.region.address, r.region.length, r.region.kind.value, r.region.device_id)
                for r in self._registrations.values()
                if self._exported(r)
            ],
            payload=self._descriptor_payload(),
        )
        return _encoder.encode(desc)

    @staticmethod
    def decode_descriptor(data: bytes) -> AgentDescriptor:
        """Decode and validate a descriptor; raises ``RemoteAgentError`` naming what is wrong."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise RemoteAgentError(f"agent descriptor must be bytes, got {type(data).__name__}")
        if len(data) > _MAX_DESCRIPTOR_BYTES:
            raise RemoteAgentError(f"agent descriptor is {len(data)} bytes, over the {_MAX_DESCRIPTOR_BYTES} limit")
        check_msgpack_bounds(
            data, error=RemoteAgentError, what="malformed agent descriptor"
        )  # before msgspec: no RecursionError, bounded memory
        try:
            desc = _decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise RemoteAgentError(f"malformed agent descriptor: {exc}") from exc
        except Exception as exc:  # nothing a peer sends may escape as an untyped error
            raise RemoteAgentError(f"agent descriptor could not be decoded: {type(exc).__name__}: {exc}") from exc
        if desc.version != DESCRIPTOR_VERSION:
            raise RemoteAgentError(
                f"agent descriptor version: expected {DESCRIPTOR_VERSION}, got {desc.version} (peer {desc.name!r})"
            )
        for r in desc.regions:
            if r.kind not in MemoryKind.__members__ or r.address <= 0 or r.length <= 0:
                raise RemoteAgentError(f"agent descriptor of {desc.name!r} holds an invalid region {r!r}")
        return desc

    @staticmethod
    def decode_payload(
        descriptor: AgentDescriptor, decoder: msgspec.msgpack.Decoder[P], *, version: int | None = None
    ) -> P:
        """A peer's transport payload, bound-checked and decoded with ``decoder``; its ``version`` field must equal
        ``version`` (unless that is ``None``: a payload without a version of its own).

        The one way agents read what a peer put in ``AgentDescriptor.payload``: nested junk cannot raise
        ``RecursionError`` (bounds first), and every problem is a ``RemoteAgentError`` naming the peer, the
        backend and what was wrong, e.g. ``peer 'x': ucx payload version: expected 2, got 1``.
        """
        who, backend = f"peer {descriptor.name!r}", descriptor.backend
        what = f"{who}: {backend} payload is malformed"
        check_msgpack_bounds(descriptor.payload, error=RemoteAgentError, what=what)
        try:
            payload = decoder.decode(descriptor.payload)
        except msgspec.DecodeError as exc:
            raise RemoteAgentError(f"{what}: {exc}") from exc
        except Exception as exc:  # nothing a peer sends may escape as an untyped error
            raise RemoteAgentError(f"{what}: {type(exc).__name__}: {exc}") from exc
        got = getattr(payload, "version", None)
        if version is not None and got != version:
            raise RemoteAgentError(f"{who}: {backend} payload version: expected {version}, got {got!r}")
        return payload

    def load_remote_agent(self, descriptor: bytes, *, expose: bool = True) -> str:
        """Load (or refresh) a peer from its descriptor; returns the peer's name for ``submit``.

        One identity per name: a descriptor under the name of a loaded peer refreshes it only when it comes from
        the same agent (the same incarnation, and ``_same_agent`` says the same transport endpoint), with a
        newer ``generation`` (an older one is ignored). Any other agent under that name is refused with
        ``RemoteAgentError`` while the loaded one may be alive: a peer cannot take over a loaded name. Once
        ``_peer_gone`` proves the loaded one gone, or after ``unload_remote_agent``, the name is free again.
        """
        self._check_open()
        desc = self.decode_descriptor(descriptor)
        if desc.backend != self.backend:
            raise RemoteAgentError(
                f"peer {desc.name!r} runs backend {desc.backend!r}; this agent runs {self.backend!r}"
            )
        old = self._remotes.get(desc.name)
        if old is not None and not (old.incarnation == desc.incarnation and self._same_agent(old, desc)):
            # One identity per name: another agent under a loaded name is a takeover unless the loaded one is gone.
            if not self._peer_gone(old):
                raise RemoteAgentError(
                    f"peer {desc.name!r}: an agent of that name is already loaded (incarnation "
                    f"{self._describe_agent(old.descriptor)}) and, as far as this agent knows, alive; a descriptor of "
                    f"incarnation {self._describe_agent(desc)} does not replace it. Unload the old peer first if it really "
                    "restarted"
                )
            self.unload_remote_agent(desc.name)
            old = None
        if old is not None and old.descriptor.generation > desc.generation:
            return desc.name  # a stale (reordered) descriptor never replaces a newer one
        starts = np.array([r.address for r in desc.regions], dtype=np.uint64)
        ends = np.array([r.address + r.length for r in desc.regions], dtype=np.uint64)
        starts, ends = merge_intervals(starts, ends)
        try:
            native = self._load_remote(desc, old)
        except TransferError:
            raise
        except Exception as exc:
            raise RemoteAgentError(f"{self.backend} agent could not load peer {desc.name!r}: {exc}") from exc
        self._remotes[desc.name] = RemoteAgent(desc.name, desc, starts, ends, native)
        self.expose_to(desc.name, expose)
        return desc.name

    def expose_to(self, name: str, exposed: bool = True) -> None:
        """Whether the loaded peer ``name`` may access this agent's memory, where this side decides it.

        Loading a peer exposes this agent's memory to it unless ``load_remote_agent(..., expose=False)``. Where
        the owner hands out access on request (the shm agent serves its memfds only to an exposed, loaded peer)
        this is the gate. Where a peer accesses memory with keys from a full descriptor (NIXL, UCX), the gate is
        who is given that descriptor; this flag then only records the decision. Access already handed out (fds
        passed, keys unpacked) cannot be taken back by ``exposed=False``: only deregistering the memory does.
        """
        if exposed and name in self._remotes:
            self._exposed.add(name)
        else:
            self._exposed.discard(name)

    def exposed_to(self, name: str) -> bool:
        """Whether ``expose_to`` lets the loaded peer ``name`` access this agent's memory."""
        return name in self._exposed

    def unload_remote_agent(self, name: str) -> None:
        """Forget a peer and drop its connection state."""
        remote = self._remotes.pop(name, None)
        self._exposed.discard(name)
        if remote is None:
            raise RemoteAgentError(f"peer {name!r} is not loaded in agent {self.name!r}")
        self._unload_remote(remote)

    @property
    def remote_agents(self) -> tuple[str, ...]:
        return tuple(self._remotes)

    def remote(self, name: str) -> RemoteAgent:
        try:
            return self._remotes[name]
        except KeyError:
            known = ", ".join(sorted(self._remotes)) or "none"
            raise RemoteAgentError(f"peer {name!r} is not loaded in agent {self.name!r} (loaded: {known})") from None

    # --- transfers ------------------------------------------------------------------------

    def submit(
        self,
        op: TransferOp,
        remote: str,
        local_addrs: Any,
        remote_addrs: Any,
        sizes: Any,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Submit one batch of fragments; returns at once with a handle to poll.

        Every local range must lie in memory this agent registered and every
        remote range in memory the peer registered (per its latest descriptor);
        otherwise nothing moves and ``RemoteRangeError`` / ``RegistrationError``
        names the first offending fragment.
        """
        self._check_open()
        op = TransferOp(op)
        if op is TransferOp.WRITE and not self.capabilities.write:
            raise UnsupportedOperationError(f"{self.backend} agent does not support WRITE")
        if op is TransferOp.READ and not self.capabilities.read:
            raise UnsupportedOperationError(f"{self.backend} agent does not support READ")
        if notification is not None and not self.capabilities.notifications:
            raise UnsupportedOperationError(f"{self.backend} agent does not support notifications")
        if notification is not None and not isinstance(notification, bytes):
            raise TransferError(f"notification must be bytes, got {type(notification).__name__}")
        peer = self.remote(remote)
        local = _as_u64("local_addrs", local_addrs)
        rem = _as_u64("remote_addrs", remote_addrs)
        size = _as_u64("sizes", sizes)
        if not (local.size == rem.size == size.size):
            raise TransferError(
                f"fragment arrays differ in length: local_addrs={local.size}, remote_addrs={rem.size}, sizes={size.size}"
            )
        if size.size and int(size.min()) == 0:
            raise TransferError(f"fragment {int(np.argmin(size))} has size 0")
        bad_local = ~ranges_inside(local, size, self._local_starts, self._local_ends)
        if bad_local.any():
            i = int(np.flatnonzero(bad_local)[0])
            raise RegistrationError(
                f"fragment {i}: local range [{int(local[i]):#x}, +{int(size[i])}) is not inside memory "
                f"registered with agent {self.name!r} ({int(bad_local.sum())} of {size.size} fragments affected)"
            )
        bad_remote = ~ranges_inside(rem, size, peer.starts, peer.ends)
        if bad_remote.any():
            i = int(np.flatnonzero(bad_remote)[0])
            raise RemoteRangeError(
                f"fragment {i}: remote range [{int(rem[i]):#x}, +{int(size[i])}) is not inside memory "
                f"peer {remote!r} registered ({int(bad_remote.sum())} of {size.size} fragments affected); nothing was moved"
            )
        handle = TransferHandle(
            id=next(self._ids),
            op=op,
            remote=remote,
            count=int(size.size),
            nbytes=int(size.sum()) if size.size else 0,
            notification=notification,
            submitted_at=time.monotonic(),
        )
        try:
            handle.native = self._submit(handle, peer, local, rem, size)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferFailedError(f"{self.backend} agent failed to submit to {remote!r}: {exc}") from exc
        self._handles[handle.id] = handle
        return handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Advance and report a transfer's state; a failure is kept in ``handle.error``."""
        if handle.released:
            raise TransferError(f"transfer {handle.id} was already released")
        if handle.status is TransferStatus.PENDING:
            try:
                handle.status = self._poll(handle)
            except TransferError as exc:
                handle.status, handle.error = TransferStatus.FAILED, exc
            except Exception as exc:
                handle.status = TransferStatus.FAILED
                handle.error = TransferFailedError(
                    f"{self.backend} transfer {handle.id} to {handle.remote!r} failed: {exc}"
                )
                handle.error.__cause__ = exc
        return handle.status

    def wait(self, handle: TransferHandle, timeout: float, *, interval: float = 0.0002) -> TransferStatus:
        """Poll until terminal; raises ``TransferTimeoutError`` after ``timeout`` seconds, or the transfer's error."""
        deadline = time.monotonic() + timeout
        sleep = interval
        while self.poll(handle) is TransferStatus.PENDING:
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(
                    f"{self.backend} transfer {handle.id} to {handle.remote!r} still pending after {timeout:.3f}s"
                )
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.005)
        if handle.status is TransferStatus.FAILED and handle.error is not None:
            raise handle.error
        return handle.status

    def release(self, handle: TransferHandle) -> None:
        """Free a terminal transfer's resources. A pending transfer is aborted if the transport can, else refused."""
        if handle.released:
            return
        if self.poll(handle) is TransferStatus.PENDING:
            if not self.capabilities.can_abort:
                raise TransferError(
                    f"transfer {handle.id} to {handle.remote!r} is still in flight and the {self.backend} agent "
                    "cannot abort it; poll until it is terminal before releasing"
                )
            self._abort(handle)
            handle.status = TransferStatus.FAILED
        self._release(handle)
        handle.released = True
        handle.native = None
        self._handles.pop(handle.id, None)

    def get_notifications(self) -> list[Notification]:
        """Notifications received since the last call, each delivered exactly once."""
        self._check_open()
        return self._get_notifications()

    def set_completion_listener(self, listener: Callable[[int], None] | None) -> None:
        """Be told, from any thread, the id of a transfer that may have ended; ``poll`` it to learn how.

        Only transports with ``capabilities.async_submit`` announce (from their copy or progress threads);
        with any other transport, keep polling. The listener must return quickly and must not call into the
        agent (it may run on a transport thread while another thread drives the agent). ``None`` removes it.
        """
        self._completion_listener = listener

    def _announce(self, handle_id: int) -> None:
        """Tell the completion listener that transfer ``handle_id`` may have ended (for transports)."""
        listener = self._completion_listener
        if listener is None:
            return
        try:
            listener(handle_id)
        except Exception:  # a listener's bug must not stop a transport thread
            log.exception("completion listener of agent %r failed", self.name)

    def progress(self) -> None:
        """Drive the transport once (transports with their own progress threads do nothing)."""

    def resources(self) -> dict[str, int]:
        """Live resource counts, for leak checks: all zero after ``close()`` or a full cleanup."""
        return {
            "registrations": len(self._registrations),
            "remote_agents": len(self._remotes),
            "transfers": len(self._handles),
            **self._native_resources(),
        }

    def close(self) -> None:
        """Release every transfer, peer and registration. Idempotent."""
        if self._closed:
            return
        for h in list(self._handles.values()):
            try:
                self.release(h)
            except TransferError:
                self._handles.pop(h.id, None)
        for name in list(self._remotes):
            self.unload_remote_agent(name)
        for reg in list(self._registrations.values()):
            self.deregister_memory(reg)
        self._close()
        self._closed = True

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self.name!r} is closed")

    def _lookup_local(self, addrs: np.ndarray) -> np.ndarray:
        """Index into ``registrations`` (insertion order) of the registration holding each address, or -1."""
        regs = list(self._registrations.values())
        starts = np.array([r.region.address for r in regs], dtype=np.uint64)
        ends = np.array([r.region.end for r in regs], dtype=np.uint64)
        out = np.full(addrs.size, -1, dtype=np.int64)
        for i in np.argsort(starts):
            hit = (addrs >= starts[i]) & (addrs < ends[i]) & (out < 0)
            out[hit] = i
        return out

    # --- primitives a transport implements --------------------------------------------------

    @abstractmethod
    def _register(self, region: MemoryRegion, keepalive: Any) -> Any:
        """Register ``region`` with the transport; return its native handle."""

    @abstractmethod
    def _deregister(self, registration: Registration) -> None:
        """Undo ``_register``."""

    @abstractmethod
    def _descriptor_payload(self) -> bytes:
        """Transport data a peer needs to reach this agent (never pickle)."""

    def _identity_payload(self) -> bytes | None:
        """The payload of ``descriptor(exposed=False)``: what identifies this agent to a peer, with no key to its
        memory; None (the default) when a peer never needs to load this agent without access to its memory."""
        return None

    @abstractmethod
    def _load_remote(self, descriptor: AgentDescriptor, previous: RemoteAgent | None) -> Any:
        """Connect to a peer; ``previous`` is the earlier state when the same agent is refreshing its descriptor.

        ``previous`` is only ever the agent ``descriptor`` comes from (``_same_agent``): another agent under a
        loaded name was refused, or its gone predecessor unloaded, before this is called.
        """

    def _same_agent(self, loaded: RemoteAgent, descriptor: AgentDescriptor) -> bool:
        """Whether ``descriptor`` comes from the agent object ``loaded`` was loaded from (its refresh).

        Called only when the incarnations (processes) match. Compare what stays fixed for the agent's life and
        what a peer reaches it by (a worker address, a NIXL agent name, socket names), never what changes when
        it registers memory (regions, rkeys, metadata). Default: True, the incarnation alone identifies it;
        a transport whose process can hold two agents of one name (an engine rebuilt in place) overrides it.
        """
        return True

    def _peer_gone(self, loaded: RemoteAgent) -> bool:
        """Whether the loaded peer provably serves no more (its process died, its endpoint failed).

        True lets another agent's descriptor replace it under its name; be sure: a wrong True lets a live
        peer's name be taken over. Default: False, only ``unload_remote_agent`` frees a name.
        """
        return False

    def _describe_agent(self, descriptor: AgentDescriptor) -> str:
        """A short description of the agent a descriptor names, for errors: its incarnation, then transport details."""
        return descriptor.incarnation[:8]

    @abstractmethod
    def _unload_remote(self, remote: RemoteAgent) -> None:
        """Drop a peer's connection state."""

    @abstractmethod
    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        """Start the transfer (arrays are validated uint64); return its native handle."""

    @abstractmethod
    def _poll(self, handle: TransferHandle) -> TransferStatus:
        """Report the transfer's state; raise a ``TransferError`` subclass on failure.

        ``DONE`` is a promise: every byte of every fragment is visible in the
        destination memory (for WRITE, in the peer's memory), so the receiver may
        read it as soon as the initiator reports completion on the control plane.
        """

    @abstractmethod
    def _release(self, handle: TransferHandle) -> None:
        """Free a terminal transfer's native resources."""

    @abstractmethod
    def _get_notifications(self) -> list[Notification]:
        """Drain received notifications."""

    def _abort(self, handle: TransferHandle) -> None:
        """Stop an in-flight transfer (only for agents with ``can_abort``)."""
        raise UnsupportedOperationError(f"{self.backend} agent cannot abort transfers")

    def _exported(self, registration: Registration) -> bool:
        """Whether peers may address this registration (it is listed in the descriptor); default: all are.

        A transport that can only reach some of its registrations remotely (the
        shm agent: only memory inside its shared segments) returns False for the
        rest, which stay usable as local sources and destinations.
        """
        return True

    def _close(self) -> None:
        """Release transport-wide resources (workers, threads, segments)."""

    def _native_resources(self) -> dict[str, int]:
        """Transport-specific live counts for ``resources()``."""
        return {}
