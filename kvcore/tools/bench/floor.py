"""Floors of the one-block request: a bare ZeroMQ round trip between the two rank processes, with no kvcore code,
and how much slower the same Python work runs right after its thread slept (``warmth``).

The context rank starts an echo thread (a ROUTER on loopback that sends every frame back, polled like the
messenger's I/O loop); the generation rank sends one frame of a RequestData's size through a DEALER and waits
for it with a poll, one at a time. A kvcore one-block request needs at least this round trip, plus the work on
both sides: the ``small`` case reports its overhead beside this floor, measured in the same run.

The *threaded* floor is the same round trip through the thread hand-offs a kvcore request makes, with no kvcore
work: the generation's engine thread queues the frame, wakes its I/O thread (an inproc PAIR, as the messenger's
wake-up) and sleeps on a condition (as ``Transceiver.wait``); the I/O thread sends, receives the echo and wakes
the engine thread. That is the least any control plane built as kvcore's is (an I/O thread per process that owns
the sockets, Python on every step) can cost per request.

Every step of a one-block request runs on a thread that was asleep a moment before (the engine in ``wait``, an
I/O loop in its poll). On a shared virtual machine such a thread often runs on a core whose caches another
tenant used meanwhile: the same code then takes several times longer than in a tight loop. ``op_warmth`` times
one fixed piece of kvcore's per-request work (planning a one-block request with the rank's real page table)
back to back, and again after sleeps of 0.2, 1 and 5 ms, so a run can tell how much of its fixed cost is this.

The *lean* floor is the threaded floor plus the least work a one-block request needs, in Python, with kvcore's
own messages and agent but none of its bookkeeping: the engine thread encodes a real ``RequestData``; the echo
decodes (and validates) it, writes the one-block plan with the bench's bare agent, polls the write to its end
and answers with a real ``TransferResult``, which the I/O thread decodes and checks before it wakes the engine.
Its latency and CPU per request say what a Python per-request path of kvcore's shape can reach on the box at hand:
what kvcore spends beyond it is its own bookkeeping, not the language or the threads.

The *native* floor is the threaded floor in C (``kvcore_native``, plugins/native): the same threads, wake-ups and
sockets with no Python on the hops. It is where a native per-request path would start from.
"""

from __future__ import annotations

import collections
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from kvcore.control import wire
from kvcore.tools.bench.bare import agent_once
from kvcore.tools.bench.spec import BenchError, BenchSpec, BenchTimeoutError, _pct

#: Bytes per ping: about a one-block RequestData.
PING_BYTES = 256


def _check_loopback(endpoint: str) -> None:
    """Pings go only to the echo this run started on loopback."""
    if not endpoint.startswith("tcp://127.0.0.1:"):
        raise BenchError(f"ping: the echo must be on loopback, got {endpoint!r}")


class _Echo:
    """A ROUTER on loopback, served by its own thread, that answers every frame with itself, or with ``work(frame)``.

    A ``work`` that raises stops the answers; ``close`` raises it.
    """

    def __init__(self, work: Callable[[bytes], bytes] | None = None) -> None:
        self.work = work
        self.error: Exception | None = None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4096)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-echo", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(50):
                continue
            for _ in range(1000):
                try:
                    parts = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(parts) != 2:
                    continue
                if self.work is not None:
                    try:
                        parts[1] = self.work(parts[1])
                    except Exception as exc:  # the pinging side times out; close() says why
                        self.error = exc
                        return
                self.sock.send_multipart(parts, zmq.NOBLOCK)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        if self.thread.is_alive():  # its work is still in a write (bounded by the spec's timeout)
            # never close a socket under a thread that may still use it (the rank process ends soon)
            raise BenchError("echo: the lean floor's work did not end within 5 s of the stop (a write still pending)")
        self.sock.close(0)
        if self.error is not None:
            raise BenchError(f"echo: the lean floor's work failed: {self.error!r}") from self.error


class _ThreadedPing:
    """The generation side of the threaded floor: an I/O thread that owns a DEALER, woken by an inproc PAIR.

    ``check`` (the lean floor) runs on the I/O thread on every answer before the engine thread is woken.
    """

    def __init__(self, endpoint: str, check: Callable[[bytes], None] | None = None) -> None:
        self.check = check
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        addr = f"inproc://kvcore-bench-ping-{id(self)}"
        self.wake_rx = ctx.socket(zmq.PAIR)
        self.wake_rx.bind(addr)
        self.wake_tx = ctx.socket(zmq.PAIR)
        self.wake_tx.connect(addr)
        self.wake_lock = threading.Lock()
        self.outbox: collections.deque[bytes] = collections.deque()
        self.news = threading.Condition()
        self.echoes = 0
        self.error: Exception | None = None
        self.frame = bytes(PING_BYTES)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-ping-io", daemon=True)
        self.thread.start()

    def send(self, frame: bytes | None = None) -> None:
        """Engine thread: queue one frame and wake the I/O thread (as ``Messenger.send`` does)."""
        self.outbox.append(self.frame if frame is None else frame)
        with self.wake_lock:
            try:
                self.wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already pending

    def wait_for(self, echoes: int, timeout_s: float) -> bool:
        """Engine thread: sleep on the condition until ``echoes`` came back (as ``Transceiver.wait`` does)."""
        deadline = time.monotonic() + timeout_s
        with self.news:
            while self.echoes < echoes:
                if self.error is not None:
                    raise BenchError(f"ping: the threaded floor's I/O thread failed: {self.error!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.news.wait(min(left, 0.05))
        return True

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # the engine thread raises it instead of waiting for its deadline
            with self.news:
                self.error = exc
                self.news.notify_all()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wake_rx, zmq.POLLIN)
        while not self.stop.is_set():
            events = dict(poller.poll(1 if self.outbox else 20))  # a frame kept back: try again soon
            if self.wake_rx in events:
                for _ in range(1000):
                    try:
                        self.wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            while self.outbox:
                try:
                    self.sock.send(self.outbox[0], zmq.NOBLOCK)
                except zmq.Again:
                    break  # the queue is full (or not yet connected): it goes on a later turn
                self.outbox.popleft()
            if self.sock in events:
                got = 0
                for _ in range(1000):
                    try:
                        answer = self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if self.check is not None:
                        self.check(answer)
                    got += 1
                if got:
                    with self.news:
                        self.echoes += got
                        self.news.notify_all()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        if self.thread.is_alive():  # pragma: no cover - its poll waits 20 ms at most
            return  # never close sockets under a thread that may still use them (the rank process ends soon)
        for sock in (self.sock, self.wake_rx, self.wake_tx):
            sock.close(0)


class _FloorModes:
    """Rank commands of the floor measurement (a mixin of :class:`kvcore.tools.bench.rank._Rank`)."""

    _echo: _Echo | None = None
    _native_echo: Any = None
    backend: str
    spec: BenchSpec
    bare: dict[str, Any]

    def op_echo_start(self, lean: bool = False) -> dict[str, Any]:
        """Context: start the echo thread; returns the endpoint to ping.

        ``lean``: the lean floor's echo, which writes the prepared ``agent`` mode's plan for every RequestData.
        """
        self.op_echo_stop()
        self._echo = _Echo(self._lean_work() if lean else None)
        return {"endpoint": self._echo.endpoint}

    def _lean_work(self) -> Callable[[bytes], bytes]:
        st = self.bare.get("agent")
        if st is None:
            raise BenchError("echo: the lean floor needs the 'agent' mode prepared first")
        backend, timeout_s = self.backend, self.spec.timeout_s
        plan = st["plan"]

        def work(frame: bytes) -> bytes:
            msg = wire.decode(frame)
            if not isinstance(msg, wire.RequestData):
                raise BenchError(f"echo: expected a RequestData, got {type(msg).__name__}")
            agent_once(st, backend, timeout_s)
            return wire.encode(
                wire.TransferResult(
                    v=wire.PROTOCOL_VERSION,
                    request_id=msg.request_id,
                    ctx_rank=0,
                    ctx_incarnation="lean",
                    status="ok",
                    nbytes=int(plan.nbytes),
                    fragments=int(plan.count),
                    nonce=msg.nonce,
                )
            )

        return work

    def op_echo_stop(self) -> dict[str, Any]:
        echo, self._echo = self._echo, None
        if echo is not None:
            echo.close()
        return {}

    def op_native_echo_start(self) -> dict[str, Any]:
        """Context: start the native floor's echo; ``{"endpoint": None, "missing": why}`` where kvcore-native is not
        installed or cannot start (the rest of the case is measured all the same)."""
        self.op_native_echo_stop()
        native, why = _native()
        if native is None:
            return {"endpoint": None, "missing": why}
        try:
            echo, endpoint = native.echo_start()
        except native.NativeFloorError as exc:
            return {"endpoint": None, "missing": f"kvcore-native could not start its echo: {exc}"}
        self._native_echo = (native, echo)
        return {"endpoint": endpoint}

    def op_native_echo_stop(self) -> dict[str, Any]:
        held, self._native_echo = self._native_echo, None
        if held is not None:
            native, echo = held
            native.echo_stop(echo)
        return {}

    def op_ping_native(self, endpoint: str, n: int, timeout_s: float) -> dict[str, Any]:
        """Generation: ``n`` round trips to the native echo through a C I/O thread, one at a time; seconds each."""
        _check_loopback(endpoint)
        native, why = _native()
        if native is None:
            raise BenchError(f"ping: the native floor cannot run: {why}")
        try:
            return {"seconds": native.ping_threaded(endpoint, n, timeout_s)}
        except TimeoutError as exc:
            raise BenchTimeoutError(f"ping: {exc}") from exc

    def op_ping(self, endpoint: str, n: int, timeout_s: float) -> dict[str, Any]:
        """Generation: ``n`` round trips to the echo, one at a time; seconds each."""
        _check_loopback(endpoint)
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        frame = bytes(PING_BYTES)
        seconds: list[float] = []
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                sock.send(frame)
                if not poller.poll(int(timeout_s * 1000)):
                    raise BenchTimeoutError(f"ping: no echo from {endpoint} within {timeout_s}s")
                sock.recv()
                seconds.append(time.perf_counter() - t0)
        finally:
            sock.close(0)
        return {"seconds": seconds}

    def op_ping_threaded(self, endpoint: str, n: int, timeout_s: float, lean: bool = False) -> dict[str, Any]:
        """Generation: ``n`` round trips to the echo through an I/O thread, one at a time; seconds each.

        The calling thread plays the engine: it queues the frame, wakes the I/O thread and waits on a condition.
        ``lean``: every frame is a fresh RequestData (encoded by the engine thread) and every answer must decode
        to a ``TransferResult`` with status ``ok`` and the request's nonce.
        """
        _check_loopback(endpoint)
        io = _ThreadedPing(endpoint, _lean_check if lean else None)
        seconds: list[float] = []
        try:
            for i in range(n):
                t0 = time.perf_counter()
                io.send(_lean_request(i) if lean else None)
                if not io.wait_for(i + 1, timeout_s):
                    raise BenchTimeoutError(f"ping: no echo from {endpoint} within {timeout_s}s (threaded)")
                seconds.append(time.perf_counter() - t0)
        finally:
            io.close()
        return {"seconds": seconds}

    def op_warmth(self, n: int) -> dict[str, Any]:
        """Microseconds (p50) of planning a one-block request, back to back and after sleeping 0.2, 1 and 5 ms."""
        import numpy as np

        from kvcore.layout.mapping import plan_transfer

        placement = self.tx.placement  # type: ignore[attr-defined]
        from kvcore.tools.bench.blocks import request_blocks

        ids = np.asarray(request_blocks(self.ids, "small", 0), dtype=np.int64)  # type: ignore[attr-defined]

        def timed(gap_s: float) -> float:
            seconds = []
            for _ in range(n):
                if gap_s:
                    time.sleep(gap_s)
                t0 = time.perf_counter()
                plan_transfer(placement, placement, ids, ids)
                seconds.append(time.perf_counter() - t0)
            return statistics.median(seconds) * 1e6

        timed(0.0)  # imports and the plan cache: not counted
        out = {"hot_us_p50": timed(0.0)}
        for gap_ms in (0.2, 1, 5):
            out[f"after_sleep_{gap_ms:g}ms_us_p50"] = timed(gap_ms / 1e3)
        out["after_sleep_1ms_vs_hot"] = out["after_sleep_1ms_us_p50"] / out["hot_us_p50"]
        return out


def _native() -> tuple[Any, str]:
    """``(kvcore_native, "")``, or ``(None, why)`` where it is not installed."""
    try:
        import kvcore_native
    except ImportError as exc:
        return None, f"kvcore-native is not installed (pip install -e plugins/native; make install does): {exc}"
    return kvcore_native, ""


#: The lean floor's receiver: its RequestData names it, and one block id; its nonce is checked in every answer.
_LEAN_GEN = "bench-lean"
_LEAN_NONCE = b"lean-floor-nonce"


def _lean_request(i: int) -> bytes:
    """The engine thread's part of a lean request: a RequestData for one block, encoded."""
    return wire.encode(
        wire.RequestData(
            v=wire.PROTOCOL_VERSION,
            request_id=i,
            gen_instance=_LEAN_GEN,
            gen_rank=0,
            gen_incarnation=f"lean-{os.getpid()}",
            block_ids=np.array([i % 8], dtype="<i8").tobytes(),
            prompt_len=32,
            nonce=_LEAN_NONCE,
        )
    )


def _lean_check(frame: bytes) -> None:
    """The I/O thread's part of a lean answer: it decodes to a TransferResult that says ``ok`` with our nonce."""
    msg = wire.decode(frame)
    if not isinstance(msg, wire.TransferResult) or msg.status != "ok" or msg.nonce != _LEAN_NONCE:
        raise BenchError(f"ping: the lean floor's answer is not an ok TransferResult: {msg!r}")


def floor_summary(seconds: list[float], warm: int) -> dict[str, float]:
    """p50/p99 in ms of the timed round trips (the first ``warm`` are the warm-up)."""
    ms = [x * 1e3 for x in seconds[warm:]]
    return {"round_trips": len(ms), "ms_p50": _pct(ms, 50), "ms_p99": _pct(ms, 99)}
