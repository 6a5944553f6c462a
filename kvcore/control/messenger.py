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

The messenger is built in layers, one module each, every one over the state declared in ``messenger_state``:
``peer_sockets`` (the DEALERs and their monitors) -> ``outbox`` (queued sends) -> ``inbound`` (ZAP, the ROUTER,
decoding and dispatch) -> ``ioloop`` (the loop turn and the driver) -> this module (construction, the thread-safe
API, close). ``endpoints`` binds the ROUTER; ``ratelimit`` holds :class:`RateLimitedLog`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable

import zmq

from kvcore.control import wire
from kvcore.control.auth import AuthConfig, z85_key
from kvcore.control.endpoints import bind_router
from kvcore.control.inbound import _ZAP_DOMAIN
from kvcore.control.ioloop import _IDLE_POLL_S, IoLoop
from kvcore.control.messenger_state import (
    AuthFailedHandler,
    ConnectHandler,
    DisconnectHandler,
    Driver,
    ErrorHandler,
    Handler,
    Source,
    _readable,
)
from kvcore.control.peer_sockets import DEFAULT_MAX_PEER_SOCKETS as DEFAULT_MAX_PEER_SOCKETS
from kvcore.control.peer_sockets import FDS_PER_PEER_SOCKET, peer_socket_budget
from kvcore.control.ratelimit import RateLimitedLog
from kvcore.errors import ConfigError, ProtocolError
from kvcore.hostinfo import is_loopback_host
from kvcore.metrics.snapshot import Histogram, _cell_histogram, _hist_cell

__all__ = ["Messenger", "Source", "RateLimitedLog", "peer_socket_budget", "FDS_PER_PEER_SOCKET"]

_WAKE_IDS = itertools.count()
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: one handler per context

log = logging.getLogger("kvcore.control.messenger")

#: How long (ms) messages already queued on a socket may still take to leave after ``close`` (a peer that is gone
#: costs at most this; with a context of our own, ``close`` waits that long for it).
_CLOSE_LINGER_MS = 250


class Messenger(IoLoop):
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
        self._ctx = zmq.Context() if self._own_ctx else zmq.Context.instance()
        self._zap = None
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
        self._peer_keys = {}  # endpoint -> Z85 server key (set_peer_key)
        self._outbox = collections.deque()
        self._dealers = {}
        self._handshake_retries = {}  # endpoint -> fresh sockets made after failed handshakes
        self._by_sock = {}
        self._by_monitor = {}
        self._stop = threading.Event()
        self._driver = None
        self._turn_end = None
        self._next_wait_s = _IDLE_POLL_S
        self._full_since = {}  # (router?, dest) -> when its queue was first full
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
