"""A NixlAgent in a separate rank process (``kvcore.runtime``), driven by commands, for cross-process tests.

The peer loop behaves like an engine loop: between commands it calls
``agent.get_notifications()``, buffering notifications for ``notifs``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from kvcore.runtime import Channel, RankProcess, serve


def pattern(seed: int, nbytes: int) -> Any:
    """Deterministic bytes (numpy uint8) both sides and the test can compute independently."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class _NixlPeer:
    """The peer's commands: one ``NixlAgent`` with one registered buffer (filled from ``seed`` if given)."""

    def __init__(self, name: str, options: dict[str, Any], nbytes: int, seed: int | None, progress: bool) -> None:
        import torch
        from kvcore_nixl.agent import NixlAgent

        self.agent = NixlAgent(name, options)
        self.nbytes, self.progress = nbytes, progress
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        if seed is not None:
            self.buf.numpy()[:] = pattern(seed, nbytes)
        self.reg = self.agent.register_memory(self.buf)
        self.extra: list[Any] = []
        self.notifs: list[list[Any]] = []

    def idle(self) -> None:
        if self.progress:
            self.notifs.extend([n.remote, n.message] for n in self.agent.get_notifications())

    def op_exit(self) -> dict[str, Any]:
        self.agent.close()
        return {"resources": self.agent.resources()}

    def op_notifs(self, count: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while len(self.notifs) < count and time.monotonic() < deadline:
            self.notifs.extend([n.remote, n.message] for n in self.agent.get_notifications())
            time.sleep(0.0005)
        notifs, self.notifs = self.notifs, []
        return {"notifs": notifs}

    def op_read(self, offset: int, length: int) -> dict[str, Any]:
        return {"data": self.buf.numpy()[offset : offset + length].tobytes()}

    def op_fill(self, seed: int) -> dict[str, Any]:
        self.buf.numpy()[:] = pattern(seed, self.nbytes)
        return {}

    def op_load(self, desc: bytes) -> dict[str, Any]:
        return {"peer": self.agent.load_remote_agent(desc)}

    def op_deregister(self) -> dict[str, Any]:
        self.agent.deregister_memory(self.reg)
        return {"desc": self.agent.descriptor()}

    def op_register_extra(self, nbytes: int) -> dict[str, Any]:
        import torch

        extra = torch.zeros(nbytes, dtype=torch.uint8)
        self.agent.register_memory(extra)
        self.extra.append(extra)
        return {"desc": self.agent.descriptor(), "base": extra.data_ptr()}

    def op_submit(
        self,
        xop: str,
        peer: str,
        local: list[int],
        remote: list[int],
        sizes: list[int],
        notif: bytes | None = None,
        timeout: float = 10.0,
    ) -> dict[str, Any]:
        import numpy as np

        from kvcore.transport.agent import TransferOp

        h = self.agent.submit(
            TransferOp(xop),
            peer,
            np.asarray(local, dtype=np.uint64) + np.uint64(self.buf.data_ptr()),
            np.asarray(remote, dtype=np.uint64),
            np.asarray(sizes, dtype=np.uint64),
            notification=notif,
        )
        self.agent.wait(h, timeout=timeout)
        self.agent.release(h)
        return {}

    def op_region(self) -> dict[str, Any]:
        return {"region": [self.buf.data_ptr(), self.nbytes]}


def peer_main(
    channel: Channel, name: str, options: dict[str, Any], nbytes: int, seed: int | None, progress: bool
) -> None:
    """The peer's rank function: say where the buffer is, then serve commands (an engine loop between them)."""
    peer = _NixlPeer(name, options, nbytes, seed, progress)
    try:
        channel.send({"desc": peer.agent.descriptor(), "base": peer.buf.data_ptr(), "pid": os.getpid()})
        serve(channel, peer, idle=peer.idle, idle_wait=0.001)
    finally:
        peer.agent.close()


class Peer(RankProcess):
    """Handle on a peer process; use as a context manager so the process is always killed."""

    def __init__(
        self,
        name: str = "peer",
        *,
        nbytes: int = 1 << 20,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__(
            "_peer:peer_main",
            name=f"nixl peer {name}",
            kwargs={"name": name, "options": options or {}, "nbytes": nbytes, "seed": seed, "progress": progress},
            path=[os.path.dirname(os.path.abspath(__file__))],
        )
        try:
            hello = self.recv(60.0, op="start")
        except BaseException:
            self.kill()
            raise
        self.descriptor: bytes = hello["desc"]
        self.base: int = hello["base"]
        self.nbytes = nbytes

    def call(self, op: str, *, reply_within: float = 30.0, **kw: Any) -> dict[str, Any]:  # type: ignore[override]
        """Run ``op`` in the peer; its failure raises ``RankFailedError`` naming the op and the exception."""
        self.post(op, **kw)  # not super().call: an op may take an argument named ``timeout``
        return self.reply(op, reply_within)

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)  # in case a test stopped it
        self.kill()
