"""The native lane behind real transceivers (``config.native_lane``): which requests take it, which take the
Python path, and that each ends as on the Python path. The evidence of the path taken is the lanes' own counts
(``lane_*`` in ``stats()``: requests, writes) on both sides, not only the bytes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _instances import ContextProcess, fill_value, make_rank, ticket_for

from kvcore.transceiver import SessionState, leaks

pytest.importorskip("kvcore_native.lane", reason="kvcore-native (plugins/native) is not installed")
from kvcore_native.errors import NativeTransportError
from kvcore_native.posters import create_poster

LANE = {"native_lane": True}


def _available(backend: str) -> bool:
    try:
        create_poster(backend, f"probe-{backend}").close()
    except (NativeTransportError, ImportError):
        return False
    return True


BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(not _available(b), reason=f"no {b} poster")) for b in ("ucx", "nixl")
]


class Gen:
    """An in-process one-rank generation instance."""

    def __init__(self, backend: str, config: dict[str, Any], num_blocks: int = 64) -> None:
        self.agent, self.cache, self.tx = make_rank("generation", "gen-lane", backend, num_blocks, 20.0, config=config)
        self.flat = self.cache.view(num_blocks, -1).view(torch.uint8)

    def close(self) -> None:
        self.tx.close()
        self.agent.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(backend: str) -> Iterator[tuple[ContextProcess, Gen]]:
    ctx = ContextProcess(backend, config=LANE)
    try:
        gen = Gen(backend, LANE)
    except BaseException:
        ctx.close()
        raise
    try:
        yield ctx, gen
    finally:
        gen.close()
        ctx.close()


def _check_bytes(gen: Gen, rid: int, src: list[int], dst: list[int]) -> None:
    want = fill_value(rid, src, gen.flat.shape[1])
    assert np.array_equal(gen.flat[dst].numpy(), want), f"request {rid}: the bytes differ from the context's"


def _lane(stats: dict[str, int]) -> tuple[int, int]:
    return stats.get("lane_requests_total", 0), stats.get("lane_writes_total", 0)


def test_common_requests_take_the_lane_and_end_as_on_the_python_path(pair: tuple[ContextProcess, Gen]) -> None:
    ctx, gen = pair
    assert _lane(gen.tx.stats()) == (0, 0)
    rng = np.random.default_rng(3)
    src, dst = rng.permutation(64).tolist(), rng.permutation(64).tolist()
    rids = list(range(8))
    for r in rids:  # the context first for half of them, the generation first for the others: both join
        s, d = src[r * 4 : r * 4 + 4], dst[r * 4 : r * 4 + 4]
        if r % 2:
            ctx.send(r, s)
            gen.tx.start_receive(r, ctx.endpoint, d, ticket=ticket_for(r))
        else:
            gen.tx.start_receive(r, ctx.endpoint, d, ticket=ticket_for(r))
            time.sleep(0.02)
            ctx.send(r, s)
    out = gen.tx.wait_all(rids, 20)
    assert {o.state for o in out.values()} == {SessionState.DONE}
    assert {o.nbytes for o in out.values()} == {4 * gen.flat.shape[1]}
    for r in rids:
        _check_bytes(gen, r, src[r * 4 : r * 4 + 4], dst[r * 4 : r * 4 + 4])
        assert ctx.wait_released(r)["state"] == "DONE"
    assert _lane(gen.tx.stats())[0] == 8  # eight answers came on the lane
    assert _lane(ctx.stats()) == (8, 8)  # eight requests served and written by the context's lane
    assert gen.tx.leaks() == {} and leaks(ctx.stats()) == {}


def test_requests_the_lane_cannot_take_go_the_python_path(pair: tuple[ContextProcess, Gen]) -> None:
    ctx, gen = pair
    # An aux payload travels with TransferResult only: the context declines the lane, the receiver asks again.
    ctx.start_send(1, [1, 2], aux=b"first token")
    gen.tx.start_receive(1, ctx.endpoint, [10, 11], ticket=ticket_for(1))
    # A cached prefix: the two block lists do not pair block by block, so the receiver asks on the Python path.
    ctx.send(2, [3, 4])
    tokens = gen.tx.geometry.tokens_per_block
    gen.tx.start_receive(2, ctx.endpoint, [13], ticket=ticket_for(2), cached_tokens=tokens, prompt_len=2 * tokens)
    out = gen.tx.wait_all([1, 2], 20)
    assert out[1].state is SessionState.DONE and out[1].aux == b"first token"
    assert out[2].state is SessionState.DONE
    _check_bytes(gen, 1, [1, 2], [10, 11])
    assert np.array_equal(gen.flat[13].numpy(), fill_value(2, [3, 4], gen.flat.shape[1])[1])
    gen_requests, _ = _lane(gen.tx.stats())
    # 1 was asked on the lane and declined there (nothing written); 2 never took it.
    assert (gen_requests, *_lane(ctx.stats())) == (1, 1, 0)
    for r in (1, 2):
        assert ctx.wait_released(r)["state"] == "DONE"
    assert gen.tx.leaks() == {} and leaks(ctx.stats()) == {}


def test_a_receiver_without_a_lane_is_served_on_the_python_path(backend: str) -> None:
    ctx = ContextProcess(backend, config=LANE)
    gen = Gen(backend, {})
    try:
        ctx.send(5, [5, 6])
        gen.tx.start_receive(5, ctx.endpoint, [7, 8], ticket=ticket_for(5))
        assert gen.tx.wait_all([5], 20)[5].state is SessionState.DONE
        _check_bytes(gen, 5, [5, 6], [7, 8])
        assert ctx.wait_released(5)["state"] == "DONE"
        stats = ctx.stats()
        assert _lane(stats) == (0, 0) and leaks(stats) == {}  # its offer was taken back: nothing waits
    finally:
        gen.close()
        ctx.close()


def test_cancels_on_either_side_end_lane_requests(pair: tuple[ContextProcess, Gen]) -> None:
    ctx, gen = pair
    gen.tx.start_receive(1, ctx.endpoint, [1], ticket=ticket_for(1))  # asked on the lane; never offered
    time.sleep(0.1)
    assert gen.tx.cancel(1)
    ctx.send(2, [2])  # offered on the lane; the context's engine cancels before anyone asks
    time.sleep(0.1)
    ctx.cancel(2)
    gen.tx.start_receive(2, ctx.endpoint, [3], ticket=ticket_for(2))
    out = gen.tx.wait_all([1, 2], 20)
    assert out[1].state is SessionState.CANCELLED
    assert out[2].state in (SessionState.CANCELLED, SessionState.FAILED)
    assert not gen.flat[[1, 3]].any(), "a cancelled request wrote"
    assert ctx.wait_released(2)["state"] == "CANCELLED"
    deadline = time.monotonic() + 10
    while (leaks(ctx.stats()) or gen.tx.leaks()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gen.tx.leaks() == {} and leaks(ctx.stats()) == {}
