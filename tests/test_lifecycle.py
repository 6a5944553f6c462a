"""Peer and request lifecycles off the happy path, with real processes on every installed transport.

Restarts at the same endpoint (SIGKILL and clean), repeated kill -9 of either side
with the survivor back at its baseline, cancel races under load, late receivers,
a dead writer on "another host", and the input checks that keep bytes from
landing in the wrong place.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from _instances import ContextProcess, GenerationProcess, backend_params, fill_value, free_port, make_rank, ticket_for

from kvcore import errors as E
from kvcore.transceiver import SessionState, leaks

pytestmark = pytest.mark.timeout(300)

BACKENDS = backend_params()


class Gen:
    """An in-process one-rank generation instance."""

    def __init__(
        self, backend: str = "shm", num_blocks: int = 64, timeout: float = 30.0, name: str = "", **config: Any
    ) -> None:
        self.agent, self.cache, self.tx = make_rank(
            "generation", name or f"gen-{os.getpid()}", backend, num_blocks, timeout, config, instance_name=name or None
        )
        self.flat = self.cache.view(num_blocks, -1).view(torch.uint8)

    def close(self) -> None:
        self.tx.close()
        self.agent.close()


def _expect(flat: torch.Tensor, rid: int, src: list[int], dst: list[int]) -> None:
    want = fill_value(rid, src, flat.shape[1])
    assert np.array_equal(flat[dst].numpy(), want), f"request {rid}: bytes differ from the context's pattern"


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _settled_resources(timeout: float = 20.0) -> dict[str, int]:
    """``_resources()`` once two readings half a second apart agree (background closes have finished)."""
    last, deadline = _resources(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _resources()
        if now == last:
            return now
        last = now
    return last


def _resources() -> dict[str, int]:
    """This process's fds, threads and kvcore shared-memory mappings."""
    maps = open("/proc/self/maps").read().splitlines()
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "shm_maps": sum(1 for m in maps if "kvcore-shm" in m),
    }


# --- restarts at the same endpoint -----------------------------------------------------------------


@pytest.mark.parametrize("how", ["kill", "clean"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_context_restart_at_the_same_endpoint_then_next_request_done(
    backend: str, how: str, closing: list[Any]
) -> None:
    port = free_port()
    gen = Gen(backend)
    closing.append(gen)
    ctx = ContextProcess(backend, config={"port": port})
    closing.append(ctx)
    endpoint = ctx.endpoint
    assert endpoint.endswith(f":{port}")
    ctx.send(1, [1, 2])
    gen.tx.start_receive(1, endpoint, [3, 4], ticket=ticket_for(1))
    assert gen.tx.wait_all([1], 30)[1].state is SessionState.DONE
    _expect(gen.flat, 1, [1, 2], [3, 4])
    if how == "kill":
        ctx.kill()
    else:
        ctx.close()
    ctx2 = ContextProcess(backend, config={"port": port})
    closing.append(ctx2)
    assert ctx2.endpoint == endpoint
    ctx2.send(2, [5, 6])
    gen.tx.start_receive(2, endpoint, [7, 8], ticket=ticket_for(2))
    out = gen.tx.wait_all([2], 40)[2]
    assert out.state is SessionState.DONE, out.error
    _expect(gen.flat, 2, [5, 6], [7, 8])
    st = gen.tx.stats()
    # A killed incarnation is lost; a closed one said goodbye (counted as closed): either way it is gone.
    assert st["peers_lost"] + st["peers_closed"] >= 1, "the old incarnation was never let go"
    # Push: the receiver loads a context's identity only where the transport needs it (shm: it hands its memfds
    # to loaded peers only); nixl and ucx load no context agent at all. Either way the old one is not kept.
    loaded = 1 if backend == "shm" else 0
    _wait(lambda: gen.tx.stats()["remote_agents"] == loaded, 10, "the old incarnation's agent to be unloaded")
    assert gen.tx.leaks() == {}


@pytest.mark.parametrize("how", ["kill", "clean"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_generation_restart_at_the_same_endpoint_then_next_request_done(
    backend: str, how: str, closing: list[Any]
) -> None:
    port = free_port()
    agent, cache, ctx = make_rank("context", f"ctx-{os.getpid()}", backend)
    closing.extend([agent, ctx])
    flat = cache.view(cache.shape[0], -1).view(torch.uint8)
    opts = {"config": {"port": port}, "instance_name": "decode-a"}  # the same name: a restart, not a new peer
    gp = GenerationProcess(backend, **opts)
    closing.append(gp)
    flat[[1, 2]] = torch.from_numpy(fill_value(1, [1, 2], flat.shape[1]))
    ctx.start_send(1, [1, 2], ticket=ticket_for(1))
    gp.receive(1, ctx.info_endpoint, [3, 4])
    assert gp.wait_released(1, 30)["state"] == "DONE"
    assert ctx.wait_all([1], 30)[1].state is SessionState.DONE
    if how == "kill":
        gp.kill()
    else:
        gp.close()
    gp2 = GenerationProcess(backend, **opts)
    closing.append(gp2)
    assert gp2.endpoint == gp.endpoint
    flat[[5, 6]] = torch.from_numpy(fill_value(2, [5, 6], flat.shape[1]))
    ctx.start_send(2, [5, 6], ticket=ticket_for(2))
    gp2.receive(2, ctx.info_endpoint, [7, 8])
    out = gp2.wait_released(2, 40)
    assert out["state"] == "DONE", out
    got = np.frombuffer(gp2.read([7, 8]), np.uint8).reshape(2, -1)
    assert np.array_equal(got, fill_value(2, [5, 6], flat.shape[1]))
    assert ctx.wait_all([2], 30)[2].state is SessionState.DONE
    _wait(lambda: ctx.stats()["remote_agents"] == 1, 15, "the dead generation rank's agent to be unloaded")
    st = ctx.stats()
    assert st["gen_peers"] == 1 and st["peers_lost"] + st["peers_closed"] >= 1
    assert ctx.leaks() == {}


# --- repeated kill -9 of either side --------------------------------------------------------------


def _dead_files(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/kvcore-shm-{pid}-*")


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_kill_of_the_generation_side_leaves_the_context_at_baseline(backend: str, closing: list[Any]) -> None:
    agent, _, ctx = make_rank("context", f"ctx-{os.getpid()}", backend, num_blocks=256)
    closing.extend([agent, ctx])
    baseline: dict[str, int] | None = None
    for round_ in range(3):
        gp = GenerationProcess(backend, num_blocks=256)
        warm = 100 * round_ + 99  # first contact done: the kill below lands on a peer this rank has loaded
        ctx.start_send(warm, [255], ticket=ticket_for(warm))
        gp.receive(warm, ctx.info_endpoint, [255])
        assert ctx.wait_all([warm], 30)[warm].state is SessionState.DONE
        rids = [100 * round_ + i for i in range(8)]
        for i, rid in enumerate(rids):
            gp.receive(rid, ctx.info_endpoint, list(range(i * 32, (i + 1) * 32)))
        n = len(rids)
        _wait(lambda n=n: ctx.stats()["early_requests"] == n, 20, "the receivers' requests")
        for i, rid in enumerate(rids):
            ctx.start_send(rid, list(range(i * 32, (i + 1) * 32)), ticket=ticket_for(rid))
        gp.kill()  # mid-transfer, or just after: either way the survivor must end clean
        outs = ctx.wait_all(rids, 60)
        assert all(o.state in (SessionState.DONE, SessionState.FAILED) for o in outs.values())
        _wait(lambda: ctx.stats()["remote_agents"] == 0, 20, "the dead peer to be unloaded")
        _wait(lambda: ctx.stats()["control_connections"] == 0, 20, "the dead peer's socket to be closed")
        assert ctx.leaks() == {}
        gp.close()
        if baseline is None:
            baseline = _settled_resources()
        else:
            base = baseline
            # No growth (a leak); fewer is fine: the first round's baseline may still hold lazily released state.
            _wait(
                lambda base=base: all(v <= base[k] for k, v in _resources().items()),
                20,
                f"fds/threads/mappings back at or below {base} ({_resources()})",
            )
        _wait(lambda pid=gp.pid: _dead_files(pid) == [], 10, "the dead process's shared-memory files to be removed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_kill_of_the_context_side_leaves_the_generation_at_baseline(backend: str, closing: list[Any]) -> None:
    gen = Gen(backend, num_blocks=256)
    closing.append(gen)
    baseline: dict[str, int] | None = None
    for round_ in range(3):
        ctx = ContextProcess(backend, num_blocks=256)
        warm = 100 * round_ + 99  # first contact done: the kill below lands on a peer this rank has loaded
        ctx.send(warm, [255])
        gen.tx.start_receive(warm, ctx.endpoint, [255], ticket=ticket_for(warm))
        assert gen.tx.wait_all([warm], 30)[warm].state is SessionState.DONE
        rids = [100 * round_ + i for i in range(8)]
        for i, rid in enumerate(rids):
            ctx.send(rid, list(range(i * 32, (i + 1) * 32)))
            gen.tx.start_receive(rid, ctx.endpoint, list(range(i * 32, (i + 1) * 32)), ticket=ticket_for(rid))
        ctx.kill()
        outs = gen.tx.wait_all(rids, 60)
        for o in outs.values():
            assert o.state is SessionState.DONE or isinstance(o.error, E.PeerLostError), o
        _wait(lambda: gen.tx.stats()["remote_agents"] == 0, 20, "the dead context's agent to be unloaded")
        _wait(lambda: gen.tx.stats()["control_connections"] == 0, 20, "the dead context's socket to be closed")
        assert gen.tx.leaks() == {}
        ctx.close()
        if baseline is None:
            baseline = _settled_resources()
        else:
            base = baseline
            # No growth (a leak); fewer is fine: the first round's baseline may still hold lazily released state.
            _wait(
                lambda base=base: all(v <= base[k] for k, v in _resources().items()),
                20,
                f"fds/threads/mappings back at or below {base} ({_resources()})",
            )
        _wait(lambda pid=ctx.pid: _dead_files(pid) == [], 10, "the dead process's shared-memory files to be removed")


# --- the cancel-race soak --------------------------------------------------------------------------


def _soak_count(backend: str) -> int:
    return int(os.environ.get("KVCORE_SOAK_REQUESTS", "10000"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_soak_with_cancels_from_both_sides_every_request_terminal_and_released(
    backend: str, closing: list[Any]
) -> None:
    """Many requests, 512 in flight, random cancels from both sides at random moments: each one outcome, one release.

    Every DONE request's bytes are checked at the moment DONE is reported, before its slot can be reused.
    """
    total, window, nblocks = _soak_count(backend), 512, 1024
    gen = Gen(backend, num_blocks=nblocks, timeout=60.0)
    closing.append(gen)
    ctx = ContextProcess(backend, num_blocks=nblocks, timeout=60.0)
    closing.append(ctx)
    rng = np.random.default_rng(11)
    gen_cancel = set(rng.choice(total, total // 20, replace=False).tolist())
    ctx_cancel = set(rng.choice(total, total // 20, replace=False).tolist())
    outcomes: dict[int, SessionState] = {}
    released: set[int] = set()
    slot: dict[int, int] = {}
    src_of: dict[int, int] = {}
    free = list(range(nblocks))
    started = 0
    deadline = time.monotonic() + 600
    while len(released) < total:
        assert time.monotonic() < deadline, f"stuck: {len(released)} of {total} released, {gen.tx.stats()}"
        while started < total and started - len(released) < window and free:
            r = started
            slot[r] = free.pop()
            src_of[r] = slot[r]  # exclusive on both sides until the generation side releases it
            if r % 3 == 0:
                gen.tx.start_receive(r, ctx.endpoint, [slot[r]], ticket=ticket_for(r))
                ctx.send(r, [src_of[r]])
            else:
                ctx.send(r, [src_of[r]])
                gen.tx.start_receive(r, ctx.endpoint, [slot[r]], ticket=ticket_for(r))
            started += 1
            if r - 5 in gen_cancel:
                gen.tx.cancel(r - 5)
            if r - 3 in ctx_cancel:
                ctx.cancel(r - 3)
        ctx._drain()  # keep the context process's report pipe flowing
        res = gen.tx.poll()
        for o in res.outcomes:
            assert o.request_id not in outcomes, f"request {o.request_id} reported twice"
            outcomes[o.request_id] = o.state
            if o.state is SessionState.DONE:
                _expect(gen.flat, o.request_id, [src_of[o.request_id]], [slot[o.request_id]])
        for rid in res.released:
            assert rid in outcomes and rid not in released, f"request {rid}: released twice or before its outcome"
            released.add(rid)
            gen.flat[slot[rid]] = 0
            free.append(slot.pop(rid))
    assert len(outcomes) == total
    assert set(outcomes.values()) <= {SessionState.DONE, SessionState.CANCELLED}
    assert list(outcomes.values()).count(SessionState.DONE) >= total - len(gen_cancel) - len(ctx_cancel)
    assert gen.tx.leaks() == {}
    # The context side reports each request once and releases it once, and ends with nothing held.
    _wait(lambda: not leaks(ctx.stats()), 60, "the context side to settle")
    ctx._drain()
    ctx_out = [e["outcome"] for e in ctx.events if "outcome" in e]
    ctx_rel = [e["released"] for e in ctx.events if "released" in e]
    assert len(ctx_out) == len(set(ctx_out)) == total
    assert len(ctx_rel) == len(set(ctx_rel)) == total
    # A receiver's cancel reaches the context side whatever the moment: none of its requests waits out its timeout.
    odd = {e["outcome"]: (e["state"], e["error"]) for e in ctx.events if "outcome" in e}
    odd = {r: v for r, v in odd.items() if v[0] not in ("DONE", "CANCELLED")}
    assert not odd, f"context-side outcomes other than DONE/CANCELLED: {dict(list(odd.items())[:5])}"


# --- late receivers ----------------------------------------------------------------------------------


def test_late_receiver_after_a_cancelled_send_gets_the_outcome_at_once(closing: list[Any]) -> None:
    agent, _, ctx = make_rank("context", f"ctx-{os.getpid()}", timeout=30)
    closing.extend([agent, ctx])
    gen = Gen(timeout=30)
    closing.append(gen)
    ctx.start_send(5, [1], ticket=ticket_for(5))
    assert ctx.cancel(5)
    assert ctx.wait_all([5], 10)[5].state is SessionState.CANCELLED  # released: only a tombstone is left
    t0 = time.monotonic()
    gen.tx.start_receive(5, ctx.info_endpoint, [2], ticket=ticket_for(5))
    out = gen.tx.wait_all([5], 25)[5]
    assert out.state is SessionState.CANCELLED, out  # not TIMED_OUT after request_timeout_s
    assert time.monotonic() - t0 < 15, "the late receiver waited for its timeout instead of the tombstone"
    assert not gen.flat[2].any()


def test_late_receiver_after_a_failed_send_gets_the_failure_at_once(closing: list[Any]) -> None:
    agent, _, ctx = make_rank("context", f"ctx-{os.getpid()}", timeout=30)
    closing.extend([agent, ctx])
    # Two instances in one process: two names (the same name would be refused as a takeover of a live agent).
    early, late = Gen(timeout=30, name="gen-early"), Gen(timeout=30, name="gen-late")
    closing.extend([early, late])
    ctx.start_send(6, [1, 2], prompt_len=16, ticket=ticket_for(6))
    early.tx.start_receive(
        6, ctx.info_endpoint, [3, 4], prompt_len=9, ticket=ticket_for(6)
    )  # disagrees: the send fails
    e = early.tx.wait_all([6], 20)[6]
    assert e.state is SessionState.FAILED and isinstance(e.error, E.MappingError)
    assert "16" in str(e.error) and "9" in str(e.error), e.error  # both values named
    assert ctx.wait_all([6], 20)[6].state is SessionState.FAILED
    late.tx.start_receive(6, ctx.info_endpoint, [3, 4], prompt_len=16, ticket=ticket_for(6))
    out = late.tx.wait_all([6], 25)[6]
    assert out.state is SessionState.FAILED and isinstance(out.error, E.MappingError), out
    assert not early.flat[[3, 4]].any() and not late.flat[[3, 4]].any()


def test_cancel_during_first_contact_lets_the_context_go_at_once(closing: list[Any]) -> None:
    """A receive cancelled before its context instance was even reached: the context is told once it is."""
    agent, _, ctx = make_rank("context", f"ctx-{os.getpid()}", timeout=60)
    closing.extend([agent, ctx])
    gen = Gen(timeout=60)
    closing.append(gen)
    ctx.start_send(3, [1], ticket=ticket_for(3))
    gen.tx.start_receive(3, ctx.info_endpoint, [2], ticket=ticket_for(3))
    assert gen.tx.cancel(3)  # first contact is still under way: nobody was asked yet
    assert gen.tx.wait_all([3], 20)[3].state is SessionState.CANCELLED
    out = ctx.wait_all([3], 20)[3]  # far sooner than its 60 s request timeout
    assert out.state is SessionState.CANCELLED, out
    assert "declined" in str(out.error)
    assert not gen.flat[2].any()


# --- fencing -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("other_host", [False, True])
def test_dead_writer_is_fenced_same_host_at_once_other_host_after_the_grace(
    other_host: bool, closing: list[Any]
) -> None:
    grace = 3.0
    gen = Gen(timeout=60, fencing_grace_s=grace, peer_lost_timeout_s=1.0)
    closing.append(gen)
    env = {"KVCORE_HOST_ID": "another-host"} if other_host else None
    ctx = ContextProcess(timeout=60, env=env)
    closing.append(ctx)
    gen.tx.start_receive(9, ctx.endpoint, [1], ticket=ticket_for(9))
    _wait(lambda: ctx.stats()["early_requests"] == 1, 10, "the request to reach the context")
    ctx.kill()
    t_kill = time.monotonic()
    outcome, t_release = None, None
    deadline = time.monotonic() + 30
    while t_release is None:
        assert time.monotonic() < deadline, f"never released: {gen.tx.stats()}"
        r = gen.tx.poll()
        outcome = outcome or next((o for o in r.outcomes if o.request_id == 9), None)
        if 9 in r.released:
            t_release = time.monotonic()
        time.sleep(0.01)
    assert outcome is not None and isinstance(outcome.error, E.PeerLostError), outcome
    st = gen.tx.stats()
    if other_host:
        assert st["fenced_grace"] == 1 and st["fenced_dead"] == 0
        assert t_release - t_kill >= grace, "a writer on another host was released before its fencing grace"
    else:
        assert st["fenced_dead"] == 1 and st["fenced_grace"] == 0
    assert gen.tx.leaks() == {}


# --- first contact, refusals and input checks ---------------------------------------------------------


def test_first_contact_with_nobody_fails_after_first_contact_timeout(closing: list[Any]) -> None:
    gen = Gen(timeout=60, first_contact_timeout_s=1.0)
    closing.append(gen)
    gen.tx.start_receive(1, f"tcp://127.0.0.1:{free_port()}", [0], ticket=ticket_for(1))
    out = gen.tx.wait_all([1], 20)[1]  # far sooner than request_timeout_s
    assert out.state is SessionState.FAILED and isinstance(out.error, E.PeerLostError), out
    assert "no answer" in str(out.error)
    _wait(lambda: gen.tx.stats()["ctx_instances"] == 0 and gen.tx.stats()["control_connections"] == 0, 10, "cleanup")


def test_refused_instance_is_forgotten_after_its_ttl(closing: list[Any]) -> None:
    ctx = ContextProcess()
    closing.append(ctx)
    agent, _, tx = make_rank("generation", "gen-x", config={"refused_peer_ttl_s": 1.0}, head_dim=64)
    closing.extend([agent, tx])
    tx.start_receive(1, ctx.endpoint, [0], ticket=ticket_for(1))
    out = tx.wait_all([1], 20)[1]
    assert isinstance(out.error, E.IncompatiblePeerError) and "head_dim" in str(out.error)
    tx.start_receive(2, ctx.endpoint, [0], ticket=ticket_for(2))  # cached: fails at once
    assert isinstance(tx.wait_all([2], 5)[2].error, E.IncompatiblePeerError)
    _wait(lambda: tx.stats()["ctx_instances"] == 0, 10, "the refusal to expire")


@pytest.mark.parametrize(
    ("blocks", "match"),
    [
        ([3, 3], "appears 2 times"),
        ([1.9], "integer block ids"),
        ([-1], "0..63"),
        ([2**63], "0..63"),
        ([2**64], "integer block ids"),
        ([True], "integer block ids"),
    ],
)
def test_block_ids_are_checked_at_the_call(blocks: list[Any], match: str, closing: list[Any]) -> None:
    gen = Gen()
    closing.append(gen)
    with pytest.raises(E.LayoutError, match=match):
        gen.tx.start_receive(1, "tcp://127.0.0.1:1", blocks, ticket=ticket_for(1))
    agent, _, ctx = make_rank("context", "ctx-checks")
    closing.extend([agent, ctx])
    with pytest.raises(E.LayoutError, match=match):
        ctx.start_send(1, blocks, ticket=ticket_for(1))
    assert gen.tx.leaks() == {} and ctx.leaks() == {}


def _hybrid_rank(role: str, ssm_dtype: str, mamba_arg: bool) -> tuple[Any, Any]:
    """A one-rank hybrid instance: attention KV plus Mamba2 state whose SSM dtype is ``ssm_dtype``."""
    from kvcore.config import TransceiverConfig, create_agent
    from kvcore.layout.builders import allocate_kv_cache, allocate_mamba_state, build_page_table
    from kvcore.layout.page import PageTable
    from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology
    from kvcore.transceiver import Transceiver

    geo = AttentionGeometry(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=8, dtype="bfloat16")
    mg = MambaGeometry(
        layers=(1,), conv_sections=(32, 8, 8), d_conv=4, nheads=4, head_dim=8, d_state=8,
        conv_dtype="bfloat16", ssm_dtype=ssm_dtype,
    )  # fmt: skip
    topo = Topology.create(tp_size=1, pp_size=1, rank=0, num_layers=2)
    cfg = TransceiverConfig(backend="shm", request_timeout_s=20)
    agent = create_agent(cfg, f"{role}-hybrid")
    kv = allocate_kv_cache(topo, geo, 8, allocator=agent.allocate_tensor)
    conv, ssm = allocate_mamba_state(topo, mg, 4, allocator=agent.allocate_tensor)
    table = PageTable.combine(
        [
            build_page_table("head_major_pool", kv, topology=topo, geometry=geo),
            build_page_table("mamba_state", conv, ssm, topology=topo, geometry=mg),
        ]
    )
    tx = Transceiver(
        cfg, role=role, agent=agent, topology=topo, geometry=geo, page_table=table, mamba=mg if mamba_arg else None
    )
    return agent, tx


@pytest.mark.parametrize("declared", [True, False], ids=["mamba-geometry-declared", "page-table-only"])
def test_mamba_state_dtype_mismatch_is_refused_at_first_contact(declared: bool, closing: list[Any]) -> None:
    """SSM state float16 on one side and bfloat16 on the other: refused, never DONE with garbage."""
    ca, ctx = _hybrid_rank("context", "float16", declared)
    ga, gen = _hybrid_rank("generation", "bfloat16", declared)
    closing.extend([ca, ctx, ga, gen])
    ctx.start_send(1, [0, 1], state_slot=0, ticket=ticket_for(1))
    gen.start_receive(1, ctx.info_endpoint, [2, 3], state_slot=1, ticket=ticket_for(1))
    out = gen.wait_all([1], 20)[1]
    assert out.state is SessionState.FAILED and isinstance(out.error, E.IncompatiblePeerError), out
    assert "dtype" in str(out.error) and "float16" in str(out.error), out.error


def test_poll_from_two_threads_reports_each_outcome_once(closing: list[Any]) -> None:
    ctx = ContextProcess(num_blocks=256)
    closing.append(ctx)
    gen = Gen(num_blocks=256)
    closing.append(gen)
    rids = list(range(200))
    for r in rids:
        ctx.send(r, [r])
        gen.tx.start_receive(r, ctx.endpoint, [r], ticket=ticket_for(r))
    seen: list[int] = []
    rel: list[int] = []
    lock = threading.Lock()

    def poller() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with lock:
                if len(rel) >= len(rids):
                    return
            res = gen.tx.poll()
            with lock:
                seen.extend(o.request_id for o in res.outcomes)
                rel.extend(res.released)

    threads = [threading.Thread(target=poller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == rids and sorted(rel) == rids
