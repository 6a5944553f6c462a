"""Checked plans (issue 30): a large plan is checked against registered memory once, then moved in pieces.

``TransferAgent.check_plan`` does ``submit``'s checks once for a whole plan and ``submit_checked`` submits slices
of it without checking them again, as long as neither side's registrations changed since; the data plane moves
every chunked transfer that way. These tests use two shm agents in this process and the inline-copy agent of
``_faults`` (its ``submit`` moves every byte, as NIXL or UCX over CMA); they assert bytes, which checks ran and
what was refused, never a duration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _faults import InlineShmAgent

from kvcore.errors import RegistrationError, RemoteAgentError, RemoteRangeError, TransferError
from kvcore.transceiver.dataplane import FINE_CHUNK_BYTES, DataPlane
from kvcore.transport.agent import CheckedPlan, TransferAgent, TransferOp, TransferStatus
from kvcore.transport.builtin.shm import ShmAgent

MiB = 1 << 20
FRAG = 64 * 1024


@pytest.fixture
def pair() -> Iterator[tuple[InlineShmAgent, ShmAgent, str, torch.Tensor, torch.Tensor]]:
    a, b = InlineShmAgent("cp-a"), ShmAgent("cp-b", {"copy_threads": 1})
    try:
        src = a.allocate_tensor((32 * MiB,), torch.uint8)
        src.copy_(torch.randint(0, 256, (32 * MiB,), dtype=torch.uint8))
        a.register_memory(src)
        dst = b.allocate_tensor((32 * MiB,), torch.uint8)
        b.register_memory(dst)
        b.load_remote_agent(a.descriptor())
        peer = a.load_remote_agent(b.descriptor())
        yield a, b, peer, src, dst
    finally:
        a.close()
        b.close()
        assert not {k: v for k, v in a.resources().items() if v}


def _scattered(src: torch.Tensor, dst: torch.Tensor, n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """``n`` fragments of 64 KiB at shuffled slots on both sides (nothing merges)."""
    rng = np.random.default_rng(seed)
    slots = src.numel() // FRAG
    s, d = rng.permutation(slots)[:n], rng.permutation(slots)[:n]
    sizes = np.full(n, FRAG, dtype=np.uint64)
    return (src.data_ptr() + s * FRAG).astype(np.uint64), (dst.data_ptr() + d * FRAG).astype(np.uint64), sizes


def _landed(src: torch.Tensor, dst: torch.Tensor, plan: tuple[np.ndarray, ...]) -> bool:
    s0, d0 = src.data_ptr(), dst.data_ptr()
    for la, ra, sz in zip(*(p.tolist() for p in plan), strict=True):
        if not torch.equal(src[la - s0 : la - s0 + sz], dst[ra - d0 : ra - d0 + sz]):
            return False
    return True


def _count_range_checks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    real = TransferAgent._check_ranges

    def counted(self: TransferAgent, *args: Any) -> None:
        calls["ranges"] += 1
        real(self, *args)

    monkeypatch.setattr(TransferAgent, "_check_ranges", counted)
    return calls


def test_a_plan_checked_once_moves_in_pieces_without_checking_each_piece(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _b, peer, src, dst = pair
    frags = _scattered(src, dst, 96)
    calls = _count_range_checks(monkeypatch)
    plan = a.check_plan(TransferOp.WRITE, peer, *frags)
    assert isinstance(plan, CheckedPlan) and plan.count == 96 and plan.nbytes() == 96 * FRAG
    assert plan.nbytes(10, 20) == 10 * FRAG
    for start in range(0, 96, 32):
        h = a.submit_checked(plan, start, start + 32)
        assert h.count == 32 and h.nbytes == 32 * FRAG
        assert a.wait(h, timeout=30) is TransferStatus.DONE
        a.release(h)
    assert calls["ranges"] == 1, "the pieces of a checked plan were checked again"
    assert [n for n, _ in a.submitted] == [32 * FRAG] * 3
    assert _landed(src, dst, frags)


def test_a_checked_plan_holds_read_only_copies(pair: Any) -> None:
    a, _b, peer, src, dst = pair
    local, remote, sizes = _scattered(src, dst, 8)
    plan = a.check_plan(TransferOp.WRITE, peer, local, remote, sizes)
    local[0] = 0  # the caller's array changes after the check: the plan does not
    assert int(plan.local[0]) != 0
    with pytest.raises(ValueError):
        plan.remote_addrs[0] = 0
    with pytest.raises(ValueError):
        plan.sizes[0] = 1 << 40


def test_check_plan_refuses_what_submit_refuses(pair: Any) -> None:
    a, _b, peer, src, dst = pair
    base = dst.data_ptr()
    with pytest.raises(RemoteRangeError):
        a.check_plan(TransferOp.WRITE, peer, [src.data_ptr()], [base + 32 * MiB - 8], [16])
    with pytest.raises(RegistrationError):
        a.check_plan(TransferOp.WRITE, peer, [src.data_ptr() + 32 * MiB], [base], [16])
    with pytest.raises(TransferError, match="size 0"):
        a.check_plan(TransferOp.WRITE, peer, [src.data_ptr()], [base], [0])
    with pytest.raises(TransferError, match="differ in length"):
        a.check_plan(TransferOp.WRITE, peer, [src.data_ptr()], [base, base], [16])
    assert a.submitted == []


def test_submit_checked_refuses_a_foreign_plan_and_a_range_outside_it(pair: Any) -> None:
    a, b, peer, src, dst = pair
    plan = a.check_plan(TransferOp.WRITE, peer, *_scattered(src, dst, 8))
    with pytest.raises(TransferError, match="another agent"):
        b.submit_checked(plan, 0, 8)
    for start, stop in ((0, 9), (-1, 4), (5, 4)):
        with pytest.raises(TransferError, match="not a range"):
            a.submit_checked(plan, start, stop)
    assert a.submitted == []


def test_a_piece_is_checked_again_after_a_registration_changed(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory withdrawn after the check is never written: the next piece is checked against what is registered."""
    a, b, peer, src, dst = pair
    frags = _scattered(src, dst, 16)
    plan = a.check_plan(TransferOp.WRITE, peer, *frags)
    h = a.submit_checked(plan, 0, 8)
    a.wait(h, timeout=30)
    a.release(h)
    # The local side: its source memory is deregistered, so the rest of the plan reads from unregistered memory.
    (reg,) = a.registrations
    a.deregister_memory(reg)
    with pytest.raises(RegistrationError):
        a.submit_checked(plan, 8, 16)
    a.register_memory(src)  # registered again: a new generation, checked again, and allowed
    calls = _count_range_checks(monkeypatch)
    h = a.submit_checked(plan, 8, 16)
    assert calls["ranges"] == 1
    a.wait(h, timeout=30)
    a.release(h)
    assert _landed(src, dst, frags)
    # The remote side: the peer unloaded, then loaded again without its memory.
    a.unload_remote_agent(peer)
    with pytest.raises(RemoteAgentError):
        a.submit_checked(plan, 0, 8)
    (breg,) = b.registrations
    b.deregister_memory(breg)
    a.load_remote_agent(b.descriptor())
    with pytest.raises(RemoteRangeError):
        a.submit_checked(plan, 0, 8)
    assert len(a.submitted) == 2


def test_the_data_plane_checks_a_chunked_transfer_once(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan over the chunk size goes in several submits of one checked plan: one range check in all."""
    a, _b, peer, src, dst = pair
    frags = _scattered(src, dst, 3 * FINE_CHUNK_BYTES // FRAG)  # 12 MiB: three fine chunks
    dp = DataPlane(a, Counter(), lambda: False)
    dp.chunk_bytes = dp.fine_chunk_bytes = FINE_CHUNK_BYTES  # one fine chunk per piece
    calls = _count_range_checks(monkeypatch)
    x = dp.submit(TransferOp.WRITE, peer, *frags)
    while dp.poll(x) is TransferStatus.PENDING:
        dp.pump()
    dp.release(x)
    assert x.status is TransferStatus.DONE and x.nbytes == 3 * FINE_CHUNK_BYTES
    assert [n for n, _ in a.submitted] == [FINE_CHUNK_BYTES] * 3
    assert calls["ranges"] == 1, "the data plane checked every piece again"
    assert _landed(src, dst, frags)
    assert a.resources()["transfers"] == 0


def test_the_data_plane_refuses_a_plan_outside_registered_memory_before_any_piece(pair: Any) -> None:
    a, _b, peer, src, dst = pair
    local, remote, sizes = _scattered(src, dst, 3 * FINE_CHUNK_BYTES // FRAG)
    remote[-1] = dst.data_ptr() + dst.numel()  # the last fragment lies past the peer's memory
    dp = DataPlane(a, Counter(), lambda: False)
    dp.chunk_bytes = dp.fine_chunk_bytes = FINE_CHUNK_BYTES
    with pytest.raises(RemoteRangeError):
        dp.submit(TransferOp.WRITE, peer, local, remote, sizes)
    assert a.submitted == [], "a piece moved before the plan's last fragment was found outside"
