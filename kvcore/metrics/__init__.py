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

The package, one concern a module: ``snapshot`` (label sets, :class:`Histogram`, the frozen structs),
``recorder`` (:class:`TransceiverMetrics`, :func:`live_recorders`), ``prometheus`` (the metric table,
:class:`KvcoreCollector`, :func:`register_metrics`), ``server`` (:func:`serve_metrics`) and ``logs``
(:func:`log_extra`, :func:`request_logger`). Every public name is importable from ``kvcore.metrics``.
"""

from __future__ import annotations

from kvcore.metrics.logs import log_extra, request_logger
from kvcore.metrics.prometheus import KvcoreCollector as KvcoreCollector
from kvcore.metrics.prometheus import register_metrics
from kvcore.metrics.recorder import TransceiverMetrics, live_recorders
from kvcore.metrics.server import serve_metrics
from kvcore.metrics.snapshot import (
    DURATION_BUCKETS,
    OTHER_PEER,
    FenceReason,
    Histogram,
    MetricsSnapshot,
    OutcomeCount,
    PeerMetrics,
    RequestOutcome,
)
from kvcore.metrics.snapshot import NO_PEER as NO_PEER
from kvcore.metrics.snapshot import OTHER_ERROR as OTHER_ERROR

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
    "register_metrics",
    "request_logger",
    "serve_metrics",
]
