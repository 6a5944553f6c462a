"""The messenger's I/O loop: one turn polls every socket, serves what is ready, runs the driver, writes the outbox.

A *driver* (``Messenger.set_driver``) runs once per turn, after the sockets were served, and says how long the
next poll may wait. The loop also measures how long the thread waited to run (``Messenger.io_timing``): the stall
inside its turns and how late its timed sleeps ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from kvcore.control.inbound import Inbound
from kvcore.control.messenger_state import _readable
from kvcore.metrics.snapshot import _observe

#: Poll period of a messenger without a driver (seconds): only ``close`` needs the loop to come round.
_IDLE_POLL_S = 0.1


class IoLoop(Inbound):
    """The I/O thread's loop (``_run``) and one turn of it; nothing in it may stop the thread."""

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
