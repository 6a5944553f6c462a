"""Where a messenger listens and what it tells peers to dial: binding the ROUTER, the advertised endpoint."""

from __future__ import annotations

import logging

import zmq

from kvcore.control import wire
from kvcore.errors import ConfigError, ProtocolError

log = logging.getLogger("kvcore.control.messenger")

_WILDCARDS = {"0.0.0.0", "::", "*", "[::]"}


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bind_router(router: zmq.Socket[bytes], host: str, port: int, advertise_host: str | None = None) -> tuple[str, str]:
    """Bind ``router`` on ``host:port`` (0: a free port) and return ``(bound endpoint, advertised endpoint)``.

    ``host`` may be an IPv4/IPv6 address, a name, or a wildcard (``0.0.0.0``,
    ``::``). Peers dial the advertised endpoint: ``advertise_host`` when given
    (the address a peer on another host can reach, e.g. the pod IP), else the
    bind address, else, for a wildcard bind, this host's name (a wildcard is
    never advertised). An address that cannot be bound is a ``ConfigError``
    naming it.
    """
    wildcard = host in _WILDCARDS
    if ":" in host:
        router.setsockopt(zmq.IPV6, 1)
    bind_host = "*" if wildcard else _bracket(host)
    try:
        if port:
            router.bind(f"tcp://{bind_host}:{port}")
        else:
            router.bind_to_random_port(f"tcp://{bind_host}")
    except zmq.ZMQBaseError as exc:  # ZMQError, or ZMQBindError from bind_to_random_port
        raise ConfigError(
            f"control plane cannot bind host {host!r} port {port or '(any free)'}: {exc}; "
            "pick a free port or an address of this host"
        ) from exc
    last = router.getsockopt(zmq.LAST_ENDPOINT)
    bound = last.decode() if isinstance(last, bytes) else str(last)
    bound_port = int(bound.rpartition(":")[2])
    if advertise_host:
        advertised_host = advertise_host
    elif wildcard:
        import socket

        advertised_host = socket.gethostname()
        log.warning(
            "kvcore control plane bound to wildcard %s without advertise_host: advertising this host's name %r; "
            "set advertise_host to the address peers should dial",
            host,
            advertised_host,
        )
    else:
        advertised_host = host
    advertised = f"tcp://{_bracket(advertised_host)}:{bound_port}"
    try:
        wire.parse_endpoint(advertised)
    except ProtocolError as exc:
        router.unbind(bound)
        raise ConfigError(f"advertise_host {advertised_host!r} does not make a valid endpoint: {exc}") from exc
    return bound, advertised
