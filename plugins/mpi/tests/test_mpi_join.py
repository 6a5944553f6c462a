"""Two agents that load each other at the same instant both connect (MPICH crashed on two joins at once)."""

from __future__ import annotations

import threading
import uuid
from importlib.metadata import PackageNotFoundError, distribution
from typing import Any

import pytest

try:
    distribution("kvcore-mpi")
except PackageNotFoundError:
    pytest.skip("kvcore-mpi is not installed (pip install ./plugins/mpi)", allow_module_level=True)

from kvcore.testing.harness import PeerProcess


def test_two_agents_loading_each_other_at_once_both_connect() -> None:
    with (
        PeerProcess("mpi", {}, name=f"a-{uuid.uuid4().hex[:8]}") as a,
        PeerProcess("mpi", {}, name=f"b-{uuid.uuid4().hex[:8]}") as b,
    ):
        a.call("alloc", key="m", nbytes=4096)  # the agents start (MPI_Init) before the race, not during it
        b.call("alloc", key="m", nbytes=4096)
        da, db = a.call("descriptor")["descriptor"], b.call("descriptor")["descriptor"]
        outcome: dict[str, Any] = {}
        start = threading.Barrier(2)

        def load(name: str, peer: PeerProcess, descriptor: bytes) -> None:
            start.wait()
            try:
                outcome[name] = peer.call("load", descriptor=descriptor, timeout=30.0)
            except Exception as exc:
                outcome[name] = exc

        threads = [
            threading.Thread(target=load, args=("a", a, db)),
            threading.Thread(target=load, args=("b", b, da)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40.0)
        assert not any(isinstance(v, Exception) for v in outcome.values()), outcome
        assert a.alive() and b.alive(), "a peer died while joining"
