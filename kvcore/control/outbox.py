"""The messenger's outbox: messages any thread queues, written by the I/O thread in order per peer, bounded.

Other threads append and wake the I/O thread; the I/O thread writes the outbox at the end of each loop turn. A
message that meets a full socket queue waits for a later turn with everything after it to the same peer, for at
most ``_SEND_GIVE_UP_S`` and within ``_MAX_DEFERRED_PER_PEER`` messages and ``_MAX_DEFERRED_BYTES_PER_PEER``
bytes per peer.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from kvcore.control.peer_sockets import _MAX_UNCONFIRMED, _MAX_UNCONFIRMED_BYTES, PeerSockets
from kvcore.errors import ProtocolError

#: How long messages to a peer whose socket queue is full are kept for a retry before they are dropped (seconds).
_SEND_GIVE_UP_S = 5.0
#: Messages (and bytes) kept for one peer whose queue is full: a peer that sends but never reads (a stranger
#: flooding bad frames, each answered) cannot grow the outbox or the I/O thread's work per turn past these.
_MAX_DEFERRED_PER_PEER = 16384
_MAX_DEFERRED_BYTES_PER_PEER = 16 * 1024 * 1024


class Outbox(PeerSockets):
    """Queueing from any thread, waking the I/O thread, and writing the queue on it."""

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
