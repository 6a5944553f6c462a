"""Control-plane encoding: round trips, typed errors for hostile frames, endpoint parsing, negotiation."""

from __future__ import annotations

import pickle

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.control import wire
from kvcore.errors import MessageDecodeError, MessageTooLargeError, ProtocolError, ProtocolVersionError

V = wire.PROTOCOL_VERSION


def _req(**kw: object) -> wire.RequestData:
    base = dict(
        v=V,
        request_id=2**64 - 1,
        gen_instance="g",
        gen_rank=1,
        gen_incarnation="abc",
        block_ids=(b"\x01" + b"\x00" * 7) * 3,
        timeout_ms=1000,
    )
    base.update(kw)
    return wire.RequestData(**base)  # type: ignore[arg-type]


def test_round_trip_every_small_message() -> None:
    msgs = [
        wire.InstanceInfoRequest(v=V, min_version=1, max_version=1, asker="g/0"),
        _req(),
        wire.TransferResult(v=V, request_id=5, ctx_rank=1, ctx_incarnation="x", status="ok", nbytes=10),
        wire.Cancel(v=V, request_id=5, instance="i", rank=0, reason="r"),
        wire.ErrorReply(v=V, kind="MessageDecodeError", error="bad"),
        wire.RegisterResult(v=V, ctx_rank=0, ok=False, error_kind="IncompatiblePeerError", error="dtype"),
    ]
    for m in msgs:
        assert wire.decode(wire.encode(m)) == m


def test_pickle_frame_is_a_typed_error_and_never_unpickled() -> None:
    class Canary:
        def __reduce__(self):  # pragma: no cover - must never run
            return (exec, ("import os; os._exit(99)",))

    with pytest.raises(MessageDecodeError):
        wire.decode(pickle.dumps(Canary()))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x00",
        b"\xff" * 10,
        msgspec.msgpack.encode({"t": "nope", "v": 1}),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"t": "request_data", "v": 1}),
    ],
)
def test_malformed_frames_raise_decode_error(frame: bytes) -> None:
    with pytest.raises(MessageDecodeError):
        wire.decode(frame)


def test_oversized_frame_rejected_before_decoding() -> None:
    with pytest.raises(MessageTooLargeError, match="exceeds the 64-byte bound"):
        wire.decode(b"\x00" * 65, max_bytes=64)


def test_future_protocol_version_is_refused_by_name() -> None:
    frame = msgspec.msgpack.encode({"t": "cancel", "v": 99, "request_id": 1, "instance": "i", "rank": 0})
    with pytest.raises(ProtocolVersionError, match="version 99"):
        wire.decode(frame)


def test_request_data_validation() -> None:
    with pytest.raises(MessageDecodeError, match="block_ids"):
        wire.decode(wire.encode(_req(block_ids=b"\x00" * 7)))
    with pytest.raises(MessageDecodeError, match="timeout_ms"):
        wire.decode(wire.encode(_req(timeout_ms=0)))
    with pytest.raises(MessageDecodeError, match="request_id"):
        wire.decode(wire.encode(_req(request_id=-1)))


def test_negotiate() -> None:
    assert wire.negotiate(1, 5) == V
    with pytest.raises(ProtocolVersionError, match="no common protocol version"):
        wire.negotiate(V + 1, V + 3)


@pytest.mark.parametrize("ep", ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:80"])
def test_parse_endpoint_accepts(ep: str) -> None:
    assert wire.parse_endpoint(ep)[1] > 0


@pytest.mark.parametrize(
    "ep", ["tcp://127.0.0.1:0", "ipc:///tmp/x", "tcp://1.2.3.4;5.6.7.8:9", "tcp://h:99999", "tcp://h:1 ", 5]
)
def test_parse_endpoint_rejects(ep: object) -> None:
    with pytest.raises(ProtocolError):
        wire.parse_endpoint(ep)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decoder_never_raises_untyped(frame: bytes) -> None:
    try:
        wire.decode(frame)
    except ProtocolError:
        pass


def test_the_wire_keeps_the_key_layout() -> None:
    """``block_order`` and ``sharding`` travel under the key ``layout`` (the wire's spelling); both directions decode."""
    from kvcore.layout.builders import allocate_kv_cache, build_kv_page_table
    from kvcore.layout.page import PageTable as _PageTable
    from kvcore.layout.topology import AttentionGeometry as _Geometry
    from kvcore.layout.topology import Topology as _Topology

    geom = _Geometry(
        num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=2, dtype="float16", block_order="token_major"
    )
    topo = _Topology.create(1, 1, 0, 2)
    table = build_kv_page_table(allocate_kv_cache(topo, geom, 2), topology=topo, geometry=geom)
    as_sent = msgspec.msgpack.decode(msgspec.msgpack.encode(geom))
    assert as_sent["layout"] == "token_major" and "block_order" not in as_sent
    view = msgspec.msgpack.decode(table.encode())["views"][0]
    assert view["layout"]["kind"] == "token_major_sharded" and "sharding" not in view
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(as_sent), type=_Geometry) == geom
    assert _PageTable.decode(table.encode()) == table
