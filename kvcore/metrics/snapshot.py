"""The typed snapshot of a transceiver's counts: label sets, the fixed-bucket histogram, the frozen structs.

msgspec structs, so a :class:`MetricsSnapshot` encodes to JSON or msgpack as is. The histogram *cells* here (a
list of bucket counts, then the sum) are what the recorder and the messenger's I/O timing update on the hot path;
:func:`_cell_histogram` freezes one into a :class:`Histogram`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from enum import Enum

import msgspec

from kvcore import errors as E

#: Upper bounds (seconds) of the duration histograms' buckets: 10 µs (a poll) to 60 s (a request's timeout).
DURATION_BUCKETS: tuple[float, ...] = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: The ``peer`` label of peers past ``max_peers`` and of forgotten peers.
OTHER_PEER = "_other"
#: The ``peer`` label of events with no peer (a request that failed before any peer was known).
NO_PEER = ""
#: The ``error_kind`` label of an error that is not a kvcore error class.
OTHER_ERROR = "OtherError"


class RequestOutcome(str, Enum):
    """A request's terminal outcome (the values of ``SessionState``'s terminal states)."""

    DONE = "DONE"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"
    FAILED = "FAILED"


class FenceReason(str, Enum):
    """Why a writer was declared unable to write any more, so that its pages could be released."""

    SAME_HOST_PID = "same_host_pid"  # same host, its process is gone (pid and start time)
    TRANSPORT_ERROR = "transport_error"  # the transport reported the remote endpoint failed
    HEARTBEAT = "heartbeat"  # control connection and heartbeats lost
    GRACE_EXPIRED = "grace_expired"  # remote writer: the fencing grace ran out


def _kvcore_error_kinds() -> frozenset[str]:
    """Every class name under ``KvcoreError`` (plus the in-doubt marker): the closed set of ``error_kind`` labels."""
    seen: set[str] = set()
    todo: list[type] = [E.KvcoreError]
    while todo:
        cls = todo.pop()
        seen.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return frozenset(seen)


_ERROR_KINDS = _kvcore_error_kinds()
_OUTCOMES: dict[str, str] = {o.value: o.value for o in RequestOutcome}

# --- the typed snapshot --------------------------------------------------------------------------


class Histogram(msgspec.Struct, frozen=True):
    """A fixed-bucket histogram: ``counts[i]`` observations in ``(bounds[i-1], bounds[i]]``, the last one above all."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # len(bounds) + 1, not cumulative
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float:
        """The mean observation (0.0 when empty)."""
        n = self.count
        return self.sum / n if n else 0.0

    def quantile(self, q: float) -> float:
        """An upper bound on the ``q`` quantile: the bucket bound it falls in (``inf`` past the last bound)."""
        if not 0.0 <= q <= 1.0:
            raise E.ConfigError(f"quantile q must be in [0, 1], got {q!r}")
        n = self.count
        if n == 0:
            return 0.0
        rank, acc = q * n, 0
        for i, c in enumerate(self.counts):
            acc += c
            if acc >= rank and c:
                return self.bounds[i] if i < len(self.bounds) else float("inf")
        return float("inf")

    def __add__(self, other: Histogram) -> Histogram:
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)), self.sum + other.sum)


def _empty_hist() -> Histogram:
    return Histogram(DURATION_BUCKETS, (0,) * (len(DURATION_BUCKETS) + 1), 0.0)


class OutcomeCount(msgspec.Struct, frozen=True):
    """Requests that ended with ``outcome`` and ``error_kind`` (``""`` for DONE)."""

    outcome: str
    error_kind: str
    count: int


class PeerMetrics(msgspec.Struct, frozen=True):
    """Everything counted for one peer label (or, as ``MetricsSnapshot.total``, for all of them)."""

    requests_finished: tuple[OutcomeCount, ...] = ()
    request_seconds: Mapping[str, Histogram] = msgspec.field(default_factory=dict)  # outcome -> durations
    transfers_posted: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    transfers_bounced: int = 0
    transfer_bytes: int = 0
    transfer_fragments: int = 0
    plan_seconds: Histogram = msgspec.field(default_factory=_empty_hist)
    post_seconds: Histogram = msgspec.field(default_factory=_empty_hist)
    transfer_seconds: Histogram = msgspec.field(default_factory=_empty_hist)
    queue_seconds: Histogram = msgspec.field(default_factory=_empty_hist)
    round_trip_seconds: Histogram = msgspec.field(default_factory=_empty_hist)
    service_seconds: Histogram = msgspec.field(default_factory=_empty_hist)
    first_contact_seconds: Histogram = msgspec.field(default_factory=_empty_hist)
    quarantined: int = 0
    fenced: Mapping[str, int] = msgspec.field(default_factory=dict)  # FenceReason value -> count

    def outcomes(self) -> dict[str, int]:
        """Finished requests per outcome (``DONE``, ``CANCELLED``, ``TIMED_OUT``, ``FAILED``)."""
        out: dict[str, int] = {}
        for oc in self.requests_finished:
            out[oc.outcome] = out.get(oc.outcome, 0) + oc.count
        return out

    def error_kinds(self) -> dict[str, int]:
        """Finished requests per error class name (DONE requests are not counted)."""
        out: dict[str, int] = {}
        for oc in self.requests_finished:
            if oc.error_kind:
                out[oc.error_kind] = out.get(oc.error_kind, 0) + oc.count
        return out


class MetricsSnapshot(msgspec.Struct, frozen=True):
    """One transceiver's counts at one moment: totals, and the same per peer label."""

    backend: str
    role: str
    rank: int
    instance: str
    requests_started: int
    total: PeerMetrics
    peers: Mapping[str, PeerMetrics]
    #: CPU time the transceiver's I/O thread (its control plane and worker) has used, seconds.
    io_thread_cpu_seconds: float = 0.0
    #: Time the I/O thread was ready to run inside its loop turns but did not (the GIL, a core, a lock), seconds.
    io_thread_stall_seconds: float = 0.0
    #: How late the I/O thread ran after each timed sleep that ended without traffic (seconds).
    io_thread_wake_lag: Histogram = msgspec.field(default_factory=_empty_hist)


# --- the recorder --------------------------------------------------------------------------------


# --- histogram cells: what the hot path updates -------------------------------------------------

# A histogram cell is a list: bucket counts (len(bounds) + 1), then the sum. Lists, not objects, because
# ``cell[i] += 1`` is the cheapest update Python has.
_NB = len(DURATION_BUCKETS) + 1


def _hist_cell() -> list[float]:
    return [0] * _NB + [0.0]


def _observe(cell: list[float], seconds: float) -> None:
    cell[bisect_left(DURATION_BUCKETS, seconds)] += 1
    cell[_NB] += seconds


def _cell_histogram(cell: list[float]) -> Histogram:
    """A histogram cell (bucket counts, then the sum) as a frozen :class:`Histogram`."""
    return Histogram(DURATION_BUCKETS, tuple(int(x) for x in cell[:_NB]), float(cell[_NB]))


_HISTS = (
    "plan_seconds",
    "post_seconds",
    "transfer_seconds",
    "queue_seconds",
    "round_trip_seconds",
    "service_seconds",
    "first_contact_seconds",
)
