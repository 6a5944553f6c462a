"""Registration book-keeping of a transfer agent: which local memory it registered and which of it peers may reach.

:class:`AgentMemory` keeps the registrations, the merged address ranges every ``submit`` checks local fragments
against, and the ``generation`` a descriptor carries (bumped on every change, so a peer tells a newer descriptor
from an older one). The transport's part is ``_register`` / ``_deregister`` (and ``_exported`` where only some
memory can be offered to peers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcore.errors import RegistrationError, TransferError, UnsupportedOperationError
from kvcore.transport.agent_base import AgentBase
from kvcore.transport.agent_types import MemoryRegion, Registration
from kvcore.transport.ranges import merge_intervals

if TYPE_CHECKING:
    import torch


class AgentMemory(AgentBase, ABC):
    """The memory part of the agent contract: register, deregister, offer to peers, look addresses up."""

    def allocate_tensor(self, shape: Sequence[int], dtype: Any, device: str = "cpu") -> torch.Tensor:
        """Allocate a zeroed tensor that this agent can expose to peers (e.g. KV pools on the receiver).

        Transports that need special memory (the shm agent needs shared memory) override this; the default is an
        ordinary torch allocation. The tensor is not registered: pass it to ``register_memory``.

        Args:
            shape: the tensor's shape.
            dtype: a ``torch.dtype``.
            device: ``"cpu"``, or a CUDA device where the transport registers VRAM.

        Returns:
            The zeroed tensor.

        Raises:
            UnsupportedOperationError: (an override) the transport cannot allocate on ``device``.
            RegistrationError: (an override) the transport could not allocate memory it can expose.
        """
        import torch

        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    def register_memory(self, memory: torch.Tensor | MemoryRegion) -> Registration:
        """Register a tensor or raw region so it can be a transfer source or a peer's destination.

        The registration holds the tensor alive until ``deregister_memory``. Peers see it (if ``offers`` says so)
        in the next ``descriptor()``; the memory is a valid local range for ``submit`` at once.

        Args:
            memory: a contiguous CPU or CUDA tensor, or a :class:`MemoryRegion`.

        Returns:
            The :class:`Registration`, to pass back to ``deregister_memory``.

        Raises:
            TransferError: the agent is closed.
            RegistrationError: the tensor is not contiguous or on an unsupported device, the region is empty, or
                the transport failed to register it (its own error chained).
            UnsupportedOperationError: the memory kind (DRAM, VRAM) is not in ``capabilities.memory_kinds``.
        """
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
        """Withdraw a registration. Peers must load the new descriptor; the old ranges are refused from then on.

        Args:
            registration: what ``register_memory`` returned.

        Raises:
            RegistrationError: ``registration`` is not registered with this agent (never was, or already withdrawn).
            Exception: whatever the transport's ``_deregister`` raised, as it is; the memory then stays registered
                and alive.
        """
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
        """The live registrations, in the order they were made."""
        return tuple(self._registrations.values())

    def offers(self, registration: Registration) -> bool:
        """Whether peers may address ``registration`` (it is listed in this agent's descriptor).

        False for memory the transport can only use locally (the shm agent: memory not from its
        ``allocate_tensor``); such memory is a valid local source or destination, never a peer's target.

        Args:
            registration: one of this agent's registrations.

        Returns:
            True when the registration is listed in ``descriptor()``.
        """
        return self._exported(registration)

    def _registrations_changed(self) -> None:
        self._generation += 1
        regions = [r.region for r in self._registrations.values()]
        starts = np.array([r.address for r in regions], dtype=np.uint64)
        ends = np.array([r.end for r in regions], dtype=np.uint64)
        self._local_starts, self._local_ends = merge_intervals(starts, ends)

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

    def _exported(self, registration: Registration) -> bool:
        """Whether peers may address this registration (it is listed in the descriptor); default: all are.

        A transport that can only reach some of its registrations remotely (the
        shm agent: only memory inside its shared segments) returns False for the
        rest, which stay usable as local sources and destinations.
        """
        return True
