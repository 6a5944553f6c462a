"""Two "hosts" on one Linux machine: namespaces joined by a veth pair, for cross-host tests of kvcore.

``TwoHosts()`` builds hosts ``a`` and ``b``. Each is its own network namespace
(``ip netns``) holding one end of a veth pair, plus an init process (pid 1 of
its own pid namespace) that also owns a UTS namespace (its own hostname), a
mount namespace with a fresh tmpfs on ``/dev/shm`` and its own ``/proc``, and
an IPC namespace. Every process started in a host (``Host.popen``, a rank
process behind ``Host.launcher()``) enters all of these, so two processes of one host share
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

Each host's pid 1 is :mod:`kvcore.runtime.hostinit`. The transport tests' peer in a host
(:class:`kvcore.testing.host_peer.HostPeer`) and the cross-host measurement (``python -m
kvcore.tools.hosts_bench``) are built on this module.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore.hostinfo import process_alive, process_start_time

__all__ = [
    "TwoHosts",
    "Host",
    "HostsError",
    "unavailable_reason",
    "sweep",
    "children",
    "sigkill",
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


def children(pid: int) -> list[int]:
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


def sigkill(pid: int) -> None:
    """SIGKILL ``pid``; nothing if it is gone already."""
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
            sigkill(int(pid))
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
            sys.executable, "-m", "kvcore.runtime.hostinit", h.hostname, shm_size, self._etc_hosts,
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
        kids = children(h.init.pid)
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
                    for kid in children(server.pid):
                        sigkill(kid)
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
                    for kid in children(proc.pid):
                        sigkill(kid)
                    sigkill(proc.pid)
            if h.init is not None:
                if h.init_pid:
                    sigkill(h.init_pid)  # pid 1 of the host: the kernel kills the whole pid namespace with it
                sigkill(h.init.pid)
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
                sigkill(int(pid))
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
