"""kvcore-native's UCX poster: real libucp, real processes, every byte checked by the side that received it."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from kvcore_native.errors import NativeTransportError
from kvcore_native.ucx import UcxPoster, libucp_path

try:
    libucp_path()
except NativeTransportError as _exc:
    pytest.skip(f"libucp is not installed: {_exc}", allow_module_level=True)

SPAWN = multiprocessing.get_context("spawn")
MODES = ["peer", "none"]
KIB, MIB = 1 << 10, 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def _pattern(seed: int, k: int, n: int) -> np.ndarray:
    """Fragment ``k``'s bytes: never 0 and different for every fragment; each side computes them on its own."""
    j = np.arange(n, dtype=np.uint64)
    return ((j * 7 + k * 131 + seed) % 251 + 1).astype(np.uint8)


def _recv(conn: Connection, timeout_s: float = 60.0) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the other process said nothing within {timeout_s}s")
    return conn.recv()


def _target(conn: Connection, mode: str, size: int) -> None:
    """A receiving process: a zeroed buffer, registered; checks what landed against its own expectation."""
    poster = UcxPoster("target", {"error_handling": mode})
    buf = np.zeros(size, np.uint8)
    poster.register(buf.ctypes.data, buf.nbytes)
    conn.send((poster.descriptor(), buf.ctypes.data))
    while (msg := conn.recv())[0] == "check":
        _, seed, offsets, lengths, ids = msg
        expected = np.zeros(size, np.uint8)
        for off, n, k in zip(offsets.tolist(), lengths.tolist(), ids.tolist()):
            expected[off : off + n] = _pattern(seed, k, n)
        wrong = np.flatnonzero(buf != expected)
        conn.send((int(wrong.size), int(wrong[0]) if wrong.size else -1, int(np.count_nonzero(buf))))
    poster.close()


class _Remote:
    """A target process and a writer poster in this one, connected."""

    def __init__(self, mode: str, size: int, src_bytes: int) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=_target, args=(child, mode, size), daemon=True)
        self.proc.start()
        self.poster = UcxPoster("writer", {"error_handling": mode})
        self.src = np.zeros(src_bytes, np.uint8)
        self.poster.register(self.src.ctypes.data, self.src.nbytes)
        descriptor, self.base = _recv(self.conn)
        self.peer = self.poster.connect(descriptor)

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("exit",))
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.poster.close()


@pytest.fixture
def remote(request: pytest.FixtureRequest) -> Iterator[_Remote]:
    mode, size, src_bytes = request.param
    r = _Remote(mode, size, src_bytes)
    try:
        yield r
    finally:
        r.close()


@pytest.mark.parametrize("remote", [(m, 120 * MIB, 97 * MIB) for m in MODES], indirect=True, ids=MODES)
def test_scattered_writes_land_every_byte_and_leave_the_rest_zero(remote: _Remote) -> None:
    """1 x 16 KiB, 4096 x 16 KiB shuffled, 8 x 4 MiB and 7 odd fragments land byte for byte; the target checks."""
    rng = np.random.default_rng(20240607)
    seed, slot, big = 11, 16 * KIB, 4 * MIB
    slots = rng.permutation(5120).astype(np.uint64) * slot  # 16 KiB slots of [0, 80 MiB)
    bigs = (80 * MIB + rng.permutation(10)[:8] * big).astype(np.uint64)  # 4 MiB slots of [80, 120 MiB): 2 stay zero
    odd_off = rng.integers(1, 4096, 7).astype(np.uint64)
    odd_len = rng.integers(1, 12 * KIB, 7).astype(np.uint64)
    writes = [
        (slots[:1], np.full(1, slot, np.uint64)),
        (slots[1:4097], np.full(4096, slot, np.uint64)),
        (bigs, np.full(8, big, np.uint64)),
        (slots[4097:4104] + odd_off, odd_len),  # odd offsets and lengths inside unused slots
    ]
    dst_off = np.concatenate([w[0] for w in writes])
    lengths = np.concatenate([w[1] for w in writes])
    ids = np.arange(dst_off.size, dtype=np.uint64)
    # The source holds the fragments in yet another order, so no fragment sits where its destination does.
    order = rng.permutation(dst_off.size)
    src_off = np.zeros(dst_off.size, np.uint64)
    src_off[order] = np.concatenate([[0], np.cumsum(lengths[order])[:-1]]).astype(np.uint64)
    for off, n, k in zip(src_off.tolist(), lengths.tolist(), ids.tolist()):
        remote.src[off : off + n] = _pattern(seed, k, n)
    src_base, dst_base = np.uint64(remote.src.ctypes.data), np.uint64(remote.base)

    start = 0
    for i, (_, lens) in enumerate(writes):
        part = slice(start, start + lens.size)
        start += lens.size
        src, dst = src_base + src_off[part], dst_base + dst_off[part]
        if i % 2:  # uint64 arrays and plain int lists both go through
            remote.poster.write(remote.peer, src, dst, lens, timeout_s=60)
        else:
            remote.poster.write(remote.peer, src.tolist(), dst.tolist(), lens.tolist(), timeout_s=60)
    assert remote.poster.in_flight == 0

    remote.conn.send(("check", seed, dst_off, lengths, ids))
    wrong, first_wrong, nonzero = _recv(remote.conn)
    assert (wrong, first_wrong) == (0, -1), f"{wrong} bytes differ from the expectation, the first at {first_wrong}"
    assert nonzero == int(lengths.sum())  # every written byte is nonzero, nothing else is


@pytest.mark.parametrize("mode", MODES)
def test_fragments_that_continue_each_other_go_as_one_put_inside_one_registration(mode: str) -> None:
    """Runs contiguous on both sides are one put each (the evidence: the poster's count of puts), a run is cut
    where the source crosses into another registration or either side stops continuing, and every byte lands."""
    conn, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_target, args=(child, mode, 8 * MIB), daemon=True)
    proc.start()
    poster = UcxPoster("writer", {"error_handling": mode})
    try:
        src = np.zeros(8 * MIB, np.uint8)
        poster.register(src.ctypes.data, 4 * MIB)  # two registrations that meet at 4 MiB
        poster.register(src.ctypes.data + 4 * MIB, 4 * MIB)
        descriptor, base = _recv(conn)
        peer = poster.connect(descriptor)
        f = 64 * KIB
        # (source offsets, destination offsets, lengths, puts expected)
        cases = [
            ([i * f for i in range(32)], [i * f for i in range(32)], [f] * 32, 1),  # 2 MiB in one run
            ([4 * MIB - f, 4 * MIB], [2 * MIB, 2 * MIB + f], [f, f], 2),  # the source crosses registrations
            ([5 * MIB + i * f for i in range(4)], [3 * MIB + (3 - i) * f for i in range(4)], [f] * 4, 4),
            ([6 * MIB + (2 - i) * 2 * f for i in range(3)], [4 * MIB + i * f for i in range(3)], [f] * 3, 3),
            ([7 * MIB, 7 * MIB + 100, 7 * MIB + 150], [5 * MIB, 5 * MIB + 100, 5 * MIB + 150], [100, 50, 4000], 1),
        ]
        seed, k, offsets, lengths, ids = 23, 0, [], [], []
        for s_off, d_off, lens, _ in cases:
            for so, do, n in zip(s_off, d_off, lens):
                src[so : so + n] = _pattern(seed, k, n)
                offsets.append(do)
                lengths.append(n)
                ids.append(k)
                k += 1
        for s_off, d_off, lens, puts in cases:
            before = poster.puts
            poster.write(peer, [src.ctypes.data + o for o in s_off], [base + o for o in d_off], lens, timeout_s=60)
            assert poster.puts - before == puts, (s_off, d_off, lens)
        conn.send(("check", seed, np.array(offsets, np.uint64), np.array(lengths, np.uint64), np.array(ids)))
        wrong, first_wrong, nonzero = _recv(conn)
        assert (wrong, first_wrong) == (0, -1), f"{wrong} bytes differ from the expectation, the first at {first_wrong}"
        assert nonzero == sum(lengths)
    finally:
        if proc.is_alive():
            conn.send(("exit",))
            proc.join(30)
        if proc.is_alive():
            proc.kill()
        poster.close()


# --- refusals, in one process (nothing crosses a process boundary when nothing moves) -------------------------


class _Pair:
    """A writer and a target poster in this process, connected; 1 MiB registered on each side."""

    def __init__(self, mode: str = "peer") -> None:
        self.a = UcxPoster("a", {"error_handling": mode})
        self.b = UcxPoster("b", {"error_handling": mode})
        self.src = np.arange(MIB, dtype=np.uint64).astype(np.uint8)
        self.dst = np.zeros(MIB, np.uint8)
        self.a.register(self.src.ctypes.data, MIB)
        self.b.register(self.dst.ctypes.data, MIB)
        self.s, self.d = self.src.ctypes.data, self.dst.ctypes.data
        self.peer = self.a.connect(self.b.descriptor())

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def pair() -> Iterator[_Pair]:
    p = _Pair()
    try:
        yield p
    finally:
        p.close()


def _refusals() -> None:
    """Run in a child process: were a check missing, the write would land where it points, in this process."""
    pair = _Pair()
    a, s, d, peer = pair.a, pair.s, pair.d, pair.peer
    elsewhere = np.zeros(4096, np.uint8)
    refused: list[tuple[tuple[Any, ...], str]] = [
        (
            (peer, [elsewhere.ctypes.data], [d], [16]),
            r"fragment 0: source \[0x[0-9a-f]+, \+16\) is not inside one registration",
        ),
        ((peer, [s, s + MIB - 8], [d, d], [16, 16]), r"fragment 1: source .* not inside one registration"),
        ((peer, [s], [d + MIB], [1]), rf"fragment 0: destination .* is not inside one region of peer {peer}"),
        ((peer, [s], [d - 8], [16]), r"fragment 0: destination .* not inside one region"),
        ((peer, [s], [2**64 - 8], [16]), r"fragment 0: address \+ length overflows"),
        ((peer, [2**64 - 8], [d], [16]), r"overflows"),
        ((peer, [], [], []), r"a write of no fragments \(n == 0\)"),
        ((peer, [s], [d, d], [16]), r"src has 1 entries, dst 2, lengths 1: they must be equal"),
        ((peer, [s], [d], [0]), r"fragment 0: length 0"),
        ((peer, [s], [d], [-1]), r"lengths\[0\] = -1 is not an unsigned 64-bit integer"),
        ((peer, [s], [d], ["16"]), r"lengths\[0\] = '16' is not an unsigned"),
        ((peer, np.array([s], np.int64), [d], [16]), r"src must be uint64 \(1-D\), got a 1-D buffer of format 'l'"),
        ((peer, b"12345678", [d], [16]), r"src must be uint64"),
        ((peer, 7, [d], [16]), r"src must be a sequence of ints or a uint64 array, got int"),
        ((4095, [s], [d], [16]), r"unknown peer 4095 \(never connected, or disconnected\)"),
        ((99999, [s], [d], [16]), r"unknown peer"),
        ((-1, [s], [d], [16]), r"unknown peer -1 "),
    ]
    for args, message in refused:
        with pytest.raises(NativeTransportError, match=message):
            a.write(args[0], args[1], args[2], args[3], timeout_s=5)
    assert not pair.dst.any(), "a refused write moved bytes"
    assert a.in_flight == 0

    a.write(peer, [s + 100], [d + 200], [300])  # the poster still works, exactly where it was asked to
    assert np.array_equal(pair.dst[200:500], pair.src[100:400])
    assert not pair.dst[:200].any() and not pair.dst[500:].any()

    a.disconnect(peer)
    with pytest.raises(NativeTransportError, match=rf"unknown peer {peer} \(never connected, or disconnected\)"):
        a.write(peer, [s], [d], [16])
    with pytest.raises(NativeTransportError, match="disconnect: unknown peer"):
        a.disconnect(peer)
    again = a.connect(pair.b.descriptor())
    assert again != peer  # a slot is not reused at once: a stale slot does not reach the new peer
    a.write(again, [s], [d], [16])

    a.close()
    closed: list[tuple[Callable[..., object], tuple[Any, ...]]] = [
        (a.write, (again, [s], [d], [16])),
        (a.register, (s, 16)),
        (a.connect, (pair.b.descriptor(),)),
        (a.disconnect, (again,)),
        (a.descriptor, ()),
    ]
    for call, args in closed:
        with pytest.raises(NativeTransportError, match="ucx poster: closed"):
            call(*args)
    a.close()  # again: nothing
    assert a.closed and a.in_flight == 0
    pair.close()
    print("ALL REFUSED")


def _run_in_child(function: str) -> str:
    """Run ``function`` of this module in a fresh process: a crash fails the test instead of killing pytest."""
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_ucx_poster as t; t.{function}()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def test_refusals_are_typed_name_what_was_wrong_and_move_nothing() -> None:
    """Outside either side's registrations, overflowing, empty, unequal, mistyped, to an unknown or disconnected
    peer, after close: each a NativeTransportError naming what was wrong, and no byte moved."""
    assert _run_in_child("_refusals").split()[-2:] == ["ALL", "REFUSED"]


def test_registrations_options_and_peers_are_checked_when_made(pair: _Pair) -> None:
    with pytest.raises(NativeTransportError, match=r"register: \[0x[0-9a-f]+, \+16\) overlaps the registration"):
        pair.a.register(pair.s + 8, 16)
    with pytest.raises(NativeTransportError, match="register: length 0"):
        pair.a.register(pair.s, 0)
    with pytest.raises(NativeTransportError, match="not a valid range"):
        pair.a.register(2**64 - 8, 16)
    with pytest.raises(NativeTransportError, match="the descriptor is this poster's own"):
        pair.a.connect(pair.a.descriptor())
    with pytest.raises(NativeTransportError, match="unknown option 'tls'; known: error_handling"):
        UcxPoster("x", {"tls": "tcp"})
    with pytest.raises(NativeTransportError, match="error_handling: 'peer' or 'none' expected, got 'auto'"):
        UcxPoster("x", {"error_handling": "auto"})
    with pytest.raises(NativeTransportError, match="UCX refused the setting NO_SUCH_SETTING=1"):
        UcxPoster("x", {"ucx_no_such_setting": "1"})
    none = UcxPoster("none", {"error_handling": "none", "ucx_tls": "sm,cma", "progress_thread": "false"})
    try:
        with pytest.raises(NativeTransportError, match="peer uses UCX error handling 'none', this poster 'peer'"):
            pair.a.connect(none.descriptor())
    finally:
        none.close()


# --- the descriptor is untrusted --------------------------------------------------------------------------------


def _fnv1a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def _frame(
    address: bytes,
    regions: list[tuple[int, int, bytes]],
    *,
    mode: int = 1,
    version: int = 1,
    nregs: int | None = None,
    addr_len: int | None = None,
    tail: bytes = b"",
) -> bytes:
    """A descriptor in the poster's format (little-endian), with a checksum that matches whatever it says."""
    body = address + b"".join(struct.pack("<QQI", base, n, len(rk)) + rk for base, n, rk in regions) + tail
    head = b"KVNU" + struct.pack(
        "<HBBIIII",
        version,
        mode,
        0,
        24 + len(body) + 8,
        len(address) if addr_len is None else addr_len,
        len(regions) if nregs is None else nregs,
        0,
    )
    return head + body + struct.pack("<Q", _fnv1a(head + body))


def _fuzz_descriptors() -> None:
    """Run in a child process: every malformed descriptor is a NativeTransportError; then the poster still works."""
    a, b = UcxPoster("a"), UcxPoster("b")
    src, dst = np.full(4096, 7, np.uint8), np.zeros(4096, np.uint8)
    a.register(src.ctypes.data, 4096)
    b.register(dst.ctypes.data, 4096)
    good = b.descriptor()
    alen = struct.unpack_from("<I", good, 12)[0]
    address = good[24 : 24 + alen]
    base, length, rlen = struct.unpack_from("<QQI", good, 24 + alen)
    rkey = good[24 + alen + 20 : 24 + alen + 20 + rlen]
    assert _frame(address, [(base, length, rkey)]) == good, "the test's framing no longer matches the poster's"

    rng = random.Random(1234)
    cases: list[tuple[str, bytes]] = [("empty", b""), ("trailing byte", good + b"\0")]
    cases += [(f"truncated to {i}", good[:i]) for i in range(len(good))]
    for bit in range(len(good) * 8):  # every single-bit flip: the framing or the checksum catches it
        flipped = bytearray(good)
        flipped[bit // 8] ^= 1 << (bit % 8)
        cases.append((f"bit {bit} flipped", bytes(flipped)))
    cases += [(f"random {i}", rng.randbytes(rng.randrange(600))) for i in range(1500)]
    cases += [
        (f"random after magic {i}", b"KVNU\x01\x00\x01\x00" + rng.randbytes(rng.randrange(600))) for i in range(500)
    ]
    huge = 2**32 - 1
    region = [(base, length, rkey)]
    rkey_past_end = _frame(address, region)[:-8]
    at = 24 + alen + 16  # the region's rkey length: claims 4 GiB, checksum recomputed
    rkey_past_end = rkey_past_end[:at] + struct.pack("<I", huge) + rkey_past_end[at + 4 :]
    rkey_past_end += struct.pack("<Q", _fnv1a(rkey_past_end))
    crafted = [  # well framed, checksum right: each refused for its own reason
        ("version 2", _frame(address, region, version=2), "descriptor version 2; this poster reads version 1"),
        ("mode none", _frame(address, region, mode=0), "peer uses UCX error handling 'none', this poster 'peer'"),
        ("mode 7", _frame(address, region, mode=7), "unknown flags"),
        ("4 billion regions", _frame(address, region, nregs=huge), "4294967295 regions; at most 4096"),
        ("4097 regions", _frame(address, region, nregs=4097), "4097 regions; at most 4096"),
        ("more regions than bytes", _frame(address, region, nregs=2), "region 1: its header runs past the end"),
        ("a 4 GiB address", _frame(address, region, addr_len=huge), "worker address of 4294967295 bytes"),
        ("an empty address", _frame(b"", region), "worker address of 0 bytes"),
        ("address version 5", _frame(bytes([0x25]) + address[1:], region), "worker address version 5"),
        ("a region of length 0", _frame(address, [(base, 0, rkey)]), "region 0: [0x"),
        ("a region past 2**64", _frame(address, [(2**64 - 8, 16, rkey)]), "is not a valid range"),
        ("overlap", _frame(address, [(base, length, rkey), (base + 8, 8, rkey)]), "overlap"),
        ("bytes after the regions", _frame(address, region, tail=b"x"), "1 bytes after its last region"),
        ("an empty rkey", _frame(address, [(base, length, b"")]), "rkey of 0 bytes"),
        ("a 4 KiB + 1 rkey", _frame(address, [(base, length, bytes(4097))]), "rkey of 4097 bytes"),
        ("an rkey length past the end", rkey_past_end, "rkey of 4294967295 bytes"),
        (
            "an rkey naming md 40",
            _frame(address, [(base, length, struct.pack("<QB", 1 << 40, 0) + b"\0\xff")]),
            "past the 16",
        ),
        ("device memory", _frame(address, [(base, length, rkey[:8] + b"\x01" + rkey[9:])]), "rkey of memory type 1"),
        (
            "distances",
            _frame(address, [(base, length, rkey[:-1] + b"\x00\x01\x02\x03")]),
            "4 bytes after its memory-domain",
        ),
        ("keys overrun", _frame(address, [(base, length, rkey[:9] + b"\xfe")]), "keys run past its 10 bytes"),
        ("oversize", b"KVNU" + bytes(MIB), "at most 1048576 are read"),
        ("a bit flipped", good[:30] + bytes([good[30] ^ 1]) + good[31:], "(corrupted)"),
    ]
    cases += [(what, blob) for what, blob, _ in crafted]
    refused = 0
    for what, blob in cases:
        try:
            a.connect(blob)
        except NativeTransportError as exc:
            assert str(exc).startswith("ucx poster: connect: "), (what, exc)
            refused += 1
        else:
            raise AssertionError(f"{what}: accepted")
    for _, blob, reason in crafted:
        with pytest.raises(NativeTransportError, match=re.escape(reason)):
            a.connect(blob)
    peer = a.connect(good)  # the poster is unharmed: a real write still lands
    a.write(peer, [src.ctypes.data], [dst.ctypes.data], [4096])
    assert (dst == 7).all()
    a.close()
    b.close()
    print("REFUSED", refused, "OF", len(cases))


def test_malformed_descriptors_are_refused_and_never_crash() -> None:
    """Truncations, bit flips, random bytes, huge counts and lengths, oversize: a child process runs them all, so a
    crash fails this test instead of killing pytest."""
    words = _run_in_child("_fuzz_descriptors").split()
    assert words[0] == "REFUSED" and words[1] == words[3] and int(words[1]) > 4000, words


# --- peers that die or hang -------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("remote", [(m, MIB, MIB) for m in MODES], indirect=True, ids=MODES)
def test_a_dead_peer_fails_the_next_write_and_never_hangs(remote: _Remote) -> None:
    p, s, d = remote.poster, remote.src.ctypes.data, remote.base
    p.write(remote.peer, [s], [d], [16 * KIB])
    remote.proc.kill()
    remote.proc.join(30)
    for _ in range(3):  # the first write finds the death (CMA: the put; TCP: the reset), the next ones know it
        with pytest.raises(NativeTransportError, match=r"failed: .*UCS status -?\d+.*the peer died or is unreachable"):
            p.write(remote.peer, [s], [d], [16 * KIB], timeout_s=10)
    assert p.in_flight == 0
    p.disconnect(remote.peer)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("remote", [("peer", MIB, MIB)], indirect=True, ids=["peer"])
def test_a_hung_peer_is_a_timeout_and_the_abandoned_write_drains_when_it_dies(remote: _Remote) -> None:
    """Error handling "peer" puts through the target's progress (TCP): a stopped target never completes them."""
    p, s, d = remote.poster, remote.src.ctypes.data, remote.base
    p.write(remote.peer, [s], [d], [MIB])
    assert remote.proc.pid is not None
    os.kill(remote.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(NativeTransportError, match=r"write of 1 fragments to peer \d+ did not end within 0.5s"):
            p.write(remote.peer, [s], [d], [MIB], timeout_s=0.5)
        assert p.in_flight == 1  # abandoned, still pending: its source memory stays registered
    finally:
        remote.proc.kill()
        remote.proc.join(30)
    deadline = time.monotonic() + 60
    while p.in_flight and time.monotonic() < deadline:  # the reset ends it
        time.sleep(0.02)
    assert p.in_flight == 0
    with pytest.raises(NativeTransportError, match="the peer died or is unreachable"):
        p.write(remote.peer, [s], [d], [16])


# --- the capsule and the vtable -----------------------------------------------------------------------------------

_POST = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_uint32,
    ctypes.POINTER(ctypes.c_uint64),
    ctypes.POINTER(ctypes.c_uint64),
    ctypes.POINTER(ctypes.c_uint64),
    ctypes.c_uint32,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_char_p,
    ctypes.c_size_t,
)
_POLL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)
_RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
KVN_PENDING, KVN_DONE, KVN_FAILED = 0, 1, -1


class _Vtable(ctypes.Structure):
    _fields_ = [
        ("abi", ctypes.c_int),
        ("backend", ctypes.c_char_p),
        ("post_write", _POST),
        ("poll", _POLL),
        ("release", _RELEASE),
    ]


class _Ref(ctypes.Structure):
    _fields_ = [("vt", ctypes.POINTER(_Vtable)), ("self", ctypes.c_void_p)]


_api = ctypes.pythonapi
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
NAME = b"kvcore_native.poster"


def _u64s(*values: int) -> Any:
    return (ctypes.c_uint64 * len(values))(*values)


def _poll_to_end(ref: _Ref, handle: ctypes.c_void_p, err: Any) -> int:
    deadline = time.monotonic() + 30
    while (rc := ref.vt.contents.poll(ref.self, handle, err, len(err))) == KVN_PENDING and time.monotonic() < deadline:
        pass
    return int(rc)


def test_the_capsule_holds_the_vtable_and_in_flight_counts_what_close_refuses(pair: _Pair) -> None:
    cap = pair.a.capsule()
    assert _api.PyCapsule_IsValid(cap, NAME) == 1
    assert _api.PyCapsule_IsValid(cap, b"kvcore_native.other") == 0
    ref = _Ref.from_address(_api.PyCapsule_GetPointer(cap, NAME))
    vt = ref.vt.contents
    assert (vt.abi, vt.backend) == (1, b"ucx")
    err = ctypes.create_string_buffer(512)
    handle = ctypes.c_void_p()

    src, dst, lens = _u64s(pair.s, pair.s + 8192), _u64s(pair.d + 4096, pair.d), _u64s(4096, 100)
    assert vt.post_write(ref.self, pair.peer, src, dst, lens, 2, ctypes.byref(handle), err, len(err)) == 0, err.value
    assert pair.a.in_flight == 1
    with pytest.raises(NativeTransportError, match="close refused: 1 handles posted and not released"):
        pair.a.close()
    with pytest.raises(NativeTransportError, match=r"disconnect: peer \d+ has 1 handles posted and not released"):
        pair.a.disconnect(pair.peer)
    assert _poll_to_end(ref, handle, err) == KVN_DONE, err.value
    assert _poll_to_end(ref, handle, err) == KVN_DONE  # a verdict does not change
    vt.release(ref.self, handle)
    assert pair.a.in_flight == 0
    assert np.array_equal(pair.dst[4096:8192], pair.src[:4096]) and np.array_equal(pair.dst[:100], pair.src[8192:8292])
    assert vt.poll(ref.self, handle, err, len(err)) == KVN_FAILED and b"unknown or released handle" in err.value
    vt.release(ref.self, handle)  # again: nothing

    assert vt.post_write(ref.self, pair.peer, src, dst, lens, 0, ctypes.byref(handle), err, len(err)) == -1
    assert err.value == b"ucx poster: a write of no fragments (n == 0)"
    assert vt.post_write(ref.self, 77, src, dst, lens, 1, ctypes.byref(handle), err, 8) == -1
    assert err.value == b"ucx pos"  # the message is cut to errlen, NUL included

    # Released while pending, a handle is abandoned: counted, then drained; close waits for it.
    big = _u64s(*(pair.s + i * 4096 for i in range(256)))
    far = _u64s(*(pair.d + i * 4096 for i in range(256)))
    sizes = _u64s(*([4096] * 256))
    assert vt.post_write(ref.self, pair.peer, big, far, sizes, 256, ctypes.byref(handle), err, len(err)) == 0
    vt.release(ref.self, handle)
    assert pair.a.in_flight in (0, 1)
    deadline = time.monotonic() + 30
    while pair.a.in_flight and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pair.a.in_flight == 0 and np.array_equal(pair.dst, pair.src)

    # The capsule keeps the poster alive; a closed poster refuses through it.
    inner = pair.a._p
    before = sys.getrefcount(inner)
    extra = pair.a.capsule()
    assert sys.getrefcount(inner) == before + 1
    del extra
    assert sys.getrefcount(inner) == before
    pair.a.close()
    assert vt.post_write(ref.self, pair.peer, src, dst, lens, 1, ctypes.byref(handle), err, len(err)) == -1
    assert err.value == b"ucx poster: closed"


def test_a_capsule_outlives_its_python_object() -> None:
    poster = UcxPoster("alone")
    cap = poster.capsule()
    del poster
    ref = _Ref.from_address(_api.PyCapsule_GetPointer(cap, NAME))
    err, handle = ctypes.create_string_buffer(256), ctypes.c_void_p()
    one = _u64s(4096)
    assert ref.vt.contents.post_write(ref.self, 0, one, one, one, 1, ctypes.byref(handle), err, 256) == -1
    assert err.value == b"ucx poster: unknown peer 0 (never connected, or disconnected)"


# --- the library, found and missing -------------------------------------------------------------------------------


def test_without_libucp_the_module_imports_and_a_poster_says_how_to_install_it(tmp_path: Any) -> None:
    (tmp_path / "libucp.so.0").write_bytes(b"not a library")
    code = (
        "import sys, ctypes.util\n"
        "sys.modules['libucx'] = None\n"
        "ctypes.util.find_library = lambda name: None\n"
        "from kvcore_native import _ucx\n"
        "from kvcore_native.errors import NativeTransportError\n"
        "from kvcore_native.ucx import UcxPoster\n"
        "try:\n"
        "    UcxPoster('x')\n"
        "except NativeTransportError as exc:\n"
        "    print(exc)\n"
    )
    env = dict(os.environ, KVCORE_UCX_LIBDIR=str(tmp_path / "none"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True)
    assert "libucp not found" in out.stdout and "pip install libucx-cu12" in out.stdout, out.stdout
    env["KVCORE_UCX_LIBDIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True)
    assert f"cannot open {tmp_path}/libucp.so.0" in out.stdout, out.stdout
