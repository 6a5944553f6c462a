"""Fixtures: a tiny model directory and engine processes (vllm_engine.run, each a kvcore.runtime rank)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore.runtime import RankError, RankProcess, RankTimeoutError

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from vllm_engine import write_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(str(tmp_path_factory.mktemp("tiny-llama")))


class EngineProcess:
    """One engine process: a ``RankProcess`` running ``vllm_engine:run``; commands go in, events come back.

    Commands are told (``send``), or batched so they act in the same step (``send_many``); ``state`` is a call.
    Events wait in ``events`` until a ``wait`` takes the first one that matches. Every read has a deadline; a
    failure in the engine process comes back as the harness's typed error, with the tail of its log added.

    The process starts at once; its ``ready`` event is read on first use (``ready``, ``up()``, or any command, wait
    or signal), so engines a test starts one after the other boot side by side. With ``wait_ready=False`` the
    test reads ``ready`` itself (``wait("ready")``) and may set ``ready``.
    """

    def __init__(self, spec: dict[str, Any], log_path: Path, wait_ready: bool = True) -> None:
        self.spec = spec
        self.log_path = log_path
        tp = f"-tp{spec['tp_rank']}" if spec.get("tp_size", 1) > 1 else ""
        self.rank = RankProcess(
            "vllm_engine:run",
            name=f"vllm-{spec['role']}{tp}",
            kwargs={**spec, "log_path": str(log_path)},
            env={"PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": "WARNING"},
            path=[str(HERE)],
        )
        self.events: list[dict[str, Any]] = []
        self._ready: dict[str, Any] | None = None if wait_ready else {}

    @property
    def ready(self) -> dict[str, Any]:
        """The engine's ``ready`` event (its free blocks and endpoint), waited for on first use."""
        return self.up()

    @ready.setter
    def ready(self, event: dict[str, Any]) -> None:
        self._ready = event

    def up(self) -> dict[str, Any]:
        """Wait until the engine is up (once); its ``ready`` event. An engine that failed to start raises here."""
        if self._ready is None:
            try:
                self._ready = self.wait("ready", timeout=180)
            except BaseException:
                self.rank.close(timeout=5)  # it never started: reap it here, before the fixture's teardown
                raise
        return self._ready

    def send(self, op: str, **args: Any) -> None:
        self.up()  # an engine is told nothing before it is up
        with self._logged():
            self.rank.tell(op, **args)

    def send_many(self, *cmds: dict[str, Any], then_freeze: float = 0.0) -> None:
        """Several commands in one frame: the engine acts on them all before its next step.

        ``then_freeze``: the engine stops stepping for that many seconds after that step.
        """
        self.up()
        commands = [dict(c) for c in cmds]
        if then_freeze:
            commands.append({"op": "freeze", "seconds": then_freeze})
        with self._logged():
            self.rank.tell("batch", commands=commands)

    def wait(self, event: str, timeout: float = 60, **match: Any) -> dict[str, Any]:
        """The first not yet consumed event named ``event`` whose fields equal ``match``."""
        if event != "ready":
            self.up()
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                    return self.events.pop(i)
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise RankTimeoutError(rank=self.rank.name, op=f"wait {event}", timeout=timeout)
                with self._logged():
                    self.events.append(self.rank.recv(left, op=f"wait {event}"))
            except RankTimeoutError as exc:
                raise AssertionError(
                    f"{self.spec['role']}: no {event} {match} within {timeout}s; events {self.events}; log:\n{self.tail()}"
                ) from exc

    def state(self) -> dict[str, Any]:
        """One engine step, then its counters; every event emitted before is read into ``events``."""
        self.ask_state()
        return self.state_reply()

    def ask_state(self) -> None:
        """Ask for :meth:`state` without waiting (TP ranks step together: ask every rank, then read the replies)."""
        self.up()
        with self._logged():
            self.rank.post("state")

    def state_reply(self, timeout: float = 60) -> dict[str, Any]:
        """The reply to :meth:`ask_state`; the events that came before it are read into ``events``."""
        with self._logged():
            state = self.rank.reply("state", timeout)
            while (event := self.rank.try_recv()) is not None:
                self.events.append(event)
        return state

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except FileNotFoundError:
            return "(no log yet)"

    def signal(self, sig: int) -> None:
        self.up()  # a signal meant for a running engine, not for one still booting
        os.kill(self.rank.pid, sig)

    def wait_exit(self, timeout: float) -> int | None:
        """Reap the process once it exited (after a signal); its exit status."""
        if not self.rank.join(timeout):
            raise AssertionError(f"{self.rank.name} still running {timeout}s after it was told to end")
        return self.rank.exitcode

    def close(self) -> None:
        self.rank.close(timeout=30)

    @contextlib.contextmanager
    def _logged(self) -> Iterator[None]:
        """The harness's errors (the engine raised, or died) with the tail of the engine's log added."""
        try:
            yield
        except RankError as exc:
            if not isinstance(exc, RankTimeoutError):
                exc.add_note(f"log of {self.rank.name} ({self.log_path}):\n{self.tail()}")
            raise


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Any]:
    """``start(spec) -> EngineProcess``; every process is closed (killed if it hangs) at teardown.

    Engines boot side by side: ``start`` returns at once, and the engine's ``ready`` is read on first use.
    """
    started: list[EngineProcess] = []

    def start(wait_ready: bool = True, **spec: Any) -> EngineProcess:
        p = EngineProcess(spec, tmp_path / f"{spec['role']}-{len(started)}.log", wait_ready)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.rank.alive():
            with contextlib.suppress(ProcessLookupError):
                p.signal(signal.SIGCONT)  # a test may have stopped it
            # Every engine told first, so TP ranks (which step together over gloo) all stop, not one by one.
            with contextlib.suppress(RankError):
                p.rank.tell("exit")
    for p in started:
        p.close()
