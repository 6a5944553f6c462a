"""The worker runs inside the messenger's I/O loop: errors in its work never stop it, and close() stops it cleanly.

One thread per transceiver reads control messages, does the work (plan, submit, poll, timers) and writes the
answers. These tests break that thread's work on purpose with real shm agents that have injected bugs
(``_faults.RaisingShmAgent``) or hold their writes (``_faults.HeldShmAgent``), across real ZeroMQ sockets.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from _faults import RankGroup, fault_plugin_manager, leaked_since, open_fds
from _instances import fill_value, ticket_for

from kvcore import errors as E
from kvcore.transceiver import SessionState

pytestmark = pytest.mark.timeout(120)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def _fill(ctx: RankGroup, rid: int, blocks: list[int]) -> np.ndarray:
    flat = _flat(ctx.caches[0])
    want = fill_value(rid, blocks, flat.shape[1])
    flat[blocks] = torch.from_numpy(want)
    return want


def _until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_agent_bugs_on_the_worker_loop_fail_one_request_and_the_rest_move() -> None:
    """A submit that raises RuntimeError fails its request (both sides told); progress() raising is survived."""
    pm = fault_plugin_manager()
    ctx = RankGroup.build(
        "context", backend="raising-shm", pm=pm, agent_options=[{"raise_writes": 1, "raise_progress": 50}]
    )
    gen = RankGroup.build("generation", pm=pm, timeout=30.0)
    try:
        c, g = ctx.txs[0], gen.txs[0]
        gflat = _flat(gen.caches[0])
        # Request 0: its write hits the submit bug. It must end FAILED on both sides, not wait for a deadline.
        _fill(ctx, 0, [1])
        c.start_send(0, [1], ticket=ticket_for(0))
        g.start_receive(0, ctx.info_endpoint, [2], ticket=ticket_for(0))
        out = g.wait_all([0], 30)[0]
        assert out.state is SessionState.FAILED
        assert isinstance(out.error, E.TransferFailedError) and "RuntimeError" in str(out.error)
        assert c.wait_all([0], 30)[0].state is SessionState.FAILED
        assert ctx.agents[0].raised >= 2, "the injected progress() bug never ran on the worker loop"
        # The loop that served the bug serves everything after it: bytes land, nothing leaks.
        for rid in range(1, 6):
            want = _fill(ctx, rid, [rid + 2])
            c.start_send(rid, [rid + 2], ticket=ticket_for(rid))
            g.start_receive(rid, ctx.info_endpoint, [rid + 10], ticket=ticket_for(rid))
            assert g.wait_all([rid], 30)[rid].state is SessionState.DONE
            assert np.array_equal(gflat[rid + 10].numpy(), want[0]), f"request {rid}: wrong bytes"
            assert c.wait_all([rid], 30)[rid].state is SessionState.DONE
        assert g.leaks() == {} and c.leaks() == {}
    finally:
        gen.close()
        ctx.close()


def _close_with_held_writes(pm: Any) -> None:
    ctx = RankGroup.build("context", backend="held-shm", pm=pm, agent_options=[{"closed": True}])
    gen = RankGroup.build("generation", pm=pm, timeout=30.0)
    try:
        _fill(ctx, 7, [3])
        ctx.txs[0].start_send(7, [3], ticket=ticket_for(7))
        gen.txs[0].start_receive(7, ctx.info_endpoint, [4], ticket=ticket_for(7))
        assert ctx.agents[0].holding.wait(20), "the context rank never submitted the write"
        # A second request behind the held one is still taken by the same loop (the held write blocks nothing).
        _fill(ctx, 8, [5])
        ctx.txs[0].start_send(8, [5], ticket=ticket_for(8))
        gen.txs[0].start_receive(8, ctx.info_endpoint, [6], ticket=ticket_for(8))
        _until(lambda: ctx.agents[0].resources()["transfers"] >= 2, 20, "both writes submitted")
        assert gen.txs[0].status(7) is not None and gen.txs[0].status(8) is not None
    finally:
        gen.close()
        ctx.close()  # the transport still holds both writes
        ctx.agents[0].gate.set()


def test_close_while_writes_are_held_on_the_worker_loop_stops_everything() -> None:
    """close() on both sides while the transport still holds writes: it returns, no thread and no fd left."""
    pm = fault_plugin_manager()
    _close_with_held_writes(pm)  # process-wide state created once (ZeroMQ context, torch pools) is not a leak
    gc.collect()
    fds, threads = open_fds(), set(threading.enumerate())
    _close_with_held_writes(pm)
    gc.collect()
    leaked_fds, leaked_threads = leaked_since(fds, threads)
    assert leaked_threads == set(), f"threads left running: {sorted(leaked_threads)}"
    assert leaked_fds == set(), f"descriptors left open: {sorted(leaked_fds)}"


def test_a_burst_larger_than_the_socket_queue_from_the_io_thread_arrives_whole_and_in_order() -> None:
    """A driver that writes 6000 messages in one loop turn (ZeroMQ queues hold about 2000): none is lost."""
    from kvcore.control import wire
    from kvcore.control.messenger import Messenger

    n = 6000
    got: list[int] = []
    done = threading.Event()

    def on_b(_src: Any, msg: Any) -> None:
        got.append(msg.request_id)
        if len(got) == n:
            done.set()

    a = Messenger(lambda s, m: None, name="burst-a")
    b = Messenger(on_b, name="burst-b")
    sent = threading.Event()

    def driver() -> float:
        if not sent.is_set():
            sent.set()
            for i in range(n):  # all from the I/O thread, in one turn: written at its end, no wake-up
                a.send(b.endpoint, wire.Cancel(v=wire.PROTOCOL_VERSION, request_id=i, instance="x", rank=0, reason=""))
        return 0.02

    a.set_driver(driver)
    a.start()
    b.start()
    try:
        assert done.wait(60), f"{len(got)} of {n} messages arrived"
        assert got == list(range(n)), "messages to one peer arrived out of order"
        assert a.counters["send_failed"] == 0
    finally:
        a.close()
        b.close()
