"""What shm agents tell each other: the descriptor payload, the fd request and reply, the control block's layout.

Every struct is msgpack with size bounds (``Name``, list lengths), decoded only after ``check_msgpack_bounds``.
The constants are the limits both sides enforce and the Linux sealing flags (Python 3.11's fcntl may lack them).
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
from typing import Annotated

import msgspec

_SOCK_RE = re.compile(r"\Akvcore-shm-[0-9]{1,10}-[0-9a-f]{8}-[0-9]{1,10}-(fds|notify)\Z")
_MAX_SEGMENT_BYTES = 1 << 40
_MAX_SEGMENTS = 4096
_MAX_NOTIFICATION_BYTES = 60 * 1024  # one datagram, well under the default socket buffer
_MAX_REQUEST_BYTES = 4096
_MAX_REPLY_BYTES = 1 << 20
_FDS_PER_MESSAGE = 250  # the kernel passes at most SCM_MAX_FD (253) fds in one message
_FETCH_TIMEOUT_S = 10.0
# How long a full listen backlog (EAGAIN: the owner is alive but has not accepted yet, e.g. under a connection
# flood or a loaded box) is retried before the fetch gives up with a TransferTimeoutError, not PeerLostError.
_CONNECT_BUSY_S = 10.0
_MAX_SERVER_CONNECTIONS = 1024

# Sealing constants (Linux); Python 3.11's fcntl may lack them.
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1024 + 9)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1024 + 10)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)
_MFD_FLAGS = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

# Control block: uint64 words. The header is followed by one token per export slot.
_MAGIC = 0x6B76636F72657368  # b"kvcoresh"
_LAYOUT_VERSION = 2
_W_MAGIC, _W_VERSION, _W_ALIVE, _W_PID = 0, 1, 2, 3
_HEADER_WORDS = 8
_SLOTS = 4096
_CTL_BYTES = 8 * (_HEADER_WORDS + _SLOTS)


Name = Annotated[str, msgspec.Meta(max_length=1024)]


class _SegmentInfo(msgspec.Struct, array_like=True, frozen=True):
    id: int
    base: int  # address of the segment in the owner process
    size: int


class _ExportInfo(msgspec.Struct, array_like=True, frozen=True):
    address: int
    length: int
    slot: int
    token: int


class _Payload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The shm part of the descriptor: the owner's pid, its two sockets, its segments and exports (no file names)."""

    pid: int
    fds: Name  # abstract SOCK_SEQPACKET socket serving the memfds
    notify: Name  # abstract SOCK_DGRAM socket receiving notifications
    segments: Annotated[list[_SegmentInfo], msgspec.Meta(max_length=_MAX_SEGMENTS)]
    exports: Annotated[list[_ExportInfo], msgspec.Meta(max_length=_SLOTS)]
    host: Name = ""  # kvcore.hostinfo.host_identity() of the owner: a peer on another host is refused at load
    hostname: Name = ""  # for the error message only
    version: int = 1  # _PAYLOAD_VERSION of the owner's kvcore; checked at load


class _FdRequest(msgspec.Struct, array_like=True, frozen=True):
    """Client -> owner: I am agent ``client`` (``incarnation``); send me the memory of ``server``."""

    client: Name
    incarnation: Name
    server: Name
    server_incarnation: Name


class _FdReply(msgspec.Struct, array_like=True, frozen=True):
    """Owner -> client: who answers, and the segment behind each fd that follows the control block's fd."""

    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=4096)]
    server: Name
    incarnation: Name
    segments: Annotated[list[_SegmentInfo], msgspec.Meta(max_length=_MAX_SEGMENTS)]


_payload_decoder = msgspec.msgpack.Decoder(_Payload)
_PAYLOAD_VERSION = 1  # of _Payload; a peer with another one is refused at load
_request_decoder = msgspec.msgpack.Decoder(_FdRequest)
_reply_decoder = msgspec.msgpack.Decoder(_FdReply)
_notif_decoder = msgspec.msgpack.Decoder(tuple[str, bytes])
_encoder = msgspec.msgpack.Encoder()


def _peer_pid(sock: socket.socket) -> int:
    """The pid the kernel recorded for the other end of a connected UNIX socket (``SO_PEERCRED``)."""
    pid, _uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(pid)
