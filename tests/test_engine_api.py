"""The engine API of issue 14: transfer parameters, tickets, pull mode, aux payload, str/bytes ids, leases,
per-rank poll and per-request status.

The context instance runs in its own process (``ContextProcess``), the
generation rank in this one; every byte is compared with ``fill_value``
computed independently of kvcore. Topology coverage of pull mode (TP2->TP4,
TP4->TP2, PP mismatch, GQA, MLA, Mamba) is in ``test_e2e_topologies.py``.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _faults import RankGroup
from _instances import ContextProcess, _pattern_id, fill_value, make_rank, ticket_for

from kvcore import errors as E
from kvcore.params import TransferParams, derive_ticket, new_ticket
from kvcore.transceiver import RequestStatus, SessionState, leaks

BACKENDS = ["shm", "nixl", "ucx"]


class Gen:
    """A one-rank generation instance in this process (each its own instance and agent name)."""

    _seq = itertools.count()

    def __init__(self, backend: str = "shm", num_blocks: int = 64, timeout: float = 30.0, **config: Any) -> None:
        name = f"gen-api-{next(Gen._seq)}"
        self.agent, self.cache, self.tx = make_rank(
            "generation", name, backend, num_blocks, timeout, config, instance_name=name
        )
        self.flat = self.cache.view(num_blocks, -1).view(torch.uint8)

    def expect_bytes(self, rid: Any, src: list[int], dst: list[int]) -> None:
        want = fill_value(_pattern_id(rid), src, self.flat.shape[1])
        assert np.array_equal(self.flat[dst].numpy(), want), f"request {rid!r}: received bytes differ"

    def close(self) -> None:
        self.tx.close()
        self.agent.close()


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    items: list[Any] = []
    try:
        yield items
    finally:
        for it in reversed(items):
            it.close()


def _until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# --- transfer parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize("rid", [7, 2**64 - 1, "cmpl-abc-0", b"\x00\xffid"])
def test_params_round_trip_through_json(rid: Any) -> None:
    p = TransferParams.make(rid, "tcp://10.0.0.1:5555", mode="pull", block_ids=[3, 1, 2], incarnation="inc0")
    d = json.loads(json.dumps(p.to_dict()))  # what a router does to it
    q = TransferParams.from_dict(d)
    assert q == p and type(q.request_id) is type(rid) and q.request_id == rid
    assert TransferParams.from_json(p.to_json()) == p
    assert len(p.ticket_bytes) == 16 and p.ticket_bytes != TransferParams.make(rid, p.endpoint).ticket_bytes


def test_params_are_small() -> None:
    push = TransferParams.make("chatcmpl-0123456789abcdef0123456789abcdef", "tcp://10.200.30.40:55555", dp_rank=3)
    assert len(push.to_json()) < 256, push.to_json()
    pull = TransferParams.make(
        "r", "tcp://10.200.30.40:55555", mode="pull", block_ids=range(100_000, 100_256), incarnation="0" * 32
    )
    assert len(pull.to_json()) < 2600  # 256 blocks (a 4096-token prompt at 16 tokens a block)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"endpoint": "tcp://a:1", "ticket": "00" * 16}, "request_id"),
        ({"request_id": 1, "endpoint": "tcp://a:1", "ticket": "zz"}, "hex"),
        ({"request_id": 1, "endpoint": "tcp://a:1", "ticket": "00" * 4}, "16..64 bytes"),
        ({"request_id": 1.5, "endpoint": "tcp://a:1", "ticket": "00" * 16}, "request_id"),
        ({"request_id": -1, "endpoint": "tcp://a:1", "ticket": "00" * 16}, "0..2\\*\\*64-1"),
        ({"request_id": "x" * 257, "endpoint": "tcp://a:1", "ticket": "00" * 16}, "1..256"),
        ({"request_id": 1, "endpoint": "tcp://a:1", "ticket": "00" * 16, "mode": "teleport"}, "mode"),
        ({"request_id": 1, "endpoint": "tcp://a:1", "ticket": "00" * 16, "mode": "pull"}, "incarnation"),
        ({"request_id": 1, "endpoint": "tcp://a:1", "ticket": "00" * 16, "version": 9}, "version"),
        ({"request_id": 1, "endpoint": "tcp://a:1", "ticket": "00" * 16, "block_ids": "123"}, "block_ids"),
    ],
)
def test_malformed_params_are_refused_with_the_field(data: dict[str, Any], match: str) -> None:
    with pytest.raises(E.KvcoreError, match=match):
        TransferParams.from_dict(data)


def test_deeply_nested_params_json_is_a_typed_error_not_a_recursion_error() -> None:
    """2 KB of nested JSON (a router's payload from a stranger) is refused as malformed, before any recursion."""
    tail = ', "endpoint": "tcp://a:1", "ticket": "' + "00" * 16 + '"}'
    nested = '{"request_id": ' + "[" * 1000 + "]" * 1000 + tail
    assert len(nested) < 2100
    with pytest.raises(E.SessionError, match="malformed transfer parameters"):
        TransferParams.from_json(nested)
    for text in ("[" * 2048, '{"group_block_ids": {"a": ' + "[" * 2048 + "}", b"{" * 2048):
        with pytest.raises(E.SessionError):
            TransferParams.from_json(text)
    with pytest.raises(E.SessionError, match="bytes of JSON"):
        TransferParams.from_json(" " * (8 * 1024 * 1024) + "{}")


@pytest.mark.parametrize("rid", [7, b"\x00\xffid"])
def test_unknown_params_fields_are_refused_naming_the_field(rid: Any) -> None:
    """A field this kvcore does not read is refused (a typo, a stranger's addition), never dropped silently."""
    p = TransferParams.make(rid, "tcp://10.0.0.1:5555", mode="pull", block_ids=[3], incarnation="inc0")
    d = json.loads(p.to_json())
    assert TransferParams.from_dict(d) == p == TransferParams.from_json(json.dumps(d))  # the known ones still parse
    with pytest.raises(E.SessionError, match="unknown field 'block_id'"):
        TransferParams.from_dict({**d, "block_id": [4]})
    with pytest.raises(E.SessionError, match="unknown field 'owner'"):
        TransferParams.from_json(json.dumps({**d, "owner": "someone else"}))


def test_derived_tickets_differ_per_request_and_type() -> None:
    s = b"s" * 32
    assert derive_ticket(s, 5) != derive_ticket(s, "5") != derive_ticket(s, b"5")
    assert derive_ticket(s, 5) == derive_ticket(s, 5) != derive_ticket(b"t" * 32, 5)
    with pytest.raises(E.TicketError):
        derive_ticket(b"short", 5)


# --- tickets -----------------------------------------------------------------------------------------


def test_a_receiver_without_the_ticket_gets_nothing_and_the_owner_still_gets_its_kv(closing: list[Any]) -> None:
    ctx = ContextProcess()
    closing.append(ctx)
    thief, bare, owner = Gen(), Gen(), Gen()
    closing.extend([thief, bare, owner])
    bare.tx.start_receive(1, ctx.endpoint, [3])  # no ticket at all (the pre-ticket API), asked before start_send
    params = TransferParams.from_dict(ctx.start_send(1, [1, 2]))
    thief.flat.zero_()
    thief.tx.start_receive(1, params.endpoint, [3, 4], ticket=new_ticket())  # a guess
    out = thief.tx.wait_all([1], 20)[1]
    assert out.state is SessionState.FAILED and isinstance(out.error, E.TicketError), out.error
    assert not thief.flat[[3, 4]].any(), "bytes reached a receiver without the ticket"
    out = bare.tx.wait_all([1], 20)[1]
    assert isinstance(out.error, E.TicketError) and "no ticket" in str(out.error), out.error
    owner.tx.start_receive(params=params.to_dict(), block_ids=[7, 8])
    assert owner.tx.wait_all([1], 20)[1].state is SessionState.DONE
    owner.expect_bytes(1, [1, 2], [7, 8])
    assert ctx.wait_released(1)["state"] == "DONE"
    assert ctx.stats()["tickets_refused"] >= 1


# --- pull mode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_pull_moves_exact_bytes_with_aux_and_str_ids(backend: str, closing: list[Any]) -> None:
    ctx = ContextProcess(backend)
    closing.append(ctx)
    gen = Gen(backend)
    closing.append(gen)
    cases = [(11, [1, 2, 3], [40, 41, 42]), ("req-a", [4], [50]), (b"\x00b", [5, 6], [51, 9])]
    for rid, src, dst in cases:
        p = ctx.start_send(rid, src, mode="pull", aux=b"first-token:" + repr(rid).encode())
        assert p["mode"] == "pull" and p["block_ids"] == src
        gen.tx.start_receive(params=p, block_ids=dst)
    outs = gen.tx.wait_all([c[0] for c in cases], 30)
    for rid, src, dst in cases:
        o = outs[rid]
        assert o.state is SessionState.DONE, o.error
        assert o.aux == b"first-token:" + repr(rid).encode()
        assert o.nbytes == len(dst) * gen.flat.shape[1]
        gen.expect_bytes(rid, src, dst)
        assert ctx.wait_released(rid)["state"] == "DONE"
    assert gen.tx.leaks() == {}
    assert leaks(ctx.stats()) == {}


def test_int_and_str_ids_are_different_requests(closing: list[Any]) -> None:
    ctx = ContextProcess()
    closing.append(ctx)
    gen = Gen()
    closing.append(gen)
    p5 = ctx.start_send(5, [1])
    ps5 = ctx.start_send("5", [2])
    gen.tx.start_receive(params=ps5, block_ids=[10])
    gen.tx.start_receive(params=p5, block_ids=[11])
    outs = gen.tx.wait_all([5, "5"], 20)
    assert outs[5].state is outs["5"].state is SessionState.DONE
    gen.expect_bytes(5, [1], [11])
    gen.expect_bytes("5", [2], [10])


def test_pull_after_the_lease_ran_out_is_not_done(closing: list[Any]) -> None:
    """The context let go (its pages may hold other data now): a read of them must not be reported DONE."""
    ctx = ContextProcess(timeout=1.0, config={"lease_s": 1.0, "max_lease_s": 1.0})
    closing.append(ctx)
    gen = Gen()
    closing.append(gen)
    p = ctx.start_send(3, [1, 2], mode="pull")
    assert ctx.wait_released(3, 20)["error"].startswith("LeaseExpiredError")
    gen.tx.start_receive(params=p, block_ids=[5, 6])
    out = gen.tx.wait_all([3], 20)[3]
    assert out.state in (SessionState.FAILED, SessionState.TIMED_OUT), out
    assert isinstance(out.error, E.LeaseExpiredError), out.error
    assert gen.tx.leaks() == {}


def test_pull_with_other_blocks_than_the_context_holds_fails_on_both_sides(closing: list[Any]) -> None:
    ctx = ContextProcess()
    closing.append(ctx)
    gen = Gen()
    closing.append(gen)
    p = ctx.start_send(4, [1, 2], mode="pull")
    forged = dict(p, block_ids=[3, 4])  # a router bug: another request's blocks
    gen.tx.start_receive(params=forged, block_ids=[5, 6])
    out = gen.tx.wait_all([4], 20)[4]
    assert out.state is SessionState.FAILED and isinstance(out.error, E.MappingError), out.error
    assert ctx.wait_released(4)["error"].startswith("MappingError")


def test_pull_from_a_restarted_context_fails_clearly(closing: list[Any]) -> None:
    from _instances import free_port

    port = free_port()
    ctx = ContextProcess(config={"port": port})
    closing.append(ctx)
    gen = Gen()
    closing.append(gen)
    p = ctx.start_send(1, [1], mode="pull")
    gen.tx.start_receive(params=p, block_ids=[2])
    assert gen.tx.wait_all([1], 20)[1].state is SessionState.DONE
    stale = ctx.start_send(2, [3], mode="pull")
    ctx.kill()
    ctx2 = ContextProcess(config={"port": port})
    closing.append(ctx2)
    gen.tx.start_receive(params=stale, block_ids=[4])
    out = gen.tx.wait_all([2], 30)[2]
    assert out.state is SessionState.FAILED and isinstance(out.error, E.PeerLostError), out.error
    assert "restarted" in str(out.error)


def test_cancel_of_a_pull_request_lets_the_context_go_at_once(closing: list[Any]) -> None:
    ctx = ContextProcess(timeout=60)
    closing.append(ctx)
    gen = Gen(backend="shm")
    closing.append(gen)
    warm = ctx.start_send(99, [9], mode="pull")
    gen.tx.start_receive(params=warm, block_ids=[9])
    assert gen.tx.wait_all([99], 20)[99].state is SessionState.DONE  # the instance is known and registered
    p = ctx.start_send(7, [1, 2], mode="pull")
    gen.tx.expect(p)
    assert gen.tx.cancel(7)
    out = gen.tx.wait_all([7], 20)[7]
    assert out.state is SessionState.CANCELLED
    assert ctx.wait_released(7, 20)["state"] == "CANCELLED"  # long before its 60 s lease


def test_an_empty_poll_does_not_wait_for_the_io_thread(closing: list[Any]) -> None:
    """With nothing ended, ``poll`` and ``poll_local`` of a one-rank instance return at once without the lock the
    I/O thread holds while it works (the engine polls every step); a request that ends is still reported."""
    agent, _, tx = make_rank("context", "ctx-empty-poll", "shm")
    closing.extend([agent, tx])
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with tx._link.lock:
            held.set()
            done.wait(10)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert held.wait(5)
        t0 = time.monotonic()
        assert tx.poll().outcomes == [] and tx.poll_local().released == []
        assert time.monotonic() - t0 < 2  # the holder keeps the lock for 10 s
    finally:
        done.set()
        holder.join(10)
    tx.start_send(1, [0], ticket=ticket_for(1))
    assert tx.cancel(1)
    out = tx.wait_all([1], 20)[1]
    assert out.state is SessionState.CANCELLED


def test_layerwise_pull_is_refused_clearly(closing: list[Any]) -> None:
    agent, _, tx = make_rank("context", "ctx-lw", "shm")
    closing.extend([agent, tx])
    with pytest.raises(E.SessionError, match="layer-wise"):
        tx.start_send(1, [0], mode="pull", layers_ready=1, ticket=ticket_for(1))


# --- aux payload -------------------------------------------------------------------------------------


def test_aux_in_push_mode_and_its_bounds(closing: list[Any]) -> None:
    ctx = ContextProcess(config={"max_aux_bytes": 4096})
    closing.append(ctx)
    gen = Gen(max_aux_bytes=100)
    closing.append(gen)
    p = ctx.start_send(1, [1], aux=b"x" * 64)
    gen.tx.start_receive(params=p, block_ids=[2])
    assert gen.tx.wait_all([1], 20)[1].aux == b"x" * 64
    with pytest.raises(RuntimeError, match=r"PayloadTooLargeError.*4096"):
        ctx.start_send(2, [3], aux=b"y" * 4097)
    p3 = ctx.start_send(3, [4], aux=b"z" * 200)  # fine there, too large for this receiver
    gen.tx.start_receive(params=p3, block_ids=[5])
    out = gen.tx.wait_all([3], 20)[3]
    assert out.state is SessionState.FAILED and isinstance(out.error, E.PayloadTooLargeError), out.error


def test_set_aux_after_the_receiver_has_its_answer_is_refused(closing: list[Any]) -> None:
    ctx = RankGroup.build("context")
    gen = RankGroup.build("generation")
    closing.extend([gen, ctx])
    tx = ctx.txs[0]
    p = tx.start_send(1, [1], ticket=ticket_for(1))
    tx.set_aux(1, b"before")
    gen.txs[0].start_receive(params=p, block_ids=[2])
    assert gen.txs[0].wait_all([1], 20)[1].aux == b"before"
    with pytest.raises(E.SessionError, match="already has its KV"):
        tx.set_aux(1, b"after")


# --- leases ------------------------------------------------------------------------------------------


def test_expect_renews_the_lease_beyond_the_request_timeout(closing: list[Any]) -> None:
    ctx = ContextProcess(timeout=1.5, config={"lease_s": 1.5, "max_lease_s": 30})
    closing.append(ctx)
    gen = Gen()
    closing.append(gen)
    p = ctx.start_send(1, [1, 2])
    gen.tx.expect(p)
    assert gen.tx.status(1) is RequestStatus.WAITING
    time.sleep(4.0)  # far beyond the context's 1.5 s without renewals
    gen.tx.start_receive(params=p, block_ids=[3, 4])
    out = gen.tx.wait_all([1], 20)[1]
    assert out.state is SessionState.DONE, out.error
    gen.expect_bytes(1, [1, 2], [3, 4])


def test_lease_expiry_reaches_an_expecting_receiver(closing: list[Any]) -> None:
    ctx = ContextProcess(timeout=1.0, config={"lease_s": 1.0, "max_lease_s": 2.0})
    closing.append(ctx)
    gen = Gen()  # renews at a third of the context's lease, which the parameters carry
    closing.append(gen)
    p = ctx.start_send(1, [1])
    gen.tx.expect(p)
    t0 = time.monotonic()
    out = gen.tx.wait_all([1], 20)[1]
    assert out.state is SessionState.TIMED_OUT and isinstance(out.error, E.LeaseExpiredError), out.error
    assert time.monotonic() - t0 < 10, "the receiver learnt of the expiry only at its own deadline"
    assert ctx.wait_released(1)["error"].startswith("LeaseExpiredError")
    assert gen.tx.leaks() == {}


# --- per-rank poll and status -----------------------------------------------------------------------


def test_poll_local_reports_each_rank_without_the_others(closing: list[Any]) -> None:
    ctx = RankGroup.build("context", tp=2)
    gen = RankGroup.build("generation", tp=2)
    closing.extend([gen, ctx])
    params = [tx.start_send("r1", [1, 2], ticket=ticket_for("r1")) for tx in ctx.txs]
    assert params[0].ticket == params[1].ticket
    gen.txs[0].start_receive(params=params[0], block_ids=[3, 4])
    # Only generation rank 0 receives and polls; a collective poll would wait for rank 1 forever.
    deadline = time.monotonic() + 20
    got: list[Any] = []
    while not got and time.monotonic() < deadline:
        got = gen.txs[0].poll_local().done
        time.sleep(0.01)
    assert [o.request_id for o in got] == ["r1"]
    assert gen.txs[1].status("r1") is None


def test_status_walks_through_the_states(closing: list[Any]) -> None:
    ctx = RankGroup.build("context")
    gen = RankGroup.build("generation")
    closing.extend([gen, ctx])
    c, g = ctx.txs[0], gen.txs[0]
    assert c.status(1) is None
    p = c.start_send(1, [1], ticket=ticket_for(1), layers_ready=0)  # nothing ready yet
    assert c.status(1) is RequestStatus.WAITING
    g.start_receive(params=p, block_ids=[2])
    assert g.status(1) in (RequestStatus.CONNECTING, RequestStatus.TRANSFERRING)
    _until(lambda: c.status(1) is RequestStatus.READY, 20, "the receiver's ask (SGLang's WaitingForInput)")
    c.layers_ready(1, 4)
    assert g.wait_all([1], 20)[1].state is SessionState.DONE
    assert g.status(1) is None  # released
    _until(lambda: c.poll().released == [1] or c.status(1) is None, 20, "the context's release")


# --- layers_ready with an event -------------------------------------------------------------------------


class _HostEvent:
    """Anything with ``query()`` is accepted as torch.cuda.Event is; this one completes when the test says so."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.flag.is_set()


def test_layers_ready_waits_for_its_event_without_blocking_the_caller(closing: list[Any]) -> None:
    ctx = RankGroup.build("context")
    gen = RankGroup.build("generation")
    closing.extend([gen, ctx])
    c, g = ctx.txs[0], gen.txs[0]
    flat = ctx.caches[0].view(32, -1).view(torch.uint8)
    flat[[1]] = torch.from_numpy(fill_value(1, [1], flat.shape[1]))
    p = c.start_send(1, [1], ticket=ticket_for(1), layers_ready=0)
    g.start_receive(params=p, block_ids=[2])
    ev = _HostEvent()
    t0 = time.monotonic()
    c.layers_ready(1, 4, event=ev)
    assert time.monotonic() - t0 < 1.0  # returned at once: the worker polls the event
    _until(lambda: ev.queries >= 3, 10, "the worker to poll the event")
    assert g.status(1) is not None and g.poll().done == []  # not complete before the event: nothing written
    assert c.stats()["pending_events"] == 1
    ev.flag.set()
    out = g.wait_all([1], 20)[1]
    assert out.state is SessionState.DONE
    gflat = gen.caches[0].view(32, -1).view(torch.uint8)
    assert np.array_equal(gflat[[2]].numpy(), fill_value(1, [1], flat.shape[1]))
    assert c.stats()["pending_events"] == 0
    with pytest.raises(E.SessionError, match="query"):
        c.layers_ready(1, 4, event=object())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the event path of layers_ready)")
def test_layers_ready_with_a_cuda_event(closing: list[Any]) -> None:
    ctx = RankGroup.build("context")
    gen = RankGroup.build("generation")
    closing.extend([gen, ctx])
    c, g = ctx.txs[0], gen.txs[0]
    p = c.start_send(1, [1], ticket=ticket_for(1), layers_ready=0)
    g.start_receive(params=p, block_ids=[2])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # keep the stream busy for a while
        ev = torch.cuda.Event()
        ev.record(stream)
    c.layers_ready(1, 4, event=ev)
    assert g.wait_all([1], 60)[1].state is SessionState.DONE
    assert ev.query()


def test_a_stranger_process_asking_first_does_not_steal_the_kv(closing: list[Any]) -> None:
    """Issue 11's theft: a stranger instance (its own process) registers and asks for request 101 first.

    Request ids are names, not secrets: without the ticket it gets a TicketError and no byte, and the real
    receiver still gets the request exactly.
    """
    from _instances import GenerationProcess

    ctx = ContextProcess()
    closing.append(ctx)
    thief = GenerationProcess(instance_name="thief")
    closing.append(thief)
    thief.receive(101, ctx.endpoint, [1, 2], ticket=new_ticket())
    time.sleep(0.5)  # its ask reached the context (kept as an early request)
    ctx.send(101, [3, 4])
    out = thief.wait_released(101)
    assert out["state"] == "FAILED" and out["error"].startswith("TicketError"), out
    assert not any(thief.read([1, 2])), "the stranger's blocks received bytes"
    owner = Gen()
    closing.append(owner)
    owner.tx.start_receive(101, ctx.endpoint, [5, 6], ticket=ticket_for(101))
    assert owner.tx.wait_all([101], 20)[101].state is SessionState.DONE
    owner.expect_bytes(101, [3, 4], [5, 6])
    assert ctx.wait_released(101)["state"] == "DONE"


def test_a_read_reported_before_start_send_counts_once_start_send_runs(closing: list[Any]) -> None:
    """vLLM hands out the parameters (request_finished) a step before its worker calls start_send: a fast decode
    side may read and report first. The report waits for start_send, which checks it like any other."""
    ctx = RankGroup.build("context")
    gen = RankGroup.build("generation")
    closing.extend([gen, ctx])
    c, g = ctx.txs[0], gen.txs[0]
    flat = ctx.caches[0].view(32, -1).view(torch.uint8)
    flat[[3, 4]] = torch.from_numpy(fill_value(8, [3, 4], flat.shape[1]))
    p = TransferParams.make(8, c.info_endpoint, mode="pull", block_ids=[3, 4], incarnation=c.incarnation)
    g.start_receive(params=p, block_ids=[10, 11])
    _until(lambda: c.stats()["early_requests"] == 1, 20, "the early read report")
    assert g.poll().done == []  # not DONE before the context has said the blocks were its to lend
    c.start_send(8, [3, 4], params=p)
    out = g.wait_all([8], 20)[8]
    assert out.state is SessionState.DONE, out.error
    gflat = gen.caches[0].view(32, -1).view(torch.uint8)
    assert np.array_equal(gflat[[10, 11]].numpy(), fill_value(8, [3, 4], flat.shape[1]))
    assert c.wait_all([8], 20)[8].state is SessionState.DONE
    assert c.leaks() == {} and g.leaks() == {}


def test_a_registered_peer_cannot_decline_requests_it_has_no_ticket_for(closing: list[Any]) -> None:
    ctx = RankGroup.build("context")
    closing.append(ctx)
    c = ctx.txs[0]
    stranger, owner = Gen(), Gen()
    closing.extend([stranger, owner])
    warm = c.start_send(1, [1], ticket=ticket_for(1))
    stranger.tx.start_receive(params=warm, block_ids=[1])  # a legitimate peer for its own request: registered
    assert stranger.tx.wait_all([1], 20)[1].state is SessionState.DONE
    real = c.start_send(2, [2], ticket=ticket_for(2))  # started: a decline without its ticket changes nothing
    for rid in (2, 3):  # 3: not started yet, a pre-cancel by someone without the ticket is not honoured
        stranger.tx.expect(TransferParams.make(rid, c.info_endpoint, ticket=new_ticket()))
        assert stranger.tx.cancel(rid)
    stranger.tx.wait_all([2, 3], 20)
    _until(lambda: c.stats()["tickets_refused"] >= 1, 20, "the refused decline")
    later = c.start_send(3, [3], ticket=ticket_for(3))
    for p, dst in ((real, 5), (later, 6)):
        owner.tx.start_receive(params=p, block_ids=[dst])
    outs = owner.tx.wait_all([2, 3], 20)
    assert outs[2].state is outs[3].state is SessionState.DONE, outs
