"""What a transceiver did, counted: a cheap recorder, a typed snapshot, Prometheus exposition and log context.

The transceiver owns one :class:`TransceiverMetrics` and calls it at each step of
a request (started, first contact, queued, planned and posted, transfer
finished, round trip, finished, quarantined, fenced). The recorder keeps plain
counters and fixed-bucket histograms in **per-thread shards**: the hot path takes
no lock (each thread only writes its own shard), costs a few hundred
nanoseconds, and stays correct without the GIL. :meth:`TransceiverMetrics.snapshot`
merges the shards into a frozen :class:`MetricsSnapshot` (msgspec structs, so it
encodes to JSON or msgpack as is).

Prometheus is optional (``pip install 'kvcore[prometheus]'``). Nothing is
registered at import: :func:`register_metrics` adds one collector to a
``CollectorRegistry`` (the engine's own, or prometheus-client's default), and
:func:`serve_metrics` serves a registry over HTTP on loopback by default. The
collector reads the live recorders at scrape time; every name starts with
``kvcore_`` and carries its unit. docs/observability.md lists every metric.

Label cardinality is bounded: ``backend``, ``role``, ``rank`` are fixed per
transceiver; ``outcome``, ``error_kind``, ``result``, ``reason`` come from closed
sets (an unknown error kind counts as ``OtherError``); ``peer`` (the peer
instance's name) is capped per recorder at ``max_peers`` names, later ones count
under ``_other``, and :meth:`TransceiverMetrics.forget_peer` frees a name when its
peer is unloaded (its counts move to ``_other``, so sums over peers never drop).

Why one module of this length: the metric table (names, units, labels, help), the recorder the transceiver
calls, the typed snapshot and the Prometheus collector are one contract; docs/observability.md is checked against
that single table.
"""

from __future__ import annotations

import logging
import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from enum import Enum
from typing import Any

import msgspec

from kvcore import errors as E

__all__ = [
    "DURATION_BUCKETS",
    "OTHER_PEER",
    "FenceReason",
    "Histogram",
    "MetricsSnapshot",
    "OutcomeCount",
    "PeerMetrics",
    "RequestOutcome",
    "TransceiverMetrics",
    "live_recorders",
    "log_extra",
    "request_logger",
    "register_metrics",
    "serve_metrics",
]

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


class _Cell:
    """One thread's counts for one peer label. Written by its owner thread only."""

    __slots__ = (
        "finished",
        "request_seconds",
        "transfers_posted",
        "transfers_ok",
        "transfers_failed",
        "transfers_bounced",
        "transfer_bytes",
        "transfer_fragments",
        "quarantined",
        "fenced",
        *_HISTS,
    )

    def __init__(self) -> None:
        self.finished: dict[tuple[str, str], int] = {}
        self.request_seconds: dict[str, list[float]] = {}
        self.transfers_posted = 0
        self.transfers_ok = 0
        self.transfers_failed = 0
        self.transfers_bounced = 0
        self.transfer_bytes = 0
        self.transfer_fragments = 0
        self.quarantined = 0
        self.fenced: dict[str, int] = {}
        self.plan_seconds = _hist_cell()
        self.post_seconds = _hist_cell()
        self.transfer_seconds = _hist_cell()
        self.queue_seconds = _hist_cell()
        self.round_trip_seconds = _hist_cell()
        self.service_seconds = _hist_cell()
        self.first_contact_seconds = _hist_cell()


class _Shard:
    """One thread's cells, keyed by peer label, plus its count of started requests."""

    __slots__ = ("cells", "requests_started", "thread")

    def __init__(self, thread: threading.Thread | None) -> None:
        self.cells: dict[str, _Cell] = {}
        self.requests_started = 0
        self.thread = thread


def _add_cells(dst: list[float], src: list[float]) -> None:
    for i, v in enumerate(list(src)):
        dst[i] += v


class _Acc:
    """Merges cells into one PeerMetrics (snapshot time only)."""

    def __init__(self) -> None:
        self.finished: dict[tuple[str, str], int] = {}
        self.request_seconds: dict[str, list[float]] = {}
        self.ints = dict.fromkeys(
            (
                "transfers_posted",
                "transfers_ok",
                "transfers_failed",
                "transfers_bounced",
                "transfer_bytes",
                "transfer_fragments",
                "quarantined",
            ),
            0,
        )
        self.hists = {h: _hist_cell() for h in _HISTS}
        self.fenced: dict[str, int] = {}

    def add(self, c: _Cell | _Acc) -> None:
        # Copies first (dict(...), list(...)): the owner thread may insert or increment meanwhile.
        for key, n in dict(c.finished).items():
            self.finished[key] = self.finished.get(key, 0) + n
        for outcome, cell in dict(c.request_seconds).items():
            _add_cells(self.request_seconds.setdefault(outcome, _hist_cell()), cell)
        for name in self.ints:
            self.ints[name] += c.ints[name] if isinstance(c, _Acc) else getattr(c, name)
        for h in _HISTS:
            _add_cells(self.hists[h], c.hists[h] if isinstance(c, _Acc) else getattr(c, h))
        for reason, n in dict(c.fenced).items():
            self.fenced[reason] = self.fenced.get(reason, 0) + n

    def freeze(self) -> PeerMetrics:
        fields: dict[str, Any] = {**self.ints, **{name: _cell_histogram(cell) for name, cell in self.hists.items()}}
        return PeerMetrics(
            requests_finished=tuple(OutcomeCount(o, k, n) for (o, k), n in sorted(self.finished.items()) if n),
            request_seconds={k: _cell_histogram(v) for k, v in sorted(self.request_seconds.items())},
            fenced=dict(sorted(self.fenced.items())),
            **fields,
        )


_live: weakref.WeakSet[TransceiverMetrics] = weakref.WeakSet()
_live_lock = threading.Lock()


def live_recorders() -> list[TransceiverMetrics]:
    """Every recorder alive in this process (what a collector without an explicit list reports)."""
    with _live_lock:
        return sorted(_live, key=lambda r: (r.role, r.rank, r.instance, id(r)))


class TransceiverMetrics:
    """The counters of one transceiver: called at each step of each request; cheap and thread-safe.

    Every method may be called from any thread at any time; none blocks. Durations are seconds
    (``time.perf_counter()`` or ``time.monotonic()`` differences). ``peer`` is the peer instance's name
    (``""`` when none is known yet).
    """

    def __init__(
        self,
        *,
        backend: str,
        role: str,
        rank: int = 0,
        instance: str = "",
        max_peers: int = 32,
        gauges: Callable[[], Mapping[str, int]] | None = None,
        register: bool = True,
    ) -> None:
        if role not in ("context", "generation"):
            raise E.ConfigError(f"metrics role must be 'context' or 'generation', got {role!r}")
        if max_peers < 0:
            raise E.ConfigError(f"max_peers must be >= 0, got {max_peers!r}")
        self.backend, self.role, self.rank, self.instance = backend, role, int(rank), instance
        self.max_peers = max_peers
        #: Live counts exported as gauges (``kvcore_live_objects``): typically ``Transceiver.stats`` less its counters.
        self.gauges = gauges
        #: Event counts that only grow, exported as ``kvcore_control_events_total{kind}`` (refused tickets, lost
        #: peers, fenced writers, expired early requests...).
        self.events: Callable[[], Mapping[str, int]] | None = None
        #: The I/O thread's CPU seconds so far (``kvcore_io_thread_cpu_seconds``): typically ``Messenger.cpu_seconds``.
        self.cpu_seconds: Callable[[], float] | None = None
        self._cpu_seen = 0.0  # the highest reading: the counter never goes back when the thread has ended
        #: The I/O thread's stall seconds and wake-lag histogram (``kvcore_io_thread_stall_seconds``,
        #: ``kvcore_io_thread_wake_lag_seconds``): typically ``Messenger.io_timing``.
        self.io_timing: Callable[[], tuple[float, Histogram]] | None = None
        self._local = threading.local()
        self._lock = threading.Lock()  # shard list and peer labels only: never taken on the hot path's common case
        self._shards: list[_Shard] = []
        self._labels: dict[str, str] = {NO_PEER: NO_PEER}
        self._named = 0  # peers holding their own label
        self._retired = _Acc()  # counts of dead threads' shards and of forgotten peers' cells
        self._retired_started = 0
        self._retired_peers: dict[str, _Acc] = {}
        if register:
            with _live_lock:
                _live.add(self)

    # --- the hot path --------------------------------------------------------------------------

    def _cell(self, peer: str) -> _Cell:
        try:
            shard: _Shard = self._local.shard
        except AttributeError:
            shard = self._new_shard()
        label = self._labels.get(peer)
        if label is None:
            label = self._label_for(peer)
        cell = shard.cells.get(label)
        if cell is None:
            cell = shard.cells[label] = _Cell()
        return cell

    def request_started(self) -> None:
        """A request was started by the engine (``start_send`` or ``start_receive``)."""
        try:
            shard: _Shard = self._local.shard
        except AttributeError:
            shard = self._new_shard()
        shard.requests_started += 1

    def first_contact(self, peer: str, seconds: float) -> None:
        """First contact with a peer instance finished: info fetched, agent loaded, registered."""
        _observe(self._cell(peer).first_contact_seconds, seconds)

    def queued(self, peer: str, seconds: float) -> None:
        """A write waited ``seconds`` from the moment it could start (both sides known, peer loaded) to its plan."""
        _observe(self._cell(peer).queue_seconds, seconds)

    def transfer_posted(
        self, peer: str, nbytes: int, fragments: int, plan_s: float, post_s: float, *, bounced: bool = False
    ) -> None:
        """One write was planned (``plan_s``) and submitted to the agent (``post_s``): its bytes and fragments."""
        c = self._cell(peer)
        c.transfers_posted += 1
        c.transfer_bytes += nbytes
        c.transfer_fragments += fragments
        if bounced:
            c.transfers_bounced += 1
        _observe(c.plan_seconds, plan_s)
        _observe(c.post_seconds, post_s)

    def transfer_finished(self, peer: str, ok: bool, seconds: float) -> None:
        """A posted write is terminal at the transport, ``seconds`` after it was posted."""
        c = self._cell(peer)
        if ok:
            c.transfers_ok += 1
        else:
            c.transfers_failed += 1
        _observe(c.transfer_seconds, seconds)

    def writer_round_trip(self, peer: str, seconds: float) -> None:
        """Generation role: a writer's TransferResult arrived ``seconds`` after its RequestData was sent."""
        _observe(self._cell(peer).round_trip_seconds, seconds)

    def writer_service(self, peer: str, seconds: float) -> None:
        """Context role: a TransferResult was sent ``seconds`` after the receiver's RequestData arrived."""
        _observe(self._cell(peer).service_seconds, seconds)

    def request_finished(
        self,
        outcome: RequestOutcome | str,
        seconds: float,
        *,
        error: BaseException | str | None = None,
        peer: str = NO_PEER,
    ) -> None:
        """A request's outcome was reported by ``poll()``, ``seconds`` after it was started.

        ``error`` is the outcome's error (or its class name); anything outside kvcore's error classes
        counts as ``OtherError``, so the label set stays closed.
        """
        oc = _OUTCOMES.get(outcome)  # a str-valued enum hashes and compares as its value: one lookup for both
        if oc is None:
            raise E.ConfigError(f"outcome must be one of {sorted(_OUTCOMES)}, got {outcome!r}")
        if error is None or oc == "DONE":
            kind = ""
        else:
            kind = error if isinstance(error, str) else type(error).__name__
            if kind not in _ERROR_KINDS:
                kind = OTHER_ERROR
        c = self._cell(peer)
        key = (oc, kind)
        c.finished[key] = c.finished.get(key, 0) + 1
        cell = c.request_seconds.get(oc)
        if cell is None:
            cell = c.request_seconds[oc] = _hist_cell()
        _observe(cell, seconds)

    def quarantined(self, peer: str = NO_PEER) -> None:
        """A terminal request's pages were quarantined: a write to them may still land."""
        self._cell(peer).quarantined += 1

    def fenced(self, reason: FenceReason, peer: str = NO_PEER) -> None:
        """A writer was fenced (declared unable to write), so that quarantined pages could be released."""
        c = self._cell(peer)
        key = FenceReason(reason).value
        c.fenced[key] = c.fenced.get(key, 0) + 1

    # --- labels, shards ------------------------------------------------------------------------

    def _new_shard(self) -> _Shard:
        shard = _Shard(threading.current_thread())
        self._local.shard = shard
        with self._lock:
            self._shards.append(shard)
        return shard

    def _label_for(self, peer: str) -> str:
        with self._lock:
            label = self._labels.get(peer)
            if label is None:
                if self._named < self.max_peers:
                    label = peer
                    self._named += 1
                else:
                    label = OTHER_PEER
                self._labels[peer] = label
            return label

    def forget_peer(self, peer: str) -> None:
        """The peer was unloaded: free its label; its counts so far are reported under ``_other`` from now on."""
        with self._lock:
            label = self._labels.pop(peer, None)
            if label is None or label in (NO_PEER, OTHER_PEER):
                return
            self._named -= 1
            # Owner threads no longer write this label's cells (new events for the peer get a fresh label);
            # a write racing with this call may be lost, never double-counted.
            acc = self._retired_peers.setdefault(OTHER_PEER, _Acc())
            for shard in self._shards:
                cell = shard.cells.pop(label, None)
                if cell is not None:
                    acc.add(cell)

    # --- reading -------------------------------------------------------------------------------

    def snapshot(self) -> MetricsSnapshot:
        """Merge every thread's counts into a frozen snapshot (costs O(threads x peers); call it off the hot path)."""
        with self._lock:
            # Dead threads write nothing more: fold their shards once, so that shards stay bounded by live threads.
            for shard in [s for s in self._shards if s.thread is not None and not s.thread.is_alive()]:
                self._shards.remove(shard)
                self._retired_started += shard.requests_started
                for label, cell in list(shard.cells.items()):
                    self._retired_peers.setdefault(label, _Acc()).add(cell)
            shards = list(self._shards)
            per: dict[str, _Acc] = {}
            for label, acc in self._retired_peers.items():
                per.setdefault(label, _Acc()).add(acc)
            started = self._retired_started
        for shard in shards:
            started += shard.requests_started
            for label, cell in list(shard.cells.items()):
                per.setdefault(label, _Acc()).add(cell)
        total = _Acc()
        for acc in per.values():
            total.add(acc)
        if self.cpu_seconds is not None:
            try:
                self._cpu_seen = max(self._cpu_seen, float(self.cpu_seconds()))
            except Exception:  # a provider that fails must not break a scrape
                pass
        stall, lag = 0.0, _empty_hist()
        if self.io_timing is not None:
            try:
                stall, lag = self.io_timing()
            except Exception:  # as above
                pass
        return MetricsSnapshot(
            backend=self.backend,
            role=self.role,
            rank=self.rank,
            instance=self.instance,
            requests_started=started,
            total=total.freeze(),
            peers={label: acc.freeze() for label, acc in sorted(per.items())},
            io_thread_cpu_seconds=self._cpu_seen,
            io_thread_stall_seconds=float(stall),
            io_thread_wake_lag=lag,
        )

    def close(self) -> None:
        """Stop reporting this recorder to collectors (its snapshot still works)."""
        with _live_lock:
            _live.discard(self)


# --- Prometheus ----------------------------------------------------------------------------------

#: (snapshot field, metric name, help) of every duration histogram.
_HIST_METRICS: tuple[tuple[str, str, str], ...] = (
    ("plan_seconds", "kvcore_plan_duration_seconds", "Time to build one write's fragment plan."),
    ("post_seconds", "kvcore_post_duration_seconds", "Time to submit one write to the transfer agent."),
    ("transfer_seconds", "kvcore_transfer_duration_seconds", "Time from a write's submission to its terminal status."),
    ("queue_seconds", "kvcore_queue_duration_seconds", "Time a write waited from 'could start' to its plan."),
    (
        "round_trip_seconds",
        "kvcore_writer_round_trip_seconds",
        "Generation role: time from a RequestData sent to that writer's TransferResult received.",
    ),
    (
        "service_seconds",
        "kvcore_writer_service_seconds",
        "Context role: time from a receiver's RequestData received to the TransferResult sent.",
    ),
    (
        "first_contact_seconds",
        "kvcore_first_contact_duration_seconds",
        "Time of first contact with a peer instance (info, agent loading, registration).",
    ),
)


def _families(recorders: Iterable[TransceiverMetrics]) -> Iterator[Any]:
    """The metric families of the given recorders, read now (prometheus-client imported lazily)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    base = ["backend", "role", "rank"]
    started = CounterMetricFamily("kvcore_requests_started", "Requests started by the engine.", labels=base)
    finished = CounterMetricFamily(
        "kvcore_requests_finished",
        "Requests reported terminal by poll(), by outcome and error class.",
        labels=[*base, "peer", "outcome", "error_kind"],
    )
    req_seconds = HistogramMetricFamily(
        "kvcore_request_duration_seconds",
        "Time from start_send/start_receive to the outcome reported by poll().",
        labels=[*base, "peer", "outcome"],
    )
    posted = CounterMetricFamily("kvcore_transfers_posted", "Writes submitted to the agent.", labels=[*base, "peer"])
    completed = CounterMetricFamily(
        "kvcore_transfers_completed", "Writes terminal at the transport, by result.", labels=[*base, "peer", "result"]
    )
    bounced = CounterMetricFamily(
        "kvcore_transfers_bounced", "Writes sent through the bounce buffer.", labels=[*base, "peer"]
    )
    nbytes = CounterMetricFamily("kvcore_transfer_bytes", "Bytes submitted in writes.", labels=[*base, "peer"])
    frags = CounterMetricFamily(
        "kvcore_transfer_descriptors", "Fragments (agent descriptors) submitted in writes.", labels=[*base, "peer"]
    )
    quarantined = CounterMetricFamily(
        "kvcore_quarantine_events", "Requests whose pages were quarantined.", labels=[*base, "peer"]
    )
    fenced = CounterMetricFamily(
        "kvcore_fencing_events", "Writers fenced, by reason.", labels=[*base, "peer", "reason"]
    )
    cpu = CounterMetricFamily(
        "kvcore_io_thread_cpu_seconds",
        "CPU time used by the transceiver's I/O thread (control plane and worker).",
        labels=base,
    )
    stall = CounterMetricFamily(
        "kvcore_io_thread_stall_seconds",
        "Time the I/O thread was ready to run inside its loop turns but was not on a CPU "
        "(waiting for the GIL, a core or a lock).",
        labels=base,
    )
    lag = HistogramMetricFamily(
        "kvcore_io_thread_wake_lag_seconds",
        "How late the I/O thread ran Python again after a timed sleep that ended without traffic.",
        labels=base,
    )
    hists = {field: HistogramMetricFamily(name, help_, labels=[*base, "peer"]) for field, name, help_ in _HIST_METRICS}
    live = GaugeMetricFamily(
        "kvcore_live_objects", "Live sessions, leases, tombstones, peers, transfers (stats()).", labels=[*base, "kind"]
    )
    events = CounterMetricFamily(
        "kvcore_control_events",
        "Control-plane events since start, by kind (stats() counters: tickets refused, peers lost, ...).",
        labels=[*base, "kind"],
    )

    def buckets(h: Histogram) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, c in zip((*h.bounds, float("inf")), h.counts):
            acc += c
            out.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        return out

    for r in recorders:
        snap = r.snapshot()
        b = [snap.backend, snap.role, str(snap.rank)]
        started.add_metric(b, snap.requests_started)
        cpu.add_metric(b, snap.io_thread_cpu_seconds)
        stall.add_metric(b, snap.io_thread_stall_seconds)
        if snap.io_thread_wake_lag.count:
            lag.add_metric(b, buckets(snap.io_thread_wake_lag), snap.io_thread_wake_lag.sum)
        for label, pm in snap.peers.items():
            p = [*b, label]
            for oc in pm.requests_finished:
                finished.add_metric([*p, oc.outcome, oc.error_kind], oc.count)
            for outcome, h in pm.request_seconds.items():
                req_seconds.add_metric([*p, outcome], buckets(h), h.sum)
            posted.add_metric(p, pm.transfers_posted)
            completed.add_metric([*p, "ok"], pm.transfers_ok)
            completed.add_metric([*p, "failed"], pm.transfers_failed)
            bounced.add_metric(p, pm.transfers_bounced)
            nbytes.add_metric(p, pm.transfer_bytes)
            frags.add_metric(p, pm.transfer_fragments)
            quarantined.add_metric(p, pm.quarantined)
            for reason, n in pm.fenced.items():
                fenced.add_metric([*p, reason], n)
            for field, fam in hists.items():
                h = getattr(pm, field)
                if h.count:
                    fam.add_metric(p, buckets(h), h.sum)
        if r.gauges is not None:
            try:
                values = dict(r.gauges())
            except Exception:  # a closed transceiver: no gauges, the counters still export
                values = {}
            for kind, v in sorted(values.items()):
                if not kind.endswith("_total"):
                    live.add_metric([*b, kind], float(v))
        if r.events is not None:
            try:
                counts = dict(r.events())
            except Exception:  # a closed transceiver
                counts = {}
            for kind, v in sorted(counts.items()):
                events.add_metric([*b, kind.removesuffix("_total")], float(v))
    yield started
    yield cpu
    yield stall
    yield lag
    yield finished
    yield req_seconds
    yield posted
    yield completed
    yield bounced
    yield nbytes
    yield frags
    yield quarantined
    yield fenced
    yield from hists.values()
    yield live
    yield events


class KvcoreCollector:
    """A prometheus-client collector over recorders: the given ones, or every live one in this process."""

    def __init__(self, recorders: Iterable[TransceiverMetrics] | None = None) -> None:
        self._fixed = list(recorders) if recorders is not None else None

    def collect(self) -> Iterator[Any]:
        yield from _families(self._fixed if self._fixed is not None else live_recorders())

    def describe(self) -> list[Any]:
        # Declares the names at registration (so clashes raise then) without reading any recorder.
        return list(_families(()))


def _require_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise E.ConfigError(
            "Prometheus export needs prometheus-client: pip install 'kvcore[prometheus]' "
            "(MetricsSnapshot works without it)"
        ) from exc
    return prometheus_client


_registered: MutableMapping[Any, KvcoreCollector] = weakref.WeakKeyDictionary()


def register_metrics(registry: Any = None) -> KvcoreCollector:
    """Add kvcore's collector to ``registry`` (the engine's ``CollectorRegistry``; default: prometheus-client's).

    Idempotent per registry. The collector reports every live :class:`TransceiverMetrics` of this process.
    """
    prometheus_client = _require_prometheus()
    reg = registry if registry is not None else prometheus_client.REGISTRY
    with _live_lock:
        col = _registered.get(reg)
        if col is None:
            col = KvcoreCollector()
            reg.register(col)
            _registered[reg] = col
    return col


def serve_metrics(port: int, host: str = "127.0.0.1", registry: Any = None) -> Any:
    """Serve ``registry`` (a fresh one holding kvcore's collector when None) on ``http://host:port/metrics``.

    Binds to loopback unless told otherwise; ``port=0`` picks a free one. Returns the HTTP server:
    ``server.server_port`` is the port, ``server.shutdown()`` stops it.
    """
    prometheus_client = _require_prometheus()
    if registry is None:
        registry = prometheus_client.CollectorRegistry()
    register_metrics(registry)
    server, _thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    return server


# --- structured logs -----------------------------------------------------------------------------


def log_extra(request_id: int | None = None, peer: str | None = None) -> dict[str, Any]:
    """The ``extra=`` of a log record about a request: ``kvcore_request_id`` and ``kvcore_peer`` attributes."""
    return {"kvcore_request_id": request_id, "kvcore_peer": peer}


class _RequestAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Adds ``kvcore_request_id`` / ``kvcore_peer`` to every record, and prefixes the message for plain handlers."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        extra = dict(self.extra or {})
        rid, peer = extra.get("kvcore_request_id"), extra.get("kvcore_peer")
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        prefix = " ".join(x for x in (f"request {rid}" if rid is not None else "", f"peer {peer}" if peer else "") if x)
        return (f"[{prefix}] {msg}" if prefix else msg), kwargs


def request_logger(
    logger: logging.Logger, request_id: int | None = None, peer: str | None = None
) -> logging.LoggerAdapter:  # type: ignore[type-arg]
    """A logger whose records carry ``kvcore_request_id`` and ``kvcore_peer`` (for JSON formatters and filters)."""
    return _RequestAdapter(logger, log_extra(request_id, peer))
