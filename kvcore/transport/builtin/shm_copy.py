"""The shm agent's copies: small transfers inside ``submit``, large ones on copy threads, slice by slice in turn.

A transfer of up to ``_INLINE_BYTES`` is copied inside ``submit`` (a few microseconds; no thread hop). A larger
one becomes a :class:`_Job` for the :class:`_CopyEngine`, whose threads take at most ``_SLICE_BYTES`` of one job
before serving the next, so a small transfer never waits behind the whole of a large one. Copies use glibc's
``memmove`` through ctypes, which releases the GIL.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvcore.errors import TransferError
from kvcore.transport.builtin.shm_peer import _Peer
from kvcore.transport.fragments import merge_runs

_memmove = ctypes.memmove  # a CFUNCTYPE: releases the GIL while glibc copies
# Transfers up to this size are copied inside submit (a few microseconds; no thread hop), larger ones by the
# copy threads, which take at most _SLICE_BYTES of one transfer before serving the next: a small transfer
# never waits behind the whole of a large one.
_INLINE_BYTES = 256 * 1024
_SLICE_BYTES = 2 * 1024 * 1024
_COPY_THREADS = 2


def _merge_runs(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """Merge consecutive fragments that are contiguous on both sides; returns Python lists for the copy loop."""
    d, s, n, _ = merge_runs(dst, src, sizes)
    return d.tolist(), s.tolist(), n.tolist()


@dataclass(eq=False)
class _Xfer:
    """A transfer: its copy job (None once copied inside submit) and a notification the peer's queue has not taken.

    ``pending`` is sent only after every byte landed.
    """

    pending: bytes | None
    address: bytes
    job: _Job | None = None
    error: TransferError | None = None  # set by the copy thread when the notification failed


@dataclass(eq=False)
class _Job:
    """One transfer's copy, run by the copy threads in slices: runs ``(dst, src, n)`` from ``i``/``off`` on."""

    dst: list[int]
    src: list[int]
    n: list[int]
    peer: _Peer
    handle_id: int
    xfer: _Xfer
    i: int = 0  # next run to copy
    off: int = 0  # bytes of run ``i`` already handed out
    active: int = 0  # slices being copied now
    finished: bool = False  # every byte landed

    @property
    def exhausted(self) -> bool:
        return self.i >= len(self.n)

    def take(self, limit: int) -> list[tuple[int, int, int]]:
        """The next slice: whole runs (and at most one part of a run) totalling at most ``limit`` bytes."""
        out: list[tuple[int, int, int]] = []
        left = limit
        while left > 0 and self.i < len(self.n):
            k = min(self.n[self.i] - self.off, left)
            out.append((self.dst[self.i] + self.off, self.src[self.i] + self.off, k))
            left -= k
            self.off += k
            if self.off == self.n[self.i]:
                self.i, self.off = self.i + 1, 0
        return out


class _CopyEngine:
    """Copy threads for the shm agent: every live job gets a slice in turn (round robin), so none waits for another.

    Threads start at the first job and stop at ``stop()``. ``wait_peer`` blocks until no job writes or reads a
    peer's mappings, so they are never unmapped under a copy.
    """

    def __init__(self, name: str, threads: int, on_done: Callable[[_Job], None]) -> None:
        self._name, self._nthreads, self._on_done = name, threads, on_done
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()  # jobs with slices left to hand out
        self._live: set[_Job] = set()  # jobs not finished
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def start(self, job: _Job) -> None:
        with self._cv:
            if self._stopping:
                raise TransferError("the shm agent is closing; no new copies")
            self._live.add(job)
            self._queue.append(job)
            if len(self._threads) < self._nthreads:
                t = threading.Thread(target=self._run, name=f"{self._name}-copy{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                pieces = job.take(_SLICE_BYTES)
                job.active += 1
                if not job.exhausted:
                    self._queue.append(job)  # its next slice after every other job's
            try:
                for d, s, k in pieces:
                    _memmove(d, s, k)
            finally:
                with self._cv:
                    job.active -= 1
                    done = job.exhausted and job.active == 0 and not job.finished
                    if done:
                        job.finished = True
                        self._live.discard(job)
                        self._cv.notify_all()
            if done:
                self._on_done(job)

    def wait_peer(self, peer: _Peer) -> None:
        """Return once no live job touches ``peer``'s mappings (copies always end: memmove cannot block)."""
        with self._cv:
            self._cv.wait_for(lambda: not any(j.peer is peer for j in self._live))

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def threads(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        """Finish every job, then end the threads."""
        with self._cv:
            self._cv.wait_for(lambda: not self._live)
            self._stopping = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)
