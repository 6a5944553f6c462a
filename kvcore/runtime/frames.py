"""The frames of a rank pipe: one tagged msgspec struct per kind, msgpack-encoded, never pickle.

Every frame travels as a 4-byte big-endian length and one msgpack-encoded :data:`Frame`. The target, its
keyword arguments and every message travel that way, so they must be msgpack types (maps, lists, str, bytes,
numbers, bools, None).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["MAX_FRAME", "Call", "Failure", "Frame", "Message", "Reply", "Start", "decode", "encode"]

#: Largest frame either side accepts (a peer's whole buffer read back, in the transport tests).
MAX_FRAME = 512 * 1024 * 1024


class Start(msgspec.Struct, tag="start", forbid_unknown_fields=True):
    """Parent -> child, first frame: what to run (``module:function``), its keyword arguments, the environment."""

    target: str
    name: str
    kwargs: dict[str, Any]
    env: dict[str, str] = {}
    path: list[str] = []


class Call(msgspec.Struct, tag="call", forbid_unknown_fields=True):
    """Parent -> child: run command ``op``; ``reply`` False: send back nothing unless it fails."""

    op: str
    args: dict[str, Any]
    reply: bool = True


class Reply(msgspec.Struct, tag="reply", forbid_unknown_fields=True):
    """Child -> parent: the result of command ``op``."""

    op: str
    result: dict[str, Any]


class Failure(msgspec.Struct, tag="failure", forbid_unknown_fields=True):
    """Child -> parent: ``op`` (a command, or ``main``) raised; the child's exception, named and traced."""

    op: str
    error_type: str
    message: str
    trace: str = ""


class Message(msgspec.Struct, tag="message", forbid_unknown_fields=True):
    """Either direction: an application message (a map), outside the command/reply pairs."""

    body: dict[str, Any]


Frame = Start | Call | Reply | Failure | Message
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode(frame: Frame) -> bytes:
    """The frame's msgpack body (without the length prefix)."""
    return _encoder.encode(frame)


def decode(data: bytes) -> Frame:
    """A frame from its msgpack body; ``msgspec.DecodeError`` if it is not one."""
    return _decoder.decode(data)
