"""The transfer-agent contract suite: every transport plugin runs these tests against itself.

Usage, in a plugin's ``tests/test_contract.py``::

    from kvcore.testing.contract import TransferAgentContract

    class TestCmaContract(TransferAgentContract):
        backend = "cma"
        agent_options = {}  # optional: agent options (JSON-serializable)

pytest collects the subclass (its name starts with ``Test``) and runs every
``test_contract_*`` method it inherits, so a test added to the suite runs in
every plugin without any list to update. Several subclasses (other options)
may live in one file. Without ``backend`` the ``--kvcore-backend=NAME`` option
names it. The backend is looked up through the installed plugins, exactly as
users get it. Every test talks to a second real process
(``kvcore.testing.harness``) that runs an agent of the same backend; one peer
is shared per subclass, a few tests start their own (crash, release). Byte
checks compare against ``harness.pattern``, computed without the transport.

The old form (``from kvcore.testing.contract import *`` plus a module-level
``KVCORE_CONTRACT_BACKEND``) still runs, with a ``DeprecationWarning``, for one
release.
"""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import msgspec
import numpy as np
import pytest

from kvcore.errors import (
    PeerLostError,
    RemoteAgentError,
    RemoteRangeError,
    TransferFailedError,
    UnsupportedOperationError,
)
from kvcore.testing.harness import PeerProcess, digest, pattern
from kvcore.transport.agent import MemoryKind, TransferAgent, TransferOp

__all__ = ["TransferAgentContract", "TestLegacyContract"]

#: Bound on any single wait in the suite; generous for 2-core CI boxes.
WAIT_S = 20.0
#: A dead peer must be reported within this many seconds.
DEAD_PEER_BOUND_S = 15.0
MiB = 1024 * 1024


# --- helpers -------------------------------------------------------------------------------------


def _key() -> str:
    return uuid.uuid4().hex[:12]


def _source(agent: TransferAgent, data: np.ndarray, device: str = "cpu") -> tuple[Any, int]:
    """Local memory holding ``data``, registered with ``agent``; returns (tensor, address)."""
    import torch

    t = agent.allocate_tensor((data.size,), torch.uint8, device=device)
    t.copy_(torch.from_numpy(data))
    agent.register_memory(t)
    return t, t.data_ptr()


def _peer_bytes(peer: PeerProcess, key: str, offset: int = 0, length: int | None = None) -> np.ndarray:
    return np.frombuffer(peer.call("read", key=key, offset=offset, length=length)["data"], dtype=np.uint8)


def _assert_bytes(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.size == expected.size, f"{what}: {actual.size} bytes, expected {expected.size}"
    bad = np.flatnonzero(actual != expected)
    assert bad.size == 0, (
        f"{what}: {bad.size} bytes differ; first at offset {int(bad[0])}: "
        f"got {int(actual[bad[0]])}, expected {int(expected[bad[0]])}"
    )


def _run(agent: TransferAgent, *args: Any, notification: bytes | None = None) -> None:
    h = agent.submit(*args, notification=notification)  # type: ignore[misc]
    agent.wait(h, timeout=WAIT_S)
    agent.release(h)


def _connect(agent: TransferAgent, peer: PeerProcess) -> str:
    """Load each other's descriptors, the peer first, as a transceiver does (the receiver loads the writer before
    it registers); transports that hand out memory only to loaded peers (shm) rely on that order."""
    peer.call("load", descriptor=agent.descriptor())
    return agent.load_remote_agent(peer.call("descriptor")["descriptor"])


# --- the contract --------------------------------------------------------------------------------


class TransferAgentContract:
    """The transfer-agent contract suite: subclass it as ``Test<Name>Contract`` and set ``backend``.

    Every ``test_contract_*`` method is one promise of ``kvcore.TransferAgent``; each runs against the installed
    backend with a peer agent in a second process. Fixtures are class-scoped where they hold a process.
    """

    #: The backend name under test (as users put it in configuration); empty: ``--kvcore-backend``.
    backend: ClassVar[str] = ""
    #: Agent options for both sides (JSON-serializable: they travel to the peer process).
    agent_options: ClassVar[dict[str, Any]] = {}

    # --- fixtures ---------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def kvcore_backend(cls, request: pytest.FixtureRequest) -> str:
        """The backend under test: the class's ``backend``, else ``--kvcore-backend``."""
        name = getattr(request.cls, "backend", "") or request.config.getoption("kvcore_backend", default=None)
        if not name:
            pytest.fail(f"set backend = '<name>' on {request.cls.__name__} or pass --kvcore-backend")
        return str(name)

    @pytest.fixture(scope="class")
    @classmethod
    def kvcore_agent_options(cls, request: pytest.FixtureRequest) -> dict[str, Any]:
        """Agent options for both sides: the class's ``agent_options``."""
        return dict(getattr(request.cls, "agent_options", {}))

    @pytest.fixture(scope="class")
    @classmethod
    def kvcore_agent_class(cls, kvcore_backend: str) -> type[TransferAgent]:
        """The agent class the installed plugins register under the backend name."""
        from kvcore.extension.plugins import make_plugin_manager

        agent_cls = make_plugin_manager().transfer_agents.get(kvcore_backend)
        assert isinstance(agent_cls, type) and issubclass(agent_cls, TransferAgent), (
            f"{kvcore_backend!r} is not a TransferAgent"
        )
        assert agent_cls.backend == kvcore_backend, (
            f"{agent_cls.__name__}.backend is {agent_cls.backend!r}, registered as {kvcore_backend!r}"
        )
        return agent_cls

    @pytest.fixture(scope="class")
    @classmethod
    def kvcore_peer(cls, kvcore_backend: str, kvcore_agent_options: dict[str, Any]) -> Iterator[PeerProcess]:
        """One peer process per subclass, running an agent of the backend under test."""
        peer = PeerProcess(kvcore_backend, kvcore_agent_options, name=f"peer-{uuid.uuid4().hex[:8]}")
        yield peer
        peer.close()

    @pytest.fixture
    def kvcore_agent(
        self, kvcore_agent_class: type[TransferAgent], kvcore_agent_options: dict[str, Any]
    ) -> Iterator[TransferAgent]:
        """A fresh local agent per test (the initiator); closed afterwards."""
        agent = kvcore_agent_class(f"initiator-{uuid.uuid4().hex[:8]}", kvcore_agent_options)
        yield agent
        agent.close()

    # --- the promises ------------------------------------------------------------------------------

    def test_contract_descriptor_exchange(self, kvcore_agent: TransferAgent, kvcore_peer: PeerProcess) -> None:
        """Both sides register memory and load each other's descriptor; the peer's regions are listed in it."""
        key = _key()
        info = kvcore_peer.call("alloc", key=key, nbytes=MiB)
        try:
            raw = kvcore_peer.call("descriptor")["descriptor"]
            desc = TransferAgent.decode_descriptor(raw)
            assert desc.backend == kvcore_agent.backend
            assert desc.name == kvcore_peer.name
            assert any(
                r.address <= info["address"] and info["address"] + MiB <= r.address + r.length for r in desc.regions
            )
            name = kvcore_agent.load_remote_agent(raw)
            assert name == kvcore_peer.name and name in kvcore_agent.remote_agents
            assert kvcore_agent.load_remote_agent(raw) == name  # loading again refreshes, never duplicates
            assert kvcore_agent.remote_agents.count(name) == 1
            _source(kvcore_agent, pattern(1, 4096))
            own = TransferAgent.decode_descriptor(kvcore_agent.descriptor())
            assert own.name == kvcore_agent.name and own.backend == kvcore_agent.backend
        finally:
            kvcore_peer.call("free", key=key)

    def test_contract_large_write(self, kvcore_agent: TransferAgent, kvcore_peer: PeerProcess) -> None:
        """One 64 MiB WRITE lands byte-for-byte; the guard pages around it stay zero."""
        size, guard = 64 * MiB, 4096
        key = _key()
        dst = kvcore_peer.call("alloc", key=key, nbytes=size + 2 * guard)["address"]
        try:
            _, src = _source(kvcore_agent, pattern(2, size))
            peer = _connect(kvcore_agent, kvcore_peer)
            _run(kvcore_agent, TransferOp.WRITE, peer, [src], [dst + guard], [size])
            expected = np.zeros(size + 2 * guard, dtype=np.uint8)
            expected[guard : guard + size] = pattern(2, size)
            _assert_bytes(_peer_bytes(kvcore_peer, key), expected, "64 MiB write")
        finally:
            kvcore_peer.call("free", key=key)

    def test_contract_scattered_write(self, kvcore_agent: TransferAgent, kvcore_peer: PeerProcess) -> None:
        """4096 permuted 4 KiB fragments land in the right slots; the unused slots stay zero."""
        n, frag, slots = 4096, 4096, 8192
        key = _key()
        dst = kvcore_peer.call("alloc", key=key, nbytes=slots * frag)["address"]
        try:
            data = pattern(3, n * frag)
            _, src = _source(kvcore_agent, data)
            where = np.random.default_rng(3).permutation(slots)[:n]
            peer = _connect(kvcore_agent, kvcore_peer)
            local = src + np.arange(n, dtype=np.uint64) * frag
            remote = dst + where.astype(np.uint64) * frag
            _run(kvcore_agent, TransferOp.WRITE, peer, local, remote, np.full(n, frag, dtype=np.uint64))
            expected = np.zeros((slots, frag), dtype=np.uint8)
            expected[where] = data.reshape(n, frag)
            _assert_bytes(_peer_bytes(kvcore_peer, key), expected.reshape(-1), "scattered write")
        finally:
            kvcore_peer.call("free", key=key)

    def test_contract_notification_once_after_data(self, kvcore_agent: TransferAgent, kvcore_peer: PeerProcess) -> None:
        """The notification reaches the peer exactly once, names the sender, and only after the data landed."""
        size = 8 * MiB
        key = _key()
        dst = kvcore_peer.call("alloc", key=key, nbytes=size)["address"]
        try:
            _, src = _source(kvcore_agent, pattern(4, size))
            peer = _connect(kvcore_agent, kvcore_peer)
            message = b"contract-" + uuid.uuid4().hex.encode()
            kvcore_peer.call("watch_start", key=key, expect=1, timeout=WAIT_S)
            _run(kvcore_agent, TransferOp.WRITE, peer, [src], [dst], [size], notification=message)
            seen = kvcore_peer.call("watch_result", timeout=WAIT_S + 5)["notifications"]
            assert [(r, m) for r, m, _ in seen] == [(kvcore_agent.name, message)]
            assert seen[0][2] == digest(pattern(4, size)), "the notification arrived before all the data had landed"
            late = kvcore_peer.call("notifications", expect=0, settle=0.3)["notifications"]
            assert late == [], f"notification delivered more than once: {late!r}"
        finally:
            kvcore_peer.call("free", key=key)

    def test_contract_remote_range_refused(self, kvcore_agent: TransferAgent, kvcore_peer: PeerProcess) -> None:
        """A destination outside registered memory raises ``RemoteRangeError`` before any byte moves."""
        page = 4096
        key = _key()
        # Three mapped pages, only the middle one registered: the outside is real memory a bug could hit.
        base = kvcore_peer.call("alloc", key=key, nbytes=3 * page, seed=5, reg_offset=page, reg_length=page)["address"]
        try:
            _, src = _source(kvcore_agent, pattern(6, 2 * page))
            peer = _connect(kvcore_agent, kvcore_peer)
            bad: list[tuple[Any, Any, Any]] = [
                ([src], [base + 2 * page], [16]),  # just past the end
                ([src], [base + 2 * page - 8], [16]),  # straddles the end
                ([src], [base + page - 8], [16]),  # straddles the start
                ([src], [base], [16]),  # before the start
                ([src], [base + page], [page + 1]),  # one byte too long
            ]
            # A batch whose last fragment is bad: the good ones must not move either.
            good_local = src + np.arange(64, dtype=np.uint64) * 64
            good_remote = base + page + np.arange(64, dtype=np.uint64) * 64
            bad.append(
                (
                    np.append(good_local, np.uint64(src)),
                    np.append(good_remote, np.uint64(base + 3 * page - 16)),
                    np.full(65, 64, dtype=np.uint64),
                )
            )
            for local, remote, sizes in bad:
                with pytest.raises(RemoteRangeError):
                    kvcore_agent.submit(TransferOp.WRITE, peer, local, remote, sizes)
                if kvcore_agent.capabilities.read:
                    with pytest.raises(RemoteRangeError):
                        kvcore_agent.submit(TransferOp.READ, peer, local, remote, sizes)
            _assert_bytes(_peer_bytes(kvcore_peer, key), pattern(5, 3 * page), "memory around a refused write")
            assert kvcore_agent.resources()["transfers"] == 0
        finally:
            kvcore_peer.call("free", key=key)

    def test_contract_deregistered_refused(self, kvcore_agent: TransferAgent, kvcore_peer: PeerProcess) -> None:
        """After the peer deregisters a region and the initiator reloads its descriptor, writes there are refused."""
        size = MiB
        gone, kept = _key(), _key()
        gone_addr = kvcore_peer.call("alloc", key=gone, nbytes=size, seed=7)["address"]
        kept_addr = kvcore_peer.call("alloc", key=kept, nbytes=size)["address"]
        try:
            _, src = _source(kvcore_agent, pattern(8, size))
            peer = _connect(kvcore_agent, kvcore_peer)
            new_descriptor = kvcore_peer.call("deregister", key=gone)["descriptor"]
            assert kvcore_agent.load_remote_agent(new_descriptor) == peer
            with pytest.raises(RemoteRangeError):
                kvcore_agent.submit(TransferOp.WRITE, peer, [src], [gone_addr], [size])
            _assert_bytes(_peer_bytes(kvcore_peer, gone), pattern(7, size), "deregistered memory")
            _run(kvcore_agent, TransferOp.WRITE, peer, [src], [kept_addr], [size])
            _assert_bytes(_peer_bytes(kvcore_peer, kept), pattern(8, size), "still-registered memory")
        finally:
            kvcore_peer.call("free", key=gone)
            kvcore_peer.call("free", key=kept)

    def test_contract_several_in_flight(self, kvcore_agent: TransferAgent, kvcore_peer: PeerProcess) -> None:
        """Eight transfers submitted before any is polled all complete, each with its own notification once."""
        count, size = 8, MiB
        key = _key()
        dst = kvcore_peer.call("alloc", key=key, nbytes=count * size)["address"]
        try:
            data = pattern(9, count * size)
            _, src = _source(kvcore_agent, data)
            peer = _connect(kvcore_agent, kvcore_peer)
            handles = [
                kvcore_agent.submit(
                    TransferOp.WRITE, peer, [src + i * size], [dst + i * size], [size], notification=b"inflight-%d" % i
                )
                for i in range(count)
            ]
            assert kvcore_agent.resources()["transfers"] == count
            for h in handles:
                kvcore_agent.wait(h, timeout=WAIT_S)
            for h in handles:
                kvcore_agent.release(h)
            assert kvcore_agent.resources()["transfers"] == 0
            got = kvcore_peer.call("notifications", expect=count, timeout=WAIT_S, settle=0.2)["notifications"]
            assert sorted(m for _, m in got) == sorted(b"inflight-%d" % i for i in range(count)), got
            assert {r for r, _ in got} == {kvcore_agent.name}
            _assert_bytes(_peer_bytes(kvcore_peer, key), data, "transfers in flight together")
        finally:
            kvcore_peer.call("free", key=key)

    def test_contract_read(self, kvcore_agent: TransferAgent, kvcore_peer: PeerProcess) -> None:
        """READ of permuted fragments copies the peer's bytes when declared, else raises ``UnsupportedOperationError``."""
        import torch

        n, frag = 256, 4096
        key = _key()
        remote_base = kvcore_peer.call("alloc", key=key, nbytes=n * frag, seed=10)["address"]
        try:
            local = kvcore_agent.allocate_tensor((n * frag,), torch.uint8)
            kvcore_agent.register_memory(local)
            peer = _connect(kvcore_agent, kvcore_peer)
            order = np.random.default_rng(10).permutation(n)
            args = (
                TransferOp.READ,
                peer,
                local.data_ptr() + np.arange(n, dtype=np.uint64) * frag,
                remote_base + order.astype(np.uint64) * frag,
                np.full(n, frag, dtype=np.uint64),
            )
            if not kvcore_agent.capabilities.read:
                with pytest.raises(UnsupportedOperationError):
                    kvcore_agent.submit(*args)
                return
            _run(kvcore_agent, *args)
            expected = pattern(10, n * frag).reshape(n, frag)[order].reshape(-1)
            _assert_bytes(local.cpu().numpy().view(np.uint8).reshape(-1), expected, "READ")
            _assert_bytes(_peer_bytes(kvcore_peer, key), pattern(10, n * frag), "the peer's memory after a READ")
        finally:
            kvcore_peer.call("free", key=key)

    def test_contract_release_frees_everything(
        self, kvcore_agent_class: type[TransferAgent], kvcore_agent_options: dict[str, Any], kvcore_peer: PeerProcess
    ) -> None:
        """After release, unload, deregister and close, ``resources()`` is all zero on both sides."""
        key = _key()
        dst = kvcore_peer.call("alloc", key=key, nbytes=MiB)["address"]
        agent = kvcore_agent_class(f"release-{uuid.uuid4().hex[:8]}", kvcore_agent_options)
        try:
            _, src = _source(agent, pattern(11, MiB))
            peer = _connect(agent, kvcore_peer)
            h = agent.submit(TransferOp.WRITE, peer, [src], [dst], [MiB], notification=b"release")
            agent.wait(h, timeout=WAIT_S)
            assert agent.resources()["transfers"] == 1
            agent.release(h)
            agent.release(h)  # idempotent
            assert agent.resources()["transfers"] == 0
            agent.unload_remote_agent(peer)
            assert agent.resources()["remote_agents"] == 0
            for reg in agent.registrations:
                agent.deregister_memory(reg)
            assert agent.resources()["registrations"] == 0
        finally:
            agent.close()
        left = {k: v for k, v in agent.resources().items() if v}
        assert not left, f"initiator still holds resources after close: {left}"
        agent.close()  # idempotent
        kvcore_peer.call("notifications", expect=1, timeout=WAIT_S)
        peer_left = {k: v for k, v in kvcore_peer.call("reopen")["resources"].items() if v}
        assert not peer_left, f"peer still holds resources after close: {peer_left}"

    def test_contract_dead_peer(
        self, kvcore_agent: TransferAgent, kvcore_backend: str, kvcore_agent_options: dict[str, Any]
    ) -> None:
        """A peer killed with SIGKILL gives a typed ``PeerLostError`` or ``TransferFailedError`` within a bound."""
        victim = PeerProcess(kvcore_backend, kvcore_agent_options, name=f"victim-{uuid.uuid4().hex[:8]}")
        try:
            dst = victim.call("alloc", key="k", nbytes=MiB)["address"]
            _, src = _source(kvcore_agent, pattern(12, MiB))
            peer = _connect(kvcore_agent, victim)
        finally:
            victim.kill()
        start = time.monotonic()
        with pytest.raises((PeerLostError, TransferFailedError)):
            h = kvcore_agent.submit(TransferOp.WRITE, peer, [src], [dst], [MiB], notification=b"to-the-dead")
            kvcore_agent.wait(h, timeout=DEAD_PEER_BOUND_S)
        elapsed = time.monotonic() - start
        assert elapsed < DEAD_PEER_BOUND_S + 1, f"dead peer took {elapsed:.1f}s to report"
        kvcore_agent.close()
        left = {k: v for k, v in kvcore_agent.resources().items() if v}
        assert not left, f"agent holds resources after a dead peer and close: {left}"

    def test_contract_malformed_descriptor(self, kvcore_agent: TransferAgent, kvcore_peer: PeerProcess) -> None:
        """Garbage, truncated, foreign or tampered descriptors raise ``RemoteAgentError`` and change nothing."""
        key = _key()
        kvcore_peer.call("alloc", key=key, nbytes=MiB)
        try:
            raw = kvcore_peer.call("descriptor")["descriptor"]
            desc = TransferAgent.decode_descriptor(raw)
            enc = msgspec.msgpack.encode
            bad: dict[str, Any] = {
                "empty": b"",
                "garbage": b"\x00\xffnot a descriptor",
                "truncated": raw[: len(raw) // 2],
                "not bytes": "a string",
                "other backend": enc(msgspec.structs.replace(desc, backend=desc.backend + "-other")),
                "future version": enc(msgspec.structs.replace(desc, version=desc.version + 1000)),
                "junk payload": enc(msgspec.structs.replace(desc, payload=b"\xc1\xc1junk payload")),
                "empty payload": enc(msgspec.structs.replace(desc, payload=b"")),
                "bad region": msgspec.msgpack.encode(
                    {**msgspec.to_builtins(desc), "regions": [[-5, 10, "DRAM", 0]], "payload": desc.payload}
                ),
            }
            before = kvcore_agent.remote_agents
            for what, data in bad.items():
                with pytest.raises(RemoteAgentError):
                    kvcore_agent.load_remote_agent(data)
                assert kvcore_agent.remote_agents == before, f"a {what} descriptor changed the loaded peers"
            # The untampered descriptor still names the peer and its backend (the decode above was not a no-op).
            assert (desc.name, desc.backend) == (kvcore_peer.name, kvcore_agent.backend)
            assert kvcore_agent.load_remote_agent(raw) == kvcore_peer.name  # the agent still works
        finally:
            kvcore_peer.call("free", key=key)

    def test_contract_large_write_vram(self, kvcore_agent: TransferAgent, kvcore_peer: PeerProcess) -> None:
        """VRAM -> VRAM: a 64 MiB WRITE between GPU tensors lands byte-for-byte (skipped without CUDA or VRAM support)."""
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        if MemoryKind.VRAM not in kvcore_agent.capabilities.memory_kinds:
            pytest.skip(f"{kvcore_agent.backend} agent does not support VRAM")
        size = 64 * MiB
        key = _key()
        dst = kvcore_peer.call("alloc", key=key, nbytes=size, device="cuda")["address"]
        try:
            _, src = _source(kvcore_agent, pattern(13, size), device="cuda")
            peer = _connect(kvcore_agent, kvcore_peer)
            _run(kvcore_agent, TransferOp.WRITE, peer, [src], [dst], [size])
            _assert_bytes(_peer_bytes(kvcore_peer, key), pattern(13, size), "64 MiB VRAM write")
        finally:
            kvcore_peer.call("free", key=key)


class TestLegacyContract(TransferAgentContract):
    """The suite for modules that still use ``from kvcore.testing.contract import *`` (deprecated).

    Reads ``KVCORE_CONTRACT_BACKEND`` / ``KVCORE_CONTRACT_OPTIONS`` from the importing test module. Only a star
    import brings this class into a test module; subclass ``TransferAgentContract`` instead.
    """

    @pytest.fixture(scope="class")
    @classmethod
    def kvcore_backend(cls, request: pytest.FixtureRequest) -> str:
        warnings.warn(
            f"{request.module.__name__}: 'from kvcore.testing.contract import *' with KVCORE_CONTRACT_BACKEND is "
            "deprecated; subclass kvcore.testing.contract.TransferAgentContract and set backend = '...'",
            DeprecationWarning,
            stacklevel=2,
        )
        name = getattr(request.module, "KVCORE_CONTRACT_BACKEND", None) or request.config.getoption(
            "kvcore_backend", default=None
        )
        if not name:
            pytest.fail("set KVCORE_CONTRACT_BACKEND = '<backend>' in the test module or pass --kvcore-backend")
        return str(name)

    @pytest.fixture(scope="class")
    @classmethod
    def kvcore_agent_options(cls, request: pytest.FixtureRequest) -> dict[str, Any]:
        return dict(getattr(request.module, "KVCORE_CONTRACT_OPTIONS", {}))
