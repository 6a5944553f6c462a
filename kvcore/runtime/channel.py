"""One end of a rank pipe (:class:`Channel`) and the typed errors both ends raise.

A channel reads and writes length-prefixed :mod:`kvcore.runtime.frames` over a read fd and a write fd. What
it promises: a deadline on every read (:meth:`Channel.recv` raises :class:`RankTimeoutError` naming the rank
and the op), and a read that times out half way through a frame keeps the bytes for the next read.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

import msgspec

from kvcore.errors import KvcoreError
from kvcore.runtime.frames import MAX_FRAME, Failure, Frame, Message, decode, encode

__all__ = [
    "Channel",
    "RankError",
    "RankExitedError",
    "RankFailedError",
    "RankProtocolError",
    "RankTimeoutError",
]

_CHUNK = 1 << 22


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
        data = encode(frame)
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
                        return decode(data)
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
