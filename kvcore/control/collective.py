"""Agreement among the ranks of one instance: a tiny allgather interface with two implementations.

Engines already run a process group; kvcore only needs ``allgather(bytes)``.
``LocalCollective`` is the single-process default; ``TorchCollective`` wraps a
``torch.distributed`` group (gloo for CPU tensors). Payloads are msgpack bytes
built by kvcore, never pickled objects.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from kvcore.errors import CollectiveError

__all__ = ["Collective", "LocalCollective", "TorchCollective"]


@runtime_checkable
class Collective(Protocol):
    """Every rank calls ``allgather`` in the same order; each gets all ranks' payloads, indexed by rank."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allgather(self, data: bytes) -> list[bytes]: ...


class LocalCollective:
    """One rank, nothing to agree with."""

    rank = 0
    size = 1

    def allgather(self, data: bytes) -> list[bytes]:
        return [bytes(data)]


class TorchCollective:
    """Allgather over a ``torch.distributed`` process group (``None`` is the default group)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allgather(self, data: bytes) -> list[bytes]:
        """All ranks' payloads; ``CollectiveError`` when the group fails (a rank closed, exited or fell out of step)."""
        try:
            return self._allgather(data)
        except CollectiveError:
            raise
        except Exception as exc:  # gloo/NCCL raise RuntimeError (connection closed, timeout) or DistBackendError
            raise CollectiveError(
                f"allgather among this instance's {self._size} ranks failed on rank {self._rank}: another rank "
                f"closed its transceiver or exited, or the ranks stopped calling poll() in step "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''})"
            ) from exc

    def _allgather(self, data: bytes) -> list[bytes]:
        import torch

        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._size)]
        self._dist.all_gather(sizes, n, group=self._group)
        width = max(int(s.item()) for s in sizes) or 1
        buf = torch.zeros(width, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(width, dtype=torch.uint8) for _ in range(self._size)]
        self._dist.all_gather(out, buf, group=self._group)
        return [bytes(t[: int(s.item())].numpy().tobytes()) for t, s in zip(out, sizes)]
