"""The threaded floor in C: the round trip of ``kvcore.tools.bench.floor``'s threaded floor with no Python on its hops.

The context side's echo thread and the generation side's I/O thread are C threads on pyzmq's libzmq (opened by
path: :func:`libzmq_path`); the calling thread plays the engine with the GIL released: it hands each frame to the
I/O thread through an inproc PAIR and sleeps on a condition variable until the echo came back.
"""

from __future__ import annotations

import ctypes.util
import threading
from typing import Any

from kvcore.errors import KvcoreError
from kvcore_native import _floor

__all__ = ["NativeFloorError", "echo_start", "echo_stop", "libzmq_path", "ping_threaded"]

_loaded = False
_lock = threading.Lock()


class NativeFloorError(KvcoreError):
    """The native floor could not run: libzmq not found or refused, a socket or thread that failed."""


def libzmq_path() -> str:
    """The file of the libzmq pyzmq uses (mapped once ``zmq`` is imported), else the system's ``libzmq``."""
    import zmq  # noqa: F401  (maps pyzmq's libzmq into this process)

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if line.count("/") else ""
                if "/libzmq" in path and ".so" in path:
                    return path
    except OSError:
        pass
    found = ctypes.util.find_library("zmq")
    if found is None:
        raise NativeFloorError("libzmq not found: pyzmq's library is not mapped and the system has none")
    return found


def _load() -> None:
    global _loaded
    with _lock:
        if not _loaded:
            path = libzmq_path()
            try:
                _floor.load(path)
            except OSError as exc:
                raise NativeFloorError(str(exc)) from exc
            _loaded = True


def echo_start() -> tuple[Any, str]:
    """Start an echo on a free loopback port, answered by a C thread; returns ``(echo, endpoint)``."""
    _load()
    try:
        echo, endpoint = _floor.echo_start()
    except OSError as exc:
        raise NativeFloorError(str(exc)) from exc
    return echo, str(endpoint)


def echo_stop(echo: Any) -> None:
    """Stop the echo's thread and close its socket (a second call does nothing)."""
    _floor.echo_stop(echo)


def ping_threaded(endpoint: str, n: int, timeout_s: float) -> list[float]:
    """``n`` round trips to an echo, one at a time, through a C I/O thread; seconds each.

    Raises ``TimeoutError`` when an echo does not come back within ``timeout_s`` (the round trip is named), and
    :class:`NativeFloorError` when a socket or the I/O thread fails.
    """
    _load()
    try:
        seconds = _floor.ping_threaded(endpoint, int(n), float(timeout_s))
    except TimeoutError:
        raise
    except OSError as exc:
        raise NativeFloorError(str(exc)) from exc
    return seconds
