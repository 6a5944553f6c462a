"""What a messenger keeps: where a message came from, one record per peer socket, and the state its layers share.

:class:`MessengerState` only declares the attributes ``Messenger.__init__`` sets; the layers built on it
(``peer_sockets`` -> ``outbox`` -> ``inbound`` -> ``ioloop`` -> ``messenger``) each read and write them on the
one I/O thread that owns every ZeroMQ socket (ZeroMQ sockets are not thread-safe), except where a lock is noted.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvcore.control import wire
from kvcore.control.auth import AuthConfig
from kvcore.control.ratelimit import RateLimitedLog
from kvcore.errors import KvcoreError


@dataclass(frozen=True)
class Source:
    """Where a message came from: a peer's DEALER (``identity`` on our ROUTER) or our DEALER to ``endpoint``.

    ``peer_key`` is the peer's CurveZMQ public key (Z85) as proven by the
    handshake: the client key ZAP admitted on the ROUTER, or the server key
    our DEALER verified. ``None`` without authentication.
    """

    identity: bytes | None = None
    endpoint: str | None = None
    peer_key: bytes | None = None


Handler = Callable[[Source, wire.Message], None]
ErrorHandler = Callable[[Source, KvcoreError], None]
DisconnectHandler = Callable[[str], None]
ConnectHandler = Callable[[str], None]
AuthFailedHandler = Callable[[str, str], None]
#: Runs once per I/O-loop turn on the I/O thread; returns how long (seconds) the next poll may wait for traffic.
Driver = Callable[[], float]


@dataclass(eq=False)
class _Dealer:
    """One outgoing socket to a peer endpoint, its monitor, and what the monitor told us."""

    endpoint: str
    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    server_key: bytes | None
    connected: bool = False
    authenticated: bool = False
    last_used: float = 0.0
    #: Frames written before the ZMTP handshake succeeded (none of them can have been delivered yet): sent again
    #: on a fresh socket when the handshake fails without authentication (bounded).
    unconfirmed: list[bytes] = field(default_factory=list)
    unconfirmed_bytes: int = 0
    retries: int = 0  # fresh sockets made for this endpoint after failed handshakes


#: Plain ints of the option and flag ``_readable`` uses: pyzmq's enum members cost an enum operation per call.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on ``sock`` (its ZMQ_EVENTS): draining stops without raising zmq.Again."""
    return bool(int(sock.get(_EVENTS)) & _POLLIN)


class MessengerState:
    """The attributes every layer of the messenger shares, set by ``Messenger.__init__`` (``_poller`` by the loop)."""

    name: str
    #: Events by kind (``sent``, ``received``, ``bad_frames``, ``send_failed``, ``auth_denied``, ...).
    counters: collections.Counter[str]
    _rlog: RateLimitedLog
    _handler: Handler
    _on_error: ErrorHandler | None
    _on_disconnect: DisconnectHandler | None
    _on_connect: ConnectHandler | None
    _on_auth_failed: AuthFailedHandler | None
    _max: int  # max_message_bytes
    _heartbeat_ms: int
    _auth: AuthConfig | None
    _max_dealers: int
    _own_ctx: bool
    _ctx: zmq.Context[zmq.Socket[bytes]]
    _zap: zmq.Socket[bytes] | None
    _router: zmq.Socket[bytes]
    _wake_rx: zmq.Socket[bytes]
    _wake_tx: zmq.Socket[bytes]  # any thread, under _wake_lock
    _wake_lock: threading.Lock
    _wake_closed: bool  # under _wake_lock: the wake socket is closed (no thread may touch it)
    _keys_lock: threading.Lock
    _peer_keys: dict[str, bytes]  # under _keys_lock: endpoint -> Z85 server key (set_peer_key)
    _outbox: collections.deque[tuple[str, object, bytes]]  # any thread appends; the I/O thread writes
    _dealers: dict[str, _Dealer]
    _handshake_retries: dict[str, int]  # endpoint -> fresh sockets made after failed handshakes
    _by_sock: dict[zmq.Socket[bytes], _Dealer]
    _by_monitor: dict[zmq.Socket[bytes], _Dealer]
    _poller: zmq.Poller
    _stop: threading.Event
    _driver: Driver | None
    _turn_end: Callable[[], None] | None
    _next_wait_s: float
    _full_since: dict[tuple[bool, object], float]  # (router?, dest) -> when its queue was first full
    _thread: threading.Thread
    _cpu_at_exit: float
    _stall_s: float
    _lag: list[float]
