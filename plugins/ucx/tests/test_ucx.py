"""UCX-specific tests: binding layouts, run merging, dead peers, thread shutdown, endpoint reuse, the benchmark."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import uuid
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

import numpy as np
import pytest

try:
    distribution("kvcore-ucx")
except PackageNotFoundError:  # only an absent plugin skips; a broken UCX install fails the tests
    pytest.skip("kvcore-ucx is not installed (pip install ./plugins/ucx)", allow_module_level=True)

from kvcore_ucx import _ucp
from kvcore_ucx.agent import UcxAgent, UcxOptions, merge_runs

from kvcore.errors import PeerLostError, RemoteAgentError, RemoteRangeError
from kvcore.testing.harness import PeerProcess, pattern
from kvcore.transport.agent import MemoryRegion, TransferOp

MiB = 1024 * 1024


def _progress_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvcore-ucx-progress-")]


def _source(agent: UcxAgent, data: np.ndarray) -> tuple[np.ndarray, int]:
    buf = data.copy()
    agent.register_memory(MemoryRegion(buf.ctypes.data, buf.nbytes))
    return buf, buf.ctypes.data


# --- pure parts --------------------------------------------------------------------------------


def test_merge_runs_merges_only_runs_contiguous_on_both_sides() -> None:
    local = np.array([100, 110, 120, 200, 300, 310], dtype=np.uint64)
    remote = np.array([1000, 1010, 1020, 5000, 7000, 9000], dtype=np.uint64)
    sizes = np.full(6, 10, dtype=np.uint64)
    key = np.array([0, 0, 1, 1, 1, 1])
    lo, re, sz, (k,) = merge_runs(local, remote, sizes, key)
    # 0+1 merge; 2 is contiguous but under another key; 3 is a jump; 4,5 contiguous locally only.
    assert lo.tolist() == [100, 120, 200, 300, 310]
    assert re.tolist() == [1000, 1020, 5000, 7000, 9000]
    assert sz.tolist() == [20, 10, 10, 10, 10]
    assert k.tolist() == [0, 1, 1, 1, 1]
    lo, re, sz, _ = merge_runs(
        np.arange(4, dtype=np.uint64) * 8 + 64, np.arange(4, dtype=np.uint64) * 8, np.full(4, 8, np.uint64)
    )
    assert (lo.tolist(), re.tolist(), sz.tolist()) == ([64], [0], [32])


def test_binding_struct_layouts_match_the_c_compiler(ucp: Any, tmp_path: Path) -> None:
    """Every sizeof/offsetof in the ABI-mode cdef equals what gcc computes from the wheel's ucp.h."""
    import cffi

    gcc = shutil.which("gcc") or shutil.which("cc")
    include = Path(ucp.libdir).parent / "include"
    if gcc is None or not (include / "ucp" / "api" / "ucp.h").exists():
        pytest.skip("needs a C compiler and the UCX headers (libucx wheel's include/)")
    ffi = cffi.FFI()
    ffi.cdef(_ucp.CDEF)
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <ucp/api/ucp.h>", "int main(void) {"]
    expected = []
    for s in _ucp.STRUCTS:
        lines.append(f'printf("{s} %zu\\n", sizeof({s}));')
        expected.append(f"{s} {ffi.sizeof(s)}")
        for f, _ in ffi.typeof(s).fields:
            lines.append(f'printf("{s}.{f} %zu\\n", offsetof({s}, {f}));')
            expected.append(f"{s}.{f} {ffi.offsetof(s, f)}")
    lines.append('printf("ucs_status_t %zu\\n", sizeof(ucs_status_t)); return 0; }')
    expected.append(f"ucs_status_t {ffi.sizeof('ucs_status_t')}")
    (tmp_path / "layout.c").write_text("\n".join(lines))
    subprocess.run([gcc, "-I", str(include), "layout.c", "-o", "layout"], cwd=tmp_path, check=True, timeout=60)
    actual = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, timeout=10, check=True)
    assert actual.stdout.splitlines() == expected


def test_status_pointer_decoding() -> None:
    assert _ucp.ptr_status(0) == _ucp.UCS_OK
    assert _ucp.ptr_status(0x7F00_1234_5678) == _ucp.UCS_INPROGRESS
    assert _ucp.ptr_status((1 << 64) - 3) == -3  # UCS_ERR_IO_ERROR
    assert _ucp.ptr_status((1 << 64) - 100) == -100


# --- one agent ---------------------------------------------------------------------------------


def test_options_are_checked(ucp: Any) -> None:
    from kvcore.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"ucx agent option 'error_handling': expected 'auto' or 'none' or 'peer', got 'sometimes'"
    ):
        UcxAgent("x", {"error_handling": "sometimes"})
    with pytest.raises(ConfigError, match=r"ucx agent option\(s\) 'progress_threads': unknown; expected one of"):
        UcxAgent("x", {"progress_threads": 2})
    with pytest.raises(ConfigError, match=r"ucx agent option 'close_timeout_s': expected float > 0, got '2' \(str\)"):
        UcxAgent("x", {"close_timeout_s": "2"})
    with pytest.raises(ConfigError, match=r"ucx agent option 'max_notification_bytes': expected int > 0, got 0"):
        UcxAgent("x", {"max_notification_bytes": 0})
    assert not _progress_threads()


def test_options_are_typed_with_defaults_and_reach_the_agent(ucp: Any) -> None:
    assert UcxAgent.options_type is UcxOptions
    assert UcxOptions() == UcxOptions(
        error_handling="auto",
        ucx_config={},
        progress_thread=True,
        progress_interval_s=0.05,
        close_timeout_s=2.0,
        max_notification_bytes=64 * 1024,
    )
    before = len(_progress_threads())
    quiet = UcxAgent("quiet", {"progress_thread": False, "error_handling": "peer"})
    try:
        assert quiet.opts.error_handling == "peer" and len(_progress_threads()) == before  # no thread started
    finally:
        quiet.close()


def test_close_joins_the_progress_thread_within_its_bound(ucp: Any) -> None:
    before = len(_progress_threads())
    # A 60 s progress poll and a 10 s join bound: only ucp_worker_signal waking the thread lets close() join it
    # (without the wake-up the join times out and the thread is still there), so no tight wall-clock limit is needed.
    agents = [UcxAgent(f"t{i}", {"progress_interval_s": 60.0, "close_timeout_s": 10.0}) for i in range(3)]
    assert len(_progress_threads()) == before + 3
    for a in agents:
        assert a.resources()["progress_threads"] == 1
        t0 = time.monotonic()
        a.close()
        assert time.monotonic() - t0 < 10.0, "close() waited for its join bound: the progress thread was not woken"
        assert a.resources()["progress_threads"] == 0
    assert len(_progress_threads()) == before
    agents[0].close()  # idempotent


def test_vram_is_refused_without_cuda(ucp: Any) -> None:
    from kvcore.errors import UnsupportedOperationError

    with UcxAgent("vram") as a:
        if a._memory_types & (1 << _ucp.UCS_MEMORY_TYPE_CUDA):
            pytest.skip("this UCX sees CUDA; VRAM registration is exercised by the contract suite")
        with pytest.raises(UnsupportedOperationError, match="CUDA"):
            a.register_memory(MemoryRegion(0x10000, 4096, kind=__import__("kvcore").MemoryKind.VRAM))
        assert a.resources()["registrations"] == 0


# --- two processes -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "peer"])
def test_dead_peer_is_peer_lost_and_close_is_bounded(ucp: Any, mode: str) -> None:
    options = {"error_handling": mode}
    agent = UcxAgent(f"init-{uuid.uuid4().hex[:6]}", options)
    victim = PeerProcess("ucx", options, name=f"victim-{uuid.uuid4().hex[:6]}")
    try:
        dst = victim.call("alloc", key="k", nbytes=MiB)["address"]
        _, src = _source(agent, pattern(3, MiB))
        peer = agent.load_remote_agent(victim.call("descriptor")["descriptor"])
        h = agent.submit(TransferOp.WRITE, peer, [src], [dst], [MiB], notification=b"alive")
        agent.wait(h, 10)
        agent.release(h)
        victim.kill()
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="died or is unreachable"):
            h = agent.submit(TransferOp.WRITE, peer, [src], [dst], [MiB], notification=b"dead")
            agent.wait(h, 10)
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        agent.close()
        assert time.monotonic() - t0 < 5
        assert not any(agent.resources().values()), agent.resources()
    finally:
        victim.kill()
        agent.close()


def test_error_handling_mismatch_is_refused_at_load(ucp: Any) -> None:
    with PeerProcess("ucx", {"error_handling": "peer"}, name="peer-mode") as other, UcxAgent("none-mode") as agent:
        with pytest.raises(RemoteAgentError, match="error_handling"):
            agent.load_remote_agent(other.call("descriptor")["descriptor"])


def test_endpoint_is_reused_when_the_peer_refreshes_its_descriptor(ucp: Any) -> None:
    with PeerProcess("ucx", {}, name="refresh") as other, UcxAgent("refresher") as agent:
        a1 = other.call("alloc", key="a", nbytes=MiB, seed=1)["address"]
        peer = agent.load_remote_agent(other.call("descriptor")["descriptor"])
        ep_before = agent.remote(peer).native.ep
        a2 = other.call("alloc", key="b", nbytes=MiB, seed=2)["address"]
        # a stale descriptor does not know region b yet
        _, src = _source(agent, pattern(9, MiB))
        with pytest.raises(RemoteRangeError):
            agent.submit(TransferOp.WRITE, peer, [src], [a2], [MiB])
        assert agent.load_remote_agent(other.call("descriptor")["descriptor"]) == peer
        assert agent.remote(peer).native.ep == ep_before, "refresh of the same process must keep the endpoint"
        h = agent.submit(TransferOp.WRITE, peer, [src, src + 4096], [a2, a1], [4096, 4096], notification=b"n")
        agent.wait(h, 10)
        agent.release(h)
        got_b = np.frombuffer(other.call("read", key="b", offset=0, length=4096)["data"], np.uint8)
        got_a = np.frombuffer(other.call("read", key="a", offset=0, length=4096)["data"], np.uint8)
        assert np.array_equal(got_b, pattern(9, MiB)[:4096])
        assert np.array_equal(got_a, pattern(9, MiB)[4096:8192])
        assert agent.resources()["ucx_retired_rkey_sets"] == 0


def test_fragment_spanning_two_adjacent_peer_registrations_is_refused(ucp: Any) -> None:
    """Base-class range checks merge adjacent regions; rkeys do not, so the agent refuses the straddle."""
    with UcxAgent("adjacent-target") as target, UcxAgent("straddler") as agent:
        buf = np.zeros(8192, dtype=np.uint8)
        base = buf.ctypes.data
        target.register_memory(MemoryRegion(base, 4096))
        target.register_memory(MemoryRegion(base + 4096, 4096))
        _, src = _source(agent, pattern(5, 8192))
        peer = agent.load_remote_agent(target.descriptor())
        with pytest.raises(RemoteRangeError, match="one registration"):
            agent.submit(TransferOp.WRITE, peer, [src], [base + 4096 - 8], [16])
        # each side of the boundary alone is fine (in-process: UCX loops back through its self/shm transports)
        h = agent.submit(
            TransferOp.WRITE, peer, [src, src + 8], [base + 4096 - 8, base + 4096], [8, 8], notification=b"x"
        )
        agent.wait(h, 10)
        agent.release(h)
        assert np.array_equal(buf[4088:4104], pattern(5, 8192)[:16])
        deadline = time.monotonic() + 5
        notes: list[Any] = []
        while not notes and time.monotonic() < deadline:
            notes = target.get_notifications()
        assert [(n.remote, n.message) for n in notes] == [("straddler", b"x")]


def test_benchmark_core_runs_and_verifies(ucp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcore_ucx.bench import designs as bench

    monkeypatch.setitem(bench.CASES, "tiny", (64, 4096))
    result = bench.run(designs=["B"], cases=["tiny"], iterations=1)
    tiny = result["B"]["tiny"]
    assert tiny["verified"] and tiny["notifications_ok"], tiny
    assert tiny["gbps_median"] > 0
    assert result["memcpy"]["tiny"]["contiguous_gbps"] > 0


# --- error handling per peer ("auto": none on one host, peer across hosts) ----------------------------------


def _claim_host(descriptor: bytes, identity: str) -> bytes:
    """The same descriptor with its ucx payload claiming another host identity."""
    import msgspec
    from kvcore_ucx.agent import _Payload

    from kvcore.transport.agent import TransferAgent

    desc = TransferAgent.decode_descriptor(descriptor)
    payload = msgspec.msgpack.decode(desc.payload, type=_Payload)
    fake = msgspec.structs.replace(payload, host_identity=identity)
    return msgspec.msgpack.encode(msgspec.structs.replace(desc, payload=msgspec.msgpack.encode(fake)))


def test_auto_error_handling_picks_the_mode_per_peer(ucp: Any) -> None:
    with UcxAgent("a", {"progress_thread": False}) as a, UcxAgent("b", {"progress_thread": False}) as b:
        buf = np.zeros(4096, dtype=np.uint8)
        b.register_memory(MemoryRegion(buf.ctypes.data, buf.nbytes))
        assert a.peer_error_mode(a.load_remote_agent(b.descriptor())) == "none"  # same host: shm/CMA
        a.unload_remote_agent("b")
        assert a.peer_error_mode(a.load_remote_agent(_claim_host(b.descriptor(), "other-boot/1"))) == "peer"


def test_forced_mode_against_auto_is_refused_only_where_they_differ(ucp: Any) -> None:
    with UcxAgent("auto", {"progress_thread": False}) as auto, UcxAgent("peer", {"error_handling": "peer"}) as peer:
        with pytest.raises(RemoteAgentError, match=r"this agent uses 'none' \(option 'auto'\)"):
            auto.load_remote_agent(peer.descriptor())  # one host: auto means none, the peer forces peer
        remote = auto.load_remote_agent(_claim_host(peer.descriptor(), "other-boot/1"))
        assert auto.peer_error_mode(remote) == "peer"  # another host: auto means peer too


def test_ucx_config_is_applied_and_a_bad_key_is_named(ucp: Any) -> None:
    from kvcore.errors import TransferError

    with UcxAgent("tls", {"ucx_config": {"UCX_TLS": "tcp,self", "TCP_PORT_RANGE": "21000-21999"}}) as agent:
        assert agent.worker_address
    with pytest.raises(TransferError, match="NO_SUCH_SETTING"):
        UcxAgent("bad", {"ucx_config": {"NO_SUCH_SETTING": "1"}})


# --- the bench baseline: bare UCX on the identical plan ----------------------------------------------


def test_bare_ucx_baseline_is_registered_and_moves_the_plan_byte_for_byte(ucp: Any) -> None:
    """``ucx_put`` (registered through the hook) writes a scattered plan into another process's kvcore agent."""
    from kvcore.extension.plugins import make_plugin_manager
    from kvcore.testing.harness import digest
    from kvcore.transport.baselines import BaselinePlan

    reg = make_plugin_manager().registries.bench_baselines
    assert reg.for_backend("ucx") == ["ucx_put"] and reg.matrix_mode("ucx") == "ucx_put"
    frag, n = 4096, 64
    src_pool = pattern(21, frag * n)
    perm = np.random.default_rng(22).permutation(n)
    with PeerProcess("ucx", {}, name=f"bare-target-{uuid.uuid4().hex[:6]}") as peer:
        base = peer.call("alloc", key="dst", nbytes=frag * n)["address"]
        plan = BaselinePlan(
            src=np.uint64(src_pool.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(frag),
            dst=np.uint64(base) + perm.astype(np.uint64) * np.uint64(frag),
            sizes=np.full(n, frag, dtype=np.uint64),
            pool_base=src_pool.ctypes.data,
            pool_bytes=src_pool.nbytes,
            peer_descriptor=peer.call("descriptor")["descriptor"],
            agent_options={},
            timeout_s=30.0,
        )
        bare = reg.get("ucx_put")(plan)
        try:
            seconds, submit = bare.once()
            assert seconds >= submit > 0
            bare.once()  # re-posted: the setup is reused
        finally:
            bare.close()
        expected = np.empty((n, frag), dtype=np.uint8)
        expected[perm] = src_pool.reshape(n, frag)  # fragment i lands in slot perm[i]
        assert peer.call("digest", key="dst")["digest"] == digest(expected)
