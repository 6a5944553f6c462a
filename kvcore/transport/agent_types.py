"""The values of the transfer-agent contract: memory regions, registrations, descriptors, handles, capabilities.

Plain data, no behaviour beyond validation: what :class:`~kvcore.transport.agent.TransferAgent` takes and returns,
and what a peer reads from a descriptor (msgpack, never pickle). Every name here is importable from
``kvcore.transport.agent`` (where the contract documents it) and the engine-facing ones from ``kvcore``.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvcore.errors import RegistrationError, TransferError

if TYPE_CHECKING:
    import torch

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
class CheckedPlan:
    """A batch of fragments an agent's ``check_plan`` found inside registered memory on both sides.

    ``submit_checked(plan, start, stop)`` submits fragments ``start:stop`` of it without checking them again while
    neither side's registrations changed since the check (the agent's registration generation, the peer object it
    loaded); once one did, that piece is checked again before any byte moves. The arrays are the agent's own
    read-only copies, so no fragment changes after its check. Only the agent that checked a plan accepts it.
    """

    op: TransferOp
    remote: str
    local: np.ndarray  # uint64, read-only
    remote_addrs: np.ndarray  # uint64, read-only
    sizes: np.ndarray  # uint64, read-only, none zero
    before: np.ndarray  # uint64, count + 1: bytes of the fragments before each one (the last: the plan's bytes)
    agent: object  # the agent that checked it
    peer: RemoteAgent  # the peer object its remote ranges were checked against
    generation: int  # the agent's registration generation at the check
    native: Any = None  # the transport's per-plan work (region indices, descriptors), made by its first piece

    @property
    def count(self) -> int:
        """Fragments in the plan."""
        return int(self.sizes.size)

    def nbytes(self, start: int = 0, stop: int | None = None) -> int:
        """Bytes of fragments ``start:stop`` (the whole plan by default)."""
        return int(self.before[self.count if stop is None else stop]) - int(self.before[start])


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
