"""kvcore-native's threaded floor: real libzmq on C threads, against its own echo and kvcore bench's Python echo."""

from __future__ import annotations

import os
import time

import kvcore_native
import pytest
import zmq
from kvcore_native import NativeFloorError, echo_start, echo_stop, libzmq_path, ping_threaded


def _threads() -> int:
    """Threads of this process, C threads included (Python's threading does not see them)."""
    return len(os.listdir("/proc/self/task"))


def test_libzmq_is_pyzmqs_own() -> None:
    path = libzmq_path()
    assert "libzmq" in os.path.basename(path) and os.path.exists(path)
    assert os.path.realpath(path).startswith(os.path.realpath(os.path.dirname(zmq.__file__) + "/.."))


def test_round_trips_are_timed_and_the_threads_and_sockets_end() -> None:
    echo_stop(echo_start()[0])  # the module's ZeroMQ context starts its own two threads once, with its first socket
    before = _threads()
    echo, endpoint = echo_start()
    try:
        assert endpoint.startswith("tcp://127.0.0.1:")
        assert _threads() == before + 1  # the echo's thread
        seconds = ping_threaded(endpoint, 200, 5.0)
        assert _threads() == before + 1  # the ping's I/O thread ended with the call
    finally:
        echo_stop(echo)
    echo_stop(echo)  # a second stop does nothing
    assert _threads() == before
    assert len(seconds) == 200 and all(0 < s < 5.0 for s in seconds)


def test_no_echo_is_a_timeout_at_its_deadline_naming_the_endpoint() -> None:
    echo, endpoint = echo_start()
    echo_stop(echo)  # nobody answers any more
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"no echo from {endpoint} within 0.3s .*round trip 0"):
        ping_threaded(endpoint, 3, 0.3)
    assert 0.25 < time.monotonic() - t0 < 3


def test_a_bad_endpoint_is_a_typed_error() -> None:
    with pytest.raises(NativeFloorError, match="connect"):
        ping_threaded("no-such-transport://x", 1, 1.0)
    with pytest.raises((ValueError, NativeFloorError)):
        ping_threaded("tcp://127.0.0.1:1", -1, 1.0)


def test_it_speaks_plain_zeromq_both_ways() -> None:
    """The native echo answers a pyzmq DEALER byte for byte; the native ping is answered by a pyzmq ROUTER."""
    echo, endpoint = echo_start()
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        frame = os.urandom(256)
        dealer.send(frame)
        assert dealer.poll(5000) and dealer.recv() == frame
    finally:
        dealer.close(0)
        echo_stop(echo)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got: list[bytes] = []
    import threading

    def serve() -> None:
        for _ in range(5):
            if not router.poll(5000):
                return
            ident, body = router.recv_multipart()
            got.append(body)
            router.send_multipart([ident, body])

    t = threading.Thread(target=serve)
    t.start()
    try:
        assert len(ping_threaded(f"tcp://127.0.0.1:{port}", 5, 5.0)) == 5
    finally:
        t.join(10)
        router.close(0)
    assert len(got) == 5 and all(len(b) == 256 for b in got)


_STRANGER = """
import resource, subprocess, sys
from kvcore_native import echo_start, echo_stop, ping_threaded
echo, endpoint = echo_start()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
stranger = (
    "import zmq, time\\n"
    "d = zmq.Context().socket(zmq.DEALER); d.setsockopt(zmq.LINGER, 5000); d.connect(%r)\\n"
    "d.send(b'y' * 100_000_000); d.send_multipart([b'a', b'b', b'c']); d.send(b''); time.sleep(1)\\n"
) % endpoint
subprocess.run([sys.executable, "-c", stranger], check=True, timeout=60)
grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(grew_kib, len(ping_threaded(endpoint, 20, 5.0)))
echo_stop(echo)
"""


def test_a_strangers_oversized_or_misshapen_frames_cost_the_echo_nothing() -> None:
    """A peer on loopback that sends 100 MB, three parts or an empty frame is cut off by libzmq's size cap (4 KiB)
    before anything is buffered; the echo keeps answering. Run in a fresh process: its peak memory is the evidence."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _STRANGER], capture_output=True, text=True, timeout=120, check=True)
    grew_kib, answered = (int(x) for x in out.stdout.split())
    assert answered == 20
    assert grew_kib < 20 * 1024, f"the echo's process grew by {grew_kib} KiB"


def test_concurrent_pings_each_get_their_own_answers() -> None:
    import threading

    echo, endpoint = echo_start()
    got: list[int] = []
    try:
        threads = [
            threading.Thread(target=lambda: got.append(len(ping_threaded(endpoint, 100, 5.0)))) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        echo_stop(echo)
    assert got == [100, 100, 100, 100]


def test_the_package_says_what_it_is() -> None:
    assert kvcore_native.__all__ == ["NativeFloorError", "echo_start", "echo_stop", "libzmq_path", "ping_threaded"]
