"""Prometheus exposition: the metric table and one collector that reads the live recorders at scrape time.

prometheus-client is optional (``pip install 'kvcore[prometheus]'``) and imported only when a collector is
registered or read. Nothing is registered at import: :func:`register_metrics` adds one collector to a
``CollectorRegistry``. Every name starts with ``kvcore_`` and carries its unit; docs/observability.md lists every
metric (a test checks it against this table).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

from kvcore import errors as E
from kvcore.metrics.recorder import TransceiverMetrics, _live_lock, live_recorders
from kvcore.metrics.snapshot import Histogram

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
