"""Which host and process a peer is: identities that decide what can be proven about it from here.

Two processes can check each other's pids only when they share a kernel *and*
a pid namespace: ``host_identity()`` names exactly that (the kernel's boot id
plus the pid namespace's inode), so two containers with different hostnames on
one node, or two "hosts" built with Linux namespaces on one machine, are told
apart correctly. A pid alone can be reused; ``process_start_time`` (clock ticks
since boot, from ``/proc/<pid>/stat``) pins one process for the kernel's life.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket

__all__ = ["host_identity", "hostname", "is_loopback_host", "process_start_time", "process_alive", "same_host"]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns_inode(kind: str) -> str:
    try:
        link = os.readlink(f"/proc/self/ns/{kind}")  # "pid:[4026531836]"
    except OSError:
        return ""
    return link.partition("[")[2].rstrip("]")


@functools.cache
def _boot_id() -> str:
    return _read("/proc/sys/kernel/random/boot_id")


def host_identity() -> str:
    """``"<boot id>/<pid namespace inode>"``: equal for two processes iff each can see the other's pids.

    Empty where ``/proc`` does not say (then no pid-based proof about a peer is possible).
    ``KVCORE_HOST_ID`` overrides it: processes that must not trust each other's pids (or a test that
    simulates another host) set different values.
    """
    override = os.environ.get("KVCORE_HOST_ID")
    if override is not None:
        return override
    boot, pidns = _boot_id(), _ns_inode("pid")
    if not boot or not pidns:
        return ""
    return f"{boot}/{pidns}"


def hostname() -> str:
    """The UTS hostname (differs per namespaced host); for logs and operators, never for proofs."""
    return socket.gethostname()


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of ``/proc/<pid>/stat``), or None if gone."""
    stat = _read(f"/proc/{int(pid)}/stat")
    if not stat:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its closing parenthesis.
    rest = stat.rpartition(")")[2].split()
    try:
        return int(rest[19])  # fields 3.. start at rest[0]; field 22 is rest[19]
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """True while process ``pid`` exists in our pid namespace (and, if given, still has ``start_time``).

    A zombie counts as dead: it can run no code and write no memory.
    """
    if pid <= 0:
        return False
    stat = _read(f"/proc/{int(pid)}/stat")
    if not stat:
        return False
    rest = stat.rpartition(")")[2].split()
    if rest and rest[0] in ("Z", "X"):
        return False
    if start_time is not None:
        try:
            return int(rest[19]) == int(start_time)
        except (IndexError, ValueError):
            return False
    return True


def same_host(identity: str) -> bool:
    """True when a peer's ``host_identity()`` equals ours (non-empty): its pids are ours to check."""
    mine = host_identity()
    return bool(mine) and identity == mine


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (v4 or v6, bracketed or not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
