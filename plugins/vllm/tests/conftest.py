"""Fixtures: a tiny model directory and engine processes (see vllm_engine.py)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from vllm_engine import write_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(str(tmp_path_factory.mktemp("tiny-llama")))


class EngineProcess:
    """One engine process (vllm_engine.py) spoken to over JSON lines; every wait has a deadline."""

    def __init__(self, spec: dict[str, Any], log_path: Path, wait_ready: bool = True) -> None:
        self.spec = spec
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="WARNING")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "vllm_engine.py"), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        self._buf = b""
        self.events: list[dict[str, Any]] = []
        self.ready = self.wait("ready", timeout=180) if wait_ready else {}

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def send_many(self, *cmds: dict[str, Any], then_freeze: float = 0.0) -> None:
        """Several commands in one write: the engine reads them together, so they act in the same step.

        ``then_freeze``: the engine stops stepping for that many seconds after that step.
        """
        assert self.proc.stdin is not None
        lines = [dict(c) for c in cmds]
        if then_freeze:
            lines.append({"op": "freeze", "seconds": then_freeze})
        self.proc.stdin.write(b"".join((json.dumps(c) + "\n").encode() for c in lines))
        self.proc.stdin.flush()

    def _read_events(self, deadline: float) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise AssertionError(f"{self.spec['role']} engine exited (rc={self.proc.poll()}); log:\n{self.tail()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        self.events.append(json.loads(line))

    def wait(self, event: str, timeout: float = 60, **match: Any) -> dict[str, Any]:
        """The first not yet consumed event named ``event`` whose fields equal ``match``."""
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                    return self.events.pop(i)
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.spec['role']}: no {event} {match} within {timeout}s; events {self.events}; log:\n{self.tail()}"
                )
            self._read_events(min(deadline, time.monotonic() + 0.5))

    def state(self) -> dict[str, Any]:
        self.send(op="state")
        return self.wait("state")

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Any]:
    """``start(spec) -> EngineProcess``; every process is closed (killed if it hangs) at teardown."""
    started: list[EngineProcess] = []

    def start(wait_ready: bool = True, **spec: Any) -> EngineProcess:
        p = EngineProcess(spec, tmp_path / f"{spec['role']}-{len(started)}.log", wait_ready)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:
            try:
                p.signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        p.close()
