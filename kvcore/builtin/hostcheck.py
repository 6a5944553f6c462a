"""Refusing peers a same-host transport cannot reach: a typed error at load time instead of a misleading one later.

The shm agent maps the peer's files under ``/dev/shm`` and sends notifications
to an abstract UNIX socket; both exist only inside one host (one mount and one
network namespace). A peer on another host would otherwise fail with "control
segment is gone; the peer died" (or, worse, find a stale file of the same
name). ``require_same_host`` is called first thing when a descriptor is
loaded: it compares ``kvcore.hostinfo.host_identity()`` of both sides and,
where a side cannot tell its identity, probes the peer's notification socket.
"""

from __future__ import annotations

import errno
import socket

from kvcore.errors import RemoteAgentError
from kvcore.hostinfo import host_identity, hostname

__all__ = ["PeerOnOtherHostError", "require_same_host", "abstract_socket_reachable"]


class PeerOnOtherHostError(RemoteAgentError):
    """A same-host transport was asked to load a peer on another host; choose a network transport (nixl, ucx)."""


def abstract_socket_reachable(address: bytes) -> bool:
    """True when an abstract UNIX datagram socket (``b"\\0name"``) exists in this network namespace."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.connect(address)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise
    finally:
        s.close()
    return True


def require_same_host(
    backend: str,
    peer_name: str,
    peer_identity: str,
    *,
    peer_hostname: str = "",
    socket_address: bytes | None = None,
) -> None:
    """Raise ``PeerOnOtherHostError`` unless the peer is on this host (same ``host_identity()``, or its socket answers).

    ``peer_identity`` is the peer's ``host_identity()`` from its descriptor
    (empty when it could not tell); ``socket_address`` an abstract socket the
    peer listens on, probed only when an identity is missing.
    """
    mine = host_identity()
    theirs_host = f" ({peer_hostname})" if peer_hostname else ""
    hint = f"the {backend} agent reaches peers on this host only; use a network transport (nixl or ucx) across hosts"
    if mine and peer_identity:
        if peer_identity != mine:
            raise PeerOnOtherHostError(
                f"peer {peer_name!r}{theirs_host} is on another host: host identity expected {mine!r} "
                f"(this host, {hostname()}), got {peer_identity!r}; {hint}"
            )
        return
    if socket_address is not None and not abstract_socket_reachable(socket_address):
        raise PeerOnOtherHostError(
            f"peer {peer_name!r}{theirs_host} is not reachable on this host: its notification socket "
            f"{socket_address[1:].decode(errors='replace')!r} does not exist in this network namespace "
            f"(host identity: ours {mine or 'unknown'!r}, the peer's {peer_identity or 'unknown'!r}); {hint}"
        )
