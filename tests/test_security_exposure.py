"""What of its memory a rank exposes, and to whom (issue 31, items 1 to 3), with real processes and a second uid.

- By default every rank authenticates with this user's local key: another uid can neither ask a context for its
  ranks nor pose as a context a tenant named (items 1 to 3 played by a stranger).
- ``InstanceInfo`` (what anyone who connects may ask) carries no agent descriptor, pid or key (item 2).
- A context in push mode exposes nothing of its pool to the generation ranks it writes to (item 1): on shm its
  memfds are refused to them, on nixl and ucx they never get a descriptor of it.
- In pull mode a context exposes its memory to a generation rank only once it shows the ticket of a pull
  request held there (item 1, the pull receiver).
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from _instances import ContextProcess, fill_value, free_port, make_rank, ticket_for
from _local_auth import as_uid, local_dealer
from _shm_attacker import steal

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.auth import local_key_dir
from kvcore.transceiver import SessionState
from kvcore.transport.agent import TransferAgent, TransferOp, process_incarnation

NOBODY = 65534
BACKENDS = ["shm", "nixl", "ucx"]


def _backend(name: str) -> str:
    if name != "shm" and importlib.util.find_spec(f"kvcore_{name}") is None:
        pytest.skip(f"kvcore-{name} is not installed (pip install ./plugins/{name})")
    return name


class _Gen:
    """A generation rank in this process: the tenant (honest or not) whose agent we inspect."""

    def __init__(self, backend: str, **config: Any) -> None:
        self.agent, cache, self.tx = make_rank("generation", f"gen-{os.urandom(3).hex()}", backend, config=config)
        self.flat = cache.view(64, -1).view(torch.uint8)

    def outcome(self, rid: Any, timeout: float = 30.0) -> Any:
        return self.tx.wait_all([rid], timeout)[rid]

    def close(self) -> None:
        self.tx.close()
        self.agent.close()


def _ctx_info(ctx: ContextProcess) -> wire.RankInfo:
    return msgspec.msgpack.decode(ctx.call("rank_info")["info"], type=wire.RankInfo)


@pytest.mark.parametrize("backend", BACKENDS)
def test_instance_info_tells_no_descriptor_pid_or_key(backend: str, closing: list[Any]) -> None:
    """Item 2: anyone admitted may ask a context for its ranks; the answer names endpoints and layouts, nothing to
    reach its memory (no remote key, no NIXL metadata, no memfd socket) or its process with."""
    ctx = ContextProcess(_backend(backend))
    closing.append(ctx)
    sock = local_dealer(ctx.endpoint)
    try:
        sock.send(
            wire.encode(wire.InstanceInfoRequest(v=wire.PROTOCOL_VERSION, min_version=1, max_version=1, asker="x"))
        )
        assert sock.poll(10_000), "no InstanceInfo"
        info = wire.decode(sock.recv())
        assert isinstance(info, wire.InstanceInfo) and info.ranks
        for r in info.ranks:
            assert (r.agent_descriptor, r.pid, r.start_time, r.host_id) == (b"", 0, 0, "")
            assert r.endpoint == ctx.endpoint and r.incarnation
    finally:
        sock.close(0)
    assert _ctx_info(ctx).agent_descriptor, "the rank itself has a full descriptor"


def _ask_as_stranger(endpoint: str) -> dict[str, Any]:
    """Child, another uid: read the local key, then ask the rank for its instance info without it."""
    try:
        open(local_key_dir() / "local.key_secret", "rb").close()
        key = "read"
    except OSError as exc:
        key = type(exc).__name__
    zctx = zmq.Context()
    s = zctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send(wire.encode(wire.InstanceInfoRequest(v=wire.PROTOCOL_VERSION, min_version=1, max_version=1, asker="m")))
    answered = bool(s.poll(3000))
    s.close(0)
    zctx.term()
    return {"key": key, "answered": answered}


def test_another_uid_gets_nothing_from_a_rank_by_default(closing: list[Any]) -> None:
    """No set-up: the rank serves CURVE with this user's key; uid nobody cannot read it and gets no answer."""
    ctx = ContextProcess("shm")
    closing.append(ctx)
    out = as_uid(NOBODY, _ask_as_stranger, ctx.endpoint)
    assert out == {"key": "PermissionError", "answered": False}
    gen = _Gen("shm")
    closing.append(gen)
    ctx.send(1, [1, 2])  # and an instance of this user still gets its request
    gen.tx.start_receive(1, ctx.endpoint, [3, 4], ticket=ticket_for(1))
    assert gen.outcome(1).state is SessionState.DONE


def _silent_context(port: int, seconds: float) -> int:
    """Child, another uid: a ROUTER posing as a context at ``port``; how many frames reached it."""
    zctx = zmq.Context()
    s = zctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(f"tcp://127.0.0.1:{port}")
    frames, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        if s.poll(100):
            s.recv_multipart()
            frames += 1
    s.close(0)
    zctx.term()
    return frames


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_context_of_another_uid_that_a_tenant_names_learns_nothing(backend: str, closing: list[Any]) -> None:
    """Item 3 by a stranger: parameters name a 'context' run by uid nobody. Our generation rank's handshake fails
    (it cannot prove this user's key): no frame reaches it, no registration, no descriptor of our memory."""
    port = free_port()
    result: dict[str, Any] = {}
    child = threading.Thread(target=lambda: result.update(frames=as_uid(NOBODY, _silent_context, port, 6.0)))
    child.start()
    gen = _Gen(_backend(backend), first_contact_timeout_s=3.0)
    closing.append(gen)
    try:
        time.sleep(0.5)  # the child binds
        gen.tx.start_receive(7, f"tcp://127.0.0.1:{port}", [1], ticket=ticket_for(7))
        out = gen.outcome(7)
    finally:
        child.join(30)
    assert out.state is not SessionState.DONE
    assert result.get("frames") == 0, result
    assert gen.agent.remote_agents == ()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_push_context_exposes_nothing_to_the_ranks_it_writes_to(backend: str, closing: list[Any]) -> None:
    """Item 1: a tenant's generation rank registered with the context (it received a request) tries to read the
    context's pool, addresses known: nothing of the pool is reachable. Other requests stay the context's."""
    _backend(backend)
    ctx = ContextProcess(backend)
    closing.append(ctx)
    gen = _Gen(backend)
    closing.append(gen)
    ctx.send(1, [10, 11])  # another tenant's request, waiting for its receiver
    ctx.send(2, [20])  # the tenant's own
    gen.tx.start_receive(2, ctx.endpoint, [5], ticket=ticket_for(2))
    assert gen.outcome(2).state is SessionState.DONE
    info = _ctx_info(ctx)
    full = TransferAgent.decode_descriptor(info.agent_descriptor)
    if backend == "shm":
        # Loaded (it writes into us, and we hand our memfds only to loaded peers), but identity-only ...
        assert gen.agent.remote(full.name).descriptor.regions == []
        # ... and its owner refuses its memfds to us even with a descriptor naming them all.
        payload = msgspec.msgpack.decode(full.payload)
        got = steal(payload["fds"], gen.agent.name, process_incarnation(), full.name, full.incarnation)
        assert got["fds"] == 0 and not got["ok"], got
        assert "not given access" in got["error"]
    else:
        assert full.name not in gen.agent.remote_agents, "push: no descriptor of the context reaches the receiver"
    region = full.regions[0]
    local = gen.agent.register_memory(buf := torch.zeros(4096, dtype=torch.uint8))
    try:
        with pytest.raises((E.RemoteRangeError, E.RemoteAgentError)):
            h = gen.agent.submit(
                TransferOp.READ, full.name, np.array([buf.data_ptr()]), np.array([region.address]), np.array([4096])
            )
            gen.agent.wait(h, 10)
    finally:
        gen.agent.deregister_memory(local)
    assert ctx.stats()["exposed_to_peers"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pull_context_exposes_its_memory_only_to_a_ticket_holder(backend: str, closing: list[Any]) -> None:
    """Item 1, pull: a registered rank without the request's ticket gets no access (TicketError, nothing
    exposed); the ticket holder reads the right bytes, and the context counts one exposure."""
    _backend(backend)
    ctx = ContextProcess(backend)
    closing.append(ctx)
    mallory, alice = _Gen(backend), _Gen(backend)
    closing += [mallory, alice]
    p = ctx.start_send(3, [12, 13], mode="pull")
    forged = {**p, "ticket": os.urandom(16).hex()}
    mallory.tx.start_receive(params=forged, block_ids=[1, 2])
    out = mallory.outcome(3)
    assert out.state is SessionState.FAILED and isinstance(out.error, E.TicketError), out
    assert "gave no access to its memory" in str(out.error)
    full = TransferAgent.decode_descriptor(_ctx_info(ctx).agent_descriptor)
    assert full.name not in mallory.agent.remote_agents or not mallory.agent.remote(full.name).descriptor.regions
    assert ctx.stats()["exposed_to_peers"] == 0
    alice.tx.start_receive(params=p, block_ids=[7, 8])
    assert alice.outcome(3).state is SessionState.DONE
    expected = fill_value(3, [12, 13], alice.flat.shape[1])
    assert np.array_equal(alice.flat[[7, 8]].numpy(), expected)
    assert ctx.stats()["exposed_to_peers"] == 1
