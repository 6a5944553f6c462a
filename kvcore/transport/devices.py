"""Where the KV pools are: the ``device`` an engine names, checked against what torch's CUDA allocator holds.

An engine that leaves ``device="cpu"`` (the default) for pools on a GPU, or names one GPU for pools on another,
would have them registered as host memory or on the wrong device. What a transport does with such a
registration is its own affair: a failed transfer, a fault inside a copy, or bytes on the wrong GPU. Where
torch's caching allocator holds a pool's memory, the mismatch is refused before anything is registered; memory
that torch does not hold (host memory, another allocator's) is taken as named.
"""

from __future__ import annotations

import bisect
import re
import sys
from collections.abc import Iterable, Sequence

from kvcore.errors import ConfigError
from kvcore.transport.agent_types import MemoryKind

__all__ = ["cuda_segments", "pool_device_mistake", "pool_memory"]

_DEVICE = re.compile(r"cpu|cuda(?::([0-9]{1,3}))?")  # ASCII digits only (\d takes any script's digits)

#: One segment of torch's CUDA caching allocator: (address, bytes, device index).
Segment = tuple[int, int, int]


def cuda_segments() -> list[Segment]:
    """The segments torch's CUDA caching allocator holds in this process; none where CUDA was never initialized.

    An allocator that keeps no snapshot (another backend, a torch without CUDA) gives none: nothing to check.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    try:
        if not torch.cuda.is_initialized():
            return []
        try:
            segments = torch.cuda.memory_snapshot(include_traces=False)  # newer torch: no stack traces copied
        except TypeError:
            segments = torch.cuda.memory_snapshot()
        return [(int(s["address"]), int(s["total_size"]), int(s["device"])) for s in segments]
    except Exception:  # an allocator without snapshots: the device is taken as named
        return []


def pool_device_mistake(regions: Iterable[tuple[int, int]], device: str, segments: Sequence[Segment]) -> str | None:
    """What is wrong with ``device`` for these pool regions, as the allocator's ``segments`` show; None if nothing.

    Args:
        regions: the pools' ``(address, length)`` ranges (``PageTable.regions()``).
        device: ``"cpu"`` or ``"cuda:N"`` (already checked; ``"cuda"`` is ``"cuda:0"``).
        segments: ``(address, bytes, device index)`` of the CUDA memory torch holds (:func:`cuda_segments`).
    """
    want = None if device == "cpu" else int(device.partition(":")[2] or 0)
    ordered = sorted(segments)
    starts = [start for start, _, _ in ordered]
    longest = max((size for _, size, _ in ordered), default=0)
    for addr, length in regions:
        # Segments overlapping [addr, addr + length): they start before its end and no earlier than the longest
        # segment could reach back from its start.
        lo, hi = bisect.bisect_right(starts, addr - longest), bisect.bisect_left(starts, addr + length)
        on = sorted({d for start, size, d in ordered[lo:hi] if addr < start + size})
        if not on or on == [want]:
            continue
        where = " and ".join(f"cuda:{d}" for d in on)
        if want is None:
            return (
                f"the KV pool at {addr:#x} ({length} bytes) is GPU memory on {where} (torch's CUDA allocator holds "
                f"it), but device='cpu' would register it as host memory: pass device='cuda:{on[0]}'"
            )
        hint = " ('cuda' means 'cuda:0' to kvcore, not torch's current device)" if device == "cuda" else ""
        return (
            f"the KV pool at {addr:#x} ({length} bytes) is on {where} (torch's CUDA allocator holds it), "
            f"not on the device named, {device!r}{hint}: pass device='cuda:{on[0]}'"
        )
    return None


def pool_memory(
    device: str, regions: Sequence[tuple[int, int]], segments: Sequence[Segment] | None = None
) -> tuple[MemoryKind, int]:
    """The memory kind and device index to register the pools with, from the engine's ``device``.

    ``segments``: the CUDA memory torch holds; None: this process's (:func:`cuda_segments`).

    Raises:
        ConfigError: ``device`` is not ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; or torch's CUDA allocator holds a
            pool on another device than the one named (``"cpu"`` included).
    """
    m = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    if m is None:
        raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    mistake = pool_device_mistake(regions, device, cuda_segments() if segments is None else segments)
    if mistake is not None:
        raise ConfigError(mistake)
    if device == "cpu":
        return MemoryKind.DRAM, 0
    return MemoryKind.VRAM, int(m.group(1) or 0)
