"""A second real process for transport tests: ``PeerProcess``, a rank process (:mod:`kvcore.runtime`) serving one agent.

The peer creates one agent of the backend under test through the plugin
registry, allocates memory with ``agent.allocate_tensor``, registers it, hands
out its descriptor and, on command, reads back bytes, drains notifications,
deregisters, closes or exits. The process, the msgpack frames, the deadline on
every read, the typed errors and the reaping are the runtime's (:mod:`kvcore.runtime`);
nothing is pickled. The peer closes its agent and exits when its channel closes,
so a crashed test never leaves a peer behind.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvcore.runtime import Channel, RankError, RankFailedError, RankProcess, RankTimeoutError, serve

__all__ = ["PeerProcess", "PeerError", "HarnessTimeout", "pattern", "digest", "peer_main"]

#: The peer answered a command with an error (``error_type`` names the exception it raised): the rank harness's
#: typed error under the name the transport tests know.
PeerError = RankFailedError
#: The peer did not answer within the deadline (it hung).
HarnessTimeout = RankTimeoutError


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic pseudo-random bytes: the independent expectation every byte check compares against."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped.

    Delivery is asynchronous: a thread that is running when the signal is sent runs on until its next return to
    user mode, long enough, on a loaded box, to accept a connection or send a message the test meant to forbid.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # that thread ended
                pass
        if all(state in "Tt" for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} did not stop within {timeout:g} s: its threads are in states {states}")
        time.sleep(0.005)


def digest(data: Any) -> str:
    """blake2b hex digest of a bytes-like object or uint8 array."""
    return hashlib.blake2b(memoryview(np.ascontiguousarray(data)).cast("B")).hexdigest()  # type: ignore[arg-type]


# --- the test side ---------------------------------------------------------------------------


class PeerProcess(RankProcess):
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
        target: str = "kvcore.testing.harness:peer_main",
    ) -> None:
        # launcher: an argv prefix that runs the peer elsewhere (kvcore.testing.host_peer enters a namespaced host);
        # target: a function that serves a _Peer subclass with more commands (kvcore.testing.host_peer has one).
        super().__init__(
            target,
            name=name,
            kwargs={"backend": backend, "name": name, "options": dict(options or {})},
            env=env,
            launcher=launcher,
        )
        self.backend = backend
        try:
            self.info = self.call("hello", timeout=startup_timeout)
        except BaseException:
            self.kill()
            raise

    def close(self, timeout: float = 20.0) -> int | None:
        """Ask the peer to close its agent and exit; kill it if it does not within ``timeout``."""
        if self.alive():
            try:
                self.call("exit", timeout=timeout)
            except RankError:
                pass  # it is gone or stuck: RankProcess.close kills and reaps it
        return super().close(timeout)

    def __enter__(self) -> PeerProcess:
        return self


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
        self.closed = False

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
        self.closed = True
        self.buffers.clear()
        return {"resources": self.agent.resources()}


def peer_main(
    channel: Channel, backend: str, name: str, options: dict[str, Any], peer_cls: type[_Peer] = _Peer
) -> None:
    """The peer's rank function: one agent of ``backend``, commands served until ``exit`` or EOF, then closed."""
    peer = peer_cls(backend, name, options)
    try:
        serve(channel, peer)
    finally:
        if not peer.closed:
            peer.agent.close()
