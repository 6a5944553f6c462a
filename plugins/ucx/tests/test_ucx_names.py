"""One identity per agent name on ``ucx`` (issue 31): no takeover of a loaded name, no loading of itself.

Peers are real processes (``kvcore.testing.harness.PeerProcess``); the writer is a ``UcxAgent`` here. Every
refused attempt is followed by a transfer to the victim whose bytes are checked.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, distribution
from typing import Any

import msgspec
import numpy as np
import pytest

try:
    distribution("kvcore-ucx")
except PackageNotFoundError:  # only an absent plugin skips; a broken UCX install fails the tests
    pytest.skip("kvcore-ucx is not installed (pip install ./plugins/ucx)", allow_module_level=True)

from kvcore_ucx.agent import UcxAgent

from kvcore.errors import PeerLostError, RemoteAgentError
from kvcore.testing.harness import PeerProcess, pattern
from kvcore.transport.agent import MemoryRegion, TransferAgent, TransferOp

MiB = 1024 * 1024


@pytest.fixture
def writer(ucp: Any) -> Iterator[UcxAgent]:
    a = UcxAgent(f"writer-{uuid.uuid4().hex[:6]}")
    yield a
    a.close()


def _source(agent: UcxAgent, seed: int, nbytes: int = MiB) -> int:
    buf = pattern(seed, nbytes).copy()
    agent.register_memory(MemoryRegion(buf.ctypes.data, buf.nbytes))
    agent._kept = [*getattr(agent, "_kept", []), buf]  # type: ignore[attr-defined]
    return int(buf.ctypes.data)


def _write(agent: UcxAgent, peer: str, src: int, dst: int, n: int = MiB) -> None:
    h = agent.submit(TransferOp.WRITE, peer, [src], [dst], [n], notification=b"w")
    agent.wait(h, timeout=20)
    agent.release(h)


def _bytes(p: PeerProcess, key: str) -> np.ndarray:
    return np.frombuffer(p.call("read", key=key)["data"], dtype=np.uint8)


def _forged(real: bytes, **changes: Any) -> bytes:
    desc = TransferAgent.decode_descriptor(real)
    return msgspec.msgpack.encode(msgspec.structs.replace(desc, **changes))


def test_a_second_agent_under_a_loaded_live_name_is_refused_and_the_victim_keeps_working(writer: UcxAgent) -> None:
    with PeerProcess("ucx", name="gen-0") as victim, PeerProcess("ucx", name="gen-0") as squatter:
        dst = victim.call("alloc", key="k", nbytes=MiB)["address"]
        squatter.call("alloc", key="k", nbytes=MiB)
        real = victim.call("descriptor")["descriptor"]
        name = writer.load_remote_agent(real)
        _write(writer, name, _source(writer, 1), dst)
        evil = squatter.call("descriptor")["descriptor"]
        inc = TransferAgent.decode_descriptor(real).incarnation
        attempts = {
            "another incarnation": evil,
            "the victim's incarnation, another worker": _forged(evil, incarnation=inc),
            "the same, a newer generation": _forged(evil, incarnation=inc, generation=10**6),
        }
        for what, desc in attempts.items():
            with pytest.raises(RemoteAgentError, match=r"'gen-0'.*already loaded.*Unload the old peer first") as err:
                writer.load_remote_agent(desc)
            assert inc[:8] in str(err.value), what
        _write(writer, name, _source(writer, 2), dst)  # still the victim's endpoint and memory
        assert np.array_equal(_bytes(victim, "k"), pattern(2, MiB))
        assert not _bytes(squatter, "k").any()


def test_own_descriptor_is_never_loaded(writer: UcxAgent) -> None:
    _source(writer, 3, 4096)
    own = writer.descriptor()
    for forged in (own, _forged(own, name="someone-else"), _forged(own, incarnation=uuid.uuid4().hex)):
        with pytest.raises(RemoteAgentError, match=r"this agent's own.*never loads itself"):
            writer.load_remote_agent(forged)
    assert writer.remote_agents == ()


def test_a_restarted_peer_loads_once_the_old_one_is_unloaded(writer: UcxAgent) -> None:
    """A new incarnation under the name: refused while the old one is loaded ("none" mode cannot see it die)."""
    src = _source(writer, 4)
    first = PeerProcess("ucx", name="gen-1")
    try:
        dst = first.call("alloc", key="k", nbytes=MiB)["address"]
        name = writer.load_remote_agent(first.call("descriptor")["descriptor"])
        _write(writer, name, src, dst)
    finally:
        first.kill()
    with PeerProcess("ucx", name="gen-1") as second:
        dst2 = second.call("alloc", key="k", nbytes=MiB)["address"]
        new = second.call("descriptor")["descriptor"]
        with pytest.raises(RemoteAgentError, match="already loaded"):
            writer.load_remote_agent(new)
        writer.unload_remote_agent(name)
        assert writer.load_remote_agent(new) == name
        _write(writer, name, src, dst2)
        assert np.array_equal(_bytes(second, "k"), pattern(4, MiB))


def test_a_peer_whose_endpoint_failed_is_replaced_by_its_restart(ucp: Any) -> None:
    """In "peer" mode UCX's error handler proves the old endpoint gone, so the new incarnation needs no unload."""
    opts = {"error_handling": "peer"}
    with UcxAgent(f"writer-{uuid.uuid4().hex[:6]}", opts) as writer:
        src = _source(writer, 5)
        first = PeerProcess("ucx", opts, name="gen-2")
        try:
            dst = first.call("alloc", key="k", nbytes=MiB)["address"]
            name = writer.load_remote_agent(first.call("descriptor")["descriptor"])
            _write(writer, name, src, dst)
        finally:
            first.kill()
        with pytest.raises(PeerLostError):
            _write(writer, name, src, dst)
        with PeerProcess("ucx", opts, name="gen-2") as second:
            dst2 = second.call("alloc", key="k", nbytes=MiB)["address"]
            assert writer.load_remote_agent(second.call("descriptor")["descriptor"]) == name
            _write(writer, name, src, dst2)
            assert np.array_equal(_bytes(second, "k"), pattern(5, MiB))
