"""Fixtures for the real-engine tests: a tiny model made here, engine processes, one plain engine's tokens."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore.runtime import RankError, RankProcess

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from llm_engine import write_model  # noqa: E402

#: One CPU core per engine: the prefill on core 0, the decode on core 1 (this machine has two).
CORES = {"plain": "0", "prefill": "0", "decode": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Llm:
    """One engine process (``llm_engine:run``); ``call`` runs a command in it within a deadline."""

    def __init__(self, spec: dict[str, Any], log_path: Path) -> None:
        self.spec, self.log_path = spec, log_path
        cpu = spec.pop("cpu", None) or CORES[spec["role"]]
        self.rank = RankProcess(
            "llm_engine:run",
            name=f"llm-{spec['role']}",
            kwargs={**spec, "log_path": str(log_path)},
            env={
                "PYTHONUNBUFFERED": "1",
                "VLLM_CPU_OMP_THREADS_BIND": cpu,
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_LOGGING_LEVEL": "INFO",
            },
            path=[str(HERE)],
        )
        self._ready: dict[str, Any] | None = None
        self._pids: list[int] = []

    def up(self) -> dict[str, Any]:
        """Wait once until the engine is up (it boots in the background meanwhile)."""
        if self._ready is None:
            try:
                self._ready = self.rank.recv(300, op="boot")
            except RankError as exc:
                exc.add_note(f"log of {self.rank.name}:\n{self.tail()}")
                raise
            self._pids = self.rank.call("pids", timeout=30)["children"]
        return self._ready

    def call(self, op: str, timeout: float = 180, **args: Any) -> dict[str, Any]:
        self.up()
        try:
            return self.rank.call(op, timeout=timeout, **args)
        except RankError as exc:
            exc.add_note(f"log of {self.rank.name}:\n{self.tail()}")
            raise

    def metrics(self) -> dict[str, Any]:
        return self.call("metrics")

    def vllm_pids(self) -> list[int]:
        """vLLM's processes under the driver (EngineCore and its worker, where kvcore runs)."""
        self.up()
        return list(self._pids)

    def signal_vllm(self, sig: int) -> None:
        for pid in self.vllm_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def crash(self) -> None:
        """SIGKILL vLLM's processes and the driver: a crash, nothing of their cleanup runs."""
        self.signal_vllm(signal.SIGKILL)
        self.rank.kill()

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except FileNotFoundError:
            return "(no log yet)"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def close(self) -> None:
        if self.rank.alive():
            with contextlib.suppress(RankError, OSError):
                self.signal_vllm(signal.SIGCONT)
                self.rank.tell("exit")
        self.rank.close(timeout=30)
        for pid in self._pids:  # whatever vLLM left behind (it should have left nothing)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def llm_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llm-logs")


class Engines:
    """Starts engines (they boot side by side) and closes every one it started."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.started = logs, []

    def start(self, **spec: Any) -> Llm:
        llm = Llm(dict(spec), self.logs / f"{spec['role']}-{len(os.listdir(self.logs))}-{time.time_ns()}.log")
        self.started.append(llm)
        return llm

    def close(self) -> None:
        for llm in self.started:
            llm.close()


@pytest.fixture(scope="module")
def module_engines(llm_logs: Path) -> Iterator[Engines]:
    e = Engines(llm_logs)
    yield e
    e.close()


@pytest.fixture
def engines(llm_logs: Path) -> Iterator[Engines]:
    e = Engines(llm_logs)
    yield e
    e.close()


class Reference:
    """Greedy tokens of one plain engine (no connector), asked once per prompt and kept."""

    def __init__(self, llm: Llm) -> None:
        self.llm, self.cache = llm, {}

    def tokens(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        todo = [p for p in prompts if (tuple(p), max_tokens) not in self.cache]
        if todo:
            reqs = [
                {"id": f"ref-{len(self.cache) + i}", "prompt": p, "max_tokens": max_tokens} for i, p in enumerate(todo)
            ]
            outs = self.llm.call("generate", requests=reqs)["outputs"]
            for r in reqs:
                self.cache[(tuple(r["prompt"]), max_tokens)] = outs[r["id"]]["tokens"]
        return [self.cache[(tuple(p), max_tokens)] for p in prompts]


@pytest.fixture(scope="session")
def reference(model_dir: str, llm_logs: Path) -> Iterator[Reference]:
    e = Engines(llm_logs)
    yield Reference(e.start(role="plain", model_dir=model_dir))
    e.close()
