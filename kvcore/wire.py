"""Control-plane messages: typed msgspec structs encoded as msgpack, never pickle.

Every message carries the protocol version ``v``; every frame is size-bounded;
a frame that does not decode into a known message raises ``MessageDecodeError``
(a typed error for that peer, never a crash of the listener). Durations on the
wire are relative (milliseconds), never absolute clock readings.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from kvcore.errors import MessageDecodeError, MessageTooLargeError, ProtocolError, ProtocolVersionError
from kvcore.mapping import RankLayout
from kvcore.page import PageTable
from kvcore.topology import AttentionGeometry, MambaGeometry, Topology

__all__ = [
    "PROTOCOL_VERSION",
    "MIN_PROTOCOL_VERSION",
    "RankInfo",
    "InstanceInfoRequest",
    "InstanceInfo",
    "RegisterRankInfo",
    "RegisterResult",
    "RequestData",
    "TransferResult",
    "Cancel",
    "ErrorReply",
    "Message",
    "encode",
    "decode",
    "parse_endpoint",
    "negotiate",
]

#: The protocol version this build speaks, and the oldest it still accepts.
PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1

#: Bound on block ids in one request (a 1M-token prompt at 16 tokens per block).
MAX_BLOCKS_PER_REQUEST = 65536
MAX_U64 = 2**64 - 1


class RankInfo(msgspec.Struct, frozen=True):
    """One rank's identity, geometry, page table, agent descriptor and endpoint; cached per peer."""

    instance_name: str
    rank: int
    incarnation: str
    protocol_version: int
    backend: str
    endpoint: str
    topology: Topology
    geometry: AttentionGeometry
    page_table: PageTable
    agent_descriptor: bytes
    pid: int = 0  # with host_id and start_time: lets a same-host peer prove a writer is dead (fenced)
    hostname: str = ""  # for people reading logs; never used as a proof
    host_id: str = ""  # kvcore.hostinfo.host_identity(): equal only where pids can be checked
    start_time: int = 0  # the process's start time in clock ticks since boot (pid reuse guard)
    mamba: MambaGeometry | None = None

    @property
    def layout(self) -> RankLayout:
        return RankLayout(topology=self.topology, geometry=self.geometry, page_table=self.page_table, mamba=self.mamba)


class _Msg(msgspec.Struct, tag_field="t", frozen=True):
    v: int  # protocol version of the sender


class InstanceInfoRequest(_Msg, tag="instance_info_request", frozen=True):
    """gen -> ctx rank 0: send me your instance's RankInfos. Carries the range of versions the asker speaks."""

    min_version: int
    max_version: int
    asker: str  # "instance/rank" of the generation rank, for logs


class InstanceInfo(_Msg, tag="instance_info", frozen=True):
    """ctx rank 0 -> gen: every context rank's RankInfo (or an error explaining the refusal)."""

    instance_name: str
    ranks: list[RankInfo]
    error: str = ""


class RegisterRankInfo(_Msg, tag="register_rank_info", frozen=True):
    """gen -> each overlapping ctx rank: my RankInfo; load my agent descriptor."""

    info: RankInfo


class RegisterResult(_Msg, tag="register_result", frozen=True):
    """ctx -> gen: whether the registration was accepted; ``error`` names every incompatible field."""

    ctx_rank: int
    ok: bool
    error_kind: str = ""
    error: str = ""


class RequestData(_Msg, tag="request_data", frozen=True):
    """gen -> ctx rank: write request ``request_id`` into these destination blocks."""

    request_id: int
    gen_instance: str
    gen_rank: int
    gen_incarnation: str
    block_ids: bytes  # little-endian int64
    state_slot: int = -1  # one slot per request for state pools (Mamba); -1: none
    prompt_len: int = -1
    timeout_ms: int = 60_000
    bounce_addr: int = 0  # nonzero: write the packed fragments here (a lease in the receiver's arena)
    bounce_bytes: int = 0
    bounce_digest: bytes = b""  # kvcore.bounce.plan_digest of the receiver's view of the unmerged plan
    ctx_incarnation: str = ""  # the context incarnation the receiver believes it asks
    nonce: bytes = b""  # the receiver's secret for this request: every answer echoes it, its cancels carry it


class TransferResult(_Msg, tag="transfer_result", frozen=True):
    """ctx rank -> gen rank: the outcome of one writer's part of a request (exactly one per writer)."""

    request_id: int
    ctx_rank: int
    ctx_incarnation: str
    status: Literal["ok", "failed", "cancelled"]
    nbytes: int = 0
    fragments: int = 0
    error_kind: str = ""
    error: str = ""
    bounced: bool = False  # the bytes sit packed in the bounce lease; the receiver must scatter them
    nonce: bytes = b""  # echo of RequestData.nonce: the receiver ignores answers without it
    in_doubt: bool = False  # "failed" at the writer's deadline while the write may still land; a final result follows


class Cancel(_Msg, tag="cancel", frozen=True):
    """Either direction: the sender cancelled ``request_id``."""

    request_id: int
    instance: str
    rank: int
    reason: str = ""
    nonce: bytes = b""  # the RequestData.nonce of the request being cancelled (generation -> context)


class ErrorReply(_Msg, tag="error", frozen=True):
    """Answer to a frame that could not be processed; ``kind`` is the kvcore error class name."""

    kind: str
    error: str
    request_id: int = -1


Message = (
    InstanceInfoRequest
    | InstanceInfo
    | RegisterRankInfo
    | RegisterResult
    | RequestData
    | TransferResult
    | Cancel
    | ErrorReply
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)  # type: ignore[arg-type]
_probe = msgspec.msgpack.Decoder(dict[str, Any])


def encode(msg: Message) -> bytes:
    """Encode a message to msgpack bytes."""
    return _encoder.encode(msg)


def decode(frame: bytes, max_bytes: int = 16 * 1024 * 1024) -> Message:
    """Decode one frame; typed errors for oversize, malformed, unknown or wrong-version frames."""
    if len(frame) > max_bytes:
        raise MessageTooLargeError(f"control frame of {len(frame)} bytes exceeds the {max_bytes}-byte bound")
    try:
        msg = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        version = _peek_version(frame)
        if version is not None and not (MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION):
            raise ProtocolVersionError(
                f"peer speaks protocol version {version}; this kvcore speaks {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"
            ) from exc
        raise MessageDecodeError(f"malformed control frame ({len(frame)} bytes): {exc}") from exc
    if not (MIN_PROTOCOL_VERSION <= msg.v <= PROTOCOL_VERSION):
        raise ProtocolVersionError(
            f"{type(msg).__name__} has protocol version {msg.v}; this kvcore speaks {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"
        )
    _validate(msg)
    return msg


def _peek_version(frame: bytes) -> int | None:
    try:
        v = _probe.decode(frame).get("v")
    except Exception:
        return None
    return v if isinstance(v, int) else None


def _validate(msg: Message) -> None:
    if isinstance(msg, RequestData):
        if not (0 <= msg.request_id <= MAX_U64):
            raise MessageDecodeError(f"request_id {msg.request_id} is outside 0..2**64-1")
        if len(msg.block_ids) % 8 or len(msg.block_ids) > 8 * MAX_BLOCKS_PER_REQUEST:
            raise MessageDecodeError(
                f"block_ids must be little-endian int64 and at most {MAX_BLOCKS_PER_REQUEST} entries, "
                f"got {len(msg.block_ids)} bytes"
            )
        if msg.timeout_ms <= 0:
            raise MessageDecodeError(f"timeout_ms must be > 0, got {msg.timeout_ms}")
        if msg.bounce_addr < 0 or msg.bounce_bytes < 0 or len(msg.bounce_digest) > 64:
            raise MessageDecodeError("bounce_addr/bounce_bytes must be >= 0 and bounce_digest at most 64 bytes")
        if len(msg.nonce) > 64 or len(msg.ctx_incarnation) > 64:
            raise MessageDecodeError("nonce and ctx_incarnation must be at most 64 bytes")
    elif isinstance(msg, RegisterRankInfo):
        parse_endpoint(msg.info.endpoint)
    elif isinstance(msg, InstanceInfo):
        for info in msg.ranks:
            parse_endpoint(info.endpoint)


def negotiate(min_version: int, max_version: int) -> int:
    """The highest protocol version both sides speak, or ``ProtocolVersionError`` naming both ranges."""
    best = min(max_version, PROTOCOL_VERSION)
    if best < max(min_version, MIN_PROTOCOL_VERSION):
        raise ProtocolVersionError(
            f"no common protocol version: peer speaks {min_version}..{max_version}, "
            f"this kvcore speaks {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"
        )
    return best


_ENDPOINT_RE = re.compile(r"\Atcp://(?P<host>[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})\Z")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Strictly parse a peer-supplied ``tcp://host:port``; anything else is a ``ProtocolError``."""
    if not isinstance(endpoint, str):
        raise ProtocolError(f"endpoint must be a string, got {type(endpoint).__name__}")
    m = _ENDPOINT_RE.match(endpoint)
    if not m or not (0 < int(m.group("port")) <= 65535):
        raise ProtocolError(f"endpoint {endpoint!r} is not of the form tcp://host:port")
    return m.group("host"), int(m.group("port"))
