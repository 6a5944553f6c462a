"""Child-side functions for ``test_ranks.py``: each runs in a real rank process (``kvcore.runtime``)."""

from __future__ import annotations

import os
import time
from typing import Any

from kvcore.runtime import Channel, serve


class _Echo:
    """Commands the harness tests drive: echo, raise, hang, report messages before replying."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def op_echo(self, **args: Any) -> dict[str, Any]:
        return {"args": args, "pid": os.getpid()}

    def op_boom(self, what: str) -> dict[str, Any]:
        raise ValueError(f"bad value {what!r}")

    def op_hang(self, seconds: float) -> dict[str, Any]:
        time.sleep(seconds)
        return {}

    def op_chatty(self, n: int) -> dict[str, Any]:
        for i in range(n):
            self.channel.send({"progress": i})
        return {"sent": n}

    def op_env(self, name: str) -> dict[str, Any]:
        return {"value": os.environ.get(name)}


def echo_main(channel: Channel, greeting: str = "") -> None:
    """Say hello (a message), then serve ``_Echo``'s commands until EOF or ``exit``."""
    channel.send({"hello": greeting, "pid": os.getpid()})
    serve(channel, _Echo(channel))


def raise_main(channel: Channel) -> None:
    """Fail before serving anything."""
    raise RuntimeError("cannot start: the pool is missing")


def stubborn_main(channel: Channel) -> None:
    """Say hello, then ignore the channel (and SIGTERM) for a long time: only SIGKILL ends it."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel.send({"pid": os.getpid()})
    time.sleep(600)


def garbage_main(channel: Channel) -> None:
    """Write a frame whose body is not a harness frame (a hostile or broken child)."""
    payload = b"\x93\x01\x02\x03"  # msgpack [1, 2, 3]: valid msgpack, not a frame
    os.write(channel.write_fd, len(payload).to_bytes(4, "big") + payload)
    time.sleep(30)
