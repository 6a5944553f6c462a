"""The native lane behind real transceivers (``config.native_lane``): which requests take it, which take the
Python path, and that each ends as on the Python path. The evidence of the path taken is the lanes' own counts
(``lane_*`` in ``stats()``: requests, writes) on both sides, not only the bytes. Both ranks run in processes of
their own (this one never loads UCX: the UCX of these wheels may crash a process at exit here)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from _instances import ContextProcess, GenerationProcess, fill_value

from kvcore.transceiver import leaks

pytest.importorskip("kvcore_native.lane", reason="kvcore-native (plugins/native) is not installed")
from kvcore_native.posters import missing_library

LANE = {"native_lane": True}


BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(bool(missing_library(b)), reason=missing_library(b)))
    for b in ("ucx", "nixl")
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


BLOCK_BYTES = 4 * 4 * 32 * 8 * 2 * 2  # the instances' geometry: layers, heads, head dim, tokens, K and V, bf16


@pytest.fixture
def pair(backend: str) -> Iterator[tuple[ContextProcess, GenerationProcess]]:
    ctx = ContextProcess(backend, config=LANE)
    try:
        gen = GenerationProcess(backend, config=LANE)
    except BaseException:
        ctx.close()
        raise
    try:
        yield ctx, gen
    finally:
        gen.close()
        ctx.close()


def _check_bytes(gen: GenerationProcess, rid: int, src: list[int], dst: list[int]) -> None:
    got = np.frombuffer(gen.read(dst), np.uint8).reshape(len(dst), -1)
    assert np.array_equal(got, fill_value(rid, src, BLOCK_BYTES)), f"request {rid}: the bytes differ from the context's"


def _zero(gen: GenerationProcess, blocks: list[int]) -> bool:
    return not any(gen.read(blocks))


def _lane(stats: dict[str, int]) -> tuple[int, int]:
    return stats.get("lane_requests_total", 0), stats.get("lane_writes_total", 0)


def test_common_requests_take_the_lane_and_end_as_on_the_python_path(
    pair: tuple[ContextProcess, GenerationProcess],
) -> None:
    ctx, gen = pair
    assert _lane(gen.stats()) == (0, 0)
    rng = np.random.default_rng(3)
    src, dst = rng.permutation(64).tolist(), rng.permutation(64).tolist()
    rids = list(range(8))
    for r in rids:  # the context first for half of them, the generation first for the others: both join
        s, d = src[r * 4 : r * 4 + 4], dst[r * 4 : r * 4 + 4]
        if r % 2:
            ctx.send(r, s)
            gen.receive(r, ctx.endpoint, d)
        else:
            gen.receive(r, ctx.endpoint, d)
            time.sleep(0.02)
            ctx.send(r, s)
    for r in rids:
        assert gen.wait_released(r) | {"aux": b""} == {"outcome": r, "state": "DONE", "error": None, "aux": b""}
        _check_bytes(gen, r, src[r * 4 : r * 4 + 4], dst[r * 4 : r * 4 + 4])
        assert ctx.wait_released(r)["state"] == "DONE"
    assert _lane(gen.stats())[0] == 8  # eight answers came on the lane
    assert _lane(ctx.stats()) == (8, 8)  # eight requests served and written by the context's lane
    assert leaks(gen.stats()) == {} and leaks(ctx.stats()) == {}


def test_requests_the_lane_cannot_take_go_the_python_path(pair: tuple[ContextProcess, GenerationProcess]) -> None:
    ctx, gen = pair
    # An aux payload travels with TransferResult only: the context declines the lane, the receiver asks again.
    ctx.start_send(1, [1, 2], aux=b"first token")
    gen.receive(1, ctx.endpoint, [10, 11])
    # A cached prefix: the two block lists do not pair block by block, so the receiver asks on the Python path.
    ctx.send(2, [3, 4])
    gen.receive(2, ctx.endpoint, [13], cached_tokens=8, prompt_len=16)  # 8 tokens per block
    assert gen.wait_released(1) == {"outcome": 1, "state": "DONE", "error": None, "aux": b"first token"}
    assert gen.wait_released(2)["state"] == "DONE"
    _check_bytes(gen, 1, [1, 2], [10, 11])
    got = np.frombuffer(gen.read([13]), np.uint8)
    assert np.array_equal(got, fill_value(2, [3, 4], BLOCK_BYTES)[1]), "the uncached block is not the second one"
    gen_requests, _ = _lane(gen.stats())
    # 1 was asked on the lane and declined there (nothing written); 2 never took it.
    assert (gen_requests, *_lane(ctx.stats())) == (1, 1, 0)
    for r in (1, 2):
        assert ctx.wait_released(r)["state"] == "DONE"
    assert leaks(gen.stats()) == {} and leaks(ctx.stats()) == {}


def test_a_wrong_ticket_is_refused_at_once_and_the_offer_stays_for_the_rightful_receiver(
    pair: tuple[ContextProcess, GenerationProcess], backend: str
) -> None:
    """The lane declines a request whose ticket is not its offer's (nothing moves), so it asks on the Python path
    and is refused there as without the lane (TicketError, counted); the rightful receiver is then served on the
    lane. Either order of offer and forged request."""
    ctx, gen = pair
    forger = GenerationProcess(backend, config=LANE)  # another generation rank, registered, with the wrong ticket
    try:
        for rid, forged_first in ((1, False), (2, True)):
            if forged_first:
                forger.receive(rid, ctx.endpoint, [rid + 20], ticket=b"f" * 16)
                time.sleep(0.05)
                ctx.send(rid, [rid])
            else:
                ctx.send(rid, [rid])
                time.sleep(0.05)
                forger.receive(rid, ctx.endpoint, [rid + 20], ticket=b"f" * 16)
            t0 = time.monotonic()
            out = forger.wait_released(rid)
            assert out["state"] == "FAILED" and "TicketError" in str(out["error"]), out
            assert time.monotonic() - t0 < 5, "a wrong ticket was answered only at the request's timeout"
            assert _zero(forger, [rid + 20]), "a request with a wrong ticket wrote"
            gen.receive(rid, ctx.endpoint, [rid + 30])
            out = gen.wait_released(rid)
            assert out["state"] == "DONE", out
            _check_bytes(gen, rid, [rid], [rid + 30])
            assert ctx.wait_released(rid)["state"] == "DONE"
        cs = ctx.stats()
        assert cs["tickets_refused"] == 2
        # The path taken: the context's lane was asked four times and wrote twice (the rightful requests); each
        # forged request was answered there ("declined") and refused on the Python path.
        assert (_lane(cs), _lane(gen.stats()), _lane(forger.stats())) == ((4, 2), (2, 0), (2, 0))
        assert leaks(cs) == {} and leaks(gen.stats()) == {} and leaks(forger.stats()) == {}
    finally:
        forger.close()


def test_a_receiver_without_a_lane_is_served_on_the_python_path(backend: str) -> None:
    ctx = ContextProcess(backend, config=LANE)
    gen = GenerationProcess(backend)
    try:
        ctx.send(5, [5, 6])
        gen.receive(5, ctx.endpoint, [7, 8])
        assert gen.wait_released(5)["state"] == "DONE"
        _check_bytes(gen, 5, [5, 6], [7, 8])
        assert ctx.wait_released(5)["state"] == "DONE"
        stats = ctx.stats()
        assert _lane(stats) == (0, 0) and leaks(stats) == {}  # its offer was taken back: nothing waits
    finally:
        gen.close()
        ctx.close()


def test_cancels_on_either_side_end_lane_requests(pair: tuple[ContextProcess, GenerationProcess]) -> None:
    ctx, gen = pair
    gen.receive(1, ctx.endpoint, [1])  # asked on the lane; never offered
    time.sleep(0.1)
    gen.cancel(1)
    ctx.send(2, [2])  # offered on the lane; the context's engine cancels before anyone asks
    time.sleep(0.1)
    ctx.cancel(2)
    time.sleep(0.1)
    t0 = time.monotonic()
    gen.receive(2, ctx.endpoint, [3])
    assert gen.wait_released(1)["state"] == "CANCELLED"
    assert gen.wait_released(2)["state"] == "CANCELLED"
    assert time.monotonic() - t0 < 10, "the receiver heard of the context's cancel only at its timeout"
    ctx.send(1, [4])  # the context starts a request its receiver cancelled on the lane: it ends at once
    assert ctx.wait_released(1, timeout=10)["state"] == "CANCELLED"
    assert _zero(gen, [1, 3]), "a cancelled request wrote"
    assert ctx.wait_released(2)["state"] == "CANCELLED"
    deadline = time.monotonic() + 10
    while (leaks(ctx.stats()) or leaks(gen.stats())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leaks(gen.stats()) == {} and leaks(ctx.stats()) == {}


def test_a_context_that_dies_leaves_nothing_waiting_on_the_receivers_lane(backend: str) -> None:
    cfg = {**LANE, "peer_lost_timeout_s": 1.0, "fencing_grace_s": 3.0, "transfer_timeout_s": 2.0}
    ctx = ContextProcess(backend, config=cfg, timeout=8.0)
    gen = GenerationProcess(backend, config=cfg, timeout=8.0)
    try:
        ctx.send(1, [1])
        gen.receive(1, ctx.endpoint, [2])
        assert gen.wait_released(1)["state"] == "DONE"
        assert gen.stats()["lane_connections"] == 1
        for r in range(2, 6):  # asked on the lane, never offered: the context dies with them pending
            gen.receive(r, ctx.endpoint, [r + 10])
        time.sleep(0.2)
        ctx.kill()
        for r in range(2, 6):
            assert gen.wait_released(r, timeout=30)["state"] == "FAILED"
        # The lane stops waiting for answers the receiver no longer needs (not after its late-answer grace).
        stats = gen.stats()
        assert (stats["lane_pending"], stats["lane_asks"]) == (0, 0) and leaks(stats) == {}
        # Its lane connection goes with the instance, once unloaded (a gone context's lane is asked no more).
        deadline = time.monotonic() + 15
        while gen.stats()["lane_connections"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gen.stats()["lane_connections"] == 0
    finally:
        gen.close()
        ctx.close()
