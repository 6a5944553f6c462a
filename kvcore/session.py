"""Send and receive sessions: one per request and side, with an explicit state machine.

::

    INIT ──► READY ──► TRANSFERRING ──► DONE
      │        │            │
      └────────┴────────────┴──► FAILED | CANCELLED | TIMED_OUT

A session reaches exactly one terminal state, once: later transitions are
ignored (duplicate, late or replayed messages change nothing). Terminal is a
*logical* outcome; *quiescent* is the physical one: no write into this
request's memory can still land. Pages go back to the engine only when a
session is both terminal and quiescent ("released").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from kvcore.errors import KvcoreError, SessionError

__all__ = [
    "IDLE_TASK_STATES",
    "SessionState",
    "TERMINAL",
    "Session",
    "RxSession",
    "TxSession",
    "WriterState",
    "ReceiverTask",
]


class SessionState(str, Enum):
    INIT = "INIT"  # created; peers not yet known or contacted
    READY = "READY"  # every peer known; nothing in flight yet
    TRANSFERRING = "TRANSFERRING"  # at least one write submitted / requested
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"


TERMINAL = frozenset({SessionState.DONE, SessionState.FAILED, SessionState.CANCELLED, SessionState.TIMED_OUT})

# The one place the allowed transitions live.
_ALLOWED: dict[SessionState, frozenset[SessionState]] = {
    SessionState.INIT: frozenset({SessionState.READY, SessionState.TRANSFERRING}) | TERMINAL,
    SessionState.READY: frozenset({SessionState.TRANSFERRING}) | TERMINAL,
    SessionState.TRANSFERRING: TERMINAL,
    **{s: frozenset() for s in TERMINAL},
}


@dataclass(eq=False)
class Session:
    """Common lifecycle of a send or receive session."""

    request_id: int
    deadline: float  # time.monotonic() bound on reaching a terminal state
    state: SessionState = SessionState.INIT
    error: KvcoreError | None = None
    created: float = field(default_factory=time.monotonic)
    finished: float | None = None
    released: bool = False  # reported to the engine as safe to reuse
    reported: bool = False  # terminal outcome handed to the engine

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
        return True

    @property
    def quiescent(self) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError


class WriterState(str, Enum):
    """A context rank's part of a receive session."""

    ASKED = "ASKED"  # RequestData sent; the writer may be writing
    OK = "OK"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    FENCED = "FENCED"  # the writer process is known dead: it can write nothing more


@dataclass(eq=False)
class RxSession(Session):
    """Generation side: waits for every expected context rank to report its writes."""

    ctx_endpoint: str = ""
    block_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    state_slot: int = -1
    prompt_len: int = -1
    ctx_dp_rank: int = 0
    writers: dict[int, WriterState] = field(default_factory=dict)  # ctx rank -> state
    nbytes: int = 0
    leases: dict[int, int] = field(default_factory=dict)  # ctx rank -> bounce arena offset
    unpack: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # ctx rank -> (dst, sizes)
    bounced: set[int] = field(default_factory=set)  # writers whose bytes sit packed in their lease

    @property
    def quiescent(self) -> bool:
        return all(w is not WriterState.ASKED for w in self.writers.values())

    def all_ok(self) -> bool:
        return bool(self.writers) and all(w is WriterState.OK for w in self.writers.values())


@dataclass(eq=False)
class ReceiverTask:
    """Context side: the write of this request into one generation rank."""

    gen_key: tuple[str, int]  # (instance, rank)
    endpoint: str
    block_ids: np.ndarray
    state_slot: int
    prompt_len: int
    state: str = "waiting"  # waiting | submitted | partial (some layers written, nothing in flight) | done | ...
    handle: Any = None
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


@dataclass(eq=False)
class TxSession(Session):
    """Context side: writes one request's KV to every generation rank that asked for it."""

    block_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    state_slot: int = -1
    prompt_len: int = -1
    tasks: dict[tuple[str, int], ReceiverTask] = field(default_factory=dict)
    expected_receivers: int | None = None  # known once the first receiver asked
    nbytes: int = 0
    layers_upto: int | None = None  # layer-wise sending: layers below this are ready; None: all are

    @property
    def quiescent(self) -> bool:
        return all(t.state != "submitted" for t in self.tasks.values())


#: Receiver tasks with nothing in flight that may still have layers to write.
IDLE_TASK_STATES = frozenset({"waiting", "partial"})
