"""Two hosts on one machine (network, UTS, mount, pid and IPC namespaces joined by a veth pair): kvcore across them.

An agent in host a writes into an agent in host b over TCP (nixl and ucx),
every byte compared with an independently computed expectation; the receiving
host's process is killed mid-transfer and the writer must see a typed error,
not a hang; the shm agent refuses a peer on the other host; and the
control-plane messenger binds one address and advertises another.

Run as root (the harness makes namespaces); elsewhere these tests skip and say why.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvcore.testing.harness import PeerError, digest, pattern
from kvcore.testing.hosts import TwoHosts, sweep, unavailable_reason

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

KiB, MiB = 1024, 1024 * 1024
#: The typed errors a writer may see when its peer dies: the peer is lost, or the transport failed the write.
PEER_DEATH_ERRORS = {"PeerLostError", "TransferFailedError"}


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    with TwoHosts() as h:
        h.wait_link()
        yield h


def _u64(values: Any) -> bytes:
    return np.ascontiguousarray(values, dtype=np.uint64).tobytes()


def _pair(hosts: TwoHosts, backend: str, *, same_host: bool = False) -> tuple[Any, Any]:
    """A writer in host a and a reader in host b (or both in host a), each one agent of ``backend``."""
    writer = hosts.a.peer(backend, {}, name="writer")
    reader = (hosts.a if same_host else hosts.b).peer(backend, {}, name="reader")
    return writer, reader


# --- the harness itself ----------------------------------------------------------------------------------


def test_hosts_have_their_own_hostname_pids_shm_and_addresses(hosts: TwoHosts) -> None:
    probe = (
        "import os, socket; from kvcore.hostinfo import host_identity; "
        "open('/dev/shm/kvcore-two-hosts-probe', 'w').close(); "
        "print(socket.gethostname(), os.getpid(), host_identity(), sorted(os.listdir('/dev/shm')))"
    )
    a = hosts.a.python(probe)
    assert a.returncode == 0, a.stderr
    b = hosts.b.python("import os, socket; print(socket.gethostname(), sorted(os.listdir('/dev/shm')))")
    assert b.returncode == 0, b.stderr
    a_name, a_pid, a_identity, a_shm = a.stdout.split(maxsplit=3)
    b_name, b_shm = b.stdout.split(maxsplit=1)
    assert a_name == hosts.a.hostname and b_name == hosts.b.hostname and a_name != b_name
    assert int(a_pid) < 100  # a fresh pid namespace, not this machine's pids
    assert "kvcore-two-hosts-probe" in a_shm and "kvcore-two-hosts-probe" not in b_shm  # separate /dev/shm
    from kvcore.hostinfo import host_identity

    assert a_identity != host_identity()
    addrs = hosts.b.run(["ip", "-o", "addr", "show"]).stdout
    assert "198.18.0.2/30" in addrs and "fd00:6b76::2/64" in addrs and "198.18.0.1/30" not in addrs


def test_link_carries_tcp_both_families(hosts: TwoHosts) -> None:
    hosts.wait_link(timeout=10)  # IPv4 and IPv6 connect from a to b, or HostsError


def test_close_removes_everything_also_after_a_failure() -> None:
    names: list[str] = []
    with pytest.raises(RuntimeError, match="test body failed"), TwoHosts(ipv6=False) as h:
        names = [h.a.netns, h.b.netns]
        init_pids = [h.a.init_pid, h.b.init_pid]
        peer = h.b.peer("shm", {}, name="doomed")
        inner = peer.inner_pid
        raise RuntimeError("test body failed")
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listing for n in names)
    from kvcore.hostinfo import process_alive

    assert inner is not None and not process_alive(inner)
    assert not any(process_alive(p) for p in init_pids)


def test_sweep_removes_what_a_killed_creator_left() -> None:
    """A process that builds hosts and dies without any cleanup leaves namespaces; the sweeper removes them."""
    code = (
        "import os; from kvcore.testing.hosts import TwoHosts; h = TwoHosts(ipv6=False); "
        "print(h.a.netns, h.b.netns, flush=True); os._exit(0)"  # no atexit, no close()
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    left = out.stdout.split()
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(n in listing for n in left)  # still there: nothing else removed them
    removed = sweep()
    assert {f"netns {n}" for n in left} <= set(removed)
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listing for n in left)


# --- transports across the hosts -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["nixl", "ucx"])
def test_write_across_hosts_every_byte(hosts: TwoHosts, backend: str) -> None:
    """One 32 MiB write and 2048 scattered 16 KiB blocks from host a into host b, over TCP with error handling."""
    writer, reader = _pair(hosts, backend)
    try:
        big, block, blocks = 32 * MiB, 16 * KiB, 2048
        writer.call("alloc", key="big", nbytes=big, seed=11)
        writer.call("alloc", key="blocks", nbytes=block * blocks, seed=12)
        dst_big = reader.call("alloc", key="big", nbytes=big)["address"]
        dst_blocks = reader.call("alloc", key="blocks", nbytes=block * blocks)["address"]
        remote = writer.call("load", descriptor=reader.call("descriptor")["descriptor"])["remote"]
        info = writer.call("peer_info", remote=remote)
        # Another host: nixl uses its cross-host lane (UCX peer mode), ucx a peer-mode endpoint.
        assert info.get("scope", "cross_host") == "cross_host" and info.get("error_mode", "peer") == "peer"

        reader.call("watch_start", key="big", expect=2, timeout=120)  # the reader progresses, as an engine loop does
        writer.call(
            "write", remote=remote, key="big", offsets=_u64([0]), remote_addrs=_u64([dst_big]), sizes=_u64([big]),
            notification=b"big",
        )  # fmt: skip
        perm = np.random.default_rng(5).permutation(blocks)
        writer.call(
            "write", remote=remote, key="blocks",
            offsets=_u64(np.arange(blocks) * block),
            remote_addrs=_u64(dst_blocks + perm * block),
            sizes=_u64(np.full(blocks, block)),
            notification=b"blocks",
        )  # fmt: skip
        notes = reader.call("watch_result", timeout=120)["notifications"]
        assert sorted(n[1] for n in notes) == [b"big.0", b"blocks.0"]
        assert {n[0] for n in notes} == {"writer"}

        src_blocks = pattern(12, block * blocks).reshape(blocks, block)
        expected = np.empty_like(src_blocks)
        expected[perm] = src_blocks  # block i of the source lands in slot perm[i]
        assert reader.call("digest", key="big")["digest"] == digest(pattern(11, big))
        assert reader.call("digest", key="blocks")["digest"] == digest(expected)
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("backend", ["nixl", "ucx"])
def test_same_host_peers_keep_shared_memory(hosts: TwoHosts, backend: str) -> None:
    """Two agents inside one namespaced host still pick the same-host path (shm/CMA, UCX error handling none)."""
    writer, reader = _pair(hosts, backend, same_host=True)
    try:
        n = 4 * MiB
        writer.call("alloc", key="src", nbytes=n, seed=21)
        dst = reader.call("alloc", key="dst", nbytes=n)["address"]
        remote = writer.call("load", descriptor=reader.call("descriptor")["descriptor"])["remote"]
        info = writer.call("peer_info", remote=remote)
        assert info.get("scope", "same_host") == "same_host" and info.get("error_mode", "none") == "none"
        reader.call("watch_start", key="dst", expect=1, timeout=60)
        writer.call(
            "write", remote=remote, key="src", offsets=_u64([0]), remote_addrs=_u64([dst]), sizes=_u64([n]),
            notification=b"n",
        )  # fmt: skip
        assert [x[1] for x in reader.call("watch_result")["notifications"]] == [b"n.0"]
        assert reader.call("digest", key="dst")["digest"] == digest(pattern(21, n))
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("backend", ["nixl", "ucx"])
def test_receiver_killed_mid_transfer_gives_the_writer_a_typed_error(hosts: TwoHosts, backend: str) -> None:
    """Kill the receiving host's process while 64 MiB writes stream to it: the writer's wait ends in a typed error."""
    writer, reader = _pair(hosts, backend)
    try:
        n = 64 * MiB
        writer.call("alloc", key="src", nbytes=n, seed=31)
        dst = reader.call("alloc", key="dst", nbytes=n)["address"]
        remote = writer.call("load", descriptor=reader.call("descriptor")["descriptor"])["remote"]
        reader.call("watch_start", key="dst", expect=1 << 30, timeout=600)  # keeps progressing until killed
        # Each wait is bounded (30 s): a transfer still pending then is reported as HANG and fails the test.
        writer.call("write_until_error_start", remote=remote, key="src", remote_address=dst, nbytes=n, timeout=30.0)
        deadline = time.monotonic() + 60
        while True:  # let two writes complete, so the kill lands on a connection that is moving bytes
            status = writer.call("write_until_error_status")
            assert "error_type" not in status, f"the writer failed before the kill: {status}"
            if status.get("writes", 0) >= 2:
                break
            assert time.monotonic() < deadline, "the writer never completed two writes"
            time.sleep(0.01)
        reader.kill()
        result = writer.call("write_until_error_result", timeout=120)
        assert result["error_type"] in PEER_DEATH_ERRORS, result
        # The writer's agent stays usable and holds nothing for the dead peer once it is unloaded.
        writer.call("unload", remote=remote)
        left = writer.call("resources")["resources"]
        assert left["transfers"] == 0 and left["remote_agents"] == 0, left
    finally:
        writer.close()
        reader.close()


def test_shm_refuses_a_peer_on_another_host(hosts: TwoHosts) -> None:
    writer = hosts.a.peer("shm", {}, name="shm-writer")
    there = hosts.b.peer("shm", {}, name="shm-there")
    here = hosts.a.peer("shm", {}, name="shm-here")
    try:
        for p in (there, here):
            p.call("alloc", key="dst", nbytes=64 * KiB)
        with pytest.raises(PeerError) as err:
            writer.call("load", descriptor=there.call("descriptor")["descriptor"])
        assert err.value.error_type == "PeerOnOtherHostError"
        assert "another host" in err.value.message and hosts.b.hostname in err.value.message
        # The same agent loads a peer on its own host: the refusal is about hosts, nothing else.
        assert writer.call("load", descriptor=here.call("descriptor")["descriptor"])["remote"] == "shm-here"
    finally:
        for p in (writer, there, here):
            p.close()
