"""A peer SIGKILLed or SIGSTOPped mid-transfer: the survivor ends the request typed, in bound, and serves on.

Real processes and real MPICH: the peers are ``kvcore.testing.harness.PeerProcess`` agents; the survivor is
the agent in this process. MPICH reports neither fault itself (README); the agent's watchdog does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, distribution

import numpy as np
import pytest

try:
    distribution("kvcore-mpi")
except PackageNotFoundError:
    pytest.skip("kvcore-mpi is not installed (pip install ./plugins/mpi)", allow_module_level=True)

import torch
from kvcore_mpi.agent import MpiAgent, split_fragments

from kvcore.errors import PeerLostError, TransferFailedError
from kvcore.testing.harness import PeerProcess, pattern, stop_process
from kvcore.transport.agent import TransferHandle, TransferOp, TransferStatus

MiB = 1024 * 1024
#: Short fences so that a stopped peer is declared lost quickly in tests.
OPTIONS = {"fence_after_s": 2.0, "fence_min_bytes_per_s": 256.0 * MiB}
#: Each of these many writes of this size is queued to the victim before it is hit.
WRITES, SIZE = 6, 32 * MiB
#: Every request must be terminal this soon after the fault (the contract's dead-peer bound).
BOUND_S = 15.0


@pytest.fixture
def survivor() -> Iterator[MpiAgent]:
    agent = MpiAgent(f"survivor-{uuid.uuid4().hex[:8]}", OPTIONS)
    yield agent
    agent.close()


def _connect(agent: MpiAgent, peer: PeerProcess) -> str:
    peer.call("load", descriptor=agent.descriptor())
    return agent.load_remote_agent(peer.call("descriptor")["descriptor"])


def _source(agent: MpiAgent, data: np.ndarray) -> int:
    t = torch.from_numpy(data.copy())
    agent.register_memory(t)
    return int(t.data_ptr())


def _writes_then(agent: MpiAgent, victim: PeerProcess, hit: str) -> tuple[list[TransferHandle], float]:
    """Queue WRITES writes to ``victim``, hit it (``kill`` or ``stop``) while they move; return handles, hit time."""
    dst = victim.call("alloc", key="k", nbytes=SIZE)["address"]
    src = _source(agent, pattern(21, SIZE))
    peer = _connect(agent, victim)
    handles = [
        agent.submit(TransferOp.WRITE, peer, [src], [dst], [SIZE], notification=b"w%d" % i) for i in range(WRITES)
    ]
    time.sleep(0.05)  # the first write is on the wire
    if hit == "kill":
        victim.kill()
    else:
        stop_process(victim.pid)
    return handles, time.monotonic()


def _settle(agent: MpiAgent, handles: list[TransferHandle]) -> list[TransferStatus]:
    deadline = time.monotonic() + BOUND_S
    while any(agent.poll(h) is TransferStatus.PENDING for h in handles):
        assert time.monotonic() < deadline, f"requests still pending {BOUND_S}s after the fault"
        time.sleep(0.01)
    return [h.status for h in handles]


@pytest.fixture(scope="module")
def other() -> Iterator[PeerProcess]:
    """A healthy peer, the next one the survivor serves after each fault."""
    with PeerProcess("mpi", OPTIONS, name=f"next-{uuid.uuid4().hex[:8]}") as peer:
        yield peer


def _serves_another_peer(agent: MpiAgent, other: PeerProcess) -> None:
    """Another peer still gets a write byte-for-byte, with its notification."""
    key = uuid.uuid4().hex[:8]
    dst = other.call("alloc", key=key, nbytes=MiB)["address"]
    try:
        src = _source(agent, pattern(22, MiB))
        peer = _connect(agent, other)
        h = agent.submit(TransferOp.WRITE, peer, [src], [dst], [MiB], notification=b"after")
        agent.wait(h, timeout=20.0)
        agent.release(h)
        got = np.frombuffer(other.call("read", key=key)["data"], dtype=np.uint8)
        assert np.array_equal(got, pattern(22, MiB))
        notes = other.call("notifications", expect=1, timeout=20.0)["notifications"]
        assert [m for _, m in notes] == [b"after"]
    finally:
        other.call("free", key=key)


@pytest.mark.parametrize("hit", ["kill", "stop"])
def test_peer_hit_mid_transfer_ends_typed_in_bound_and_survivor_serves_on(
    survivor: MpiAgent, other: PeerProcess, hit: str
) -> None:
    victim = PeerProcess("mpi", OPTIONS, name=f"victim-{uuid.uuid4().hex[:8]}")
    try:
        handles, hit_at = _writes_then(survivor, victim, hit)
        statuses = _settle(survivor, handles)
        elapsed = time.monotonic() - hit_at
        failed = [h for h in handles if h.status is TransferStatus.FAILED]
        assert failed, f"every write completed although the peer was hit ({hit}): {statuses}"
        for h in failed:
            assert isinstance(h.error, (PeerLostError, TransferFailedError)), repr(h.error)
        assert elapsed < BOUND_S, f"{hit}: took {elapsed:.1f}s to end the requests"
        for h in handles:
            survivor.release(h)
        assert survivor.resources()["transfers"] == 0
    finally:
        victim.kill()  # a stopped process dies of SIGKILL too
    _serves_another_peer(survivor, other)


def test_split_fragments_keeps_every_byte_in_blocks_of_at_most_the_limit() -> None:
    local = np.array([1000, 5000], dtype=np.uint64)
    remote = np.array([9000, 20000], dtype=np.uint64)
    sizes = np.array([10, 3], dtype=np.uint64)
    lo, re, sz = split_fragments(local, remote, sizes, limit=4)
    assert sz.tolist() == [4, 4, 2, 3]
    assert lo.tolist() == [1000, 1004, 1008, 5000]
    assert re.tolist() == [9000, 9004, 9008, 20000]
