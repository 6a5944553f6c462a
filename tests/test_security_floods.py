"""Floods by a malicious generation-side process: the caps it fills are its own, never the other peers'.

The context rank runs in this process; the flooder (``_flood_peer``, an admitted same-uid peer: this user's local
CURVE key) and the legitimate generation instance run in their own processes, over real sockets. Every test
floods a cap first, then checks that the legitimate instance's request still completes with the context's bytes.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import pytest
import torch
from _flood_peer import Flooder, dead_endpoints
from _instances import GenerationProcess, fill_value, make_rank, ticket_for

from kvcore.control import wire
from kvcore.transceiver import SessionState

pytestmark = pytest.mark.timeout(300)


class Ctx:
    """An in-process one-rank context instance (its internals are looked at: ``tx._role``, ``tx._link``)."""

    def __init__(self, closing: list[Any], **config: Any) -> None:
        self.agent, cache, self.tx = make_rank("context", f"ctx-{os.getpid()}", config=config)
        self.flat = cache.view(cache.shape[0], -1).view(torch.uint8)
        closing.extend([self.agent, self.tx])

    def send(self, rid: Any, blocks: list[int]) -> None:
        self.flat[blocks] = torch.from_numpy(fill_value(rid, blocks, self.flat.shape[1]))
        self.tx.start_send(rid, blocks, ticket=ticket_for(rid))

    @property
    def counters(self) -> Any:
        return self.tx._link.counters

    def stats(self) -> dict[str, int]:
        return self.tx.stats()


def _done_with_the_bytes(ctx: Ctx, gen: GenerationProcess, rid: int, src: list[int], dst: list[int]) -> None:
    """``rid`` ends DONE on both sides and the generation blocks hold the context's pattern."""
    out = gen.wait_released(rid, 40)
    assert out["state"] == "DONE", out
    got = np.frombuffer(gen.read(dst), np.uint8).reshape(len(dst), -1)
    assert np.array_equal(got, fill_value(rid, src, ctx.flat.shape[1])), f"request {rid}: the bytes differ"
    assert ctx.tx.wait_all([rid], 30)[rid].state is SessionState.DONE


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- the table of generation ranks (max_peers, idle_peer_ttl_s) ---------------------------------------------


def test_registrations_that_never_ask_do_not_keep_the_table_full_for_a_newcomer(closing: list[Any]) -> None:
    """A stranger registers 20 valid generation ranks with a table of 8, then exits: the legitimate instance that
    registers next is admitted (one that never asked makes room) and its request completes."""
    ctx = Ctx(closing, max_peers=8)
    flood = Flooder(ctx.tx.info_endpoint)
    closing.append(flood)
    flood.call("register", count=20)
    assert ctx.stats()["gen_peers"] == 8, "the flood fills the table"
    flood.kill()  # gone without a word: nothing tells the context
    gen = GenerationProcess()
    closing.append(gen)
    ctx.send(1, [1, 2])
    gen.receive(1, ctx.tx.info_endpoint, [3, 4])
    _done_with_the_bytes(ctx, gen, 1, [1, 2], [3, 4])
    assert ctx.stats()["gen_peers"] <= 8 and ctx.counters["idle_peers_dropped"] >= 13


def test_idle_generation_ranks_are_dropped_and_one_that_asks_again_is_admitted_again(closing: list[Any]) -> None:
    """idle_peer_ttl_s=1: a stranger's registrations (it exited) are dropped and their agent unloaded; the
    legitimate rank is kept while its early request waits, serves a pull request, is dropped once idle, and is
    admitted again when it asks again."""
    ctx = Ctx(closing, idle_peer_ttl_s=1.0)
    flood = Flooder(ctx.tx.info_endpoint)
    closing.append(flood)
    assert flood.call("register", count=5)["ok"] == 5
    assert ctx.stats()["gen_peers"] == 5 and ctx.stats()["remote_agents"] == 1  # one descriptor, five names
    flood.kill()
    gen = GenerationProcess()
    closing.append(gen)
    _wait(lambda: ctx.counters["idle_peers_dropped"] >= 5, 30, "the stranger's registrations to be dropped")
    _wait(lambda: ctx.stats()["remote_agents"] == 0, 30, "the stranger's agent to be unloaded")
    gen.receive(1, ctx.tx.info_endpoint, [3, 4])  # before start_send: an early request holds the rank
    _wait(lambda: ctx.stats()["early_requests"] == 1, 30, "the early request to be kept")
    time.sleep(3.0)  # three idle_peer_ttl_s with the early request waiting
    assert ctx.stats()["gen_peers"] == 1, "the rank whose early request waits is not idle"
    _pull(ctx, gen, 2, [5, 6], [7, 8])
    ctx.send(1, [1, 2])
    _done_with_the_bytes(ctx, gen, 1, [1, 2], [3, 4])
    _wait(lambda: ctx.stats()["gen_peers"] == 0, 30, "the legitimate rank to be dropped once idle")
    _wait(lambda: ctx.stats()["remote_agents"] == 0, 30, "every dropped rank's agent to be unloaded")
    ctx.send(3, [9, 10])
    gen.receive(3, ctx.tx.info_endpoint, [11, 12])
    _done_with_the_bytes(ctx, gen, 3, [9, 10], [11, 12])
    assert ctx.counters["idle_peers_readmitted"] == 1


def _pull(ctx: Ctx, gen: GenerationProcess, rid: int, src: list[int], dst: list[int]) -> None:
    """A pull request: the generation rank reads the context's blocks, then reports the read."""
    ctx.flat[src] = torch.from_numpy(fill_value(rid, src, ctx.flat.shape[1]))
    params = ctx.tx.start_send(rid, src, ticket=ticket_for(rid), mode="pull")
    gen.call("receive_params", params=params.to_dict(), blocks=dst)
    _done_with_the_bytes(ctx, gen, rid, src, dst)


# --- sockets toward endpoints a peer names ----------------------------------------------------------------


def test_refused_registrations_open_no_socket_toward_the_endpoints_they_name(closing: list[Any]) -> None:
    """600 refused registrations, each naming another endpoint (200 whose agent fails to load, 400 refused on
    arrival): every refusal goes back over the connection it came on, no socket (4 descriptors each) is opened
    toward what they named, refused ranks are remembered within max_peers, and the legitimate rank is served."""
    ctx = Ctx(closing, max_peers=256)
    flood = Flooder(ctx.tx.info_endpoint)
    closing.append(flood)
    fds = len(os.listdir("/proc/self/fd"))
    named = dead_endpoints(600)
    got = flood.call("register", count=200, descriptor="bogus", endpoints=named[:200], timeout=120)
    assert got == {"ok": 0, "refused": 200}, "each refusal reaches the connection it answers"
    got = flood.call("register", count=400, descriptor="foreign", endpoints=named[200:], timeout=120)
    assert got == {"ok": 0, "refused": 400}
    assert ctx.stats()["control_connections"] == 0
    assert len(os.listdir("/proc/self/fd")) - fds < 50  # 600 sockets would be 1800 or more
    assert len(ctx.tx._role.peers) <= 256, "refused ranks are remembered within max_peers"
    gen = GenerationProcess()
    closing.append(gen)
    ctx.send(1, [1, 2])
    gen.receive(1, ctx.tx.info_endpoint, [3, 4])
    _done_with_the_bytes(ctx, gen, 1, [1, 2], [3, 4])


# --- requests waiting for start_send (max_early_bytes_per_peer) ------------------------------------------------


def test_one_peers_early_requests_cannot_fill_the_early_queue_for_the_others(closing: list[Any]) -> None:
    """16 early requests of 65536 block ids (8 MiB) from one registered rank, against max_early_bytes of 4 MiB:
    it keeps its eighth, the rest is refused, and a legitimate early receiver is still kept and served."""
    ctx = Ctx(closing, max_early_bytes=4 * 1024 * 1024)
    flood = Flooder(ctx.tx.info_endpoint)
    closing.append(flood)
    assert flood.call("register", count=1)["ok"] == 1
    got = flood.call("ask_early", count=16, blocks=wire.MAX_BLOCKS_PER_REQUEST)
    assert got == {"refused": 15, "kinds": ["ResourceExhaustedError"]}, got
    assert ctx.stats()["early_request_bytes"] <= 512 * 1024
    gen = GenerationProcess()
    closing.append(gen)
    gen.receive(1, ctx.tx.info_endpoint, [3, 4])  # early: before start_send
    _wait(lambda: ctx.stats()["early_requests"] == 2, 30, "the legitimate early request to be kept")
    ctx.send(1, [1, 2])
    _done_with_the_bytes(ctx, gen, 1, [1, 2], [3, 4])


# --- tombstones (max_peer_tombstones) ---------------------------------------------------------------------------


def test_a_flood_of_declines_never_evicts_the_engines_own_cancel(closing: list[Any]) -> None:
    """The engine cancels request 7 before start_send; a registered peer then declines 500 requests (over both
    tombstone caps of 64): start_send(7) still ends CANCELLED on both sides, and another request completes."""
    ctx = Ctx(closing, max_tombstones=64, max_peer_tombstones=64)
    ctx.tx.cancel(7)
    flood = Flooder(ctx.tx.info_endpoint)
    closing.append(flood)
    assert flood.call("register", count=1)["ok"] == 1
    flood.call("decline", count=500)
    assert ctx.stats()["tombstones"] <= 128
    gen = GenerationProcess()
    closing.append(gen)
    ctx.send(7, [1, 2])
    gen.receive(7, ctx.tx.info_endpoint, [3, 4])
    assert gen.wait_released(7, 40)["state"] == "CANCELLED"
    assert ctx.tx.wait_all([7], 30)[7].state is SessionState.CANCELLED
    ctx.send(8, [5, 6])
    gen.receive(8, ctx.tx.info_endpoint, [7, 8])
    _done_with_the_bytes(ctx, gen, 8, [5, 6], [7, 8])


# --- ticket guesses -----------------------------------------------------------------------------------------------


def test_ticket_guesses_are_all_counted_and_logged_rate_limited(
    closing: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """30 receivers with the wrong ticket: 30 refusals counted, at most two log lines; the owner is served."""
    ctx = Ctx(closing)
    gen = GenerationProcess()
    closing.append(gen)
    for rid in range(1, 31):
        ctx.send(rid, [rid])
    with caplog.at_level(logging.WARNING, logger="kvcore.transceiver"):
        for rid in range(1, 31):
            gen.receive(rid, ctx.tx.info_endpoint, [rid], ticket=b"\x01" * 16)
        for rid in range(1, 31):
            assert gen.wait_released(rid, 40)["state"] == "FAILED"
    assert ctx.stats()["tickets_refused"] == 30
    lines = [r for r in caplog.records if "refused a receiver" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    ctx.send(40, [40])
    gen.receive(40, ctx.tx.info_endpoint, [41])
    _done_with_the_bytes(ctx, gen, 40, [40], [41])
