"""The one rank-process harness (``kvcore.runtime``): real child processes, typed errors, nothing left over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from kvcore.errors import KvcoreError
from kvcore.runtime import (
    Channel,
    RankExitedError,
    RankFailedError,
    RankProcess,
    RankProtocolError,
    RankTimeoutError,
    StartMethod,
    ready,
)
from kvcore.runtime.frames import Call

HERE = str(Path(__file__).parent)
ECHO = "_rank_targets:echo_main"


def _rank(target: str = ECHO, **kw: object) -> RankProcess:
    return RankProcess(target, name=kw.pop("name", "test-rank"), path=[HERE], **kw)  # type: ignore[arg-type]


def _gone(pid: int) -> bool:
    """True once ``pid`` no longer exists at all (reaped: not even a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_for(cond: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("start", [StartMethod.SUBPROCESS, StartMethod.FORKSERVER])
def test_commands_and_messages_round_trip(start: StartMethod) -> None:
    with _rank(kwargs={"greeting": "hi"}, start=start) as r:
        hello = r.recv(60, op="hello")
        assert hello == {"hello": "hi", "pid": r.pid}
        blob = bytes(range(256)) * 1000  # bytes travel as bytes, lists as lists
        assert r.call("echo", a=1, b=[1, "x"], c=blob) == {"args": {"a": 1, "b": [1, "x"], "c": blob}, "pid": r.pid}
        # Messages sent while a command runs are kept, in order, for recv (not mistaken for the reply).
        assert r.call("chatty", n=3) == {"sent": 3}
        assert [r.recv(5)["progress"] for _ in range(3)] == [0, 1, 2]
        r.post("echo", x=2)
        assert r.reply("echo", 30)["args"] == {"x": 2}


def test_env_reaches_the_child() -> None:
    with _rank(env={"KVCORE_RANK_TEST": "on"}) as r:
        r.recv(60)
        assert r.call("env", name="KVCORE_RANK_TEST") == {"value": "on"}


def test_a_command_that_raises_is_a_typed_error_naming_op_type_and_message() -> None:
    with _rank(name="rank-7") as r:
        r.recv(60)
        with pytest.raises(RankFailedError) as err:
            r.call("boom", what="x1")
        e = err.value
        assert isinstance(e, KvcoreError)
        assert (e.rank, e.op, e.error_type, e.message) == ("rank-7", "boom", "ValueError", "bad value 'x1'")
        assert "op_boom" in e.trace and "rank 'rank-7' failed in 'boom': ValueError: bad value 'x1'" in str(e)
        # The rank keeps serving after a failed command.
        assert r.call("echo", ok=True)["args"] == {"ok": True}
        with pytest.raises(RankFailedError, match=r"unknown command 'nope'.*boom, chatty, echo"):
            r.call("nope")
        # A command told without a reply that fails surfaces on the next read.
        r.tell("boom", what="later")
        with pytest.raises(RankFailedError, match="later"):
            r.call("echo")


def test_a_main_that_raises_is_reported_with_its_exception() -> None:
    r = _rank("_rank_targets:raise_main")
    try:
        with pytest.raises(RankFailedError) as err:
            r.recv(60)
        assert (err.value.op, err.value.error_type) == ("main", "RuntimeError")
        assert err.value.message == "cannot start: the pool is missing"
    finally:
        assert r.close() == 1


def test_a_hanging_child_times_out_within_the_deadline() -> None:
    with _rank() as r:
        r.recv(60)
        t0 = time.monotonic()
        with pytest.raises(RankTimeoutError) as err:
            r.call("hang", seconds=8, timeout=1.0)
        waited = time.monotonic() - t0
        assert (err.value.rank, err.value.op, err.value.timeout) == ("test-rank", "hang", 1.0)
        assert isinstance(err.value, TimeoutError)
        assert 1.0 <= waited < 5, waited  # bounded by the deadline, not by the 8 s the child sleeps


def test_a_killed_child_is_an_error_not_a_hang() -> None:
    r = _rank()
    try:
        r.recv(60)
        r.post("hang", seconds=60)
        os.kill(r.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankExitedError) as err:
            r.reply("hang", 120)
        assert time.monotonic() - t0 < 60
        assert err.value.exitcode == -signal.SIGKILL and err.value.op == "hang"
        with pytest.raises(RankExitedError):
            r.call("echo")
    finally:
        r.close()
    assert _gone(r.pid)


def test_close_reaps_the_child_and_escalates_to_kill() -> None:
    polite = _rank()
    polite.recv(60)
    assert polite.close() == 0  # EOF on its channel ends serve(); a clean exit
    assert _gone(polite.pid)
    stubborn = _rank("_rank_targets:stubborn_main")
    stubborn.recv(60)
    t0 = time.monotonic()
    assert stubborn.close(timeout=0.5) == -signal.SIGKILL  # ignored EOF and SIGTERM
    assert time.monotonic() - t0 < 30
    assert _gone(stubborn.pid)
    assert stubborn.close() == -signal.SIGKILL  # idempotent


_ORPHAN = """
import sys
from kvcore.runtime import RankProcess, StartMethod
r = RankProcess("_rank_targets:echo_main", name="orphan", path=[sys.argv[1]], start=StartMethod[sys.argv[2]])
print(r.recv(60)["pid"], flush=True)
import time; time.sleep(600)
"""


@pytest.mark.parametrize("start", ["SUBPROCESS", "FORKSERVER"])
def test_the_child_dies_with_its_parent(start: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN, HERE, start], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _gone(child)
        parent.kill()
        parent.wait(30)
        # Reparented and killed by PR_SET_PDEATHSIG; its new parent (init or a subreaper) reaps it.
        assert _wait_for(lambda: _gone(child) or _zombie(child), 30), f"rank {child} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(30)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_wire_is_length_prefixed_msgpack_never_pickle() -> None:
    r_fd, w_fd = os.pipe()
    ch = Channel(r_fd, w_fd, who="self")
    try:
        ch.write(Call("store", {"blob": b"\x80\x04", "n": 3}))
        raw = os.read(r_fd, 1 << 16)
        size = int.from_bytes(raw[:4], "big")
        assert size == len(raw) - 4
        # An independent msgpack decoder reads the frame as a plain map: no pickle opcode stream.
        assert msgspec.msgpack.decode(raw[4:]) == {
            "type": "call",
            "op": "store",
            "args": {"blob": b"\x80\x04", "n": 3},
            "reply": True,
        }
        assert not raw[4:].startswith(b"\x80")  # pickle protocol 2+ would start with PROTO (0x80)
        # Objects msgpack cannot express are refused, never pickled on the way.
        with pytest.raises(TypeError):
            ch.send({"obj": object()})
    finally:
        ch.close()


def test_a_frame_that_is_not_a_harness_frame_is_a_protocol_error() -> None:
    with _rank("_rank_targets:garbage_main") as r:
        with pytest.raises(RankProtocolError, match="malformed frame"):
            r.recv(60)
        r.kill()
    assert _gone(r.pid)


def test_ready_reports_ranks_with_something_to_read() -> None:
    a, b = _rank(name="a"), _rank(name="b")
    try:
        a.recv(60)
        b.recv(60)
        assert ready([a, b], 0.2) == []
        b.post("echo", n=1)
        assert _wait_for(lambda: ready([a, b], 0.5) == [b], 30)
        assert b.reply("echo", 30)["args"] == {"n": 1}
    finally:
        a.close()
        b.close()
