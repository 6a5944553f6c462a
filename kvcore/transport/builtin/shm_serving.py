"""The owner side of the shm agent: the serving thread that hands its memfds to loaded peers and takes notifications.

One thread per agent polls the fd socket (accepting connections, at most ``_MAX_SERVER_CONNECTIONS``), the
connections (one fd request each, answered under the **capability rule**: only to a process whose agent this
agent loaded and exposed, under the name and incarnation the request states, with the pid the kernel reports) and
the notification socket (a datagram is delivered only when its sender names an agent loaded here with the pid the
kernel attached). :class:`ShmServing` is a base of :class:`~kvcore.transport.builtin.shm.ShmAgent`; the agent's
constructor creates the sockets and the state declared here.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections import deque

import msgspec

from kvcore.errors import RemoteAgentError
from kvcore.msgbounds import check_msgpack_bounds
from kvcore.transport.agent import Notification, TransferAgent, process_incarnation
from kvcore.transport.builtin.shm_memory import _Segment
from kvcore.transport.builtin.shm_peer import _Peer
from kvcore.transport.builtin.shm_protocol import (
    _FDS_PER_MESSAGE,
    _MAX_NOTIFICATION_BYTES,
    _MAX_REQUEST_BYTES,
    _MAX_SERVER_CONNECTIONS,
    _UCRED,
    _encoder,
    _FdReply,
    _notif_decoder,
    _peer_pid,
    _request_decoder,
    _SegmentInfo,
)

log = logging.getLogger("kvcore.shm")


class ShmServing(TransferAgent):
    """The shm agent's serving thread: fd requests (the capability rule) and incoming notifications."""

    # Set by ShmAgent.__init__; the serving thread reads them.
    refused: int  # fd requests and notifications refused (read by tests and operators)
    _listener: socket.socket  # the abstract SOCK_SEQPACKET socket serving the memfds
    _conns: dict[socket.socket, bool]  # accepted -> served once; touched by the serving thread only
    _rx: socket.socket  # the abstract datagram socket receiving notifications
    _wake_r: socket.socket  # written by close() to end the thread's wait
    _stop: threading.Event
    _lock: threading.Lock  # the notification socket and queue
    _notifications: deque[Notification]
    _seg_lock: threading.Lock  # _segments
    _segments: dict[int, _Segment]
    _ctl_fd: int  # the control block's memfd, passed first

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # BlockingIOError: none pending; anything else: closing
                return
            if len(self._conns) >= _MAX_SERVER_CONNECTIONS:
                # Make room by dropping the oldest connection that was never served (a stranger can open many,
                # but only loaded agents get served); when every one was served, refuse the newcomer.
                idle = next((c for c, served in self._conns.items() if not served), None)
                if idle is None:
                    self.refused += 1
                    conn.close()
                    continue
                self._drop_conn(idle)
            conn.setblocking(False)
            self._conns[conn] = False

    def _serve(self, conn: socket.socket) -> None:
        """Answer one fd request on ``conn``; a refused or broken connection is closed."""
        try:
            data = conn.recv(_MAX_REQUEST_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop_conn(conn)
            return
        try:
            pid = _peer_pid(conn)
            error = self._refusal(data, pid)
        except Exception as exc:  # nothing a client sends may stop this thread
            error = f"malformed request: {type(exc).__name__}"
        try:
            if error:
                self.refused += 1
                log.warning("kvcore shm agent %r refused its memory to pid %s: %s", self.name, pid, error)
                conn.send(_encoder.encode(_FdReply(False, error, self.name, process_incarnation(), [])))
                self._drop_conn(conn)
                return
            with self._seg_lock:
                segs = [s for s in self._segments.values() if s.exports > 0 and s.fd >= 0]
                fds = [self._ctl_fd] + [s.fd for s in segs]
                head = _encoder.encode(
                    _FdReply(
                        True, "", self.name, process_incarnation(), [_SegmentInfo(s.id, s.base, s.size) for s in segs]
                    )
                )
                socket.send_fds(conn, [head], fds[:_FDS_PER_MESSAGE])
                for i in range(_FDS_PER_MESSAGE, len(fds), _FDS_PER_MESSAGE):
                    socket.send_fds(conn, [b"+"], fds[i : i + _FDS_PER_MESSAGE])
            self._conns[conn] = True
        except OSError:
            self._drop_conn(conn)

    def _refusal(self, data: bytes, pid: int) -> str:
        """Why the process ``pid`` may not have our memory ('' when it may): the capability rule."""
        check_msgpack_bounds(data, error=RemoteAgentError)
        req = _request_decoder.decode(data)
        if (req.server, req.server_incarnation) != (self.name, process_incarnation()):
            return f"this is agent {self.name!r}, not {req.server!r} (incarnation {req.server_incarnation[:8]})"
        remote = self._remotes.get(req.client)
        peer = remote.native if remote is not None else None
        if not isinstance(peer, _Peer) or peer.incarnation != req.incarnation:
            return f"agent {req.client!r} (incarnation {req.incarnation[:8]}) is not loaded here"
        if peer.pid != pid:
            return f"agent {req.client!r} is loaded with pid {peer.pid}; the request comes from pid {pid}"
        if not self.exposed_to(req.client):
            return f"agent {req.client!r} is loaded here but not given access to this agent's memory"
        return ""

    def _drop_conn(self, conn: socket.socket) -> None:
        self._conns.pop(conn, None)
        conn.close()

    def _serve_loop(self) -> None:
        fixed = (self._rx.fileno(), self._wake_r.fileno(), self._listener.fileno())
        while not self._stop.is_set():
            try:
                # poll, not select: the fd numbers of up to 1024 connections may exceed FD_SETSIZE.
                poller = select.poll()
                conns = {c.fileno(): c for c in self._conns}
                for fd in (*fixed, *conns):
                    poller.register(fd, select.POLLIN)
                ready = {fd for fd, _ in poller.poll(1000)}
                if fixed[0] in ready:
                    self._drain_socket()
                if fixed[2] in ready:
                    self._accept()
                for fd in ready & conns.keys():
                    self._serve(conns[fd])
            except Exception:  # pragma: no cover - nothing may stop this thread
                if not self._stop.is_set():
                    log.exception("kvcore shm agent %r: serving thread error (kept serving)", self.name)

    def _drain_socket(self) -> None:
        # Under the lock, so the thread and get_notifications() never reorder datagrams between them.
        with self._lock:
            while True:
                try:
                    data, anc, _, _ = self._rx.recvmsg(_MAX_NOTIFICATION_BYTES + 1, socket.CMSG_SPACE(_UCRED.size))
                except OSError:  # BlockingIOError: drained; anything else: closing
                    return
                pid = next(
                    (
                        _UCRED.unpack(d[: _UCRED.size])[0]
                        for lvl, typ, d in anc
                        if lvl == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS and len(d) >= _UCRED.size
                    ),
                    0,
                )
                try:
                    check_msgpack_bounds(data, error=RemoteAgentError)
                    sender, message = _notif_decoder.decode(data)
                except (msgspec.DecodeError, RemoteAgentError) as exc:
                    log.warning(
                        "kvcore shm agent %r dropped a malformed notification (%d bytes): %s", self.name, len(data), exc
                    )
                    continue
                remote = self._remotes.get(sender)
                peer = remote.native if remote is not None else None
                if not isinstance(peer, _Peer) or peer.pid != pid:
                    self.refused += 1
                    log.warning(
                        "kvcore shm agent %r dropped a notification naming %r from pid %d: no such agent loaded here "
                        "with that pid",
                        self.name,
                        sender[:64],
                        pid,
                    )
                    continue
                self._notifications.append(Notification(sender, message))

    def _get_notifications(self) -> list[Notification]:
        self._drain_socket()  # do not wait for the thread's next wake-up
        with self._lock:
            out = list(self._notifications)
            self._notifications.clear()
        return out
