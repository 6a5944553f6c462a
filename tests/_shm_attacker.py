"""A hostile local process for the shm security tests (``test_security_shm.py``).

A rank process (``kvcore.runtime``) serving ``_Attacker``'s commands;
``Attacker`` below starts and drives it.
``steal`` and ``forge_notification`` are plain functions too, so a test can run
them in a forked child that dropped to another uid (the interpreter of this
machine is not readable by ``nobody``, so that child cannot exec one).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading
import uuid
from typing import Any

import msgspec

from kvcore.runtime import Channel, RankProcess, serve
from kvcore.testing.harness import pattern
from kvcore.transport.agent import AgentDescriptor, RegionInfo, process_incarnation
from kvcore.transport.builtin import shm, shm_protocol

enc = msgspec.msgpack.encode


def steal(fds_socket: str, client: str, incarnation: str, server: str, server_incarnation: str) -> dict[str, Any]:
    """Ask an shm agent's socket for its memory fds while claiming to be ``client``; report what came back."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    try:
        s.connect(b"\0" + fds_socket.encode())
        s.send(enc(shm_protocol._FdRequest(client, incarnation, server, server_incarnation)))
        data, fds, _, _ = socket.recv_fds(s, 1 << 20, 253)
        for fd in fds:
            os.close(fd)
        reply = msgspec.msgpack.decode(data, type=shm_protocol._FdReply) if data else None
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
                reply = enc(shm_protocol._FdReply(True, "", name, incarnation, [seg]))
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


class Attacker(RankProcess):
    """Drives ``_Attacker`` in its own rank process (msgpack frames, deadlines on every read, always reaped)."""

    def __init__(self) -> None:
        super().__init__("_shm_attacker:attacker_main", name="shm-attacker", path=[os.path.dirname(__file__)])
        try:
            self.info = self.call("hello")
        except BaseException:
            self.kill()
            raise

    def close(self, timeout: float = 20.0) -> int | None:
        if self.alive():
            try:
                self.call("exit", timeout=timeout)
            except Exception:
                pass
        return super().close(timeout)


def attacker_main(channel: Channel) -> None:
    """The attacker's rank function: serve ``_Attacker``'s commands until ``exit`` or EOF."""
    serve(channel, _Attacker())
