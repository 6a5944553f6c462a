"""A hostile local process for the shm security tests (``test_security_shm.py``).

Run as ``python tests/_shm_attacker.py``: it answers msgpack-framed commands on
stdin/stdout like ``kvcore.testing.harness`` (``Attacker`` below drives it).
``steal`` and ``forge_notification`` are plain functions too, so a test can run
them in a forked child that dropped to another uid (the interpreter of this
machine is not readable by ``nobody``, so that child cannot exec one).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import subprocess
import sys
import threading
import uuid
from typing import Any

import msgspec

from kvcore.testing.harness import _read_frame, _write_frame, pattern
from kvcore.transport.agent import AgentDescriptor, RegionInfo, process_incarnation
from kvcore.transport.builtin import shm

enc = msgspec.msgpack.encode


def steal(fds_socket: str, client: str, incarnation: str, server: str, server_incarnation: str) -> dict[str, Any]:
    """Ask an shm agent's socket for its memory fds while claiming to be ``client``; report what came back."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    try:
        s.connect(b"\0" + fds_socket.encode())
        s.send(enc(shm._FdRequest(client, incarnation, server, server_incarnation)))
        data, fds, _, _ = socket.recv_fds(s, 1 << 20, 253)
        for fd in fds:
            os.close(fd)
        reply = msgspec.msgpack.decode(data, type=shm._FdReply) if data else None
        return {"fds": len(fds), "ok": bool(reply and reply.ok), "error": reply.error if reply else "closed"}
    finally:
        s.close()


def forge_notification(notify_socket: str, sender: str, message: bytes) -> None:
    """Send a notification datagram that claims to come from agent ``sender``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.sendto(enc((sender, message)), b"\0" + notify_socket.encode())
    finally:
        s.close()


class _Attacker:
    def __init__(self) -> None:
        self.agent: shm.ShmAgent | None = None
        self.buffers: dict[str, Any] = {}
        self.evil_fd = -1
        self.evil_mm: mmap.mmap | None = None

    def op_hello(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "uid": os.getuid(), "incarnation": process_incarnation()}

    def op_agent(self, name: str) -> dict[str, Any]:
        self.agent = shm.ShmAgent(name)
        return {}

    def op_alloc(self, key: str, nbytes: int, seed: int) -> dict[str, Any]:
        import torch

        assert self.agent is not None
        t = self.agent.allocate_tensor((nbytes,), torch.uint8)
        t.copy_(torch.from_numpy(pattern(seed, nbytes)))
        self.agent.register_memory(t)
        self.buffers[key] = t
        return {"address": t.data_ptr()}

    def op_descriptor(self) -> dict[str, Any]:
        assert self.agent is not None
        return {"descriptor": self.agent.descriptor()}

    def op_load(self, descriptor: bytes) -> dict[str, Any]:
        assert self.agent is not None
        return {"name": self.agent.load_remote_agent(descriptor)}

    def op_read(self, key: str) -> dict[str, Any]:
        return {"data": self.buffers[key].numpy().tobytes()}

    def op_truncate_own(self) -> dict[str, Any]:
        """Try to shrink (and grow) every kvcore memfd this process holds; report each outcome."""
        outcomes = []
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if "memfd:kvcore-shm-" not in target:
                continue
            fd = int(name)
            size = os.fstat(fd).st_size
            for new in (0, size // 2, size + mmap.PAGESIZE):
                try:
                    os.ftruncate(fd, new)
                    outcomes.append("resized")
                except OSError as exc:
                    outcomes.append(os.strerror(exc.errno or 0))
            try:
                fcntl.fcntl(fd, shm.F_ADD_SEALS, 0x0008)  # F_SEAL_WRITE: would stop the writer
                outcomes.append("sealed")
            except OSError as exc:
                outcomes.append(os.strerror(exc.errno or 0))
        return {"outcomes": outcomes}

    def op_serve_unsealed(self, nbytes: int) -> dict[str, Any]:
        """Serve kvcore's fd protocol with a correct, sealed control block and an *unsealed* segment."""
        prefix = f"kvcore-shm-{os.getpid()}-deadbeef-1"
        token, name, incarnation = 12345, "evil", uuid.uuid4().hex
        ctl_fd = os.memfd_create("kvcore-shm-evil-ctl", os.MFD_ALLOW_SEALING)
        os.ftruncate(ctl_fd, shm._CTL_BYTES)
        ctl = mmap.mmap(ctl_fd, shm._CTL_BYTES)
        words = memoryview(ctl).cast("Q")
        words[shm._W_VERSION], words[shm._W_ALIVE], words[shm._W_PID] = shm._LAYOUT_VERSION, 1, os.getpid()
        words[shm._W_MAGIC], words[shm._HEADER_WORDS] = shm._MAGIC, token
        fcntl.fcntl(ctl_fd, shm.F_ADD_SEALS, shm.F_SEAL_SHRINK | shm.F_SEAL_GROW)
        self.evil_fd = os.memfd_create("kvcore-shm-evil-s1", 0)  # no MFD_ALLOW_SEALING: can never be sealed
        os.ftruncate(self.evil_fd, nbytes)
        self.evil_mm = mmap.mmap(self.evil_fd, nbytes)
        base = shm._address_of(self.evil_mm)
        seg = shm._SegmentInfo(1, base, nbytes)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(b"\0" + f"{prefix}-fds".encode())
        # A real agent also listens for notifications: the loader checks that socket to tell a peer on this host.
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(b"\0" + f"{prefix}-notify".encode())
        listener.listen(8)

        def serve() -> None:
            while True:
                conn, _ = listener.accept()
                conn.recv(4096)
                reply = enc(shm._FdReply(True, "", name, incarnation, [seg]))
                socket.send_fds(conn, [reply], [ctl_fd, self.evil_fd])
                threading.Thread(target=conn.recv, args=(16,), daemon=True).start()  # keep it open

        threading.Thread(target=serve, daemon=True).start()
        payload = shm._Payload(
            pid=os.getpid(),
            fds=f"{prefix}-fds",
            notify=f"{prefix}-notify",
            segments=[seg],
            exports=[shm._ExportInfo(base, nbytes, 0, token)],
        )
        desc = AgentDescriptor(1, "shm", name, incarnation, 1, [RegionInfo(base, nbytes, "DRAM", 0)], enc(payload))
        return {"descriptor": enc(desc), "address": base}

    def op_truncate_unsealed(self) -> dict[str, Any]:
        os.ftruncate(self.evil_fd, 0)  # a writer that had mapped this would now take SIGBUS
        return {}

    def op_steal(self, **kw: Any) -> dict[str, Any]:
        return steal(**kw)

    def op_exit(self) -> dict[str, Any]:
        if self.agent is not None:
            self.agent.close()
        return {}


class Attacker:
    """Drives ``_shm_attacker.py`` in its own process (the harness's framing, deadlines on every read)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.info = self.call("hello")
        self.pid = int(self.info["pid"])

    def call(self, op: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        import time

        assert self.proc.stdin is not None and self.proc.stdout is not None
        _write_frame(self.proc.stdin, {"op": op, **args})  # type: ignore[arg-type]
        reply = _read_frame(self.proc.stdout.fileno(), time.monotonic() + timeout)
        if not reply.get("ok"):
            raise RuntimeError(f"attacker op {op!r} failed: {reply.get('error')}: {reply.get('message')}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=20)
            except Exception:
                self.proc.kill()
            self.proc.wait(timeout=20)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _main() -> int:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer.fileno()
    attacker = _Attacker()
    while True:
        try:
            req = _read_frame(inp, None)
        except EOFError:
            return 0
        op = str(req.pop("op", ""))
        try:
            reply = {"ok": True, **getattr(attacker, f"op_{op}")(**req)}
        except Exception as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        _write_frame(out, reply)
        if op == "exit":
            return 0


if __name__ == "__main__":
    sys.exit(_main())
