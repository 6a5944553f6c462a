"""The data plane off the control thread (issue 16): chunked plans, the shm agent's copy threads, the hol case.

Real shm agents (two in this process: the capability rule only asks that each
loaded the other), real rank processes for the bench case. Nothing here asserts
a duration: only bytes, order of completion (with one copy thread the order is
deterministic) and the shape of the bench's result.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvcore.errors import ConfigError, TransferError
from kvcore.tools.bench import installed_backends
from kvcore.transceiver.link import CHUNK_BYTES, chunk_plan
from kvcore.transport.agent import TransferOp, TransferStatus
from kvcore.transport.builtin.shm import ShmAgent

MiB = 1 << 20


# --- chunk_plan --------------------------------------------------------------------------------------


def _apply(src_mem: np.ndarray, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, n: int) -> np.ndarray:
    """Run a plan of (offset, offset, size) fragments on byte arrays: the reference copy loop."""
    out = np.zeros(n, np.uint8)
    for s, d, k in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        out[d : d + k] = src_mem[s : s + k]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_chunk_plan_moves_exactly_the_plans_bytes_in_bounded_chunks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 40))
    sizes = rng.integers(1, 5000, count).astype(np.uint64)
    limit = int(rng.integers(64, 3000))
    # disjoint destination slots in shuffled order; sources anywhere
    dst_slots = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)
    order = rng.permutation(count)
    dst = dst_slots[order]
    sizes = sizes[order]
    total = int(sizes.sum())
    src = rng.integers(0, 10_000, count).astype(np.uint64)
    src_mem = rng.integers(0, 256, 20_000, dtype=np.uint8)

    s2, d2, z2, bounds = chunk_plan(src, dst, sizes, limit)

    assert bounds[0] == 0 and bounds[-1] == z2.size and bounds == sorted(set(bounds))
    assert int(z2.sum()) == total and int(z2.max()) <= limit and int(z2.min()) >= 1
    for a, b in itertools.pairwise(bounds):
        assert int(z2[a:b].sum()) <= 2 * limit
    want = _apply(src_mem, src, dst, sizes, total)
    assert np.array_equal(_apply(src_mem, s2, d2, z2, total), want)
    chunked = np.zeros(total, np.uint8)
    for a, b in itertools.pairwise(bounds):  # chunk by chunk, in order, gives the same bytes
        part = _apply(src_mem, s2[a:b], d2[a:b], z2[a:b], total)
        mask = np.zeros(total, bool)
        for d, k in zip(d2[a:b].tolist(), z2[a:b].tolist(), strict=True):
            mask[d : d + k] = True
        chunked[mask] = part[mask]
    assert np.array_equal(chunked, want)


def test_chunk_plan_keeps_a_small_plan_whole() -> None:
    src, dst, sizes, bounds = chunk_plan(np.array([10]), np.array([20]), np.array([30]), 1 << 20)
    assert bounds == [0, 1] and sizes.tolist() == [30] and src.tolist() == [10] and dst.tolist() == [20]


# --- the shm agent's copy threads ------------------------------------------------------------------------


@pytest.fixture
def shm_pair() -> Any:
    options = {"copy_threads": 1}  # one copy thread: the round-robin order is deterministic
    a, b = ShmAgent("dp-a", options), ShmAgent("dp-b", options)
    try:
        dst = b.allocate_tensor((96 * MiB,), torch.uint8)
        b.register_memory(dst)
        b.load_remote_agent(a.descriptor())  # the capability rule: b serves its memory to an agent it loaded
        peer = a.load_remote_agent(b.descriptor())
        yield a, b, peer, dst
    finally:
        a.close()
        b.close()
        assert not {k: v for k, v in a.resources().items() if v}
        assert not {k: v for k, v in b.resources().items() if v}


def test_shm_small_transfer_ends_before_a_large_one_submitted_first(shm_pair: Any) -> None:
    a, _b, peer, dst = shm_pair
    src = torch.randint(0, 256, (80 * MiB,), dtype=torch.uint8)
    a.register_memory(src)
    ended: list[int] = []
    lock = threading.Lock()

    def listener(handle_id: int) -> None:
        with lock:
            ended.append(handle_id)

    a.set_completion_listener(listener)
    base = dst.data_ptr()
    big = a.submit(TransferOp.WRITE, peer, [src.data_ptr()], [base], [64 * MiB], notification=b"big")
    # 1 MiB: above the inline size, so it too goes through the copy thread, behind the big one in its queue
    mid = a.submit(TransferOp.WRITE, peer, [src.data_ptr() + 64 * MiB], [base + 64 * MiB], [MiB], notification=b"mid")
    # 16 KiB: copied inside submit, DONE at once whatever runs on the copy thread
    small = a.submit(TransferOp.WRITE, peer, [src.data_ptr() + 65 * MiB], [base + 65 * MiB], [16 * 1024])
    assert a.poll(small) is TransferStatus.DONE
    assert a.wait(mid, timeout=60) is TransferStatus.DONE
    assert a.wait(big, timeout=60) is TransferStatus.DONE
    # The copy thread served the 1 MiB transfer after one 2 MiB slice of the big one, not after all 64 MiB.
    assert ended == [mid.id, big.id]
    with pytest.raises(TransferError):
        a.submit(TransferOp.WRITE, peer, [src.data_ptr()], [base + 96 * MiB], [1])  # outside: refused
    assert torch.equal(dst[: 65 * MiB + 16 * 1024], src[: 65 * MiB + 16 * 1024])
    for h in (big, mid, small):
        a.release(h)
    assert a.resources()["transfers"] == 0 and a.resources()["copy_jobs"] == 0


def test_shm_unload_waits_for_a_copy_in_flight(shm_pair: Any) -> None:
    a, _b, peer, dst = shm_pair
    src = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8)
    a.register_memory(src)
    h = a.submit(TransferOp.WRITE, peer, [src.data_ptr()], [dst.data_ptr()], [64 * MiB])
    # Unloading the peer while its copy may still run waits for the copy instead of unmapping under it.
    a.unload_remote_agent(peer)
    assert a.resources()["copy_jobs"] == 0
    assert a.poll(h) is TransferStatus.DONE
    a.release(h)
    assert torch.equal(dst[: 64 * MiB], src)


def test_shm_copy_threads_option_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"shm agent option 'copy_threads': expected int in 1\.\.64, got 0"):
        ShmAgent("dp-bad", {"copy_threads": 0})


# --- the bench's head-of-line case ------------------------------------------------------------------------

TRANSPORTS = [b for b in ("shm", "nixl") if b in installed_backends()]


@pytest.mark.timeout(120)
def test_bench_hol_case_reports_alone_and_during_latency_per_backend() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcore",
            "bench",
            "--json",
            "--backend",
            ",".join(TRANSPORTS),
            "--cases",
            "hol",
            "--tokens",
            "2048",
            "--layers",
            "4",
            "--iterations",
            "1",
            "--hol-requests",
            "8",
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert list(result["backends"]) == TRANSPORTS
    for backend, entry in result["backends"].items():
        case = entry["cases"]["hol"]
        o = case["one_block"]
        assert case["block_bytes"] == 4 * 2 * 8 * 32 * 128 * 2, backend  # one block of the 4-layer model
        # 64 blocks = 32 MiB: over Link's 16 MiB chunk, so a transport that copies inside submit gets chunks
        assert case["bytes"] == 64 * case["block_bytes"] > CHUNK_BYTES
        assert o["requests_alone"] == 8  # one timed round of 8 after the warm-up
        assert 0 <= o["requests_during"] <= 8
        assert o["alone_ms_p50"] > 0 and o["alone_ms_p99"] >= o["alone_ms_p50"]
        if o["requests_during"]:
            assert o["during_vs_alone_p50"] == pytest.approx(o["during_ms_p50"] / o["alone_ms_p50"], rel=1e-9)
        else:
            assert o["during_ms_p50"] is None and o["during_vs_alone_p50"] is None
        assert case["big_ms_median"] > 0
        assert case["big_gbps_median"] == pytest.approx(case["bytes"] / (case["big_ms_median"] / 1e3) / 1e9, rel=1e-9)
        assert case["not_done"] == [] and case["leaks"] == {} and case["pool_verified"] is True
        assert case["verified"] is True and entry["ok"] is True
