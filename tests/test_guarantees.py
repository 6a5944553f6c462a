"""Lifecycle guarantees that a broken kvcore cannot pass, through the public API only.

Each test drives the real shm agent, wrapped where needed so that a one-sided
write lands late (``held-shm``) or is refused (``failing-shm``), and checks the
promise at the moment it is made: bytes at DONE, pages untouched after release,
the worst outcome across the ranks of one instance, a typed error for a lost peer.
``make mutations`` breaks each guarantee on purpose and expects these tests to fail.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _faults import RankGroup, fault_plugin_manager, layer_pattern
from _instances import GenerationProcess, fill_value, make_rank, ticket_for

from kvcore import errors as E
from kvcore.transceiver import SessionState

pytestmark = pytest.mark.timeout(120)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """One row of raw bytes per block."""
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def _poll_until(
    groups: list[RankGroup], cond: Callable[[], bool], timeout: float, on_result: Callable[[str, int, Any], None]
) -> None:
    """Poll every group (each rank in step) until ``cond()``; ``on_result(group_role, rank, PollResult)`` sees all."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        for g in groups:
            for rank, res in enumerate(g.poll()):
                on_result(g.role, rank, res)
        time.sleep(0.002)


@pytest.fixture
def pm() -> Any:
    return fault_plugin_manager()


class Log:
    """Outcomes and releases seen per (role, rank), in the order ``poll`` reported them."""

    def __init__(self) -> None:
        self.outcomes: dict[tuple[str, int, int], Any] = {}
        self.released: dict[tuple[str, int], list[int]] = {}

    def __call__(self, role: str, rank: int, res: Any) -> None:
        for o in res.outcomes:
            key = (role, rank, o.request_id)
            assert key not in self.outcomes, f"{key} reported twice"
            self.outcomes[key] = o
        self.released.setdefault((role, rank), []).extend(res.released)

    def has(self, role: str, rank: int, rid: int) -> bool:
        return (role, rank, rid) in self.outcomes

    def is_released(self, role: str, rank: int, rid: int) -> bool:
        return rid in self.released.get((role, rank), [])


@pytest.fixture
def held(pm: Any) -> Iterator[tuple[RankGroup, RankGroup]]:
    """A context rank whose writes are held until the test opens the gate, and a generation rank (plain shm)."""
    ctx = RankGroup.build(
        "context", backend="held-shm", pm=pm, agent_options=[{"closed": True}], transfer_timeout_s=1.0
    )
    gen = RankGroup.build("generation", pm=pm, timeout=30.0)
    try:
        yield ctx, gen
    finally:
        ctx.agents[0].gate.set()
        gen.close()
        ctx.close()


def _fill(ctx: RankGroup, rid: int, blocks: list[int]) -> np.ndarray:
    flat = _flat(ctx.caches[0])
    want = fill_value(rid, blocks, flat.shape[1])
    flat[blocks] = torch.from_numpy(want)
    return want


@pytest.mark.parametrize("how", ["cancel", "context-cancel", "timeout"])
def test_pages_are_not_released_while_a_write_is_in_flight_and_stay_untouched_after(
    held: tuple[RankGroup, RankGroup], how: str
) -> None:
    """Cancel (either side) or time out a request whose write the transport holds: no release until it landed.

    After release nothing changes in the destination pages, and the source pages are not released while the
    transport still reads them. A context-side cancel comes too late to stop a submitted write: the receiver
    may then end DONE, with every byte in place at DONE.
    """
    ctx, gen = held
    gate = ctx.agents[0].gate
    src, dst = [3, 4], [10, 11]
    want = _fill(ctx, 1, src)
    gflat = _flat(gen.caches[0])
    log = Log()
    if how == "timeout":
        gen.close()
        gen = RankGroup.build("generation", pm=fault_plugin_manager(), timeout=2.0)
        gflat = _flat(gen.caches[0])
    try:
        ctx.txs[0].start_send(1, src, ticket=ticket_for(1))
        gen.txs[0].start_receive(1, ctx.info_endpoint, dst, ticket=ticket_for(1))
        assert ctx.agents[0].holding.wait(20), "the context rank never submitted the write"
        if how == "cancel":
            assert gen.txs[0].cancel(1)
            # The logical outcome comes at once ...
            _poll_until([gen, ctx], lambda: log.has("generation", 0, 1), 20, log)
            assert log.outcomes[("generation", 0, 1)].state is SessionState.CANCELLED
            assert isinstance(log.outcomes[("generation", 0, 1)].error, E.RequestCancelledError)
        elif how == "timeout":  # ... or at the deadline ...
            _poll_until([gen, ctx], lambda: log.has("generation", 0, 1), 20, log)
            assert log.outcomes[("generation", 0, 1)].state is SessionState.TIMED_OUT
            assert isinstance(log.outcomes[("generation", 0, 1)].error, E.TransferTimeoutError)
        else:
            assert ctx.txs[0].cancel(1)
            _poll_until([gen, ctx], lambda: log.has("context", 0, 1), 20, log)
            assert log.outcomes[("context", 0, 1)].state is SessionState.CANCELLED
        # ... but while the write is in flight the pages are not handed back, however long it takes.
        t_end = time.monotonic() + 1.0
        _poll_until([gen, ctx], lambda: time.monotonic() > t_end, 5, log)
        assert not log.is_released("generation", 0, 1), "pages released while a write into them was in flight"
        assert not log.is_released("context", 0, 1), "source pages released while the transport still reads them"
        if how != "context-cancel":
            assert gen.txs[0].stats()["quarantined"] == 1
        assert not gflat[dst].any(), "the held write moved bytes before the transport performed it"
        at_done: list[np.ndarray] = []

        def on_result(role: str, rank: int, res: Any) -> None:
            if role == "generation" and any(o.request_id == 1 for o in res.done):
                at_done.append(gflat[dst].numpy().copy())
            log(role, rank, res)

        gate.set()  # the transport performs the write now
        _poll_until([gen, ctx], lambda: log.is_released("generation", 0, 1), 20, on_result)
        if at_done:
            assert np.array_equal(at_done[0], want), "bytes at DONE differ from the context's pattern"
        at_release = gflat[dst].clone()
        assert np.array_equal(at_release.numpy(), want), "the in-flight write had not landed when pages were released"
        # Nothing lands after release: wait until the context side is finished with the request too.
        _poll_until([gen, ctx], lambda: log.is_released("context", 0, 1), 20, log)
        assert torch.equal(gflat[dst], at_release), "bytes changed after the pages were released"
        assert gen.txs[0].stats()["quarantined"] == 0 and gen.txs[0].stats()["rx_sessions"] == 0
    finally:
        if how == "timeout":
            gate.set()
            gen.close()


def test_done_only_once_every_writer_landed_bytes_checked_at_done(pm: Any) -> None:
    """Two context ranks (PP2) write one request; one is slow: DONE waits for it, and every byte is there at DONE."""
    ctx = RankGroup.build("context", backend="held-shm", pp=2, pm=pm, agent_options=[{}, {"closed": True}], geometry={})
    gen = RankGroup.build("generation", pm=pm)
    try:
        src, dst = [5, 9], [20, 2]
        per_layer = ctx.caches[0][0, 0].numel() * ctx.caches[0].element_size()
        for p, cache in enumerate(ctx.caches):  # [blocks, layers of this stage, ...]; global layers 2p, 2p+1
            raw = cache.view(torch.uint8).view(cache.shape[0], cache.shape[1], -1)
            for j, b in enumerate(src):
                for k in range(cache.shape[1]):
                    raw[b, k] = torch.from_numpy(layer_pattern(5, j, 2 * p + k, per_layer))
        graw = gen.caches[0].view(torch.uint8).view(gen.caches[0].shape[0], gen.caches[0].shape[1], -1)
        want = np.stack(
            [np.stack([layer_pattern(5, j, layer, per_layer) for layer in range(4)]) for j in range(len(src))]
        )
        ctx.each(lambda _r, tx: tx.start_send(5, src, ticket=ticket_for(5)))
        gen.txs[0].start_receive(5, ctx.info_endpoint, dst, ticket=ticket_for(5))
        log = Log()

        def first_stage_landed() -> bool:
            return np.array_equal(graw[dst, :2].numpy(), want[:, :2])

        _poll_until([gen, ctx], first_stage_landed, 20, log)
        t_end = time.monotonic() + 1.5  # the first writer reported; the second one's write is still held
        _poll_until([gen, ctx], lambda: time.monotonic() > t_end or log.has("generation", 0, 5), 5, log)
        assert not log.has("generation", 0, 5), "DONE reported while a writer's bytes were still in flight"
        ctx.agents[1].gate.set()
        at_done: dict[str, Any] = {}

        def on_result(role: str, rank: int, res: Any) -> None:
            if role == "generation" and any(o.request_id == 5 for o in res.done):
                at_done["bytes"] = graw[dst].numpy().copy()  # checked at DONE, before the engine could reuse
            log(role, rank, res)

        _poll_until([gen, ctx], lambda: log.has("generation", 0, 5), 20, on_result)
        assert log.outcomes[("generation", 0, 5)].state is SessionState.DONE
        assert np.array_equal(at_done["bytes"], want), "bytes at DONE differ from the context's pattern"
    finally:
        for a in ctx.agents:
            a.gate.set()
        gen.close()
        ctx.close()


def test_one_rank_failing_makes_the_instance_outcome_the_worst(pm: Any) -> None:
    """A two-rank generation instance (PP2): the transport refuses writes to rank 1 only; both ranks report FAILED."""
    ctx = RankGroup.build("context", backend="failing-shm", pm=pm, agent_options=[{"fail_remotes": ["generation-1"]}])
    gen = RankGroup.build("generation", pp=2, pm=pm)
    try:
        _fill(ctx, 7, [1, 2])
        ctx.txs[0].start_send(7, [1, 2], ticket=ticket_for(7))
        # Rank 0 asks first and its part lands (so rank 0 alone would be DONE); only then does rank 1 ask.
        gen.txs[0].start_receive(7, ctx.info_endpoint, [6, 8], ticket=ticket_for(7))
        deadline = time.monotonic() + 20
        while not _flat(gen.caches[0])[[6, 8]].any():
            assert time.monotonic() < deadline, "rank 0's part never arrived"
            time.sleep(0.01)
        gen.txs[1].start_receive(7, ctx.info_endpoint, [6, 8], ticket=ticket_for(7))
        log = Log()
        _poll_until(
            [gen, ctx],
            lambda: all(log.is_released("generation", r, 7) for r in (0, 1)) and log.is_released("context", 0, 7),
            30,
            log,
        )
        for r in (0, 1):
            o = log.outcomes[("generation", r, 7)]
            assert o.state is SessionState.FAILED, f"generation rank {r} reported {o.state.value}"
            assert isinstance(o.error, E.KvcoreError)
        assert log.outcomes[("context", 0, 7)].state is SessionState.FAILED
        assert ctx.agents[0].failed_writes == 1
        assert not _flat(gen.caches[1])[[6, 8]].any(), "the refused write moved bytes"
    finally:
        gen.close()
        ctx.close()


def test_a_generation_process_that_dies_mid_request_fails_the_send_with_peer_lost() -> None:
    """The receiver dies while the context waits for more layers: PeerLostError, long before the request timeout."""
    gp = GenerationProcess()
    agent, _, tx = make_rank("context", "ctx-disconnect", timeout=120.0)
    try:
        gp.receive(1, tx.info_endpoint, [1])
        tx.start_send(1, [2], ticket=ticket_for(1))
        assert tx.wait_all([1], 30)[1].state is SessionState.DONE  # the context rank now talks to the receiver
        gp.receive(2, tx.info_endpoint, [3, 4])
        deadline = time.monotonic() + 20
        while tx.stats()["early_requests"] != 1:  # its RequestData arrived before start_send
            assert time.monotonic() < deadline, "the receiver's request never arrived"
            time.sleep(0.01)
        tx.start_send(2, [5, 6], layers_ready=2, ticket=ticket_for(2))  # half the layers: the rest would follow later
        gp.kill()
        out = tx.wait_all([2], 30)[2]  # the request timeout is 120 s: only the disconnect can end it sooner
        assert out.state is SessionState.FAILED, out
        assert isinstance(out.error, E.PeerLostError), repr(out.error)
        st = tx.stats()
        assert st["tx_sessions"] == 0 and st["agent_transfers"] == 0
    finally:
        gp.close()
        tx.close()
        agent.close()


def test_a_request_to_a_peer_that_never_answers_times_out_within_its_bound(pm: Any) -> None:
    """Nothing answers at the context endpoint (a silent socket): the receiver's own deadline ends the request."""
    import zmq

    from kvcore.config import TransceiverConfig
    from kvcore.control.auth import AuthConfig

    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    local = AuthConfig.from_config(TransceiverConfig())  # a peer of this uid (a stranger fails the handshake)
    assert local is not None
    silent.curve_server, silent.curve_secretkey = True, local.secret_key
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    gen = RankGroup.build("generation", pm=pm, timeout=2.0)
    try:
        gen.txs[0].start_receive(1, f"tcp://127.0.0.1:{port}", [0], ticket=ticket_for(1))
        assert silent.poll(10000), "the receiver never contacted the endpoint"
        out = gen.txs[0].wait_all([1], 30)[1]  # bound: 2 s; the wait is generous for a loaded machine
        assert out.state is SessionState.TIMED_OUT
        assert isinstance(out.error, E.TransferTimeoutError)
        assert gen.txs[0].stats()["rx_sessions"] == 0
    finally:
        gen.close()
        silent.close(0)


def test_a_send_nobody_asks_for_times_out_within_its_bound(pm: Any) -> None:
    """The context side's own deadline ends a request no receiver ever asks for, and releases its pages."""
    ctx = RankGroup.build("context", pm=pm, timeout=2.0)
    try:
        ctx.txs[0].start_send(1, [0, 1], ticket=ticket_for(1))
        out = ctx.txs[0].wait_all([1], 30)[1]
        assert out.state is SessionState.TIMED_OUT
        assert isinstance(out.error, E.TransferTimeoutError)
        assert ctx.txs[0].stats()["tx_sessions"] == 0
    finally:
        ctx.close()


def test_transceivers_closed_leave_no_fd_and_no_thread_behind(pm: Any) -> None:
    """Two instances that moved requests, then closed with their agents: exactly the baseline fds and threads."""
    from _faults import leaked_since, open_fds

    def round_trip(n: int) -> None:
        ctx = RankGroup.build("context", pm=pm)
        gen = RankGroup.build("generation", pm=pm)
        try:
            for r in range(n):
                _fill(ctx, r, [r % 8])
                ctx.txs[0].start_send(r, [r % 8], ticket=ticket_for(r))
                gen.txs[0].start_receive(r, ctx.info_endpoint, [8 + r % 8], ticket=ticket_for(r))
                assert gen.txs[0].wait_all([r], 30)[r].state is SessionState.DONE
            assert ctx.txs[0].wait_all(list(range(n)), 30)
        finally:
            gen.close()
            ctx.close()

    round_trip(1)  # process-wide state created once (ZeroMQ context, torch pools) is not a leak
    fds, threads = open_fds(), set(threading.enumerate())
    round_trip(10)
    leaked_fds, leaked_threads = leaked_since(fds, threads)
    assert leaked_fds == set(), f"descriptors left open: {sorted(leaked_fds)}"
    assert leaked_threads == set(), f"threads left running: {sorted(leaked_threads)}"
