"""kvcore-native's NIXL poster: real NIXL (its C API, UCX backend, DRAM) across real processes, byte-checked.

The receivers and the fuzzer run in rank processes (:class:`kvcore.runtime.RankProcess`) whose targets are the
``*_main`` functions at the end of this module; the sender is the test process itself.
"""

from __future__ import annotations

import ctypes
import os
import random
import resource
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from kvcore_native.errors import NativeTransportError
from kvcore_native.nixl import NixlPoster, nixl_capi_path

from kvcore.runtime import Channel, RankExitedError, RankProcess, serve
from kvcore.testing.harness import pattern


def _nixl_installed() -> bool:
    try:
        nixl_capi_path()
    except NativeTransportError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _nixl_installed(), reason="NIXL's C API (the nixl-cu12 or nixl-cu13 wheel) is absent"
)

KiB, MiB = 1024, 1024 * 1024
SRC_BYTES = 64 * MiB
DST_BYTES = 136 * MiB
SEED = 20240611
HERE = os.path.dirname(os.path.abspath(__file__))


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _plan(seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Three writes as (src offsets, dst offsets, lengths): 1 x 16 KiB at an odd offset; 4096 x 16 KiB scattered
    in shuffled order over 6144 slots; 8 x 4 MiB with 4 KiB gaps. Sender and receiver both derive it from the seed."""
    rng = np.random.default_rng(seed)
    one = (np.array([3 * KiB], np.uint64), np.array([5], np.uint64), np.array([16 * KiB], np.uint64))
    slots = rng.choice(6144, size=4096, replace=False).astype(np.uint64)  # random slots, in random order
    many = (
        rng.integers(0, SRC_BYTES // (16 * KiB), 4096).astype(np.uint64) * np.uint64(16 * KiB),
        np.uint64(MiB) + slots * np.uint64(16 * KiB),
        np.full(4096, 16 * KiB, np.uint64),
    )
    order = rng.permutation(8).astype(np.uint64)
    big = (
        order * np.uint64(8 * MiB),
        np.uint64(100 * MiB) + np.arange(8, dtype=np.uint64) * np.uint64(4 * MiB + 4 * KiB),
        np.full(8, 4 * MiB, np.uint64),
    )
    return [one, many, big]


def _expected(seed: int) -> np.ndarray:
    """The receiver's whole buffer after the plan: the source pattern where written, zero everywhere else."""
    source = pattern(seed, SRC_BYTES)
    out = np.zeros(DST_BYTES, np.uint8)
    for src, dst, lengths in _plan(seed):
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist()):
            out[d : d + n] = source[s : s + n]
    return out


@pytest.fixture(autouse=True, scope="module")
def _no_efa_module() -> Iterator[None]:
    """A process that loads NIXL's UCX here ends in SIGSEGV at exit (rtnl_tc_unregister, in _dl_fini): UCX's EFA
    module links the system's libefa, which brings the system's libibverbs and libnl beside the copies the nixl
    wheel bundles. Without the EFA module (no EFA device here) a crash at exit cannot hide, or fake, the crashes
    these tests look for; the rank processes inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        if "UCX_MODULES" not in os.environ:
            mp.setenv("UCX_MODULES", "^efa")
        yield


@pytest.fixture
def pair() -> Iterator[tuple[NixlPoster, NixlPoster, np.ndarray, np.ndarray, int]]:
    """Two posters in this process, a (1 MiB registered) connected to b (1 MiB registered): for refusals."""
    src, dst = np.zeros(MiB, np.uint8), np.zeros(MiB, np.uint8)
    a, b = NixlPoster(f"pair-a-{os.getpid()}"), NixlPoster(f"pair-b-{os.getpid()}")
    a.register(_addr(src), src.nbytes)
    b.register(_addr(dst), dst.nbytes)
    peer = a.connect(b.descriptor())
    yield a, b, src, dst, peer
    a.close()
    b.close()


# --- bytes across processes --------------------------------------------------------------------------------------


def test_scattered_writes_land_byte_for_byte_and_nothing_else_changes() -> None:
    with RankProcess("test_nixl_poster:receiver_main", name="nixl-receiver", path=[HERE]) as receiver:
        got = receiver.call("setup", timeout=60.0, name=f"recv-{os.getpid()}", nbytes=DST_BYTES)
        source = pattern(SEED, SRC_BYTES)
        with NixlPoster(f"send-{os.getpid()}") as sender:
            sender.register(_addr(source), source.nbytes)
            peer = sender.connect(got["descriptor"])
            base, dbase = np.uint64(_addr(source)), np.uint64(got["addr"])
            for src, dst, lengths in _plan(SEED):
                sender.write(peer, src + base, dst + dbase, lengths, timeout_s=30.0)
            assert sender.in_flight == 0
            verdict = receiver.call("check", timeout=60.0, seed=SEED)
            assert verdict == {"mismatches": 0, "first": -1}
            sender.disconnect(peer)
        receiver.call("exit", timeout=30.0)
    assert receiver.exitcode == 0


def test_lists_of_ints_write_like_arrays(pair: tuple[NixlPoster, NixlPoster, np.ndarray, np.ndarray, int]) -> None:
    a, _, src, dst, peer = pair
    src[:] = pattern(7, src.nbytes)
    a.write(peer, [_addr(src) + 100, _addr(src)], (_addr(dst) + 5000, _addr(dst)), [10, 7])
    assert bytes(dst[5000:5010]) == bytes(src[100:110]) and bytes(dst[:7]) == bytes(src[:7])
    assert not dst[7:5000].any() and not dst[5010:].any()
    signed = np.array([_addr(src) + 1], np.int64)  # any integers do, not only uint64 buffers
    a.write(peer, signed, np.array([_addr(dst) + 9000], np.int64), np.array([3], np.int64))
    assert bytes(dst[9000:9003]) == bytes(src[1:4])


def test_contiguous_fragments_go_as_one_but_never_across_registrations() -> None:
    """Neighbours on both sides are merged into one NIXL descriptor, except where the merged range would span two
    registrations (NIXL would refuse it: a descriptor must lie inside one registration)."""
    src, dst = pattern(13, 64 * KiB), np.zeros(64 * KiB, np.uint8)
    with NixlPoster(f"merge-a-{os.getpid()}") as a, NixlPoster(f"merge-b-{os.getpid()}") as b:
        a.register(_addr(src), 16 * KiB)  # two adjacent registrations on the source side
        a.register(_addr(src) + 16 * KiB, 48 * KiB)
        b.register(_addr(dst), dst.nbytes)
        peer = a.connect(b.descriptor())
        offsets = np.arange(0, 64 * KiB, 4 * KiB, dtype=np.uint64)  # 16 neighbours, across the boundary
        lengths = np.full(offsets.size, 4 * KiB, np.uint64)
        a.write(peer, np.uint64(_addr(src)) + offsets, np.uint64(_addr(dst)) + offsets, lengths)
        assert np.array_equal(dst, src)
        with pytest.raises(NativeTransportError, match=r"fragment 0: src .* outside this poster's registered"):
            a.write(peer, [_addr(src) + 12 * KiB], [_addr(dst)], [8 * KiB])  # one fragment across it: refused


def test_threads_write_through_one_poster_at_once() -> None:
    """write() releases the GIL and takes the poster's mutex: four threads share one poster, every byte lands."""
    src, dst = pattern(17, MiB), np.zeros(MiB, np.uint8)
    with NixlPoster(f"threads-a-{os.getpid()}") as a, NixlPoster(f"threads-b-{os.getpid()}") as b:
        a.register(_addr(src), src.nbytes)
        b.register(_addr(dst), dst.nbytes)
        peer = a.connect(b.descriptor())

        def quarter(q: int) -> int:
            rng = np.random.default_rng(q)
            offsets = np.uint64(q * MiB // 4) + rng.permutation(64).astype(np.uint64) * np.uint64(4 * KiB)
            for _ in range(50):
                a.write(peer, np.uint64(_addr(src)) + offsets, np.uint64(_addr(dst)) + offsets, [4 * KiB] * 64)
            return q

        with ThreadPoolExecutor(4) as pool:
            assert sorted(pool.map(quarter, range(4))) == [0, 1, 2, 3]
        assert np.array_equal(dst, src) and a.in_flight == 0


# --- refusals ------------------------------------------------------------------------------------------------------


def test_writes_outside_registered_memory_are_refused_naming_the_fragment(
    pair: tuple[NixlPoster, NixlPoster, np.ndarray, np.ndarray, int],
) -> None:
    a, _, src, dst, peer = pair
    s, d = _addr(src), _addr(dst)
    with pytest.raises(NativeTransportError, match=r"fragment 1: src .* outside this poster's registered memory"):
        a.write(peer, [s, s + MiB - 8], [d, d + 64], [8, 16])  # the second source runs 8 bytes past the end
    with pytest.raises(NativeTransportError, match=r"fragment 0: src .* outside this poster's registered memory"):
        a.write(peer, [s - 1], [d], [1])
    with pytest.raises(NativeTransportError, match=r"fragment 0: dst .* outside the memory peer 0 \('pair-b-"):
        a.write(peer, [s], [d + MiB - 4], [8])
    with pytest.raises(NativeTransportError, match=r"fragment 0: dst .* outside the memory peer"):
        a.write(peer, [s], [s], [8])  # this side's memory is not the peer's
    assert not dst.any()


def test_malformed_writes_are_refused_before_anything_moves(
    pair: tuple[NixlPoster, NixlPoster, np.ndarray, np.ndarray, int],
) -> None:
    a, _, src, dst, peer = pair
    s, d = _addr(src), _addr(dst)
    with pytest.raises(NativeTransportError, match=r"fragment 0 overflows: src 0xffffffffffffffff \+ length 2"):
        a.write(peer, [2**64 - 1], [d], [2])
    with pytest.raises(NativeTransportError, match=r"fragment 0 overflows: dst"):
        a.write(peer, [s], [2**64 - 8], [16])
    with pytest.raises(NativeTransportError, match=r"at least one fragment, got n == 0"):
        a.write(peer, [], [], [])
    with pytest.raises(NativeTransportError, match=r"fragment 0 has length 0"):
        a.write(peer, [s], [d], [0])
    with pytest.raises(NativeTransportError, match=r"src, dst and lengths differ in length: 2, 1 and 2"):
        a.write(peer, [s, s + 8], [d], [8, 8])
    with pytest.raises(NativeTransportError, match=r"src\[1\]: expected an int in \[0, 2\*\*64\)"):
        a.write(peer, [s, -1], [d, d], [1, 1])
    with pytest.raises(NativeTransportError, match=r"lengths\[0\]: expected an int, got str"):
        a.write(peer, [s], [d], ["8"])
    with pytest.raises(NativeTransportError, match=r"dst: expected a sequence of ints or a uint64 array, got bytes"):
        a.write(peer, [s], b"\0" * 8, [8])
    with pytest.raises(NativeTransportError, match=r"timeout_s must be positive"):
        a.write(peer, [s], [d], [8], timeout_s=0.0)
    assert not dst.any() and a.in_flight == 0


def test_unknown_and_disconnected_peers_and_a_closed_poster_are_refused(
    pair: tuple[NixlPoster, NixlPoster, np.ndarray, np.ndarray, int],
) -> None:
    a, b, src, dst, peer = pair
    s, d = _addr(src), _addr(dst)
    with pytest.raises(NativeTransportError, match=r"unknown peer 7 "):
        a.write(7, [s], [d], [8])
    with pytest.raises(NativeTransportError, match=r"unknown peer -1 "):
        a.write(-1, [s], [d], [8])
    with pytest.raises(NativeTransportError, match=r"connected already as peer 0"):
        a.connect(b.descriptor())
    with pytest.raises(NativeTransportError, match=r"the descriptor is this poster's own"):
        a.connect(a.descriptor())
    a.disconnect(peer)
    with pytest.raises(NativeTransportError, match=r"peer 0 was disconnected"):
        a.write(peer, [s], [d], [8])
    with pytest.raises(NativeTransportError, match=r"disconnect: already disconnected peer 0"):
        a.disconnect(peer)
    again = a.connect(b.descriptor())  # a fresh slot; the old one stays "disconnected"
    assert again == 1
    a.write(again, [s], [d], [8])
    a.close()
    a.close()  # again: nothing
    assert a.closed
    for call in (lambda: a.write(again, [s], [d], [8]), a.descriptor, lambda: a.register(s, 8), a.capsule):
        with pytest.raises(NativeTransportError, match=r"closed"):
            call()


def test_registrations_are_checked() -> None:
    mem = np.zeros(MiB, np.uint8)
    with NixlPoster(f"reg-{os.getpid()}") as poster:
        poster.register(_addr(mem), 4096)
        with pytest.raises(NativeTransportError, match=r"overlaps registration"):
            poster.register(_addr(mem) + 4095, 10)
        with pytest.raises(NativeTransportError, match=r"length must be positive, got 0"):
            poster.register(_addr(mem) + 8192, 0)
        with pytest.raises(NativeTransportError, match=r"passes 2\*\*64"):
            poster.register(2**64 - 4096, 8192)
        poster.register(_addr(mem) + 4096, 4096)  # adjacent is fine


def test_a_missing_library_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCORE_NIXL_CAPI", "/nonexistent/libnixl_capi.so")
    with pytest.raises(NativeTransportError, match=r"KVCORE_NIXL_CAPI='/nonexistent/libnixl_capi.so' is not a file"):
        nixl_capi_path()


def test_a_library_that_will_not_open_is_a_typed_error_at_construction(tmp_path: Any) -> None:
    """The package imports without a working NIXL; constructing a poster says what is wrong (in a fresh process:
    this one has NIXL loaded already)."""
    fake = tmp_path / "libnixl_capi.so"
    fake.write_bytes(b"not a shared object")
    env = {"KVCORE_NIXL_CAPI": str(fake)}
    with RankProcess("test_nixl_poster:construct_main", name="nixl-missing", path=[HERE], env=env) as child:
        result = child.call("construct", timeout=60.0)
        child.call("exit", timeout=30.0)
    assert result["error"].startswith(f"NativeTransportError: cannot open NIXL's C API at {fake}: "), result


# --- untrusted descriptors -------------------------------------------------------------------------------------------


def _field(tag: bytes, data: bytes, claimed: int | None = None) -> bytes:
    """One field of NIXL's serializer (nixlSerDes): tag, little-endian u64 length, bytes, '|'."""
    return tag + struct.pack("<Q", len(data) if claimed is None else claimed) + data + b"|"


def _descriptor(conns: int = 1, sections: int = 1, descs: int = 1, name_claim: int | None = None) -> bytes:
    """A descriptor in NIXL 1.5's layout with the counts given (the UCX blobs are placeholders)."""
    region = struct.pack("<QQQ", 0x10000, 4096, 0) + b"\x01" + b"\0" * 9 + b"\xff"
    return (
        b"nixlSerDes|"
        + _field(b"Agent", b"forged", name_claim)
        + _field(b"Conns", struct.pack("<Q", conns))
        + _field(b"t", b"UCX")
        + _field(b"c", b"\0" * 32)
        + _field(b"", b"MemSection")
        + _field(b"nixlSecElms", struct.pack("<Q", sections))
        + _field(b"bknd", b"UCX")
        + _field(b"nixlDList", b"nixlSDList")
        + _field(b"t", struct.pack("<I", 0))
        + _field(b"n", struct.pack("<Q", descs))
        + _field(b"", region)
    )


@pytest.mark.parametrize(
    ("blob", "why"),
    [
        (_descriptor(conns=2**62), r"connection count is 4611686018427387904, at most 16"),
        (_descriptor(sections=2**40), r"memory section count is 1099511627776, at most 16"),
        (_descriptor(descs=2**63), r"registration count is 9223372036854775808, at most 4096"),
        (_descriptor(name_claim=2**64 - 1), r"the agent name claims 18446744073709551615 bytes"),
        (_descriptor(descs=2), r"truncated at byte \d+: a registration needs a 8-byte header, 0 bytes left"),
        (_descriptor() + b"x", r"1 trailing bytes after its memory sections"),
        (_descriptor().replace(b"MemSection", b"MemSectioM"), r"expected the 'MemSection' marker"),
        (b"nixlSerDes|" + b"\xff" * (MiB + 1), r"descriptor of 1048588 bytes refused: at most 1048576"),
        (b"", r"not a NIXL descriptor: 0 bytes"),
    ],
    ids=["conns", "sections", "registrations", "name-length", "truncated", "trailing", "marker", "oversize", "empty"],
)
def test_malformed_descriptors_are_refused_before_nixl_sees_them(blob: bytes, why: str) -> None:
    with NixlPoster(f"md-{os.getpid()}") as poster, pytest.raises(NativeTransportError, match=why):
        poster.connect(blob)


def test_a_fuzzed_descriptor_is_a_typed_error_never_a_crash() -> None:
    """Random bytes, random bytes behind NIXL's header, every truncation of a real descriptor, in a child: a
    crash there fails the test instead of killing pytest."""
    with RankProcess("test_nixl_poster:fuzz_main", name="nixl-fuzz", path=[HERE]) as fuzzer:
        try:
            result = fuzzer.call("fuzz", timeout=120.0, seed=SEED, rounds=400)
        except RankExitedError as exc:
            pytest.fail(f"connect() crashed the process on a malformed descriptor: {exc}")
        assert result["accepted"] == 0, result
        assert result["refused"] == result["tried"] > 800, result
        fuzzer.call("exit", timeout=30.0)
    assert fuzzer.exitcode == 0


# --- a dead peer ---------------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_killed_peer_fails_the_write_within_its_timeout_and_close_still_works() -> None:
    source = pattern(SEED + 1, MiB)
    with NixlPoster(f"orphan-{os.getpid()}") as sender:
        sender.register(_addr(source), source.nbytes)
        with RankProcess("test_nixl_poster:receiver_main", name="nixl-victim", path=[HERE]) as victim:
            got = victim.call("setup", timeout=60.0, name=f"victim-{os.getpid()}", nbytes=MiB)
            peer = sender.connect(got["descriptor"])
            sender.write(peer, [_addr(source)], [got["addr"]], [MiB])  # alive: it lands
            victim.kill()
        t0 = time.monotonic()
        for _ in range(2):  # the first write after the death, and one more: each an error, none a hang
            with pytest.raises(NativeTransportError, match=r"peer 0 \('victim-\d+'\)"):
                sender.write(peer, [_addr(source)], [got["addr"]], [MiB], timeout_s=10.0)
        assert time.monotonic() - t0 < 20.0
        assert sender.in_flight == 0
        sender.disconnect(peer)


# --- the capsule: the vtable C threads use ---------------------------------------------------------------------------

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


class _Vtable(ctypes.Structure):
    """kvn_poster.h's kvn_poster_vtable."""

    _fields_ = [("abi", ctypes.c_int), ("backend", ctypes.c_char_p), ("post_write", _POST), ("poll", _POLL),
                ("release", _RELEASE)]  # fmt: skip


class _Ref(ctypes.Structure):
    """kvn_poster.h's kvn_poster_ref."""

    _fields_ = [("vt", ctypes.POINTER(_Vtable)), ("self", ctypes.c_void_p)]


def _ref(capsule: object) -> _Ref:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return _Ref.from_address(get(capsule, b"kvcore_native.poster"))


def _u64s(*values: int) -> Any:
    return (ctypes.c_uint64 * len(values))(*values)


def test_the_capsule_holds_the_vtable_and_close_refuses_while_a_handle_is_not_released(
    pair: tuple[NixlPoster, NixlPoster, np.ndarray, np.ndarray, int],
) -> None:
    a, _, src, dst, peer = pair
    src[:] = pattern(11, src.nbytes)
    capsule = a.capsule()
    valid = ctypes.pythonapi.PyCapsule_IsValid
    valid.restype, valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    assert valid(capsule, b"kvcore_native.poster") == 1 and valid(capsule, b"other") == 0
    ref = _ref(capsule)
    vt = ref.vt.contents
    assert vt.abi == 1 and vt.backend == b"nixl"
    err = ctypes.create_string_buffer(512)
    handle = ctypes.c_void_p()
    assert vt.post_write(ref.self, 99, _u64s(_addr(src)), _u64s(_addr(dst)), _u64s(8), 1, handle, err, 512) == -1
    assert b"unknown peer 99" in err.value and not handle.value
    assert vt.post_write(ref.self, peer, _u64s(), _u64s(), _u64s(), 0, handle, err, 512) == -1
    assert b"n == 0" in err.value
    rc = vt.post_write(ref.self, peer, _u64s(_addr(src), _addr(src) + 4096), _u64s(_addr(dst) + 64, _addr(dst)),
                       _u64s(4096, 64), 2, handle, err, 512)  # fmt: skip
    assert rc == 0 and handle.value, err.value
    assert a.in_flight == 1
    with pytest.raises(NativeTransportError, match=r"close: 1 writes .* posted and not released"):
        a.close()
    with pytest.raises(NativeTransportError, match=r"disconnect: peer 0 has 1 writes posted and not released"):
        a.disconnect(peer)
    deadline = time.monotonic() + 10.0
    while (state := vt.poll(ref.self, handle, err, 512)) == 0 and time.monotonic() < deadline:
        pass
    assert state == 1, err.value  # KVN_DONE: every byte is in the peer's memory
    assert bytes(dst[64:4160]) == bytes(src[:4096]) and bytes(dst[:64]) == bytes(src[4096:4160])
    assert a.in_flight == 1  # done, not yet released
    vt.release(ref.self, handle)  # the handle is gone: polling it again would be the caller's use after free
    assert a.in_flight == 0
    a.close()
    assert vt.post_write(ref.self, peer, _u64s(_addr(src)), _u64s(_addr(dst)), _u64s(8), 1, handle, err, 512) == -1
    assert b"closed" in err.value  # the capsule keeps the poster alive; a closed one refuses
    del capsule


def test_a_write_past_its_timeout_is_abandoned_and_close_will_not_drop_it() -> None:
    """In UCX's peer error mode a large write needs the target's progress; this target never progresses, so the
    write times out, stays in flight (abandoned) and close refuses to drop the registrations under it."""
    with RankProcess("test_nixl_poster:abandon_main", name="nixl-abandon", path=[HERE]) as child:
        result = child.call("abandon", timeout=60.0)
        assert "did not end within 0.3 s" in result["write_error"], result
        assert result["in_flight_after_timeout"] == 1
        assert "1 abandoned writes did not end within 5.0 s; the poster stays open" in result["close_error"], result
        assert result["in_flight_after_close"] == 1
        child.call("exit", timeout=30.0)


def test_no_progress_thread_and_no_listener_run(tmp_path: Any) -> None:
    """The agent config struct as declared reaches NIXL: a progress thread would spin a core (delay 0), a listener
    would add a thread; a fresh process with a poster has one thread more than without (UCX's), and idles."""
    with RankProcess("test_nixl_poster:threads_main", name="nixl-threads", path=[HERE]) as child:
        result = child.call("measure", timeout=60.0)
        child.call("exit", timeout=30.0)
    assert result["with_poster"] - result["before"] <= 1, result
    assert result["idle_cpu_s"] < 0.1, result
    assert result["after_close"] <= result["with_poster"], result


# --- rank process targets ------------------------------------------------------------------------------------------


class _Receiver:
    def __init__(self) -> None:
        self.poster: NixlPoster | None = None
        self.buf: np.ndarray | None = None

    def op_setup(self, name: str, nbytes: int) -> dict[str, Any]:
        self.buf = np.zeros(nbytes, np.uint8)
        self.poster = NixlPoster(name)
        self.poster.register(_addr(self.buf), nbytes)
        return {"descriptor": self.poster.descriptor(), "addr": _addr(self.buf)}

    def op_check(self, seed: int) -> dict[str, Any]:
        assert self.buf is not None
        wrong = np.flatnonzero(self.buf != _expected(seed))
        return {"mismatches": int(wrong.size), "first": int(wrong[0]) if wrong.size else -1}

    def op_exit(self) -> None:
        if self.poster is not None:
            self.poster.close()


def receiver_main(channel: Channel) -> None:
    serve(channel, _Receiver())


class _Fuzzer:
    def op_fuzz(self, seed: int, rounds: int) -> dict[str, Any]:
        rng = random.Random(seed)
        mem = np.zeros(64 * KiB, np.uint8)
        with NixlPoster(f"fuzz-peer-{os.getpid()}") as peer, NixlPoster(f"fuzz-{os.getpid()}") as poster:
            peer.register(_addr(mem), 4096)
            peer.register(_addr(mem) + 8192, 4096)
            real = peer.descriptor()
            blobs = [real[:n] for n in range(len(real))]
            blobs += [rng.randbytes(rng.randrange(0, 2048)) for _ in range(rounds)]
            blobs += [b"nixlSerDes|" + rng.randbytes(rng.randrange(0, 512)) for _ in range(rounds)]
            accepted = refused = 0
            for blob in blobs:
                try:
                    poster.disconnect(poster.connect(blob))
                    accepted += 1
                except NativeTransportError:
                    refused += 1
            poster.disconnect(poster.connect(real))  # the real one, whole, still connects afterwards
        return {"tried": len(blobs), "accepted": accepted, "refused": refused}


def fuzz_main(channel: Channel) -> None:
    serve(channel, _Fuzzer())


class _Abandoner:
    def __init__(self) -> None:
        self.keep: list[Any] = []

    def op_abandon(self) -> dict[str, Any]:
        params = {"ucx_error_handling_mode": "peer"}
        a, b = NixlPoster(f"ab-a-{os.getpid()}", params), NixlPoster(f"ab-b-{os.getpid()}", params)
        src, dst = np.ones(4 * MiB, np.uint8), np.zeros(4 * MiB, np.uint8)
        self.keep += [a, b, src, dst]  # kept for the process's life: a write may still be in flight into dst
        a.register(_addr(src), src.nbytes)
        b.register(_addr(dst), dst.nbytes)
        peer = a.connect(b.descriptor())
        result: dict[str, Any] = {}
        try:
            a.write(peer, [_addr(src)], [_addr(dst)], [src.nbytes], timeout_s=0.3)
            result["write_error"] = ""
        except NativeTransportError as exc:
            result["write_error"] = str(exc)
        result["in_flight_after_timeout"] = a.in_flight
        try:
            a.close()
            result["close_error"] = ""
        except NativeTransportError as exc:
            result["close_error"] = str(exc)
        result["in_flight_after_close"] = a.in_flight
        return result


def abandon_main(channel: Channel) -> None:
    serve(channel, _Abandoner())


class _Constructor:
    def op_construct(self) -> dict[str, Any]:
        try:
            NixlPoster("never").close()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": ""}


def construct_main(channel: Channel) -> None:
    serve(channel, _Constructor())


def _threads() -> int:
    """Threads of this process, C threads included (Python's threading does not see them)."""
    return len(os.listdir("/proc/self/task"))


class _Threads:
    def op_measure(self) -> dict[str, Any]:
        before = _threads()
        poster = NixlPoster(f"threads-{os.getpid()}")
        with_poster = _threads()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(0.3)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        poster.close()
        idle = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        return {"before": before, "with_poster": with_poster, "idle_cpu_s": idle, "after_close": _threads()}


def threads_main(channel: Channel) -> None:
    serve(channel, _Threads())
