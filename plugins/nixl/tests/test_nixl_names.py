"""One identity per agent name on ``nixl`` (issue 31): a loaded name is never taken over by another agent.

Peers are real processes (``_peer.Peer``, an engine-like loop that progresses NIXL); the writer is a
``NixlAgent`` here. Every refused attempt is followed by a transfer to the victim whose bytes are checked.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, distribution
from typing import Any

import msgspec
import numpy as np
import pytest

try:
    distribution("kvcore-nixl")
except PackageNotFoundError:  # only an absent plugin skips; a broken NIXL install fails below
    pytest.skip("kvcore-nixl is not installed (pip install './plugins/nixl[cu12]')", allow_module_level=True)

import torch
from kvcore_nixl.agent import NixlAgent, load_nixl

from kvcore.errors import RemoteAgentError
from kvcore.transport.agent import TransferAgent, TransferOp

sys.path.insert(0, os.path.dirname(__file__))
from _peer import Peer, pattern

load_nixl()  # a broken NIXL install fails every test here instead of skipping them

KiB = 1024
N = 64 * KiB


@pytest.fixture
def writer() -> Iterator[NixlAgent]:
    a = NixlAgent(f"writer-{uuid.uuid4().hex[:6]}")
    yield a
    a.close()


def _source(agent: NixlAgent, seed: int) -> int:
    src = torch.from_numpy(pattern(seed, N).copy())
    agent.register_memory(src)
    agent._kept = [*getattr(agent, "_kept", []), src]  # type: ignore[attr-defined]
    return int(src.data_ptr())


def _write(agent: NixlAgent, peer: str, src: int, dst: int) -> None:
    h = agent.submit(TransferOp.WRITE, peer, [src], [dst], [N], notification=b"w")
    agent.wait(h, timeout=20)
    agent.release(h)


def _bytes(p: Peer) -> np.ndarray:
    return np.frombuffer(p.call("read", offset=0, length=N)["data"], dtype=np.uint8)


def _forged(real: bytes, **changes: Any) -> bytes:
    desc = TransferAgent.decode_descriptor(real)
    return msgspec.msgpack.encode(msgspec.structs.replace(desc, **changes))


def test_a_second_agent_under_a_loaded_live_name_is_refused_and_the_victim_keeps_working(writer: NixlAgent) -> None:
    with Peer("gen-0", nbytes=N) as victim, Peer("gen-0", nbytes=N) as squatter:
        name = writer.load_remote_agent(victim.descriptor)
        _write(writer, name, _source(writer, 1), victim.base)
        inc = TransferAgent.decode_descriptor(victim.descriptor).incarnation
        attempts = {
            "another incarnation": squatter.descriptor,
            "the victim's incarnation, another NIXL agent": _forged(squatter.descriptor, incarnation=inc),
            "the same, a newer generation": _forged(squatter.descriptor, incarnation=inc, generation=10**6),
        }
        for what, desc in attempts.items():
            with pytest.raises(RemoteAgentError, match=r"'gen-0'.*already loaded.*Unload the old peer first") as err:
                writer.load_remote_agent(desc)
            assert inc[:8] in str(err.value), what
        _write(writer, name, _source(writer, 2), victim.base)  # still the victim's NIXL agent and memory
        assert np.array_equal(_bytes(victim), pattern(2, N))
        assert not _bytes(squatter).any()


def test_a_restarted_peer_loads_once_the_old_one_is_unloaded(writer: NixlAgent) -> None:
    src = _source(writer, 3)
    first = Peer("gen-1", nbytes=N)
    try:
        name = writer.load_remote_agent(first.descriptor)
        _write(writer, name, src, first.base)
    finally:
        first.kill()
    with Peer("gen-1", nbytes=N) as second:
        with pytest.raises(RemoteAgentError, match="already loaded"):
            writer.load_remote_agent(second.descriptor)
        writer.unload_remote_agent(name)
        assert writer.load_remote_agent(second.descriptor) == name
        _write(writer, name, src, second.base)
        assert np.array_equal(_bytes(second), pattern(3, N))
