"""The client side of the shm agent: what it keeps per loaded peer, and how it maps that peer's memory.

A peer's memory is fetched lazily, at the first transfer that needs it: over the owner's ``SOCK_SEQPACKET`` socket
(``_connect_fds``), checked (the socket's ``SO_PEERCRED`` pid and the identity the owner states must match the
descriptor loaded; every fd must be a memfd sealed against shrinking and at least as large as declared), then
mapped. ``_translate`` turns a peer's addresses into addresses of those mappings, refusing any fragment outside a
live export (the control block's tokens); ``_check_alive`` and ``_still_alive`` tell a live peer from a gone one.
"""

from __future__ import annotations

import logging
import mmap
import select
import socket
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvcore.errors import (
    KvcoreError,
    PeerLostError,
    RemoteAgentError,
    RemoteRangeError,
    TransferFailedError,
    TransferTimeoutError,
)
from kvcore.msgbounds import check_msgpack_bounds
from kvcore.transport.agent import RemoteAgent, process_incarnation
from kvcore.transport.builtin.shm_memory import _address_of, _close_fds, _Segment, check_sealed_memfd
from kvcore.transport.builtin.shm_protocol import (
    _CONNECT_BUSY_S,
    _CTL_BYTES,
    _FDS_PER_MESSAGE,
    _FETCH_TIMEOUT_S,
    _HEADER_WORDS,
    _LAYOUT_VERSION,
    _MAGIC,
    _MAX_REPLY_BYTES,
    _W_ALIVE,
    _W_MAGIC,
    _W_VERSION,
    _encoder,
    _FdRequest,
    _Payload,
    _peer_pid,
    _reply_decoder,
)

log = logging.getLogger("kvcore.shm")


def _connect_fds(who: str, fds_name: str) -> socket.socket:
    """A connection to a peer's fd socket; ``PeerLostError`` only when nobody is there.

    ECONNREFUSED and ENOENT mean no process listens under that name: the peer closed or died. EAGAIN means the
    listen backlog is full: the owner is alive but has not accepted yet (a flood of idle connections, or a loaded
    box), so it is retried until ``_CONNECT_BUSY_S`` and then is a ``TransferTimeoutError``. Any other error is a
    ``TransferFailedError`` naming it: the peer may well be alive.
    """
    deadline = time.monotonic() + _CONNECT_BUSY_S
    pause = 0.001
    attempts = 0
    while True:
        attempts += 1
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        conn.settimeout(_FETCH_TIMEOUT_S)
        try:
            conn.connect(b"\0" + fds_name.encode())
            return conn
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            conn.close()
            raise PeerLostError(f"{who}: its shm socket is gone ({exc}); the peer agent closed or died") from exc
        except BlockingIOError as exc:
            conn.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(
                    f"{who}: its shm socket's listen backlog stayed full for {_CONNECT_BUSY_S:g} s "
                    f"({attempts} attempts, last: {exc}); the peer is alive but does not accept"
                ) from exc
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)
        except TimeoutError as exc:
            conn.close()
            raise TransferTimeoutError(f"{who}: connecting to its shm socket timed out ({exc})") from exc
        except OSError as exc:
            conn.close()
            raise TransferFailedError(f"{who}: connecting to its shm socket failed ({exc})") from exc


@dataclass(eq=False)
class _Peer:
    """What we keep per loaded peer: its identity, and once fetched its connection, control block and segments."""

    name: str
    incarnation: str
    pid: int
    fds_name: str
    notify: bytes
    payload: _Payload
    conn: socket.socket | None = None
    ctl_mm: mmap.mmap | None = None
    ctl_words: np.ndarray | None = None
    segments: dict[int, _Segment] = field(default_factory=dict)
    unshared: set[int] = field(default_factory=set)  # listed, but the owner no longer shares them (no live export)
    seg_base: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    seg_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    seg_local: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    reg_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    reg_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    reg_slot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    reg_token: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))

    @property
    def fetched(self) -> bool:
        """True when every segment the current descriptor lists is mapped here."""
        return self.ctl_words is not None and all(
            s.id in self.segments or s.id in self.unshared for s in self.payload.segments
        )

    def hung_up(self) -> bool:
        """True when the owner closed the connection that carried its fds (it never sends unsolicited data)."""
        if self.conn is None:
            return False
        p = select.poll()
        p.register(self.conn, select.POLLIN | select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0))
        return bool(p.poll(0))

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments = {}
        self.ctl_words = None  # drop the buffer export before unmapping
        if self.ctl_mm is not None:
            try:
                self.ctl_mm.close()
            except BufferError:  # pragma: no cover - a view escaped; the GC unmaps it
                log.warning("kvcore shm: control block of %r still in use; left to the garbage collector", self.name)
            self.ctl_mm = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _still_alive(old: _Peer) -> bool:
    """Whether a loaded peer may still be serving: its connection is up, or its socket still accepts."""
    if old.conn is not None:
        return not old.hung_up()
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(b"\0" + old.fds_name.encode())
        return True
    except BlockingIOError:  # a full backlog: someone is there, only busy
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _index(peer: _Peer) -> None:
    """Rebuild the lookup arrays from the mapped segments and the descriptor's exports."""
    segs = sorted(peer.segments.values(), key=lambda s: s.base)
    peer.seg_base = np.array([s.base for s in segs], dtype=np.uint64)
    peer.seg_end = np.array([s.base + s.size for s in segs], dtype=np.uint64)
    peer.seg_local = np.array([s.local for s in segs], dtype=np.uint64)
    exports = sorted(peer.payload.exports, key=lambda e: e.address)
    peer.reg_start = np.array([e.address for e in exports], dtype=np.uint64)
    peer.reg_end = np.array([e.address + e.length for e in exports], dtype=np.uint64)
    peer.reg_slot = np.array([e.slot for e in exports], dtype=np.int64)
    peer.reg_token = np.array([e.token for e in exports], dtype=np.uint64)


def _fetch(client: str, remote: RemoteAgent) -> None:
    """Get the peer's control block and segments as sealed memfds over its socket, check them and map them.

    ``client`` is the name of the agent asking (stated in the request; the owner serves only agents it loaded).
    """
    peer: _Peer = remote.native
    who = f"peer {peer.name!r} (pid {peer.pid})"
    if peer.conn is None:
        conn = _connect_fds(who, peer.fds_name)
        served_by = _peer_pid(conn)
        if served_by != peer.pid:
            conn.close()
            raise RemoteAgentError(
                f"{who}: the socket its descriptor names is served by pid {served_by}, not {peer.pid}; refused"
            )
        peer.conn = conn
    received: list[int] = []
    try:
        request = _FdRequest(client, process_incarnation(), peer.name, peer.incarnation)
        peer.conn.send(_encoder.encode(request))
        data, fds, flags, _ = socket.recv_fds(peer.conn, _MAX_REPLY_BYTES, _FDS_PER_MESSAGE + 3)
        received += fds
        if not data:
            raise PeerLostError(f"{who}: closed the connection instead of answering; the peer agent closed or died")
        check_msgpack_bounds(data, error=RemoteAgentError)
        try:
            reply = _reply_decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise RemoteAgentError(f"{who}: malformed fd reply: {exc}") from exc
        if not reply.ok:
            raise RemoteAgentError(f"{who} refused to share its memory: {reply.error}")
        if (reply.server, reply.incarnation) != (peer.name, peer.incarnation):
            raise RemoteAgentError(
                f"{who}: the process behind the socket is agent {reply.server!r} (incarnation "
                f"{reply.incarnation[:8]}), not the one the descriptor names; refused"
            )
        while len(received) < 1 + len(reply.segments) and not flags & socket.MSG_CTRUNC:
            _, more, flags, _ = socket.recv_fds(peer.conn, 16, _FDS_PER_MESSAGE + 3)
            if not more:
                break
            received += more
        if flags & socket.MSG_CTRUNC or len(received) != 1 + len(reply.segments):
            raise RemoteAgentError(
                f"{who}: sent {len(received)} fds for a control block and {len(reply.segments)} segments"
            )
        if peer.ctl_words is None:
            _map_control(who, peer, received[0])
        offered = {s.id: (s, fd) for s, fd in zip(reply.segments, received[1:])}
        for want in peer.payload.segments:
            if want.id in peer.segments:
                continue
            got = offered.get(want.id)
            if got is None:  # no live export in it any more: every fragment there is refused as stale
                peer.unshared.add(want.id)
                continue
            if (got[0].base, got[0].size) != (want.base, want.size):
                raise RemoteAgentError(
                    f"{who}: shared segment {want.id} at {got[0].base:#x} size {got[0].size}; its descriptor says "
                    f"{want.base:#x} size {want.size}"
                )
            check_sealed_memfd(got[1], want.size)
            # MAP_POPULATE: map every page now (paid once) rather than a minor fault per page in the first writes.
            mm = mmap.mmap(got[1], want.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            peer.segments[want.id] = _Segment(want.id, want.size, mm, _address_of(mm), want.base)
    except TimeoutError as exc:  # alive (it accepted) but silent: stopped or starved, not gone
        peer.conn.close()
        peer.conn = None
        raise TransferTimeoutError(
            f"{who}: accepted the connection but did not answer the fd request within {_FETCH_TIMEOUT_S:g} s"
        ) from exc
    except OSError as exc:
        peer.conn.close()
        peer.conn = None
        raise PeerLostError(f"{who}: fetching its memory failed: {exc}") from exc
    except KvcoreError:
        peer.conn.close()
        peer.conn = None
        raise
    finally:
        _close_fds(received)  # the mappings keep the memory; no fd of a peer stays open here
    _index(peer)


def _map_control(who: str, peer: _Peer, fd: int) -> None:
    check_sealed_memfd(fd, _CTL_BYTES)
    mm = mmap.mmap(fd, _CTL_BYTES)
    words = np.frombuffer(mm, dtype=np.uint64)
    if int(words[_W_MAGIC]) != _MAGIC or int(words[_W_VERSION]) != _LAYOUT_VERSION:
        del words
        mm.close()
        raise RemoteAgentError(f"{who}: its control block is not a kvcore shm control block of layout v2")
    peer.ctl_mm, peer.ctl_words = mm, words


def _check_alive(peer: _Peer) -> None:
    """Raise ``PeerLostError`` when the peer closed its agent or its process died."""
    assert peer.ctl_words is not None
    if int(peer.ctl_words[_W_ALIVE]) != 1:
        raise PeerLostError(f"peer {peer.name!r} (pid {peer.pid}) closed its shm agent")
    if peer.hung_up():
        raise PeerLostError(f"peer {peer.name!r} (pid {peer.pid}) died (its shm connection hung up)")


def _translate(peer_name: str, peer: _Peer, addrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Peer addresses -> addresses of our mappings, refusing any fragment outside a live export."""
    if addrs.size == 0:
        return addrs
    assert peer.ctl_words is not None
    # Stale-descriptor guard first (it needs only the control block): every export a fragment touches must
    # still carry the token we were given. The base class already confined fragments to listed exports.
    ends = addrs + sizes
    live = peer.ctl_words[_HEADER_WORDS + peer.reg_slot] == peer.reg_token
    dead_before = np.concatenate(([0], np.cumsum(~live)))
    lo = np.searchsorted(peer.reg_start, addrs, side="right").astype(np.int64) - 1
    hi = np.searchsorted(peer.reg_start, ends - 1, side="right").astype(np.int64) - 1
    stale = (lo < 0) | (dead_before[hi + 1] - dead_before[np.maximum(lo, 0)] > 0)
    if stale.any():
        i = int(np.flatnonzero(stale)[0])
        raise RemoteRangeError(
            f"fragment {i}: remote range [{int(addrs[i]):#x}, +{int(sizes[i])}) was deregistered by peer "
            f"{peer_name!r} ({int(stale.sum())} of {addrs.size} fragments affected); reload its descriptor; "
            "nothing was moved"
        )
    seg = np.searchsorted(peer.seg_base, addrs, side="right").astype(np.int64) - 1
    ok = seg >= 0
    seg = np.where(ok, seg, 0)
    ok &= ends <= peer.seg_end[seg] if peer.seg_end.size else np.zeros(addrs.size, dtype=bool)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise RemoteRangeError(
            f"fragment {i}: remote range [{int(addrs[i]):#x}, +{int(sizes[i])}) is not inside one shm segment "
            f"of peer {peer_name!r}; nothing was moved"
        )
    out: np.ndarray = peer.seg_local[seg] + (addrs - peer.seg_base[seg])
    return out
