"""Sealed memfd segments: the memory the shm agent shares, and the check a peer's memfd must pass before mapping.

A segment is a memfd sealed against shrinking and growing, mapped once; the owner keeps its fd to pass to peers,
a peer keeps only the mapping. ``check_sealed_memfd`` is the rule that makes mapping a peer's memory safe: a
memfd nobody can truncate never raises SIGBUS under a copy.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from kvcore.errors import RemoteAgentError
from kvcore.transport.builtin.shm_protocol import F_GET_SEALS, F_SEAL_SHRINK


def _address_of(mm: mmap.mmap) -> int:
    """The address of an mmap's first byte, without keeping a buffer export alive."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:  # pragma: no cover
            pass


def check_sealed_memfd(fd: int, min_size: int) -> None:
    """``RemoteAgentError`` unless ``fd`` is a regular file sealed against shrinking, of at least ``min_size`` bytes."""
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as exc:
        raise RemoteAgentError(f"the peer passed an fd that cannot be sealed (not a memfd): {exc}") from exc
    if not seals & F_SEAL_SHRINK:
        raise RemoteAgentError(
            f"the peer passed a memfd not sealed against shrinking (seals {seals:#x}): it could truncate it under us"
        )
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < min_size:
        raise RemoteAgentError(f"the peer passed a memfd of {st.st_size} bytes; its descriptor declares {min_size}")


@dataclass(eq=False)
class _Segment:
    """A sealed memfd mapped in this process (one we own, with its fd; or one of a peer's, fd already closed)."""

    id: int
    size: int
    mm: mmap.mmap
    local: int  # address of the mapping in this process
    base: int = 0  # address in the owner process (== local for our own)
    fd: int = -1  # kept open for our own segments: it is what we pass to peers
    exports: int = 0  # live exported registrations inside (our own segments)

    def close(self) -> bool:
        """Unmap (and close our fd); False when tensors still hold the memory (freed with the last tensor)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
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
