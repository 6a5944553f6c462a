"""NIXL-specific tests: error mapping, install hint, backend options, prepared-list reuse, peer refresh, progress.

Every test that moves bytes does so between this process and a real peer
process (``_peer.Peer``), through real NIXL; expectations come from
``_peer.pattern``, computed without NIXL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from importlib.metadata import PackageNotFoundError, distribution

import msgspec
import numpy as np
import pytest

try:
    distribution("kvcore-nixl")
except PackageNotFoundError:  # only an absent plugin skips; a broken NIXL install fails below
    pytest.skip("kvcore-nixl is not installed (pip install './plugins/nixl[cu12]')", allow_module_level=True)

import torch
from kvcore_nixl.agent import NVIDIA_DRIVER_PROC, NixlAgent, NixlOptions, decode_payload, load_nixl, ucx_tls_hint

from kvcore.errors import (
    ConfigError,
    PeerLostError,
    RegistrationError,
    RemoteRangeError,
    TransferError,
    TransferTimeoutError,
    UnsupportedOperationError,
)
from kvcore.transport.agent import AgentDescriptor, RegionInfo, TransferAgent, TransferOp

sys.path.insert(0, os.path.dirname(__file__))
from _peer import Peer, pattern

load_nixl()  # a broken NIXL install fails every test here instead of skipping them

KiB = 1024
MiB = 1024 * KiB


def _source(agent: NixlAgent, seed: int, nbytes: int) -> torch.Tensor:
    src = torch.from_numpy(pattern(seed, nbytes).copy())
    agent.register_memory(src)
    return src


def _write(
    agent: NixlAgent, peer: str, local: np.ndarray, remote: np.ndarray, sizes: np.ndarray, notif: bytes | None = None
) -> None:
    h = agent.submit(TransferOp.WRITE, peer, local, remote, sizes, notification=notif)
    agent.wait(h, timeout=10.0)
    agent.release(h)


def _peer_bytes(p: Peer) -> np.ndarray:
    return np.frombuffer(p.call("read", offset=0, length=p.nbytes)["data"], dtype=np.uint8)


@pytest.fixture
def agent() -> NixlAgent:
    a = NixlAgent("ctx")
    yield a
    a.close()


# --- packaging, import, options --------------------------------------------------------------------


def test_missing_install_gives_typed_error_with_hint() -> None:
    """With every nixl module unimportable, constructing the agent raises UnknownBackendError naming the fix."""
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
                    raise ImportError(f"blocked {name}")
                return None
        sys.meta_path.insert(0, Block())
        from kvcore.errors import UnknownBackendError
        from kvcore_nixl.agent import NixlAgent
        try:
            NixlAgent("x")
        except UnknownBackendError as exc:
            print("TYPED", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "TYPED" in out.stdout, out.stderr
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api", "pip install", "kvcore-nixl[cu12]"):
        assert name in out.stdout


def test_plugin_module_imports_nothing_heavy() -> None:
    code = "import sys, kvcore_nixl.plugin; print(sorted(m for m in ('torch', 'nixl_cu12', 'kvcore_nixl.agent') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_registry_finds_nixl_agent() -> None:
    from kvcore.extension.plugins import make_plugin_manager

    pm = make_plugin_manager()
    entry = pm.registries.transfer_agents.entry("nixl")
    assert entry.load() is NixlAgent
    assert entry.capabilities is not None and entry.capabilities.read and not entry.capabilities.can_abort


def test_backend_params_default_and_override() -> None:
    a = NixlAgent("a")
    b = NixlAgent("b", {"backend_params": {"ucx_error_handling_mode": "peer", "num_workers": 2}})
    try:
        assert a.backend_params["ucx_error_handling_mode"] == "none"
        assert b.backend_params["ucx_error_handling_mode"] == "peer"
        assert b.backend_params["num_workers"] == "2"
        assert a.nixl_name != b.nixl_name and a.nixl_name.startswith("a#")
    finally:
        a.close()
        b.close()


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"nixl agent option\(s\) 'backend': unknown; expected one of .*nixl_backend"):
        NixlAgent("x", {"backend": "UCX"})
    with pytest.raises(ConfigError, match=r"NOPE.*available: .*UCX"):
        NixlAgent("x", {"nixl_backend": "NOPE"})
    with pytest.raises(
        ConfigError, match=r"nixl agent option 'unit_dlists': expected true or false or 'auto', got 'sometimes' \(str\)"
    ):
        NixlAgent("x", {"unit_dlists": "sometimes"})
    with pytest.raises(ConfigError, match=r"nixl agent option 'progress_delay_us': expected int >= 0, got -1 \(int\)"):
        NixlAgent("x", {"progress_delay_us": -1})
    with pytest.raises(ConfigError, match=r"nixl agent option 'peers': expected 'any' or 'same_host' or 'cross_host'"):
        NixlAgent("x", {"peers": "everyone"})
    with pytest.raises(ConfigError, match=r"nixl agent option 'backend_params': expected a mapping of str to"):
        NixlAgent("x", {"backend_params": ["ucx_error_handling_mode=peer"]})


def test_options_are_typed_with_defaults() -> None:
    assert NixlAgent.options_type is NixlOptions
    defaults = NixlOptions()
    assert (defaults.nixl_backend, defaults.peers, defaults.progress_thread, defaults.unit_dlists) == (
        "UCX",
        "any",
        False,
        "auto",
    )
    a = NixlAgent("typed", {"peers": "same_host", "unit_dlist_cache": 2})
    try:
        assert a.opts == NixlOptions(peers="same_host", unit_dlist_cache=2)
        lanes = decode_payload(a.descriptor()).lanes
        assert [lane.scopes for lane in lanes] == [["same_host"]]  # the option reached the agent: one lane
    finally:
        a.close()


def _task_cpu_s(tids: set[str]) -> float:
    """CPU seconds (user + system) the given threads of this process used so far (ended threads count 0)."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def test_progress_thread_does_not_spin() -> None:
    """The optional progress thread sleeps between rounds: over 3 s idle, the agent's own threads use little CPU.

    Only the threads the agent started are measured (not the whole pytest process), so other work on a
    loaded machine cannot make this fail; a spinning thread uses ~3 s of CPU in 3 s, a sleeping one ~none.
    """
    before = set(os.listdir("/proc/self/task"))
    a = NixlAgent("idle", {"progress_thread": True, "progress_delay_us": 1000})
    try:
        mine = set(os.listdir("/proc/self/task")) - before
        assert mine, "the agent started no thread: progress_thread had no effect"
        c0 = _task_cpu_s(mine)
        time.sleep(3.0)  # the measurement window, not a synchronisation
        used = _task_cpu_s(mine) - c0
        assert used < 0.75, f"the idle agent's threads used {used:.2f}s CPU in 3s"
    finally:
        a.close()


# --- transfers -------------------------------------------------------------------------------------


def test_prepped_lists_reused_and_bytes_match(agent: NixlAgent) -> None:
    """Forced unit lists: two submits of different permutations reuse one cached list pair; bytes are right."""
    unit, n = 16 * KiB, 64
    prepped = NixlAgent("ctx-prepped", {"unit_dlists": True})
    try:
        with Peer("gen", nbytes=unit * n) as p:
            src = _source(prepped, 11, unit * n)
            peer = prepped.load_remote_agent(p.descriptor)
            expected = np.zeros(unit * n, dtype=np.uint8)
            src_np = pattern(11, unit * n).reshape(n, unit)
            for seed in (1, 2):
                perm = np.random.default_rng(seed).permutation(n)[: n // 2]  # half the blocks, scattered
                local = np.uint64(src.data_ptr()) + np.arange(n // 2, dtype=np.uint64) * np.uint64(unit)
                remote = np.uint64(p.base) + perm.astype(np.uint64) * np.uint64(unit)
                _write(prepped, peer, local, remote, np.full(n // 2, unit, dtype=np.uint64))
                expected.reshape(n, unit)[perm] = src_np[: n // 2]
                assert prepped.resources()["nixl_dlists"] == 2  # one local, one remote unit list, reused
                np.testing.assert_array_equal(_peer_bytes(p), expected)
            # The one-step path on the same plan writes the same bytes.
            p.call("fill", seed=99)
            agent.register_memory(src)
            peer2 = agent.load_remote_agent(p.descriptor)
            perm = np.random.default_rng(3).permutation(n)
            local = np.uint64(src.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(unit)
            remote = np.uint64(p.base) + perm.astype(np.uint64) * np.uint64(unit)
            sizes = np.full(n, unit, dtype=np.uint64)
            _write(agent, peer2, local, remote, sizes)
            via_direct = _peer_bytes(p).copy()
            p.call("fill", seed=99)
            _write(prepped, peer, local, remote, sizes)
            np.testing.assert_array_equal(_peer_bytes(p), via_direct)
            exp = np.empty((n, unit), dtype=np.uint8)
            exp[perm] = src_np
            np.testing.assert_array_equal(via_direct, exp.ravel())
    finally:
        prepped.close()
    assert set(prepped.resources().values()) == {0}


def test_unaligned_and_mixed_fragments_merge(agent: NixlAgent) -> None:
    """Unequal, unaligned and contiguous fragments take the one-step path and land exactly."""
    with Peer("gen", nbytes=1 * MiB) as p:
        src = _source(agent, 5, 1 * MiB)
        peer = agent.load_remote_agent(p.descriptor)
        local = np.array([3, 100, 113, 5000], dtype=np.uint64) + np.uint64(src.data_ptr())
        remote = np.array([7, 1000, 1013, 300000], dtype=np.uint64) + np.uint64(p.base)
        sizes = np.array([97, 13, 50, 70000], dtype=np.uint64)
        _write(agent, peer, local, remote, sizes, b"mixed")
        got, s = _peer_bytes(p), pattern(5, 1 * MiB)
        exp = np.zeros(1 * MiB, dtype=np.uint8)
        for lo, ro, n in [(3, 7, 97), (100, 1000, 13), (113, 1013, 50), (5000, 300000, 70000)]:
            exp[ro : ro + n] = s[lo : lo + n]
        np.testing.assert_array_equal(got, exp)
        notifs = p.call("notifs", count=1, timeout=5.0)["notifs"]
        assert notifs == [["ctx", b"mixed"]]  # the kvcore name, not NIXL's unique agent name


def test_empty_notification_refused(agent: NixlAgent) -> None:
    with Peer("gen", nbytes=64 * KiB) as p:
        src = _source(agent, 1, 64 * KiB)
        peer = agent.load_remote_agent(p.descriptor)
        with pytest.raises(UnsupportedOperationError, match="empty notification"):
            agent.submit(TransferOp.WRITE, peer, [src.data_ptr()], [p.base], [4096], notification=b"")
        assert agent.resources()["transfers"] == 0


def test_range_nixl_does_not_know_maps_to_remote_range_error(agent: NixlAgent) -> None:
    """A descriptor claiming more memory than the peer's NIXL metadata holds: NIXL refuses, kvcore types it."""
    with Peer("gen", nbytes=64 * KiB) as p:
        src = _source(agent, 1, 256 * KiB)
        desc = TransferAgent.decode_descriptor(p.descriptor)
        forged = msgspec.structs.replace(
            desc, regions=[RegionInfo(p.base, 256 * KiB, "DRAM", 0)], generation=desc.generation + 1
        )
        peer = agent.load_remote_agent(msgspec.msgpack.encode(forged))
        with pytest.raises(RemoteRangeError, match="NIXL does not know"):
            agent.submit(TransferOp.WRITE, peer, [src.data_ptr()], [p.base + 128 * KiB], [4096])
        # The agent is unaffected: a valid write still works.
        _write(agent, peer, np.array([src.data_ptr()]), np.array([p.base]), np.array([4096]))
        np.testing.assert_array_equal(_peer_bytes(p)[:4096], pattern(1, 4096))


def test_bad_payload_is_remote_agent_error(agent: NixlAgent) -> None:
    from kvcore.errors import RemoteAgentError

    desc = AgentDescriptor(1, "nixl", "evil", "x" * 32, 1, [], b"\x93\x01")
    with pytest.raises(RemoteAgentError, match="nixl payload"):
        agent.load_remote_agent(msgspec.msgpack.encode(desc))


def test_registration_failure_is_registration_error(agent: NixlAgent) -> None:
    from kvcore.transport.agent import MemoryKind, MemoryRegion

    if torch.cuda.is_available():
        pytest.skip("a bogus VRAM address is only guaranteed to fail without CUDA")
    with pytest.raises(RegistrationError, match="VRAM"):
        agent.register_memory(MemoryRegion(0x1000, 4096, MemoryKind.VRAM, 0))
    assert agent.resources()["registrations"] == 0


def test_peer_refresh_after_new_registration(agent: NixlAgent) -> None:
    """The peer registers more memory; after reloading its descriptor the new region is writable, old lists dropped."""
    with Peer("gen", nbytes=64 * KiB) as p:
        src = _source(agent, 3, 64 * KiB)
        peer = agent.load_remote_agent(p.descriptor)
        _write(agent, peer, np.array([src.data_ptr()]), np.array([p.base]), np.array([4096]))
        extra = p.call("register_extra", nbytes=64 * KiB)
        with pytest.raises(RemoteRangeError):
            agent.submit(TransferOp.WRITE, peer, [src.data_ptr()], [extra["base"]], [4096])
        assert agent.load_remote_agent(extra["desc"]) == peer
        assert decode_payload(extra["desc"]).nixl_name == decode_payload(p.descriptor).nixl_name
        _write(agent, peer, np.array([src.data_ptr()]), np.array([extra["base"]]), np.array([64 * KiB]), b"new")
        assert p.call("notifs", count=2, timeout=5.0)["notifs"][-1] == ["ctx", b"new"]


def test_deregistered_peer_memory_refused_after_reload(agent: NixlAgent) -> None:
    with Peer("gen", nbytes=64 * KiB) as p:
        src = _source(agent, 3, 64 * KiB)
        peer = agent.load_remote_agent(p.descriptor)
        _write(agent, peer, np.array([src.data_ptr()]), np.array([p.base]), np.array([4096]))
        agent.load_remote_agent(p.call("deregister")["desc"])
        with pytest.raises(RemoteRangeError, match="not inside memory"):
            agent.submit(TransferOp.WRITE, peer, [src.data_ptr()], [p.base], [4096])


def test_local_deregistration_drops_lists(agent: NixlAgent) -> None:
    with Peer("gen", nbytes=256 * KiB) as p:
        src = torch.from_numpy(pattern(4, 256 * KiB).copy())
        reg = agent.register_memory(src)
        peer = agent.load_remote_agent(p.descriptor)
        n, unit = 16000, 16  # above direct_max_descriptors: the prepared path
        local = np.uint64(src.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(unit)
        remote = np.uint64(p.base) + np.random.default_rng(0).permutation(n).astype(np.uint64) * np.uint64(unit)
        _write(agent, peer, local, remote, np.full(n, unit, dtype=np.uint64))
        assert agent.resources()["nixl_dlists"] == 2
        agent.deregister_memory(reg)
        assert agent.resources()["nixl_dlists"] == 1  # the peer's list survives, ours is gone
        with pytest.raises(RegistrationError):
            agent.submit(TransferOp.WRITE, peer, local[:1], remote[:1], [unit])


def test_dead_peer_is_peer_lost(agent: NixlAgent) -> None:
    with Peer("gen", nbytes=4 * MiB) as p:
        src = _source(agent, 2, 4 * MiB)
        peer = agent.load_remote_agent(p.descriptor)
        _write(agent, peer, np.array([src.data_ptr()]), np.array([p.base]), np.array([4096]))
        p.kill()
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match=r"died|lost"):
            for _ in range(50):
                _write(agent, peer, np.array([src.data_ptr()]), np.array([p.base]), np.array([4 * MiB]))
        assert time.monotonic() - t0 < 10.0


@pytest.mark.parametrize(
    ("tls", "gpu", "hinted"),
    [("tcp", True, True), ("tcp,sm", True, True), ("tcp,cuda_copy", True, False), ("^ib", True, False),
     ("all", True, False), (None, True, False), ("tcp", False, False)],
)  # fmt: skip
def test_a_ucx_tls_without_cuda_on_a_gpu_machine_is_named_in_the_error(
    tls: str | None, gpu: bool, hinted: bool
) -> None:
    """NIXL refuses such a UCX_TLS with NIXL_ERR_BACKEND alone (its reason only in its log): the error says why."""
    hint = ucx_tls_hint("UCX", tls, gpu)
    assert bool(hint) is hinted
    if hinted:
        assert repr(tls) in hint and "cuda_copy" in hint
    assert ucx_tls_hint("GDS", tls, gpu) == ""


def test_stopped_peer_times_out_and_cannot_be_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX over TCP (puts need the target): a SIGSTOPped target never completes a write; wait() bounds it,
    release() refuses, and the transfer completes once the peer runs again."""
    # Read by UCX when the backend is created, here and in the spawned peer. NIXL refuses a UCX_TLS without a
    # CUDA transport where the NVIDIA driver is loaded (seen on an H200 machine): cuda_copy there, for host
    # memory it changes nothing.
    gpu = os.path.exists(NVIDIA_DRIVER_PROC)
    monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy" if gpu else "tcp")
    opts = {"backend_params": {"ucx_error_handling_mode": "peer"}}
    a = NixlAgent("ctx", opts)
    try:
        with Peer("gen", nbytes=4 * MiB, options=opts) as p:
            src = _source(a, 2, 4 * MiB)
            peer = a.load_remote_agent(p.descriptor)
            _write(a, peer, np.array([src.data_ptr()]), np.array([p.base]), np.array([4096]))  # connect
            os.kill(p.pid, signal.SIGSTOP)
            try:
                h = a.submit(TransferOp.WRITE, peer, [src.data_ptr()], [p.base], [4 * MiB], notification=b"late")
                with pytest.raises(TransferTimeoutError):
                    a.wait(h, timeout=1.0)
                with pytest.raises(TransferError, match="cannot abort"):
                    a.release(h)
                with pytest.raises(RegistrationError, match="in flight"):
                    a.deregister_memory(a.registrations[0])
                assert a.resources()["registrations"] == 1  # refused: still registered, source kept alive
            finally:
                os.kill(p.pid, signal.SIGCONT)
            a.wait(h, timeout=10.0)
            a.release(h)
            np.testing.assert_array_equal(_peer_bytes(p)[: 4 * MiB], pattern(2, 4 * MiB))
    finally:
        a.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_vram_source_to_dram_peer(agent: NixlAgent) -> None:
    """A CUDA tensor registers as VRAM (device index kept) and writes scattered fragments into a DRAM peer."""
    unit, n = 64 * KiB, 32
    with Peer("gen", nbytes=unit * n) as p:
        src = torch.from_numpy(pattern(8, unit * n).copy()).cuda()
        reg = agent.register_memory(src)
        assert reg.region.kind.value == "VRAM" and reg.region.device_id == src.device.index
        peer = agent.load_remote_agent(p.descriptor)
        perm = np.random.default_rng(8).permutation(n)
        local = np.uint64(src.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(unit)
        remote = np.uint64(p.base) + perm.astype(np.uint64) * np.uint64(unit)
        _write(agent, peer, local, remote, np.full(n, unit, dtype=np.uint64), b"vram")
        exp = np.empty((n, unit), dtype=np.uint8)
        exp[perm] = pattern(8, unit * n).reshape(n, unit)
        np.testing.assert_array_equal(_peer_bytes(p), exp.ravel())


def test_bench_core_runs_small() -> None:
    """``kvcore_nixl.bench.bare_vs_agent.run_bench`` (what ``kvcore bench`` will call) returns numbers and verified bytes."""
    from kvcore_nixl.bench.bare_vs_agent import run_bench

    r = run_bench(blocks=2, layers=4, iterations=1)
    assert r["fragments"] == 2 * 4 * 2 and r["bytes"] == r["fragments"] * 64 * KiB
    assert r["verified"] == {m: True for m in ("bare_nixl", "agent", "bare_nixl_initialize", "agent_prepped", "memcpy")}
    assert r["agent_gbps"] > 0 and r["bare_nixl_gbps"] > 0 and r["agent_vs_bare"] > 0
