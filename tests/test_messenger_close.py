"""Messenger shutdown: closing while the peer closes too never hangs, and messengers can be recreated at once."""

from __future__ import annotations

import threading

from kvcore.control import wire
from kvcore.control.messenger import Messenger


def _ping() -> wire.Message:
    return wire.ErrorReply(v=wire.PROTOCOL_VERSION, kind="ProtocolError", error="ping")


def test_close_while_peer_closes_and_recreate() -> None:
    """Both ends close concurrently, many times in one process.

    Regression: the wake-up inproc address was derived from ``id(self)``, which is
    reused once a closed messenger is freed while libzmq unbinds the endpoint
    asynchronously ("Address already in use" on the next messenger).
    """
    for i in range(60):
        got = threading.Event()
        a = Messenger(lambda s, m: None, name=f"a{i}", heartbeat_ms=50)
        b = Messenger(lambda s, m, got=got: got.set(), name=f"b{i}", heartbeat_ms=50)
        a.start()
        b.start()
        a.send(b.endpoint, _ping())
        b.send(a.endpoint, _ping())
        assert got.wait(5)
        done: list[str] = []

        def close(m: Messenger, done: list[str] = done) -> None:
            m.close(2.0)
            done.append(m.name)

        threads = [threading.Thread(target=close, args=(m,), daemon=True) for m in (b, a)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert sorted(done) == sorted([a.name, b.name]), f"iteration {i}: close hung ({done} finished)"
