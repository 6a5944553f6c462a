"""Raw ZeroMQ sockets that speak to kvcore ranks as this uid does: CURVE clients with this user's local key.

Ranks authenticate by default (``auth_mode="auto"``: this uid's local key, docs/security.md), so a test playing a
malicious *admitted* peer with a bare socket must present that key; a socket without it is a stranger, refused
during the handshake.
"""

from __future__ import annotations

from typing import Any

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
