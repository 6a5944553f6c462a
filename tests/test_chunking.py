"""Adaptive chunks: a transport that copies inside ``submit`` gets a large plan in pieces sized by its copy rate
while the rank is quiet (``QUIET_PIECE_S`` of copy each; 16 MiB until the rate is known), and in 4 MiB pieces
while other requests arrive beside it, so that they wait behind a shorter copy.

Real transceivers over real ZeroMQ; the context's agent is the shm agent made to move every byte inside
``submit`` and to take 2 ms per MiB (``_faults.InlineShmAgent``), as NIXL or UCX over CMA on a small box.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from _faults import RankGroup, fault_plugin_manager
from _instances import fill_value, ticket_for

from kvcore.transceiver import SessionState
from kvcore.transceiver import dataplane as link_module
from kvcore.transceiver.link import CHUNK_BYTES, FINE_CHUNK_BYTES, MAX_QUIET_CHUNKS, QUIET_PIECE_S

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
# One block of every layer is one contiguous 4 MiB slot (head-major pool): 4 layers x K,V x 8 heads x 256 x 128 x 2.
GEOMETRY = dict(num_layers=4, num_kv_heads=8, head_dim=128, tokens_per_block=256, dtype="bfloat16")
BLOCK = 4 * MiB


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def _pieces(agent: object, base: int, blocks: set[int], since: int) -> list[int]:
    """Sizes of the submits since ``since`` whose first local byte is in one of ``blocks``."""
    out = []
    for nbytes, addr in agent.submitted[since:]:  # type: ignore[attr-defined]
        if (addr - base) // BLOCK in blocks:
            out.append(nbytes)
    return out


BIG_SRC = list(range(1, 33, 2))  # 16 blocks = 64 MiB, none adjacent
BIG_DST = list(range(30, -1, -2))


def _pair(seconds_per_mib: float, backend: str = "inline-shm") -> tuple[RankGroup, RankGroup]:
    """A context rank on the inline-copy agent at ``seconds_per_mib`` and a generation rank, 4 MiB blocks."""
    pm = fault_plugin_manager()
    ctx = RankGroup.build(
        "context", backend=backend, pm=pm, num_blocks=40, geometry=GEOMETRY,
        agent_options=[{"seconds_per_mib": seconds_per_mib}],
    )  # fmt: skip
    try:
        gen = RankGroup.build("generation", pm=pm, num_blocks=40, geometry=GEOMETRY, timeout=60.0)
    except BaseException:
        ctx.close()
        raise
    return ctx, gen


def _move_alone(ctx: RankGroup, gen: RankGroup, rid: int) -> tuple[list[int], list[float]]:
    """Move the 64 MiB request ``rid`` with nothing beside it; check its bytes; its pieces and their copy times."""
    c, g, agent = ctx.txs[0], gen.txs[0], ctx.agents[0]
    src, dst = _flat(ctx.caches[0]), _flat(gen.caches[0])
    want = fill_value(rid, BIG_SRC, BLOCK)
    src[BIG_SRC] = torch.from_numpy(want)
    start = len(agent.submitted)
    c.start_send(rid, BIG_SRC, ticket=ticket_for(rid))
    g.start_receive(rid, ctx.info_endpoint, BIG_DST, ticket=ticket_for(rid))
    assert g.wait_all([rid], 60)[rid].state is SessionState.DONE
    assert c.wait_all([rid], 60)[rid].state is SessionState.DONE
    assert np.array_equal(dst[BIG_DST].numpy(), want), f"request {rid}: wrong bytes"
    dst.zero_()
    return _pieces(agent, src.data_ptr(), set(BIG_SRC), start), agent.seconds[start:]


def test_a_lone_large_request_goes_in_coarse_chunks_and_one_beside_it_makes_them_fine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert BLOCK == FINE_CHUNK_BYTES and CHUNK_BYTES == 4 * FINE_CHUNK_BYTES
    # At 2 ms per MiB (at most 0.5 GB/s) a quiet piece of 64 ms is 3 to 7 fine chunks: coarse, yet the request
    # beside the large one arrives while one is still copying.
    monkeypatch.setattr(link_module, "QUIET_PIECE_S", 0.064)
    ctx, gen = _pair(0.002)
    try:
        c, g = ctx.txs[0], gen.txs[0]
        agent = ctx.agents[0]
        src, dst = _flat(ctx.caches[0]), _flat(gen.caches[0])
        assert src.shape[1] == BLOCK
        base = src.data_ptr()
        big_src, big_dst = BIG_SRC, BIG_DST

        # 1. Alone: 16 MiB first (no rate known yet), then pieces of several fine chunks.
        pieces, _ = _move_alone(ctx, gen, 1)
        assert pieces[0] == CHUNK_BYTES and sum(pieces) == 16 * BLOCK
        # (the first piece to a new peer also maps its memory: its rate, and so the next piece, may come out small)
        assert max(pieces[1:]) >= 2 * FINE_CHUNK_BYTES, f"quiet pieces were not coarse: {pieces}"

        # 2. The same request again, and a one-block request started while its first piece copies.
        want = fill_value(1, big_src, BLOCK)  # the same source blocks as request 1
        start = len(agent.submitted)
        c.start_send(2, big_src, ticket=ticket_for(2))
        g.start_receive(2, ctx.info_endpoint, big_dst, ticket=ticket_for(2))
        deadline = time.monotonic() + 30
        while len(agent.submitted) == start:  # the first piece is copying (32 ms at 2 ms per MiB)
            assert time.monotonic() < deadline, "the large request never started"
            time.sleep(0.0005)
        small_want = fill_value(3, [35], BLOCK)
        src[[35]] = torch.from_numpy(small_want)
        c.start_send(3, [35], ticket=ticket_for(3))
        g.start_receive(3, ctx.info_endpoint, [36], ticket=ticket_for(3))
        reported: list[int] = []
        deadline = time.monotonic() + 60
        while len(reported) < 2:
            assert time.monotonic() < deadline, f"only {reported} reported"
            g.wait(1.0)
            reported += [o.request_id for o in g.poll().done]
        assert reported == [3, 2], "the one-block request waited for the whole large one"
        assert c.wait_all([2, 3], 60)[2].state is SessionState.DONE
        pieces = _pieces(agent, base, set(big_src), start)
        assert sum(pieces) == 16 * BLOCK
        assert pieces[0] >= 2 * FINE_CHUNK_BYTES, f"started while the rank was quiet, yet fine: {pieces}"
        assert FINE_CHUNK_BYTES in pieces[1:], f"no fine piece after the request beside it arrived: {pieces}"
        assert np.array_equal(dst[big_dst].numpy(), want), "request 2: wrong bytes"
        assert np.array_equal(dst[[36]].numpy(), small_want), "request 3: wrong bytes"
        assert c.leaks() == {} and g.leaks() == {}
    finally:
        gen.close()
        ctx.close()


def test_a_lone_request_gets_its_next_chunk_at_once_while_nothing_else_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks that end inside ``submit`` follow each other without a trip round the I/O loop while it is quiet
    (``chunks_back_to_back``), and a message that arrives meanwhile still gets the loop back (test above)."""
    monkeypatch.setattr(link_module, "QUIET_PIECE_S", 0.0)  # every piece after the first is one fine chunk
    ctx, gen = _pair(0.0001)
    try:
        pieces, _ = _move_alone(ctx, gen, 4)
        assert pieces == [CHUNK_BYTES] + [BLOCK] * 12
        back_to_back = ctx.txs[0]._link.counters["chunks_back_to_back"]
        assert 1 <= back_to_back <= 11, f"{back_to_back} of the 12 later chunks followed their predecessor at once"
        assert ctx.txs[0].leaks() == {} and gen.txs[0].leaks() == {}
    finally:
        gen.close()
        ctx.close()


@pytest.mark.parametrize(
    ("seconds_per_mib", "backend"), [(0.002, "inline-shm"), (0.0005, "inline-shm"), (0.002, "pollcopy-shm")]
)
def test_quiet_pieces_last_about_quiet_piece_s_at_the_measured_copy_rate(seconds_per_mib: float, backend: str) -> None:
    """Each quiet piece after the first holds as many fine chunks as the agent copied in ``QUIET_PIECE_S`` at
    the rate of the piece before it (one at least, ``MAX_QUIET_CHUNKS`` at most): a slower copy, smaller pieces.
    The rate counts the time to the piece's first poll: an agent that copies while it is polled (``pollcopy``,
    as UCX progresses) returns from ``submit`` at once, and its pieces must not grow for that."""
    ctx, gen = _pair(seconds_per_mib, backend)
    try:
        pieces, seconds = _move_alone(ctx, gen, 5)
        assert pieces[0] == CHUNK_BYTES and sum(pieces) == 16 * BLOCK
        left = 16 * BLOCK - CHUNK_BYTES
        for i in range(1, len(pieces)):
            rate = pieces[i - 1] / seconds[i - 1]  # the agent's own copy time: the link's is a little longer
            rule = max(1, min(MAX_QUIET_CHUNKS, int(rate * QUIET_PIECE_S) // FINE_CHUNK_BYTES))
            chunks, room = pieces[i] // FINE_CHUNK_BYTES, left // FINE_CHUNK_BYTES
            assert chunks in (min(rule, room), min(max(1, rule - 1), room)), (
                f"piece {i}: {chunks} fine chunks, the rule at {rate / 1e9:.2f} GB/s gives {rule} ({pieces})"
            )
            left -= pieces[i]
        if seconds_per_mib == 0.002:  # at most 0.5 GB/s: 8 ms of copy is less than one fine chunk
            assert pieces[1:] == [FINE_CHUNK_BYTES] * 12
        assert ctx.txs[0].leaks() == {} and gen.txs[0].leaks() == {}
    finally:
        gen.close()
        ctx.close()
