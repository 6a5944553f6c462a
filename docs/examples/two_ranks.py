"""Two ranks, two processes: a context rank sends one request's KV to a generation rank over the shm backend.

Run it as ``python docs/examples/two_ranks.py``. The parent starts the context rank and hands the request's
transfer parameters (JSON) to the generation rank, which polls until the request is done and released. It exits
non-zero unless both report DONE and every byte of the generation rank's cache is what an independent
computation says it must be.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

import numpy as np
import torch

from kvcore import Transceiver, TransceiverConfig, create_agent
from kvcore.layout.builders import allocate_kv_cache, build_page_table
from kvcore.layout.topology import AttentionGeometry, Topology

REQUEST = 7
SRC_BLOCKS = [3, 1, 4]  # where the context rank holds the request, in token order
DST_BLOCKS = [0, 5, 2]  # where the generation rank wants it
NUM_BLOCKS = 8


def pattern(block: int, nbytes: int) -> np.ndarray:
    """The bytes the context writes into its block ``block``: computed, never read back from the context."""
    return ((np.arange(nbytes, dtype=np.int64) * 7 + block * 31) % 251).astype(np.uint8)


def rank(role: str) -> tuple[Transceiver, np.ndarray]:
    """One rank on the built-in shm backend, its KV pools in shared memory; its pools as bytes, one row per block."""
    config = TransceiverConfig(backend="shm")
    topology = Topology.create(tp_size=1, pp_size=1, rank=0, num_layers=4)
    geometry = AttentionGeometry(
        num_layers=4, num_kv_heads=2, head_dim=64, tokens_per_block=16, dtype="float16", block_order="head_major"
    )
    agent = create_agent(config, agent_name=f"example-{role}")
    kv = allocate_kv_cache(topology, geometry, num_blocks=NUM_BLOCKS, allocator=agent.allocate_tensor)
    table = build_page_table("head_major_pool", kv, topology=topology, geometry=geometry)
    tx = Transceiver(config, role=role, agent=agent, topology=topology, geometry=geometry, page_table=table)
    return tx, kv.view(NUM_BLOCKS, -1).view(torch.uint8).numpy()  # shares the pools' memory


def context() -> None:
    tx, blocks = rank("context")
    with tx:
        for b in SRC_BLOCKS:
            blocks[b] = pattern(b, blocks.shape[1])
        params = tx.start_send(REQUEST, SRC_BLOCKS)
        print(json.dumps(params.to_dict()), flush=True)  # the engine forwards these to the generation side
        outcome = tx.wait_all([REQUEST], timeout=60)[REQUEST]  # reported and released: the pages are free again
        print(f"context: request {REQUEST} {outcome.state.value}", file=sys.stderr)
        sys.exit(0 if outcome.error is None else 1)


def generation() -> None:
    tx, blocks = rank("generation")
    with tx:
        tx.start_receive(params=json.loads(sys.stdin.readline()), block_ids=DST_BLOCKS)
        outcome, released, deadline = None, False, time.monotonic() + 60
        while not released:  # an engine's loop: the outcome first, then the release (the pages are safe to read)
            if time.monotonic() > deadline:
                sys.exit(f"request {REQUEST}: no outcome and release within 60 s")
            tx.wait(1.0)
            result = tx.poll()
            outcome = next((o for o in result.outcomes if o.request_id == REQUEST), outcome)
            released = REQUEST in result.released
        assert outcome is not None  # poll releases a request only after reporting its outcome
        got = blocks.copy()
    expected = np.zeros_like(got)  # every block untouched but those of the request
    for src, dst in zip(SRC_BLOCKS, DST_BLOCKS):
        expected[dst] = pattern(src, got.shape[1])
    moved = got[DST_BLOCKS]
    print(f"generation: request {REQUEST} {outcome.state.value}, transceiver counted {outcome.nbytes} bytes")
    print(f"received {len(DST_BLOCKS)} blocks, {moved.nbytes} bytes, sha256 {hashlib.sha256(moved).hexdigest()}")
    if outcome.error is not None or not np.array_equal(got, expected):
        bad = int(np.count_nonzero(got != expected))
        print(f"MISMATCH: {bad} of {got.nbytes} bytes differ from the expectation ({outcome.error})")
        sys.exit(1)
    print(f"verified: all {got.nbytes} bytes of the generation cache match (request blocks and untouched ones)")


def main() -> int:
    me = [sys.executable, __file__]
    ctx = subprocess.Popen([*me, "context"], stdout=subprocess.PIPE, text=True)
    try:
        params = ctx.stdout.readline() if ctx.stdout else ""
        gen = subprocess.run([*me, "generation"], input=params, text=True, timeout=120)
        ctx_rc = ctx.wait(timeout=120)
    finally:
        ctx.kill()
    ok = gen.returncode == 0 and ctx_rc == 0
    print("two ranks: OK" if ok else f"two ranks: FAILED (context rc {ctx_rc}, generation rc {gen.returncode})")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        {"context": context, "generation": generation}[sys.argv[1]]()
    else:
        sys.exit(main())
