"""Bare mpi4py against the kvcore ``mpi`` agent, in one run: ``python -m kvcore_mpi.bench``.

Two shapes, each moved to a second process on this host: one 512 MiB fragment, and 4096 fragments of 16 KiB
scattered (permuted) over 128 MiB. *Bare*: mpi4py alone, the way a hand-written MPI program would do it: the
target attaches its buffer to a dynamic window over the joined communicator and probes (MPI progress); the
initiator calls ``Win.Put`` once per fragment and ``Win.Flush`` once. *Agent*: ``MpiAgent.submit`` +
``wait`` to a peer process (:mod:`kvcore.runtime`) running the agent. Prints the best of ``--repeat`` runs
of each and the ratio agent / bare (time).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np

from kvcore.runtime import Channel, RankProcess, serve
from kvcore_mpi._bootstrap import mpi

MiB = 1024 * 1024


def _target() -> None:
    """The bare target: listen, join, attach a buffer to a dynamic window, probe until stdin closes."""
    MPI = mpi()
    size = int(sys.argv[2])
    buf = np.zeros(size, dtype=np.uint8)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(json.dumps({"port": listener.getsockname()[1], "address": MPI.Get_address(buf)}), flush=True)
        conn, _ = listener.accept()
        with conn:
            inter = MPI.Comm.Join(conn.fileno())
    comm = inter.Merge(high=False)
    win = MPI.Win.Create_dynamic(comm=comm)
    win.Attach(buf)
    import select

    while not select.select([sys.stdin], [], [], 0.0005)[0]:
        comm.Iprobe(1, MPI.ANY_TAG)
    # stdin closed: the initiator is done; the process exits without collective teardown


def _bare(shape: tuple[np.ndarray, np.ndarray, int], repeat: int, one_put: bool = False) -> float:
    """Best seconds of ``repeat`` bare runs of ``shape`` (offsets, sizes, buffer bytes) + Flush: a Put per fragment,
    or (``one_put``) one Put with hindexed datatypes on both sides, the calls the agent makes, without kvcore."""
    MPI = mpi()
    offsets, sizes, total = shape
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcore_mpi.bench", "_target", str(total)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        hello = json.loads(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", hello["port"])) as sock:
            inter = MPI.Comm.Join(sock.fileno())
        comm = inter.Merge(high=True)
        win = MPI.Win.Create_dynamic(comm=comm)
        src = np.ones(int(sizes.sum()), dtype=np.uint8)
        local = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
        remote = (hello["address"] + offsets).tolist()
        win.Lock_all(MPI.MODE_NOCHECK)
        best = float("inf")
        origin = MPI.BYTE.Create_hindexed(sizes.tolist(), local).Commit()
        target = MPI.BYTE.Create_hindexed(sizes.tolist(), remote).Commit()
        for _ in range(repeat):
            start = time.perf_counter()
            if one_put:
                win.Put([src, 1, origin], 0, target=(0, 1, target))
            else:
                for lo, ro, n in zip(local, remote, sizes.tolist()):
                    win.Put([src[lo : lo + n], MPI.BYTE], 0, target=(ro, n, MPI.BYTE))
            win.Flush(0)
            best = min(best, time.perf_counter() - start)
        origin.Free()
        target.Free()
        win.Unlock_all()
        return best
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(10)


class _PeerRank:
    """The peer's commands (:mod:`kvcore.runtime`): an ``MpiAgent`` owning a destination buffer."""

    def __init__(self, nbytes: int) -> None:
        import torch

        from kvcore_mpi.agent import MpiAgent

        self.agent = MpiAgent(f"bench-peer-{uuid.uuid4().hex[:8]}")
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.agent.register_memory(self.dst)

    def op_load(self, descriptor: bytes) -> dict[str, Any]:
        return {"name": self.agent.load_remote_agent(descriptor)}


def peer_main(channel: Channel, nbytes: int) -> None:
    """The peer's rank function: say where its buffer is and its descriptor, then serve commands."""
    rank = _PeerRank(nbytes)
    try:
        channel.send({"descriptor": rank.agent.descriptor(), "address": rank.dst.data_ptr()})
        serve(channel, rank, idle_wait=0.05)
    finally:
        rank.agent.close()


def _agent(shape: tuple[np.ndarray, np.ndarray, int], repeat: int) -> float:
    """Best seconds of ``repeat`` ``submit`` + ``wait`` runs of ``shape`` through the kvcore agent."""
    import torch

    from kvcore.transport.agent import TransferOp
    from kvcore_mpi.agent import MpiAgent

    offsets, sizes, total = shape
    agent = MpiAgent(f"bench-{uuid.uuid4().hex[:8]}")
    peer = RankProcess("kvcore_mpi.bench:peer_main", name="mpi bench peer", kwargs={"nbytes": total})
    try:
        hello = peer.recv(120.0, op="start")
        dst = int(hello["address"])
        src = torch.ones(int(sizes.sum()), dtype=torch.uint8)
        agent.register_memory(src)
        peer.call("load", descriptor=agent.descriptor(), timeout=120.0)
        name = agent.load_remote_agent(hello["descriptor"])
        local = src.data_ptr() + np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)
        remote = np.uint64(dst) + offsets.astype(np.uint64)
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            handle = agent.submit(TransferOp.WRITE, name, local, remote, sizes.astype(np.uint64))
            agent.wait(handle, timeout=120.0)
            best = min(best, time.perf_counter() - start)
            agent.release(handle)
        agent.close()
    finally:
        peer.close()
    return best


def shapes() -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """The two shapes: (destination offsets, sizes, destination buffer bytes)."""
    n, frag = 4096, 16 * 1024
    slots = np.random.default_rng(0).permutation(2 * n)[:n].astype(np.int64) * frag
    return {
        "512 MiB x 1": (np.zeros(1, dtype=np.int64), np.array([512 * MiB], dtype=np.int64), 512 * MiB),
        "16 KiB x 4096": (slots, np.full(n, frag, dtype=np.int64), 2 * n * frag),
    }


def main(argv: list[str] | None = None) -> None:
    """Run both shapes both ways; print seconds, GB/s and the ratio."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "_target":
        _target()
        return
    parser = argparse.ArgumentParser(prog="python -m kvcore_mpi.bench", description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    opts = parser.parse_args(args)
    rows: list[dict[str, Any]] = []
    for label, shape in shapes().items():
        nbytes = int(shape[1].sum())
        per_piece, one_put = _bare(shape, opts.repeat), _bare(shape, opts.repeat, one_put=True)
        through = _agent(shape, opts.repeat)
        bare = min(per_piece, one_put)  # the better of the two bare ways is the baseline
        rows.append({"shape": label, "bare_put_per_piece_s": per_piece, "bare_one_put_s": one_put,
                     "agent_s": through, "kvcore_over_bare": bare / through})  # fmt: skip
        print(
            f"{label:>14}: bare mpi4py, a Put per piece {per_piece * 1e3:8.1f} ms, one hindexed Put "
            f"{one_put * 1e3:8.1f} ms ({nbytes / bare / 1e9:5.2f} GB/s)   kvcore agent {through * 1e3:8.1f} ms "
            f"({nbytes / through / 1e9:5.2f} GB/s)   kvcore/bare throughput {bare / through:5.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
