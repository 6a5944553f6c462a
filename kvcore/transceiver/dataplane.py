"""The data plane of one rank: plans moved through its transfer agent in chunks, one in flight per transfer.

A role moves a plan with ``DataPlane.submit`` and learns the end through the
returned ``Transfer`` (``poll``, and an ``on_done`` callback on the worker
thread as soon as the transfer is terminal). An agent whose ``submit`` returns
before the bytes move (``async_submit``: the shm agent's copy threads) gets the
plan at once and announces its end; the worker then reports it without waiting
for a timer. An agent whose ``submit`` moves the bytes itself (NIXL or UCX over
CMA) gets a large plan in chunks, one at a time, and the worker serves new
requests, results and timers between chunks: a small request waits for at most
one chunk of a large one, never for all of it. The chunk adapts:
``CHUNK_BYTES`` while this rank has nothing else to do (fewer submits, full
speed), ``FINE_CHUNK_BYTES`` while other requests come and go (a message or a
work item beside a chunked transfer within the last ``BUSY_WINDOW_S``), so that
they wait for a shorter copy. When the first chunk is still in flight after
``submit`` returned (the transport posts asynchronously: RDMA, TCP lanes), the
rest of the plan follows as one chunk. A chunked plan is checked against registered memory once, whole
(``TransferAgent.check_plan``), and each piece is a slice of that checked plan (``submit_checked``): no piece
pays the checks again, and none is submitted unchecked after a registration changed.

Everything here runs on the worker thread (the messenger's I/O thread), but
``DataPlane.stop``, which any thread may call.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvcore import errors as E
from kvcore.transceiver.counters import RoleCounter
from kvcore.transport.agent import CheckedPlan, TransferAgent, TransferHandle, TransferOp, TransferStatus

__all__ = [
    "Transfer",
    "DataPlane",
    "chunk_plan",
    "CHUNK_BYTES",
    "QUIET_PIECE_S",
    "MAX_QUIET_CHUNKS",
    "FINE_CHUNK_BYTES",
    "BUSY_WINDOW_S",
    "PUMP_BUDGET_S",
]

log = logging.getLogger("kvcore.transceiver")
_R = TypeVar("_R")

#: The first piece of a plan posted to an agent whose submit moves the bytes itself, before this rank has
#: measured how fast that agent copies (16 MiB: about 2.5 ms of CMA copy on a small box).
CHUNK_BYTES = 16 * 1024 * 1024
#: How long one piece may copy while the rank is quiet, once the agent's copy rate is known: the longest a
#: request arriving beside a large one waits before the pieces turn fine (8 ms: 40-44 MiB over NIXL and UCX on
#: this box, 12-13 pieces for a 512 MiB request instead of 32 of 16 MiB; a faster copy gets larger pieces).
QUIET_PIECE_S = 0.008
#: The most fine chunks in one quiet piece (256 MiB).
MAX_QUIET_CHUNKS = 64
#: The chunk while other requests are active on this rank: the longest copy a newcomer can wait behind (4 MiB:
#: about half a millisecond of CMA copy on a small box).
FINE_CHUNK_BYTES = 4 * 1024 * 1024
#: How recent (seconds) a message or a work item must be for the rank to count as busy (fine chunks).
BUSY_WINDOW_S = 0.01
#: How long (seconds) the worker may post chunks of a transfer back to back while nothing else waits for it.
PUMP_BUDGET_S = 0.01


def chunk_plan(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Split a plan into consecutive chunks of about ``limit`` bytes: ``(src, dst, sizes, bounds)``.

    Fragments larger than ``limit`` are cut into ``limit``-byte pieces first; chunk ``i`` is fragments
    ``bounds[i]:bounds[i+1]`` and holds at most ``2 * limit`` bytes. Every byte of the plan is in exactly one
    chunk, in the plan's order.
    """
    src, dst, sizes = (np.asarray(a, dtype=np.uint64) for a in (src, dst, sizes))
    lim = np.uint64(limit)
    if sizes.size and int(sizes.max()) > limit:
        pieces = (sizes + lim - np.uint64(1)) // lim
        which = np.repeat(np.arange(sizes.size), pieces.astype(np.int64))
        first = np.concatenate(([0], np.cumsum(pieces)[:-1])).astype(np.int64)
        k = (np.arange(which.size, dtype=np.int64) - first[which]).astype(np.uint64) * lim
        src, dst = src[which] + k, dst[which] + k
        sizes = np.minimum(lim, sizes[which] - k)
    before = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64) if sizes.size else sizes
    window = before // lim
    bounds = [0, *(np.flatnonzero(np.diff(window)) + 1).tolist(), int(sizes.size)]
    return src, dst, sizes, bounds


@dataclass(eq=False)
class Transfer:
    """One plan as the data plane moves it: consecutive chunks through the agent, one in flight at a time.

    ``plan``: the plan as the agent checked it once, whole (``check_plan``), when it goes in more than one fine
    chunk: each piece is ``submit_checked`` of a slice of it (None: the plan went as one ``submit``). ``bounds``
    cut the plan into fine chunks; the piece in flight is fine chunks ``chunk`` to ``chunk + span`` (several fine
    chunks go as one submit while the rank is quiet).

    ``status`` is PENDING until every chunk is terminal at the transport; then DONE (every byte landed) or
    FAILED (``error``; no chunk is in flight and none is posted after it).
    """

    op: TransferOp
    remote: str
    plan: CheckedPlan | None
    bounds: list[int]
    on_done: Callable[[], None] | None
    nbytes: int
    chunk: int = 0  # the first fine chunk of the piece in flight
    span: int = 1  # fine chunks in the piece in flight
    posted_at: float = float("inf")  # when the piece in flight was submitted (none yet: nothing came beside it)
    handle: TransferHandle | None = None
    status: TransferStatus = TransferStatus.PENDING
    error: E.TransferError | None = None
    pumped: bool = False  # chunks left and the transport copies inside submit: the worker posts them without sleeping
    stopped: str = ""  # why no further chunk may be posted (the writer gave up): it ends FAILED

    @property
    def chunks(self) -> int:
        return len(self.bounds) - 1

    @property
    def more(self) -> bool:
        """Fine chunks remain after the piece in flight."""
        return self.chunk + self.span < self.chunks


class DataPlane:
    """The transfers in flight through one rank's agent: each submitted in chunks and advanced to its end.

    ``counters``: the rank's counters (``agent_errors``, ``chunks_back_to_back`` are counted here).
    ``waiting``: whether anything else waits for the worker thread (work, a stop, a message): a transfer
    chunked alone then yields the thread between chunks.
    """

    def __init__(self, agent: TransferAgent, counters: Counter[RoleCounter], waiting: Callable[[], bool]) -> None:
        self.agent = agent
        self.counters = counters
        self._waiting = waiting
        # Transfers not yet terminal, and the one behind each agent handle.
        self._xfers: dict[int, Transfer] = {}
        self._by_handle: dict[int, Transfer] = {}
        self.chunked = 0  # transfers with chunks still to post (pumped by the worker loop)
        self.chunk_bytes = 0 if agent.capabilities.async_submit else CHUNK_BYTES
        self.fine_chunk_bytes = FINE_CHUNK_BYTES
        #: Per peer, bytes/s of the last piece the agent copied on this thread (absent: not known yet).
        self.copy_rates: dict[str, float] = {}
        self.last_other = 0.0  # when a message or work last came beside a chunked transfer

    def note_other(self, now: float) -> None:
        """A message or a work item came for the worker: chunked transfers' next pieces are fine."""
        if self.chunked:
            self.last_other = now

    def submit(
        self,
        op: TransferOp,
        remote: str,
        src: np.ndarray,
        dst: np.ndarray,
        sizes: np.ndarray,
        on_done: Callable[[], None] | None = None,
    ) -> Transfer:
        """Start moving a plan to (WRITE) or from (READ) loaded peer ``remote``; returns its ``Transfer``.

        A plan of more than one fine chunk is checked whole once (``check_plan``) and moves in pieces of that
        checked plan; a smaller one goes as one ``submit``. Raises the agent's ``TransferError`` when the plan or
        its first chunk is refused (then nothing moved). ``on_done`` runs on the worker thread as soon as the
        worker sees the transfer end after this returned; a transfer that ended inside ``submit`` is seen by the
        caller's first ``poll``.
        """
        small = type(sizes) is np.ndarray and sizes.size <= 8  # a one-block request: Python sums it faster
        nbytes = sum(sizes.tolist()) if small else int(np.asarray(sizes, dtype=np.uint64).sum())
        fine = min(self.fine_chunk_bytes, self.chunk_bytes) if self.chunk_bytes else 0
        if fine and nbytes > fine:
            src, dst, sizes, bounds = chunk_plan(src, dst, sizes, fine)
        else:
            bounds = [0, len(sizes)]
        if len(bounds) > 2:
            x = Transfer(op, remote, self._check(op, remote, src, dst, sizes), bounds, None, nbytes)
            self._post_chunk(x)  # the first chunk's refusal is the caller's error
        else:
            x = Transfer(op, remote, None, bounds, None, nbytes)
            x.posted_at = time.monotonic()
            self._posted(x, self._call("submit", remote, self.agent.submit, op, remote, src, dst, sizes))
        if x.more and x.handle is not None and self.agent.poll(x.handle) is TransferStatus.PENDING:
            # The transport did not move the chunk inside submit (RDMA, a remote lane): it does not hold
            # this thread, so the rest goes as one more chunk rather than paying a submit per chunk.
            x.bounds, x.span = [0, x.bounds[x.span], x.bounds[-1]], 1
        elif x.more:
            x.pumped = True
            self.chunked += 1
        self._xfers[id(x)] = x
        x.on_done = on_done
        return x

    def _check(self, op: TransferOp, remote: str, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> CheckedPlan:
        return self._call("check_plan", remote, self.agent.check_plan, op, remote, src, dst, sizes)

    def _call(self, name: str, remote: str, fn: Callable[..., _R], *args: Any) -> _R:
        """``fn(*args)``, an agent call; its kvcore errors propagate. Anything else is an agent bug (its contract
        says TransferError): it fails this transfer, never the worker's loop, and no handle exists to poll, so the
        request ends FAILED instead of waiting for its deadline."""
        try:
            return fn(*args)
        except E.KvcoreError:
            raise
        except Exception as exc:
            self.counters["agent_errors"] += 1
            log.error(
                "agent %s: %s to %r raised %s", self.agent.backend, name, remote, type(exc).__name__, exc_info=True
            )
            raise E.TransferFailedError(
                f"the {self.agent.backend} agent's {name} to {remote!r} raised {type(exc).__name__}: {exc}"
            ) from exc

    def _span(self, x: Transfer) -> int:
        """Fine chunks in ``x``'s next submit: one while other requests are active (traffic or work came while its
        last piece copied, or within ``BUSY_WINDOW_S``), so they wait for less; else as many as the agent copies in
        ``QUIET_PIECE_S`` at its measured rate (``chunk_bytes`` until a rate is known), at most ``MAX_QUIET_CHUNKS``.
        """
        if self.last_other >= x.posted_at or time.monotonic() - self.last_other < BUSY_WINDOW_S:
            return 1
        fine = max(1, self.fine_chunk_bytes)
        rate = self.copy_rates.get(x.remote, 0.0)
        quiet = rate * QUIET_PIECE_S if rate > 0 else self.chunk_bytes
        return max(1, min(MAX_QUIET_CHUNKS, int(quiet) // fine))

    def _post_chunk(self, x: Transfer) -> None:
        x.span = min(self._span(x), x.chunks - x.chunk)
        a, b = x.bounds[x.chunk], x.bounds[x.chunk + x.span]
        x.posted_at = time.monotonic()
        assert x.plan is not None  # a transfer of more than one fine chunk is checked whole first
        h = self._call("submit", x.remote, self.agent.submit_checked, x.plan, a, b)
        self._posted(x, h)
        self._note_rate(x, h, x.plan.nbytes(a, b))

    def _posted(self, x: Transfer, h: TransferHandle) -> None:
        x.handle = h
        self._by_handle[h.id] = x

    def _note_rate(self, x: Transfer, h: TransferHandle, nbytes: int) -> None:
        """A piece that is DONE at its first poll was copied on this thread (inside ``submit``, or inside that poll
        as the UCX agent's progress does): its rate, from submit to that poll, sizes this peer's next quiet pieces."""
        try:
            done = self.agent.poll(h) is TransferStatus.DONE
        except E.KvcoreError:
            return  # the piece's end (and error) is the worker's to see when it advances the transfer
        took = time.monotonic() - x.posted_at
        if done and took > 0:
            if len(self.copy_rates) >= 4096:
                self.copy_rates.clear()  # bounded: peers come and go
            self.copy_rates[x.remote] = nbytes / took

    def poll(self, x: Transfer) -> TransferStatus:
        """Advance ``x`` (post its next chunk when one ended) and report its state; never calls ``on_done``.

        A transfer the worker loop pumps chunk by chunk is only reported: one chunk per loop turn, with the
        work queue served between chunks, whoever polls.
        """
        if not x.pumped:
            self._advance(x, notify=False)
        return x.status

    def stop(self, x: Transfer, why: str) -> None:
        """Post no further chunk of ``x``: it ends FAILED once the chunk in flight is terminal (any thread)."""
        x.stopped = why or "stopped"

    def release(self, x: Transfer) -> None:
        """Check that ``x`` may be forgotten: terminal (its agent handles were released as its chunks ended)."""
        if x.status is TransferStatus.PENDING:
            raise E.TransferError(f"transfer to {x.remote!r} is still in flight; poll it until it is terminal")

    def _advance(self, x: Transfer, *, notify: bool = True) -> None:
        h = x.handle
        if h is None:
            return
        status = self.agent.poll(h)
        if status is TransferStatus.PENDING:
            return
        error = h.error
        self._by_handle.pop(h.id, None)
        x.handle = None
        self.agent.release(h)
        if status is TransferStatus.DONE and x.more and x.stopped:
            status = TransferStatus.FAILED
            moved = x.plan.nbytes(0, x.bounds[x.chunk + x.span]) if x.plan is not None else 0
            error = E.TransferFailedError(
                f"transfer to {x.remote!r} stopped after {moved} of {x.nbytes} bytes: {x.stopped}"
            )
        if status is TransferStatus.DONE and x.more:
            x.chunk += x.span
            try:
                self._post_chunk(x)
                return
            except E.TransferError as exc:
                status, error = TransferStatus.FAILED, exc
        if x.pumped:
            x.pumped = False
            self.chunked -= 1
        self._xfers.pop(id(x), None)
        x.status = status
        if status is TransferStatus.FAILED:
            x.error = error or E.TransferFailedError(f"transfer to {x.remote!r} failed")
        if notify and x.on_done is not None:
            x.on_done()

    def pump(self) -> bool:
        """Post the next chunk of every chunked transfer whose current chunk ended.

        One chunk each per turn while several transfers are chunked (they take turns). A transfer chunked alone
        whose chunks end inside ``submit`` (a copy on this thread) gets its next chunk at once, for up to
        ``PUMP_BUDGET_S``, as long as no message, wake-up or work waits for this thread: a trip round the loop
        between two chunks cost 0.07-0.12 ms over NIXL on this box, back to back 0.035-0.075 ms.
        True when a chunk was posted: the loop comes back without sleeping. When every current chunk is still
        in flight (a remote that must progress first), the loop sleeps as for any busy wait.
        """
        posted = False
        alone = self.chunked == 1
        until = time.monotonic() + PUMP_BUDGET_S
        for x in list(self._xfers.values()):
            if not x.pumped:
                continue
            chained = False
            while True:
                before = x.chunk
                self._advance(x)
                if x.chunk == before:
                    break  # still in flight, or finished
                posted = True
                if chained:
                    self.counters["chunks_back_to_back"] += 1
                if not (alone and x.pumped) or self._waiting():
                    break
                if time.monotonic() > until:
                    break
                chained = True
        return posted

    def finish(self, handle_id: int) -> bool:
        """The agent announced that the transfer behind ``handle_id`` may have ended: advance it (False: not ours)."""
        x = self._by_handle.get(handle_id)
        if x is None:
            return False
        self._advance(x)
        return True
