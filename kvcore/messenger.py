"""ZeroMQ control plane: one ROUTER socket for incoming traffic, one DEALER per peer for outgoing.

ZeroMQ sockets must stay on the thread that uses them, so one I/O thread owns
every socket of a messenger: it polls the ROUTER, the DEALERs and a wake-up
pipe, decodes frames and hands messages to the handler. Handlers only mutate
state and enqueue work; they never block on a transfer. Other threads send by
enqueueing (``send``/``reply`` are thread-safe).

A frame that fails to decode is answered with an ``ErrorReply`` naming the
problem and logged; the listener keeps serving everyone else.
"""

from __future__ import annotations

import collections
import ipaddress
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvcore import wire
from kvcore.errors import KvcoreError, ProtocolError

__all__ = ["Messenger", "Source"]

_WAKE_IDS = itertools.count()

log = logging.getLogger("kvcore.messenger")


@dataclass(frozen=True)
class Source:
    """Where a message came from: a peer's DEALER (``identity`` on our ROUTER) or our DEALER to ``endpoint``."""

    identity: bytes | None = None
    endpoint: str | None = None


Handler = Callable[[Source, wire.Message], None]
ErrorHandler = Callable[[Source, KvcoreError], None]
DisconnectHandler = Callable[[str], None]
ConnectHandler = Callable[[str], None]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Messenger:
    """The control-plane sockets of one rank. Bind loopback by default; other addresses log a warning."""

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = 16 * 1024 * 1024,
        on_error: ErrorHandler | None = None,
        on_disconnect: DisconnectHandler | None = None,
        on_connect: ConnectHandler | None = None,
        heartbeat_ms: int = 1000,
        name: str = "kvcore",
    ) -> None:
        self._handler = handler
        self._on_error = on_error
        self._on_disconnect = on_disconnect
        self._on_connect = on_connect
        self._max = max_message_bytes
        self._heartbeat_ms = heartbeat_ms
        self.name = name
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms * 3)
        if not _is_loopback(host):
            log.warning("kvcore control plane binding to non-loopback address %s: reachable from the network", host)
        bind_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        if ":" in host:
            self._router.setsockopt(zmq.IPV6, 1)
        if port:
            self._router.bind(f"tcp://{bind_host}:{port}")
        else:
            self._router.bind_to_random_port(f"tcp://{bind_host}")
        last = self._router.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = last.decode() if isinstance(last, bytes) else str(last)
        # Unique per messenger for the life of the process: id(self) is reused once a closed messenger is freed,
        # while libzmq unbinds a closed inproc endpoint asynchronously ("Address already in use").
        self._wake_addr = f"inproc://kvcore-wake-{next(_WAKE_IDS)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._outbox: collections.deque[tuple[str, object, bytes]] = collections.deque()
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-messenger", daemon=True)
        self.counters = collections.Counter[str]()

    # --- public, thread-safe ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def send(self, endpoint: str, msg: wire.Message) -> None:
        """Send ``msg`` to the ROUTER at ``endpoint`` (connecting a DEALER on first use)."""
        wire.parse_endpoint(endpoint)
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
        return len(self._dealers)

    # --- I/O thread -------------------------------------------------------------------------

    def _enqueue(self, item: tuple[str, object, bytes]) -> None:
        if self._stop.is_set():
            raise ProtocolError(f"messenger {self.name} is closed")
        self._outbox.append(item)
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already pending

    def _dealer(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max)
            sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat_ms * 3)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
            sock.connect(endpoint)
            self._dealers[endpoint] = sock
            self._monitors[mon] = endpoint
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(mon, zmq.POLLIN)
        return sock

    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        connected: set[str] = set()
        while not self._stop.is_set():
            try:
                events = dict(self._poller.poll(100))
            except zmq.ZMQError:  # pragma: no cover
                break
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            self._flush_outbox()
            if self._router in events:
                self._drain_router()
            for sock in list(events):
                if sock.closed:
                    continue  # dropped by this turn's outbox
                ep = self._monitors.get(sock)
                if ep is not None:
                    self._drain_monitor(sock, ep, connected)
                elif sock is not self._router and sock is not self._wake_rx:
                    self._drain_dealer(sock)

    def _flush_outbox(self) -> None:
        while self._outbox:
            kind, dest, frame = self._outbox.popleft()
            try:
                if kind == "router":
                    self._router.send_multipart([dest, frame], zmq.NOBLOCK)  # type: ignore[list-item]
                elif kind == "drop":
                    self._close_dealer(dest)  # type: ignore[arg-type]
                    continue
                else:
                    self._dealer(dest).send(frame, zmq.NOBLOCK)  # type: ignore[arg-type]
                self.counters["sent"] += 1
            except zmq.ZMQError as exc:
                self.counters["send_failed"] += 1
                log.warning("messenger %s: could not send to %r: %s", self.name, dest, exc)

    def _close_dealer(self, endpoint: str) -> None:
        sock = self._dealers.pop(endpoint, None)
        if sock is None:
            return
        mon = next((m for m, ep in self._monitors.items() if ep == endpoint), None)
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        for s in (mon, sock):
            if s is not None:
                try:
                    self._poller.unregister(s)
                except KeyError:
                    pass
                s.close(0)
        if mon is not None:
            self._monitors.pop(mon, None)

    def _drain_router(self) -> None:
        while True:
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2:
                self.counters["bad_frames"] += 1
                log.warning("messenger %s: dropped a message with %d frames (expected 1)", self.name, len(parts) - 1)
                continue
            self._dispatch(Source(identity=parts[0]), parts[1])

    def _drain_dealer(self, sock: zmq.Socket[bytes]) -> None:
        endpoint = next((ep for ep, s in self._dealers.items() if s is sock), None)
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(Source(endpoint=endpoint), frame)

    def _drain_monitor(self, mon: zmq.Socket[bytes], endpoint: str, connected: set[str]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                evt = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            if evt["event"] == zmq.EVENT_CONNECTED:
                connected.add(endpoint)
                if self._on_connect is not None:
                    try:
                        self._on_connect(endpoint)
                    except Exception:  # pragma: no cover
                        log.exception("connect handler failed")
            elif evt["event"] == zmq.EVENT_DISCONNECTED and endpoint in connected:
                connected.discard(endpoint)
                log.info("messenger %s: peer %s disconnected", self.name, endpoint)
                if self._on_disconnect is not None:
                    try:
                        self._on_disconnect(endpoint)
                    except Exception:  # pragma: no cover
                        log.exception("disconnect handler failed")

    def _dispatch(self, source: Source, frame: bytes) -> None:
        self.counters["received"] += 1
        try:
            msg = wire.decode(frame, self._max)
        except KvcoreError as exc:
            self.counters["bad_frames"] += 1
            log.warning("messenger %s: rejected a frame from %s: %s", self.name, source.endpoint or "a peer", exc)
            if source.identity is not None:
                err = wire.ErrorReply(v=wire.PROTOCOL_VERSION, kind=type(exc).__name__, error=str(exc))
                try:
                    self._router.send_multipart([source.identity, wire.encode(err)], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            if self._on_error is not None:
                self._on_error(source, exc)
            return
        try:
            self._handler(source, msg)
        except Exception:
            self.counters["handler_errors"] += 1
            log.exception("messenger %s: handler failed on %s", self.name, type(msg).__name__)

    def _close_sockets(self) -> None:
        # Stop every monitor while its PAIR end is still open, and only then close that end. libzmq emits
        # monitor events with a blocking send under the monitored socket's monitor lock: an event raised after
        # our PAIR end closed (a peer disconnecting while both sides shut down) blocks that send for good, and
        # disable_monitor() then waits on the lock forever (seen as a ~1-in-12 hang in Transceiver.close).
        for sock in self._dealers.values():
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in list(self._monitors):
            sock.close(0)
        for sock in self._dealers.values():
            sock.close(0)
        self._dealers.clear()
        self._monitors.clear()
        self._router.close(0)
        self._wake_rx.close(0)
        self._wake_tx.close(0)
