"""kvcore.metrics: the recorder's counts, its thread safety, the bounded peer labels, the Prometheus
exposition (parsed with prometheus-client's own parser) and the HTTP exporter scraped on loopback."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import urllib.request

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcore import errors as E
from kvcore.metrics import (
    DURATION_BUCKETS,
    OTHER_PEER,
    FenceReason,
    Histogram,
    MetricsSnapshot,
    RequestOutcome,
    TransceiverMetrics,
    log_extra,
    register_metrics,
    request_logger,
    serve_metrics,
)


def _recorder(**kw: object) -> TransceiverMetrics:
    return TransceiverMetrics(backend="shm", role="context", rank=0, instance="ctx-test", register=False, **kw)  # type: ignore[arg-type]


def _some_traffic(m: TransceiverMetrics) -> None:
    """3 requests to gen-a (2 DONE, 1 PeerLost), 1 to gen-b cancelled, 1 failed before any peer."""
    for _ in range(5):
        m.request_started()
    m.first_contact("gen-a", 0.02)
    m.first_contact("gen-b", 0.03)
    for _ in range(2):
        m.queued("gen-a", 2e-4)
        m.transfer_posted("gen-a", 16384, 1, 1e-4, 5e-5)
        m.transfer_finished("gen-a", True, 1e-3)
        m.writer_service("gen-a", 2e-3)
        m.request_finished(RequestOutcome.DONE, 3e-3, peer="gen-a")
    m.transfer_posted("gen-a", 1 << 20, 64, 2e-4, 1e-4, bounced=True)
    m.transfer_finished("gen-a", False, 0.5)
    m.request_finished("FAILED", 0.6, error=E.PeerLostError("gone"), peer="gen-a")
    m.quarantined("gen-a")
    m.fenced(FenceReason.SAME_HOST_PID, "gen-a")
    m.request_finished(RequestOutcome.CANCELLED, 0.01, error="RequestCancelledError", peer="gen-b")
    m.request_finished(RequestOutcome.TIMED_OUT, 60.5, error=ValueError("not ours"))


def test_snapshot_counts_every_call() -> None:
    m = _recorder()
    _some_traffic(m)
    s = m.snapshot()
    assert (s.backend, s.role, s.rank, s.instance) == ("shm", "context", 0, "ctx-test")
    assert s.requests_started == 5
    assert s.total.outcomes() == {"DONE": 2, "FAILED": 1, "CANCELLED": 1, "TIMED_OUT": 1}
    # an error class outside kvcore's hierarchy is counted as OtherError: the label set stays closed
    assert s.total.error_kinds() == {"PeerLostError": 1, "RequestCancelledError": 1, "OtherError": 1}
    assert s.total.transfers_posted == 3 and s.total.transfers_ok == 2 and s.total.transfers_failed == 1
    assert s.total.transfer_bytes == 2 * 16384 + (1 << 20)
    assert s.total.transfer_fragments == 2 + 64
    assert s.total.transfers_bounced == 1
    assert s.total.quarantined == 1 and s.total.fenced == {"same_host_pid": 1}
    assert s.total.first_contact_seconds.count == 2
    assert s.total.first_contact_seconds.sum == pytest.approx(0.05)
    assert s.total.plan_seconds.count == 3 and s.total.post_seconds.count == 3
    assert s.total.queue_seconds.count == 2 and s.total.service_seconds.count == 2
    assert s.total.round_trip_seconds.count == 0
    assert s.total.request_seconds["TIMED_OUT"].counts[-1] == 1  # 60.5 s is past the last bound
    assert set(s.peers) == {"gen-a", "gen-b", ""}
    assert s.peers["gen-a"].outcomes() == {"DONE": 2, "FAILED": 1}
    assert s.peers["gen-b"].outcomes() == {"CANCELLED": 1}
    assert s.peers[""].outcomes() == {"TIMED_OUT": 1}


def test_bad_outcome_and_fence_reason_are_typed_errors() -> None:
    m = _recorder()
    with pytest.raises(E.ConfigError, match="outcome must be one of"):
        m.request_finished("SORT_OF_DONE", 1.0)
    with pytest.raises(ValueError):
        m.fenced("because", "gen-a")  # type: ignore[arg-type]
    with pytest.raises(E.ConfigError, match="role"):
        TransceiverMetrics(backend="shm", role="decode", register=False)


def test_histogram_buckets_quantile_and_mean() -> None:
    m = _recorder()
    for v in (1e-5, 1e-5, 2e-3, 0.3):  # bucket bounds are inclusive upper bounds, as in Prometheus
        m.transfer_finished("p", True, v)
    h = m.snapshot().total.transfer_seconds
    assert h.bounds == DURATION_BUCKETS and len(h.counts) == len(DURATION_BUCKETS) + 1
    assert h.counts[0] == 2 and h.counts[DURATION_BUCKETS.index(2.5e-3)] == 1
    assert h.counts[DURATION_BUCKETS.index(0.5)] == 1
    assert h.count == 4 and h.mean == pytest.approx((2e-5 + 2e-3 + 0.3) / 4)
    assert h.quantile(0.5) == 1e-5 and h.quantile(0.75) == 2.5e-3 and h.quantile(1.0) == 0.5
    with pytest.raises(E.ConfigError, match="quantile"):
        h.quantile(1.5)
    assert (h + h).count == 8


def test_counts_are_exact_under_concurrent_threads() -> None:
    m = _recorder()
    n, threads = 20_000, 4
    start = threading.Barrier(threads)

    def work(i: int) -> None:
        start.wait()
        for _ in range(n):
            m.request_started()
            m.transfer_posted(f"gen-{i % 2}", 10, 1, 1e-4, 1e-5)
            m.request_finished(RequestOutcome.DONE, 1e-3, peer=f"gen-{i % 2}")

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    mid = m.snapshot()  # reading while they write must not raise nor double-count
    for t in ts:
        t.join()
    assert mid.requests_started <= n * threads
    s = m.snapshot()  # the threads are dead now: their shards are folded, and nothing is lost
    assert s.requests_started == n * threads
    assert s.total.transfer_bytes == 10 * n * threads
    assert s.total.outcomes() == {"DONE": n * threads}
    assert s.peers["gen-0"].transfers_posted == s.peers["gen-1"].transfers_posted == n * threads // 2
    assert m.snapshot() == s  # folding dead shards twice changes nothing


def test_peer_labels_are_bounded_and_forgotten_peers_fold_into_other() -> None:
    m = _recorder(max_peers=2)
    for peer in ("a", "b", "c", "d"):
        m.transfer_posted(peer, 100, 1, 0.0, 0.0)
    s = m.snapshot()
    assert set(s.peers) == {"a", "b", OTHER_PEER}
    assert s.peers[OTHER_PEER].transfer_bytes == 200 and s.total.transfer_bytes == 400
    m.forget_peer("a")  # unloaded: its label is free, its counts move to _other (sums never drop)
    m.transfer_posted("e", 1, 1, 0.0, 0.0)
    s = m.snapshot()
    assert set(s.peers) == {"b", "e", OTHER_PEER}
    assert s.peers[OTHER_PEER].transfer_bytes == 300 and s.total.transfer_bytes == 401


def test_snapshot_is_a_typed_struct_that_round_trips_json() -> None:
    m = _recorder()
    _some_traffic(m)
    s = m.snapshot()
    back = msgspec.json.decode(msgspec.json.encode(s), type=MetricsSnapshot)
    assert back == s
    assert isinstance(back.total.transfer_seconds, Histogram)


def _families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = [(s.name, s.labels, s.value) for s in fam.samples]
    return out


def _value(fams: dict[str, list[tuple[str, dict[str, str], float]]], sample: str, **labels: str) -> float:
    base = sample.removesuffix("_total").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
    hits = [v for n, lab, v in fams[base] if n == sample and all(lab.get(k) == w for k, w in labels.items())]
    assert len(hits) == 1, (sample, labels, hits)
    return hits[0]


def test_prometheus_exposition_parses_with_correct_counts_and_types() -> None:
    m = _recorder()
    m.gauges = lambda: {"tx_sessions": 3, "bounced_writes_total": 9}
    _some_traffic(m)
    reg = CollectorRegistry()
    register_metrics(reg)
    assert register_metrics(reg) is register_metrics(reg)  # idempotent per registry
    from kvcore.metrics import KvcoreCollector

    reg2 = CollectorRegistry()
    reg2.register(KvcoreCollector([m]))
    text = generate_latest(reg2).decode()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["kvcore_requests_started"] == "counter"
    assert types["kvcore_transfer_duration_seconds"] == "histogram"
    assert types["kvcore_live_objects"] == "gauge"
    assert all(name.startswith("kvcore_") for name in types)
    fams = _families(text)
    lab = {"backend": "shm", "role": "context", "rank": "0"}
    assert _value(fams, "kvcore_requests_started_total", **lab) == 5
    assert _value(fams, "kvcore_requests_finished_total", peer="gen-a", outcome="DONE", error_kind="") == 2
    assert (
        _value(fams, "kvcore_requests_finished_total", peer="gen-a", outcome="FAILED", error_kind="PeerLostError") == 1
    )
    assert _value(fams, "kvcore_requests_finished_total", peer="", outcome="TIMED_OUT", error_kind="OtherError") == 1
    assert _value(fams, "kvcore_transfer_bytes_total", peer="gen-a") == 2 * 16384 + (1 << 20)
    assert _value(fams, "kvcore_transfer_descriptors_total", peer="gen-a") == 66
    assert _value(fams, "kvcore_transfers_completed_total", peer="gen-a", result="failed") == 1
    assert _value(fams, "kvcore_transfers_bounced_total", peer="gen-a") == 1
    assert _value(fams, "kvcore_fencing_events_total", peer="gen-a", reason="same_host_pid") == 1
    assert _value(fams, "kvcore_transfer_duration_seconds_count", peer="gen-a") == 3
    assert _value(fams, "kvcore_transfer_duration_seconds_bucket", peer="gen-a", le="0.001") == 2
    assert _value(fams, "kvcore_transfer_duration_seconds_bucket", peer="gen-a", le="+Inf") == 3
    assert _value(fams, "kvcore_transfer_duration_seconds_sum", peer="gen-a") == pytest.approx(0.502)
    assert _value(fams, "kvcore_request_duration_seconds_count", peer="gen-a", outcome="DONE") == 2
    assert _value(fams, "kvcore_live_objects", kind="tx_sessions") == 3
    assert not [s for s in fams["kvcore_live_objects"] if s[1]["kind"] == "bounced_writes_total"]


def test_register_metrics_reports_every_live_recorder_and_forgets_closed_ones() -> None:
    ctx = TransceiverMetrics(backend="shm", role="context", instance="c")
    gen = TransceiverMetrics(backend="shm", role="generation", rank=1, instance="g")
    try:
        reg = CollectorRegistry()
        register_metrics(reg)
        gen.request_started()
        fams = _families(generate_latest(reg).decode())
        assert _value(fams, "kvcore_requests_started_total", role="generation", rank="1") == 1
        assert _value(fams, "kvcore_requests_started_total", role="context", rank="0") == 0
        gen.close()
        fams = _families(generate_latest(reg).decode())
        assert [lab["role"] for _, lab, _ in fams["kvcore_requests_started"]] == ["context"]
    finally:
        ctx.close()
        gen.close()


def test_exporter_serves_the_metrics_over_http_on_loopback() -> None:
    m = TransceiverMetrics(backend="shm", role="generation", instance="g-http")
    server = serve_metrics(0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"  # loopback unless told otherwise
        m.request_started()
        m.writer_round_trip("ctx-a", 1.5e-3)
        m.request_finished(RequestOutcome.DONE, 2e-3, peer="ctx-a")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
        fams = _families(text)
        assert _value(fams, "kvcore_requests_started_total", role="generation") == 1
        assert _value(fams, "kvcore_writer_round_trip_seconds_count", role="generation", peer="ctx-a") == 1
        assert _value(fams, "kvcore_requests_finished_total", role="generation", outcome="DONE") == 1
    finally:
        server.shutdown()
        server.server_close()
        m.close()


def test_log_records_carry_request_id_and_peer(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("kvcore.test_metrics")
    with caplog.at_level(logging.INFO, logger="kvcore.test_metrics"):
        request_logger(log, 42, "ctx-a").info("write %d landed", 7)
        log.info("plain", extra=log_extra(43, "gen-b"))
    first, second = caplog.records
    assert first.kvcore_request_id == 42 and first.kvcore_peer == "ctx-a"  # type: ignore[attr-defined]
    assert first.getMessage() == "[request 42 peer ctx-a] write 7 landed"
    assert second.kvcore_request_id == 43 and second.kvcore_peer == "gen-b"  # type: ignore[attr-defined]


def test_snapshot_works_without_prometheus_client() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from kvcore.metrics import TransceiverMetrics, register_metrics\n"
        "from kvcore.errors import ConfigError\n"
        "m = TransceiverMetrics(backend='shm', role='context')\n"
        "m.transfer_posted('p', 5, 1, 0.0, 0.0)\n"
        "assert m.snapshot().total.transfer_bytes == 5\n"
        "try:\n    register_metrics()\nexcept ConfigError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "kvcore[prometheus]" in out.stdout


def test_every_exported_metric_is_documented_with_its_type() -> None:
    from pathlib import Path

    from kvcore.metrics import KvcoreCollector

    doc = (Path(__file__).resolve().parent.parent / "docs" / "observability.md").read_text()
    cells = [line.split("|")[1:-1] for line in doc.splitlines() if line.startswith("| `kvcore_")]
    rows = {c[0].strip().strip("`"): c[1].strip() for c in cells if len(c) == 5}  # the "Every metric" table
    families = KvcoreCollector().describe()
    assert len(families) >= 18
    for fam in families:
        # prometheus-client names counters without _total; the exposition (and the doc) adds it
        name = fam.name + ("_total" if fam.type == "counter" else "")
        assert name in rows, f"docs/observability.md does not list {name}"
        assert rows[name] == fam.type, f"{name}: documented as {rows[name]}, exported as {fam.type}"
    assert all(field in doc for field in _peer_metrics_fields())


def _peer_metrics_fields() -> list[str]:
    from kvcore.metrics import PeerMetrics

    return [f"`{f}`" for f in PeerMetrics.__struct_fields__]
