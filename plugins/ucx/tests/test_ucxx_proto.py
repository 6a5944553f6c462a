"""Prototype A (:mod:`kvcore_ucx.bench.ucxx_proto`): the target refuses ranges it no longer registered.

Prototype A is not a feature of kvcore-ucx: this module is skipped where ucxx is not installed (see
plugins/ucx/README.md, "Installing prototype A").
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ucxx", reason="ucxx (prototype A) not installed: see plugins/ucx/README.md")

from kvcore.errors import RemoteRangeError
from kvcore.runtime import Channel, RankProcess, serve
from kvcore.testing.harness import pattern
from kvcore.transport.agent import MemoryRegion, TransferOp

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1024 * 1024


class _Target:
    """Two registered MiB; ``deregister`` drops the second, ``read`` returns the bytes and notifications."""

    def __init__(self) -> None:
        from kvcore_ucx.bench.ucxx_proto import UcxxProtoAgent

        self.agent = UcxxProtoAgent("ucxx-target")
        self.buf = np.zeros(2 * MiB, dtype=np.uint8)
        self.regs = [self.agent.register_memory(MemoryRegion(self.buf.ctypes.data + i * MiB, MiB)) for i in range(2)]

    def op_deregister(self) -> dict[str, Any]:
        self.agent.deregister_memory(self.regs[1])
        return {}

    def op_read(self) -> dict[str, Any]:
        return {"data": self.buf.tobytes(), "notes": [n.message for n in self.agent.get_notifications()]}


def target_main(channel: Channel) -> None:
    t = _Target()
    try:
        channel.send({"descriptor": t.agent.descriptor(), "address": t.buf.ctypes.data})
        serve(channel, t)
    finally:
        t.agent.close()


def test_ucxx_prototype_target_rejects_ranges_it_no_longer_registered() -> None:
    from kvcore_ucx.bench.ucxx_proto import UcxxProtoAgent

    saved_env = dict(os.environ)  # importing ucxx sets UCX_* variables for the whole process
    target = RankProcess("test_ucxx_proto:target_main", name="ucxx target", path=[HERE])
    agent = UcxxProtoAgent("ucxx-init")
    try:
        hello = target.recv(60, op="start")
        peer = agent.load_remote_agent(hello["descriptor"])
        dst = hello["address"]
        src_buf = pattern(8, 2 * MiB).copy()
        agent.register_memory(MemoryRegion(src_buf.ctypes.data, src_buf.nbytes))
        src = src_buf.ctypes.data
        h = agent.submit(TransferOp.WRITE, peer, [src, src + MiB], [dst + MiB, dst], [4096, 4096], notification=b"ok")
        agent.wait(h, 20)
        agent.release(h)
        # The target deregisters region 2; our descriptor is stale, so only the target can refuse.
        target.call("deregister", timeout=20)
        h = agent.submit(TransferOp.WRITE, peer, [src + 4096], [dst + MiB + 4096], [4096], notification=b"no")
        with pytest.raises(RemoteRangeError, match="refused"):
            agent.wait(h, 20)
        agent.release(h)
        got = target.call("read", timeout=20)
        data = np.frombuffer(got["data"], np.uint8)
        expected = np.zeros(2 * MiB, np.uint8)
        expected[MiB : MiB + 4096] = pattern(8, 2 * MiB)[:4096]
        expected[:4096] = pattern(8, 2 * MiB)[MiB : MiB + 4096]
        assert np.array_equal(data, expected), "a refused write moved bytes, or an accepted one did not"
        assert got["notes"] == [b"ok"]
    finally:
        agent.close()
        target.close(10.0)
        os.environ.clear()
        os.environ.update(saved_env)
