"""Attacks on the shm agent, with real processes (and a second uid where the machine allows it).

Each test names the attack of issue 11 it replays. The writer (``W``) is an
``ShmAgent`` in this process; victims are harness peers; attackers run
``tests/_shm_attacker.py`` or, to be another uid, a forked child that dropped
to ``nobody``.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from _local_auth import as_uid
from _shm_attacker import Attacker, forge_notification, steal

from kvcore.errors import PeerLostError, RemoteAgentError, TransferTimeoutError
from kvcore.testing.harness import PeerProcess, pattern, stop_process
from kvcore.transport.agent import TransferAgent, TransferOp, process_incarnation
from kvcore.transport.builtin import shm
from kvcore.transport.builtin.shm import ShmAgent

MiB = 1024 * 1024
NOBODY = 65534


@pytest.fixture
def writer() -> Iterator[ShmAgent]:
    a = ShmAgent(f"writer-{uuid.uuid4().hex[:6]}")
    yield a
    a.close()


@pytest.fixture
def victim() -> Iterator[PeerProcess]:
    p = PeerProcess("shm", name=f"victim-{uuid.uuid4().hex[:6]}")
    yield p
    p.close()


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    a = Attacker()
    yield a
    a.close()


def _source(agent: ShmAgent, seed: int, nbytes: int) -> int:
    t = agent.allocate_tensor((nbytes,), torch.uint8)
    t.numpy()[:] = pattern(seed, nbytes)
    agent.register_memory(t)
    agent._kept = [*getattr(agent, "_kept", []), t]  # type: ignore[attr-defined]
    return t.data_ptr()


def _write(agent: ShmAgent, peer: str, src: int, dst: int, n: int) -> None:
    h = agent.submit(TransferOp.WRITE, peer, [src], [dst], [n], notification=b"w")
    agent.wait(h, timeout=20)
    agent.release(h)


def _victim_bytes(p: PeerProcess, key: str) -> np.ndarray:
    return np.frombuffer(p.call("read", key=key)["data"], dtype=np.uint8)


def _forged(real: bytes, **changes: Any) -> bytes:
    desc = TransferAgent.decode_descriptor(real)
    return msgspec.msgpack.encode(msgspec.structs.replace(desc, **changes))


def _payload(desc: bytes) -> dict[str, Any]:
    return msgspec.msgpack.decode(TransferAgent.decode_descriptor(desc).payload)


# --- "A descriptor naming another process's segments makes the context write into the victim" ---------------


def test_descriptor_naming_a_victim_that_never_loaded_us_is_refused(writer: ShmAgent, victim: PeerProcess) -> None:
    """The victim's payload under a stranger's name, or the victim's whole descriptor relayed by a stranger."""
    dst = victim.call("alloc", key="v", nbytes=MiB, seed=1)["address"]
    src = _source(writer, 2, MiB)
    real = victim.call("descriptor")["descriptor"]
    forged = _forged(real, name="mallory", incarnation=uuid.uuid4().hex)
    for desc, why in ((forged, "not 'mallory'"), (real, "is not loaded here")):
        peer = writer.load_remote_agent(desc)
        with pytest.raises(RemoteAgentError, match=f"refused to share its memory: .*{why}"):
            _write(writer, peer, src, dst, MiB)
        writer.unload_remote_agent(peer)
    assert np.array_equal(_victim_bytes(victim, "v"), pattern(1, MiB))


def test_descriptor_naming_a_victim_that_did_load_us_is_refused(writer: ShmAgent, victim: PeerProcess) -> None:
    """The victim serves us (it loaded us), but the identity behind its socket is not the one the descriptor names."""
    dst = victim.call("alloc", key="v", nbytes=MiB, seed=3)["address"]
    src = _source(writer, 4, MiB)
    victim.call("load", descriptor=writer.descriptor())
    real = victim.call("descriptor")["descriptor"]
    peer = writer.load_remote_agent(_forged(real, name="mallory", incarnation=uuid.uuid4().hex))
    with pytest.raises(RemoteAgentError, match=r"not 'mallory'|not the one the descriptor names"):
        _write(writer, peer, src, dst, MiB)
    assert np.array_equal(_victim_bytes(victim, "v"), pattern(3, MiB))
    writer.unload_remote_agent(peer)
    # The legitimate relationship still works after the attack.
    _write(writer, writer.load_remote_agent(real), src, dst, MiB)
    assert np.array_equal(_victim_bytes(victim, "v"), pattern(4, MiB))


def test_invented_export_is_refused_by_its_token(writer: ShmAgent, victim: PeerProcess) -> None:
    """A descriptor may only name exports it was given: a guessed token never matches the owner's control block."""
    dst = victim.call("alloc", key="v", nbytes=MiB, seed=5)["address"]
    src = _source(writer, 6, MiB)
    victim.call("load", descriptor=writer.descriptor())
    real = victim.call("descriptor")["descriptor"]
    payload = _payload(real)
    payload["exports"] = [[a, n, slot, 1] for a, n, slot, _ in payload["exports"]]  # tokens used to count from 1
    peer = writer.load_remote_agent(_forged(real, payload=msgspec.msgpack.encode(payload)))
    from kvcore.errors import RemoteRangeError

    with pytest.raises(RemoteRangeError, match="deregistered"):
        _write(writer, peer, src, dst, MiB)
    assert np.array_equal(_victim_bytes(victim, "v"), pattern(5, MiB))


# --- "Replaying the context's own RankInfo makes it overwrite its own source blocks" ---------------------------


def test_own_descriptor_is_never_loaded(writer: ShmAgent) -> None:
    _source(writer, 7, 4096)
    own = writer.descriptor()
    for forged in (own, _forged(own, name="someone-else"), _forged(own, incarnation=uuid.uuid4().hex)):
        with pytest.raises(RemoteAgentError, match="this agent's own"):
            writer.load_remote_agent(forged)
    assert writer.remote_agents == ()


# --- "Registering an agent name already in use (gen-0) breaks every later request of the real gen-0" ------------


def test_a_second_agent_with_a_loaded_name_does_not_replace_a_live_one(writer: ShmAgent) -> None:
    with PeerProcess("shm", name="gen-0") as real, PeerProcess("shm", name="gen-0") as squatter:
        dst = real.call("alloc", key="k", nbytes=MiB, seed=8)["address"]
        squatter.call("alloc", key="k", nbytes=MiB)
        src = _source(writer, 9, MiB)
        for p in (real, squatter):
            p.call("load", descriptor=writer.descriptor())
        name = writer.load_remote_agent(real.call("descriptor")["descriptor"])
        with pytest.raises(RemoteAgentError, match=r"already loaded.*alive"):
            writer.load_remote_agent(squatter.call("descriptor")["descriptor"])
        _write(writer, name, src, dst, MiB)  # the real gen-0 is untouched
        assert np.array_equal(_victim_bytes(real, "k"), pattern(9, MiB))
        real.kill()
        # Once the loaded one is provably gone, a new incarnation under the name replaces it.
        dst2 = squatter.call("alloc", key="k2", nbytes=MiB)["address"]
        assert writer.load_remote_agent(squatter.call("descriptor")["descriptor"]) == name
        _write(writer, name, src, dst2, MiB)
        assert np.array_equal(_victim_bytes(squatter, "k2"), pattern(9, MiB))


# --- "Kill the context with SIGBUS: register a segment, let the context map it, truncate the file" -------------


def test_the_owner_cannot_truncate_what_the_writer_mapped(writer: ShmAgent, attacker: Attacker) -> None:
    attacker.call("agent", name="owner")
    dst = attacker.call("alloc", key="k", nbytes=MiB, seed=10)["address"]
    src = _source(writer, 11, MiB)
    attacker.call("load", descriptor=writer.descriptor())
    peer = writer.load_remote_agent(attacker.call("descriptor")["descriptor"])
    _write(writer, peer, src, dst, MiB)  # mapped now
    outcomes = attacker.call("truncate_own")["outcomes"]
    assert outcomes and all(o == os.strerror(1) for o in outcomes), outcomes  # EPERM, every attempt
    _write(writer, peer, src, dst, MiB)  # no SIGBUS: this process is still here
    assert np.frombuffer(attacker.call("read", key="k")["data"], np.uint8).tobytes() == pattern(11, MiB).tobytes()


def test_unsealed_memory_is_refused_before_it_is_mapped(writer: ShmAgent, attacker: Attacker) -> None:
    evil = attacker.call("serve_unsealed", nbytes=MiB)
    src = _source(writer, 12, MiB)
    peer = writer.load_remote_agent(evil["descriptor"])
    with pytest.raises(RemoteAgentError, match=r"not sealed against shrinking|cannot be sealed"):
        _write(writer, peer, src, evil["address"], MiB)
    attacker.call("truncate_unsealed")
    with open("/proc/self/maps") as f:
        assert "kvcore-shm-evil-s1" not in f.read()  # never mapped, so nothing can fault
    with pytest.raises(RemoteAgentError):
        _write(writer, peer, src, evil["address"], MiB)


# --- "A process that never got loaded cannot get the fds" (and other uids cannot either) -------------------------


@pytest.mark.parametrize("uid", [None, NOBODY], ids=["same-uid", "uid-nobody"])
def test_a_process_never_loaded_gets_no_fds(writer: ShmAgent, victim: PeerProcess, uid: int | None) -> None:
    victim.call("alloc", key="v", nbytes=MiB, seed=13)
    victim.call("load", descriptor=writer.descriptor())  # the victim trusts the writer, not the thief
    real = victim.call("descriptor")["descriptor"]
    desc = TransferAgent.decode_descriptor(real)
    sock = _payload(real)["fds"]
    claims = [
        (writer.name, process_incarnation()),  # impersonates the loaded writer: wrong pid
        ("thief", uuid.uuid4().hex),  # a name the victim never loaded
    ]
    for client, inc in claims:
        got = as_uid(uid, steal, sock, client, inc, desc.name, desc.incarnation)
        assert got["fds"] == 0 and not got["ok"], got
        assert "pid" in got["error"] or "not loaded" in got["error"]
    # The legitimate writer still gets the memory.
    src = _source(writer, 14, MiB)
    dst = victim.call("alloc", key="w", nbytes=MiB)["address"]
    _write(writer, writer.load_remote_agent(victim.call("descriptor")["descriptor"]), src, dst, MiB)
    assert np.array_equal(_victim_bytes(victim, "w"), pattern(14, MiB))


@pytest.mark.parametrize("uid", [None, NOBODY], ids=["same-uid", "uid-nobody"])
def test_forged_notifications_are_dropped(writer: ShmAgent, victim: PeerProcess, uid: int | None) -> None:
    dst = victim.call("alloc", key="v", nbytes=4096)["address"]
    victim.call("load", descriptor=writer.descriptor())
    notify = _payload(victim.call("descriptor")["descriptor"])["notify"]
    as_uid(uid, forge_notification, notify, writer.name, b"request 7 done")
    as_uid(uid, forge_notification, notify, "nobody-loaded-me", b"request 8 done")
    assert victim.call("notifications", expect=0, settle=0.5)["notifications"] == []
    src = _source(writer, 15, 4096)
    peer = writer.load_remote_agent(victim.call("descriptor")["descriptor"])
    _write(writer, peer, src, dst, 4096)
    assert victim.call("notifications", expect=1, timeout=10)["notifications"] == [[writer.name, b"w"]]


def test_a_dead_owner_is_peer_lost_not_a_crash(writer: ShmAgent, attacker: Attacker) -> None:
    attacker.call("agent", name="short-lived")
    dst = attacker.call("alloc", key="k", nbytes=MiB, seed=16)["address"]
    src = _source(writer, 17, MiB)
    attacker.call("load", descriptor=writer.descriptor())
    peer = writer.load_remote_agent(attacker.call("descriptor")["descriptor"])
    _write(writer, peer, src, dst, MiB)
    attacker.kill()  # SIGKILL and reap: a crash, no cleanup runs
    with pytest.raises(PeerLostError):
        _write(writer, peer, src, dst, MiB)


def test_a_connection_flood_does_not_lock_out_a_loaded_peer(writer: ShmAgent, victim: PeerProcess) -> None:
    """1100 idle connections to the victim's fd socket (over its cap of 1024): a loaded writer is still served."""

    dst = victim.call("alloc", key="v", nbytes=MiB)["address"]
    victim.call("load", descriptor=writer.descriptor())
    real = victim.call("descriptor")["descriptor"]
    name = b"\0" + _payload(real)["fds"].encode()
    flood = []
    try:
        for _ in range(1100):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(name)
            flood.append(s)
        src = _source(writer, 18, MiB)
        _write(writer, writer.load_remote_agent(real), src, dst, MiB)
        assert np.array_equal(_victim_bytes(victim, "v"), pattern(18, MiB))
        assert victim.call("resources")["resources"]["served_connections"] <= 1024
    finally:
        for s in flood:
            s.close()


def _fill_backlog(name: bytes) -> list[socket.socket]:
    """Connect to a listener that does not accept (its process is stopped) until the kernel's backlog is full."""
    flood = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(name)
        except BlockingIOError:  # EAGAIN: the backlog is full
            s.close()
            break
        flood.append(s)
        assert len(flood) < 10_000, "the listener's backlog never filled"
    return flood


def _stopped_victim_with_full_backlog(writer: ShmAgent, victim: PeerProcess) -> tuple[int, bytes, list[socket.socket]]:
    dst = victim.call("alloc", key="v", nbytes=MiB)["address"]
    victim.call("load", descriptor=writer.descriptor())
    real = victim.call("descriptor")["descriptor"]
    stop_process(victim.pid)  # alive, but its serving thread accepts nothing
    return dst, real, _fill_backlog(b"\0" + _payload(real)["fds"].encode())


def test_a_full_backlog_is_a_busy_peer_not_a_lost_one(
    writer: ShmAgent, victim: PeerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EAGAIN from connect (the listen backlog is full) is retried, then a timeout; never "the peer is gone"."""
    monkeypatch.setattr(shm, "_CONNECT_BUSY_S", 0.5, raising=False)
    flood: list[socket.socket] = []
    try:
        dst, real, flood = _stopped_victim_with_full_backlog(writer, victim)
        src = _source(writer, 19, MiB)
        peer = writer.load_remote_agent(real)
        with pytest.raises(TransferTimeoutError, match="backlog stayed full") as err:
            _write(writer, peer, src, dst, MiB)
        assert not isinstance(err.value, PeerLostError)
        for s in flood:
            s.close()
        flood = []
        os.kill(victim.pid, signal.SIGCONT)
        _write(writer, peer, src, dst, MiB)  # the same loaded peer, served once it accepts again
        assert np.array_equal(_victim_bytes(victim, "v"), pattern(19, MiB))
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        for s in flood:
            s.close()


def test_a_full_backlog_is_retried_until_the_loaded_peer_accepts(writer: ShmAgent, victim: PeerProcess) -> None:
    """The writer meets a full backlog; the victim resumes while the writer retries; the write lands."""
    flood: list[socket.socket] = []
    resume = threading.Timer(0.3, os.kill, (victim.pid, signal.SIGCONT))
    try:
        dst, real, flood = _stopped_victim_with_full_backlog(writer, victim)
        src = _source(writer, 20, MiB)
        resume.start()  # the victim accepts the queued flood, then the writer's own connection
        _write(writer, writer.load_remote_agent(real), src, dst, MiB)
        assert np.array_equal(_victim_bytes(victim, "v"), pattern(20, MiB))
    finally:
        resume.cancel()
        os.kill(victim.pid, signal.SIGCONT)
        for s in flood:
            s.close()
