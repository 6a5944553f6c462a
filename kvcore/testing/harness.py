"""A second real process for transport tests: ``PeerProcess`` spawns it, commands travel as msgpack frames on pipes.

The peer (``python -m kvcore.testing.harness``) creates one agent of the
backend under test through the plugin registry, allocates memory with
``agent.allocate_tensor``, registers it, hands out its descriptor and, on
command, reads back bytes, drains notifications, deregisters, closes or exits.
Frames are ``4-byte big-endian length + msgpack map``; nothing is pickled.
Every read on the test side has a deadline; the peer exits when its stdin
closes, so a crashed test never leaves a peer behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

import msgspec
import numpy as np

__all__ = ["PeerProcess", "PeerError", "HarnessTimeout", "pattern", "digest"]

_MAX_FRAME = 512 * 1024 * 1024
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict[str, Any])


class PeerError(AssertionError):
    """The peer process answered a command with an error (``error_type`` names the exception it raised)."""

    def __init__(self, op: str, error_type: str, message: str) -> None:
        super().__init__(f"peer command {op!r} failed: {error_type}: {message}")
        self.op, self.error_type, self.message = op, error_type, message


class HarnessTimeout(AssertionError):
    """The peer did not answer within the deadline (it hung or died)."""


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic pseudo-random bytes: the independent expectation every byte check compares against."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def digest(data: Any) -> str:
    """blake2b hex digest of a bytes-like object or uint8 array."""
    return hashlib.blake2b(memoryview(np.ascontiguousarray(data)).cast("B")).hexdigest()  # type: ignore[arg-type]


def _write_frame(stream: BinaryIO, obj: Mapping[str, Any]) -> None:
    data = _encoder.encode(obj)
    stream.write(len(data).to_bytes(4, "big") + data)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise HarnessTimeout(f"peer sent no reply within the deadline ({got} of {n} bytes read)")
        chunk = os.read(fd, min(n - got, 1 << 22))
        if not chunk:
            raise EOFError(f"peer closed its pipe after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: float | None) -> dict[str, Any]:
    size = int.from_bytes(_read_exact(fd, 4, deadline), "big")
    if size > _MAX_FRAME:
        raise ValueError(f"frame of {size} bytes exceeds the {_MAX_FRAME} limit")
    return _decoder.decode(_read_exact(fd, size, deadline))


# --- the test side ---------------------------------------------------------------------------


class PeerProcess:
    """A peer agent in its own process; ``call(op, **args)`` runs one command and returns its reply.

    Use as a context manager, or call ``close()``; ``kill()`` simulates a crash.
    """

    def __init__(
        self,
        backend: str,
        options: Mapping[str, Any] | None = None,
        *,
        name: str = "contract-peer",
        startup_timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        launcher: Sequence[str] = (),
        module: str = "kvcore.testing.harness",
    ) -> None:
        # launcher: an argv prefix that runs the peer elsewhere (kvcore.testing.hosts enters a namespaced host);
        # module: a module whose main() serves a _Peer subclass with more commands.
        cmd = [
            *launcher,
            sys.executable,
            "-m",
            module,
            "--backend",
            backend,
            "--name",
            name,
            "--options",
            json.dumps(dict(options or {})),
        ]
        self.backend, self.name = backend, name
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=None if env is None else dict(env)
        )
        try:
            self.info = self.call("hello", timeout=startup_timeout)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, op: str, *, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        """Send one command and wait at most ``timeout`` seconds for its reply; raises ``PeerError`` on failure."""
        if self.proc.poll() is not None:
            raise PeerError(op, "PeerExited", f"peer process exited with status {self.proc.returncode}")
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            _write_frame(self.proc.stdin, {"op": op, **args})  # type: ignore[arg-type]
            reply = _read_frame(self.proc.stdout.fileno(), time.monotonic() + timeout)
        except (BrokenPipeError, EOFError) as exc:
            raise PeerError(op, "PeerExited", f"peer process went away: {exc}") from exc
        if not reply.get("ok"):
            raise PeerError(op, str(reply.get("error")), str(reply.get("message")))
        return reply

    def kill(self) -> None:
        """SIGKILL the peer (a crash: no cleanup runs) and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._close_pipes()

    def close(self, timeout: float = 20.0) -> None:
        """Ask the peer to close its agent and exit; kill it if it does not within ``timeout``."""
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=timeout)
                self.proc.wait(timeout=timeout)
            except Exception:
                self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the peer side ---------------------------------------------------------------------------


class _Peer:
    """Command handlers; each returns the reply's fields."""

    def __init__(self, backend: str, name: str, options: dict[str, Any]) -> None:
        from kvcore.extension.plugins import make_plugin_manager

        self.backend, self.name, self.options = backend, name, options
        self.cls = make_plugin_manager().transfer_agents.get(backend)
        self.agent = self.cls(name, options)
        self.buffers: dict[str, Any] = {}  # key -> tensor
        self.regs: dict[str, Any] = {}  # key -> Registration
        self.watch: threading.Thread | None = None
        self.watched: list[list[Any]] = []
        self.loaded: list[str] = []  # initiators loaded with op_load

    def _bytes(self, key: str) -> np.ndarray:
        out: np.ndarray = self.buffers[key].cpu().numpy().view(np.uint8).reshape(-1)
        return out

    def op_hello(self) -> dict[str, Any]:
        caps = self.cls.capabilities
        return {"pid": os.getpid(), "name": self.name, "read": caps.read, "write": caps.write}

    def op_alloc(
        self,
        key: str,
        nbytes: int,
        seed: int | None = None,
        reg_offset: int = 0,
        reg_length: int | None = None,
        device: str = "cpu",
    ) -> dict[str, Any]:
        import torch

        from kvcore.transport.agent import MemoryKind, MemoryRegion

        tensor = self.agent.allocate_tensor((nbytes,), torch.uint8, device=device)
        if seed is not None:
            tensor.copy_(torch.from_numpy(pattern(seed, nbytes)))
        self.buffers[key] = tensor
        if reg_length is None:
            self.regs[key] = self.agent.register_memory(tensor)
        elif reg_length > 0:
            kind = MemoryKind.VRAM if tensor.device.type == "cuda" else MemoryKind.DRAM
            region = MemoryRegion(tensor.data_ptr() + reg_offset, reg_length, kind, tensor.device.index or 0)
            self.regs[key] = self.agent.register_memory(region)
        return {"address": tensor.data_ptr(), "nbytes": nbytes}

    def op_read(self, key: str, offset: int = 0, length: int | None = None) -> dict[str, Any]:
        data = self._bytes(key)
        end = data.size if length is None else offset + length
        return {"data": data[offset:end].tobytes()}

    def op_digest(self, key: str) -> dict[str, Any]:
        return {"digest": digest(self._bytes(key))}

    def op_descriptor(self) -> dict[str, Any]:
        return {"descriptor": self.agent.descriptor()}

    def op_load(self, descriptor: bytes) -> dict[str, Any]:
        """Load an initiator's descriptor (as a receiver does before it registers); unloads the one loaded before."""
        name = self.agent.load_remote_agent(descriptor)
        for other in [n for n in self.loaded if n != name and n in self.agent.remote_agents]:
            self.agent.unload_remote_agent(other)
        self.loaded = [name]
        return {"name": name}

    def op_deregister(self, key: str) -> dict[str, Any]:
        self.agent.deregister_memory(self.regs.pop(key))
        return {"descriptor": self.agent.descriptor()}

    def op_free(self, key: str) -> dict[str, Any]:
        reg = self.regs.pop(key, None)
        if reg is not None:
            self.agent.deregister_memory(reg)
        self.buffers.pop(key, None)
        return {}

    def op_notifications(self, expect: int = 0, timeout: float = 10.0, settle: float = 0.1) -> dict[str, Any]:
        """Drain notifications until ``expect`` arrived (or ``timeout``), then ``settle`` more seconds for duplicates."""
        got: list[list[Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < expect and time.monotonic() < deadline:
            self.agent.progress()
            got += [[n.remote, n.message] for n in self.agent.get_notifications()]
            time.sleep(0.001)
        end = time.monotonic() + settle
        while time.monotonic() < end:
            self.agent.progress()
            got += [[n.remote, n.message] for n in self.agent.get_notifications()]
            time.sleep(0.005)
        return {"notifications": got}

    def op_watch_start(self, key: str, expect: int, timeout: float = 20.0) -> dict[str, Any]:
        """Start draining notifications on a thread, recording the digest of ``key`` at each arrival."""
        self.watched = []

        def run() -> None:
            deadline = time.monotonic() + timeout
            while len(self.watched) < expect and time.monotonic() < deadline:
                self.agent.progress()
                for n in self.agent.get_notifications():
                    self.watched.append([n.remote, n.message, digest(self._bytes(key))])
                time.sleep(0.0005)

        self.watch = threading.Thread(target=run, daemon=True)
        self.watch.start()
        return {}

    def op_watch_result(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.watch is not None, "watch_start was not called"
        self.watch.join(timeout)
        if self.watch.is_alive():
            raise TimeoutError(f"the notification watcher is still running after {timeout}s")
        self.watch = None
        return {"notifications": self.watched}

    def op_resources(self) -> dict[str, Any]:
        return {"resources": self.agent.resources()}

    def op_reopen(self) -> dict[str, Any]:
        """Close the agent (reporting its resources after close) and start a fresh one."""
        self.regs.clear()
        self.agent.close()
        after = self.agent.resources()
        self.buffers.clear()
        self.loaded = []
        self.agent = self.cls(self.name, self.options)
        return {"resources": after}

    def op_exit(self) -> dict[str, Any]:
        self.regs.clear()
        self.agent.close()
        self.buffers.clear()
        return {"resources": self.agent.resources()}


def _serve(backend: str, name: str, options: dict[str, Any], peer_cls: type[_Peer] = _Peer) -> int:
    # Replies go on a private copy of stdout; anything a plugin prints lands on stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer.fileno()
    try:
        peer = peer_cls(backend, name, options)
    except Exception as exc:
        _read_frame(inp, None)
        _write_frame(out, {"ok": False, "error": type(exc).__name__, "message": str(exc)})
        return 1
    while True:
        try:
            req = _read_frame(inp, None)
        except EOFError:  # the test process went away: clean up and leave
            peer.agent.close()
            return 0
        op = str(req.pop("op", ""))
        handler = getattr(peer, f"op_{op}", None)
        try:
            if handler is None:
                raise ValueError(f"unknown harness command {op!r}")
            reply = {"ok": True, **handler(**req)}
        except Exception as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        _write_frame(out, reply)
        if op == "exit":
            return 0


def main(argv: list[str] | None = None, peer_cls: type[_Peer] = _Peer) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvcore.testing.harness")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--name", default="contract-peer")
    parser.add_argument("--options", default="{}")
    args = parser.parse_args(argv)
    return _serve(args.backend, args.name, json.loads(args.options), peer_cls)


if __name__ == "__main__":
    sys.exit(main())
