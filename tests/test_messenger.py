"""The ZeroMQ messenger on its own: loopback by default, typed round trips, hostile frames, disconnect events."""

from __future__ import annotations

import logging
import queue
import threading

import pytest

from kvcore.control import wire
from kvcore.control.messenger import Messenger, Source
from kvcore.errors import ConfigError

V = wire.PROTOCOL_VERSION


def _pair() -> tuple[Messenger, Messenger, queue.Queue, queue.Queue]:
    qa: queue.Queue = queue.Queue()
    qb: queue.Queue = queue.Queue()
    a = Messenger(lambda src, m: qa.put((src, m)), name="a")
    b = Messenger(lambda src, m: qb.put((src, m)), name="b")
    a.start()
    b.start()
    return a, b, qa, qb


def test_binds_loopback_by_default() -> None:
    m = Messenger(lambda s, x: None, name="lo")
    try:
        host, port = wire.parse_endpoint(m.endpoint)
        assert host == "127.0.0.1" and port > 0
    finally:
        m.close()


def test_non_loopback_bind_without_auth_needs_the_opt_in_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="allow_insecure_bind"):
        Messenger(lambda s, x: None, host="0.0.0.0", name="any")
    with caplog.at_level(logging.WARNING, logger="kvcore.control.messenger"):
        m = Messenger(lambda s, x: None, host="0.0.0.0", name="any", allow_insecure_bind=True)
    try:
        assert "non-loopback" in caplog.text and "WITHOUT authentication" in caplog.text
    finally:
        m.close()


def test_round_trip_and_reply_on_the_same_socket() -> None:
    a, b, qa, qb = _pair()
    try:
        a.send(b.endpoint, wire.Cancel(v=V, request_id=2**64 - 1, instance="x", rank=3, reason="r"))
        src, msg = qb.get(timeout=5)
        assert isinstance(src, Source) and src.identity is not None
        assert isinstance(msg, wire.Cancel) and msg.request_id == 2**64 - 1
        b.reply(src, wire.ErrorReply(v=V, kind="SessionError", error="no such request", request_id=7))
        src2, reply = qa.get(timeout=5)
        assert src2.endpoint == b.endpoint and isinstance(reply, wire.ErrorReply) and reply.request_id == 7
    finally:
        a.close()
        b.close()


def test_garbage_is_answered_and_the_listener_keeps_serving() -> None:
    a, b, qa, qb = _pair()
    try:
        for frame in (b"", b"\xc1", b"\x81\xa1t\xa4nope"):
            a.send_raw(b.endpoint, frame)
            _, err = qa.get(timeout=5)
            assert isinstance(err, wire.ErrorReply) and err.kind == "MessageDecodeError"
        a.send(b.endpoint, wire.Cancel(v=V, request_id=1, instance="x", rank=0))
        assert isinstance(qb.get(timeout=5)[1], wire.Cancel)
        assert b.counters["bad_frames"] == 3
    finally:
        a.close()
        b.close()


def test_oversized_frame_never_reaches_the_handler() -> None:
    got: queue.Queue = queue.Queue()
    small = Messenger(lambda s, m: got.put(m), max_message_bytes=1024, name="small")
    big = Messenger(lambda s, m: None, name="big")
    small.start()
    big.start()
    try:
        big.send_raw(small.endpoint, b"\x00" * 4096)  # ZMQ_MAXMSGSIZE drops it (and that connection)
        # The DEALER reconnects by itself; a sane message sent while it does may be lost with the old
        # connection, so send until one is served (each wait is on the handler's queue, not a sleep).
        first = None
        for rid in range(1, 50):
            big.send(small.endpoint, wire.Cancel(v=V, request_id=rid, instance="x", rank=0))
            try:
                first = got.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        assert isinstance(first, wire.Cancel), "no sane message was served after the oversized frame"
        served = [first]
        while not got.empty():
            served.append(got.get_nowait())
        assert all(isinstance(m, wire.Cancel) for m in served)  # the oversized frame never reached the handler
        assert small.counters["received"] == len(served)
    finally:
        small.close()
        big.close()


def test_peer_disconnect_is_reported() -> None:
    lost: list[str] = []
    event, arrived = threading.Event(), threading.Event()
    a = Messenger(lambda s, m: None, on_disconnect=lambda ep: (lost.append(ep), event.set()), name="a")
    b = Messenger(lambda s, m: arrived.set(), name="b")
    a.start()
    b.start()
    try:
        a.send(b.endpoint, wire.Cancel(v=V, request_id=1, instance="x", rank=0))
        ep = b.endpoint
        assert arrived.wait(10), "the message never arrived"  # so the connection is up
        b.close()
        assert event.wait(10), "no disconnect event after the peer closed"
        assert lost == [ep]
    finally:
        a.close()


def test_a_peer_that_floods_and_never_reads_gets_its_answers_dropped_past_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answers kept for a peer whose queue is full are capped: a stranger that never reads cannot grow the outbox."""
    import time

    import zmq

    from kvcore.control import outbox as mod

    monkeypatch.setattr(mod, "_MAX_DEFERRED_PER_PEER", 50)
    b: Messenger
    seen: queue.Queue = queue.Queue()

    def answer(src: Source, m: wire.Message) -> None:  # as the transceiver's handlers do: every ask is answered
        if isinstance(m, wire.Cancel) and m.instance == "x":
            seen.put(m)
        else:
            b.reply(src, wire.ErrorReply(v=V, kind="SessionError", error="x" * 200))

    b = Messenger(answer, name="answers")
    b.start()
    a = Messenger(lambda s, m: None, name="other")
    a.start()
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.RCVHWM, 1)
    stranger.setsockopt(zmq.RCVBUF, 4096)
    stranger.setsockopt(zmq.LINGER, 0)
    ask = wire.encode(wire.Cancel(v=V, request_id=1, instance="stranger", rank=0))
    try:
        stranger.connect(b.endpoint)
        deadline = time.monotonic() + 60
        sent = 0
        while b.counters["send_dropped_backlog"] == 0:
            assert time.monotonic() < deadline, f"no answer dropped after {sent} asks: {dict(b.counters)}"
            for _ in range(200):
                stranger.send(ask, zmq.NOBLOCK)  # each is answered; the stranger never reads
            sent += 200
            time.sleep(0.005)
        assert b.counters["send_deferred"] > 0
        # The messenger still serves everyone else.
        a.send(b.endpoint, wire.Cancel(v=V, request_id=7, instance="x", rank=0))
        assert seen.get(timeout=10).request_id == 7
    finally:
        stranger.close(0)
        ctx.term()
        a.close()
        b.close()


def test_cpu_seconds_counts_the_io_thread_alone_and_keeps_its_total_after_close() -> None:
    """A driver that burns CPU on the I/O thread shows in ``cpu_seconds``; CPU burnt on another thread does not."""
    import time

    burn = threading.Event()

    def driver() -> float:
        if burn.is_set():
            t_end = time.thread_time() + 0.2  # 200 ms of this thread's CPU
            while time.thread_time() < t_end:
                pass
            burn.clear()
        return 0.01

    m = Messenger(lambda s, x: None, name="cpu")
    m.set_driver(driver)
    assert m.cpu_seconds() == 0.0  # not started
    m.start()
    try:
        t_end = time.thread_time() + 0.3  # 300 ms on this thread: not the I/O thread's
        while time.thread_time() < t_end:
            pass
        before = m.cpu_seconds()
        assert before < 0.15, before
        burn.set()
        deadline = time.monotonic() + 20
        while burn.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        after = m.cpu_seconds()
        assert after - before >= 0.2, (before, after)
    finally:
        m.close()
    assert m.cpu_seconds() >= after  # the thread ended: its total stays


@pytest.mark.serial  # compares wake lags with and without a busy thread: other load beside it blurs both
def test_io_timing_counts_the_gil_a_busy_thread_holds_and_a_lock_wait_but_not_cpu() -> None:
    """``wake_lag`` sees a thread that holds the GIL; ``stall_seconds`` a lock wait on the I/O thread, not its CPU."""
    import sys
    import time

    gate = threading.Lock()
    wait_once, burn_once = threading.Event(), threading.Event()

    def driver() -> float:
        if wait_once.is_set():
            with gate:  # held by the test thread for 0.3 s: the I/O thread waits without using a CPU
                pass
            wait_once.clear()
        if burn_once.is_set():
            t_end = time.thread_time() + 0.2  # 200 ms of this thread's CPU: work, not a stall
            while time.thread_time() < t_end:
                pass
            burn_once.clear()
        return 0.005  # timed sleeps, each one a wake-lag sample

    def until_clear(ev: threading.Event) -> None:
        deadline = time.monotonic() + 20
        while ev.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ev.is_set()

    m = Messenger(lambda s, x: None, name="timing")
    m.set_driver(driver)
    assert m.io_timing()[1].count == 0  # not started
    m.start()
    try:
        time.sleep(0.3)
        stall0, idle = m.io_timing()
        assert idle.count > 0

        gate.acquire()
        wait_once.set()
        time.sleep(0.3)
        gate.release()
        until_clear(wait_once)
        stall1, _ = m.io_timing()
        assert stall1 - stall0 >= 0.2, (stall0, stall1)

        cpu0 = m.cpu_seconds()
        burn_once.set()
        until_clear(burn_once)
        stall2, before_busy = m.io_timing()
        assert m.cpu_seconds() - cpu0 >= 0.2
        assert stall2 - stall1 < m.cpu_seconds() - cpu0, (stall1, stall2)  # the burn's CPU is not a stall

        # A thread that runs Python without pause keeps the GIL until the switch interval (20 ms here) forces it
        # off: every timed wake-up of the I/O thread waits for that.
        stop = threading.Event()

        def spin() -> None:
            while not stop.is_set():
                pass

        old = sys.getswitchinterval()
        sys.setswitchinterval(0.02)
        spinner = threading.Thread(target=spin)
        try:
            spinner.start()
            time.sleep(0.6)
        finally:
            stop.set()
            spinner.join()
            sys.setswitchinterval(old)
        _, after_busy = m.io_timing()
    finally:
        m.close()
    n = after_busy.count - before_busy.count
    assert n >= 3, n
    busy_mean = (after_busy.sum - before_busy.sum) / n
    assert busy_mean >= 0.005, busy_mean
    assert busy_mean > idle.mean, (busy_mean, idle.mean)


def test_a_failed_handshake_without_auth_is_no_auth_verdict_and_the_queued_message_still_arrives() -> None:
    """Without CURVE, a peer that garbles its ZMTP greeting (as a starved or resetting peer can) is not refused:
    on_auth_failed is not called, the socket is kept, and once a real ROUTER listens there the message arrives.

    (vLLM TP2 prefill -> TP1 decode on two busy cores hit this: the decode refused the prefill's rank 1 for a
    "CURVE handshake failed" although no key was configured.)"""
    import socket
    import time

    import zmq

    refused: list[tuple[str, str]] = []
    m = Messenger(lambda s, msg: None, name="handshake", on_auth_failed=lambda ep, why: refused.append((ep, why)))
    m.start()
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    raw.bind(("127.0.0.1", 0))
    raw.listen(4)
    port = raw.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        m.send(endpoint, wire.ErrorReply(v=wire.PROTOCOL_VERSION, kind="KvcoreError", error="hello"))
        raw.settimeout(10)
        conn, _ = raw.accept()
        # A ZMTP 3.0 greeting offering the CURVE mechanism to our NULL socket: the handshake fails (mismatch).
        conn.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32)
        deadline = time.monotonic() + 10
        while m.counters["handshakes_failed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        conn.close()
        raw.close()
        assert m.counters["handshakes_failed"] >= 1
        assert refused == [] and m.counters["peer_auth_failed"] == 0
        assert m.peer_count == 1, "the socket (and what is queued on it) is kept"
        ctx = zmq.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        try:
            assert router.poll(15_000), "the queued message never arrived after the reconnect"
            frame = router.recv_multipart()[-1]
            msg = wire.decode(frame)
            assert isinstance(msg, wire.ErrorReply) and msg.error == "hello"
        finally:
            router.close(0)
    finally:
        m.close()


def _http_like_server() -> tuple[object, str]:
    """A TCP service that is not kvcore (it answers anything with an HTTP error), on a loopback port."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            try:
                conn.settimeout(2)
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                pass
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"tcp://127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("curve", [False, True])
def test_a_peer_that_is_not_kvcore_is_reported_as_such_not_as_a_curve_failure(
    curve: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """An endpoint that speaks another protocol: the log (and the auth-failure reason, with CURVE) says the peer
    does not speak kvcore's protocol; without CURVE no line blames a CURVE handshake."""
    import time

    from kvcore.control.auth import AuthConfig

    srv, endpoint = _http_like_server()
    reasons: list[str] = []
    m = Messenger(
        lambda s, x: None,
        name="not-kvcore",
        auth=AuthConfig.generate() if curve else None,
        on_auth_failed=lambda ep, why: reasons.append(why),
    )
    m.start()
    try:
        with caplog.at_level(logging.INFO, logger="kvcore.control.messenger"):
            m.send(endpoint, wire.ErrorReply(v=V, kind="KvcoreError", error="hello"))
            deadline = time.monotonic() + 15
            while not (reasons if curve else m.counters["handshakes_failed"]) and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        m.close()
        srv.close()  # type: ignore[attr-defined]
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcore.control.messenger"]
    assert any("does not speak kvcore's protocol" in line for line in lines), lines
    if curve:
        assert reasons and all("does not speak kvcore's protocol" in why for why in reasons), reasons
    else:
        assert reasons == [] and not any("CURVE handshake" in line for line in lines), lines


_BUDGET_CHILD = r"""
import json, os, resource, sys, time
from kvcore.control import wire
from kvcore.control.messenger import Messenger

args = json.loads(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (args["nofile"], resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
m = Messenger(lambda s, x: None, name="budget")
m.start()
fds = lambda: len(os.listdir("/proc/self/fd"))
n0 = fds()
for ep in args["live"]:
    m.send(ep, wire.ErrorReply(v=1, kind="KvcoreError", error="measure"))
print("sent", flush=True)
sys.stdin.readline()  # the parent saw every one arrive: each socket is connected
samples = []
for _ in range(5):  # the least of a few looks: a descriptor another thread holds for a moment is not the socket's
    samples.append(fds())
    time.sleep(0.02)
per_live = (min(samples) - n0) / len(args["live"])
for ep in args["dead"]:
    m.send(ep, wire.ErrorReply(v=1, kind="KvcoreError", error="flood"))
while m.counters["sent"] < len(args["live"]) + len(args["dead"]) and m.counters["send_failed"] == 0:
    time.sleep(0.05)
m.send(args["live"][0], wire.ErrorReply(v=1, kind="KvcoreError", error="after the flood"))
sys.stdin.readline()
print(json.dumps({"per_live": per_live, "fds": fds(), "sockets": m.peer_count, "bound": m._max_dealers,
                  "failed": m.counters["send_failed"], "evicted": m.counters["peer_sockets_evicted"]}), flush=True)
m.close()
"""


def test_the_peer_socket_bound_is_a_descriptor_budget_under_a_low_rlimit() -> None:
    """A child with RLIMIT_NOFILE 512 sends to 600 endpoints nobody serves, then to a live peer: it never runs out
    of descriptors (the bound is derived from the limit, at the descriptors one socket was measured to cost) and
    its message after the flood arrives."""
    import json
    import subprocess
    import sys

    from kvcore.control.messenger import FDS_PER_PEER_SOCKET, peer_socket_budget

    assert peer_socket_budget(1024) * FDS_PER_PEER_SOCKET <= 1024 // 2
    assert peer_socket_budget(1 << 20) == 1024
    got: queue.Queue = queue.Queue()
    live = [Messenger(lambda s, x: got.put(x), name=f"live{i}") for i in range(8)]
    for m in live:
        m.start()
    import socket

    held = [socket.socket() for _ in range(600)]
    for s in held:
        s.bind(("127.0.0.1", 0))
    dead = [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in held]  # bound, never listening: refused
    args = {"nofile": 512, "live": [m.endpoint for m in live], "dead": dead}
    child = subprocess.Popen(
        [sys.executable, "-c", _BUDGET_CHILD, json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "sent"
        for _ in live:
            assert got.get(timeout=20).error == "measure"
        child.stdin.write("\n")
        child.stdin.flush()
        after = got.get(timeout=30)
        assert after.error == "after the flood", after
        child.stdin.write("\n")
        child.stdin.flush()
        report = json.loads(child.stdout.readline())
        assert child.wait(30) == 0
    finally:
        child.kill()
        for m in live:
            m.close()
        for s in held:
            s.close()
    assert report["per_live"] <= FDS_PER_PEER_SOCKET, report  # what one connected socket costs, measured
    assert report["sockets"] <= report["bound"] == peer_socket_budget(512), report
    assert report["fds"] < 512 and report["failed"] == 0 and report["evicted"] > 0, report
