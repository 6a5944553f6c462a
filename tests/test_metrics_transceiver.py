"""Issue 16's acceptance test: scrape the Prometheus endpoint of a running transceiver pair after real transfers.

The context rank runs in its own process and serves its metrics over HTTP on loopback; the generation rank
runs here. After four two-block requests, both sides' counts must match what happened.
"""

from __future__ import annotations

import os
import time
import urllib.request
from typing import Any

import pytest
import torch
from _instances import fill_value, make_rank, ticket_for
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcore.metrics import register_metrics, serve_metrics
from kvcore.runtime import Channel, RankProcess, serve

NUM_BLOCKS = 32


class _Context:
    """The context rank: fills and sends what it is told, polls between commands, serves its metrics over HTTP."""

    def __init__(self) -> None:
        self.agent, cache, self.tx = make_rank("context", f"ctx-metrics-{os.getpid()}", "shm", NUM_BLOCKS)
        self.flat = cache.view(NUM_BLOCKS, -1).view(torch.uint8)

    def op_send(self, rid: int, blocks: list[int]) -> dict[str, Any]:
        self.flat[blocks] = torch.from_numpy(fill_value(rid, blocks, self.flat.shape[1]))
        self.tx.start_send(rid, blocks, ticket=ticket_for(rid))
        return {}


def context_main(channel: Channel) -> None:
    ctx = _Context()
    server = serve_metrics(0)
    try:
        channel.send({"endpoint": ctx.tx.info_endpoint, "port": server.server_port})
        serve(channel, ctx, idle=ctx.tx.poll, idle_wait=0.002)
    finally:
        server.shutdown()
        ctx.tx.close()
        ctx.agent.close()


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def _sum(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items()))


def _scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return _samples(resp.read().decode())


@pytest.mark.timeout(120)
def test_scraped_metrics_of_a_transceiver_pair_count_real_transfers() -> None:
    ctx = RankProcess("test_metrics_transceiver:context_main", name="metrics context", path=[os.path.dirname(__file__)])
    agent, cache, gen = make_rank("generation", "gen-metrics", "shm", NUM_BLOCKS)
    try:
        hello = ctx.recv(60, op="start")
        block_bytes = cache.view(NUM_BLOCKS, -1).view(torch.uint8).shape[1]
        rids = [11, 12, 13, 14]
        for i, rid in enumerate(rids):
            src, dst = [2 * i, 2 * i + 1], [20 + 2 * i, 21 + 2 * i]
            ctx.tell("send", rid=rid, blocks=src)
            gen.start_receive(rid, hello["endpoint"], dst, ticket=ticket_for(rid))
        outcomes = gen.wait_all(rids, timeout=60)
        assert all(o.state.value == "DONE" for o in outcomes.values())

        # generation side: in this process, through the engine's own registry
        registry = CollectorRegistry()
        register_metrics(registry)
        g = _samples(generate_latest(registry).decode())
        lab = {"role": "generation", "backend": "shm"}
        assert _sum(g, "kvcore_requests_started_total", **lab) == 4
        assert _sum(g, "kvcore_requests_finished_total", outcome="DONE", **lab) == 4
        assert _sum(g, "kvcore_request_duration_seconds_count", **lab) == 4
        assert _sum(g, "kvcore_writer_round_trip_seconds_count", **lab) == 4
        assert _sum(g, "kvcore_first_contact_duration_seconds_count", **lab) == 1  # paid once per peer
        assert _sum(g, "kvcore_live_objects", kind="rx_sessions", **lab) == 0
        snap = gen.metrics.snapshot()
        assert snap.requests_started == 4 and snap.total.outcomes() == {"DONE": 4}
        assert _sum(g, "kvcore_io_thread_cpu_seconds_total", **lab) > 0
        assert 0 < snap.io_thread_cpu_seconds <= time.process_time()  # one thread's share of this process
        # the I/O thread slept between requests (timers): its wake-ups were timed; a stall is never negative
        assert snap.io_thread_wake_lag.count > 0 and snap.io_thread_stall_seconds >= 0
        assert 0 < _sum(g, "kvcore_io_thread_wake_lag_seconds_count", **lab) <= snap.io_thread_wake_lag.count
        assert any(n == "kvcore_io_thread_stall_seconds_total" for n, _, _ in g)
        assert "" not in {p for p, m in snap.peers.items() if m.round_trip_seconds.count}  # labelled by peer

        # context side: its own process, scraped over HTTP; its outcomes are reported once it has released them
        deadline = time.monotonic() + 30
        while True:
            c = _scrape(hello["port"])
            done = _sum(c, "kvcore_requests_finished_total", role="context") == 4
            slept = _sum(c, "kvcore_io_thread_wake_lag_seconds_count", role="context") > 0  # an idle timer's sleep
            if (done and slept) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        lab = {"role": "context", "backend": "shm"}
        assert _sum(c, "kvcore_requests_started_total", **lab) == 4
        assert _sum(c, "kvcore_requests_finished_total", outcome="DONE", error_kind="", **lab) == 4
        assert _sum(c, "kvcore_transfers_posted_total", **lab) == 4
        assert _sum(c, "kvcore_transfers_completed_total", result="ok", **lab) == 4
        assert _sum(c, "kvcore_transfers_completed_total", result="failed", **lab) == 0
        assert _sum(c, "kvcore_transfer_bytes_total", **lab) == 4 * 2 * block_bytes
        assert 4 <= _sum(c, "kvcore_transfer_descriptors_total", **lab) <= 8  # two blocks each, maybe merged
        for hist in ("plan", "post", "transfer", "queue"):
            assert _sum(c, f"kvcore_{hist}_duration_seconds_count", **lab) == 4, hist
        assert _sum(c, "kvcore_writer_service_seconds_count", **lab) == 4
        assert _sum(c, "kvcore_first_contact_duration_seconds_count", **lab) == 1
        assert _sum(c, "kvcore_live_objects", kind="tx_sessions", **lab) == 0
        assert _sum(c, "kvcore_io_thread_wake_lag_seconds_count", **lab) > 0
        assert any(n == "kvcore_io_thread_stall_seconds_total" and lab_["role"] == "context" for n, lab_, _ in c)
        cpu = _sum(c, "kvcore_io_thread_cpu_seconds_total", **lab)
        assert cpu > 0 and _sum(_scrape(hello["port"]), "kvcore_io_thread_cpu_seconds_total", **lab) >= cpu
    finally:
        ctx.close(20.0)
        gen.close()
        agent.close()
    # once the transceiver is closed its I/O thread has ended: the counter keeps the thread's total
    assert gen.metrics.snapshot().io_thread_cpu_seconds >= snap.io_thread_cpu_seconds
