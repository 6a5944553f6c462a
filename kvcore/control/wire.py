"""Control-plane messages: typed msgspec structs encoded as msgpack, never pickle.

Every message carries the protocol version ``v``; every frame is size-bounded;
a frame that does not decode into a known message raises ``MessageDecodeError``
(a typed error for that peer, never a crash of the listener). Durations on the
wire are relative (milliseconds), never absolute clock readings.
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Literal

import msgspec

from kvcore.errors import MessageDecodeError, MessageTooLargeError, ProtocolError, ProtocolVersionError
from kvcore.layout.mapping import RankPlacement
from kvcore.layout.page import PageTable
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology
from kvcore.msgbounds import MAX_CONTAINER_ENTRIES, MAX_DEPTH, MAX_ITEMS, cannot_exceed_bounds, check_msgpack_bounds
from kvcore.params import BytesId

__all__ = [
    "ResultStatus",
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
    "PullDone",
    "Renew",
    "Goodbye",
    "ExposeRequest",
    "Exposure",
    "RequestId",
    "Message",
    "encode",
    "decode",
    "parse_endpoint",
    "negotiate",
    "check_msgpack_bounds",
    "MAX_DEPTH",
    "MAX_CONTAINER_ENTRIES",
    "MAX_ITEMS",
]

#: The protocol version this build speaks, and the oldest it still accepts.
PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1

#: A writer's final word on its part of a request (``TransferResult.status``, ``PullDone.status``).
ResultStatus = Literal["ok", "failed", "cancelled"]

#: Bound on block ids in one request (a 1M-token prompt at 16 tokens per block).
MAX_BLOCKS_PER_REQUEST = 65536
MAX_U64 = 2**64 - 1

#: Ranks in one instance, and the longest name or endpoint string a peer may send.
MAX_RANKS = 65536
MAX_NAME_CHARS = 1024
MAX_ERROR_CHARS = 64 * 1024
#: A CURVE public key: 32 raw bytes (or empty: the peer runs without authentication).
CURVE_KEY_BYTES = 32
#: Bound on a native poster's descriptor in a registration (a NIXL agent's metadata, a UCX worker address).
MAX_LANE_DESCRIPTOR_BYTES = 1024 * 1024

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
ErrorText = Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)]
Nonce = Annotated[bytes, msgspec.Meta(max_length=64)]
Ticket = Annotated[bytes, msgspec.Meta(max_length=64)]
#: A request id: an int (0..2**64-1, checked in decode), a str, or bytes wrapped in ``BytesId`` (msgpack keeps
#: str and bytes apart, but one msgspec union cannot hold both); each at most 256 characters/bytes.
RequestId = int | Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | BytesId
#: Hard bound on an aux payload on the wire (the configured max_aux_bytes is at most this).
MAX_AUX_BYTES = 1024 * 1024
Aux = Annotated[bytes, msgspec.Meta(max_length=MAX_AUX_BYTES)]


class RankInfo(msgspec.Struct, frozen=True):
    """One rank's identity, geometry, page table, agent descriptor and endpoint; cached per peer."""

    instance_name: Name
    rank: int
    incarnation: Name
    protocol_version: int
    backend: Name
    endpoint: Name
    topology: Topology
    geometry: AttentionGeometry
    page_table: PageTable
    agent_descriptor: bytes
    pid: int = 0  # with host_id and start_time: lets a same-host peer prove a writer is dead (fenced)
    hostname: Name = ""  # for people reading logs; never used as a proof
    host_id: Name = ""  # kvcore.hostinfo.host_identity(): equal only where pids can be checked
    start_time: int = 0  # the process's start time in clock ticks since boot (pid reuse guard)
    mamba: MambaGeometry | None = None
    #: The CURVE public key (32 raw bytes) this rank's control socket serves with; empty without authentication.
    #: Learnt from an authenticated peer, it tells the other ranks of an instance which server key to expect.
    curve_public_key: Annotated[bytes, msgspec.Meta(max_length=CURVE_KEY_BYTES)] = b""

    @property
    def placement(self) -> RankPlacement:
        return RankPlacement(
            topology=self.topology, geometry=self.geometry, page_table=self.page_table, mamba=self.mamba
        )


class _Msg(msgspec.Struct, tag_field="t", frozen=True):
    v: int  # protocol version of the sender


class InstanceInfoRequest(_Msg, tag="instance_info_request", frozen=True):
    """gen -> ctx rank 0: send me your instance's RankInfos. Carries the range of versions the asker speaks."""

    min_version: int
    max_version: int
    asker: Name  # "instance/rank" of the generation rank, for logs


class InstanceInfo(_Msg, tag="instance_info", frozen=True):
    """ctx rank 0 -> gen: every context rank's RankInfo (or an error explaining the refusal).

    Public parts only: no agent descriptor, pid, start time or host id (each rank gives its own in the
    ``RegisterResult`` that accepts a generation rank).
    """

    instance_name: Name
    ranks: Annotated[list[RankInfo], msgspec.Meta(max_length=MAX_RANKS)]
    error: ErrorText = ""


class RegisterRankInfo(_Msg, tag="register_rank_info", frozen=True):
    """gen -> each overlapping ctx rank: my RankInfo; load my agent descriptor."""

    info: RankInfo
    #: With ``config.native_lane``: this rank's native poster descriptor (``kvcore.transceiver.native``), so that
    #: the context rank may serve its common requests on its lane; empty: the Python path only.
    lane: Annotated[bytes, msgspec.Meta(max_length=MAX_LANE_DESCRIPTOR_BYTES)] = b""


class RegisterResult(_Msg, tag="register_result", frozen=True):
    """ctx -> gen: whether the registration was accepted; ``error`` names every incompatible field."""

    ctx_rank: int
    ok: bool
    error_kind: Name = ""
    error: ErrorText = ""
    #: With ``ok``: the context rank's own RankInfo, its agent descriptor identity-only (no key to its memory;
    #: empty where the transport needs none), with the pid and start time that let a same-host receiver fence it.
    info: RankInfo | None = None
    #: With ``ok`` and a lane for this generation rank: where to ask (``tcp://host:port``), the token to present,
    #: and the lane's CurveZMQ public key (32 bytes; empty: the lane speaks no CURVE). Empty: the Python path only.
    lane_endpoint: Name = ""
    lane_token: Annotated[bytes, msgspec.Meta(max_length=16)] = b""
    lane_key: Annotated[bytes, msgspec.Meta(max_length=CURVE_KEY_BYTES)] = b""


class ExposeRequest(_Msg, tag="expose_request", frozen=True):
    """gen -> ctx rank (pull mode): give me access to your memory to read request ``request_id``, whose ticket
    I present. Sent once per context rank, before the first read from it."""

    request_id: RequestId
    gen_instance: Name
    gen_rank: int
    gen_incarnation: Name
    ticket: Ticket
    nonce: Nonce  # echoed by the answer


class Exposure(_Msg, tag="exposure", frozen=True):
    """ctx rank -> gen rank: the answer to ``ExposeRequest``: this rank's full agent descriptor, or the refusal."""

    request_id: RequestId
    ctx_rank: int
    ctx_incarnation: Name
    nonce: Nonce
    agent_descriptor: bytes = b""
    error_kind: Name = ""
    error: ErrorText = ""


class RequestData(_Msg, tag="request_data", frozen=True):
    """gen -> ctx rank: write request ``request_id`` into these destination blocks."""

    request_id: RequestId
    gen_instance: Name
    gen_rank: int
    gen_incarnation: Name
    block_ids: bytes  # little-endian int64 (empty when group_block_ids is used)
    state_slot: int = -1  # one slot per request for state pools (Mamba); -1: none
    prompt_len: int = -1
    timeout_ms: int = 60_000
    bounce_addr: int = 0  # nonzero: write the packed fragments here (a lease in the receiver's arena)
    bounce_bytes: int = 0
    bounce_digest: bytes = b""  # kvcore.transport.bounce.plan_digest of the receiver's view of the unmerged plan
    ctx_incarnation: Name = ""  # the context incarnation the receiver believes it asks
    nonce: Nonce = b""  # the receiver's secret for this request: every answer echoes it, its cancels carry it
    ticket: Ticket = b""  # the request's ticket from the context's TransferParams

    group_block_ids: dict[Name, bytes] = msgspec.field(default_factory=dict)  # layer group -> little-endian int64
    #: Leading prompt tokens the receiver holds already (its cached prefix); 0: its blocks cover the whole prompt.
    cached_tokens: int = 0


class TransferResult(_Msg, tag="transfer_result", frozen=True):
    """ctx rank -> gen rank: the outcome of one writer's part of a request (exactly one per writer)."""

    request_id: RequestId
    ctx_rank: int
    ctx_incarnation: Name
    status: ResultStatus
    nbytes: int = 0
    fragments: int = 0
    error_kind: Name = ""
    error: ErrorText = ""
    bounced: bool = False  # the bytes sit packed in the bounce lease; the receiver must scatter them
    nonce: Nonce = b""  # echo of RequestData.nonce: the receiver ignores answers without it
    in_doubt: bool = False  # "failed" at the writer's deadline while the write may still land; a final result follows
    aux: Aux = b""  # with "ok": the request's aux payload from this context rank (first token, draft tokens...)


class Cancel(_Msg, tag="cancel", frozen=True):
    """Either direction: the sender cancelled ``request_id``."""

    request_id: RequestId
    instance: Name
    rank: int
    reason: ErrorText = ""
    nonce: Nonce = b""  # the RequestData.nonce of the request being cancelled (generation -> context)
    ticket: Ticket = b""  # a decline (no nonce: never asked) proves it may speak for the request with its ticket
    #: A refusal (generation -> context, with the ticket): the kvcore error class for which the receiver refused
    #: the context instance or was refused by it; the context ends the request FAILED with it at once.
    refusal: Name = ""


class ErrorReply(_Msg, tag="error", frozen=True):
    """Answer to a frame that could not be processed; ``kind`` is the kvcore error class name."""

    kind: Name
    error: ErrorText
    request_id: RequestId = -1


class PullDone(_Msg, tag="pull_done", frozen=True):
    """gen -> ctx rank (pull mode): my read of your blocks ended; you may let go of them for me.

    The context answers with the receiver's final TransferResult (echoing ``nonce``): "ok" only if it still held
    the request's blocks, unchanged, for the whole read (its lease had not run out).
    """

    request_id: RequestId
    gen_instance: Name
    gen_rank: int
    gen_incarnation: Name
    ticket: Ticket
    nonce: Nonce
    status: ResultStatus
    ctx_incarnation: Name
    blocks_digest: Nonce = b""  # digest of the context blocks and state slot the receiver read (kvcore.params)
    nbytes: int = 0
    fragments: int = 0
    error_kind: Name = ""
    error: ErrorText = ""
    prompt_len: int = -1  # the prompt length the receiver read for (-1: unknown); the context compares its own


class Renew(_Msg, tag="renew", frozen=True):
    """gen -> ctx rank: keep request ``request_id`` for me (a lease renewal while I wait to receive it)."""

    request_id: RequestId
    gen_instance: Name
    gen_rank: int
    gen_incarnation: Name
    ticket: Ticket
    nonce: Nonce  # a failure answer (lease already gone) echoes it


class Goodbye(_Msg, tag="goodbye", frozen=True):
    """Either direction: this rank is closing its transceiver (an orderly shutdown, not a crash).

    The peer takes it as final only together with the connection dropping (which a stranger cannot cause), so a
    forged goodbye changes nothing; with it, a closed peer is let go at once instead of after
    ``peer_lost_timeout_s`` of silence.
    """

    instance: Name
    rank: int
    incarnation: Name


Message = (
    InstanceInfoRequest
    | InstanceInfo
    | RegisterRankInfo
    | RegisterResult
    | RequestData
    | TransferResult
    | Cancel
    | ErrorReply
    | PullDone
    | Renew
    | Goodbye
    | ExposeRequest
    | Exposure
)


class _VersionProbe(msgspec.Struct):
    """Only the ``v`` of a frame that did not decode as any known message (unknown fields are skipped)."""

    v: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_probe = msgspec.msgpack.Decoder(_VersionProbe)


def encode(msg: Message) -> bytes:
    """Encode a message to msgpack bytes."""
    return _encoder.encode(msg)


def decode(frame: bytes, max_bytes: int = 16 * 1024 * 1024) -> Message:
    """Decode one frame; any input raises only ``ProtocolError`` subclasses (oversize, malformed, unknown, version).

    The raw bytes are walked first (``check_msgpack_bounds``): nesting depth,
    entries per container, objects per frame and every declared length are
    bounded before msgspec allocates anything, so no frame can exhaust the
    stack (a RecursionError used to escape here) or memory. A frame too small
    to break any bound (``cannot_exceed_bounds``) is left to msgspec's own
    checks of truncated, reserved and trailing bytes.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise MessageDecodeError(f"control frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise MessageTooLargeError(f"control frame of {len(frame)} bytes exceeds the {max_bytes}-byte bound")
    if not isinstance(frame, bytes):
        frame = bytes(frame)
    # A frame too small to break a bound (every RequestData or TransferResult of a few blocks) skips the walk:
    # msgspec itself refuses what is malformed, and such a frame cannot nest deep enough to exhaust its stack.
    if not cannot_exceed_bounds(frame):
        check_msgpack_bounds(frame, error=MessageDecodeError, what=f"malformed control frame ({len(frame)} bytes)")
    try:
        msg = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        version = _peek_version(frame)
        if version is not None and not (MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION):
            raise ProtocolVersionError(
                f"peer speaks protocol version {version}; this kvcore speaks {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"
            ) from exc
        raise MessageDecodeError(f"malformed control frame ({len(frame)} bytes): {exc}") from exc
    except Exception as exc:  # a bug in a __post_init__ or in msgspec must still be this peer's error
        raise MessageDecodeError(
            f"control frame ({len(frame)} bytes) could not be decoded: {type(exc).__name__}: {exc}"
        ) from exc
    if not (MIN_PROTOCOL_VERSION <= msg.v <= PROTOCOL_VERSION):
        raise ProtocolVersionError(
            f"{type(msg).__name__} has protocol version {msg.v}; this kvcore speaks {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"
        )
    try:
        _validate(msg)
    except ProtocolError:
        raise
    except Exception as exc:
        raise MessageDecodeError(f"{type(msg).__name__} failed validation: {type(exc).__name__}: {exc}") from exc
    return msg


def _peek_version(frame: bytes) -> int | None:
    try:
        return _probe.decode(frame).v
    except Exception:
        return None


def _validate(msg: Message) -> None:
    rid = getattr(msg, "request_id", None)
    if isinstance(rid, int) and not (0 <= rid <= MAX_U64) and not (isinstance(msg, ErrorReply) and rid == -1):
        raise MessageDecodeError(f"{type(msg).__name__}.request_id {rid} is outside 0..2**64-1")
    if isinstance(msg, RequestData):
        if msg.group_block_ids:
            from kvcore.layout.blocks import decode_group_ids

            decode_group_ids(msg.group_block_ids, max_blocks=MAX_BLOCKS_PER_REQUEST)
        if len(msg.block_ids) % 8 or len(msg.block_ids) > 8 * MAX_BLOCKS_PER_REQUEST:
            raise MessageDecodeError(
                f"block_ids must be little-endian int64 and at most {MAX_BLOCKS_PER_REQUEST} entries, "
                f"got {len(msg.block_ids)} bytes"
            )
        if msg.timeout_ms <= 0:
            raise MessageDecodeError(f"timeout_ms must be > 0, got {msg.timeout_ms}")
        if msg.bounce_addr < 0 or msg.bounce_bytes < 0 or len(msg.bounce_digest) > 64:
            raise MessageDecodeError("bounce_addr/bounce_bytes must be >= 0 and bounce_digest at most 64 bytes")
    elif isinstance(msg, RegisterRankInfo):
        _validate_rank_info(msg.info)
    elif isinstance(msg, InstanceInfo):
        for info in msg.ranks:
            _validate_rank_info(info)
    elif isinstance(msg, RegisterResult) and msg.info is not None:
        _validate_rank_info(msg.info)


def _validate_rank_info(info: RankInfo) -> None:
    parse_endpoint(info.endpoint)
    if len(info.curve_public_key) not in (0, CURVE_KEY_BYTES):
        raise MessageDecodeError(
            f"RankInfo.curve_public_key: expected 0 or {CURVE_KEY_BYTES} bytes, got {len(info.curve_public_key)}"
        )


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
    if len(endpoint) > 300:
        raise ProtocolError(
            f"endpoint {endpoint[:64]!r}... ({len(endpoint)} characters) is not of the form tcp://host:port"
        )
    return _parse_endpoint(endpoint)


@functools.lru_cache(maxsize=256)  # every message sent parses its endpoint: the few peers a rank has, parsed once
def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    m = _ENDPOINT_RE.match(endpoint)
    if not m or not (0 < int(m.group("port")) <= 65535):
        raise ProtocolError(f"endpoint {endpoint!r} is not of the form tcp://host:port")
    return m.group("host"), int(m.group("port"))
