"""A NixlAgent in a separate (spawned) process, driven by msgpack commands over a pipe, for cross-process tests.

The peer loop behaves like an engine loop: between commands it calls
``agent.progress()``, buffering notifications for ``notifs``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from typing import Any

import msgspec

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def pattern(seed: int, nbytes: int) -> Any:
    """Deterministic bytes (numpy uint8) both sides and the test can compute independently."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _serve(conn: Any, name: str, options: dict[str, Any], nbytes: int, seed: int | None, progress: bool) -> None:
    import numpy as np
    import torch
    from kvcore_nixl.agent import NixlAgent

    from kvcore.transport.agent import MemoryRegion, TransferOp

    agent = NixlAgent(name, options)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    if seed is not None:
        buf.numpy()[:] = pattern(seed, nbytes)
    reg = agent.register_memory(buf)
    notifs: list[list[Any]] = []
    conn.send_bytes(_enc.encode({"desc": agent.descriptor(), "base": buf.data_ptr(), "pid": os.getpid()}))
    while True:
        if not conn.poll(0.001):
            if progress:
                notifs.extend([n.remote, n.message] for n in agent.get_notifications())
            continue
        cmd = _dec.decode(conn.recv_bytes())
        op = cmd["op"]
        reply: dict[str, Any] = {}
        try:
            if op == "exit":
                agent.close()
                conn.send_bytes(_enc.encode({"resources": agent.resources()}))
                return
            if op == "notifs":
                deadline = time.monotonic() + cmd["timeout"]
                while len(notifs) < cmd["count"] and time.monotonic() < deadline:
                    notifs.extend([n.remote, n.message] for n in agent.get_notifications())
                    time.sleep(0.0005)
                reply["notifs"], notifs = notifs, []
            elif op == "read":
                reply["data"] = buf.numpy()[cmd["offset"] : cmd["offset"] + cmd["length"]].tobytes()
            elif op == "fill":
                buf.numpy()[:] = pattern(cmd["seed"], nbytes)
            elif op == "load":
                reply["peer"] = agent.load_remote_agent(cmd["desc"])
            elif op == "deregister":
                agent.deregister_memory(reg)
                reply["desc"] = agent.descriptor()
            elif op == "register_extra":
                extra = torch.zeros(cmd["nbytes"], dtype=torch.uint8)
                agent.register_memory(extra)
                reply["desc"], reply["base"] = agent.descriptor(), extra.data_ptr()
            elif op == "submit":
                base = buf.data_ptr()
                h = agent.submit(
                    TransferOp(cmd["xop"]),
                    cmd["peer"],
                    np.asarray(cmd["local"], dtype=np.uint64) + np.uint64(base),
                    np.asarray(cmd["remote"], dtype=np.uint64),
                    np.asarray(cmd["sizes"], dtype=np.uint64),
                    notification=cmd.get("notif"),
                )
                agent.wait(h, timeout=cmd.get("timeout", 10.0))
                agent.release(h)
            elif op == "region":
                reply["region"] = [MemoryRegion(buf.data_ptr(), nbytes).address, nbytes]
            else:
                reply["error"] = f"unknown op {op}"
        except Exception as exc:
            reply["error"] = f"{type(exc).__name__}: {exc}"
        conn.send_bytes(_enc.encode(reply))


class Peer:
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
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, name, options or {}, nbytes, seed, progress), daemon=True)
        self.proc.start()
        child.close()
        hello = self._recv(timeout=60.0)
        self.descriptor: bytes = hello["desc"]
        self.base: int = hello["base"]
        self.pid: int = hello["pid"]
        self.nbytes = nbytes

    def _recv(self, timeout: float) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer process {self.proc.pid} did not answer within {timeout}s")
        return _dec.decode(self.conn.recv_bytes())  # type: ignore[no-any-return]

    def call(self, op: str, *, reply_within: float = 30.0, **kw: Any) -> dict[str, Any]:
        self.conn.send_bytes(_enc.encode({"op": op, **kw}))
        reply = self._recv(reply_within)
        if "error" in reply:
            raise RuntimeError(f"peer {op} failed: {reply['error']}")
        return reply

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            if self.proc.is_alive():
                os.kill(self.proc.pid, 18)  # SIGCONT, in case a test stopped it
        self.kill()
