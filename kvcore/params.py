"""Transfer parameters: what the context side hands the engine for the generation side, and request ids.

``Transceiver.start_send`` returns a :class:`TransferParams`; the engine
forwards it, as it is, to the generation instance (vLLM's
``kv_transfer_params``, a router's JSON, an HTTP header) and passes it to
``start_receive``. It names the context instance (its info endpoint and
attention-DP rank), the request, the transfer mode, the request's **ticket**
(an unguessable secret: the context serves the request only to a receiver that
presents it) and, in pull mode, the context's blocks to read.

``to_dict``/``from_dict`` give a JSON-safe form (only str, int and lists);
``to_json``/``from_json`` a compact string. Every field is checked on the way
in: parameters come from another process, so nothing in them is trusted.
"""

from __future__ import annotations

import binascii
import hashlib
import os
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, TypeGuard, get_args

import msgspec
import numpy as np

from kvcore import errors as E

__all__ = [
    "RequestId",
    "TransferMode",
    "RoleName",
    "is_transfer_mode",
    "is_role_name",
    "BytesId",
    "InternalId",
    "internal_id",
    "api_id",
    "TransferParams",
    "new_ticket",
    "derive_ticket",
    "check_request_id",
    "check_ticket",
    "MAX_REQUEST_ID_CHARS",
    "TICKET_BYTES",
]

#: A request id on the API and the wire: an integer in 0..2**64-1, a str, or bytes (at most 256 characters/bytes).
#: How a request's KV moves: the context writes it into the receiver (push) or the receiver reads it (pull).
TransferMode = Literal["push", "pull"]
#: The two sides of a transfer: the prefill (context) instance and the decode (generation) instance.
RoleName = Literal["context", "generation"]


def is_transfer_mode(value: object) -> TypeGuard[TransferMode]:
    """Whether ``value`` names a transfer mode ("push" or "pull")."""
    return value in get_args(TransferMode)


def is_role_name(value: object) -> TypeGuard[RoleName]:
    """Whether ``value`` names a role ("context" or "generation")."""
    return value in get_args(RoleName)


RequestId = int | str | bytes

MAX_REQUEST_ID_CHARS = 256
MAX_U64 = 2**64 - 1
#: Bytes of a ticket kvcore makes; tickets given by an engine may be 16..64 bytes.
TICKET_BYTES = 16
_MIN_TICKET, _MAX_TICKET = 16, 64
#: Bound on the context block ids a TransferParams may carry (a 1M-token prompt at 16 tokens per block).
MAX_PARAM_BLOCKS = 65536
PARAMS_VERSION = 1
#: Bound on transfer parameters as JSON (65536 ids of 20 digits, with room to spare), checked before parsing.
MAX_PARAMS_JSON_BYTES = 4 * 1024 * 1024
#: What ``from_json`` parses: one object whose values nest no deeper than ``group_block_ids`` (a map of lists of
#: ints). A typed decode refuses a deeper value at its first bracket, so hostile nesting never recurses.
_JsonForm = dict[str, int | str | list[int] | dict[str, list[int]]]


class BytesId(msgspec.Struct, frozen=True, array_like=True):
    """A bytes request id inside kvcore and on the wire; the engine API gives and takes the plain bytes."""

    b: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]

    def __repr__(self) -> str:
        return repr(self.b)


#: A request id as kvcore keeps it internally (bytes wrapped); see ``internal_id`` and ``api_id``.
InternalId = int | str | BytesId


def internal_id(request_id: Any) -> InternalId:
    """Check an API request id and return the form kvcore keys sessions by (bytes become ``BytesId``)."""
    rid = check_request_id(request_id)
    return BytesId(rid) if isinstance(rid, bytes) else rid


def api_id(rid: InternalId) -> RequestId:
    """The engine's form of an internal id (``BytesId`` back to bytes)."""
    return rid.b if isinstance(rid, BytesId) else rid


def new_ticket() -> bytes:
    """A fresh unguessable ticket (16 random bytes from the OS), for parameters made before ``start_send``."""
    return os.urandom(TICKET_BYTES)


def derive_ticket(secret: bytes, request_id: RequestId) -> bytes:
    """A request's ticket derived from a secret shared by whoever starts both sides (keyed BLAKE2b, 16 bytes).

    For tools and deployments where one party (a router, a test driver, ``kvcore
    demo``) starts the request on both instances: both derive the same ticket
    without forwarding it. The secret must be at least 16 random bytes and stay
    with that party; anyone who knows it can receive any request.
    """
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise E.TicketError("derive_ticket needs a secret of at least 16 bytes")
    rid = check_request_id(request_id)
    kind = b"i" if isinstance(rid, int) else (b"s" if isinstance(rid, str) else b"b")
    body = str(rid).encode() if isinstance(rid, (int, str)) else rid
    return hashlib.blake2b(kind + body, key=secret[:64], digest_size=TICKET_BYTES).digest()


def check_request_id(request_id: Any) -> RequestId:
    """A request id as the wire carries it: int in 0..2**64-1, or a non-empty str/bytes of at most 256.

    Bools and floats are refused (``SessionError`` naming the value). ``5`` and
    ``"5"`` are different requests.
    """
    if isinstance(request_id, (str, bytes)):
        if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            raise E.SessionError(
                f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters/bytes long, got {len(request_id)}"
            )
        return request_id
    if isinstance(request_id, bool) or not isinstance(request_id, (int, np.integer)):
        raise E.SessionError(f"request_id must be an int in 0..2**64-1, a str or bytes, got {request_id!r}")
    if not 0 <= int(request_id) <= MAX_U64:
        raise E.SessionError(f"request_id must be an integer in 0..2**64-1, got {request_id!r}")
    return int(request_id)


def check_ticket(ticket: Any, what: str = "ticket") -> bytes:
    """A ticket as bytes: 16..64 raw bytes, or their hex string (as ``TransferParams`` carries it)."""
    if isinstance(ticket, str):
        try:
            ticket = binascii.unhexlify(ticket)
        except (binascii.Error, ValueError):
            raise E.TicketError(f"{what} must be hex digits, got {ticket[:80]!r}") from None
    if not isinstance(ticket, (bytes, bytearray)):
        raise E.TicketError(f"{what} must be bytes or a hex string, got {type(ticket).__name__}")
    if not _MIN_TICKET <= len(ticket) <= _MAX_TICKET:
        raise E.TicketError(f"{what} must be {_MIN_TICKET}..{_MAX_TICKET} bytes, got {len(ticket)}")
    return bytes(ticket)


class TransferParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """What the generation side needs to receive one request; made by ``start_send``, forwarded by the engine."""

    request_id: Any  # RequestId: int, str or bytes (checked in __post_init__; JSON carries bytes as hex)
    endpoint: str  # the context instance's info endpoint (its rank 0)
    ticket: str  # hex of the request's secret; whoever holds it may receive the request
    mode: TransferMode = "push"
    dp_rank: int = 0  # the context attention-DP group that holds the request
    prompt_len: int = -1
    #: Pull mode: the context's block ids (one list; the same on every context rank) and state slot.
    block_ids: list[int] = msgspec.field(default_factory=list)
    #: Pull mode, layer groups: the context's block ids per group (then ``block_ids`` is empty).
    group_block_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    state_slot: int = -1
    #: Pull mode: the context incarnation the blocks belong to (a restarted context holds other data there).
    incarnation: str = ""
    #: The context's lease on the request (ms; 0: unknown): a waiting receiver renews it at a third of this.
    lease_ms: int = 0
    version: int = PARAMS_VERSION

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        check_ticket(self.ticket, "TransferParams.ticket")
        if self.mode not in ("push", "pull"):
            raise E.SessionError(f"TransferParams.mode must be 'push' or 'pull', got {self.mode!r}")
        for name in ("dp_rank", "prompt_len", "state_slot", "version", "lease_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise E.SessionError(f"TransferParams.{name} must be an integer, got {value!r}")
        if self.dp_rank < 0 or self.lease_ms < 0:
            raise E.SessionError(
                f"TransferParams.dp_rank and lease_ms must be >= 0, got {self.dp_rank}, {self.lease_ms}"
            )
        if self.version != PARAMS_VERSION:
            raise E.ProtocolVersionError(
                f"TransferParams version {self.version}; this kvcore reads version {PARAMS_VERSION}"
            )
        if (
            len(self.group_block_ids) > 64
            or len(self.block_ids) + sum(map(len, self.group_block_ids.values())) > MAX_PARAM_BLOCKS
        ):
            raise E.SessionError(f"TransferParams.group_block_ids: at most 64 groups and {MAX_PARAM_BLOCKS} ids in all")
        if len(self.block_ids) > MAX_PARAM_BLOCKS:
            raise E.SessionError(f"TransferParams.block_ids has {len(self.block_ids)} entries (max {MAX_PARAM_BLOCKS})")
        if self.mode == "pull" and not self.incarnation:
            raise E.SessionError("TransferParams in pull mode must name the context incarnation")
        if len(self.incarnation) > 256 or len(self.endpoint) > 1024:
            raise E.SessionError("TransferParams.incarnation or endpoint is too long")

    @property
    def ticket_bytes(self) -> bytes:
        return check_ticket(self.ticket)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (str, int, lists); bytes request ids become ``{"request_id_hex": ...}``."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        if isinstance(self.request_id, bytes):
            del out["request_id"]
            out["request_id_hex"] = self.request_id.hex()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransferParams:
        """Parse what ``to_dict`` made (after any JSON round trip); ``SessionError`` names what is wrong.

        A field this kvcore does not know is refused, naming it: parameters come from another process, and a
        field silently dropped (a newer kvcore's, a typo, a stranger's) would change what the request means.
        """
        if not isinstance(data, Mapping):
            raise E.SessionError(f"transfer parameters must be a mapping, got {type(data).__name__}")
        d = dict(data)
        unknown = sorted(str(k)[:64] for k in d if k not in _FIELDS)
        if unknown:
            raise E.SessionError(
                f"transfer parameters: unknown field {unknown[0]!r}"
                + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
                + f"; TransferParams version {PARAMS_VERSION} has {', '.join(sorted(_FIELDS))}"
            )
        if "request_id_hex" in d:
            try:
                d["request_id"] = bytes.fromhex(str(d.pop("request_id_hex")))
            except ValueError:
                raise E.SessionError("TransferParams.request_id_hex is not hex") from None
        try:
            return msgspec.convert(d, cls)
        except msgspec.ValidationError as exc:
            raise E.SessionError(f"malformed transfer parameters: {exc}") from None
        except RecursionError:  # hostile nesting in a value msgspec walks
            raise E.SessionError("malformed transfer parameters: values nest too deep") from None

    def to_json(self) -> str:
        return msgspec.json.encode(self.to_dict()).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> TransferParams:
        """Parse what ``to_json`` made; ``SessionError`` for anything else (its size and nesting are bounded)."""
        if not isinstance(text, (str, bytes, bytearray, memoryview)):
            raise E.SessionError(f"transfer parameters must be a JSON str or bytes, got {type(text).__name__}")
        data = text.encode() if isinstance(text, str) else bytes(text)
        if len(data) > MAX_PARAMS_JSON_BYTES:
            raise E.SessionError(f"transfer parameters are {len(data)} bytes of JSON (at most {MAX_PARAMS_JSON_BYTES})")
        try:
            parsed = msgspec.json.decode(data, type=_JsonForm)
        except msgspec.ValidationError as exc:
            raise E.SessionError(
                f"malformed transfer parameters: a value is none of an integer, a string, a list of integers or "
                f"a map of such lists ({exc})"
            ) from None
        except msgspec.DecodeError as exc:
            raise E.SessionError(f"transfer parameters are not JSON: {exc}") from None
        return cls.from_dict(parsed)

    @classmethod
    def make(
        cls,
        request_id: RequestId,
        endpoint: str,
        *,
        ticket: bytes | str | None = None,
        mode: TransferMode = "push",
        dp_rank: int = 0,
        prompt_len: int = -1,
        block_ids: Iterable[int] = (),
        state_slot: int = -1,
        incarnation: str = "",
        lease_ms: int = 0,
        group_block_ids: Mapping[str, Iterable[int]] | None = None,
    ) -> TransferParams:
        """Build parameters (a fresh ticket unless one is given), e.g. in an engine's scheduler before prefill."""
        tk = new_ticket() if ticket is None else check_ticket(ticket)
        return cls(
            request_id=check_request_id(request_id),
            endpoint=endpoint,
            ticket=tk.hex(),
            mode=mode,
            dp_rank=int(dp_rank),
            prompt_len=int(prompt_len),
            block_ids=[int(b) for b in block_ids],
            group_block_ids={str(g): [int(b) for b in v] for g, v in (group_block_ids or {}).items()},
            state_slot=int(state_slot),
            incarnation=incarnation,
            lease_ms=int(lease_ms),
        )


#: The keys ``from_dict`` reads: the fields, and ``request_id_hex`` (how ``to_dict`` carries a bytes request id).
_FIELDS = frozenset(TransferParams.__struct_fields__) | {"request_id_hex"}
