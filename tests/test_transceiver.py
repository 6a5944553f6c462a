"""Transceiver end to end across real processes: bytes, first-contact refusal, hostile frames, cancel, death, leaks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from _instances import ContextProcess, fill_value, make_rank, ticket_for
from _local_auth import local_dealer

from kvcore import errors as E
from kvcore.control import wire
from kvcore.testing.harness import stop_process
from kvcore.transceiver import RequestStatus, SessionState, leaks


class Gen:
    """An in-process one-rank generation instance."""

    def __init__(self, backend: str = "shm", num_blocks: int = 64, timeout: float = 30.0, **geo: Any) -> None:
        self.agent, self.cache, self.tx = make_rank("generation", "gen-test", backend, num_blocks, timeout, **geo)
        self.geometry = self.tx.geometry
        self.flat = self.cache.view(num_blocks, -1).view(torch.uint8)

    def outcomes(self, rids: list[int], timeout: float = 20.0) -> dict[int, Any]:
        return self.tx.wait_all(rids, timeout)

    def close(self) -> None:
        self.tx.close()
        self.agent.close()


@pytest.fixture
def ctx() -> Iterator[ContextProcess]:
    c = ContextProcess()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def gen() -> Iterator[Gen]:
    g = Gen()
    try:
        yield g
    finally:
        g.close()


def _check_bytes(gen: Gen, rid: int, src_blocks: list[int], dst_blocks: list[int]) -> None:
    want = fill_value(rid, src_blocks, gen.flat.shape[1])
    got = gen.flat[dst_blocks].numpy()
    assert np.array_equal(got, want), f"request {rid}: received bytes differ from the context's pattern"


def test_concurrent_requests_bytes_and_no_leaks(ctx: ContextProcess, gen: Gen) -> None:
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(64), rng.permutation(64)
    rids = list(range(16))
    for r in rids:  # receivers first for half, senders first for the other half: both orders must work
        s, d = src[r * 4 : (r + 1) * 4].tolist(), dst[r * 4 : (r + 1) * 4].tolist()
        if r % 2:
            ctx.send(r, s)
            gen.tx.start_receive(r, ctx.endpoint, d, ticket=ticket_for(r))
        else:
            gen.tx.start_receive(r, ctx.endpoint, d, ticket=ticket_for(r))
            ctx.send(r, s)
    out = gen.outcomes(rids)
    assert {o.state for o in out.values()} == {SessionState.DONE}
    for r in rids:
        _check_bytes(gen, r, src[r * 4 : (r + 1) * 4].tolist(), dst[r * 4 : (r + 1) * 4].tolist())
        assert ctx.wait_released(r)["state"] == "DONE"
    assert gen.tx.leaks() == {}
    assert leaks(ctx.stats()) == {}


def test_prefix_cached_suffix_only(ctx: ContextProcess, gen: Gen) -> None:
    src, dst = [10, 11, 12, 13, 14], [40, 41, 42]  # the generation side holds the first two blocks
    gen.flat[[40, 41, 42]] = 0
    ctx.send(1, src)
    gen.tx.start_receive(1, ctx.endpoint, dst, ticket=ticket_for(1), cached_tokens=2 * gen.geometry.tokens_per_block)
    assert gen.outcomes([1])[1].state is SessionState.DONE
    want = fill_value(1, src, gen.flat.shape[1])[2:]  # only the suffix moves, aligned at the end
    assert np.array_equal(gen.flat[dst].numpy(), want)


@pytest.mark.parametrize(
    ("override", "fields"),
    [({"head_dim": 64}, ["head_dim"]), ({"dtype": "float16", "tokens_per_block": 16}, ["dtype", "tokens_per_block"])],
)
def test_incompatible_peer_refused_at_first_contact(
    ctx: ContextProcess, override: dict[str, Any], fields: list[str]
) -> None:
    g = Gen(**override)
    try:
        g.tx.start_receive(1, ctx.endpoint, [0, 1], ticket=ticket_for(1))
        out = g.outcomes([1])[1]
        assert out.state is SessionState.FAILED
        assert isinstance(out.error, E.IncompatiblePeerError)
        for f in fields:
            assert f in str(out.error)
        assert not g.flat.any(), "an incompatible peer must not receive a single byte"
        # Cached: the next request fails at once, without a new round trip.
        g.tx.start_receive(2, ctx.endpoint, [0], ticket=ticket_for(2))
        assert isinstance(g.outcomes([2], 2.0)[2].error, E.IncompatiblePeerError)
    finally:
        g.close()


def test_malformed_frame_answered_with_typed_error_while_requests_work(ctx: ContextProcess, gen: Gen) -> None:
    sock = local_dealer(ctx.endpoint)  # an admitted same-uid peer: strangers are refused before any frame
    try:
        ctx.send(5, [1, 2])
        gen.tx.start_receive(5, ctx.endpoint, [7, 9], ticket=ticket_for(5))
        for frame in (b"\x93garbage", msgspec.msgpack.encode({"t": "request_data", "v": 1, "request_id": "x"})):
            sock.send(frame)
            assert sock.poll(5000), "the context rank did not answer a malformed frame"
            reply = wire.decode(sock.recv())
            assert isinstance(reply, wire.ErrorReply) and reply.kind == "MessageDecodeError"
        sock.send(msgspec.msgpack.encode({"t": "cancel", "v": 77, "request_id": 1, "instance": "x", "rank": 0}))
        assert sock.poll(5000)
        assert wire.decode(sock.recv()).kind == "ProtocolVersionError"  # type: ignore[union-attr]
        assert gen.outcomes([5])[5].state is SessionState.DONE
        _check_bytes(gen, 5, [1, 2], [7, 9])
    finally:
        sock.close(0)


def test_forged_result_from_unknown_incarnation_is_ignored(ctx: ContextProcess, gen: Gen) -> None:
    gen.tx.start_receive(3, ctx.endpoint, [0], ticket=ticket_for(3))
    deadline = time.monotonic() + 5
    while gen.tx.status(3) is not RequestStatus.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.01)
    sock = local_dealer(gen.tx.endpoint)
    try:
        forged = wire.TransferResult(v=1, request_id=3, ctx_rank=0, ctx_incarnation="not-the-peer", status="ok")
        sock.send(wire.encode(forged))
        time.sleep(0.3)
        assert gen.tx.poll().outcomes == []  # nothing settled by a stranger
        ctx.send(3, [5])
        assert gen.outcomes([3])[3].state is SessionState.DONE
        _check_bytes(gen, 3, [5], [0])
    finally:
        sock.close(0)


def test_cancel_before_context_sends(ctx: ContextProcess, gen: Gen) -> None:
    gen.tx.start_receive(8, ctx.endpoint, [3], ticket=ticket_for(8))
    time.sleep(0.2)
    assert gen.tx.cancel(8)
    out = gen.outcomes([8])[8]  # released: the context rank confirmed it will not write
    assert out.state is SessionState.CANCELLED
    ctx.send(8, [4])  # the engine starts it late: the tombstone cancels it at once
    assert ctx.wait_released(8)["state"] == "CANCELLED"
    assert not gen.flat[3].any()


def test_context_never_sends_times_out_and_releases(ctx: ContextProcess) -> None:
    g = Gen(timeout=1.0)
    try:
        g.tx.start_receive(4, ctx.endpoint, [2], ticket=ticket_for(4))
        out = g.outcomes([4], 10.0)[4]
        assert out.state is SessionState.TIMED_OUT
        assert isinstance(out.error, E.TransferTimeoutError)
        assert g.tx.stats()["rx_sessions"] == 0
    finally:
        g.close()


def test_dead_context_gives_peer_lost_and_fenced_release(gen: Gen) -> None:
    c = ContextProcess()
    try:
        gen.tx.start_receive(6, c.endpoint, [1], ticket=ticket_for(6))
        deadline = time.monotonic() + 5
        while gen.tx.status(6) is not RequestStatus.TRANSFERRING and time.monotonic() < deadline:
            time.sleep(0.01)
        c.kill()
        out = gen.outcomes([6], 15.0)[6]
        assert out.state is SessionState.FAILED
        assert isinstance(out.error, E.PeerLostError)
    finally:
        c.close()


def test_request_ids_are_64_bit_and_validated(ctx: ContextProcess, gen: Gen) -> None:
    rid = 2**64 - 1
    ctx.send(rid, [9])
    gen.tx.start_receive(rid, ctx.endpoint, [9], ticket=ticket_for(rid))
    assert gen.outcomes([rid])[rid].state is SessionState.DONE
    with pytest.raises(E.SessionError, match="2\\*\\*64"):
        gen.tx.start_receive(-1, ctx.endpoint, [0], ticket=ticket_for(-1))
    with pytest.raises(E.LayoutError, match="block ids"):
        gen.tx.start_receive(1, ctx.endpoint, [64], ticket=ticket_for(1))
    with pytest.raises(E.ProtocolError, match="tcp://host:port"):
        gen.tx.start_receive(1, "tcp://1.2.3.4;evil:1", [0], ticket=ticket_for(1))
    with pytest.raises(E.SessionError, match="generation transceiver"):
        gen.tx.start_send(1, [0], ticket=ticket_for(1))


def test_stopped_writer_keeps_pages_quarantined_until_it_is_dead() -> None:
    """A writer that is alive but frozen may still write: the timed-out request is not released until it dies."""
    import os
    import signal

    c = ContextProcess()
    g = Gen(timeout=1.0)
    try:
        g.tx.start_receive(11, c.endpoint, [4], ticket=ticket_for(11))
        deadline = time.monotonic() + 5
        while g.tx.status(11) is not RequestStatus.TRANSFERRING and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the RequestData reached the context rank
        stop_process(c.pid)
        outcome = None
        t_end = time.monotonic() + 4.0
        released: list[int] = []
        while time.monotonic() < t_end:
            r = g.tx.poll()
            outcome = outcome or next((o for o in r.outcomes if o.request_id == 11), None)
            released += r.released
            time.sleep(0.01)
        assert outcome is not None and outcome.state is SessionState.TIMED_OUT
        assert 11 not in released, "pages were handed back while a live writer could still write"
        assert g.tx.stats()["quarantined"] == 1
        c.kill()  # now it can write nothing: fenced, released
        t_end = time.monotonic() + 15.0
        while 11 not in released and time.monotonic() < t_end:
            released += g.tx.poll().released
            time.sleep(0.01)
        assert 11 in released
        assert g.tx.stats()["quarantined"] == 0 and g.tx.stats()["rx_sessions"] == 0
    finally:
        try:
            os.kill(c.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        c.close()
        g.close()


def test_dead_receiver_fails_the_send_and_releases() -> None:
    """The generation process dies after asking; the context side ends FAILED/PEER_LOST, nothing leaks."""
    from _instances import GenerationProcess

    gp = GenerationProcess()
    agent, _, tx = make_rank("context", "ctx-test", timeout=10)
    try:
        gp.receive(21, tx.info_endpoint, [1, 2])
        deadline = time.monotonic() + 10
        while (
            not tx.stats()["early_requests"] and time.monotonic() < deadline
        ):  # its RequestData arrived before start_send
            time.sleep(0.01)
        gp.kill()
        time.sleep(0.3)
        tx.start_send(21, [5, 6], ticket=ticket_for(21))
        out = tx.wait_all([21], 15.0)[21]
        assert out.state in (SessionState.FAILED, SessionState.TIMED_OUT)
        assert isinstance(out.error, (E.PeerLostError, E.TransferError, E.TransferTimeoutError))
        st = tx.stats()
        assert st["tx_sessions"] == 0 and st["agent_transfers"] == 0
    finally:
        gp.close()
        tx.close()
        agent.close()


def test_layer_wise_sending_writes_each_slice_as_it_becomes_ready(ctx: ContextProcess) -> None:
    """start_send(layers_ready=L) then layers_ready(): finished layers land before the rest exist; DONE at the end."""
    agent, cache, tx = make_rank("context", "ctx-layerwise", timeout=20)
    geo = tx.geometry
    g = Gen()
    try:
        src, dst = [3, 8], [10, 20]
        cache.zero_()
        cache[src, :2] = torch.randn(2, 2, *cache.shape[2:]).to(cache.dtype)  # layers 0-1 computed
        tx.start_send(31, src, layers_ready=2, ticket=ticket_for(31))
        g.tx.start_receive(31, tx.info_endpoint, dst, ticket=ticket_for(31))
        deadline = time.monotonic() + 10
        while not torch.equal(g.cache[dst, :2], cache[src, :2]) and time.monotonic() < deadline:
            g.tx.poll()
            time.sleep(0.01)
        assert torch.equal(g.cache[dst, :2], cache[src, :2]), "the ready layers were not written early"
        assert not g.cache[dst, 2:].any(), "layers that were not ready must not have moved"
        assert all(o.request_id != 31 for o in g.tx.poll().outcomes)  # not DONE while layers are missing
        cache[src, 2:] = torch.randn(2, geo.num_layers - 2, *cache.shape[2:]).to(cache.dtype)
        tx.layers_ready(31, geo.num_layers)
        assert g.outcomes([31])[31].state is SessionState.DONE
        assert torch.equal(g.cache[dst], cache[src])
        assert tx.wait_all([31], 10)[31].state is SessionState.DONE
        assert tx.stats()["tx_sessions"] == 0
    finally:
        g.close()
        tx.close()
        agent.close()


def test_soak_many_requests_with_cancels_each_ends_once_and_nothing_leaks(gen: Gen) -> None:
    """1000 requests (up to 64 in flight), ~10 % cancelled at random moments: one outcome and one release each."""
    # A shortish bound, so that cancel tombstones of finished requests expire within the test; long enough
    # that no request times out on a loaded 2-core machine.
    ctx = ContextProcess(timeout=10.0)
    try:
        _soak(ctx, gen)
    finally:
        ctx.close()


def _soak(ctx: ContextProcess, gen: Gen) -> None:
    rng = np.random.default_rng(7)
    total, window = 1000, 64
    outcomes: dict[int, SessionState] = {}
    released: list[int] = []
    slots = {}  # request -> its generation block, reused only after release
    free = list(range(64))
    started = 0
    cancel_at = set(rng.choice(total, total // 10, replace=False).tolist())
    deadline = time.monotonic() + 120
    while len(released) < total:
        assert time.monotonic() < deadline, f"stuck: {len(released)} of {total} released"
        while started < total and started - len(released) < window and free:
            r = started
            slots[r] = free.pop()
            src = int(rng.integers(0, 64))
            if r % 3 == 0:  # receivers first for a third of them
                gen.tx.start_receive(r, ctx.endpoint, [slots[r]], ticket=ticket_for(r))
                ctx.send(r, [src])
            else:
                ctx.send(r, [src])
                gen.tx.start_receive(r, ctx.endpoint, [slots[r]], ticket=ticket_for(r))
            if r in cancel_at:
                gen.tx.cancel(r)
            started += 1
        res = gen.tx.poll()
        for o in res.outcomes:
            assert o.request_id not in outcomes, f"request {o.request_id} reported twice"
            outcomes[o.request_id] = o.state
        for rid in res.released:
            assert rid in outcomes, "released before its outcome was reported"
            assert rid not in released, f"request {rid} released twice"
            released.append(rid)
            free.append(slots.pop(rid))
        time.sleep(0.0005)
    states = list(outcomes.values())
    assert len(outcomes) == total
    assert states.count(SessionState.DONE) >= total - len(cancel_at)  # a cancel may lose the race to DONE
    assert set(states) <= {SessionState.DONE, SessionState.CANCELLED}
    assert gen.tx.leaks() == {}
    deadline = time.monotonic() + 40
    while True:  # the context side settles cancelled requests on its own timer
        st = ctx.stats()
        if not leaks(st) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert leaks(st) == {}
