"""The messenger's sockets to its peers: one DEALER per endpoint, bounded in number, and what their monitors say.

A DEALER is made on the first send to an endpoint (with the CURVE keys where authentication is on), evicted when
the bound is reached (least recently used never-connected first) and dropped when its peer is gone. Its monitor
reports connects, disconnects and handshakes: a failed ZMTP handshake without CURVE is retried on a fresh socket a
bounded number of times; with CURVE, a failed handshake is an authentication failure.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from kvcore.control.messenger_state import MessengerState, _Dealer

log = logging.getLogger("kvcore.control.messenger")

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


def _room_for_a_socket() -> bool:
    """Whether one more DEALER fits under the soft RLIMIT_NOFILE with half of ``_RESERVED_FDS`` still left to the
    rest of the process, counting the descriptors open now (``/proc/self/fd``; True where it cannot be read)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return True
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return True
    return used + FDS_PER_PEER_SOCKET <= int(soft) - _RESERVED_FDS // 2


class PeerSockets(MessengerState):
    """Opening, evicting and dropping DEALERs, and reading their monitors (I/O thread only)."""

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
            if self.counters["peer_sockets_evicted"] and not _room_for_a_socket():
                # At the bound (a flood of endpoints): the sockets closed a moment ago keep their descriptors until
                # ZeroMQ's reaper thread gets to them. The message waits (as at a full queue) instead of this socket
                # taking descriptors the rest of the process needs.
                self.counters["peer_sockets_waited_for_fds"] += 1
                raise zmq.Again()
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
                        try:
                            self._dealer(d.endpoint)
                        except zmq.Again:
                            pass  # no descriptors to spare now: the next message to it makes the socket
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
