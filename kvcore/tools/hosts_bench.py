"""``python -m kvcore.tools.hosts_bench``: GB/s across the veth link of two namespaced hosts, beside one host.

For each backend (default: every registered network agent), a writer in host a writes one big buffer and
many scattered blocks into a reader in host b (and, for comparison, in host a), bytes verified; then the
reader is SIGKILLed mid-stream and the time to the writer's typed error is measured. One JSON line per run.
The hosts are :class:`kvcore.runtime.hosts.TwoHosts` (root only); the peers are
:class:`kvcore.testing.host_peer.HostPeer`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from kvcore.runtime.hosts import TwoHosts
from kvcore.testing.host_peer import HostPeer

__all__ = ["main", "measure"]


def measure(
    backend: str,
    *,
    cross_host: bool,
    hosts: TwoHosts,
    big: int = 256 << 20,
    block: int = 16 << 10,
    blocks: int = 4096,
    iterations: int = 3,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Median GB/s of one ``big`` write and ``blocks`` scattered ``block`` writes, a -> b (or a -> a); bytes verified.

    Also the time from SIGKILL of the receiver to the writer's typed error (``dead_peer_s``).
    """
    import numpy as np

    from kvcore.testing.harness import digest, pattern

    def u64(v: Any) -> bytes:
        return np.ascontiguousarray(v, dtype=np.uint64).tobytes()

    writer = HostPeer(hosts.a, backend, options, name="writer")
    reader = HostPeer(hosts.b if cross_host else hosts.a, backend, options, name="reader")
    out: dict[str, Any] = {"backend": backend, "placement": "a->b (veth)" if cross_host else "a->a (one host)"}
    try:
        writer.call("alloc", key="big", nbytes=big, seed=1)
        writer.call("alloc", key="blocks", nbytes=block * blocks, seed=2)
        dbig = reader.call("alloc", key="big", nbytes=big)["address"]
        dblocks = reader.call("alloc", key="blocks", nbytes=block * blocks)["address"]
        remote = writer.call("load", descriptor=reader.call("descriptor")["descriptor"])["remote"]
        out["peer"] = writer.call("peer_info", remote=remote)
        reader.call("watch_for", key="big", expect=2 * (iterations + 1), watch_s=600)
        r = writer.call(
            "write", remote=remote, key="big", offsets=u64([0]), remote_addrs=u64([dbig]), sizes=u64([big]),
            notification=b"big", repeat=iterations + 1, wait_s=120.0, timeout=600,
        )  # fmt: skip
        out["big_GBps"] = big / float(np.median(r["seconds"][1:])) / 1e9
        perm = np.random.default_rng(3).permutation(blocks)
        r = writer.call(
            "write", remote=remote, key="blocks", offsets=u64(np.arange(blocks) * block),
            remote_addrs=u64(dblocks + perm * block), sizes=u64(np.full(blocks, block)),
            notification=b"blocks", repeat=iterations + 1, wait_s=120.0, timeout=600,
        )  # fmt: skip
        out["scattered_GBps"] = block * blocks / float(np.median(r["seconds"][1:])) / 1e9
        reader.call("watch_result", timeout=120)
        expected = np.empty((blocks, block), dtype=np.uint8)
        expected[perm] = pattern(2, block * blocks).reshape(blocks, block)
        out["verified"] = reader.call("digest", key="big")["digest"] == digest(pattern(1, big)) and reader.call(
            "digest", key="blocks"
        )["digest"] == digest(expected)
        # A dead peer: writes stream, the receiver is killed, the writer must see a typed error.
        reader.call("watch_for", key="big", expect=1 << 30, watch_s=600)
        writer.call("write_until_error_start", remote=remote, key="big", remote_address=dbig, nbytes=big, wait_s=30.0)
        while writer.call("write_until_error_status").get("writes", 0) < 1:
            time.sleep(0.005)
        killed_at = time.monotonic()
        reader.kill()
        res = writer.call("write_until_error_result", timeout=120)
        out["dead_peer_error"] = res["error_type"]
        out["dead_peer_s"] = res["at"] - killed_at
    finally:
        writer.close()
        reader.close()
    return out


def main(argv: list[str]) -> int:
    """Parse ``argv`` (see ``--help``), build the hosts, print one JSON line per backend and placement."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m kvcore.tools.hosts_bench")
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--mtu", type=int, default=None, help="veth MTU (default: the kernel's, 1500)")
    parser.add_argument("--options", default="{}", help="agent options as JSON")
    parser.add_argument("--cross-only", action="store_true")
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    with TwoHosts(mtu=args.mtu) as hosts:
        hosts.wait_link()
        from kvcore.extension.plugins import get_plugin_manager

        for backend in args.backend or get_plugin_manager().transfer_agents.remote_names():
            for cross in (True,) if args.cross_only else (False, True):
                r = measure(backend, cross_host=cross, hosts=hosts, iterations=args.iterations, options=options)
                print(json.dumps({**r, "mtu": args.mtu or 1500, "options": options}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
