"""Raw ZeroMQ sockets that speak to kvcore ranks as this uid does (CURVE clients with this user's local key), and
``as_uid``, which runs a function as another uid (a stranger on the same host).

Ranks authenticate by default (``auth_mode="auto"``: this uid's local key, docs/security.md), so a test playing a
malicious *admitted* peer with a bare socket must present that key; a socket without it is a stranger, refused
during the handshake.
"""

from __future__ import annotations

import json
import os
import select
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from kvcore.config import TransceiverConfig
from kvcore.control.auth import AuthConfig


def local_dealer(endpoint: str, *, zctx: Any = None) -> zmq.Socket[bytes]:
    """A DEALER connected to ``endpoint`` as an admitted same-uid peer (this user's local CURVE key)."""
    auth = AuthConfig.from_config(TransceiverConfig())
    assert auth is not None, "the default configuration authenticates with the local key"
    sock = (zctx or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey = auth.public_key
    sock.curve_secretkey = auth.secret_key
    sock.curve_serverkey = auth.server_key
    sock.connect(endpoint)
    return sock


def as_uid(uid: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in a forked child (as ``uid`` when given) and return its result (JSON)."""
    if uid is not None and os.geteuid() != 0:
        pytest.skip(f"switching to uid {uid} needs root; this test runs as uid {os.geteuid()}")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            if uid is not None:
                try:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                except OSError as exc:
                    os.write(w, json.dumps({"setuid_error": repr(exc)}).encode())
                    os._exit(0)
            os.write(w, json.dumps({"result": fn(*args), "uid": os.getuid(), "pid": os.getpid()}).encode())
        except BaseException as exc:
            os.write(w, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    try:
        while select.select([r], [], [], 30)[0]:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b"{}")
    if "setuid_error" in out:  # e.g. a container without CAP_SETUID
        pytest.skip(f"this machine does not allow dropping to uid {uid}: {out['setuid_error']}")
    assert "error" not in out, out
    assert uid is None or out["uid"] == uid
    return out["result"]
