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

from kvcore.config import TransceiverConfig
from kvcore.control.messenger import Messenger
from kvcore.errors import ConfigError
from kvcore.runtime.hosts import TwoHosts, sweep, unavailable_reason
from kvcore.testing.harness import PeerError, digest, pattern
from kvcore.testing.host_peer import HostPeer

_REASON = unavailable_reason()
needs_hosts = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

KiB, MiB = 1024, 1024 * 1024
#: The typed errors a writer may see when its peer dies: the peer is lost, or the transport failed the write.
PEER_DEATH_ERRORS = {"PeerLostError", "TransferFailedError"}


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    if _REASON is not None:
        pytest.skip(_REASON)
    with TwoHosts() as h:
        h.wait_link()
        yield h


def _u64(values: Any) -> bytes:
    return np.ascontiguousarray(values, dtype=np.uint64).tobytes()


def _pair(hosts: TwoHosts, backend: str, *, same_host: bool = False) -> tuple[Any, Any]:
    """A writer in host a and a reader in host b (or both in host a), each one agent of ``backend``."""
    writer = HostPeer(hosts.a, backend, {}, name="writer")
    reader = HostPeer(hosts.a if same_host else hosts.b, backend, {}, name="reader")
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


@needs_hosts
def test_close_removes_everything_also_after_a_failure() -> None:
    names: list[str] = []
    with pytest.raises(RuntimeError, match="test body failed"), TwoHosts(ipv6=False) as h:
        names = [h.a.netns, h.b.netns]
        init_pids = [h.a.init_pid, h.b.init_pid]
        peer = HostPeer(h.b, "shm", {}, name="doomed")
        inner = peer.inner_pid
        raise RuntimeError("test body failed")
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listing for n in names)
    from kvcore.hostinfo import process_alive

    assert inner is not None and not process_alive(inner)
    assert not any(process_alive(p) for p in init_pids)


@needs_hosts
def test_sweep_removes_what_a_killed_creator_left() -> None:
    """A process that builds hosts and dies without any cleanup leaves namespaces; the sweeper removes them."""
    code = (
        "import os, signal; from kvcore.runtime.hosts import TwoHosts; from kvcore.testing.host_peer import HostPeer; "
        "h = TwoHosts(ipv6=False); p = HostPeer(h.b, 'shm', {}, name='orphan'); "
        "print(h.a.netns, h.b.netns, h.a.init_pid, h.b.init_pid, p.inner_pid, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"  # no atexit, no close(), no finally
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -9, out.stderr
    *left, init_a, init_b, orphan = out.stdout.split()
    from kvcore.hostinfo import process_alive

    # The creator's pipes closed with it: each host's pid 1 exits, and the kernel takes its processes along.
    deadline = time.monotonic() + 30
    while any(process_alive(int(p)) for p in (init_a, init_b, orphan)):
        assert time.monotonic() < deadline, "host processes outlived their creator"
        time.sleep(0.05)
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

        reader.call("watch_for", key="big", expect=2, watch_s=120)  # the reader progresses, as an engine loop does
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
        reader.call("watch_for", key="dst", expect=1, watch_s=60)
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
        reader.call("watch_for", key="dst", expect=1 << 30, watch_s=600)  # keeps progressing until killed
        # Each wait is bounded (30 s): a transfer still pending then is reported as HANG and fails the test.
        writer.call("write_until_error_start", remote=remote, key="src", remote_address=dst, nbytes=n, wait_s=30.0)
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
    writer = HostPeer(hosts.a, "shm", {}, name="shm-writer")
    there = HostPeer(hosts.b, "shm", {}, name="shm-there")
    here = HostPeer(hosts.a, "shm", {}, name="shm-here")
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


# --- the control plane across the hosts ------------------------------------------------------------------

_SERVE = """
import sys
from kvcore.control import wire
from kvcore.config import TransceiverConfig
from kvcore.control.messenger import Messenger

host, advertise, base, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = TransceiverConfig(host=host, advertise_host=advertise, port=base, port_stride=2, allow_insecure_bind=True)
ms = []
for rank in range(ranks):
    def on(src, msg, rank=rank):
        ms[rank].reply(src, wire.ErrorReply(v=wire.PROTOCOL_VERSION, kind="Echo", error=f"rank {rank}: {msg.reason}"))
    m = Messenger(
        on, host=cfg.host, port=cfg.control_port(rank), advertise_host=cfg.advertise_host or None,
        allow_insecure_bind=True,
    )
    m.start()
    ms.append(m)
    print(m.bound_endpoint, m.endpoint, flush=True)
sys.stdin.read()
for m in ms:
    m.close()
"""

_DIAL = """
import queue, sys
from kvcore.control import wire
from kvcore.control.messenger import Messenger

q = queue.Queue()
m = Messenger(lambda src, msg: q.put(msg), name="dialer")
m.start()
for endpoint in sys.argv[1:]:
    m.send(endpoint, wire.Cancel(v=wire.PROTOCOL_VERSION, request_id=7, instance="x", rank=0, reason="hello"))
    print(q.get(timeout=20).error, flush=True)
m.close()
"""


@pytest.mark.parametrize(
    ("bind", "advertise"),
    [("0.0.0.0", "198.18.0.2"), ("::", "fd00:6b76::2"), ("198.18.0.2", ""), ("0.0.0.0", "")],
)
def test_messenger_across_hosts_through_the_advertised_address(hosts: TwoHosts, bind: str, advertise: str) -> None:
    """Ranks in host b bind ``bind`` on deterministic ports and advertise ``advertise``; host a dials what they say."""
    base = 7300 + 10 * ["0.0.0.0", "::", "198.18.0.2"].index(bind) + (5 if not advertise else 0)
    server = hosts.b.popen(
        [sys.executable, "-c", _SERVE, bind, advertise, str(base), "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert server.stdout is not None
        lines = [server.stdout.readline().decode().split() for _ in range(2)]
        assert all(len(line) == 2 for line in lines), lines
        advertised = [line[1] for line in lines]
        # A wildcard bind with nothing to advertise advertises the host's name (it resolves in both hosts).
        default = hosts.b.hostname if bind == "0.0.0.0" else bind
        shown = f"[{advertise}]" if ":" in advertise else (advertise or default)
        assert advertised == [f"tcp://{shown}:{base}", f"tcp://{shown}:{base + 2}"]  # rank r: port + r * stride
        if advertise or bind == "0.0.0.0":
            assert all(shown not in line[0] for line in lines)  # bound elsewhere than advertised
        out = hosts.a.run([sys.executable, "-c", _DIAL, *advertised], timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split("\n")[:2] == ["rank 0: hello", "rank 1: hello"]
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=30)
        if server.stdout is not None:
            server.stdout.close()


def test_wildcard_bind_advertises_the_host_name_never_the_wildcard() -> None:
    import socket

    m = Messenger(lambda s, x: None, host="0.0.0.0", name="wild", allow_insecure_bind=True)
    try:
        assert m.bound_endpoint.startswith("tcp://0.0.0.0:")
        assert m.endpoint == f"tcp://{socket.gethostname()}:{m.bound_endpoint.rpartition(':')[2]}"
    finally:
        m.close()


def test_busy_port_is_a_config_error_naming_it() -> None:
    first = Messenger(lambda s, x: None, name="first")
    port = int(first.endpoint.rpartition(":")[2])
    try:
        with pytest.raises(ConfigError, match=f"port {port}"):
            Messenger(lambda s, x: None, port=port, name="second")
    finally:
        first.close()


def test_control_ports_are_deterministic_per_rank() -> None:
    assert [TransceiverConfig(port=9000).control_port(r) for r in range(4)] == [9000, 9001, 9002, 9003]
    assert [TransceiverConfig(port=9000, port_stride=10).control_port(r) for r in range(3)] == [9000, 9010, 9020]
    assert [TransceiverConfig(ports=[9100, 9205]).control_port(r) for r in range(2)] == [9100, 9205]
    assert TransceiverConfig().control_port(3) == 0  # no port set: every rank a free one
    with pytest.raises(ConfigError, match="rank 2 has none"):
        TransceiverConfig(ports=[9100, 9205]).control_port(2)
    with pytest.raises(ConfigError, match="advertise_host must be an address peers can dial"):
        TransceiverConfig(advertise_host="0.0.0.0")
    with pytest.raises(ConfigError, match="disagree"):
        TransceiverConfig(port=9000, ports=[9001])
    env = {"KVCORE_PORTS": "9300,9301", "KVCORE_ADVERTISE_HOST": "fd00:6b76::2"}
    cfg = TransceiverConfig.load(env=env)
    assert cfg.ports == [9300, 9301] and cfg.advertise_host == "fd00:6b76::2"


# --- a transceiver pair across the hosts, through the public Transceiver API ------------------------------


def _pair_spec(backend: str, ctx_tp: int, gen_tp: int) -> dict[str, Any]:
    return dict(
        backend=backend, requests=4, tokens=64, layers=4, kv_heads=8, head_dim=64, tokens_per_block=16,
        ctx_tp=ctx_tp, gen_tp=gen_tp, timeout_s=90.0,
    )  # fmt: skip


def _start_instance(
    host: Any,
    backend: str,
    role: str,
    tp: int,
    spec: dict[str, Any],
    bind_host: str | None = None,
    config: dict[str, Any] | None = None,
) -> tuple[list[Any], list[Any]]:
    """``tp`` rank processes of one instance in ``host``, started together (their process group waits for all)."""
    from concurrent.futures import ThreadPoolExecutor

    peers = [HostPeer(host, backend, {}, name=f"{role[:3]}{r}") for r in range(tp)]
    bind = bind_host or host.address
    with ThreadPoolExecutor(len(peers)) as pool:
        infos = list(
            pool.map(
                lambda r: peers[r].call(
                    "rank_start", role=role, rank=r, spec=spec, dist_port=29500, bind_host=bind, config=config,
                    timeout=300,
                ),
                range(tp),
            )
        )  # fmt: skip
    return peers, infos


def _wait_released(peers: list[Any], requests: list[int], deadline: float) -> list[dict[str, Any]]:
    while True:
        status = [p.call("rank_status") for p in peers]
        for s in status:
            assert not s["error"], s["error"]
        if all(set(requests) <= set(s["released"]) for s in status):
            return status
        assert time.monotonic() < deadline, f"requests not released in time: {status}"
        time.sleep(0.05)


def _stop_all(peers: list[Any]) -> list[dict[str, Any]]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(peers))) as pool:
        return list(pool.map(lambda p: p.call("rank_stop", timeout=120), peers))


@pytest.mark.parametrize(
    ("backend", "ctx_tp", "gen_tp"), [("nixl", 1, 1), ("ucx", 1, 1), ("nixl", 2, 4), ("ucx", 2, 4)]
)
def test_transceiver_pair_across_hosts(hosts: TwoHosts, backend: str, ctx_tp: int, gen_tp: int) -> None:
    """A context instance in host a, a generation instance in host b: every byte of every request verified."""
    spec = _pair_spec(backend, ctx_tp, gen_tp)
    requests = list(range(spec["requests"]))
    ctx: list[Any] = []
    gen: list[Any] = []
    try:
        ctx, ctx_info = _start_instance(hosts.a, backend, "context", ctx_tp, spec)
        gen, gen_info = _start_instance(hosts.b, backend, "generation", gen_tp, spec)
        endpoint = ctx_info[0]["info_endpoint"]
        assert endpoint.startswith(f"tcp://{hosts.a.address}:")  # the advertised address of host a
        assert {i["host_identity"] for i in ctx_info}.isdisjoint({i["host_identity"] for i in gen_info})
        for p in ctx:
            p.call("rank_send", requests=requests)
        for p in gen:
            p.call("rank_receive", requests=requests, endpoint=endpoint)
        deadline = time.monotonic() + 240
        gen_status = _wait_released(gen, requests, deadline)
        ctx_status = _wait_released(ctx, requests, deadline)
        for s in gen_status + ctx_status:
            assert {s["outcomes"][str(r)][0] for r in requests} == {"DONE"}, s["outcomes"]
        checks = [p.call("rank_verify", requests=requests) for p in gen]
        assert [c["mismatches"] for c in checks] == [0] * gen_tp, [c["first_bad"] for c in checks]
        # Every byte of every request, over all generation ranks: layers * K/V * heads * tokens * head_dim * 2 B.
        total = spec["layers"] * 2 * spec["kv_heads"] * spec["tokens"] * spec["head_dim"] * 2 * len(requests)
        assert sum(c["verified_bytes"] for c in checks) == total
        stops = _stop_all(gen) + _stop_all(ctx)
        for st in stops:
            assert not st["error"], st["error"]
            assert st["leaks"] == {}, st["leaks"]  # sessions, leases and transfers all back to zero on both hosts
    finally:
        for p in gen + ctx:
            p.close()


@pytest.mark.parametrize("killed", ["generation", "context"])
@pytest.mark.parametrize("backend", ["nixl", "ucx"])
def test_the_survivor_releases_everything_when_the_other_host_dies(hosts: TwoHosts, backend: str, killed: str) -> None:
    """SIGKILL one instance's process mid-transfer: the other host ends every request and releases all of it.

    Across hosts no pid proves the writer dead: the generation side releases a lost context rank's pages
    ``fencing_grace_s`` after it was declared lost (shortened here), never sooner.
    """
    # The first request goes alone and must end DONE (the two hosts really talk); the other 127 (4 MiB each,
    # about half a second across the veth link) are handed to the context's engine loop and the victim is killed
    # at once, so some are being written and the rest not yet started. Killing once the first of all 128 had
    # ended failed twice in full runs: every request could end between two status looks.
    # request_timeout_s: the requests a killed generation never asked for end when it runs out (10 s), on the
    # context; the transfers take well under a second.
    spec = {**_pair_spec(backend, 1, 1), "requests": 128, "tokens": 256, "layers": 8, "timeout_s": 10.0}
    lifecycle = {"peer_lost_timeout_s": 1.0, "fencing_grace_s": 4.0, "transfer_timeout_s": 3.0}
    requests = list(range(spec["requests"]))
    ctx: list[Any] = []
    gen: list[Any] = []
    try:
        ctx, ctx_info = _start_instance(hosts.a, backend, "context", 1, spec, config=lifecycle)
        gen, _ = _start_instance(hosts.b, backend, "generation", 1, spec, config=lifecycle)
        gen[0].call("rank_receive", requests=requests, endpoint=ctx_info[0]["info_endpoint"])
        ctx[0].call("rank_send", requests=requests[:1])
        victim, survivor = (gen, ctx) if killed == "generation" else (ctx, gen)
        deadline = time.monotonic() + 60
        while not survivor[0].call("rank_status")["outcomes"]:  # the first request is through
            assert time.monotonic() < deadline, "the first request did not finish"
            time.sleep(0.005)
        assert survivor[0].call("rank_status")["outcomes"][str(requests[0])][0] == "DONE"
        ctx[0].call("rank_send", requests=requests[1:])
        victim[0].kill()
        killed_at = time.monotonic()
        deadline = time.monotonic() + 2 * spec["timeout_s"] + 30
        while len(survivor[0].call("rank_status")["outcomes"]) < len(requests):  # every request ends ...
            assert time.monotonic() < deadline, survivor[0].call("rank_status")
            time.sleep(0.05)
        status = survivor[0].call("rank_status")
        states = {r: status["outcomes"][str(r)] for r in requests}
        unfinished = {r: v for r, v in states.items() if v[0] != "DONE"}
        assert unfinished, "every request finished before the kill: nothing was in flight"
        assert {v[0] for v in unfinished.values()} <= {"FAILED", "TIMED_OUT"}, unfinished
        assert all(v[1] for v in unfinished.values()), unfinished  # each names its typed error
        _wait_released(survivor, requests, deadline)  # ... and its pages come back to the engine
        if killed == "context":
            assert time.monotonic() - killed_at >= lifecycle["fencing_grace_s"]  # not before the grace
        stop = _stop_all(survivor)[0]
        assert stop["leaks"] == {}, stop["leaks"]
    finally:
        for p in gen + ctx:
            p.close()


def test_transceiver_binds_wildcard_and_advertises_its_address_on_fixed_ports(hosts: TwoHosts) -> None:
    """Ranks bind 0.0.0.0 on port + rank; peers are told host a's address; a generation instance gets its KV."""
    spec = _pair_spec("nixl", 2, 1)
    requests = list(range(spec["requests"]))
    config = {"advertise_host": hosts.a.address, "port": 7600, "port_stride": 1}
    ctx: list[Any] = []
    gen: list[Any] = []
    try:
        ctx, ctx_info = _start_instance(hosts.a, "nixl", "context", 2, spec, bind_host="0.0.0.0", config=config)
        assert [i["endpoint"] for i in ctx_info] == [f"tcp://{hosts.a.address}:7600", f"tcp://{hosts.a.address}:7601"]
        gen, _ = _start_instance(hosts.b, "nixl", "generation", 1, spec)
        for p in ctx:
            p.call("rank_send", requests=requests)
        gen[0].call("rank_receive", requests=requests, endpoint=ctx_info[0]["info_endpoint"])
        _wait_released(gen + ctx, requests, time.monotonic() + 240)
        assert gen[0].call("rank_verify", requests=requests)["mismatches"] == 0
    finally:
        for p in gen + ctx:
            p.close()


def test_shm_host_check_decides_by_reachability_and_names_both_hosts(tmp_path: Any) -> None:
    """A same-host transport refuses a peer whose socket or control file is not here; a reachable one is accepted."""
    import os
    import socket

    from kvcore.hostinfo import host_identity
    from kvcore.transport.builtin.hostcheck import PeerOnOtherHostError, require_same_host

    name = b"\0" + f"kvcore-hostcheck-{os.getpid()}".encode()
    ctl = tmp_path / "ctl"
    with pytest.raises(PeerOnOtherHostError, match="does not exist in this network namespace"):
        require_same_host("shm", "ghost", host_identity(), socket_address=name)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as live:
        live.bind(name)
        with pytest.raises(PeerOnOtherHostError, match=r"control file .* does not exist in this mount namespace"):
            require_same_host("shm", "half", host_identity(), socket_address=name, path=str(ctl))
        ctl.write_bytes(b"")
        # Reachable: accepted even under another identity (a pod's containers share /dev/shm, not pids).
        require_same_host("shm", "here", "another-pid-namespace", socket_address=name, path=str(ctl))
    with pytest.raises(PeerOnOtherHostError, match="is on another host: host identity expected"):
        require_same_host("shm", "far", "another-boot/4026531836", peer_hostname="far-away", socket_address=name)
