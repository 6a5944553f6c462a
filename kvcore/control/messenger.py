"""ZeroMQ control plane: one ROUTER socket for incoming traffic, one DEALER per peer for outgoing.

ZeroMQ sockets must stay on the thread that uses them, so one I/O thread owns
every socket of a messenger: it polls the ROUTER, the DEALERs, their monitors,
the ZAP socket and a wake-up pipe, decodes frames and hands messages to the
handler. Handlers only mutate state and enqueue work; they never block on a
transfer. Other threads send by enqueueing (``send``/``reply`` are thread-safe)
and waking the I/O thread; a send from the I/O thread itself (a handler, the
driver) is written to its socket at the end of the same loop turn, with no
wake-up.

A *driver* (``set_driver``) runs on the I/O thread once per loop turn, after the
sockets were served, and says how long the next poll may wait: the transceiver
runs its whole worker there, so the thread that reads a control message also
does the work and writes the answer. Other threads hand it work and call
``wake``.

Nothing a peer sends can stop the I/O thread: a frame that fails to decode is
answered with an ``ErrorReply`` and counted; an exception from a handler, a
monitor or a send is counted and logged (rate-limited) and the loop goes on.

With authentication each messenger has its own ``zmq.Context``, so its ZAP
handler (see ``kvcore.control.auth``) serves only its own ROUTER: several messengers
with different allow-lists in one process never see each other's requests.

Why one module of this length: every ZeroMQ socket belongs to the one I/O thread (ZeroMQ sockets are not
thread-safe), and the ROUTER, the DEALERs, their monitors, CURVE/ZAP and the bounded dispatch are that thread's
state; split, they would share it across modules.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvcore.control import wire
from kvcore.control.auth import AuthConfig, z85_key
from kvcore.errors import ConfigError, KvcoreError, ProtocolError
from kvcore.hostinfo import is_loopback_host
from kvcore.metrics.snapshot import Histogram, _cell_histogram, _hist_cell, _observe

__all__ = ["Messenger", "Source", "RateLimitedLog", "peer_socket_budget", "FDS_PER_PEER_SOCKET"]

_WAKE_IDS = itertools.count()
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: one handler per context
_ZAP_DOMAIN = b"kvcore"
#: The most DEALER sockets (one per peer endpoint) a messenger keeps open, however many descriptors it may use.
DEFAULT_MAX_PEER_SOCKETS = 1024
#: File descriptors one DEALER costs (measured with /proc/self/fd, pyzmq 26 / libzmq 4.3; a test keeps it honest):
#: the socket's mailbox, its monitor's two PAIR ends' mailboxes (eventfds) and its TCP connection.
FDS_PER_PEER_SOCKET = 4
#: Descriptors left to the rest of the process (engine, transport, accepted connections) before the budget of
#: DEALERs is taken, which is then at most half of what is left under RLIMIT_NOFILE.
_RESERVED_FDS = 256
#: DEALERs a messenger may keep however low the limit (below this, least recently used ones are closed).
_MIN_PEER_SOCKETS = 4

log = logging.getLogger("kvcore.control.messenger")

#: Fresh sockets made for an endpoint whose ZMTP handshake failed without authentication, before giving up.
_HANDSHAKE_RETRIES = 3
#: Frames (and their bytes) kept per socket until its handshake succeeded, to send again after a failed one.
_MAX_UNCONFIRMED = 1024
_MAX_UNCONFIRMED_BYTES = 16 * 1024 * 1024
#: What a failed ZMTP handshake most often means (the greeting is ZeroMQ's, before any security mechanism).
_NOT_KVCORE = "the peer does not speak kvcore's protocol (ZeroMQ's ZMTP), or it reset the connection mid-handshake"
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


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

#: Poll period of a messenger without a driver (seconds): only ``close`` needs the loop to come round.
_IDLE_POLL_S = 0.1
#: How long (ms) messages already queued on a socket may still take to leave after ``close`` (a peer that is gone
#: costs at most this; with a context of our own, ``close`` waits that long for it).
_CLOSE_LINGER_MS = 250
#: How long messages to a peer whose socket queue is full are kept for a retry before they are dropped (seconds).
_SEND_GIVE_UP_S = 5.0
#: Messages (and bytes) kept for one peer whose queue is full: a peer that sends but never reads (a stranger
#: flooding bad frames, each answered) cannot grow the outbox or the I/O thread's work per turn past these.
_MAX_DEFERRED_PER_PEER = 16384
_MAX_DEFERRED_BYTES_PER_PEER = 16 * 1024 * 1024


def peer_socket_budget(nofile: int | None = None) -> int:
    """How many DEALERs a messenger may keep open, from the soft RLIMIT_NOFILE (``nofile``: given, for tests).

    A bound in sockets alone is not one in descriptors: 1024 DEALERs cost about 4096 descriptors, past the common
    limit of 1024, so a stranger naming 600 endpoints made every socket call fail with "Too many open files".
    The budget is half of the descriptors left after a reserve for the rest of the process, at
    ``FDS_PER_PEER_SOCKET`` each, between ``_MIN_PEER_SOCKETS`` and ``DEFAULT_MAX_PEER_SOCKETS``.
    """
    if nofile is None:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        nofile = DEFAULT_MAX_PEER_SOCKETS * FDS_PER_PEER_SOCKET * 4 if soft == resource.RLIM_INFINITY else int(soft)
    fds = max(0, nofile - _RESERVED_FDS) // 2
    return max(_MIN_PEER_SOCKETS, min(DEFAULT_MAX_PEER_SOCKETS, fds // FDS_PER_PEER_SOCKET))


class RateLimitedLog:
    """At most one line per key per interval; the next line says how many were suppressed.

    For lines a peer can cause at will (a refused frame, a refused ticket): they are all counted elsewhere, and a
    flood of them must not become a flood of log lines.
    """

    def __init__(self, interval_s: float = 5.0, logger: logging.Logger | None = None) -> None:
        self._log = logger or log
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()

    def __call__(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self._interval:
            self._suppressed[key] += 1
            return
        if len(self._last) > 256:  # keys are few and fixed; bound the table anyway
            self._last.clear()
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        self._log.log(level, msg + (f" ({n} similar suppressed)" if n else ""), *args, exc_info=exc_info)


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


_WILDCARDS = {"0.0.0.0", "::", "*", "[::]"}


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on ``sock`` (its ZMQ_EVENTS): draining stops without raising zmq.Again."""
    return bool(int(sock.get(zmq.EVENTS)) & zmq.POLLIN)


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


class Messenger:
    """The control-plane sockets of one rank. Binds loopback by default.

    ``auth``: an ``AuthConfig`` makes the ROUTER a CURVE server that admits
    only allow-listed client keys (refused in the handshake, before any frame
    is decoded) and every DEALER a CURVE client; the server key of a peer
    endpoint is the one given to ``set_peer_key``/``send(server_key=...)``, else
    ``auth.server_key``. Without ``auth`` a non-loopback ``host`` needs
    ``allow_insecure_bind=True`` (``ConfigError`` otherwise) and logs a warning.

    ``max_peer_sockets``: the bound on DEALERs open at once (least recently used never-connected ones are closed
    first); ``None``: :func:`peer_socket_budget`, derived from RLIMIT_NOFILE.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
        on_error: ErrorHandler | None = None,
        on_disconnect: DisconnectHandler | None = None,
        on_connect: ConnectHandler | None = None,
        on_auth_failed: AuthFailedHandler | None = None,
        heartbeat_ms: int = 1000,
        name: str = "kvcore",
        auth: AuthConfig | None = None,
        allow_insecure_bind: bool = False,
        max_peer_sockets: int | None = None,
    ) -> None:
        if not is_loopback_host(host):
            if auth is None and not allow_insecure_bind:
                raise ConfigError(
                    f"messenger {name}: host {host!r} is not a loopback address and no authentication is configured; "
                    "pass auth=AuthConfig(...) (config auth_key_file, see `kvcore keygen`) or, on an isolated "
                    "network, allow_insecure_bind=True (config allow_insecure_bind / KVCORE_ALLOW_INSECURE_BIND=1)"
                )
            if auth is None:
                log.warning(
                    "kvcore control plane binding to non-loopback address %s WITHOUT authentication: anyone who can "
                    "reach it can drive this rank (allow_insecure_bind is set)",
                    host,
                )
            else:
                log.info("kvcore control plane binding to non-loopback address %s with CURVE authentication", host)
        if max_peer_sockets is None:
            max_peer_sockets = peer_socket_budget()
        if max_peer_sockets < 1:
            raise ConfigError(f"max_peer_sockets must be >= 1, got {max_peer_sockets}")
        self._handler = handler
        self._on_error = on_error
        self._on_disconnect = on_disconnect
        self._on_connect = on_connect
        self._on_auth_failed = on_auth_failed
        self._max = max_message_bytes
        self._heartbeat_ms = heartbeat_ms
        self._auth = auth
        self._max_dealers = max_peer_sockets
        self.name = name
        self.counters = collections.Counter[str]()
        self._rlog = RateLimitedLog()
        # With authentication, a context of our own: its ZAP endpoint (one per context) then belongs to this
        # messenger's allow-list alone. Without, the process-wide context (one I/O thread for every messenger).
        self._own_ctx = auth is not None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if self._own_ctx else zmq.Context.instance()
        self._zap: zmq.Socket[bytes] | None = None
        try:
            if auth is not None:
                self._zap = self._ctx.socket(zmq.REP)
                self._zap.setsockopt(zmq.LINGER, 0)
                self._zap.bind(_ZAP_ENDPOINT)  # before the ROUTER binds: no connection can skip the handler
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
            self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms * 3)
            self._router.setsockopt(zmq.HANDSHAKE_IVL, 10_000)  # a silent half-open connection is dropped
            if auth is not None:
                self._router.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
                self._router.setsockopt(zmq.CURVE_SERVER, 1)
                self._router.setsockopt(zmq.CURVE_SECRETKEY, auth.secret_key)
            #: ``bound_endpoint``: where the ROUTER listens; ``endpoint``: what peers are told to dial (advertised).
            self.bound_endpoint, self.endpoint = bind_router(self._router, host, port, advertise_host)
            self._wake_addr = f"inproc://kvcore-wake-{next(_WAKE_IDS)}-{id(self):x}"
            self._wake_rx = self._ctx.socket(zmq.PAIR)
            self._wake_rx.bind(self._wake_addr)
            self._wake_tx = self._ctx.socket(zmq.PAIR)
            self._wake_tx.setsockopt(zmq.LINGER, 0)
            self._wake_tx.connect(self._wake_addr)
        except BaseException:
            for sock in [getattr(self, n, None) for n in ("_zap", "_router", "_wake_rx", "_wake_tx")]:
                if sock is not None:
                    sock.close(0)
            if self._own_ctx:
                self._ctx.term()
            raise
        self._wake_lock = threading.Lock()
        self._wake_closed = False  # under _wake_lock: the wake socket is closed (no thread may touch it)
        self._keys_lock = threading.Lock()
        self._peer_keys: dict[str, bytes] = {}  # endpoint -> Z85 server key (set_peer_key)
        self._outbox: collections.deque[tuple[str, object, bytes]] = collections.deque()
        self._dealers: dict[str, _Dealer] = {}
        self._handshake_retries: dict[str, int] = {}  # endpoint -> fresh sockets made after failed handshakes
        self._by_sock: dict[zmq.Socket[bytes], _Dealer] = {}
        self._by_monitor: dict[zmq.Socket[bytes], _Dealer] = {}
        self._stop = threading.Event()
        self._driver: Driver | None = None
        self._turn_end: Callable[[], None] | None = None
        self._next_wait_s = _IDLE_POLL_S
        self._full_since: dict[tuple[bool, object], float] = {}  # (router?, dest) -> when its queue was first full
        self._thread = threading.Thread(target=self._run, name=f"{name}-messenger", daemon=True)
        self._cpu_at_exit = 0.0
        # Written by the I/O thread only (see ``io_timing``): seconds it was ready to run but did not, and how late
        # its timed sleeps ended (a histogram cell of kvcore.metrics.snapshot).
        self._stall_s = 0.0
        self._lag = _hist_cell()

    # --- public, thread-safe ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def set_turn_end(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the I/O thread at the end of every loop turn, after that turn's messages were written
        to their sockets (before ``start``). Exceptions are counted (``driver_errors``) and logged."""
        if self._thread.is_alive():
            raise ProtocolError(f"messenger {self.name}: set_turn_end after start")
        self._turn_end = callback

    def set_driver(self, driver: Driver) -> None:
        """Run ``driver`` on the I/O thread once per loop turn (before ``start``); it returns the next poll's wait.

        The driver must never block for long: while it runs, no socket is read. An exception from it is counted
        (``driver_errors``) and logged, and the loop goes on.
        """
        if self._thread.is_alive():
            raise ProtocolError(f"messenger {self.name}: set_driver after start")
        self._driver = driver

    def flush(self) -> None:
        """Write what this thread queued so far (I/O thread only: a driver about to take long, e.g. a chunk copy)."""
        if self.in_io_thread():
            self._flush_outbox()

    def sending(self) -> bool:
        """Whether messages wait in the outbox (written at the end of the I/O thread's turn, or when a queue has room)."""
        return bool(self._outbox)

    def in_io_thread(self) -> bool:
        """True when called from this messenger's I/O thread (a handler or the driver)."""
        return threading.get_ident() == self._thread.ident

    def has_input(self) -> bool:
        """Whether a message or a wake-up waits on any socket (I/O thread only: a driver that could go on working
        asks this to learn whether it should give the loop back). ZMQ_EVENTS on each socket: no syscall."""
        if not self.in_io_thread():
            return True
        if _readable(self._router) or _readable(self._wake_rx):
            return True
        return any(not d.sock.closed and _readable(d.sock) for d in self._dealers.values())

    def cpu_seconds(self) -> float:
        """CPU time (seconds) the I/O thread has used so far (its total once it ended; 0.0 before it started or
        where the platform has no per-thread CPU clock). Thread-safe."""
        ident = self._thread.ident
        if ident is None or not self._thread.is_alive():
            return self._cpu_at_exit
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (OSError, AttributeError):  # the thread ended meanwhile; no such clock on this platform
            return 0.0

    def io_timing(self) -> tuple[float, Histogram]:
        """How long the I/O thread waited to run: ``(stall_seconds, wake_lag)``. Thread-safe; totals since start.

        ``stall_seconds``: time inside its loop turns (from the end of a poll to the start of the next) that was
        not CPU time on this thread: waiting for the GIL after a ZeroMQ or transport call released it, for a core,
        or for a lock an engine thread held. ``wake_lag``: for every poll that ended because its wait ran out
        (no traffic), how much later than due the thread ran Python again: the GIL (up to the interpreter's
        switch interval beside a busy engine thread) plus the scheduler's wake-up.
        """
        return self._stall_s, _cell_histogram(self._lag)

    def wake(self) -> None:
        """Make the I/O thread come round at once (another thread handed its driver work). Thread-safe."""
        self._wake()

    @property
    def public_key(self) -> bytes | None:
        """This messenger's CurveZMQ public key (Z85), or None without authentication."""
        return None if self._auth is None else self._auth.public_key

    def set_peer_key(self, endpoint: str, server_key: bytes | str) -> None:
        """Expect ``server_key`` (Z85 or 32 raw bytes) from the ROUTER at ``endpoint`` from now on.

        A DEALER already open to ``endpoint`` with another key is closed and
        reopened with this one at the next send.
        """
        wire.parse_endpoint(endpoint)
        key = z85_key(server_key, f"server key of {endpoint}")
        with self._keys_lock:
            if len(self._peer_keys) >= 4 * self._max_dealers and endpoint not in self._peer_keys:
                self._peer_keys.pop(next(iter(self._peer_keys)))  # bounded: forget the oldest
            self._peer_keys[endpoint] = key

    def send(self, endpoint: str, msg: wire.Message, *, server_key: bytes | str | None = None) -> None:
        """Send ``msg`` to the ROUTER at ``endpoint`` (connecting a DEALER on first use).

        ``server_key`` (authentication only): the CURVE key the peer must
        prove, remembered for the endpoint as ``set_peer_key`` does.
        """
        wire.parse_endpoint(endpoint)
        if server_key is not None:
            self.set_peer_key(endpoint, server_key)
        self._enqueue(("dealer", endpoint, wire.encode(msg)))

    def reply(self, source: Source, msg: wire.Message) -> None:
        """Answer whoever sent a message, on the socket it came from."""
        if source.identity is not None:
            self._enqueue(("router", source.identity, wire.encode(msg)))
        elif source.endpoint is not None:
            self._enqueue(("dealer", source.endpoint, wire.encode(msg)))

    def drop(self, endpoint: str) -> None:
        """Close the DEALER to ``endpoint`` (a peer that is gone); a later ``send`` connects afresh."""
        self._enqueue(("drop", endpoint, b""))

    def send_raw(self, endpoint: str, frame: bytes) -> None:
        """Send an arbitrary frame (fault-injection tests only)."""
        self._enqueue(("dealer", endpoint, frame))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the I/O thread and close every socket."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()
        else:  # pragma: no cover - the thread is wedged in a handler
            log.error("messenger %s: I/O thread did not stop within %.1fs", self.name, timeout)

    @property
    def peer_count(self) -> int:
        """DEALER sockets open (one per peer endpoint)."""
        return len(self._dealers)

    @property
    def alive(self) -> bool:
        """True while the I/O thread runs."""
        return self._thread.is_alive()

    # --- I/O thread -------------------------------------------------------------------------

    def _enqueue(self, item: tuple[str, object, bytes]) -> None:
        if self._stop.is_set():
            raise ProtocolError(f"messenger {self.name} is closed")
        self._outbox.append(item)
        if threading.get_ident() != self._thread.ident:
            self._wake()  # the I/O thread itself flushes the outbox at the end of its turn: no wake-up needed

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_closed:
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already pending

    def _server_key_for(self, endpoint: str) -> bytes | None:
        if self._auth is None:
            return None
        with self._keys_lock:
            return self._peer_keys.get(endpoint, self._auth.server_key)

    def _dealer(self, endpoint: str) -> _Dealer:
        key = self._server_key_for(endpoint)
        d = self._dealers.get(endpoint)
        if d is not None and d.server_key != key:
            self._drop_dealer(d, "its server key changed")
            d = None
        if d is None:
            if len(self._dealers) >= self._max_dealers:
                self._evict_one()
            sock = self._ctx.socket(zmq.DEALER)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, self._max)
                sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat_ms * 3)
                sock.setsockopt(zmq.HANDSHAKE_IVL, 10_000)
                if self._auth is not None and key is not None:
                    sock.setsockopt(zmq.CURVE_SERVERKEY, key)
                    sock.setsockopt(zmq.CURVE_PUBLICKEY, self._auth.public_key)
                    sock.setsockopt(zmq.CURVE_SECRETKEY, self._auth.secret_key)
                if endpoint.startswith("tcp://["):
                    sock.setsockopt(zmq.IPV6, 1)
                mon = sock.get_monitor_socket(
                    zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
                )
            except BaseException:
                sock.close(0)
                raise
            sock.connect(endpoint)
            d = _Dealer(endpoint, sock, mon, key, retries=self._handshake_retries.pop(endpoint, 0))
            self._dealers[endpoint] = d
            self._by_sock[sock] = d
            self._by_monitor[mon] = d
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(mon, zmq.POLLIN)
        d.last_used = time.monotonic()
        return d

    def _evict_one(self) -> None:
        """Make room for one DEALER: the least recently used that never authenticated/connected, else the LRU."""
        idle = [d for d in self._dealers.values() if not (d.authenticated or (self._auth is None and d.connected))]
        victim = min(idle or self._dealers.values(), key=lambda d: d.last_used)
        self.counters["peer_sockets_evicted"] += 1
        self._drop_dealer(victim, f"the bound of {self._max_dealers} peer sockets was reached")

    def _drop_dealer(self, d: _Dealer, why: str) -> None:
        """Close one DEALER and its monitor (queued messages to it are dropped)."""
        self._dealers.pop(d.endpoint, None)
        self._by_sock.pop(d.sock, None)
        self._by_monitor.pop(d.monitor, None)
        for s in (d.sock, d.monitor):
            try:
                self._poller.unregister(s)
            except KeyError:
                pass
        try:
            d.sock.disable_monitor()  # see _close_sockets: stop the monitor before closing its PAIR end
        except zmq.ZMQError:
            pass
        d.monitor.close(0)
        d.sock.close(0)
        self._rlog(logging.INFO, "drop", "messenger %s: closed the socket to %s: %s", self.name, d.endpoint, why)

    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        if self._zap is not None:
            self._poller.register(self._zap, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception:
                # Nothing may stop this thread: count, log (rate-limited) and go on serving.
                self.counters["io_errors"] += 1
                self._rlog(logging.ERROR, "io", "messenger %s: I/O loop error (kept serving)", self.name, exc_info=True)
                time.sleep(0.001)  # never spin hot on a persistent failure
        try:
            self._flush_outbox()  # answers queued by the last turns (a final result) still go out
        except Exception:
            self.counters["io_errors"] += 1
        self._cpu_at_exit = time.thread_time()

    def _turn(self) -> None:
        wait_s = self._next_wait_s
        # zmq_poll counts whole milliseconds: a shorter wait (the driver polling transfers every 0.5 ms) is a
        # look at the sockets and a sleep, so traffic waits at most that long and the loop never spins hot.
        timeout_ms = 0 if wait_s < 0.001 else int(wait_s * 1000)
        polled_at = time.monotonic()
        try:
            events = dict(self._poller.poll(timeout_ms))
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM:  # pragma: no cover - the context is gone
                self._stop.set()
                return
            raise
        due = 0.0
        if not events:
            if 0 < wait_s < 0.001:
                time.sleep(wait_s)
                due = polled_at + wait_s
            elif timeout_ms:
                due = polled_at + timeout_ms / 1000
        woke, cpu0 = time.monotonic(), time.thread_time()
        if due:
            _observe(self._lag, max(0.0, woke - due))
        try:
            self._serve(events)
        finally:
            self._stall_s += max(0.0, (time.monotonic() - woke) - (time.thread_time() - cpu0))

    def _serve(self, events: dict[zmq.Socket[bytes], int]) -> None:
        """The rest of a loop turn, after the poll: wake-ups, sockets, the driver, the outbox, the turn's end."""
        if self._wake_rx in events:
            for _ in range(10_000):  # bounded; the wake-ups carry nothing, they only end the poll
                try:
                    self._wake_rx.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if not _readable(self._wake_rx):
                    break
        if self._zap is not None and self._zap in events:
            self._guarded("zap", self._drain_zap)
        self._flush_outbox()
        if self._router in events:
            self._guarded("router", self._drain_router)
        for sock in list(events):
            mon = self._by_monitor.get(sock)
            if mon is not None:
                self._guarded("monitor", self._drain_monitor, mon)
                continue
            d = self._by_sock.get(sock)
            if d is not None:
                self._guarded("dealer", self._drain_dealer, d)
        if self._driver is None:
            self._next_wait_s = _IDLE_POLL_S
        else:
            self._flush_outbox()  # answers the handlers wrote go out before the driver's work
            self._next_wait_s = _IDLE_POLL_S
            try:
                self._next_wait_s = self._driver()
            except Exception:
                self.counters["driver_errors"] += 1
                self._rlog(
                    logging.ERROR, "driver", "messenger %s: driver error (kept serving)", self.name, exc_info=True
                )
        self._flush_outbox()  # what this turn's handlers and driver sent, without a wake-up
        if self._outbox:
            self._next_wait_s = min(self._next_wait_s, 0.001)  # a full queue: try again soon, without spinning
        if self._turn_end is not None:
            try:
                self._turn_end()
            except Exception:
                self.counters["driver_errors"] += 1
                self._rlog(logging.ERROR, "turn-end", "messenger %s: turn-end error", self.name, exc_info=True)

    def _guarded(self, what: str, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            self.counters[f"{what}_errors"] += 1
            self._rlog(logging.ERROR, what, "messenger %s: %s error (kept serving)", self.name, what, exc_info=True)

    def _flush_outbox(self) -> None:
        """Write queued messages; one that meets a full queue (HWM) waits for a later turn, in order per peer.

        A burst (a thousand results written in one loop turn) can fill a socket's queue before ZeroMQ's own
        I/O thread drains it: those messages are kept, with everything after them to the same peer, and sent
        when the queue has room. A peer whose queue stays full for ``_SEND_GIVE_UP_S`` is not reading (it is
        gone or stuck): its messages are then dropped and counted, as any failed send.
        """
        if not self._outbox:
            return
        blocked: set[tuple[bool, object]] = set()
        deferred: list[tuple[str, object, bytes]] = []
        backlog: dict[tuple[bool, object], tuple[int, int]] = {}  # per blocked peer: messages, bytes kept
        now = time.monotonic()
        while self._outbox:
            item = self._outbox.popleft()
            kind, dest, frame = item
            key = (kind == "router", dest)
            if key in blocked:
                n, size = backlog[key]
                if n >= _MAX_DEFERRED_PER_PEER or size + len(frame) > _MAX_DEFERRED_BYTES_PER_PEER:
                    self.counters["send_failed"] += 1
                    self.counters["send_dropped_backlog"] += 1
                    self._rlog(logging.WARNING, "backlog", "messenger %s: %r reads nothing; dropping", self.name, dest)
                    continue
                backlog[key] = (n + 1, size + len(frame))
                deferred.append(item)  # keeps this peer's order behind the message that waits
                continue
            try:
                if kind == "router":
                    self._router.send_multipart([dest, frame], zmq.NOBLOCK)  # type: ignore[list-item]
                elif kind == "drop":
                    d = self._dealers.get(str(dest))
                    if d is not None:
                        self._drop_dealer(d, "the peer is gone")
                    continue
                else:
                    d = self._dealer(str(dest))
                    d.sock.send(frame, zmq.NOBLOCK)
                    if not d.authenticated and len(d.unconfirmed) < _MAX_UNCONFIRMED:
                        if d.unconfirmed_bytes + len(frame) <= _MAX_UNCONFIRMED_BYTES:
                            d.unconfirmed.append(frame)
                            d.unconfirmed_bytes += len(frame)
                self.counters["sent"] += 1
                self._full_since.pop(key, None)
            except zmq.Again as exc:
                since = self._full_since.setdefault(key, now)
                if now - since < _SEND_GIVE_UP_S:
                    self.counters["send_deferred"] += 1
                    blocked.add(key)
                    backlog[key] = (1, len(frame))
                    deferred.append(item)
                    continue
                self.counters["send_failed"] += 1
                self._rlog(logging.WARNING, "send", "messenger %s: could not send to %r: %s", self.name, dest, exc)
            except zmq.ZMQError as exc:
                self.counters["send_failed"] += 1
                self._rlog(logging.WARNING, "send", "messenger %s: could not send to %r: %s", self.name, dest, exc)
            except Exception:
                self.counters["send_failed"] += 1
                self._rlog(logging.ERROR, "send-bug", "messenger %s: send to %r failed", self.name, dest, exc_info=True)
        if deferred:
            self._outbox.extendleft(reversed(deferred))  # ahead of whatever other threads queued meanwhile
        if len(self._full_since) > 4 * self._max_dealers:
            self._full_since.clear()  # bounded: a peer that was full long ago starts afresh

    def _drain_zap(self) -> None:
        """Answer ZAP requests (RFC 27): admit CURVE clients whose public key is allow-listed, refuse the rest."""
        assert self._zap is not None and self._auth is not None
        for _ in range(1000):  # bounded per turn: other sockets get their share under a flood
            try:
                parts = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) < 6:  # not a ZAP request; a REP socket must still answer something
                self._zap.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
                continue
            version, request_id, domain, address, _identity, mechanism = parts[:6]
            credentials = parts[6:]
            ok = (
                version == b"1.0"
                and domain == _ZAP_DOMAIN
                and mechanism == b"CURVE"
                and len(credentials) == 1
                and self._auth.allows(credentials[0])
            )
            if ok:
                user = z85_key(credentials[0])
                self.counters["auth_accepted"] += 1
                self._zap.send_multipart([b"1.0", request_id, b"200", b"OK", user, b""])
            else:
                self.counters["auth_denied"] += 1
                self._rlog(
                    logging.WARNING,
                    "zap",
                    "messenger %s: refused a %s connection from %s (client key not on the allow-list)",
                    self.name,
                    mechanism.decode("ascii", "replace")[:16],
                    address.decode("ascii", "replace")[:64],
                )
                self._zap.send_multipart([b"1.0", request_id, b"400", b"client key not allowed", b"", b""])

    def _drain_router(self) -> None:
        if self._auth is not None:
            self._drain_router_authenticated()
            return
        for _ in range(10_000):
            try:
                raw = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(raw) != 2:
                self._bad_multipart(len(raw))
                continue
            self._dispatch(Source(identity=raw[0]), raw[1])
            if not _readable(self._router):
                return  # drained: no zmq.Again raised (and built) per message

    def _drain_router_authenticated(self) -> None:
        # Frames (copy=False) carry the "User-Id" ZAP set: the client key the handshake proved.
        for _ in range(10_000):
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(parts) != 2:
                self._bad_multipart(len(parts))
                continue
            user = parts[1].get("User-Id")
            key = user.encode() if isinstance(user, str) and user else None
            self._dispatch(Source(identity=parts[0].bytes, peer_key=key), parts[1].bytes)
            if not _readable(self._router):
                return

    def _bad_multipart(self, parts: int) -> None:
        self.counters["bad_frames"] += 1
        self._rlog(
            logging.WARNING,
            "frames",
            "messenger %s: dropped a message with %d frames (expected 1)",
            self.name,
            parts - 1,
        )

    def _drain_dealer(self, d: _Dealer) -> None:
        for _ in range(10_000):
            try:
                frame = d.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(Source(endpoint=d.endpoint, peer_key=d.server_key), frame)
            if d.sock.closed or not _readable(d.sock):
                return  # drained (or a handler dropped this socket)

    def _drain_monitor(self, d: _Dealer) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while d.endpoint in self._dealers and self._dealers[d.endpoint] is d:
            try:
                evt = recv_monitor_message(d.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event = evt["event"]
            if event == zmq.EVENT_CONNECTED:
                d.connected = True
                if self._on_connect is not None:
                    self._on_connect(d.endpoint)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                d.authenticated = True
                d.unconfirmed.clear()
                d.unconfirmed_bytes = 0
            elif event & _HANDSHAKE_FAILED and self._auth is None:
                # No CURVE here: a failed ZMTP handshake is no authentication verdict (a peer too starved of CPU
                # to answer its greeting in time, a connection reset mid-handshake). ZeroMQ does not reconnect
                # such a socket: a fresh one is made and what was written before the handshake (never delivered)
                # is sent again on it, a bounded number of times; then the peer's lifecycle decides.
                self.counters["handshakes_failed"] += 1
                frames, retries = list(d.unconfirmed), d.retries + 1
                self._drop_dealer(d, "its ZMTP handshake failed")
                if retries <= _HANDSHAKE_RETRIES:
                    self._rlog(logging.WARNING, "handshake", "messenger %s: ZMTP handshake with %s failed (event "
                               "%d: %s); reconnecting (%d of %d), %d messages sent again", self.name, d.endpoint,
                               int(event), _NOT_KVCORE, retries, _HANDSHAKE_RETRIES, len(frames))  # fmt: skip
                    self._handshake_retries[d.endpoint] = retries
                    if len(self._handshake_retries) > 4 * self._max_dealers:
                        self._handshake_retries.clear()
                    self._outbox.extendleft(reversed([("dealer", d.endpoint, f) for f in frames]))
                    if not frames:
                        self._dealer(d.endpoint)
                else:
                    self.counters["send_failed"] += len(frames)
                    self._rlog(logging.WARNING, "handshake", "messenger %s: ZMTP handshake with %s failed %d times "
                               "(%s; no CURVE is configured here, so this is no authentication failure); %d messages "
                               "dropped", self.name, d.endpoint, retries, _NOT_KVCORE, len(frames))  # fmt: skip
                    if d.connected and self._on_disconnect is not None:
                        self._on_disconnect(d.endpoint)
                return
            elif event & _HANDSHAKE_FAILED or (
                event == zmq.EVENT_DISCONNECTED and self._auth is not None and not d.authenticated
            ):
                # The peer did not prove the expected server key, or refused ours: no socket is kept for it.
                self.counters["peer_auth_failed"] += 1
                # libzmq cannot tell a peer that speaks no ZMTP at all (any other TCP service) from one that fails
                # the CURVE exchange: each reason says both, the likelier first.
                reasons: dict[int, str] = {
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the peer refused our key (its allow-list lacks our CURVE key)",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: (
                        "handshake protocol error: the peer speaks ZMTP without CURVE, or not kvcore's protocol"
                    ),
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: (
                        f"handshake failed: {_NOT_KVCORE}, or it does not prove the CURVE server key expected"
                    ),
                }
                reason = reasons.get(
                    int(event),
                    f"disconnected before the handshake completed: {_NOT_KVCORE}, or it serves another CURVE key "
                    "than the one expected, or refused ours",
                )
                self._rlog(
                    logging.WARNING,
                    "peer-auth",
                    "messenger %s: authentication with %s failed: %s",
                    self.name,
                    d.endpoint,
                    reason,
                )
                self._drop_dealer(d, reason)
                if self._on_auth_failed is not None:
                    self._on_auth_failed(d.endpoint, reason)
                return
            elif event == zmq.EVENT_DISCONNECTED and d.connected:
                d.connected = d.authenticated = False
                log.info("messenger %s: peer %s disconnected", self.name, d.endpoint)
                if self._on_disconnect is not None:
                    self._on_disconnect(d.endpoint)

    def _dispatch(self, source: Source, frame: bytes) -> None:
        self.counters["received"] += 1
        try:
            msg = wire.decode(frame, self._max)
        except KvcoreError as exc:
            self.counters["bad_frames"] += 1
            self._rlog(
                logging.WARNING,
                "decode",
                "messenger %s: rejected a frame from %s: %s",
                self.name,
                source.endpoint or "a peer",
                exc,
            )
            if source.identity is not None:
                err = wire.ErrorReply(v=wire.PROTOCOL_VERSION, kind=type(exc).__name__, error=str(exc)[:4096])
                try:
                    self._router.send_multipart([source.identity, wire.encode(err)], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            if self._on_error is not None:
                try:
                    self._on_error(source, exc)
                except Exception:
                    self.counters["handler_errors"] += 1
                    self._rlog(
                        logging.ERROR, "on_error", "messenger %s: error handler failed", self.name, exc_info=True
                    )
            return
        try:
            self._handler(source, msg)
        except Exception:
            self.counters["handler_errors"] += 1
            self._rlog(
                logging.ERROR,
                "handler",
                "messenger %s: handler failed on %s",
                self.name,
                type(msg).__name__,
                exc_info=True,
            )

    def _close_sockets(self) -> None:
        # Stop every monitor while its PAIR end is still open, and only then close that end. libzmq emits
        # monitor events with a blocking send under the monitored socket's monitor lock: an event raised after
        # our PAIR end closed (a peer disconnecting while both sides shut down) blocks that send for good, and
        # disable_monitor() then waits on the lock forever (seen as a ~1-in-12 hang in Transceiver.close).
        for d in self._dealers.values():
            try:
                d.sock.disable_monitor()
            except zmq.ZMQError:
                pass
        for d in self._dealers.values():
            d.monitor.close(0)
        # Messages already written to a socket (the final result of a request whose engine closes the transceiver
        # as soon as it is released) may still be in ZeroMQ's queue: they get a bounded linger to leave.
        for d in self._dealers.values():
            d.sock.close(_CLOSE_LINGER_MS)
        self._dealers.clear()
        self._by_sock.clear()
        self._by_monitor.clear()
        self._router.close(_CLOSE_LINGER_MS)
        self._wake_rx.close(0)
        with self._wake_lock:  # another thread may be waking us right now: it sees the flag, not a closed socket
            self._wake_closed = True
            self._wake_tx.close(0)
        if self._zap is not None:
            self._zap.close(0)
        if self._own_ctx:
            self._ctx.term()  # every socket of it is closed: returns once queued messages left, within the linger
