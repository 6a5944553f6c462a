"""Engine mistakes refused at once (issue 27): no silent wrong KV, no false failures.

Each test makes one mistake an engine can make (an off-by-one block allocation, generation and context
disagreeing on the prompt length, a refused peer, tickets drawn per rank) through the public API, on in-process
instances (``RankGroup``), and checks the typed error on *both* sides, long before any lease runs out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _faults import RankGroup, fault_plugin_manager
from _instances import fill_value, ticket_for

from kvcore import errors as E
from kvcore.layout.mapping import align_blocks
from kvcore.transceiver import SessionState

pytestmark = pytest.mark.timeout(120)

TPB = 8  # RankGroup's tokens per block


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0], -1).view(torch.uint8)


@pytest.fixture
def pm() -> Any:
    return fault_plugin_manager()


@pytest.fixture
def groups(pm: Any) -> Iterator[list[RankGroup]]:
    made: list[RankGroup] = []
    try:
        yield made
    finally:
        for g in reversed(made):
            g.close()


def _outcomes(group: RankGroup, rids: list[Any], timeout: float = 20.0) -> dict[Any, Any]:
    """Poll every rank of ``group`` in step until each of ``rids`` is reported and released; rank 0's outcomes."""
    want, got, released = set(rids), {}, set()
    deadline = time.monotonic() + timeout
    while not (want <= set(got) and want <= released):
        if time.monotonic() > deadline:
            raise AssertionError(f"{group.role}: not reported/released in {timeout}s: {want - set(got)}, {got}")
        results = group.poll()
        for o in results[0].outcomes:
            got[o.request_id] = o
        released.update(results[0].released)
        time.sleep(0.005)
    return got


def _fill(ctx: RankGroup, rid: Any, blocks: list[int]) -> None:
    for cache in ctx.caches:
        flat = _flat(cache)
        flat[blocks] = torch.from_numpy(fill_value(rid, blocks, flat.shape[1]))


# --- 1. the cached prefix is stated, never guessed ---------------------------------------------------


def test_fewer_destination_blocks_than_the_prompt_needs_is_a_mapping_error_at_the_call(
    groups: list[RankGroup], pm: Any
) -> None:
    """prompt_len 40 at 8 tokens a block is 5 blocks: 1 destination block (no cached prefix stated) is refused."""
    gen = RankGroup.build("generation", pm=pm)
    groups.append(gen)
    with pytest.raises(E.MappingError, match=r"prompt_len 40 minus cached_tokens 0 needs 5 blocks") as err:
        gen.txs[0].start_receive(1, "tcp://127.0.0.1:1", [3], prompt_len=40, ticket=ticket_for(1))
    assert "1 blocks" in str(err.value)
    assert gen.txs[0].leaks() == {}
    # stated: 32 cached tokens are 4 whole blocks; the fifth is received
    with pytest.raises(E.MappingError, match=r"prompt_len 40 minus cached_tokens 8 needs 4 blocks"):
        gen.txs[0].start_receive(2, "tcp://127.0.0.1:1", [3], prompt_len=40, cached_tokens=8, ticket=ticket_for(2))
    with pytest.raises(E.MappingError, match=r"cached_tokens 41 exceeds prompt_len 40"):
        gen.txs[0].start_receive(3, "tcp://127.0.0.1:1", [], prompt_len=40, cached_tokens=41, ticket=ticket_for(3))


def test_a_short_block_list_without_a_stated_prefix_fails_both_sides_in_push(groups: list[RankGroup], pm: Any) -> None:
    """Neither side gave prompt_len: the context's planner finds the 1-of-3 list short; both sides end FAILED."""
    ctx = RankGroup.build("context", pm=pm)
    gen = RankGroup.build("generation", pm=pm)
    groups.extend([ctx, gen])
    _flat(gen.caches[0]).fill_(0)
    _fill(ctx, 1, [1, 2, 3])
    ctx.txs[0].start_send(1, [1, 2, 3], ticket=ticket_for(1))
    gen.txs[0].start_receive(1, ctx.info_endpoint, [9], ticket=ticket_for(1))
    out = _outcomes(gen, [1])[1]
    assert out.state is SessionState.FAILED and isinstance(out.error, E.MappingError), out.error
    assert "cached_tokens 0 needs 3 blocks" in str(out.error), out.error
    c = _outcomes(ctx, [1])[1]
    assert c.state is SessionState.FAILED and isinstance(c.error, E.MappingError), c.error
    assert not _flat(gen.caches[0])[9].any(), "a short list must receive nothing"


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_stated_cached_prefix_receives_only_the_suffix(groups: list[RankGroup], pm: Any, mode: str) -> None:
    ctx = RankGroup.build("context", pm=pm)
    gen = RankGroup.build("generation", pm=pm)
    groups.extend([ctx, gen])
    src, dst = [1, 2, 3, 4, 5], [20, 21, 22]
    _fill(ctx, 7, src)
    _flat(gen.caches[0]).fill_(0)
    params = ctx.txs[0].start_send(7, src, prompt_len=36, mode=mode, ticket=ticket_for(7))
    gen.txs[0].start_receive(params=params, block_ids=dst, cached_tokens=16)
    assert _outcomes(gen, [7])[7].state is SessionState.DONE
    want = fill_value(7, src, _flat(gen.caches[0]).shape[1])[2:]
    assert np.array_equal(_flat(gen.caches[0])[dst].numpy(), want)
    assert _outcomes(ctx, [7])[7].state is SessionState.DONE


def test_align_blocks_states_the_numbers() -> None:
    ids = np.arange(3, dtype=np.int64)
    with pytest.raises(E.MappingError, match=r"1 blocks do not cover the request: prompt_len 40 minus cached_tokens 0"):
        align_blocks(ids, ids[:1], 16, prompt_len=40)
    src, dst = align_blocks(ids, ids[1:], 16, prompt_len=40, cached_tokens=16)
    assert src.tolist() == [1, 2] and dst.tolist() == [1, 2]
    # the whole block table with a stated prefix: the cached blocks are not written
    src, dst = align_blocks(ids, ids + 10, 16, prompt_len=40, cached_tokens=32)
    assert src.tolist() == [2] and dst.tolist() == [12]
    src, dst = align_blocks(ids, ids[:0], 16, prompt_len=40, cached_tokens=40)
    assert len(src) == len(dst) == 0


# --- 7. log calls format any request id -------------------------------------------------------------------


class _FormatEvery(logging.Handler):
    """Formats every record it sees (as any real handler would) and keeps what could not be formatted."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage())
        except Exception as exc:  # what logging would print as "--- Logging error ---"
            self.errors.append(f"{record.msg!r}: {type(exc).__name__}: {exc}")


@pytest.fixture
def logged() -> Iterator[_FormatEvery]:
    handler = _FormatEvery()
    logger = logging.getLogger("kvcore")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _warned(handler: _FormatEvery, *words: str) -> str:
    line = next((m for m in handler.lines if all(w in m for w in words)), None)
    assert line is not None, f"no log line with {words}: {handler.lines[-10:]}"
    assert len(line) < 2000, f"a log line of {len(line)} characters (a peer logged by its repr?)"
    return line


def test_the_mapping_error_warning_formats_a_str_id(groups: list[RankGroup], pm: Any, logged: _FormatEvery) -> None:
    ctx = RankGroup.build("context", pm=pm)
    gen = RankGroup.build("generation", pm=pm)
    groups.extend([ctx, gen])
    ctx.txs[0].start_send("cmpl-1", [1, 2], prompt_len=16, ticket=ticket_for("cmpl-1"))
    gen.txs[0].start_receive("cmpl-1", ctx.info_endpoint, [3], prompt_len=8, ticket=ticket_for("cmpl-1"))
    assert isinstance(_outcomes(gen, ["cmpl-1"])["cmpl-1"].error, E.MappingError)
    assert logged.errors == []
    assert "generation rank ('generation-instance', 0)" in _warned(logged, "'cmpl-1'", "prompt_len")
    # and a plan that fails when written (a short list, no prompt length known here)
    ctx.txs[0].start_send("cmpl-2", [1, 2], ticket=ticket_for("cmpl-2"))
    gen.txs[0].start_receive("cmpl-2", ctx.info_endpoint, [3], ticket=ticket_for("cmpl-2"))
    assert isinstance(_outcomes(gen, ["cmpl-2"])["cmpl-2"].error, E.MappingError)
    assert logged.errors == []
    _warned(logged, "'cmpl-2'", "do not cover")


def test_the_remote_range_warning_formats_a_str_id(groups: list[RankGroup], pm: Any, logged: _FormatEvery) -> None:
    ctx = RankGroup.build("context", pm=pm)
    gen = RankGroup.build("generation", pm=pm, allocator=lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    groups.extend([ctx, gen])
    rid = b"\x00bytes-id"
    ctx.txs[0].start_send(rid, [1], ticket=ticket_for(rid))
    gen.txs[0].start_receive(rid, ctx.info_endpoint, [2], ticket=ticket_for(rid))
    assert isinstance(_outcomes(gen, [rid])[rid].error, E.RemoteRangeError)
    assert logged.errors == []
    _warned(logged, repr(rid), "generation rank")


def test_the_cross_host_fencing_warning_formats_a_str_id(logged: _FormatEvery) -> None:
    from _instances import ContextProcess, make_rank

    agent, _, tx = make_rank("generation", "gen-fence-log", config={"fencing_grace_s": 0.5, "peer_lost_timeout_s": 1.0})
    ctx = ContextProcess(timeout=60, env={"KVCORE_HOST_ID": "another-host"})
    try:
        tx.start_receive("cmpl-f", ctx.endpoint, [1], ticket=ticket_for("cmpl-f"))
        deadline = time.monotonic() + 10
        while ctx.stats()["early_requests"] != 1:
            assert time.monotonic() < deadline, "the request never reached the context"
            time.sleep(0.01)
        ctx.kill()
        out = tx.wait_all(["cmpl-f"], 30)["cmpl-f"]
        assert isinstance(out.error, E.PeerLostError), out
        assert tx.stats()["fenced_grace"] == 1
        assert logged.errors == []
        _warned(logged, "'cmpl-f'", "another host")
    finally:
        ctx.close()
        tx.close()
        agent.close()


# --- 5. one ticket per request on every context rank ---------------------------------------------------


@pytest.mark.parametrize("gen_tp", [1, 2])
def test_ranks_that_start_send_without_a_ticket_agree_on_it(groups: list[RankGroup], pm: Any, gen_tp: int) -> None:
    """TP2 context, each rank calling start_send(rid, blocks) alone: one ticket, identical parameters, DONE."""
    ctx = RankGroup.build("context", pm=pm, tp=2)
    gen = RankGroup.build("generation", pm=pm, tp=gen_tp)
    groups.extend([ctx, gen])
    rids: list[Any] = [5, "cmpl-5"]
    params = {rid: ctx.each(lambda _r, tx, rid=rid: tx.start_send(rid, [1, 2])) for rid in rids}
    for rid in rids:
        assert params[rid][0] == params[rid][1], "context ranks returned different parameters"
    assert params[5][0].ticket != params["cmpl-5"][0].ticket
    for c in gen.caches:
        _flat(c).fill_(0)
    for rid in rids:
        gen.each(lambda _r, tx, rid=rid: tx.start_receive(params=params[rid][1].to_dict(), block_ids=[6, 7]))
    outs = _outcomes(gen, rids)
    assert {o.state for o in outs.values()} == {SessionState.DONE}, outs
    assert {o.state for o in _outcomes(ctx, rids).values()} == {SessionState.DONE}
    # another instance draws another secret: its tickets for the same ids differ
    other = RankGroup.build("context", pm=pm)
    groups.append(other)
    assert other.txs[0].start_send(5, [1]).ticket != params[5][0].ticket


# --- 3. prompt_len compared in pull -------------------------------------------------------------------------


def test_pull_with_another_prompt_len_fails_on_both_sides(groups: list[RankGroup], pm: Any) -> None:
    """Context 32 tokens, generation 30 (both 4 blocks), parameters without prompt_len: MappingError, not DONE."""
    ctx = RankGroup.build("context", pm=pm)
    gen = RankGroup.build("generation", pm=pm)
    groups.extend([ctx, gen])
    p = ctx.txs[0].start_send(1, [1, 2, 3, 4], prompt_len=32, mode="pull", ticket=ticket_for(1)).to_dict()
    del p["prompt_len"]  # made before prefill knew it, or dropped on the way: the generation side cannot compare
    gen.txs[0].start_receive(params=p, block_ids=[5, 6, 7, 8], prompt_len=30)
    out = _outcomes(gen, [1])[1]
    assert out.state is SessionState.FAILED and isinstance(out.error, E.MappingError), out.error
    assert "context 32, generation 30" in str(out.error), out.error
    c = _outcomes(ctx, [1])[1]
    assert c.state is SessionState.FAILED and isinstance(c.error, E.MappingError), c.error
    assert "context 32, generation 30" in str(c.error)


# --- 4. a refusal reaches both sides at once -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_context_the_generation_side_refuses_ends_at_once_on_both_sides(
    groups: list[RankGroup], pm: Any, mode: str
) -> None:
    """A dtype the generation side cannot take: IncompatiblePeerError there, and the context's request too,
    long before its 30 s lease (and not a byte in the generation pools)."""
    ctx = RankGroup.build("context", pm=pm, tp=2, timeout=30)
    gen = RankGroup.build("generation", pm=pm, geometry={"dtype": "float16"}, timeout=30)
    groups.extend([ctx, gen])
    _flat(gen.caches[0]).fill_(0)
    params = ctx.each(lambda _r, tx: tx.start_send(1, [1, 2], mode=mode))[0]
    t0 = time.monotonic()
    gen.txs[0].start_receive(params=params, block_ids=[3, 4])
    out = _outcomes(gen, [1])[1]
    assert out.state is SessionState.FAILED and isinstance(out.error, E.IncompatiblePeerError), out.error
    c = _outcomes(ctx, [1], 10.0)[1]
    assert c.state is SessionState.FAILED and isinstance(c.error, E.IncompatiblePeerError), c.error
    assert "dtype" in str(c.error) and "generation rank" in str(c.error), c.error
    assert time.monotonic() - t0 < 10.0
    assert not _flat(gen.caches[0]).any()
    # the refusal is remembered: the next request fails here at once, and there too
    params = ctx.each(lambda _r, tx: tx.start_send(2, [1, 2], mode=mode))[0]
    gen.txs[0].start_receive(params=params, block_ids=[3, 4])
    assert isinstance(_outcomes(gen, [2])[2].error, E.IncompatiblePeerError)
    c = _outcomes(ctx, [2], 10.0)[2]
    assert c.state is SessionState.FAILED and isinstance(c.error, E.IncompatiblePeerError), c.error


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_receiver_the_context_refuses_ends_the_request_at_once_on_both_sides(
    groups: list[RankGroup], pm: Any, mode: str
) -> None:
    """The context admits one generation instance (max_peers=1): the second one's request fails on both sides
    with ResourceExhaustedError at once, not at the end of the context's lease."""
    from _instances import make_rank

    ctx = RankGroup.build("context", pm=pm, max_peers=1, timeout=30)
    groups.append(ctx)
    gens = [make_rank("generation", f"gen-{i}-{mode}", instance_name=f"gen-{i}-{mode}") for i in range(2)]
    try:
        (_, _, first), (_, _, second) = gens
        params = ctx.txs[0].start_send(1, [1], mode=mode)
        first.start_receive(params=params, block_ids=[1])
        assert first.wait_all([1], 20)[1].state is SessionState.DONE
        assert _outcomes(ctx, [1])[1].state is SessionState.DONE
        params = ctx.txs[0].start_send(2, [2], mode=mode)
        t0 = time.monotonic()
        second.start_receive(params=params, block_ids=[2])
        out = second.wait_all([2], 20)[2]
        assert out.state is SessionState.FAILED and isinstance(out.error, E.ResourceExhaustedError), out.error
        c = _outcomes(ctx, [2], 10.0)[2]
        assert c.state is SessionState.FAILED and isinstance(c.error, E.ResourceExhaustedError), c.error
        assert time.monotonic() - t0 < 10.0
    finally:
        for agent, _, tx in gens:
            tx.close()
            agent.close()


def test_a_refusal_without_the_ticket_ends_nothing(groups: list[RankGroup], pm: Any) -> None:
    """A stranger's refusal (no ticket, or another one) leaves the request to its receiver."""
    from kvcore.control import wire

    ctx = RankGroup.build("context", pm=pm)
    gen = RankGroup.build("generation", pm=pm)
    groups.extend([ctx, gen])
    params = ctx.txs[0].start_send(1, [1], ticket=ticket_for(1))
    for ticket in (b"", ticket_for(2)):
        forged = wire.Cancel(
            v=wire.PROTOCOL_VERSION, request_id=1, instance="stranger", rank=0, reason="go away",
            ticket=ticket, refusal="IncompatiblePeerError",
        )  # fmt: skip
        gen.txs[0]._link.send(ctx.info_endpoint, forged)
    deadline = time.monotonic() + 10
    while ctx.txs[0].stats()["tickets_refused"] < 1:
        assert time.monotonic() < deadline, "the forged refusal never arrived"
        time.sleep(0.01)
    gen.txs[0].start_receive(params=params, block_ids=[2])
    assert _outcomes(gen, [1])[1].state is SessionState.DONE
    assert _outcomes(ctx, [1])[1].state is SessionState.DONE


# --- 11. smaller: mismatched id types, cancel's answer, counters apart from gauges ------------------------


def test_an_int_id_against_the_same_number_as_str_is_named_when_the_ask_expires(
    groups: list[RankGroup], pm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The context started 5 (int), the generation side asks for "5" (str): counted, logged, and the receiver's
    error says both ids and their types, at the receiver's deadline (not silently at the end of the lease)."""
    ctx = RankGroup.build("context", pm=pm, timeout=3.0)
    gen = RankGroup.build("generation", pm=pm, timeout=1.5)
    groups.extend([ctx, gen])
    ctx.txs[0].start_send(5, [1, 2], ticket=ticket_for(5))
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        # The engine forwarded the context's ticket but rebuilt the id as a str; a stranger asks for 5 as bytes.
        gen.txs[0].start_receive("5", ctx.info_endpoint, [3, 4], ticket=ticket_for(5))
        gen.txs[0].start_receive(b"5", ctx.info_endpoint, [6], ticket=ticket_for(b"5"))
        outs = _outcomes(gen, ["5", b"5"])
        deadline = time.monotonic() + 10
        while ctx.txs[0].stats()["early_requests_expired"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    out = outs["5"]
    assert out.state is not SessionState.DONE
    assert "same request id type" in str(out.error) and "'5' (str)" in str(out.error), out.error
    stranger = outs[b"5"]
    assert stranger.state is not SessionState.DONE
    assert "holds request" not in str(stranger.error), "an asker without the request's ticket learns nothing of it"
    assert ctx.txs[0].stats()["early_requests_expired"] == 2
    assert any("same request id type" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    ctx.txs[0].cancel(5)
    _outcomes(ctx, [5])


def test_cancel_answers_true_for_a_remembered_cancel_and_false_once_released(groups: list[RankGroup], pm: Any) -> None:
    ctx = RankGroup.build("context", pm=pm)
    gen = RankGroup.build("generation", pm=pm)
    groups.extend([ctx, gen])
    assert ctx.txs[0].cancel(9, "dropped before prefill finished") is True, "remembered: takes effect at start_send"
    ctx.txs[0].start_send(9, [1], ticket=ticket_for(9))
    assert _outcomes(ctx, [9])[9].state is SessionState.CANCELLED
    assert ctx.txs[0].cancel(9) is False, "already ended and released here"
    assert gen.txs[0].cancel(123) is False, "unknown on the generation side"
    params = ctx.txs[0].start_send(10, [2], ticket=ticket_for(10))
    gen.txs[0].start_receive(params=params, block_ids=[5])
    assert _outcomes(gen, [10])[10].state is SessionState.DONE
    _outcomes(ctx, [10])
    assert ctx.txs[0].cancel(10) is False and gen.txs[0].cancel(10) is False


def test_counters_export_as_events_and_never_as_live_objects(groups: list[RankGroup], pm: Any) -> None:
    """kvcore_live_objects returns to 0 when idle; the counters of stats() go to kvcore_control_events_total."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvcore.metrics import KvcoreCollector
    from kvcore.transceiver.facade import COUNTERS

    ctx = RankGroup.build("context", pm=pm)
    groups.append(ctx)
    reg = CollectorRegistry()
    reg.register(KvcoreCollector([ctx.txs[0].metrics]))
    text = generate_latest(reg).decode()
    live = {
        line.split('kind="')[1].split('"')[0] for line in text.splitlines() if line.startswith("kvcore_live_objects{")
    }
    events = {line.split('kind="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("kvcore_control_events_total{")}  # fmt: skip
    assert live and not live & COUNTERS, live & COUNTERS
    assert {c.removesuffix("_total") for c in COUNTERS} <= events, COUNTERS - events


# --- 10. shutdown: an orderly goodbye, and a typed error for a collective a rank left ----------------------


@pytest.mark.parametrize("closing", ["generation", "context"])
def test_a_normal_close_reaches_the_peer_as_a_goodbye_not_as_silence(
    groups: list[RankGroup], pm: Any, closing: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With peer_lost_timeout_s at 30 s, the peer lets the closed rank go within a few seconds, counted as closed."""
    ctx = RankGroup.build("context", pm=pm, peer_lost_timeout_s=30.0)
    gen = RankGroup.build("generation", pm=pm, peer_lost_timeout_s=30.0)
    groups.extend([ctx, gen])
    params = ctx.txs[0].start_send(1, [1, 2], ticket=ticket_for(1))
    gen.txs[0].start_receive(params=params, block_ids=[3, 4])
    assert _outcomes(gen, [1])[1].state is SessionState.DONE
    _outcomes(ctx, [1])
    closer, peer = (gen, ctx) if closing == "generation" else (ctx, gen)
    key = "gen_peers" if closing == "generation" else "ctx_instances"
    assert peer.txs[0].stats()[key] == 1
    with caplog.at_level(logging.INFO, logger="kvcore"):
        closer.txs[0].close()
        deadline = time.monotonic() + 10
        while peer.txs[0].stats()["peers_closed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    st = peer.txs[0].stats()
    assert st["peers_closed"] == 1 and st["peers_lost"] == 0, st
    said = [r for r in caplog.records if "closed" in r.getMessage() and r.name.startswith("kvcore.transceiver")]
    assert said and all(r.levelno == logging.INFO for r in said), [(r.levelname, r.getMessage()) for r in said]
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]


def test_a_forged_goodbye_lets_nothing_go(groups: list[RankGroup], pm: Any) -> None:
    """A goodbye from another connection (right names, right incarnation) is ignored; the peer still serves."""
    from kvcore.control import wire

    ctx = RankGroup.build("context", pm=pm)
    gen = RankGroup.build("generation", pm=pm)
    stranger = RankGroup.build("generation", pm=pm)
    groups.extend([ctx, gen, stranger])
    params = ctx.txs[0].start_send(1, [1], ticket=ticket_for(1))
    gen.txs[0].start_receive(params=params, block_ids=[3])
    assert _outcomes(gen, [1])[1].state is SessionState.DONE
    _outcomes(ctx, [1])
    g, c = gen.txs[0], ctx.txs[0]
    as_gen = wire.Goodbye(v=wire.PROTOCOL_VERSION, instance=g.instance_name, rank=0, incarnation=g.incarnation)
    as_ctx = wire.Goodbye(v=wire.PROTOCOL_VERSION, instance=c.instance_name, rank=0, incarnation=c.incarnation)
    stranger.txs[0]._link.send(ctx.info_endpoint, as_gen)
    stranger.txs[0]._link.send(g.endpoint, as_ctx)
    time.sleep(0.5)
    assert c.stats()["gen_peers"] == 1 and g.stats()["ctx_instances"] == 1
    params = c.start_send(2, [2], ticket=ticket_for(2))
    g.start_receive(params=params, block_ids=[5])
    assert _outcomes(gen, [2])[2].state is SessionState.DONE
    assert c.stats()["peers_closed"] == 0 and g.stats()["peers_closed"] == 0


def _collective_rank(rank: int, port: int, out: Any) -> None:
    import datetime

    import torch.distributed as dist

    from kvcore import errors as Errors
    from kvcore.control.collective import TorchCollective

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))  # fmt: skip
    c = TorchCollective()
    assert c.allgather(b"x%d" % rank) == [b"x0", b"x1"]
    if rank == 1:
        dist.destroy_process_group()  # this rank closes and leaves; rank 0 still polls
        out.put("left")
        return
    time.sleep(0.5)
    try:
        c.allgather(b"again")
        out.put("no error")
    except Errors.CollectiveError as exc:
        out.put(f"CollectiveError: {exc}")
    except Exception as exc:
        out.put(f"raw {type(exc).__name__}: {exc}")


def test_a_rank_that_left_the_collective_is_a_typed_error_on_the_others() -> None:
    import multiprocessing as mp

    from _instances import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_collective_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got[1] == "left" and got[0].startswith("CollectiveError: allgather among this instance's 2 ranks"), got


# --- pools on a GPU with the wrong device named -------------------------------------------------------------

GiB = 1 << 30
#: Synthetic segments of torch's CUDA allocator: (address, bytes, device). The pools' ranges below are checked
#: against them exactly as the Transceiver checks the real allocator's (tests/test_vram.py does that on a GPU).
SEGMENTS = [(0x7F00_0000_0000, GiB, 0), (0x7F10_0000_0000, GiB, 1)]


@pytest.mark.parametrize(
    ("regions", "device", "said"),
    [
        ([(0x7F10_0000_1000, 4096)], "cpu", "on cuda:1 .*device='cpu'.*pass device='cuda:1'"),
        ([(0x7F00_0000_0000, GiB)], "cpu", "on cuda:0 .*pass device='cuda:0'"),
        ([(0x7F10_0000_1000, 4096)], "cuda:0", "on cuda:1 .*not on the device named, 'cuda:0': pass device='cuda:1'"),
        ([(0x7F10_0000_1000, 4096)], "cuda", r"not on the device named, 'cuda' \('cuda' means 'cuda:0'.*'cuda:1'"),
        ([(0x7F00_0000_1000, 4096)], "cuda", None),  # "cuda" is cuda:0
        ([(0x7F10_0000_1000, 4096)], "cuda:1", None),
        ([(0x1000, 4096)], "cpu", None),  # host memory: nothing torch holds
        ([(0x1000, 4096)], "cuda:0", None),  # another allocator's: taken as named
        ([(0x7F00_0000_0000 + GiB - 4096, 2 * 4096)], "cpu", "on cuda:0 .*device='cpu'"),  # overlaps the end
        ([(0x1000, 4096), (0x7F10_0000_0000, 4096)], "cuda:1", None),
        ([(0x7F00_0000_0000, 0x10_0000_1000)], "cuda:0", "is on cuda:0 and cuda:1"),  # straddles both GPUs' memory
    ],
)
def test_a_pool_on_another_device_than_named_is_found(regions: list[Any], device: str, said: str | None) -> None:
    from kvcore.transport.agent_types import MemoryKind
    from kvcore.transport.devices import pool_device_mistake, pool_memory

    mistake = pool_device_mistake(regions, device, SEGMENTS)
    if said is None:
        assert mistake is None
        kind, index = pool_memory(device, regions, SEGMENTS)
        assert kind is (MemoryKind.DRAM if device == "cpu" else MemoryKind.VRAM)
        assert index == (0 if device in ("cpu", "cuda") else int(device[5:]))
    else:
        assert mistake is not None and __import__("re").search(said, mistake), mistake
        with pytest.raises(E.ConfigError) as refused:  # what the Transceiver raises before registering anything
            pool_memory(device, regions, SEGMENTS)
        assert str(refused.value) == mistake


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:", "CPU", "cuda:0 ", "", "cuda:9999", "cuda:\u0663"])
def test_a_device_kvcore_does_not_know_is_a_config_error_before_anything_is_registered(device: str) -> None:
    from _instances import rank_parts

    from kvcore.transceiver import Transceiver

    agent, _, kwargs = rank_parts("generation", f"gen-device-{len(device)}", "shm", 8)
    try:
        with pytest.raises(E.ConfigError, match=r"device must be 'cpu' or 'cuda\[:N\]', got " + repr(device)):
            Transceiver(**{**kwargs, "device": device})
        assert agent.registrations == ()
    finally:
        agent.close()


def test_the_device_check_finds_what_a_plain_scan_of_every_segment_finds() -> None:
    """The check bisects the allocator's segments; a plain scan of every segment gives the same devices."""
    import random

    from kvcore.transport.devices import pool_device_mistake

    rng = random.Random(5)
    for _ in range(2000):
        segments, pos = [], rng.randrange(1000)
        for _ in range(rng.randrange(8)):
            size = rng.randrange(1, 200)
            segments.append((pos, size, rng.randrange(3)))
            pos += size + rng.randrange(50)
        rng.shuffle(segments)
        regions = [(rng.randrange(pos + 100), rng.randrange(1, 300)) for _ in range(rng.randrange(1, 4))]
        device = rng.choice(["cpu", "cuda:0", "cuda:1", "cuda:2"])
        want = None if device == "cpu" else int(device[5:])
        expected = None
        for addr, length in regions:
            on = sorted({d for start, size, d in segments if start < addr + length and addr < start + size})
            if on and on != [want]:
                expected = "on " + " and ".join(f"cuda:{d}" for d in on) + " "
                break
        got = pool_device_mistake(regions, device, segments)
        assert (got is None) == (expected is None), (regions, device, segments, got)
        assert expected is None or expected in str(got), (regions, device, segments, got)
