"""Refusing peers a same-host transport cannot reach: a typed error at load time instead of a misleading one later.

The shm agent maps the peer's files under ``/dev/shm`` and sends notifications
to an abstract UNIX socket; both exist only where the peer's mount and network
namespaces are ours. A peer on another host would otherwise fail with "control
segment is gone; the peer died" (or, worse, find a stale file of the same
name). ``require_same_host`` is called first thing when a descriptor is
loaded. It decides by *reachability*, not identity: two containers of one pod
share ``/dev/shm`` and the network namespace but not the pid namespace (so
their ``host_identity()`` differs and pid proofs are impossible, yet shared
memory works), and ``KVCORE_HOST_ID`` may simulate another host for the pid
proofs of one machine. ``kvcore.hostinfo.host_identity()`` of both sides goes
into the error, so an operator sees at once that the peer is elsewhere.
"""

from __future__ import annotations

import errno
import os
import socket

from kvcore.errors import RemoteAgentError
from kvcore.hostinfo import host_identity, hostname

__all__ = ["PeerOnOtherHostError", "require_same_host", "abstract_socket_reachable"]


class PeerOnOtherHostError(RemoteAgentError):
    """A same-host transport was asked to load a peer on another host; choose a network transport (``remote=True``)."""


def abstract_socket_reachable(address: bytes, kind: int = socket.SOCK_DGRAM) -> bool:
    """True when an abstract UNIX socket (``b"\\0name"``) of ``kind`` exists in this network namespace."""
    s = socket.socket(socket.AF_UNIX, kind)
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
    socket_address: bytes,
    path: str | None = None,
    socket_kind: int = socket.SOCK_DGRAM,
) -> None:
    """Raise ``PeerOnOtherHostError`` unless the peer's socket (and ``path``, its control file) are reachable here.

    ``peer_identity`` is the peer's ``host_identity()`` from its descriptor
    (empty when it could not tell) and ``peer_hostname`` its host name: both
    only explain the refusal. ``socket_address`` is an abstract socket the peer
    listens on (``b"\\0name"``).
    """
    missing = []
    if not abstract_socket_reachable(socket_address, socket_kind):
        missing.append(
            f"its socket {socket_address[1:].decode(errors='replace')!r} does not exist in this network namespace"
        )
    if path is not None and not os.path.exists(path):
        missing.append(f"its control file {path} does not exist in this mount namespace")
    if not missing:
        return
    mine = host_identity()
    where = f" ({peer_hostname})" if peer_hostname else ""
    if mine and peer_identity and peer_identity != mine:
        verdict = (
            f"peer {peer_name!r}{where} is on another host: host identity expected {mine!r} "
            f"(this host, {hostname()}), got {peer_identity!r}"
        )
    else:
        verdict = (
            f"peer {peer_name!r}{where} is not reachable from this host "
            f"(host identity: ours {mine or 'unknown'!r}, the peer's {peer_identity or 'unknown'!r})"
        )
    raise PeerOnOtherHostError(
        f"{verdict}: {'; '.join(missing)}; the {backend} agent reaches peers on this host only "
        "(same /dev/shm and network namespace); use a network transport across hosts "
        "(an agent with remote=True: see 'kvcore plugins')"
    )
