"""The child's side of a rank process: read the start frame, run ``main(channel, **kwargs)``, serve commands.

A child is a fresh interpreter (``python -m kvcore.runtime``, see :mod:`kvcore.runtime.process`) or a child of
a ``forkserver``; it asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG`` on Linux; elsewhere a
watchdog thread), and an exception in ``main`` or in a command served by :func:`serve` goes back to the parent
as a :class:`~kvcore.runtime.frames.Failure` frame, never a silent exit.

A caveat of ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the child exits, so start rank
processes from a thread that lives as long as they do (the main thread, in every user here).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvcore.runtime.channel import Channel, RankProtocolError
from kvcore.runtime.frames import Call, Reply, Start

__all__ = ["forkserver_entry", "main", "serve"]

#: Seconds the child waits for its start frame (the parent writes it right after starting the child).
_START_TIMEOUT_S = 120.0


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


def forkserver_entry(conn: Any) -> None:
    """A forkserver child's entry: the duplex pipe's fd carries the frames; stdout goes to stderr."""
    fd = os.dup(conn.fileno())
    conn.close()
    os.dup2(2, 1)  # native libraries may print: the parent's stdout (``--json``) stays clean
    code = _child(Channel(fd, fd, who="parent"))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def main() -> int:
    """``python -m kvcore.runtime``: frames on stdin and on a private copy of stdout (stdout goes to stderr)."""
    out = os.dup(1)
    os.dup2(2, 1)  # anything a library prints lands on stderr, never inside a frame
    return _child(Channel(0, out, who="parent"))
