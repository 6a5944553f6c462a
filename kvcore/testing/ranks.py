"""One rank-process harness: a child process runs ``main(channel, **kwargs)``; the parent drives it over a pipe.

Used by ``kvcore demo`` and ``kvcore bench`` (their rank processes), by the
transport tests' peer (:mod:`kvcore.testing.harness`, also inside namespaced
hosts through a launcher), by the tests' one-rank instances and by the plugins'
bench targets. What it promises:

* **A fresh interpreter per child**: ``python -m kvcore.testing.ranks``
  (:attr:`StartMethod.SUBPROCESS`, the default; optionally behind a launcher
  such as ``nsenter``), or a child of a ``forkserver`` that preloaded heavy
  modules (:attr:`StartMethod.FORKSERVER`: one ``import torch`` for many
  ranks). Never a ``fork`` of a process that runs threads.
* **msgpack on the wire, never pickle**: every frame is a 4-byte big-endian
  length and one msgpack-encoded :class:`Frame` (a tagged msgspec struct). The
  target, its keyword arguments and every message travel that way, so they must
  be msgpack types (maps, lists, str, bytes, numbers, bools, None).
* **A deadline on every read**: :meth:`RankProcess.recv`, :meth:`RankProcess.call`
  and :meth:`RankProcess.reply` raise :class:`RankTimeoutError` naming the rank
  and the op; a read that times out half way through a frame keeps the bytes
  for the next read.
* **Child failures are typed**: an exception in the child (in ``main`` or in a
  command served by :func:`serve`) comes back as :class:`RankFailedError` naming
  the rank, the op, the exception type, its message and the child's traceback; a
  child that dies raises :class:`RankExitedError` with its exit status.
* **Nothing outlives the parent**: the child asks the kernel for SIGKILL when its
  parent dies (``PR_SET_PDEATHSIG`` on Linux; elsewhere a watchdog thread), and
  :meth:`RankProcess.close` always reaps (EOF to the child, join with a bound,
  then SIGTERM, then SIGKILL).

Two ways to talk, freely mixed: commands (``call``/``post``/``tell`` on the
parent, :func:`serve` with ``op_<name>`` methods on the child) and plain
messages (``send``/``recv`` on both ends). Messages that arrive while the parent
waits for a reply are kept, in order, for its next ``recv``.

A caveat of ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the
child exits, so start rank processes from a thread that lives as long as they do
(the main thread, in every user here).

Why one module of this length: both ends of one protocol (the frame structs, the channel, the child's loop and
the parent's handle) change together; split, a frame change would be edited in three places.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import importlib
import multiprocessing
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from kvcore.errors import KvcoreError

__all__ = [
    "Channel",
    "RankError",
    "RankExitedError",
    "RankFailedError",
    "RankProcess",
    "RankProtocolError",
    "RankTimeoutError",
    "StartMethod",
    "ready",
    "serve",
]

#: Largest frame either side accepts (a peer's whole buffer read back, in the transport tests).
MAX_FRAME = 512 * 1024 * 1024
_CHUNK = 1 << 22
#: Seconds the child waits for its start frame (the parent writes it right after starting the child).
_START_TIMEOUT_S = 120.0


# --- errors ----------------------------------------------------------------------------------------


class RankError(KvcoreError):
    """A rank process failed, died, went silent or broke the harness protocol; ``rank`` and ``op`` name where."""

    def __init__(self, message: str, *, rank: str, op: str) -> None:
        super().__init__(message)
        self.rank, self.op = rank, op


class RankTimeoutError(RankError, TimeoutError):
    """A rank sent nothing within the deadline of a read (it hung, or is still busy)."""

    def __init__(self, *, rank: str, op: str, timeout: float) -> None:
        super().__init__(f"rank {rank!r} sent no answer to {op!r} within {timeout:.1f}s", rank=rank, op=op)
        self.timeout = timeout


class RankFailedError(RankError):
    """The child raised: ``error_type`` and ``message`` are its exception's, ``trace`` its traceback there."""

    def __init__(self, *, rank: str, op: str, error_type: str, message: str, trace: str = "") -> None:
        text = f"rank {rank!r} failed in {op!r}: {error_type}: {message}"
        super().__init__(
            text + (f"\n--- traceback in the rank process ---\n{trace}" if trace else ""), rank=rank, op=op
        )
        self.error_type, self.message, self.trace = error_type, message, trace


class RankExitedError(RankError):
    """The child process went away (crashed, was killed, or exited) while a read or write was pending."""

    def __init__(self, *, rank: str, op: str, exitcode: int | None) -> None:
        status = "still running" if exitcode is None else f"exit status {exitcode}"
        super().__init__(f"rank {rank!r} went away during {op!r} ({status})", rank=rank, op=op)
        self.exitcode = exitcode


class RankProtocolError(RankError):
    """A frame that does not belong where it arrived (malformed, oversized, or a reply to another op)."""


# --- frames ----------------------------------------------------------------------------------------


class Start(msgspec.Struct, tag="start", forbid_unknown_fields=True):
    """Parent -> child, first frame: what to run (``module:function``), its keyword arguments, the environment."""

    target: str
    name: str
    kwargs: dict[str, Any]
    env: dict[str, str] = {}
    path: list[str] = []


class Call(msgspec.Struct, tag="call", forbid_unknown_fields=True):
    """Parent -> child: run command ``op``; ``reply`` False: send back nothing unless it fails."""

    op: str
    args: dict[str, Any]
    reply: bool = True


class Reply(msgspec.Struct, tag="reply", forbid_unknown_fields=True):
    """Child -> parent: the result of command ``op``."""

    op: str
    result: dict[str, Any]


class Failure(msgspec.Struct, tag="failure", forbid_unknown_fields=True):
    """Child -> parent: ``op`` (a command, or ``main``) raised; the child's exception, named and traced."""

    op: str
    error_type: str
    message: str
    trace: str = ""


class Message(msgspec.Struct, tag="message", forbid_unknown_fields=True):
    """Either direction: an application message (a map), outside the command/reply pairs."""

    body: dict[str, Any]


Frame = Start | Call | Reply | Failure | Message
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


class Channel:
    """One end of a rank pipe: length-prefixed msgpack frames over a read fd and a write fd (may be the same).

    Reads buffer what arrived, so a read whose deadline passes in the middle of a
    frame loses nothing. ``who`` names the other end in errors. Writes are
    serialized by a lock (a child may report from several threads).
    """

    def __init__(self, read_fd: int, write_fd: int, *, who: str) -> None:
        self.read_fd, self.write_fd, self.who = read_fd, write_fd, who
        self._buf = bytearray()
        self._eof = False
        self._lock = threading.Lock()
        self._write_open = True
        #: The command being served (set by :func:`serve`): what a failure of the child is reported against.
        self.op = "main"

    # --- frames ------------------------------------------------------------------------------------

    def write(self, frame: Frame) -> None:
        """Send one frame (blocking until the pipe took it); ``BrokenPipeError`` if the other end is gone."""
        data = _encoder.encode(frame)
        view = memoryview(len(data).to_bytes(4, "big") + data)
        with self._lock:
            if not self._write_open:
                raise BrokenPipeError(f"the channel to {self.who} is closed for writing")
            while view:
                view = view[os.write(self.write_fd, view[:_CHUNK]) :]

    def pending(self) -> bool:
        """True when a whole frame is already buffered (a read would not wait)."""
        if len(self._buf) < 4:
            return False
        return len(self._buf) >= 4 + int.from_bytes(self._buf[:4], "big")

    def read(self, timeout: float | None) -> Frame | None:
        """The next frame, or None when ``timeout`` seconds passed first (None: wait forever). ``EOFError`` at EOF."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if len(self._buf) >= 4:
                size = int.from_bytes(self._buf[:4], "big")
                if size > MAX_FRAME:
                    raise RankProtocolError(
                        f"{self.who} sent a frame of {size} bytes, over the {MAX_FRAME}-byte limit",
                        rank=self.who,
                        op=self.op,
                    )
                if len(self._buf) >= 4 + size:
                    data = bytes(self._buf[4 : 4 + size])
                    del self._buf[: 4 + size]
                    try:
                        return _decoder.decode(data)
                    except msgspec.DecodeError as exc:
                        raise RankProtocolError(
                            f"{self.who} sent a malformed frame: {exc}", rank=self.who, op=self.op
                        ) from None
            if self._eof:
                raise EOFError(f"{self.who} closed the channel ({len(self._buf)} bytes of a frame pending)")
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                if not select.select([self.read_fd], [], [], left)[0]:
                    return None
            try:
                chunk = os.read(self.read_fd, _CHUNK)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self._eof = True
            self._buf += chunk

    # --- messages (either end) ---------------------------------------------------------------------

    def send(self, body: Mapping[str, Any]) -> None:
        """Send an application message (a map of msgpack types)."""
        self.write(Message(dict(body)))

    def recv(self, timeout: float | None) -> dict[str, Any]:
        """The next application message; ``RankTimeoutError`` after ``timeout`` s, ``EOFError`` if the peer left."""
        frame = self.read(timeout)
        if frame is None:
            raise RankTimeoutError(rank=self.who, op=self.op, timeout=timeout or 0.0)
        if not isinstance(frame, Message):
            raise RankProtocolError(
                f"{self.who} sent a {type(frame).__name__} frame where a message was expected",
                rank=self.who,
                op=self.op,
            )
        return frame.body

    def fail(self, op: str, exc: BaseException) -> None:
        """Report ``exc`` (raised while running ``op``) to the other end; never raises."""
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            self.write(Failure(op, type(exc).__name__, str(exc), trace))
        except OSError:
            pass

    # --- closing -----------------------------------------------------------------------------------

    def close_write(self) -> None:
        """Tell the other end no more frames come (EOF on its reads); reads here go on."""
        with self._lock:
            if not self._write_open:
                return
            self._write_open = False
            if self.write_fd == self.read_fd:
                try:
                    socket.socket(fileno=os.dup(self.write_fd)).shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            else:
                os.close(self.write_fd)

    def close(self) -> None:
        """Close both directions; idempotent."""
        self.close_write()
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1


# --- the child's side ---------------------------------------------------------------------------------


def serve(
    channel: Channel,
    handler: object,
    *,
    idle: Callable[[], None] | None = None,
    idle_wait: Callable[[], float] | float = 0.05,
) -> None:
    """Answer commands until the parent closes the channel or calls ``exit``: ``op`` runs ``handler.op_<op>(**args)``.

    A handler returns its reply's fields (a map, or None for none). A handler that
    raises is reported as a :class:`Failure` of that op and serving goes on. ``idle``
    (the rank's engine loop step, say) runs after every command and whenever
    ``idle_wait`` seconds (a number, or a function giving it each time) pass without one.
    The ``exit`` command is answered (with the handler's ``op_exit`` result, if it has one) and ends serving.
    """
    while True:
        wait = idle_wait() if callable(idle_wait) else idle_wait
        try:
            frame = channel.read(wait if idle is not None else None)
        except EOFError:
            return
        if frame is not None:
            if not isinstance(frame, Call):
                raise RankProtocolError(
                    f"the parent sent a {type(frame).__name__} frame where a command was expected",
                    rank=channel.who,
                    op=channel.op,
                )
            channel.op = frame.op
            method = getattr(handler, f"op_{frame.op}", None)
            try:
                if method is None and frame.op != "exit":
                    raise ValueError(f"unknown command {frame.op!r} (this rank serves: {_ops(handler)})")
                result = method(**frame.args) if method is not None else None
            except Exception as exc:
                channel.fail(frame.op, exc)
            else:
                if frame.reply:
                    channel.write(Reply(frame.op, dict(result or {})))
            finally:
                channel.op = "main"
            if frame.op == "exit":
                return
        if idle is not None:
            idle()


def _ops(handler: object) -> str:
    return ", ".join(sorted(n[3:] for n in dir(handler) if n.startswith("op_"))) or "nothing"


def _die_with_parent() -> None:
    """Ask for SIGKILL when the parent dies (Linux), else watch the parent pid from a thread."""
    parent = os.getppid()
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before the request took effect
                    os._exit(70)
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(70)

    threading.Thread(target=watch, name="kvcore-rank-parent-watch", daemon=True).start()


def _resolve(target: str) -> Callable[..., Any]:
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"rank target: expected 'module:function', got {target!r}")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"rank target {target!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def _child(channel: Channel) -> int:
    """Run the child: read the start frame, run its target, report a failure; the exit status."""
    _die_with_parent()
    try:
        start = channel.read(_START_TIMEOUT_S)
    except EOFError:
        return 1
    if not isinstance(start, Start):
        channel.fail("start", RankProtocolError("no start frame", rank="parent", op="start"))
        return 1
    channel.who = f"parent of {start.name}"
    os.environ.update(start.env)
    sys.path[:0] = [p for p in start.path if p not in sys.path]
    try:
        _resolve(start.target)(channel, **start.kwargs)
    except BaseException as exc:  # reported, never a silent exit
        channel.fail(channel.op, exc)
        return 1
    finally:
        channel.close()
    return 0


def _forkserver_entry(conn: Any) -> None:
    """A forkserver child's entry: the duplex pipe's fd carries the frames; stdout goes to stderr."""
    fd = os.dup(conn.fileno())
    conn.close()
    os.dup2(2, 1)  # native libraries may print: the parent's stdout (``--json``) stays clean
    code = _child(Channel(fd, fd, who="parent"))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def main() -> int:
    """``python -m kvcore.testing.ranks``: frames on stdin and on a private copy of stdout (stdout goes to stderr)."""
    out = os.dup(1)
    os.dup2(2, 1)  # anything a library prints lands on stderr, never inside a frame
    return _child(Channel(0, out, who="parent"))


# --- the parent's side --------------------------------------------------------------------------------


class StartMethod(enum.Enum):
    """How a rank process starts: both give it a fresh interpreter state, neither forks a threaded process."""

    SUBPROCESS = "subprocess"  # python -m kvcore.testing.ranks (behind a launcher if given)
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
                [*launcher, sys.executable, "-m", "kvcore.testing.ranks", name],
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
            self.process = ctx.Process(target=_forkserver_entry, args=(child,), name=name, daemon=True)
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


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: targets import kvcore.testing.ranks, and its frame
    # classes must be the ones the channel decodes into.
    from kvcore.testing import ranks as _ranks

    sys.exit(_ranks.main())
