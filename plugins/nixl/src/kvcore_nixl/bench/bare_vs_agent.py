"""Bare NIXL vs ``NixlAgent.submit`` vs host memcpy on one KV-cache fragment plan, across two processes.

``python -m kvcore_nixl.bench [--iterations N] [--blocks B] [--progress-thread] [--json]`` runs it (:func:`main`):
512 MiB of 32-layer x 8-head x 128-dim bf16 KV, 8192 x 64 KiB by default.

``run_bench()`` starts a target rank process (:mod:`kvcore.runtime`; a ``NixlAgent`` owning the destination
pool, calling ``progress()`` like an engine loop), runs every mode for
one warm-up per mode whose result the target checks against an independently
computed expectation, then ``iterations`` timed rounds interleaved across modes,
and returns a dict of numbers (median and best GB/s, ratios, checks).

The plan: ``layers`` x {K, V} per-layer pools of ``blocks`` blocks, one
fragment per (block, layer, K|V) of ``tokens * heads * head_dim * 2`` bytes
(bf16), destination block ids a random permutation of the source's, so no two
fragments are contiguous on both sides (the scattered case).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from typing import Any

import numpy as np

from kvcore.runtime import Channel, RankProcess, serve

__all__ = ["fragment_plan", "main", "run_bench"]

_GB = 1e9


def fragment_plan(
    blocks: int, layers: int, fragment_bytes: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Source offsets, destination offsets and sizes (uint64) of the scattered per-block per-layer K/V plan."""
    dst_block = np.random.default_rng(seed).permutation(blocks).astype(np.uint64)
    blk = np.arange(blocks, dtype=np.uint64)
    lkv = np.arange(layers * 2, dtype=np.uint64)  # (layer, K|V) pools, each [blocks, fragment]
    pool = np.uint64(blocks * fragment_bytes)
    src = (lkv[:, None] * pool + blk[None, :] * np.uint64(fragment_bytes)).ravel()
    dst = (lkv[:, None] * pool + dst_block[None, :] * np.uint64(fragment_bytes)).ravel()
    return src, dst, np.full(src.size, fragment_bytes, dtype=np.uint64)


class _TargetRank:
    """The target rank's commands: a ``NixlAgent`` owning the zeroed destination pool, draining notifications."""

    def __init__(self, nbytes: int, options: dict[str, Any]) -> None:
        import torch

        from kvcore_nixl.agent import NixlAgent

        self.agent = NixlAgent("bench-target", options)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.agent.register_memory(self.dst)
        self.seen: list[bytes] = []

    def drain(self) -> None:
        """Between commands: take the notifications (an engine loop's ``progress``)."""
        self.seen.extend(n.message for n in self.agent.get_notifications())

    def op_zero(self) -> dict[str, Any]:
        self.dst.zero_()
        return {}

    def op_digest(self, notif: bytes) -> dict[str, Any]:
        deadline = time.monotonic() + 10.0
        while notif not in self.seen and time.monotonic() < deadline:
            self.drain()
        got = notif in self.seen
        self.seen.clear()
        return {"digest": hashlib.blake2b(self.dst.numpy().data, digest_size=16).hexdigest(), "notified": got}


def target_main(channel: Channel, nbytes: int, options: dict[str, Any]) -> None:
    """The target's rank function (:mod:`kvcore.runtime`): say where the pool is, then serve commands."""
    rank = _TargetRank(nbytes, options)
    try:
        channel.send({"desc": rank.agent.descriptor(), "base": rank.dst.data_ptr()})
        serve(channel, rank, idle=rank.drain, idle_wait=0.001)
    finally:
        rank.agent.close()


class _Target(RankProcess):
    def __init__(self, nbytes: int, options: dict[str, Any]) -> None:
        super().__init__(
            "kvcore_nixl.bench.bare_vs_agent:target_main",
            name="nixl bench target",
            kwargs={"nbytes": nbytes, "options": options},
        )
        try:
            hello = self.recv(120.0, op="start")
        except BaseException:
            self.kill()
            raise
        self.descriptor, self.base = hello["desc"], hello["base"]


def _gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / _GB


def run_bench(
    *,
    blocks: int = 128,
    layers: int = 32,
    heads: int = 8,
    head_dim: int = 128,
    tokens_per_block: int = 32,
    iterations: int = 5,
    options: dict[str, Any] | None = None,
    verify: bool = True,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Run bare NIXL, ``NixlAgent`` and memcpy on the same plan; return GB/s (median), ratios and checks."""
    import torch

    from kvcore.transport.agent import TransferOp
    from kvcore_nixl.agent import DEFAULT_BACKEND_PARAMS, NixlAgent, decode_payload, load_nixl

    options = dict(options or {})
    frag = tokens_per_block * heads * head_dim * 2
    nbytes = blocks * layers * 2 * frag
    src_off, dst_off, sizes = fragment_plan(blocks, layers, frag)
    src = torch.from_numpy(np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8))
    expected = np.empty(nbytes, dtype=np.uint8)
    expected.reshape(-1, frag)[(dst_off // np.uint64(frag)).astype(np.int64)] = src.numpy().reshape(-1, frag)[
        (src_off // np.uint64(frag)).astype(np.int64)
    ]
    expected_digest = hashlib.blake2b(expected.data, digest_size=16).hexdigest()
    out: dict[str, Any] = {
        "bytes": nbytes,
        "fragments": int(sizes.size),
        "fragment_bytes": frag,
        "iterations": iterations,
        "verified": {},
    }
    target = _Target(nbytes, options)
    try:
        src_addr = src_off + np.uint64(src.data_ptr())
        dst_addr = dst_off + np.uint64(target.base)

        def check(mode: str, notif: bytes) -> None:
            if verify:
                r = target.call("digest", notif=notif)
                out["verified"][mode] = r["digest"] == expected_digest and r["notified"]
                target.call("zero")

        # --- bare NIXL: prepped lists of the identical fragments, one handle re-posted ---------
        api = load_nixl()
        bare = api.nixl_agent(f"bench-bare-{os.getpid()}", api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        backend = options.get("nixl_backend", "UCX")
        bare.create_backend(backend, {**DEFAULT_BACKEND_PARAMS.get(backend, {}), **options.get("backend_params", {})})
        reg = bare.register_memory(np.array([[src.data_ptr(), nbytes, 0]], dtype=np.uint64), "DRAM")
        md = decode_payload(target.descriptor).metadata  # the target's NIXL metadata, from its kvcore descriptor
        rname = bare.add_remote_agent(md)
        rname = rname.decode() if isinstance(rname, bytes) else rname

        def nx3(addrs: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(np.stack([addrs, sizes, np.zeros_like(sizes)], axis=1))

        t0 = time.perf_counter()
        lh = bare.prep_xfer_dlist("NIXL_INIT_AGENT", nx3(src_addr), "DRAM")
        rh = bare.prep_xfer_dlist(rname, nx3(dst_addr), "DRAM")
        idx = np.arange(sizes.size, dtype=np.int32)
        xh = bare.make_prepped_xfer("WRITE", lh, idx, rh, idx, b"")
        out["bare_setup_ms"] = (time.perf_counter() - t0) * 1e3

        def bare_once(notif: bytes) -> float:
            t = time.perf_counter()
            state = bare.transfer(xh, notif)
            deadline = t + timeout
            while state == "PROC":
                if time.perf_counter() > deadline:
                    raise TimeoutError("bare NIXL transfer did not finish")
                state = bare.check_xfer_state(xh)
            if state != "DONE":
                raise RuntimeError(f"bare NIXL transfer ended in {state}")
            return time.perf_counter() - t

        def bare_init_once(notif: bytes) -> float:
            t = time.perf_counter()
            h = bare.initialize_xfer(
                "WRITE", bare.get_xfer_descs(nx3(src_addr), "DRAM"), bare.get_xfer_descs(nx3(dst_addr), "DRAM"), rname
            )
            state = bare.transfer(h, notif)
            deadline = t + timeout
            while state == "PROC":
                if time.perf_counter() > deadline:
                    raise TimeoutError("bare NIXL transfer did not finish")
                state = bare.check_xfer_state(h)
            h.release()
            if state != "DONE":
                raise RuntimeError(f"bare NIXL transfer ended in {state}")
            return time.perf_counter() - t

        # --- the kvcore agent ----------------------------------------------------------------
        agent = NixlAgent("bench-initiator", options)
        agent.register_memory(src)
        peer = agent.load_remote_agent(target.descriptor)
        prepped = NixlAgent("bench-initiator-prepped", {**options, "unit_dlists": True})
        prepped.register_memory(src)
        prepped_peer = prepped.load_remote_agent(target.descriptor)
        submit_ms: list[float] = []

        def agent_once(notif: bytes, ag: NixlAgent = agent, name: str = peer) -> float:
            t = time.perf_counter()
            h = ag.submit(TransferOp.WRITE, name, src_addr, dst_addr, sizes, notification=notif)
            submit_ms.append((time.perf_counter() - t) * 1e3)
            ag.wait(h, timeout=timeout, interval=0.0)
            ag.release(h)
            return time.perf_counter() - t

        def prepped_once(notif: bytes) -> float:
            return agent_once(notif, prepped, prepped_peer)

        dst_np = np.empty(nbytes, dtype=np.uint8)
        src_np = src.numpy()

        def memcpy_once(_: bytes) -> float:
            t = time.perf_counter()
            np.copyto(dst_np, src_np)
            return time.perf_counter() - t

        modes = {
            "bare_nixl": bare_once,
            "agent": agent_once,
            "bare_nixl_initialize": bare_init_once,
            "agent_prepped": prepped_once,
            "memcpy": memcpy_once,
        }
        # Warm-up and byte check per mode, then timed rounds interleaved across modes so that load
        # from other processes on a shared box hits every mode alike.
        for mode, fn in modes.items():
            fn(f"warm-{mode}".encode())  # connection, first touch, list preparation
            if mode != "memcpy":
                check(mode, f"warm-{mode}".encode())
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        submits: dict[str, list[float]] = {mode: [] for mode in modes}
        for i in range(iterations):
            for mode, fn in modes.items():
                submit_ms.clear()
                times[mode].append(fn(f"{mode}-{i}".encode()))
                submits[mode].extend(submit_ms)
        for mode in modes:
            out[f"{mode}_gbps"] = _gbps(nbytes, times[mode])
            out[f"{mode}_best_gbps"] = nbytes / min(times[mode]) / _GB
            if submits[mode]:
                out[f"{mode}_submit_ms"] = statistics.median(submits[mode])
        out["agent_vs_bare"] = out["agent_gbps"] / out["bare_nixl_gbps"]
        out["agent_vs_memcpy"] = out["agent_gbps"] / out["memcpy_gbps"]
        out["bare_vs_memcpy"] = out["bare_nixl_gbps"] / out["memcpy_gbps"]
        if verify:
            out["verified"]["memcpy"] = bool(np.array_equal(dst_np, src_np))

        xh.release()
        lh.release()
        rh.release()
        bare.remove_remote_agent(rname)
        bare.deregister_memory(reg)
        agent.close()
        prepped.close()
    finally:
        target.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table (or JSON with ``--json``)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(
        prog="python -m kvcore_nixl.bench",
        description="Bare NIXL vs kvcore's NixlAgent vs host memcpy: 512 MiB of 32-layer x 8-head x 128-dim bf16 KV, "
        "8192 x 64 KiB.",
    )
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=128, help="blocks of 32 tokens (128 -> 512 MiB)")
    ap.add_argument("--progress-thread", action="store_true", help="NIXL progress thread (100 us delay) on both sides")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    options = {"progress_thread": True} if args.progress_thread else {}
    r = run_bench(blocks=args.blocks, iterations=args.iterations, options=options)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"{r['bytes'] / 2**20:.0f} MiB in {r['fragments']} fragments of {r['fragment_bytes'] // 1024} KiB, "
        f"median of {r['iterations']}"
    )
    for mode in ("bare_nixl", "agent", "bare_nixl_initialize", "agent_prepped", "memcpy"):
        extra = f"  submit {r[mode + '_submit_ms']:.2f} ms" if mode + "_submit_ms" in r else ""
        print(f"  {mode:22s} {r[mode + '_gbps']:6.2f} GB/s (best {r[mode + '_best_gbps']:.2f}){extra}")
    print(f"  agent / bare NIXL = {r['agent_vs_bare']:.3f}   agent / memcpy = {r['agent_vs_memcpy']:.3f}")
    print(f"  bytes verified: {r['verified']}")
    return 0
