"""One identity per agent name, through the transceiver, on every installed transport (issue 31, items 4 and 5).

Real processes on both sides of every boundary: the context rank runs here, generation ranks (victims,
attackers, restarts) in their own processes (``_instances``, ``_name_attacker``). Each attack is followed by a
request to the victim whose bytes are checked against the context's pattern.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from typing import Any

import numpy as np
import pytest
import torch
from _instances import ContextProcess, GenerationProcess, backend_params, fill_value, free_port, make_rank, ticket_for
from _name_attacker import Impersonator

from kvcore.errors import PeerLostError
from kvcore.testing.harness import stop_process
from kvcore.transceiver import SessionState
from kvcore.transceiver.sessions import WriterState

pytestmark = pytest.mark.timeout(300)

BACKENDS = backend_params()


class _Ctx:
    """The context rank under attack, in this process, with its pool as bytes per block."""

    def __init__(self, backend: str, closing: list[Any]) -> None:
        self.agent, cache, self.tx = make_rank("context", f"ctx-{uuid.uuid4().hex[:6]}", backend)
        closing.extend([self.agent, self.tx])
        self.flat = cache.view(cache.shape[0], -1).view(torch.uint8)

    def send(self, rid: int, blocks: list[int]) -> None:
        self.flat[blocks] = torch.from_numpy(fill_value(rid, blocks, self.flat.shape[1]))
        self.tx.start_send(rid, blocks, ticket=ticket_for(rid))

    def expect(self, gen: GenerationProcess, rid: int, src: list[int], dst: list[int]) -> None:
        """``gen`` asks for ``rid`` into ``dst``: DONE, with the bytes the context put in ``src``."""
        gen.receive(rid, self.tx.info_endpoint, dst)
        out = gen.wait_released(rid, 40)
        assert out["state"] == "DONE", out
        got = np.frombuffer(gen.read(dst), np.uint8).reshape(len(dst), -1)
        assert np.array_equal(got, fill_value(rid, src, self.flat.shape[1])), f"request {rid}: wrong bytes at DONE"


def _outcome(gen: GenerationProcess, rid: int, timeout: float = 40) -> dict[str, Any]:
    """``gen``'s outcome of ``rid`` (not its release: a refused rank may keep its pages quarantined a while)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gen._drain(0.05)
        for m in gen.events:
            if m.get("outcome") == rid:
                return m
    raise TimeoutError(f"no outcome of request {rid}")


# --- a second generation rank under a registered rank's agent name -------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_named_like_a_registered_ranks_agent_is_refused_and_the_victim_keeps_its_bytes(
    backend: str, closing: list[Any]
) -> None:
    ctx = _Ctx(backend, closing)
    name = f"gen-{uuid.uuid4().hex[:6]}"
    victim = GenerationProcess(backend, agent_name=name)
    closing.append(victim)
    ctx.send(1, [1, 2])
    ctx.expect(victim, 1, [1, 2], [3, 4])  # registered and loaded under `name`
    attacker = GenerationProcess(backend, timeout=10, agent_name=name)  # another process, the same agent name
    closing.append(attacker)
    ctx.send(2, [5, 6])
    attacker.receive(2, ctx.tx.info_endpoint, [3, 4])
    refused = ctx.tx.wait_all([2], 30)[2]
    assert refused.state is SessionState.FAILED and "already loaded" in str(refused.error), refused
    assert _outcome(attacker, 2)["state"] != "DONE"
    assert not np.frombuffer(attacker.read([3, 4]), np.uint8).any(), "the context wrote to the attacker"
    ctx.send(3, [7, 8])
    ctx.expect(victim, 3, [7, 8], [9, 10])  # the victim's agent is still the one loaded under its name
    assert ctx.tx.wait_all([3], 30)[3].state is SessionState.DONE


# --- a replayed own RankInfo (the context's agent descriptor and page table) ------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replayed_own_rank_info_never_makes_a_request_done_with_wrong_bytes(backend: str, closing: list[Any]) -> None:
    """The attacker advertises the context's own agent and pages: loading it would make the context write request 2
    over request 1's source blocks; the context refuses it, and request 1 still reaches its receiver intact."""
    ctx = _Ctx(backend, closing)
    victim = GenerationProcess(backend)
    attacker = Impersonator(backend, timeout=10)
    closing.extend([victim, attacker])
    ctx.send(1, [1, 2])
    ctx.send(2, [5, 6])
    attacker.impersonate(ctx.tx.rank_info)
    attacker.receive(2, ctx.tx.info_endpoint, [1, 2])  # "its" blocks 1, 2: the context's own blocks 1, 2
    refused = ctx.tx.wait_all([2], 30)[2]
    assert refused.state is SessionState.FAILED, refused
    assert re.search(r"never loads itself|is this agent itself", str(refused.error)), refused.error
    assert _outcome(attacker, 2)["state"] != "DONE"
    assert np.array_equal(ctx.flat[[1, 2]].numpy(), fill_value(1, [1, 2], ctx.flat.shape[1]))
    ctx.expect(victim, 1, [1, 2], [3, 4])


# --- real restarts under the same agent name: the old peer is unloaded, then the new one loaded ------------------


@pytest.mark.parametrize("how", ["kill", "clean", "frozen"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_generation_rank_restarted_under_its_agent_name_is_loaded_again(
    backend: str, how: str, closing: list[Any]
) -> None:
    """``frozen``: the old process is stopped, alive to every probe (its port too: the new one binds another), so
    only the new incarnation's registration tells the context it restarted, and the load follows at once."""
    ctx = _Ctx(backend, closing)
    opts: dict[str, Any] = {"config": {"port": free_port()}, "instance_name": "decode-a", "agent_name": "gen-a"}
    gp = GenerationProcess(backend, **opts)
    closing.append(gp)
    ctx.send(1, [1, 2])
    ctx.expect(gp, 1, [1, 2], [3, 4])
    if how == "frozen":
        stop_process(gp.pid)
        opts["config"] = {"port": free_port()}
    else:
        gp.kill() if how == "kill" else gp.close()
    gp2 = GenerationProcess(backend, **opts)
    closing.append(gp2)
    ctx.send(2, [5, 6])
    ctx.expect(gp2, 2, [5, 6], [7, 8])
    assert ctx.tx.wait_all([2], 30)[2].state is SessionState.DONE
    assert ctx.agent.remote_agents == ("gen-a",)
    st = ctx.tx.stats()
    assert st["gen_peers"] == 1 and st["peers_lost"] + st["peers_closed"] >= 1
    gp.kill()


def test_a_repeated_registration_from_another_connection_is_answered_there_and_changes_nothing(
    closing: list[Any],
) -> None:
    """A registration repeated with a registered rank's exact info (its incarnation included) is answered on the
    connection it came on, as a rank that reconnected needs; whoever sent it gets the answer and nothing else: the
    rank keeps its connection (its goodbye and declines are still its own) and its next request is served."""
    import zmq

    from kvcore.control import wire

    ctx = _Ctx("shm", closing)
    victim = GenerationProcess("shm", agent_name=f"gen-{uuid.uuid4().hex[:6]}")
    closing.append(victim)
    ctx.send(1, [1, 2])
    ctx.expect(victim, 1, [1, 2], [3, 4])
    sender = ctx.tx._sender
    with ctx.tx._link.lock:
        (peer,) = [p for p in sender.peers.values() if not p.gone]
        info, identity = peer.info, peer.identity
    auth = ctx.tx._link.auth  # this uid's local key pair, as any process of this user has it (docs/security.md)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if auth is not None:
        sock.setsockopt(zmq.CURVE_SECRETKEY, auth.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.public_key)
        sock.setsockopt(zmq.CURVE_SERVERKEY, auth.server_key)
    try:
        sock.connect(ctx.tx.info_endpoint)
        sock.send(wire.encode(wire.RegisterRankInfo(v=wire.PROTOCOL_VERSION, info=info)))
        assert sock.poll(10_000), "no answer to the repeated registration on its own connection"
        answer = wire.decode(sock.recv())
    finally:
        sock.close()
    assert isinstance(answer, wire.RegisterResult) and answer.ok
    with ctx.tx._link.lock:
        assert sender.peers[peer.key] is peer and peer.identity == identity and not peer.gone
    ctx.send(2, [5, 6])
    ctx.expect(victim, 2, [5, 6], [7, 8])


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_context_rank_restarted_under_its_agent_name_is_loaded_again(
    backend: str, mode: str, closing: list[Any]
) -> None:
    """Killed with a request of this rank still open (push: its session, not yet released, keeps the old
    instance); pull makes this rank load the context's agent on every transport."""
    gen_agent, cache, gen = make_rank("generation", f"gen-{os.getpid()}", backend)
    closing.extend([gen_agent, gen])
    flat = cache.view(cache.shape[0], -1).view(torch.uint8)
    port = free_port()

    def transfer(ctx: ContextProcess, rid: int, src: list[int], dst: list[int], open_: tuple[int, ...] = ()) -> Any:
        if mode == "pull":
            gen.start_receive(params=ctx.start_send(rid, src, mode="pull"), block_ids=dst)
        else:
            ctx.send(rid, src)
            gen.start_receive(rid, ctx.endpoint, dst, ticket=ticket_for(rid))
        outs = gen.wait_all([rid, *open_], 40)  # with the outcomes of requests still open, reported meanwhile
        assert outs[rid].state is SessionState.DONE, outs[rid].error
        assert np.array_equal(flat[dst].numpy(), fill_value(rid, src, flat.shape[1]))
        return outs

    ctx = ContextProcess(backend, config={"port": port}, agent_name="ctx-a")
    closing.append(ctx)
    transfer(ctx, 1, [1, 2], [3, 4])
    if mode == "push":
        gen.start_receive(2, ctx.endpoint, [5, 6], ticket=ticket_for(2))  # never sent: open when the context dies
        time.sleep(0.5)
    ctx.kill()
    ctx2 = ContextProcess(backend, config={"port": port}, agent_name="ctx-a")
    closing.append(ctx2)
    outs = transfer(ctx2, 3, [7, 8], [9, 10], (2,) if mode == "push" else ())
    if mode == "push":
        assert outs[2].state is not SessionState.DONE
        assert set(gen_agent.remote_agents) <= {"ctx-a"}
    else:
        assert gen_agent.remote_agents == ("ctx-a",)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_restart_learnt_before_the_timer_unloaded_its_predecessor_is_loaded(
    backend: str, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control connection can drop before the kernel marks the killed process dead: the instance is then only
    SUSPECT, and the restart is learnt from the new incarnation's info; its ranks may accept this rank before the
    timer unloaded the old incarnation's agent under the same name (a CI failure). Both made certain here: the
    disconnect proves nothing, the timer unloads nothing; the registration itself must free the name."""
    from kvcore.transceiver.receive import peers as recv_peers

    gen_agent, cache, gen = make_rank("generation", f"gen-{os.getpid()}", backend)
    closing.extend([gen_agent, gen])
    flat = cache.view(cache.shape[0], -1).view(torch.uint8)
    rx = gen._receiver
    reap = rx._reap_instances

    def late_timer(now: float) -> list[Any]:
        unload = reap(now)  # (it replaces rx.retired)
        rx.retired.extend(unload)  # what the timer would unload stays loaded
        return []

    port = free_port()
    ctx = ContextProcess(backend, config={"port": port}, agent_name="ctx-a")
    closing.append(ctx)
    gen.start_receive(params=ctx.start_send(1, [1, 2], mode="pull"), block_ids=[3, 4])
    assert gen.wait_all([1], 40)[1].state is SessionState.DONE
    first = gen_agent.remote("ctx-a").incarnation
    monkeypatch.setattr(recv_peers, "writer_fenced", lambda *a: (False, ""))
    monkeypatch.setattr(rx, "_reap_instances", late_timer)
    ctx.kill()
    ctx2 = ContextProcess(backend, config={"port": port}, agent_name="ctx-a")
    closing.append(ctx2)
    gen.start_receive(params=ctx2.start_send(3, [7, 8], mode="pull"), block_ids=[9, 10])
    out = gen.wait_all([3], 40)[3]
    assert out.state is SessionState.DONE, out.error
    assert np.array_equal(flat[[9, 10]].numpy(), fill_value(3, [7, 8], flat.shape[1]))
    assert gen.stats()["peers_lost"] == 1  # the restart was learnt (the old incarnation lost), not missed
    with gen._link.lock:
        assert rx.retired == [] and rx.awaiting_name == []  # the old one unloaded by the registration itself
    assert gen_agent.remote_agents == ("ctx-a",)
    assert gen_agent.remote("ctx-a").incarnation != first


def _restart_with_a_request_open(
    backend: str, closing: list[Any], monkeypatch: pytest.MonkeyPatch, config: dict[str, Any] | None = None
) -> tuple[Any, Any, Any, Any, str]:
    """A generation rank here and context "ctx-a" killed with request 2 asked of it and unanswered, then restarted
    at the same endpoint, with nothing proving the old one dead (``writer_fenced`` patched until ``undo``); request 3
    is sent by the new one and asked. Returns ``(gen agent, gen, its pool as bytes per block, the new context,
    the old incarnation)``, the incarnation "" where the transport loads no context agent in push mode."""
    from kvcore.transceiver.receive import peers as recv_peers

    gen_agent, cache, gen = make_rank("generation", f"gen-{os.getpid()}", backend, config=config)
    closing.extend([gen_agent, gen])
    flat = cache.view(cache.shape[0], -1).view(torch.uint8)
    rx = gen._receiver
    port = free_port()
    ctx = ContextProcess(backend, config={"port": port}, agent_name="ctx-a")
    closing.append(ctx)
    ctx.send(1, [1, 2])
    gen.start_receive(1, ctx.endpoint, [3, 4], ticket=ticket_for(1))
    assert gen.wait_all([1], 40)[1].state is SessionState.DONE
    # Transports where the writer needs nothing loaded on the reader's side in push mode (UCX, Mooncake) have no
    # name to wait for: there the new incarnation is served at once.
    first = gen_agent.remote("ctx-a").incarnation if "ctx-a" in gen_agent.remote_agents else ""
    gen.start_receive(2, ctx.endpoint, [5, 6], ticket=ticket_for(2))  # asked, never sent
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # its RequestData went out: the old writer may write into it from now on
        with gen._link.lock:
            s2 = rx.rx.get(2)
            if s2 is not None and WriterState.ASKED in s2.writers.values():
                break
        time.sleep(0.02)
    else:
        pytest.fail("request 2 was never asked of the context")
    monkeypatch.setattr(recv_peers, "writer_fenced", lambda *a: (False, ""))  # nothing proves the old one dead
    ctx.kill()
    ctx2 = ContextProcess(backend, config={"port": port}, agent_name="ctx-a")
    closing.append(ctx2)
    ctx2.send(3, [7, 8])
    gen.start_receive(3, ctx2.endpoint, [9, 10], ticket=ticket_for(3))
    return gen_agent, gen, flat, ctx2, first


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_restarted_context_waits_for_its_predecessor_to_be_fenced_before_it_is_loaded(
    backend: str, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with a request still open on the old incarnation (asked, never answered): its writer may still
    write until it is fenced, so its agent keeps the name, and the new incarnation's load waits (it is not
    refused). Once the old writer is proven dead, the timer unloads it and the waiting load goes through."""
    gen_agent, gen, flat, _, first = _restart_with_a_request_open(backend, closing, monkeypatch)
    rx = gen._receiver
    loads = bool(first)
    if not loads:
        outs = gen.wait_all([3], 40)
        assert outs[3].state is SessionState.DONE, outs[3].error
        assert np.array_equal(flat[[9, 10]].numpy(), fill_value(3, [7, 8], flat.shape[1]))
        assert gen_agent.remote_agents == () and rx.awaiting_name == []
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with gen._link.lock:
            if rx.awaiting_name:
                break
        time.sleep(0.05)
    with gen._link.lock:
        assert rx.awaiting_name, "the new incarnation's load did not wait for its predecessor"
    assert gen_agent.remote("ctx-a").incarnation == first  # the old agent keeps the name meanwhile
    monkeypatch.undo()  # the old writer is now proven dead (its process is gone): fenced, unloaded
    outs = gen.wait_all([3, 2], 40)
    assert outs[3].state is SessionState.DONE, outs[3].error
    assert np.array_equal(flat[[9, 10]].numpy(), fill_value(3, [7, 8], flat.shape[1]))
    assert outs[2].state is not SessionState.DONE
    assert gen.stats()["fenced_dead"] >= 1
    assert gen_agent.remote("ctx-a").incarnation != first


def test_a_restarted_context_not_loaded_in_time_says_its_predecessor_holds_the_name(
    closing: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """While the old writer is not settled, the new incarnation cannot be loaded; past the first-contact timeout
    its requests fail saying so (not "no answer", which would blame the new context). shm: the transport whose
    generation rank loads the context's agent in push mode. Once the old writer is proven dead, the next request
    is served."""
    caplog.set_level(logging.INFO, logger="kvcore.transceiver")
    gen_agent, gen, flat, ctx2, first = _restart_with_a_request_open(
        "shm", closing, monkeypatch, config={"first_contact_timeout_s": 3.0}
    )
    out = gen.wait_all([3], 40)[3]
    assert out.state is SessionState.FAILED
    assert isinstance(out.error, PeerLostError)
    assert re.search(
        r"restarted and could not be loaded within 3\.0s: its agent name 'ctx-a' is still held", str(out.error)
    )
    assert any("is loaded once the previous incarnation's writers are settled" in r.message for r in caplog.records)
    assert gen_agent.remote("ctx-a").incarnation == first
    monkeypatch.undo()  # the old writer is now proven dead: fenced, unloaded; the next request loads the new one
    ctx2.send(4, [11, 12])
    gen.start_receive(4, ctx2.endpoint, [13, 14], ticket=ticket_for(4))
    out = gen.wait_all([4], 40)[4]
    assert out.state is SessionState.DONE, out.error
    assert np.array_equal(flat[[13, 14]].numpy(), fill_value(4, [11, 12], flat.shape[1]))
    assert gen_agent.remote("ctx-a").incarnation != first
