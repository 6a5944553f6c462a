"""kvcore-native's lane: requests joined to offers across two real processes, on real posters (UCX and NIXL),
every byte checked by the side that received it; hostile frames, refusals, caps, cancels and close."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from kvcore_native.errors import NativeLaneError
from kvcore_native.lane import Lane, LaneCompletion
from kvcore_native.posters import create_poster, missing_library

SPAWN = multiprocessing.get_context("spawn")
BLOCK = 16 * 1024
BLOCKS = 64
DIGEST = b"layout-digest-01"
PROOF = b"the-right-proof!"  # what offers want and requests show, unless a test says otherwise


BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(bool(missing_library(b)), reason=missing_library(b)))
    for b in ("ucx", "nixl")
]


def _pattern(block: int, n: int = BLOCK) -> np.ndarray:
    """Source block ``block``'s bytes, computed alike (and independently of the lane) on both sides."""
    j = np.arange(n, dtype=np.uint64)
    return ((j * 13 + block * 101 + 7) % 253 + 1).astype(np.uint8)


def _recv(conn: Connection, timeout_s: float = 60.0) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the context process said nothing within {timeout_s}s")
    return conn.recv()


def _context(conn: Connection, backend: str, caps: dict[str, int]) -> None:
    """The context process: a pool of patterned blocks behind a lane; serves the test's commands."""
    pool = np.concatenate([_pattern(b) for b in range(BLOCKS)])
    poster = create_poster(backend, f"lane-ctx-{os.getpid()}")
    poster.register(pool.ctypes.data, pool.nbytes)
    lane = Lane(poster, curve=caps.pop("curve", 0) == 1, **caps)
    layout = lane.layout([pool.ctypes.data], [BLOCK], [BLOCK], BLOCKS, DIGEST)
    conn.send((lane.endpoint, lane.public_key))
    while True:
        msg = conn.recv()
        op, args = msg[0], msg[1:]
        try:
            if op == "exit":
                break
            if op == "admit":
                out: Any = lane.admit(poster.connect(args[0]))
            elif op == "offer":  # (ticket, blocks[, layout[, proof]])
                proof = args[3] if len(args) > 3 else PROOF
                out = lane.offer(args[0], proof, layout if len(args) < 3 or args[2] is None else args[2], args[1])
            elif op == "layout":
                out = lane.layout(*args)
            elif op == "decline":
                out = lane.decline(*args)
            elif op == "withdraw":
                out = lane.withdraw(args[0])
            elif op == "completions":
                deadline, out = time.monotonic() + args[0], []
                while len(out) < args[1] and time.monotonic() < deadline:
                    lane.wait(0.05)
                    out += [tuple(c) for c in lane.completions()]
            elif op == "stats":
                out = lane.stats()
            else:
                raise ValueError(op)
            conn.send(("ok", out))
        except Exception as exc:  # the test reads the error's type and text
            conn.send(("error", type(exc).__name__, str(exc)))
    lane.close()
    poster.close()


class Pair:
    """A context lane in a child process and a generation lane here, connected and admitted."""

    def __init__(self, backend: str, curve: bool = False, **caps: int) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=_context, args=(child, backend, {**caps, "curve": int(curve)}), daemon=True)
        self.proc.start()
        self.pool = np.zeros(BLOCKS * BLOCK, np.uint8)
        self.poster = create_poster(backend, f"lane-gen-{os.getpid()}")
        self.poster.register(self.pool.ctypes.data, self.pool.nbytes)
        self.lane = Lane(self.poster, curve=curve)
        self.layout = self.lane.layout([self.pool.ctypes.data], [BLOCK], [BLOCK], BLOCKS, DIGEST)
        endpoint, key = _recv(self.conn)
        self.endpoint = endpoint
        self.token = self.ctx("admit", self.poster.descriptor())
        self.c = self.lane.connect(endpoint, key)

    def ctx(self, *msg: Any) -> Any:
        self.conn.send(msg)
        got = _recv(self.conn)
        if got[0] == "error":
            raise NativeLaneError(f"{got[1]}: {got[2]}")
        return got[1]

    def ask(
        self,
        ticket: bytes,
        blocks: list[int],
        timeout_ms: int = 10_000,
        token: bytes | None = None,
        proof: bytes = b"",
    ) -> bytes:
        nonce = os.urandom(16)
        self.lane.request(self.c, token or self.token, ticket, proof or PROOF, nonce, self.layout, blocks, timeout_ms)
        return nonce

    def ended(self, n: int, timeout_s: float = 20.0) -> list[LaneCompletion]:
        out: list[LaneCompletion] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n and time.monotonic() < deadline:
            self.lane.wait(0.05)
            out += self.lane.completions()
        return out

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("exit",))
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.lane.close()
        self.poster.close()


@pytest.fixture(params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    try:
        yield p
    finally:
        p.close()


def _ticket(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _check(pool: np.ndarray, src: list[int], dst: list[int]) -> None:
    for a, b in zip(src, dst):
        got = pool[b * BLOCK : (b + 1) * BLOCK]
        assert np.array_equal(got, _pattern(a)), f"destination block {b} does not hold source block {a}"


def test_requests_join_offers_in_either_order_and_every_byte_lands(pair: Pair) -> None:
    rng = np.random.default_rng(1)
    src, dst = rng.permutation(BLOCKS).tolist(), rng.permutation(BLOCKS).tolist()
    nonces = {}
    for i in range(8):  # offer first for even requests, ask first for odd ones: both orders join
        s, d = src[i * 4 : i * 4 + 4], dst[i * 4 : i * 4 + 4]
        if i % 2 == 0:
            pair.ctx("offer", _ticket(i), s)
            nonces[pair.ask(_ticket(i), d)] = i
        else:
            nonces[pair.ask(_ticket(i), d)] = i
            time.sleep(0.01)  # the request waits in the context's lane for its offer
            pair.ctx("offer", _ticket(i), s)
    gen = pair.ended(8)
    assert sorted(nonces[c.nonce] for c in gen) == list(range(8))
    assert {(c.side, c.status, c.error) for c in gen} == {("generation", "ok", "")}
    assert all(c.ticket == _ticket(nonces[c.nonce]) and c.peer == pair.c for c in gen)
    ctx = [LaneCompletion(*c) for c in pair.ctx("completions", 10.0, 8)]
    assert sorted(c.ticket for c in ctx) == [_ticket(i) for i in range(8)]
    assert {(c.side, c.status) for c in ctx} == {("context", "ok")}
    assert {c.nonce for c in ctx} == set(nonces)  # the context saw the nonce each request came with
    _check(pair.pool, src[:32], dst[:32])
    untouched = np.setdiff1d(np.arange(BLOCKS), dst[:32])
    assert not pair.pool.reshape(BLOCKS, BLOCK)[untouched].any(), "bytes landed outside the requests' blocks"
    st = pair.ctx("stats")  # the evidence that the lane did the work: its own counts, on both sides
    assert (st["posts"], st["results_sent"], st["ok"], st["jobs_waiting"], st["writes_in_flight"]) == (8, 8, 8, 0, 0)
    mine = pair.lane.stats()
    assert (mine["results_received"], mine["ok"], mine["pending"], mine["rejected_frames"]) == (8, 8, 0, 0)


def test_a_request_with_another_proof_is_declined_and_the_offer_waits_for_the_right_one(pair: Pair) -> None:
    """A request whose proof is not its offer's moves nothing and is declined (its slower path refuses it), in
    either order; the offer stays for the rightful request. Two requests before the offer: the second is declined
    at once, so a first comer cannot lock the rightful one out."""
    forged = b"a-forged-proof!!"
    pair.ctx("offer", _ticket(1), [1])
    bad = pair.ask(_ticket(1), [11], proof=forged)  # the offer came first
    got = pair.ended(1)
    assert [(c.nonce, c.status) for c in got] == [(bad, "declined")] and "proof" in got[0].error, got
    good = pair.ask(_ticket(1), [12])
    assert [(c.nonce, c.status) for c in pair.ended(1)] == [(good, "ok")]
    _check(pair.pool, [1], [12])

    early = pair.ask(_ticket(2), [21], proof=forged)  # the requests first: the forged one waits for the offer
    time.sleep(0.05)
    second = pair.ask(_ticket(2), [22])  # the rightful one: declined at once (it asks on its slower path)
    got = pair.ended(1)
    assert [(c.nonce, c.status) for c in got] == [(second, "declined")] and "waits on the lane" in got[0].error
    pair.ctx("offer", _ticket(2), [2])  # the offer declines the forged request and stays
    got = pair.ended(1)
    assert [(c.nonce, c.status) for c in got] == [(early, "declined")] and "proof" in got[0].error, got
    assert pair.ctx("stats")["jobs_waiting"] == 1
    late = pair.ask(_ticket(2), [23])
    assert [(c.nonce, c.status) for c in pair.ended(1)] == [(late, "ok")]
    _check(pair.pool, [2], [23])

    assert not pair.pool[11 * BLOCK : 12 * BLOCK].any() and not pair.pool[21 * BLOCK : 23 * BLOCK].any()
    ctx = [LaneCompletion(*c) for c in pair.ctx("completions", 0.5, 3)]  # only the two writes end there
    assert sorted((c.ticket, c.status) for c in ctx) == [(_ticket(1), "ok"), (_ticket(2), "ok")]
    st = pair.ctx("stats")
    assert (st["proof_declines"], st["jobs_waiting"], st["job_bytes"], st["posts"]) == (2, 0, 0, 2)


def test_a_disconnected_lane_still_answers_what_was_pending_then_closes(pair: Pair) -> None:
    assert pair.lane.stats()["connections"] == 1
    n1 = pair.ask(_ticket(1), [7])  # pending: its offer is not there yet
    assert pair.lane.disconnect(pair.c) is True
    assert pair.lane.disconnect(pair.c) is False  # closing already
    with pytest.raises(NativeLaneError, match="unknown connection"):
        pair.ask(_ticket(2), [8])
    time.sleep(0.1)
    assert pair.lane.stats()["connections"] == 1  # kept while an answer is owed there
    pair.ctx("offer", _ticket(1), [1])
    assert [(c.nonce, c.status) for c in pair.ended(1)] == [(n1, "ok")]
    _check(pair.pool, [1], [7])
    deadline = time.monotonic() + 5
    while pair.lane.stats()["connections"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pair.lane.stats()["connections"] == 0, "the socket was not closed once nothing was pending"
    pair.c = pair.lane.connect(pair.endpoint, None)  # a new connection (a slot may be reused) works
    n3 = pair.ask(_ticket(3), [9])
    pair.ctx("offer", _ticket(3), [3])
    assert [(c.nonce, c.status) for c in pair.ended(1)] == [(n3, "ok")]
    _check(pair.pool, [3], [9])
    assert not pair.pool[8 * BLOCK : 9 * BLOCK].any(), "a request refused at the call wrote"


def test_decline_withdraw_cancel_and_timeouts_each_end_as_said(pair: Pair) -> None:
    pair.ctx("decline", _ticket(1), "it carries an aux payload")
    n1 = pair.ask(_ticket(1), [0])
    n2 = pair.ask(_ticket(2), [1])  # never offered: waits, then withdrawn by the context after an offer
    time.sleep(0.05)
    pair.ctx("offer", _ticket(3), [3])  # offered, then withdrawn before anyone asked
    assert pair.ctx("withdraw", _ticket(3)) is True
    n4 = pair.ask(_ticket(4), [4], timeout_ms=300)  # nobody offers it: the context answers once its time passed
    n5 = pair.ask(_ticket(5), [5])
    time.sleep(0.05)
    assert pair.lane.cancel(n5) is True  # the receiver drops it before any offer: cancelled on both sides
    got = {c.nonce: c for c in pair.ended(3, 10.0)}
    assert got[n1].status == "declined" and got[n1].error == "it carries an aux payload"
    assert got[n4].status == "failed" and "no offer" in got[n4].error
    assert got[n5].status == "cancelled"
    assert pair.ctx("offer", _ticket(5), [5]) is False  # its receiver cancelled it here first: nothing is offered
    assert n2 not in got, got[n2]
    pair.ctx("offer", _ticket(2), [2])
    assert [c.status for c in pair.ended(1)] == ["ok"]
    _check(pair.pool, [2], [1])
    assert not pair.pool[:BLOCK].any() and not pair.pool[4 * BLOCK : 6 * BLOCK].any(), "a refused request wrote"
    # The context hears of what it offered only: 2 written (1, 4 and 5 were never offered there).
    ctx = [LaneCompletion(*c) for c in pair.ctx("completions", 0.5, 2)]
    assert [(c.ticket, c.status) for c in ctx] == [(_ticket(2), "ok")]
    st = pair.ctx("stats")
    assert (st["jobs_waiting"], st["writes_in_flight"], st["posts"]) == (0, 0, 1)


def test_requests_that_disagree_with_their_offer_fail_and_write_nothing(pair: Pair) -> None:
    other = pair.ctx("layout", [0], [BLOCK], [BLOCK], BLOCKS, b"another-layout-x")  # other source fragments
    pair.ctx("offer", _ticket(1), [1], other)
    n1 = pair.ask(_ticket(1), [1])
    pair.ctx("offer", _ticket(2), [2, 3])
    n2 = pair.ask(_ticket(2), [2])  # one destination block for two source blocks
    got = {c.nonce: c for c in pair.ended(2)}
    assert got[n1].status == "failed" and "another source layout" in got[n1].error
    assert got[n2].status == "failed" and "fragments" in got[n2].error
    assert not pair.pool.any()
    assert pair.ctx("stats")["posts"] == 0


def test_bad_arguments_are_typed_errors(pair: Pair) -> None:
    with pytest.raises(NativeLaneError, match="outside the layout"):
        pair.ask(_ticket(1), [BLOCKS])
    with pytest.raises(NativeLaneError, match="16 bytes"):
        pair.lane.request(pair.c, pair.token, b"short", PROOF, os.urandom(16), pair.layout, [0], 1000)
    with pytest.raises(NativeLaneError, match="negative"):
        pair.ask(_ticket(1), [-1])
    with pytest.raises(NativeLaneError, match="unknown connection"):
        pair.lane.request(99, pair.token, _ticket(1), PROOF, os.urandom(16), pair.layout, [0], 1000)
    with pytest.raises(NativeLaneError, match="unknown layout"):
        pair.lane.request(pair.c, pair.token, _ticket(1), PROOF, os.urandom(16), 42, [0], 1000)
    with pytest.raises(NativeLaneError, match="timeout_ms"):
        pair.lane.request(pair.c, pair.token, _ticket(1), PROOF, os.urandom(16), pair.layout, [0], 0)
    nonce = os.urandom(16)
    pair.lane.request(pair.c, pair.token, _ticket(7), PROOF, nonce, pair.layout, [0], 500)
    with pytest.raises(NativeLaneError, match="nonce is pending"):
        pair.lane.request(pair.c, pair.token, _ticket(8), PROOF, nonce, pair.layout, [1], 500)
    with pytest.raises(NativeLaneError, match="offered or declined already"):
        pair.ctx("offer", _ticket(9), [0])
        pair.ctx("offer", _ticket(9), [1])
    with pytest.raises(NativeLaneError, match="endpoint"):
        pair.lane.connect("ipc:///tmp/x", None)
    assert [c.status for c in pair.ended(1)] == ["failed"]  # ticket 7 was never offered
    assert pair.ctx("withdraw", _ticket(9)) is True


def test_a_stranger_without_a_token_gets_nothing_and_its_frames_are_counted(pair: Pair) -> None:
    import struct

    import zmq

    pair.ctx("offer", _ticket(1), [1])
    n = pair.ask(_ticket(1), [1], timeout_ms=400, token=b"\x00" * 16)  # a guessed token: dropped unanswered
    got = pair.ended(1, 5.0)
    assert [(c.nonce, c.status) for c in got] == [(n, "timed_out")]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(pair.endpoint)
    head = struct.pack("<IB3x16s16s16sII16s", 0x314C564B, 1, b"\x00" * 16, _ticket(1), b"n" * 16, 1, 1000, DIGEST)
    frames = [
        b"",
        b"garbage",
        b"\xff" * 100,
        head,  # a header that announces a fragment it lacks
        head + b"\x00" * 16,  # a whole request, without a token
        head[:40],
        struct.pack("<IB3x", 0x314C564B, 9) + b"\x00" * 100,  # an unknown type
        struct.pack("<IB3x16s16s16s", 0x314C564B, 3, b"\x00" * 16, _ticket(1), b"n" * 16),  # a cancel, no token
    ]
    for f in frames:
        s.send(f)
    s.send_multipart([head + b"\x00" * 16, b"second part"])
    deadline = time.monotonic() + 5
    while pair.ctx("stats")["rejected_frames"] < len(frames) + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    s.close()
    ctx.term()
    st = pair.ctx("stats")
    assert st["rejected_frames"] >= len(frames) + 1 and st["posts"] == 0
    assert not pair.pool.any()
    pair.ask(_ticket(1), [2])  # the rightful receiver, with its token, is still served
    assert [c.status for c in pair.ended(1)] == ["ok"]
    _check(pair.pool, [1], [2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_caps_bound_what_a_lane_holds(backend: str) -> None:
    p = Pair(backend, max_jobs=2)
    small = Lane(p.poster, max_pending=1, curve=False)
    try:
        p.ctx("offer", _ticket(1), [1])
        p.ctx("offer", _ticket(2), [2])
        with pytest.raises(NativeLaneError, match="too many offers"):
            p.ctx("offer", _ticket(3), [3])
        n3 = p.ask(_ticket(3), [3])  # the context holds two jobs: a third request is refused at once
        got = p.ended(1, 5.0)
        assert [(c.nonce, c.status) for c in got] == [(n3, "failed")] and "too many" in got[0].error
        assert p.ctx("withdraw", _ticket(1))  # room for one job: the next request waits there for its offer
        c = small.connect(p.endpoint, None)
        layout = small.layout([p.pool.ctypes.data], [BLOCK], [BLOCK], BLOCKS, DIGEST)
        small.request(c, p.token, _ticket(4), PROOF, os.urandom(16), layout, [4], 2000)
        with pytest.raises(NativeLaneError, match="too many pending"):
            small.request(c, p.token, _ticket(5), PROOF, os.urandom(16), layout, [5], 2000)
        assert p.ctx("withdraw", _ticket(2))
    finally:
        small.close()
        p.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_curve_lanes_serve_and_refuse_a_plain_peer(backend: str) -> None:
    p = Pair(backend, curve=True)
    try:
        assert p.lane.public_key is not None and len(p.lane.public_key) == 32
        p.ctx("offer", _ticket(1), [5])
        p.ask(_ticket(1), [6])
        assert [c.status for c in p.ended(1)] == ["ok"]
        _check(p.pool, [5], [6])
        plain = Lane(p.poster, curve=False)
        try:
            with pytest.raises(NativeLaneError, match="without CURVE"):
                plain.connect(p.endpoint, p.lane.public_key)
        finally:
            plain.close()
        with pytest.raises(NativeLaneError, match="public key is needed"):
            p.lane.connect(p.endpoint, None)
    finally:
        p.close()


def test_close_ends_waits_and_refuses_later_calls(pair: Pair) -> None:
    import threading

    pair.ask(_ticket(1), [1])  # pending, never offered
    woke = threading.Event()
    t = threading.Thread(target=lambda: (pair.lane.wait(30.0), woke.set()))
    t.start()
    time.sleep(0.05)
    pair.lane.close()
    t.join(5)
    assert woke.is_set(), "a thread waiting on the lane was not woken by its close"
    with pytest.raises(NativeLaneError, match="closed"):
        pair.ask(_ticket(2), [2])
    pair.lane.close()  # again: nothing


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_large_write_moves_in_pieces_and_lands_whole(backend: str) -> None:
    p = Pair(backend, piece_bytes=4 * BLOCK)
    try:
        rng = np.random.default_rng(5)
        src, dst = rng.permutation(BLOCKS)[:30].tolist(), rng.permutation(BLOCKS)[:30].tolist()
        p.ctx("offer", _ticket(1), src)
        p.ask(_ticket(1), dst)
        assert [c.status for c in p.ended(1)] == ["ok"]
        _check(p.pool, src, dst)
        assert p.ctx("stats")["posts"] == 8  # 30 blocks in pieces of 4: seven full pieces and one of 2
    finally:
        p.close()
