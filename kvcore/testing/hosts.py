"""Two "hosts" on one Linux machine: namespaces joined by a veth pair, for cross-host tests of kvcore.

``TwoHosts()`` builds hosts ``a`` and ``b``. Each is its own network namespace
(``ip netns``) holding one end of a veth pair, plus an init process (pid 1 of
its own pid namespace) that also owns a UTS namespace (its own hostname), a
mount namespace with a fresh tmpfs on ``/dev/shm`` and its own ``/proc``, and
an IPC namespace. Every process started in a host (``Host.popen``,
``Host.peer``) enters all of these, so two processes of one host share
``/dev/shm``, SysV IPC and pids as on a real machine, and processes of
different hosts share nothing but the kernel and the link.

Addresses come only from the benchmarking range 198.18.0.0/15 (RFC 2544) and
the ULA fd00:6b76::/64; nothing is ever routed anywhere but between the two
namespaces this module created.

Cleanup is layered so that nothing outlives a test: ``close()`` (context
manager) kills each host's init (which takes every process of its pid
namespace with it) and deletes the namespaces (which destroys the veth pair);
an ``atexit`` hook does the same when a test forgets; each init exits when the
creating process dies (its stdin pipe closes), and ``sweep()`` removes
namespaces and links whose creating process is gone (names carry its pid and
start time), which ``TwoHosts`` runs before building.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), ``ip``, ``unshare`` and
``nsenter``; ``unavailable_reason()`` says why not where they are missing, so
tests skip with that reason and nowhere else.

Why one module of this length: namespace setup, the RPC between the host processes and the rank operations
are one harness whose code runs in three kinds of processes (the driver and the two hosts); split, each process
would have to import the others' halves.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore.hostinfo import process_alive, process_start_time
from kvcore.params import derive_ticket
from kvcore.testing.harness import PeerProcess

__all__ = [
    "TwoHosts",
    "Host",
    "HostPeer",
    "HostsError",
    "unavailable_reason",
    "sweep",
    "IPV4_NET",
    "IPV6_NET",
]

#: The two hosts' IPv4 addresses: a /30 inside the benchmarking range 198.18.0.0/15.
IPV4_NET: tuple[str, str, int] = ("198.18.0.1", "198.18.0.2", 30)
#: The two hosts' IPv6 addresses: a /64 inside the ULA fd00::/8.
IPV6_NET: tuple[str, str, int] = ("fd00:6b76::1", "fd00:6b76::2", 64)

#: Namespace names: kvcore-h<creator pid>-<creator start time>-<n>-<a|b>
_NS_PREFIX = "kvcore-h"
_NS_RE = re.compile(r"^kvcore-h(\d+)-(\d+)-(\d+)-([ab])$")
#: veth names (15 bytes at most): kvh<pid>x<n><a|b>; only ever seen in the root namespace if setup failed half way.
_LINK_RE = re.compile(r"^kvh(\d+)x(\d+)([ab])(@.*)?$")
#: The /etc/hosts each host mounts: kvcore-hosts-<pid>-<random>.hosts in the temporary directory.
_HOSTS_FILE_RE = re.compile(r"^kvcore-hosts-(\d+)-\w+\.hosts$")
_CMD_TIMEOUT = 30.0
_seq = itertools.count(1)
_live: set[TwoHosts] = set()
_live_lock = threading.Lock()

# pid 1 of a host: names the host, mounts a private /dev/shm and its own /etc/hosts (both hosts' names resolve),
# reports ready, reaps orphans until its stdin closes.
_INIT = r"""
import os, select, socket, subprocess, sys
socket.sethostname(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777,size=" + sys.argv[2], "kvcore-shm", "/dev/shm"], check=True)
subprocess.run(["mount", "--bind", sys.argv[3], "/etc/hosts"], check=True)
sys.stdout.write("ready\n"); sys.stdout.flush()
fd = sys.stdin.fileno()
while True:
    r, _, _ = select.select([fd], [], [], 0.5)
    if r and not os.read(fd, 4096):
        break
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
"""

#: The ticket secret the harness's ranks derive tickets from unless the driver passes its own (hex; test tool only).
HARNESS_TICKET_SECRET = "6b76636f72652d74776f2d686f7374732d686172726e657373"


_ECHO = (
    "import socket; s = socket.socket(socket.{family}); s.bind(('{host}', 0)); s.listen(); "
    "print(s.getsockname()[1], flush=True); c, _ = s.accept(); c.sendall(b'ok'); c.close()"
)
_CONNECT = "import socket; c = socket.create_connection(('{host}', {port}), timeout=2); assert c.recv(2) == b'ok'"


class HostsError(RuntimeError):
    """A namespace, link or host process could not be made; the message names the command and its output."""


def unavailable_reason() -> str | None:
    """Why namespaced hosts cannot be built here (a skip reason), or None when they can."""
    if sys.platform != "linux":
        return f"namespaced hosts need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "namespaced hosts need root (CAP_SYS_ADMIN and CAP_NET_ADMIN) to create namespaces and veth links"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"namespaced hosts need the {tool!r} command, which is not on PATH"
    probe = subprocess.run(
        ["unshare", "--uts", "--mount", "--pid", "--ipc", "--net", "--fork", "true"],
        capture_output=True,
        text=True,
        timeout=_CMD_TIMEOUT,
    )
    if probe.returncode != 0:
        return f"this kernel or container refuses new namespaces: unshare: {probe.stderr.strip()}"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise HostsError(f"{' '.join(argv)} did not finish within {_CMD_TIMEOUT}s") from exc
    if check and out.returncode != 0:
        raise HostsError(f"{' '.join(argv)} failed (exit {out.returncode}): {out.stderr.strip()}")
    return out


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; empty if it is gone)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return kids


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def sweep() -> list[str]:
    """Remove namespaces and links left by harnesses whose creating process is dead; returns what was removed."""
    removed: list[str] = []
    listing = _run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m is None or process_alive(int(m.group(1)), int(m.group(2))):
            continue
        for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
            _kill(int(pid))
        _run("ip", "netns", "delete", name, check=False)
        removed.append(f"netns {name}")
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for line in links.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        link = parts[1].strip()
        m = _LINK_RE.match(link)
        if m is None or process_alive(int(m.group(1))):
            continue
        _run("ip", "link", "delete", link.split("@")[0], check=False)
        removed.append(f"link {link}")
    for entry in os.listdir(tempfile.gettempdir()):
        m = _HOSTS_FILE_RE.match(entry)
        if m is not None and not process_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(tempfile.gettempdir(), entry))
            except FileNotFoundError:
                continue
            removed.append(f"file {entry}")
    return removed


class HostPeer(PeerProcess):
    """A ``kvcore.testing.hosts`` peer process inside a host; ``kill()`` kills the process inside, not nsenter."""

    def __init__(self, host: Host, backend: str, options: Mapping[str, Any] | None, *, name: str, **kw: Any) -> None:
        self.host = host
        super().__init__(
            backend,
            options,
            name=name,
            launcher=host.launcher(),
            target="kvcore.testing.hosts:host_peer_main",
            **kw,
        )

    @property
    def inner_pid(self) -> int | None:
        """The peer's pid as seen from here (nsenter forks it), or None once it is gone."""
        kids = _children(self.pid)
        return kids[0] if kids else None

    def kill(self) -> None:
        """SIGKILL the peer itself (a crash inside the host), then reap nsenter."""
        inner = self.inner_pid
        if inner is not None:
            _kill(inner)
        super().kill()


@dataclass(eq=False)
class Host:
    """One namespaced host: its namespace, hostname, addresses and init process."""

    label: str  # "a" or "b"
    netns: str
    hostname: str
    link: str  # its end of the veth pair
    address: str  # IPv4
    address6: str | None  # IPv6, or None when IPv6 is off
    init: subprocess.Popen[bytes] | None = None
    init_pid: int = 0  # pid 1 of the host's pid namespace, as seen from here
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def launcher(self) -> list[str]:
        """The argv prefix that runs a command inside this host (all of its namespaces)."""
        if not self.init_pid:
            raise HostsError(f"host {self.hostname} is not running")
        return ["nsenter", f"--target={self.init_pid}", "--net", "--uts", "--mount", "--ipc", "--pid", "--"]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this host (``subprocess.Popen`` keyword arguments pass through)."""
        proc: subprocess.Popen[bytes] = subprocess.Popen([*self.launcher(), *argv], **kwargs)
        self.processes.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this host to completion; returns its output (never raises on a non-zero exit)."""
        return subprocess.run([*self.launcher(), *argv], capture_output=True, text=True, timeout=timeout)

    def python(self, code: str, *, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run a Python snippet inside this host with this interpreter."""
        return self.run([sys.executable, "-c", code], timeout=timeout)

    def peer(
        self,
        backend: str,
        options: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 120.0,
    ) -> HostPeer:
        """A harness peer (one transfer agent of ``backend``) in this host, driven by msgpack commands on pipes."""
        peer = HostPeer(
            self, backend, options, name=name or f"{self.hostname}-{backend}", env=env, startup_timeout=startup_timeout
        )
        assert peer.popen is not None  # a launcher runs it as a subprocess
        self.processes.append(peer.popen)
        return peer


class TwoHosts:
    """Hosts ``a`` and ``b`` joined by a veth pair (198.18.0.1/30 <-> 198.18.0.2/30, fd00:6b76::1/2).

    Use as a context manager; everything it made is gone after ``close()``,
    also when the test failed, and at interpreter exit otherwise.
    """

    def __init__(self, *, ipv6: bool = True, shm_size: str = "512m", mtu: int | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise HostsError(reason)
        sweep()
        pid = os.getpid()
        start = process_start_time(pid) or 0
        n = next(_seq)
        self._closed = False
        self.hosts: dict[str, Host] = {}
        for i, label in enumerate("ab"):
            self.hosts[label] = Host(
                label=label,
                netns=f"{_NS_PREFIX}{pid}-{start}-{n}-{label}",
                hostname=f"kvhost-{label}-{pid}-{n}",
                link=f"kvh{pid}x{n}{label}",
                address=(IPV4_NET[0], IPV4_NET[1])[i],
                address6=(IPV6_NET[0], IPV6_NET[1])[i] if ipv6 else None,
            )
        with _live_lock:
            _live.add(self)
        self._etc_hosts = ""
        try:
            self._build(shm_size, mtu)
        except BaseException:
            self.close()
            raise

    @property
    def a(self) -> Host:
        return self.hosts["a"]

    @property
    def b(self) -> Host:
        return self.hosts["b"]

    def _build(self, shm_size: str, mtu: int | None) -> None:
        a, b = self.a, self.b
        for h in (a, b):
            _run("ip", "netns", "add", h.netns)
        _run("ip", "link", "add", a.link, "type", "veth", "peer", "name", b.link)
        for h in (a, b):
            _run("ip", "link", "set", h.link, "netns", h.netns)
            _run("ip", "-n", h.netns, "link", "set", "lo", "up")
            _run("ip", "-n", h.netns, "addr", "add", f"{h.address}/{IPV4_NET[2]}", "dev", h.link)
            if h.address6 is not None:
                _run("ip", "-n", h.netns, "addr", "add", f"{h.address6}/{IPV6_NET[2]}", "dev", h.link, "nodad")
            if mtu is not None:
                _run("ip", "-n", h.netns, "link", "set", h.link, "mtu", str(mtu))
            _run("ip", "-n", h.netns, "link", "set", h.link, "up")
        fd, self._etc_hosts = tempfile.mkstemp(prefix=f"kvcore-hosts-{os.getpid()}-", suffix=".hosts")
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        for h in (a, b):
            lines.append(f"{h.address} {h.hostname}")
            if h.address6:
                lines.append(f"{h.address6} {h.hostname}")
        os.write(fd, ("\n".join(lines) + "\n").encode())
        os.close(fd)
        os.chmod(self._etc_hosts, 0o644)
        for h in (a, b):
            self._start_init(h, shm_size)

    def _start_init(self, h: Host, shm_size: str) -> None:
        argv = [
            "ip", "netns", "exec", h.netns,
            "unshare", "--uts", "--mount", "--pid", "--ipc", "--fork", "--mount-proc", "--propagation", "private",
            "--kill-child=SIGKILL",
            sys.executable, "-c", _INIT, h.hostname, shm_size, self._etc_hosts,
        ]  # fmt: skip
        h.init = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert h.init.stdout is not None
        line = b""
        deadline = time.monotonic() + _CMD_TIMEOUT
        import select

        while time.monotonic() < deadline and h.init.poll() is None:
            if select.select([h.init.stdout], [], [], 0.2)[0]:
                line = h.init.stdout.readline()
                break
        if line.strip() != b"ready":
            err = h.init.stderr.read().decode(errors="replace") if h.init.poll() is not None and h.init.stderr else ""
            raise HostsError(f"host {h.hostname} did not start: {line!r} {err.strip()}")
        # `ip netns exec` execs unshare (same pid); unshare forked the init, which is pid 1 inside.
        kids = _children(h.init.pid)
        if not kids:
            raise HostsError(f"host {h.hostname}: cannot find its init process under pid {h.init.pid}")
        h.init_pid = kids[0]

    def wait_link(self, timeout: float = 10.0) -> None:
        """Wait until a TCP connection from a reaches b (IPv4, and IPv6 when on); ``HostsError`` after ``timeout``."""
        targets = [self.b.address] + ([self.b.address6] if self.b.address6 else [])
        for target in targets:
            family = "AF_INET6" if ":" in target else "AF_INET"
            server = self.b.popen(
                [sys.executable, "-c", _ECHO.format(family=family, host=target)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            try:
                assert server.stdout is not None
                port = server.stdout.readline().strip().decode()
                if not port:
                    raise HostsError(f"host b could not listen on {target}")
                deadline = time.monotonic() + timeout
                while True:
                    out = self.a.python(_CONNECT.format(family=family, host=target, port=port), timeout=timeout)
                    if out.returncode == 0:
                        break
                    if time.monotonic() > deadline:
                        raise HostsError(f"host a cannot reach [{target}]:{port}: {out.stderr.strip()[-300:]}")
                    time.sleep(0.2)
            finally:
                if server.poll() is None:
                    for kid in _children(server.pid):
                        _kill(kid)
                server.wait(timeout=10)
                for pipe in (server.stdout, server.stderr):
                    if pipe is not None:
                        pipe.close()
                self.b.processes.remove(server)

    def close(self) -> None:
        """Kill every host process and remove the namespaces and links. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for h in self.hosts.values():
            for proc in h.processes:
                if proc.poll() is None:
                    for kid in _children(proc.pid):
                        _kill(kid)
                    _kill(proc.pid)
            if h.init is not None:
                if h.init_pid:
                    _kill(h.init_pid)  # pid 1 of the host: the kernel kills the whole pid namespace with it
                _kill(h.init.pid)
            for proc in [*h.processes, *([h.init] if h.init else [])]:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                for pipe in (proc.stdin, proc.stdout, proc.stderr):
                    if pipe is not None and not pipe.closed:
                        pipe.close()
        # SIGKILL is asynchronous: wait (bounded) until the hosts' pid-1 processes are really gone.
        deadline = time.monotonic() + 10
        for h in self.hosts.values():
            while h.init_pid and process_alive(h.init_pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        for h in self.hosts.values():
            for pid in _run("ip", "netns", "pids", h.netns, check=False).stdout.split():
                _kill(int(pid))
            _run("ip", "netns", "delete", h.netns, check=False)
        _run("ip", "link", "delete", self.a.link, check=False)  # only exists if setup stopped half way
        if self._etc_hosts:
            try:
                os.unlink(self._etc_hosts)
            except FileNotFoundError:
                pass
        with _live_lock:
            _live.discard(self)

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    with _live_lock:
        live = list(_live)
    for hosts in live:
        try:
            hosts.close()
        except Exception:
            pass


# --- the peer side: the harness peer plus the commands an initiating agent needs ---------------------------


def _peer_class() -> type:
    import numpy as np

    from kvcore.errors import TransferTimeoutError
    from kvcore.hostinfo import host_identity, hostname
    from kvcore.testing.harness import _Peer
    from kvcore.transport.agent import TransferOp, TransferStatus

    class _HostPeer(_Peer):
        """Harness commands plus: where am I, load a peer, write to it (timed), write until an error."""

        def op_whoami(self) -> dict[str, Any]:
            return {"hostname": hostname(), "host_identity": host_identity(), "pid": os.getpid()}

        def op_load(self, descriptor: bytes) -> dict[str, Any]:
            return {"remote": self.agent.load_remote_agent(descriptor)}

        def op_unload(self, remote: str) -> dict[str, Any]:
            self.agent.unload_remote_agent(remote)
            return {}

        def op_write(
            self,
            remote: str,
            key: str,
            offsets: bytes,
            remote_addrs: bytes,
            sizes: bytes,
            notification: bytes | None = None,
            repeat: int = 1,
            wait_s: float = 60.0,
        ) -> dict[str, Any]:
            """Write fragments of buffer ``key`` (offsets into it) ``repeat`` times; returns each write's seconds."""
            base = np.uint64(self.buffers[key].data_ptr())
            local = np.frombuffer(offsets, dtype=np.uint64) + base
            rem = np.frombuffer(remote_addrs, dtype=np.uint64)
            size = np.frombuffer(sizes, dtype=np.uint64)
            seconds = []
            for i in range(repeat):
                notif = None if notification is None else notification + f".{i}".encode()
                t0 = time.perf_counter()
                h = self.agent.submit(TransferOp.WRITE, remote, local, rem, size, notification=notif)
                try:
                    self.agent.wait(h, wait_s)
                finally:
                    if h.status is not TransferStatus.PENDING:
                        self.agent.release(h)
                seconds.append(time.perf_counter() - t0)
            return {"seconds": seconds}

        def op_write_until_error_start(
            self, remote: str, key: str, remote_address: int, nbytes: int, wait_s: float = 30.0, limit: int = 10000
        ) -> dict[str, Any]:
            """Keep writing ``nbytes`` on a thread until a write fails (or ``limit`` writes); see ``_result``."""
            self.loop_result: dict[str, Any] = {}
            local = np.array([self.buffers[key].data_ptr()], dtype=np.uint64)
            rem = np.array([remote_address], dtype=np.uint64)
            size = np.array([nbytes], dtype=np.uint64)

            def run() -> None:
                done = 0
                try:
                    while done < limit:
                        h = self.agent.submit(TransferOp.WRITE, remote, local, rem, size)
                        try:
                            self.agent.wait(h, wait_s)
                        finally:
                            if h.status is not TransferStatus.PENDING:
                                self.agent.release(h)
                        done += 1
                        self.loop_result["writes"] = done
                    self.loop_result.update(error_type="", message="no error", at=time.monotonic())
                except TransferTimeoutError as exc:
                    self.loop_result.update(error_type="HANG", message=str(exc), at=time.monotonic())
                except Exception as exc:
                    self.loop_result.update(error_type=type(exc).__name__, message=str(exc), at=time.monotonic())
                self.loop_result["writes"] = done

            self.loop_thread = threading.Thread(target=run, daemon=True)
            self.loop_thread.start()
            return {}

        def op_write_until_error_status(self) -> dict[str, Any]:
            return dict(self.loop_result)

        def op_write_until_error_result(self, timeout: float = 120.0) -> dict[str, Any]:
            self.loop_thread.join(timeout)
            if self.loop_thread.is_alive():
                raise TimeoutError(f"the write loop is still running after {timeout}s (a hang)")
            return dict(self.loop_result)

        def op_watch_for(self, key: str, expect: int, watch_s: float) -> dict[str, Any]:
            """``watch_start`` with its own bound (``call``'s ``timeout`` is the reply deadline, not this)."""
            return self.op_watch_start(key, expect, timeout=watch_s)

        def op_peer_info(self, remote: str) -> dict[str, Any]:
            """How this agent reaches a loaded peer: nixl's lane scope, ucx's endpoint error mode."""
            info: dict[str, Any] = {}
            if hasattr(self.agent, "peer_scope"):
                info["scope"] = self.agent.peer_scope(remote)
            if hasattr(self.agent, "peer_error_mode"):
                info["error_mode"] = self.agent.peer_error_mode(remote)
            return info

        def op_progress(self) -> dict[str, Any]:
            self.agent.progress()
            return {}

        # --- a transceiver rank (context or generation) of an instance spread over host processes ---------

        def op_rank_start(
            self,
            role: str,
            rank: int,
            spec: dict[str, Any],
            dist_port: int,
            bind_host: str,
            config: dict[str, Any] | None = None,
        ) -> dict[str, Any]:
            """Build one rank (the demo's storage and oracle) and its ``Transceiver``; a thread drives ``poll``.

            Every rank of an instance must be started concurrently (the process group and the
            transceiver's allgather wait for all of them).
            """
            import datetime
            import queue

            from kvcore.config import TransceiverConfig
            from kvcore.control.collective import LocalCollective, TorchCollective
            from kvcore.testing.scenario import DemoSpec, Rank
            from kvcore.transceiver import Transceiver

            demo = DemoSpec(**spec)
            tp, pp, _, _ = demo.side(role)
            self.world = tp * pp
            collective: Any
            if self.world > 1:
                import torch.distributed as dist

                dist.init_process_group(
                    "gloo",
                    init_method=f"tcp://127.0.0.1:{dist_port}",  # inside this host: its own loopback
                    rank=rank,
                    world_size=self.world,
                    timeout=datetime.timedelta(seconds=demo.timeout_s + 30),
                )
                collective = TorchCollective()
            else:
                collective = LocalCollective()
            tx_config = TransceiverConfig(
                backend=self.backend,
                host=bind_host,
                request_timeout_s=demo.timeout_s,
                agent_options=self.options,
                # The test hosts' link is isolated inside namespaces this harness made (authentication is
                # tested on its own); a caller's config may still set auth_* instead.
                **{"allow_insecure_bind": True, **(config or {})},
            )
            me = Rank(role, rank, demo, self.agent)
            tx = Transceiver(
                tx_config,
                role=role,
                agent=self.agent,
                topology=me.topology,
                geometry=me.geometry,
                page_table=me.page_table,
                collective=collective,
                instance_name=f"{role}-two-hosts",
            )
            self.rank_state: dict[str, Any] = {
                "me": me, "tx": tx, "spec": demo, "collective": collective, "role": role,
                "commands": queue.Queue(), "outcomes": {}, "released": [], "error": "", "stop": False,
            }  # fmt: skip
            self.rank_thread = threading.Thread(target=self._rank_loop, daemon=True)
            self.rank_thread.start()
            return {"endpoint": tx.endpoint, "info_endpoint": tx.info_endpoint, "host_identity": host_identity()}

        def _rank_loop(self) -> None:
            st = self.rank_state
            me, tx, demo, collective = st["me"], st["tx"], st["spec"], st["collective"]
            try:
                while True:
                    while not st["commands"].empty():
                        cmd = st["commands"].get()
                        for r in me.mine(cmd["requests"]):
                            if cmd["op"] == "send":
                                me.fill(r)
                                tx.start_send(
                                    r,
                                    me.blocks[r],
                                    prompt_len=demo.tokens,
                                    state_slot=me.state_slot(r),
                                    ticket=derive_ticket(cmd["secret"], r),
                                )
                            else:
                                tx.start_receive(
                                    r,
                                    cmd["endpoint"],
                                    me.blocks[r],
                                    prompt_len=demo.tokens,
                                    state_slot=me.state_slot(r),
                                    ctx_dp_rank=demo.dp_group("context", r),
                                    ticket=derive_ticket(cmd["secret"], r),
                                )
                    result = tx.poll()  # collective: every rank of the instance polls in step
                    for o in result.outcomes:
                        error = f"{type(o.error).__name__}: {o.error}" if o.error is not None else ""
                        st["outcomes"][o.request_id] = [o.state.value, error]
                    st["released"].extend(result.released)
                    flags = collective.allgather(b"\x01" if st["stop"] else b"\x00")
                    if all(f == b"\x01" for f in flags):
                        return
                    time.sleep(0.0005)
            except Exception as exc:
                st["error"] = f"{type(exc).__name__}: {exc}"

        def op_rank_send(self, requests: list[int], secret: str = HARNESS_TICKET_SECRET) -> dict[str, Any]:
            """Context rank: fill this rank's part of ``requests`` with the oracle's values and send them.

            Tickets are derived from ``secret`` (hex), which the driver gives both instances.
            """
            self.rank_state["commands"].put({"op": "send", "requests": requests, "secret": bytes.fromhex(secret)})
            return {}

        def op_rank_receive(
            self, requests: list[int], endpoint: str, secret: str = HARNESS_TICKET_SECRET
        ) -> dict[str, Any]:
            """Generation rank: fetch ``requests`` from the context instance at ``endpoint``."""
            self.rank_state["commands"].put(
                {"op": "receive", "requests": requests, "endpoint": endpoint, "secret": bytes.fromhex(secret)}
            )
            return {}

        def op_rank_status(self) -> dict[str, Any]:
            st = self.rank_state
            return {
                "outcomes": {str(k): v for k, v in st["outcomes"].items()},
                "released": sorted(st["released"]),
                "error": st["error"],
            }

        def op_rank_verify(self, requests: list[int]) -> dict[str, Any]:
            """Generation rank: compare every byte of ``requests`` with the oracle (independent of kvcore)."""
            me = self.rank_state["me"]
            mine = set(me.mine(requests))
            bad, checked, first = 0, 0, ""
            for r in requests:
                n, nbytes, why = me.verify(r, r in mine)
                bad, checked, first = bad + n, checked + nbytes, first or why
            return {"mismatches": bad, "verified_bytes": checked, "first_bad": first}

        def op_rank_stop(self, join_s: float = 60.0) -> dict[str, Any]:
            """Stop polling (together with the instance's other ranks), close the transceiver, report leftovers."""
            st = self.rank_state
            st["stop"] = True
            self.rank_thread.join(join_s)
            if self.rank_thread.is_alive():
                raise TimeoutError(f"rank loop still polling after {join_s}s (another rank did not stop)")
            stats, leaks = st["tx"].stats(), st["tx"].leaks()
            st["tx"].close()
            if self.world > 1:
                import torch.distributed as dist

                dist.destroy_process_group()
            return {"stats": stats, "leaks": leaks, "error": st["error"]}

    return _HostPeer


# --- measurement: GB/s across the link beside the same run inside one host ---------------------------------


def measure(
    backend: str,
    *,
    cross_host: bool,
    hosts: TwoHosts,
    big: int = 256 << 20,
    block: int = 16 << 10,
    blocks: int = 4096,
    iterations: int = 3,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Median GB/s of one ``big`` write and ``blocks`` scattered ``block`` writes, a -> b (or a -> a); bytes verified.

    Also the time from SIGKILL of the receiver to the writer's typed error (``dead_peer_s``).
    """
    import numpy as np

    from kvcore.testing.harness import digest, pattern

    def u64(v: Any) -> bytes:
        return np.ascontiguousarray(v, dtype=np.uint64).tobytes()

    writer = hosts.a.peer(backend, options, name="writer")
    reader = (hosts.b if cross_host else hosts.a).peer(backend, options, name="reader")
    out: dict[str, Any] = {"backend": backend, "placement": "a->b (veth)" if cross_host else "a->a (one host)"}
    try:
        writer.call("alloc", key="big", nbytes=big, seed=1)
        writer.call("alloc", key="blocks", nbytes=block * blocks, seed=2)
        dbig = reader.call("alloc", key="big", nbytes=big)["address"]
        dblocks = reader.call("alloc", key="blocks", nbytes=block * blocks)["address"]
        remote = writer.call("load", descriptor=reader.call("descriptor")["descriptor"])["remote"]
        out["peer"] = writer.call("peer_info", remote=remote)
        reader.call("watch_for", key="big", expect=2 * (iterations + 1), watch_s=600)
        r = writer.call(
            "write", remote=remote, key="big", offsets=u64([0]), remote_addrs=u64([dbig]), sizes=u64([big]),
            notification=b"big", repeat=iterations + 1, wait_s=120.0, timeout=600,
        )  # fmt: skip
        out["big_GBps"] = big / float(np.median(r["seconds"][1:])) / 1e9
        perm = np.random.default_rng(3).permutation(blocks)
        r = writer.call(
            "write", remote=remote, key="blocks", offsets=u64(np.arange(blocks) * block),
            remote_addrs=u64(dblocks + perm * block), sizes=u64(np.full(blocks, block)),
            notification=b"blocks", repeat=iterations + 1, wait_s=120.0, timeout=600,
        )  # fmt: skip
        out["scattered_GBps"] = block * blocks / float(np.median(r["seconds"][1:])) / 1e9
        reader.call("watch_result", timeout=120)
        expected = np.empty((blocks, block), dtype=np.uint8)
        expected[perm] = pattern(2, block * blocks).reshape(blocks, block)
        out["verified"] = reader.call("digest", key="big")["digest"] == digest(pattern(1, big)) and reader.call(
            "digest", key="blocks"
        )["digest"] == digest(expected)
        # A dead peer: writes stream, the receiver is killed, the writer must see a typed error.
        reader.call("watch_for", key="big", expect=1 << 30, watch_s=600)
        writer.call("write_until_error_start", remote=remote, key="big", remote_address=dbig, nbytes=big, wait_s=30.0)
        while writer.call("write_until_error_status").get("writes", 0) < 1:
            time.sleep(0.005)
        killed_at = time.monotonic()
        reader.kill()
        res = writer.call("write_until_error_result", timeout=120)
        out["dead_peer_error"] = res["error_type"]
        out["dead_peer_s"] = res["at"] - killed_at
    finally:
        writer.close()
        reader.close()
    return out


def _bench_main(argv: list[str]) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m kvcore.testing.hosts bench")
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--mtu", type=int, default=None, help="veth MTU (default: the kernel's, 1500)")
    parser.add_argument("--options", default="{}", help="agent options as JSON")
    parser.add_argument("--cross-only", action="store_true")
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    with TwoHosts(mtu=args.mtu) as hosts:
        hosts.wait_link()
        from kvcore.extension.plugins import get_plugin_manager

        for backend in args.backend or get_plugin_manager().transfer_agents.remote_names():
            for cross in (True,) if args.cross_only else (False, True):
                r = measure(backend, cross_host=cross, hosts=hosts, iterations=args.iterations, options=options)
                print(json.dumps({**r, "mtu": args.mtu or 1500, "options": options}), flush=True)
    return 0


def host_peer_main(channel: Any, backend: str, name: str, options: dict[str, Any]) -> None:
    """The rank function of a peer inside a host: the harness peer plus :func:`_peer_class`'s commands."""
    from kvcore.testing.harness import peer_main

    peer_main(channel, backend, name, options, peer_cls=_peer_class())


if __name__ == "__main__":
    if sys.argv[1:2] == ["bench"]:
        sys.exit(_bench_main(sys.argv[2:]))
    sys.exit("usage: python -m kvcore.testing.hosts bench [--backend NAME] ...")
