"""Fuzzing every decoder of peer-supplied bytes, and a real Messenger over a real socket: only typed errors, ever.

Decoders: ``wire.decode`` (control frames), ``TransferAgent.decode_descriptor``
(agent descriptors) and every installed transport's payload decoder (through
``load_remote_agent`` of a real agent). Inputs: random bytes, random msgpack
structures, mutations of valid messages, deep nesting, huge declared lengths.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.control import wire
from kvcore.control.messenger import Messenger
from kvcore.errors import KvcoreError, MessageDecodeError, ProtocolError, RemoteAgentError
from kvcore.msgbounds import MAX_DEPTH, cannot_exceed_bounds, check_msgpack_bounds
from kvcore.params import BytesId
from kvcore.transport.agent import TransferAgent

V = wire.PROTOCOL_VERSION
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
enc = msgspec.msgpack.encode

TAGS = ["instance_info_request", "instance_info", "register_rank_info", "register_result", "request_data"]
TAGS += ["transfer_result", "cancel", "error", "pull_done", "renew", "bogus"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=16)
    | st.binary(max_size=24)
)
structures = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=5)
        | st.dictionaries(st.text(max_size=10) | st.sampled_from(["t", "v"]), kids, max_size=5)
    ),
    max_leaves=30,
)
# Maps shaped like messages (a known tag, a version, random fields) reach deep into the typed decoders.
message_like = st.fixed_dictionaries(
    {"t": st.sampled_from(TAGS), "v": st.integers(-3, 5)},
    optional={
        "request_id": st.integers(-(2**63), 2**64 - 1) | structures,
        "info": structures,
        "ranks": st.lists(structures, max_size=3),
        "block_ids": st.binary(max_size=40) | structures,
        "status": st.sampled_from(["ok", "failed", "cancelled", "nope"]),
        "kind": structures,
        "error": structures,
    },
)


def _valid_messages() -> list[wire.Message]:
    return [
        wire.InstanceInfoRequest(v=V, min_version=1, max_version=1, asker="gen/0"),
        wire.RequestData(v=V, request_id=7, gen_instance="g", gen_rank=0, gen_incarnation="i", block_ids=b"\0" * 64),
        wire.TransferResult(v=V, request_id=7, ctx_rank=1, ctx_incarnation="c", status="ok", nbytes=5),
        wire.Cancel(v=V, request_id=2**64 - 1, instance="x", rank=3, reason="r"),
        wire.ErrorReply(v=V, kind="SessionError", error="e"),
        wire.RegisterResult(v=V, ctx_rank=0, ok=False, error_kind="X", error="y"),
        wire.RequestData(
            v=V, request_id="cmpl-1", gen_instance="g", gen_rank=0, gen_incarnation="i", block_ids=b"", ticket=b"t" * 16
        ),
        wire.TransferResult(
            v=V, request_id=BytesId(b"\0id"), ctx_rank=0, ctx_incarnation="c", status="ok", aux=b"first-token"
        ),
        wire.PullDone(
            v=V,
            request_id=9,
            gen_instance="g",
            gen_rank=1,
            gen_incarnation="i",
            ticket=b"t" * 16,
            nonce=b"n" * 16,
            status="ok",
            ctx_incarnation="c",
            blocks_digest=b"d" * 16,
            nbytes=4096,
        ),
        wire.Renew(v=V, request_id="r", gen_instance="g", gen_rank=0, gen_incarnation="i", ticket=b"", nonce=b"n"),
    ]


def _only_typed(fn: Callable[[bytes], Any], data: bytes, allowed: type[KvcoreError] = KvcoreError) -> None:
    try:
        fn(data)
    except allowed:
        pass


def _nested(depth: int, inner: bytes = b"\xc0", opener: bytes = b"\x91") -> bytes:
    return opener * depth + inner


HOSTILE: dict[str, bytes] = {
    "2 KB nested arrays": _nested(2000),
    "nested maps": b"\x81\xa1k" * 3000 + b"\xc0",
    "nested in an unknown field of a real tag": b"\x83\xa1t\xa6cancel\xa1v\x01\xa1x" + _nested(5000),
    "nested in a known field": b"\x83\xa1t\xa6cancel\xa1v\x01\xaarequest_id" + _nested(100_000),
    "just over the depth bound": _nested(MAX_DEPTH + 1),
    "array32 of 4G entries": b"\xdd\xff\xff\xff\xff" + b"\xc0" * 16,
    "map32 of 4G entries": b"\xdf\xff\xff\xff\xff" + b"\xc0" * 16,
    "str32 of 4 GB": b"\xdb\xff\xff\xff\xff" + b"abc",
    "bin32 of 4 GB": b"\xc6\xff\xff\xff\xff" + b"abc",
    "ext32 of 4 GB": b"\xc9\xff\xff\xff\xff\x01" + b"abc",
    "array16 longer than the data": b"\xdc\xff\xff" + b"\x01" * 100,
    "reserved byte": b"\xc1",
    "truncated length": b"\xda\x01",
    "trailing bytes": enc({"t": "cancel"}) + b"\x00",
    "a million nils": b"\xdd\x00\x0f\x42\x40" + b"\xc0" * 1_000_000,
    "pickle": b"\x80\x04\x95\x15\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94.",
    "empty": b"",
}


# --- wire.decode -------------------------------------------------------------------------------


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_frames_are_typed_errors(what: str) -> None:
    with pytest.raises(ProtocolError):
        wire.decode(HOSTILE[what])


def test_depth_bound_admits_every_real_message_and_refuses_one_more_level() -> None:
    check_msgpack_bounds(_nested(MAX_DEPTH - 1))
    with pytest.raises(ProtocolError, match="nesting deeper"):
        check_msgpack_bounds(_nested(MAX_DEPTH))


def test_small_real_messages_skip_the_walk_and_deep_or_large_frames_do_not() -> None:
    """``cannot_exceed_bounds`` (wire.decode's shortcut) holds for the per-request messages and fails for a frame
    whose depth or size could break a bound: those still get the walk."""
    assert all(cannot_exceed_bounds(wire.encode(m)) for m in _valid_messages())
    assert cannot_exceed_bounds(_nested(MAX_DEPTH - 1))
    assert not cannot_exceed_bounds(_nested(MAX_DEPTH))
    assert not cannot_exceed_bounds(b"\x82" * 40 + b"\xc0")  # container bytes anywhere count, inside strings too
    assert not cannot_exceed_bounds(HOSTILE["a million nils"])  # larger than the entries bound
    assert not cannot_exceed_bounds(b"\xc0" * 9, max_entries=8)
    # a large frame is walked whatever it holds: translating it would cost more than the walk
    assert cannot_exceed_bounds(b"\xc0" * 2048) and not cannot_exceed_bounds(b"\xc0" * 2049)


_SMALL = {"max_depth": 3, "max_entries": 40, "max_items": 40}


@FUZZ
@given(structures | message_like | st.binary(max_size=64))
def test_what_skips_the_walk_never_breaks_a_bound(obj: Any) -> None:
    """Whenever the shortcut says a frame cannot break the bounds, the full walk finds no bound broken by what the
    frame holds. It may still find one broken by what a container only declares (``dc 01 00``: an array of 256
    entries in 3 bytes): such a frame is malformed, and msgspec refuses it on its own, as it refuses every
    truncated, reserved or trailing byte the walk would have found."""
    data = obj if isinstance(obj, bytes) else enc(obj)
    if not cannot_exceed_bounds(data, **_SMALL):
        return
    try:
        check_msgpack_bounds(data, **_SMALL)
    except ProtocolError as exc:
        # whatever the walk refused (a bound only declared, a truncated, reserved or trailing byte), msgspec
        # refuses too: the frame is malformed
        with pytest.raises(msgspec.DecodeError):
            msgspec.msgpack.decode(data)
        assert isinstance(obj, bytes), (obj, exc)  # an encoded structure is never malformed


def test_a_declared_count_beyond_the_frame_is_refused_as_malformed() -> None:
    """The shortcut lets a 3-byte array that declares 256 entries through; wire.decode refuses it, typed."""
    assert cannot_exceed_bounds(b"\xdc\x01\x00")
    for frame in (b"\xdc\x01\x00", b"\xdd\x00\x01\x00\x00\xc0", b"\x81\xa1t\xdc\xff\xff"):
        with pytest.raises(MessageDecodeError, match="malformed control frame"):
            wire.decode(frame)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    _only_typed(wire.decode, data, ProtocolError)


@FUZZ
@given(structures | message_like)
def test_random_msgpack_structures(obj: Any) -> None:
    _only_typed(wire.decode, enc(obj), ProtocolError)


@FUZZ
@given(st.sampled_from(_valid_messages()), st.data())
def test_mutated_valid_messages(msg: wire.Message, data: st.DataObject) -> None:
    frame = bytearray(wire.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        i = data.draw(st.integers(0, max(len(frame) - 1, 0)))
        if op == "flip" and frame:
            frame[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del frame[i:]
        else:
            frame[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    _only_typed(wire.decode, bytes(frame), ProtocolError)


@FUZZ
@given(
    st.integers(0, 2**64 - 1),
    st.text(max_size=40),
    st.integers(-(2**63), 2**63 - 1),
    st.binary(max_size=64).map(lambda b: b[: len(b) // 8 * 8]),
)
def test_encode_decode_round_trip(rid: int, name: str, rank: int, blocks: bytes) -> None:
    msg = wire.RequestData(
        v=V, request_id=rid, gen_instance=name, gen_rank=rank, gen_incarnation=name, block_ids=blocks
    )
    assert wire.decode(wire.encode(msg)) == msg
    cancel = wire.Cancel(v=V, request_id=rid, instance=name, rank=rank, reason=name)
    assert wire.decode(wire.encode(cancel)) == cancel


def test_bounded_fields_refuse_oversized_values() -> None:
    with pytest.raises(MessageDecodeError, match="length"):
        wire.decode(enc({"t": "cancel", "v": V, "request_id": 1, "instance": "x" * 5000, "rank": 0}))
    with pytest.raises(MessageDecodeError, match="length"):  # request ids: at most 256 characters or bytes
        wire.decode(enc({"t": "cancel", "v": V, "request_id": "r" * 257, "instance": "x", "rank": 0}))
    with pytest.raises(MessageDecodeError, match="length"):
        wire.decode(enc({"t": "cancel", "v": V, "request_id": [b"r" * 257], "instance": "x", "rank": 0}))
    with pytest.raises(MessageDecodeError, match="outside"):
        wire.decode(enc({"t": "cancel", "v": V, "request_id": -1, "instance": "x", "rank": 0}))
    with pytest.raises(MessageDecodeError, match="length"):  # aux: at most 1 MiB on the wire
        wire.decode(
            enc(
                {
                    "t": "transfer_result",
                    "v": V,
                    "request_id": 1,
                    "ctx_rank": 0,
                    "ctx_incarnation": "c",
                    "status": "ok",
                    "aux": b"a" * (wire.MAX_AUX_BYTES + 1),
                }
            )
        )


# --- agent descriptors and transport payloads ---------------------------------------------------


@FUZZ
@given(st.binary(max_size=512) | (structures | message_like).map(enc))
def test_descriptor_decoder(data: bytes) -> None:
    _only_typed(TransferAgent.decode_descriptor, data, RemoteAgentError)


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_descriptors_are_typed_errors(what: str) -> None:
    with pytest.raises(RemoteAgentError):
        TransferAgent.decode_descriptor(HOSTILE[what])


def _backends() -> list[str]:
    from kvcore.extension.plugins import make_plugin_manager

    reg = make_plugin_manager().transfer_agents
    out = []
    for name in ("shm", "nixl", "ucx"):
        try:
            reg.get(name)
        except KvcoreError:
            continue
        out.append(name)
    return out


@pytest.fixture(scope="module", params=_backends())
def real_agent(request: pytest.FixtureRequest) -> Iterator[TransferAgent]:
    from kvcore.extension.plugins import make_plugin_manager

    agent = make_plugin_manager().transfer_agents.get(request.param)(f"fuzz-{request.param}", {})
    yield agent
    agent.close()


def _envelope(agent: TransferAgent, payload: bytes) -> bytes:
    own = TransferAgent.decode_descriptor(agent.descriptor())
    return enc(msgspec.structs.replace(own, name="fuzz-peer", incarnation="f" * 32, payload=payload))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=256) | (structures | message_like).map(enc) | st.sampled_from(list(HOSTILE.values())))
def test_every_transport_payload_decoder(real_agent: TransferAgent, payload: bytes) -> None:
    """A descriptor with a valid envelope and a hostile payload: a typed error, and nothing was loaded."""
    before = real_agent.remote_agents
    _only_typed(real_agent.load_remote_agent, _envelope(real_agent, payload))
    if "fuzz-peer" in real_agent.remote_agents and "fuzz-peer" not in before:
        real_agent.unload_remote_agent("fuzz-peer")


# --- a real Messenger over a real socket ----------------------------------------------------------


@pytest.fixture(scope="module")
def listener() -> Iterator[tuple[Messenger, queue.Queue[wire.Message]]]:
    got: queue.Queue[wire.Message] = queue.Queue()

    def handler(_src: object, msg: wire.Message) -> None:
        got.put(msg)
        if isinstance(msg, wire.Cancel) and msg.reason == "raise":
            raise RuntimeError("a handler bug must not stop the I/O thread")

    def on_error(_src: object, _exc: KvcoreError) -> None:
        raise RecursionError("an error-handler bug must not stop the I/O thread either")

    m = Messenger(handler, on_error=on_error, name="fuzzed", max_message_bytes=4 * 1024 * 1024)
    m.start()
    yield m, got
    m.close()


@pytest.fixture(scope="module")
def raw_dealer(listener: tuple[Messenger, queue.Queue[wire.Message]]) -> Iterator[zmq.Socket[bytes]]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(listener[0].endpoint)
    yield s
    s.close(0)
    ctx.term()


def _still_answers(m: Messenger, got: queue.Queue[wire.Message], dealer: zmq.Socket[bytes], rid: int) -> None:
    dealer.send(wire.encode(wire.Cancel(v=V, request_id=rid, instance="probe", rank=0)))
    end = time.monotonic() + 20
    while time.monotonic() < end:
        msg = got.get(timeout=max(0.01, end - time.monotonic()))
        if isinstance(msg, wire.Cancel) and msg.request_id == rid:
            assert m.alive
            return
    raise AssertionError("the messenger stopped answering")


def _drain_replies(dealer: zmq.Socket[bytes]) -> None:
    while dealer.poll(0):
        dealer.recv()


def test_the_two_kilobyte_frame_that_used_to_kill_the_io_thread(
    listener: tuple[Messenger, queue.Queue[wire.Message]], raw_dealer: zmq.Socket[bytes]
) -> None:
    m, got = listener
    frame = b"\x82\xa1t\xa6cancel\xa1x" + _nested(2000)
    assert len(frame) < 2100
    raw_dealer.send(frame)
    _still_answers(m, got, raw_dealer, 1)
    assert m.counters["bad_frames"] >= 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frames=st.lists(
        st.lists(
            st.binary(max_size=300)
            | (structures | message_like).map(enc)
            | st.sampled_from([f for f in HOSTILE.values() if len(f) < 100_000]),
            min_size=1,
            max_size=3,
        ),
        min_size=1,
        max_size=12,
    )
)
def test_messenger_keeps_serving_after_garbage(
    listener: tuple[Messenger, queue.Queue[wire.Message]], raw_dealer: zmq.Socket[bytes], frames: list[list[bytes]]
) -> None:
    """N garbage messages (single and multi-part), a raising handler and a raising error handler: still answers."""
    m, got = listener
    for parts in frames:
        raw_dealer.send_multipart(parts)
    raw_dealer.send(wire.encode(wire.Cancel(v=V, request_id=5, instance="x", rank=0, reason="raise")))
    _still_answers(m, got, raw_dealer, 2**63)
    _drain_replies(raw_dealer)
    while not got.empty():
        got.get_nowait()
    assert m.counters["io_errors"] == 0  # every failure was contained where it happened
