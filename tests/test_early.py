"""The context's store of early requests (``kvcore.transceiver.early``): caps, order, expiry, and its cost.

Receivers may ask before the context's engine started a request; a stranger may also flood a context with such
asks. The store must hold each cap exactly, hand messages back in arrival order, expire them on time, and cost
the same per message with thousands kept as with one (the context's I/O thread runs it for every ask).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.transceiver import early as early_mod
from kvcore.transceiver.early import EarlyRequests, early_size

V = wire.PROTOCOL_VERSION
SRC = Source(identity=b"peer")


def _ask(rid: int, rank: int = 0, nonce: bytes = b"n", blocks: int = 1, instance: str = "gen") -> wire.RequestData:
    return wire.RequestData(
        v=V,
        request_id=rid,
        gen_instance=instance,
        gen_rank=rank,
        gen_incarnation="inc",
        block_ids=b"\0" * 8 * blocks,
        group_block_ids={},
        state_slot=-1,
        prompt_len=-1,
        nonce=nonce,
        ticket=b"t",
        timeout_ms=1000,
    )


def test_caps_in_messages_per_peer_and_bytes_hold_exactly() -> None:
    store = EarlyRequests(max_messages=5, max_per_peer=3, max_bytes=10_000)
    for rid in range(3):
        assert store.refusal(_ask(rid, rank=0)) is None
        store.add(_ask(rid, rank=0), SRC, 10.0)
    assert store.refusal(_ask(9, rank=0)) is not None  # that rank's cap
    for rid in range(3, 5):
        assert store.refusal(_ask(rid, rank=1)) is None
        store.add(_ask(rid, rank=1), SRC, 10.0)
    assert len(store) == 5 and store.refusal(_ask(9, rank=2)) is not None  # the total cap
    store.pop(0)
    assert store.refusal(_ask(9, rank=2)) is None and store.refusal(_ask(9, rank=0)) is None
    assert store.bytes == 4 * early_size(_ask(1))
    big = EarlyRequests(max_messages=100, max_per_peer=100, max_bytes=8 * 10)
    big.add(_ask(1, blocks=6), SRC, 10.0)
    why = big.refusal(_ask(2, blocks=5))  # 48 + 40 bytes > 80
    assert why is not None and why.startswith("1 requests (48 bytes)")
    assert big.refusal(_ask(2, blocks=4)) is None  # 48 + 32 bytes: exactly the cap


def test_messages_come_back_in_arrival_order_and_leave_once() -> None:
    store = EarlyRequests(100, 100, 1 << 20)
    a, b, c = _ask(7, rank=0, nonce=b"a"), _ask(7, rank=1, nonce=b"b"), _ask(7, rank=2, nonce=b"c")
    for m in (a, b, c):
        store.add(m, SRC, 10.0)
    # a receiver takes its own ask back (cancel): only that one leaves
    gone = store.take(7, lambda e: e[1].nonce != b"b")
    assert [e[1] for e in gone] == [b] and len(store) == 2
    assert [e[1] for e in store.pop(7)] == [a, c]
    assert store.pop(7) == [] and len(store) == 0 and store.bytes == 0 and 7 not in store


def test_a_lost_peer_takes_its_messages_and_its_quota_with_it() -> None:
    store = EarlyRequests(100, 2, 1 << 20)
    store.add(_ask(1, rank=0), SRC, 10.0)
    store.add(_ask(2, rank=0), SRC, 10.0)
    store.add(_ask(2, rank=1), SRC, 10.0)
    assert store.refusal(_ask(3, rank=0)) is not None
    store.drop_peer(("gen", 0))
    assert len(store) == 1 and [e[1].gen_rank for e in store.pop(2)] == [1]
    assert 1 not in store and store.refusal(_ask(3, rank=0)) is None


def test_messages_expire_after_their_own_expiry_only() -> None:
    store = EarlyRequests(100, 100, 1 << 20)
    store.add(_ask(1, nonce=b"early"), SRC, 5.0)
    store.add(_ask(1, nonce=b"late"), SRC, 20.0)
    store.add(_ask(2), SRC, 8.0)
    assert store.expired(5.0) == []  # not yet past
    assert [e[1].nonce for e in store.expired(5.5)] == [b"early"]
    assert [e[1].request_id for e in store.expired(9.0)] == [2]
    assert store.expired(19.0) == [] and len(store) == 1
    assert [e[1].nonce for e in store.expired(21.0)] == [b"late"] and len(store) == 0 and store.bytes == 0


def test_admission_and_expiry_cost_the_same_per_message_with_thousands_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old store counted a peer's messages by walking all of them on every ask: 4096 asks made 16 million steps."""
    calls = {"n": 0}
    real = early_mod._sender

    def counted(msg: Any) -> Any:
        calls["n"] += 1
        return real(msg)

    monkeypatch.setattr(early_mod, "_sender", counted)
    store = EarlyRequests(4096, 4096, 1 << 30)
    for rid in range(4096):
        assert store.refusal(_ask(rid)) is None
        store.add(_ask(rid), SRC, float(rid))
    assert calls["n"] <= 2 * 4096
    calls["n"] = 0
    assert len(store.expired(5000.0)) == 4096 and len(store) == 0
    assert calls["n"] <= 4096
    # the expiry heap does not keep what left by other ways
    for rid in range(20_000):
        store.add(_ask(rid), SRC, 1e9)
        store.pop(rid)
        store.expired(0.0)
    assert len(store._expiry) <= 1024 + 1
