"""Request lifecycles: send and receive sessions, the tasks and writers inside them, and their tombstones.

::

    INIT ──► READY ──► TRANSFERRING ──► DONE
      │        │            │
      └────────┴────────────┴──► FAILED | CANCELLED | TIMED_OUT

A session reaches exactly one terminal state, once: later transitions are
ignored (duplicate, late or replayed messages change nothing). Terminal is a
*logical* outcome; *quiescent* is the physical one: no task or writer can
still produce a write or a result for this request. Pages go back to the
engine only when a session is both terminal and quiescent ("released").

Inside a session, each peer's part has its own small state machine with the
same discipline (one table of allowed moves): a context rank's
:class:`ReceiverTask` (one per generation rank that asked) and a generation
rank's :class:`WriterState` (one per context rank that may write).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, ItemsView, Iterable, Iterator, ValuesView
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from kvcore.errors import KvcoreError, SessionError
from kvcore.params import InternalId, TransferMode

if TYPE_CHECKING:
    from kvcore.control import wire
    from kvcore.control.messenger import Source
    from kvcore.transceiver.link import Transfer
    from kvcore.transceiver.peers import CtxInstance, GenPeer

__all__ = [
    "RequestStatus",
    "SessionState",
    "TERMINAL",
    "Session",
    "SessionTable",
    "RxSession",
    "TxSession",
    "TaskState",
    "WriterState",
    "ReceiverTask",
    "Tombstone",
    "Tombstones",
]


class SessionState(str, Enum):
    INIT = "INIT"  # created; peers not yet known or contacted
    READY = "READY"  # every peer known; nothing in flight yet
    TRANSFERRING = "TRANSFERRING"  # at least one write submitted / requested
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"


class RequestStatus(str, Enum):
    """Where one request stands on this rank (``Transceiver.status``)."""

    CONNECTING = "CONNECTING"  # generation: first contact with the context instance is under way
    WAITING = "WAITING"  # context: not every receiver has asked yet; generation: expected, or waiting for writers
    READY = "READY"  # context: every receiver asked (their memory is allocated); nothing written yet
    TRANSFERRING = "TRANSFERRING"  # bytes are moving (or a slice landed and more layers are to come)
    DONE = "DONE"  # terminal states: until poll() reported the request released
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"


TERMINAL = frozenset({SessionState.DONE, SessionState.FAILED, SessionState.CANCELLED, SessionState.TIMED_OUT})

# The one place the allowed session transitions live.
_ALLOWED: dict[SessionState, frozenset[SessionState]] = {
    SessionState.INIT: frozenset({SessionState.READY, SessionState.TRANSFERRING}) | TERMINAL,
    SessionState.READY: frozenset({SessionState.TRANSFERRING}) | TERMINAL,
    SessionState.TRANSFERRING: TERMINAL,
    **{s: frozenset() for s in TERMINAL},
}


@dataclass(eq=False)
class Session:
    """Common lifecycle of a send or receive session."""

    request_id: InternalId
    deadline: float  # time.monotonic() bound on reaching a terminal state
    state: SessionState = SessionState.INIT
    error: KvcoreError | None = None
    created: float = field(default_factory=time.monotonic)
    finished: float | None = None
    released: bool = False  # reported to the engine as safe to reuse
    reported: bool = False  # terminal outcome handed to the engine
    nbytes: int = 0  # bytes moved for this request on this rank
    #: Called once when the session becomes terminal (its ``SessionTable`` notes it as news for ``poll``).
    on_end: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def transition(self, new: SessionState, error: KvcoreError | None = None) -> bool:
        """Move to ``new`` if allowed; returns False (and changes nothing) for a transition from a terminal state."""
        if new is self.state:
            return False
        if new not in _ALLOWED[self.state]:
            if self.terminal:
                return False  # committed once; late news changes nothing
            raise SessionError(f"request {self.request_id}: illegal transition {self.state.value} -> {new.value}")
        self.state = new
        if new in TERMINAL:
            self.error = error
            self.finished = time.monotonic()
            if self.on_end is not None:
                self.on_end()
        return True

    @property
    def quiescent(self) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError


S = TypeVar("S", bound=Session)


class TimerHeap:
    """Request ids filed under a time (a heap): ``take`` yields those whose time came, earliest first.

    The worker's timers use it instead of scanning every live session on every tick. An id may be filed several
    times and may have left by the time it comes up: the caller checks what it takes, files it again when its
    time moved, and ``rebuild``s the heap from what it still holds when ``len`` outgrows that (bounded memory).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, InternalId]] = []
        self._seq = itertools.count()  # ties never compare ids

    def __len__(self) -> int:
        return len(self._heap)

    def file(self, rid: InternalId, at: float) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), rid))

    def take(self, now: float) -> Iterator[InternalId]:
        """Pop and yield every id filed before ``now``; one filed again at ``now`` or later is not met again."""
        heap = self._heap
        while heap and heap[0][0] < now:
            yield heapq.heappop(heap)[2]

    def rebuild(self, entries: Iterable[tuple[float, InternalId]]) -> None:
        """Replace every entry by ``entries`` (``(time, rid)``)."""
        self._heap = [(at, next(self._seq), rid) for at, rid in entries]
        heapq.heapify(self._heap)


class SessionTable(Generic[S]):
    """A role's live sessions by request id, and the ids of those that ended and are not yet released.

    ``poll`` and ``wait`` look only at ``ended`` (terminal, not yet released: usually a handful), never at every
    live session: with thousands of requests in flight an engine's poll stays as cheap as with one, and it
    holds the lock the I/O thread needs for no longer. A session added here reports its own end
    (``Session.on_end``); one removed (released) leaves ``ended`` with it.

    The worker's timers find the sessions whose deadline passed the same way, through ``due``: a heap of
    deadlines, not a scan of every live session 50 times a second. A deadline that moves later needs nothing
    (``due`` re-files it when its old time comes); one that moves earlier goes through ``set_deadline``.
    """

    def __init__(self) -> None:
        self._live: dict[InternalId, S] = {}
        #: Request ids of terminal sessions not yet released, in the order they ended.
        self.ended: dict[InternalId, None] = {}
        #: Every live, non-terminal session is filed at or before its deadline.
        self.deadlines = TimerHeap()

    def __setitem__(self, rid: InternalId, s: S) -> None:
        old = self._live.get(rid)
        if old is not None and old is not s:
            old.on_end = None  # the session it replaces reports nothing any more, ended or not
            self.ended.pop(rid, None)
        self._live[rid] = s
        ended = self.ended

        def note() -> None:
            if self._live.get(rid) is s:
                ended[rid] = None

        s.on_end = note
        if s.terminal:
            ended[rid] = None
        else:
            self.deadlines.file(rid, s.deadline)

    def __getitem__(self, rid: InternalId) -> S:
        return self._live[rid]

    def __contains__(self, rid: object) -> bool:
        return rid in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[InternalId]:
        return iter(self._live)

    def get(self, rid: InternalId, default: S | None = None) -> S | None:
        return self._live.get(rid, default)

    def pop(self, rid: InternalId, default: S | None = None) -> S | None:
        s = self._live.pop(rid, None)
        self.ended.pop(rid, None)
        if s is None:
            return default
        s.on_end = None
        return s

    def values(self) -> ValuesView[S]:
        return self._live.values()

    def items(self) -> ItemsView[InternalId, S]:
        return self._live.items()

    def set_deadline(self, s: S, deadline: float) -> None:
        """Move held session ``s``'s deadline to ``deadline`` (earlier or later); ``due`` finds it then."""
        if deadline < s.deadline and self._live.get(s.request_id) is s and not s.terminal:
            self.deadlines.file(s.request_id, deadline)
        s.deadline = deadline

    def due(self, now: float) -> list[S]:
        """Held sessions, not yet terminal, whose deadline passed (``now > deadline``), each once.

        Looks only at entries whose time came: a session whose deadline moved later is filed again under its
        new one. One returned stays filed, so a caller that leaves it non-terminal sees it again next time.
        """
        live = self._live
        out: dict[InternalId, S] = {}
        for rid in self.deadlines.take(now):
            s = live.get(rid)
            if s is None or s.terminal or rid in out:
                continue
            if now > s.deadline:
                out[rid] = s
            else:
                self.deadlines.file(rid, s.deadline)
        for rid in out:
            self.deadlines.file(rid, now)
        if len(self.deadlines) > 2 * len(live) + 1024:
            self.deadlines.rebuild((s.deadline, rid) for rid, s in live.items() if not s.terminal)
        return list(out.values())

    def news(self) -> Iterator[tuple[InternalId, S]]:
        """``(rid, session)`` of every ended session still held (terminal, not released), oldest end first."""
        live = self._live
        for rid in list(self.ended):
            s = live.get(rid)
            if s is None or not s.terminal:
                self.ended.pop(rid, None)
            else:
                yield rid, s


# --- generation side: one writer per context rank that may write ------------------------------------


class WriterState(str, Enum):
    """A context rank's part of a receive session, as the generation rank sees it.

    Push mode: ASKED, then OK | FAILED | CANCELLED | NOT_ASKED | FENCED. Pull mode: READING (our READ of its
    blocks is in flight: bytes may still land in our pages), then PULLED (the read ended; we told the context and
    wait for its word that the blocks were still its to lend), then OK | FAILED | CANCELLED.
    """

    ASKED = "ASKED"  # RequestData sent: the writer may be writing
    READING = "READING"  # pull: our READ from this context rank is in flight
    PULLED = "PULLED"  # pull: our READ ended; PullDone sent, the context's answer pending
    OK = "OK"  # reported its writes landed
    FAILED = "FAILED"  # reported a failure: nothing more will be written
    CANCELLED = "CANCELLED"  # confirmed cancelled: nothing was or will be written
    NOT_ASKED = "NOT_ASKED"  # the writer proved it never took the request (not registered / unknown)
    FENCED = "FENCED"  # the writer is known dead (or its fencing grace ran out): it can write nothing more


#: Writers that can no longer put a byte into the request's pages.
WRITER_SETTLED = frozenset(set(WriterState) - {WriterState.ASKED, WriterState.READING})
_FINAL_WRITER = frozenset({WriterState.OK, WriterState.FAILED, WriterState.CANCELLED, WriterState.FENCED})

_WRITER_ALLOWED: dict[WriterState, frozenset[WriterState]] = {
    WriterState.ASKED: frozenset(WRITER_SETTLED - {WriterState.PULLED}),
    WriterState.NOT_ASKED: frozenset({WriterState.ASKED, WriterState.READING}),  # re-asked after a re-registration
    WriterState.READING: frozenset({WriterState.PULLED}) | _FINAL_WRITER,
    WriterState.PULLED: frozenset({WriterState.OK, WriterState.FAILED, WriterState.CANCELLED}),
    **{s: frozenset() for s in _FINAL_WRITER},
}


@dataclass(eq=False)
class RxSession(Session):
    """Generation side: waits for every expected context rank to report its writes."""

    ctx_endpoint: str = ""
    block_ids: dict[str, np.ndarray] = field(default_factory=dict)
    state_slot: int = -1
    prompt_len: int = -1
    cached_tokens: int = 0  # leading prompt tokens this side holds already (its stated cached prefix)
    ctx_dp_rank: int = 0
    instance: CtxInstance | None = None  # the context incarnation this request was asked of
    writers: dict[int, WriterState] = field(default_factory=dict)  # ctx rank -> state
    nonces: dict[int, bytes] = field(default_factory=dict)  # ctx rank -> the secret its answers must echo
    leases: dict[int, int] = field(default_factory=dict)  # ctx rank -> bounce arena offset
    unpack: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # ctx rank -> (dst, sizes)
    bounced: set[int] = field(default_factory=set)  # writers whose bytes sit packed in their lease
    last_query: float = 0.0  # when the quarantined writers were last asked for their final word
    asked_at: dict[int, float] = field(default_factory=dict)  # ctx rank -> when its RequestData was sent
    sent: set[int] = field(default_factory=set)  # ctx ranks whose RequestData has gone out
    ticket: bytes = b""  # the request's ticket (from the context's TransferParams)
    mode: TransferMode = "push"
    expecting: bool = False  # expect(): the request is announced; blocks come with start_receive
    ctx_block_ids: Any = field(default_factory=dict)  # pull: blocks to read (as the parameters gave them)
    ctx_state_slot: int = -1  # pull
    ctx_incarnation: str = ""  # pull: the context incarnation the parameters came from
    reads: dict[int, Transfer | None] = field(default_factory=dict)  # pull: ctx rank -> our READ handle
    read_bytes: dict[int, tuple[int, int]] = field(default_factory=dict)  # pull: ctx rank -> (bytes, fragments)
    aux: bytes = b""  # the aux payload a context rank sent with its "ok"
    pull_done: dict[int, wire.PullDone] = field(
        default_factory=dict
    )  # pull: ctx rank -> the PullDone we sent (re-sent if lost)
    renew_nonce: bytes = b""  # answers to our lease renewals echo this
    last_renew: float = 0.0
    renew_every: float = 0.0  # seconds between renewals (a third of the context's lease)

    @property
    def quiescent(self) -> bool:
        return all(w in WRITER_SETTLED for w in self.writers.values())

    def all_ok(self) -> bool:
        return bool(self.writers) and all(w is WriterState.OK for w in self.writers.values())

    def settle(self, ctx_rank: int, new: WriterState) -> bool:
        """Move one writer along its table; False when the move is not allowed (late or duplicate news)."""
        old = self.writers.get(ctx_rank)
        if old is None or new not in _WRITER_ALLOWED[old]:
            return False
        self.writers[ctx_rank] = new
        return True


# --- context side: one task per generation rank that asked ------------------------------------------


class TaskState(str, Enum):
    """The write of one request into one generation rank, as the context rank sees it."""

    WAITING = "WAITING"  # asked; nothing submitted yet (descriptor loading, or layers not ready)
    PARTIAL = "PARTIAL"  # layer-wise: some layers written, nothing in flight, more to come
    SUBMITTED = "SUBMITTED"  # a write is in flight at the transport
    DONE = "DONE"  # every slice landed and the receiver was told
    FAILED = "FAILED"  # the receiver was told it failed; nothing in flight
    CANCELLED = "CANCELLED"  # the receiver was told it was cancelled; nothing in flight


#: Tasks with nothing in flight that may still have layers to write.
IDLE_TASK_STATES = frozenset({TaskState.WAITING, TaskState.PARTIAL})
#: Tasks whose receiver has its final answer and that can write nothing more.
FINAL_TASK_STATES = frozenset({TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED})

_TASK_ALLOWED: dict[TaskState, frozenset[TaskState]] = {
    TaskState.WAITING: frozenset({TaskState.SUBMITTED, TaskState.PARTIAL}) | FINAL_TASK_STATES,
    TaskState.PARTIAL: frozenset({TaskState.SUBMITTED}) | FINAL_TASK_STATES,
    TaskState.SUBMITTED: frozenset({TaskState.PARTIAL}) | FINAL_TASK_STATES,
    **{s: frozenset() for s in FINAL_TASK_STATES},
}


@dataclass(eq=False)
class ReceiverTask:
    """Context side: the write of this request into one generation rank (incarnation)."""

    peer: GenPeer
    block_ids: dict[str, np.ndarray]
    state_slot: int
    prompt_len: int
    nonce: bytes  # the receiver's secret for this request: echoed in every answer, required on its cancels
    reply_to: Source | None = None  # messenger Source the receiver's RequestData came from (answers go back there)
    state: TaskState = TaskState.WAITING
    handle: Transfer | None = None
    nbytes: int = 0
    fragments: int = 0
    deadline: float = 0.0
    bounce_addr: int = 0
    bounce_bytes: int = 0
    bounce_digest: bytes = b""
    staging: int | None = None  # offset of this task's lease in the sender's staging arena
    bounced: bool = False
    doubt_sent: bool = False
    sent_upto: int = -1  # layer-wise: global layers below this were submitted (-1: nothing yet)
    total_bytes: int = 0  # over every slice written so far
    total_fragments: int = 0
    final: wire.TransferResult | None = None  # the final TransferResult sent, re-sent when the receiver asks again
    attached_at: float = field(default_factory=time.monotonic)  # when its RequestData arrived
    posted_at: float = 0.0  # when its current write was submitted
    cached_tokens: int = 0  # the receiver's stated cached prefix: its blocks cover the prompt from there

    @property
    def key(self) -> tuple[str, int]:
        return self.peer.key

    def move(self, new: TaskState) -> None:
        """Move along the task table; an illegal move is a bug in kvcore, never a peer's doing."""
        if new is self.state:
            return
        if new not in _TASK_ALLOWED[self.state]:
            who = self.peer if self.peer.info is not None else "a receiver"
            raise SessionError(f"receiver task of {who}: illegal transition {self.state.value} -> {new.value}")
        self.state = new


@dataclass(eq=False)
class TxSession(Session):
    """Context side: writes one request's KV to every generation rank that asks for it."""

    block_ids: dict[str, np.ndarray] = field(default_factory=dict)
    state_slot: int = -1
    prompt_len: int = -1
    tasks: dict[tuple[str, int], ReceiverTask] = field(default_factory=dict)
    expected_receivers: int | None = None  # known once the first receiver asked
    layers_upto: int | None = None  # layer-wise sending: layers below this are ready; None: all are
    ticket: bytes = b""  # receivers must present it (config.require_tickets)
    mode: TransferMode = "push"  # "pull": receivers read our blocks and report with PullDone
    aux: bytes = b""  # sent with every receiver's "ok"
    blocks_digest: bytes = b""  # pull: what a receiver must have read (kvcore.transceiver.digests.blocks_digest)
    renewers: dict[tuple[str, int], bytes] = field(default_factory=dict)  # receiver key -> its renewal nonce
    hold_until: float = 0.0  # leases are never renewed past this (config.max_lease_s from start_send)
    #: Offered on the native lane (``kvcore.transceiver.native``) and not yet ended there: the lane may be
    #: writing it, so it is not quiescent until the lane's completion (or a withdrawal) clears this.
    lane: bool = False

    @property
    def quiescent(self) -> bool:
        """Every receiver that asked has its final answer and nothing is in flight.

        A terminal session never keeps an idle task: it is answered at once (see
        the sender), so this is also "no task can still produce a write or a result".
        """
        return not self.lane and all(t.state in FINAL_TASK_STATES for t in self.tasks.values())


# --- tombstones --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tombstone:
    """The final word on a request this rank no longer holds: late or repeated messages get it at once."""

    state: SessionState
    error_kind: str
    message: str
    at: float
    #: The request's ticket when a peer's message made or may read this tombstone; None: made by this rank's
    #: engine (its own cancel), valid for anyone.
    ticket: bytes | None = None


class Tombstones:
    """Outcomes of released (or pre-cancelled) requests, bounded in number and age; the oldest go first."""

    #: Bytes one tombstone costs at most (entry, key, message capped at 200 characters).
    ENTRY_BYTES = 512

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._items: OrderedDict[InternalId, Tombstone] = OrderedDict()
        self.evicted = 0

    def put(
        self, rid: InternalId, state: SessionState, error: KvcoreError | None = None, ticket: bytes | None = None
    ) -> None:
        kind = type(error).__name__ if error is not None else ""
        self._items.pop(rid, None)
        self._items[rid] = Tombstone(state, kind, str(error or "")[:200], time.monotonic(), ticket)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)
            self.evicted += 1

    def get(self, rid: InternalId) -> Tombstone | None:
        return self._items.get(rid)

    def pop(self, rid: InternalId) -> Tombstone | None:
        return self._items.pop(rid, None)

    def expire(self, now: float) -> None:
        while self._items:
            rid, t = next(iter(self._items.items()))
            if now - t.at <= self.ttl_s:
                break
            del self._items[rid]

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: object) -> bool:
        return rid in self._items
