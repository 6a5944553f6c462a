"""The recorder a transceiver calls at each step of a request: per-thread shards, no lock on the hot path.

The recorder keeps plain counters and fixed-bucket histograms in **per-thread shards**: the hot path takes no lock
(each thread only writes its own shard), costs a few hundred nanoseconds, and stays correct without the GIL.
:meth:`TransceiverMetrics.snapshot` merges the shards into a frozen :class:`~kvcore.metrics.snapshot.MetricsSnapshot`.
Every recorder made with ``register=True`` is *live* (:func:`live_recorders`) until closed: what a collector without
an explicit list reports.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from kvcore import errors as E
from kvcore.metrics.snapshot import (
    _ERROR_KINDS,
    _HISTS,
    _OUTCOMES,
    NO_PEER,
    OTHER_ERROR,
    OTHER_PEER,
    FenceReason,
    Histogram,
    MetricsSnapshot,
    OutcomeCount,
    PeerMetrics,
    RequestOutcome,
    _cell_histogram,
    _empty_hist,
    _hist_cell,
    _observe,
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
