"""Two-process bandwidth benchmark of the UCX designs: ``run(...) -> dict``.

Cases (scattered on both sides: source fragments and destination slots are
random permutations, so nothing merges):

* ``llama8b_512MiB``: a 512 MiB Llama-3-8B-shaped request (4096 tokens, 32
  layers, K and V, 8 KV heads x 128 x bf16, 32-token blocks) = 8192 x 64 KiB;
* ``4096x16KiB``: 4096 x 16 KiB = 64 MiB.

Designs (:data:`DESIGNS`, name -> agent class as ``module:Class``): ``B``
(``kvcore_ucx.agent.UcxAgent``, UCX RMA through cffi, the one registered) and
the ucxx prototype ``A`` (:mod:`kvcore_ucx.bench.ucxx_proto`, never registered as a
backend; it needs ucxx, and a design whose import fails is reported skipped). Each design runs against a target in a second process
(a :mod:`kvcore.runtime` rank process: msgpack frames on a pipe, never pickle). A host memcpy baseline (numpy, one thread) runs in the
same call. Every run verifies the target's bytes against an expectation
computed with numpy from the source. GB/s = 1e9 bytes/s over submit -> DONE,
where DONE means the target holds the bytes.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvcore.runtime import Channel, RankProcess, serve

__all__ = ["CASES", "DESIGNS", "run", "main"]

KiB, MiB = 1024, 1024 * 1024
#: name -> (fragments, fragment bytes)
CASES: dict[str, tuple[int, int]] = {
    "llama8b_512MiB": (8192, 64 * KiB),
    "4096x16KiB": (4096, 16 * KiB),
}
#: design name -> its agent class (``module:Class``); a caller may add prototypes of its own.
DESIGNS: dict[str, str] = {"B": "kvcore_ucx.agent:UcxAgent", "A": "kvcore_ucx.bench.ucxx_proto:UcxxProtoAgent"}
_TIMEOUT_S = 120.0


def _agent_class(design: str) -> type:
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {sorted(DESIGNS)}, got {design!r}")
    module, _, name = DESIGNS[design].partition(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def _digest(buf: np.ndarray) -> str:
    return hashlib.blake2b(buf.data, digest_size=16).hexdigest()


class _TargetRank:
    """The target's commands: a registered zeroed buffer, its digest, the notifications that arrived."""

    def __init__(self, agent: Any, nbytes: int) -> None:
        from kvcore.transport.agent import MemoryRegion

        self.agent = agent
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        self.dst[::4096] = 0  # touch every page once, so no iteration pays first-touch faults
        agent.register_memory(MemoryRegion(self.dst.ctypes.data, nbytes))
        self.notes: list[bytes] = []

    def op_digest(self, length: int) -> dict[str, Any]:
        return {"digest": _digest(self.dst[:length])}

    def op_notifications(self, expect: int) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while len(self.notes) < expect and time.monotonic() < deadline:
            self.notes.extend(n.message for n in self.agent.get_notifications())
            time.sleep(0.001)
        notes, self.notes = self.notes, []
        return {"notifications": notes}

    def op_exit(self) -> dict[str, Any]:
        self.agent.close()
        return {"closed": True}


def target_main(channel: Channel, design: str, nbytes: int, options: dict[str, Any], designs: dict[str, str]) -> None:
    """The target's rank function: register the buffer, hand out the descriptor, answer digests and notifications."""
    DESIGNS.update(designs)
    agent = _agent_class(design)(f"bench-target-{design}", options)
    try:
        rank = _TargetRank(agent, nbytes)
        channel.send({"descriptor": agent.descriptor()})
        serve(channel, rank)
    finally:
        agent.close()


def _spin_wait(agent: Any, handle: Any, deadline: float) -> None:
    """Poll without back-off (``TransferAgent.wait`` backs off to 5 ms sleeps, which would blur the numbers)."""
    from kvcore.errors import TransferTimeoutError
    from kvcore.transport.agent import TransferStatus

    while agent.poll(handle) is TransferStatus.PENDING:
        if time.perf_counter() > deadline:
            raise TransferTimeoutError(f"benchmark transfer {handle.id} still pending at its deadline")
        time.sleep(0)
    if handle.error is not None:
        raise handle.error


def _memcpy_baseline(nbytes: int, repeats: int = 3) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _scattered_memcpy(src2d: np.ndarray, src_slot: np.ndarray, dst_slot: np.ndarray, repeats: int = 3) -> float:
    dst2d = np.zeros_like(src2d)
    dst2d[dst_slot] = src2d[src_slot]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst2d[dst_slot] = src2d[src_slot]
        times.append(time.perf_counter() - t0)
    return src2d.nbytes / statistics.median(times) / 1e9


def _run_design(
    design: str, cases: Sequence[str], iterations: int, options: dict[str, Any], seed: int, path: Sequence[str]
) -> dict[str, Any]:
    from kvcore.transport.agent import MemoryRegion, TransferOp

    biggest = max(CASES[c][0] * CASES[c][1] for c in cases)
    target = RankProcess(
        "kvcore_ucx.bench.designs:target_main",
        name=f"ucx bench target {design}",
        kwargs={"design": design, "nbytes": biggest, "options": options, "designs": DESIGNS},
        path=path,
    )
    agent = None
    results: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        agent = _agent_class(design)(f"bench-initiator-{design}", options)
        src = np.random.default_rng(seed).integers(0, 256, biggest, dtype=np.uint8)
        agent.register_memory(MemoryRegion(src.ctypes.data, biggest))
        peer = agent.load_remote_agent(target.recv(_TIMEOUT_S, op="start")["descriptor"])
        dst_base = agent.remote(peer).descriptor.regions[0].address
        results["setup_s"] = round(time.perf_counter() - t0, 3)
        rng = np.random.default_rng(seed + 1)
        for case in cases:
            n, bs = CASES[case]
            src_slot = rng.permutation(n).astype(np.uint64)
            dst_slot = rng.permutation(n).astype(np.uint64)
            local = np.uint64(src.ctypes.data) + src_slot * np.uint64(bs)
            remote = np.uint64(dst_base) + dst_slot * np.uint64(bs)
            sizes = np.full(n, bs, dtype=np.uint64)
            times, submits = [], []
            for it in range(iterations + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                h = agent.submit(TransferOp.WRITE, peer, local, remote, sizes, notification=f"{case}-{it}".encode())
                t1 = time.perf_counter()
                _spin_wait(agent, h, t0 + _TIMEOUT_S)
                t2 = time.perf_counter()
                agent.release(h)
                if it:
                    times.append(t2 - t0)
                    submits.append(t1 - t0)
            expected = np.zeros(n * bs, dtype=np.uint8)
            expected.reshape(n, bs)[dst_slot] = src[: n * bs].reshape(n, bs)[src_slot]
            verified = target.call("digest", length=n * bs, timeout=_TIMEOUT_S)["digest"] == _digest(expected)
            notes = target.call("notifications", expect=iterations + 1, timeout=_TIMEOUT_S)["notifications"]
            nbytes = n * bs
            results[case] = {
                "fragments": n,
                "fragment_bytes": bs,
                "bytes": nbytes,
                "gbps_median": round(nbytes / statistics.median(times) / 1e9, 3),
                "gbps_best": round(nbytes / min(times) / 1e9, 3),
                "ms_median": round(statistics.median(times) * 1e3, 2),
                "submit_ms_median": round(statistics.median(submits) * 1e3, 2),
                "verified": verified,
                "notifications_ok": notes == [f"{case}-{i}".encode() for i in range(iterations + 1)],
            }
        agent.close()
        agent = None
        target.call("exit", timeout=_TIMEOUT_S)
    finally:
        if agent is not None:
            agent.close()
        target.close(10.0)
    return results


def run(
    designs: Iterable[str] = ("B",),
    cases: Iterable[str] = tuple(CASES),
    iterations: int = 3,
    options: dict[str, Any] | None = None,
    seed: int = 1234,
    path: Sequence[str] = (),
) -> dict[str, Any]:
    """Measure each design on the same fragments across two processes, plus a memcpy baseline; returns a dict.

    ``path``: folders the target process needs on its ``sys.path`` for a design outside this package.
    """
    cases = list(cases)
    unknown = set(cases) - set(CASES)
    if unknown:
        raise ValueError(f"unknown benchmark case(s) {sorted(unknown)}; known: {sorted(CASES)}")
    out: dict[str, Any] = {
        "env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "iterations": iterations,
        "memcpy": {},
    }
    rng = np.random.default_rng(seed)
    for case in cases:
        n, bs = CASES[case]
        src2d = rng.integers(0, 256, (n, bs), dtype=np.uint8)
        out["memcpy"][case] = {
            "contiguous_gbps": round(_memcpy_baseline(n * bs), 3),
            "scattered_gbps": round(_scattered_memcpy(src2d, rng.permutation(n), rng.permutation(n)), 3),
        }
        del src2d
    for design in designs:
        try:
            out[design] = _run_design(design, cases, iterations, dict(options or {}), seed, path)
        except ImportError as exc:
            out[design] = {"skipped": f"{type(exc).__name__}: {exc}"}
    return out


def main(argv: Sequence[str] | None = None, path: Sequence[str] = ()) -> int:
    """``python -m kvcore_ucx.bench [--designs B,A] [--cases ...] [--iterations N]``: print the result as JSON."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m kvcore_ucx.bench", description=__doc__.splitlines()[0])
    p.add_argument("--designs", default=",".join(DESIGNS))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--iterations", type=int, default=3)
    args = p.parse_args(argv)
    result = run(args.designs.split(","), args.cases.split(","), args.iterations, path=path)
    print(json.dumps(result, indent=2))
    return 0
