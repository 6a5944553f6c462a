"""The parent's handle on a rank process: :class:`RankProcess` starts a child running ``main(channel, **kwargs)``.

Used by ``kvcore demo`` and ``kvcore bench`` (their rank processes), by the plugins' bench targets, by the
transport tests' peer (:mod:`kvcore.testing.harness`, also inside namespaced hosts through a launcher) and by
the tests' one-rank instances. What it promises:

* **A fresh interpreter per child**: ``python -m kvcore.runtime`` (:attr:`StartMethod.SUBPROCESS`, the
  default; optionally behind a launcher such as ``nsenter``), or a child of a ``forkserver`` that preloaded
  heavy modules (:attr:`StartMethod.FORKSERVER`: one ``import torch`` for many ranks). Never a ``fork`` of a
  process that runs threads.
* **msgpack on the wire, never pickle** (:mod:`kvcore.runtime.frames`).
* **A deadline on every read**: :meth:`RankProcess.recv`, :meth:`RankProcess.call` and
  :meth:`RankProcess.reply` raise :class:`~kvcore.runtime.channel.RankTimeoutError` naming the rank and the op.
* **Child failures are typed**: an exception in the child comes back as
  :class:`~kvcore.runtime.channel.RankFailedError` naming the rank, the op, the exception type, its message and
  the child's traceback; a child that dies raises :class:`~kvcore.runtime.channel.RankExitedError` with its
  exit status.
* **Nothing outlives the parent**: the child dies with its parent (:mod:`kvcore.runtime.child`), and
  :meth:`RankProcess.close` always reaps (EOF to the child, join with a bound, then SIGTERM, then SIGKILL).

Two ways to talk, freely mixed: commands (``call``/``post``/``tell`` here,
:func:`~kvcore.runtime.child.serve` with ``op_<name>`` methods on the child) and plain messages
(``send``/``recv`` on both ends). Messages that arrive while the parent waits for a reply are kept, in order,
for its next ``recv``.
"""

from __future__ import annotations

import collections
import enum
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvcore.runtime.channel import (
    Channel,
    RankError,
    RankExitedError,
    RankFailedError,
    RankProtocolError,
    RankTimeoutError,
)
from kvcore.runtime.child import forkserver_entry
from kvcore.runtime.frames import Call, Failure, Frame, Message, Reply, Start

__all__ = ["RankProcess", "StartMethod", "ready"]


class StartMethod(enum.Enum):
    """How a rank process starts: both give it a fresh interpreter state, neither forks a threaded process."""

    SUBPROCESS = "subprocess"  # python -m kvcore.runtime (behind a launcher if given)
    FORKSERVER = "forkserver"  # a child of multiprocessing's forkserver, which preloads modules once


class RankProcess:
    """A child process running ``target`` (``"module:function"``, called as ``fn(channel, **kwargs)``).

    ``name`` labels it in errors and in ``ps``. ``env`` is set in the child on top of
    the parent's environment; ``path`` is put in front of its ``sys.path`` (targets
    outside installed packages: test helpers). ``launcher`` (subprocess only) is an argv prefix that
    runs the child elsewhere (``nsenter`` into a namespaced host). ``preload``
    (forkserver only) names modules the forkserver imports once for all its children.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        target: str,
        *,
        name: str,
        kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        start: StartMethod = StartMethod.SUBPROCESS,
        launcher: Sequence[str] = (),
        preload: Sequence[str] = (),
        path: Sequence[str] = (),
    ) -> None:
        self.name, self.target = name, target
        self.popen: subprocess.Popen[bytes] | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self._inbox: collections.deque[dict[str, Any]] = collections.deque()
        self._closed = False
        if start is StartMethod.FORKSERVER and launcher:
            raise ValueError("RankProcess: a launcher needs start=StartMethod.SUBPROCESS, got FORKSERVER")
        if start is StartMethod.SUBPROCESS:
            self.popen = subprocess.Popen(
                [*launcher, sys.executable, "-m", "kvcore.runtime", name],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            assert self.popen.stdin is not None and self.popen.stdout is not None
            # The channel owns the pipes' fds from here on (Popen must not close them again).
            wfd, rfd = os.dup(self.popen.stdin.fileno()), os.dup(self.popen.stdout.fileno())
            self.popen.stdin.close()
            self.popen.stdout.close()
            self.popen.stdin = self.popen.stdout = None
            self.channel = Channel(rfd, wfd, who=name)
        else:
            ctx = multiprocessing.get_context("forkserver")
            if preload:
                ctx.set_forkserver_preload(list(preload))
            parent, child = ctx.Pipe(duplex=True)  # a socketpair: only raw bytes cross it (send_bytes is unused)
            self.process = ctx.Process(target=forkserver_entry, args=(child,), name=name, daemon=True)
            self.process.start()
            child.close()
            fd = os.dup(parent.fileno())  # the channel owns its own fd; the Connection object is done with
            parent.close()
            self.channel = Channel(fd, fd, who=name)
        try:
            self.channel.write(Start(target, name, dict(kwargs or {}), dict(env or {}), list(path)))
        except OSError:
            pass  # the child is already gone: the first read reports how it ended

    # --- state ---------------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The child's pid (with a launcher: the launcher's)."""
        if self.popen is not None:
            return self.popen.pid
        assert self.process is not None and self.process.pid is not None
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        """The exit status once the child ended (negative: killed by that signal), else None."""
        if self.popen is not None:
            return self.popen.poll()
        assert self.process is not None
        return self.process.exitcode

    def alive(self) -> bool:
        return self.exitcode is None

    def fileno(self) -> int:
        """The fd a ``select`` on this rank's replies waits on."""
        return self.channel.read_fd

    # --- messages ------------------------------------------------------------------------------------

    def send(self, body: Mapping[str, Any]) -> None:
        """Send an application message; :class:`RankExitedError` if the child is gone."""
        try:
            self.channel.send(body)
        except OSError:
            raise RankExitedError(rank=self.name, op="send", exitcode=self._exit_status()) from None

    def recv(self, timeout: float, *, op: str = "recv") -> dict[str, Any]:
        """The next application message within ``timeout`` s (``op`` names what is awaited, in errors)."""
        if self._inbox:
            return self._inbox.popleft()
        frame = self._read(op, timeout)
        if frame is None:
            raise RankTimeoutError(rank=self.name, op=op, timeout=timeout)
        if isinstance(frame, Message):
            return frame.body
        raise self._unexpected(frame, op)

    def try_recv(self) -> dict[str, Any] | None:
        """An application message if a whole one has arrived, else None; never waits."""
        if self._inbox:
            return self._inbox.popleft()
        frame = self._read("recv", 0.0)
        if frame is None:
            return None
        if isinstance(frame, Message):
            return frame.body
        raise self._unexpected(frame, "recv")

    # --- commands ------------------------------------------------------------------------------------

    def post(self, op: str, **args: Any) -> None:
        """Send command ``op``; collect its result later with :meth:`reply`."""
        self._write_call(Call(op, args))

    def tell(self, op: str, **args: Any) -> None:
        """Send command ``op`` and expect no reply (a failure still comes back, on the next read)."""
        self._write_call(Call(op, args, reply=False))

    def reply(self, op: str, timeout: float) -> dict[str, Any]:
        """The result of the earlier :meth:`post` of ``op``; messages arriving first are kept for :meth:`recv`."""
        deadline = time.monotonic() + timeout
        while True:
            frame = self._read(op, max(0.0, deadline - time.monotonic()))
            if frame is None:
                raise RankTimeoutError(rank=self.name, op=op, timeout=timeout)
            if isinstance(frame, Message):
                self._inbox.append(frame.body)
                continue
            if isinstance(frame, Reply) and frame.op == op:
                return frame.result
            raise self._unexpected(frame, op)

    def call(self, op: str, *, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        """Run command ``op`` in the child and return its result, within ``timeout`` seconds."""
        self.post(op, **args)
        return self.reply(op, timeout)

    # --- ending --------------------------------------------------------------------------------------

    def join(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for the child to exit (reaping it); True once it has."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        assert self.process is not None
        self.process.join(timeout)
        return self.process.exitcode is not None

    def kill(self) -> None:
        """SIGKILL the child (a crash: nothing of its cleanup runs) and reap it."""
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.join(10.0)
        self._release()

    def close(self, timeout: float = 20.0) -> int | None:
        """End the child: EOF on its channel, ``timeout`` s to exit, then SIGTERM, then SIGKILL; always reaps.

        Returns its exit status. Idempotent.
        """
        if not self._closed:
            self.channel.close_write()
            if not self.join(timeout):
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.kill(self.pid, sig)
                    except ProcessLookupError:
                        pass
                    if self.join(5.0):
                        break
            self._release()
        return self.exitcode

    def __enter__(self) -> RankProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RankProcess({self.name!r}, target={self.target!r}, pid={self.pid}, exitcode={self.exitcode})"

    # --- internals -----------------------------------------------------------------------------------

    def _write_call(self, call: Call) -> None:
        try:
            self.channel.write(call)
        except OSError:
            raise RankExitedError(rank=self.name, op=call.op, exitcode=self._exit_status()) from None

    def _read(self, op: str, timeout: float) -> Frame | None:
        if self._closed:
            raise RankExitedError(rank=self.name, op=op, exitcode=self.exitcode)
        try:
            return self.channel.read(timeout)
        except EOFError:
            raise RankExitedError(rank=self.name, op=op, exitcode=self._exit_status()) from None

    def _unexpected(self, frame: Frame, op: str) -> RankError:
        if isinstance(frame, Failure):
            return RankFailedError(
                rank=self.name, op=frame.op, error_type=frame.error_type, message=frame.message, trace=frame.trace
            )
        what = f"a reply to {frame.op!r}" if isinstance(frame, Reply) else f"a {type(frame).__name__} frame"
        return RankProtocolError(f"rank {self.name!r} sent {what} while {op!r} was awaited", rank=self.name, op=op)

    def _exit_status(self) -> int | None:
        """The exit status, waiting briefly: the pipe closes a moment before the process is reaped."""
        self.join(2.0)
        return self.exitcode

    def _release(self) -> None:
        self._closed = True
        self.channel.close()


def ready(ranks: Iterable[RankProcess], timeout: float) -> list[RankProcess]:
    """The ranks that have something to read (a message, a reply, or EOF), waiting at most ``timeout`` s."""
    ranks = list(ranks)
    now = [r for r in ranks if r._inbox or r.channel.pending()]
    if now:
        return now
    fds = {r.fileno(): r for r in ranks if r.fileno() >= 0}
    if not fds:
        return []
    readable, _, _ = select.select(list(fds), [], [], max(0.0, timeout))
    return [fds[fd] for fd in readable]
