"""Bare NIXL vs kvcore's NixlAgent vs host memcpy: 512 MiB of 32-layer x 8-head x 128-dim bf16 KV, 8192 x 64 KiB.

Usage: python plugins/nixl/benchmarks/bare_vs_agent.py [--iterations N] [--blocks B] [--json]
"""

from __future__ import annotations

import argparse
import json

from kvcore_nixl.bench import run_bench


def main() -> None:
    """Run the benchmark and print a table (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=128, help="blocks of 32 tokens (128 -> 512 MiB)")
    ap.add_argument("--progress-thread", action="store_true", help="NIXL progress thread (100 us delay) on both sides")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    options = {"progress_thread": True} if args.progress_thread else {}
    r = run_bench(blocks=args.blocks, iterations=args.iterations, options=options)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(
        f"{r['bytes'] / 2**20:.0f} MiB in {r['fragments']} fragments of {r['fragment_bytes'] // 1024} KiB, "
        f"median of {r['iterations']}"
    )
    for mode in ("bare_nixl", "agent", "bare_nixl_initialize", "agent_prepped", "memcpy"):
        extra = f"  submit {r[mode + '_submit_ms']:.2f} ms" if mode + "_submit_ms" in r else ""
        print(f"  {mode:22s} {r[mode + '_gbps']:6.2f} GB/s (best {r[mode + '_best_gbps']:.2f}){extra}")
    print(f"  agent / bare NIXL = {r['agent_vs_bare']:.3f}   agent / memcpy = {r['agent_vs_memcpy']:.3f}")
    print(f"  bytes verified: {r['verified']}")


if __name__ == "__main__":
    main()
