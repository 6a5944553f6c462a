"""``UcxPoster``: a native poster (``kvn_poster.h``) on UCX RMA, for the lane's C thread and for Python.

One poster owns a UCP context and worker of its own, the host memory it registered (``ucp_mem_map``) and its peers.
A WRITE is one ``ucp_put_nbx`` per run of fragments that continue each other on both sides (inside one
registration on each) and one ``ucp_ep_flush_nbx`` of the peer's endpoint, all in C: its end is a promise that
every byte is in the peer's memory. (UCX's CMA copies a put in segments of up to 512 KiB, one system call each:
8192 puts of 64 KiB cost eight times the calls of the same bytes merged.) libucp is the ``libucx-cu12`` wheel's, opened at run time
by path (:func:`libucp_path`), so ``kvcore_native._ucx`` imports where UCX is missing and constructing a poster
then says so.

Options (all strings):

- ``error_handling``: ``"peer"`` (default: UCX reports a lost peer; TCP for wire-up, CMA for the puts on one
  host) or ``"none"`` (shared memory and CMA, truly one-sided, but a peer lost on another host is never
  reported). Both ends must agree; ``connect`` refuses a descriptor of the other mode.
- ``progress_thread``: ``"true"`` (default) runs a C thread that sleeps on the worker's event fd and progresses
  it, so that a poster nobody writes from (a target) still answers wire-up and the puts it must serve;
  ``"false"`` leaves progress to the writer's polls.
- ``close_timeout_s``: bound on draining abandoned writes and closing endpoints (default ``"2.0"``).
- ``ucx_<name>``: the UCX setting ``<NAME>`` (``ucx_tls="tcp,cma"`` is ``UCX_TLS``), applied with
  ``ucp_config_modify`` over the ``UCX_*`` environment, as kvcore-ucx's ``ucx_config`` does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final, Union

from kvcore_native import _ucx
from kvcore_native.errors import NativeTransportError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["UcxPoster", "libucp_path", "MAX_PEERS", "MAX_REGIONS", "MAX_FRAGMENTS", "MAX_HANDLES"]

#: Fragments of a write: ints, or a 1-D uint64 array (any buffer of uint64).
U64s = Union[Sequence[int], "npt.NDArray[np.uint64]", memoryview]

MAX_PEERS: Final = _ucx.MAX_PEERS
MAX_REGIONS: Final = _ucx.MAX_REGIONS
MAX_FRAGMENTS: Final = _ucx.MAX_FRAGMENTS
MAX_HANDLES: Final = _ucx.MAX_HANDLES

_OPTIONS = ("error_handling", "progress_thread", "close_timeout_s", "ucx_<name>")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_lock = threading.Lock()


def libucp_path() -> str:
    """The libucp file to open: ``$KVCORE_UCX_LIBDIR/libucp.so.0``, else the ``libucx`` wheel's, else the system's.

    Raises :class:`NativeTransportError` naming every place tried.
    """
    tried: list[str] = []
    dirs: list[str] = []
    env = os.environ.get("KVCORE_UCX_LIBDIR")
    if env:
        dirs.append(env)
    try:
        import libucx

        dirs.extend(os.path.join(d, "lib") for d in libucx.__path__)
    except ImportError:
        tried.append("the libucx package: not installed")
    for d in dirs:
        path = os.path.join(d, "libucp.so.0")
        if os.path.exists(path):
            return path
        tried.append(f"{path}: not found")
    import ctypes.util

    found = ctypes.util.find_library("ucp")
    if found is not None:
        return found
    raise NativeTransportError(
        "libucp not found: " + "; ".join([*tried, "the system: no libucp"]) + ". Install it with "
        "'pip install libucx-cu12' or set KVCORE_UCX_LIBDIR to a directory holding libucp.so.0"
    )


def _load() -> None:
    with _lock:
        if _ucx.version() is None:
            path = libucp_path()
            try:
                _ucx.load(path)
            except OSError as exc:
                raise NativeTransportError(str(exc)) from exc


def _settings(options: Mapping[str, str]) -> tuple[list[tuple[str, str]], bool, bool, float]:
    """``(ucx settings, error_peer, progress_thread, close_timeout_s)`` from a poster's options."""
    settings: list[tuple[str, str]] = []
    error_peer, thread, close_timeout_s = True, True, 2.0
    for key, value in options.items():
        if not isinstance(value, str):
            raise NativeTransportError(f"ucx poster option {key!r}: a str expected, got {type(value).__name__}")
        if key == "error_handling":
            if value not in ("peer", "none"):
                raise NativeTransportError(
                    f"ucx poster option error_handling: 'peer' or 'none' expected, got {value!r}"
                )
            error_peer = value == "peer"
        elif key == "progress_thread":
            if value.lower() not in _TRUE | _FALSE:
                raise NativeTransportError(
                    f"ucx poster option progress_thread: 'true' or 'false' expected, got {value!r}"
                )
            thread = value.lower() in _TRUE
        elif key == "close_timeout_s":
            try:
                close_timeout_s = float(value)
            except ValueError:
                close_timeout_s = -1.0
            if not 0 < close_timeout_s < 3600:
                raise NativeTransportError(
                    f"ucx poster option close_timeout_s: seconds in (0, 3600) expected, got {value!r}"
                )
        elif key.lower().startswith("ucx_") and len(key) > 4:
            settings.append((key[4:].upper(), value))
        else:
            raise NativeTransportError(f"ucx poster: unknown option {key!r}; known: {', '.join(_OPTIONS)}")
    return settings, error_peer, thread, close_timeout_s


class UcxPoster:
    """A UCX poster: its own UCP context and worker, registrations and peers; writes with no Python on their path."""

    backend: str = "ucx"

    def __init__(self, name: str, options: Mapping[str, str] | None = None) -> None:
        settings, error_peer, thread, close_timeout_s = _settings(options or {})
        _load()
        self.name = name
        label = name.encode()[:31].decode(errors="ignore")  # UCX's context name (its logs) holds 31 bytes
        self._p = _ucx.Poster(label, settings, error_peer, thread, close_timeout_s)

    def register(self, addr: int, length: int) -> None:
        """Map host memory (DRAM) ``[addr, addr + length)`` this side may write from or be written into."""
        self._p.register(addr, length)

    def descriptor(self) -> bytes:
        """What a peer's :meth:`connect` reads: this worker's address and the registrations made so far."""
        return self._p.descriptor()

    def connect(self, descriptor: bytes) -> int:
        """A peer slot (a small int) for the poster that made ``descriptor`` (untrusted: checked, bounded)."""
        return self._p.connect(descriptor)

    def disconnect(self, peer: int) -> None:
        """Drop a peer (refused while its writes are posted); its abandoned writes drain first, bounded."""
        self._p.disconnect(peer)

    def write(self, peer: int, src: U64s, dst: U64s, lengths: U64s, timeout_s: float = 10.0) -> None:
        """One WRITE of local ``[src[i], +lengths[i])`` to the peer's ``[dst[i], +lengths[i])``, to its end.

        Posted through the vtable and polled with the GIL released; returns once every byte is in the peer's
        memory. Raises :class:`NativeTransportError` on refusal (nothing moved), failure or timeout.
        """
        self._p.write(peer, src, dst, lengths, timeout_s)

    def capsule(self) -> object:
        """A PyCapsule named ``kvcore_native.poster`` holding this poster's ``kvn_poster_ref`` (keeps it alive)."""
        return self._p.capsule()

    def close(self) -> None:
        """Drain abandoned writes (bounded), drop peers, registrations and the worker; again: nothing.

        Refused (:class:`NativeTransportError`) while writes are posted and not released.
        """
        self._p.close()

    @property
    def in_flight(self) -> int:
        """Writes posted and not released, plus abandoned ones still pending."""
        return self._p.in_flight

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._p.closed

    @property
    def puts(self) -> int:
        """UCX puts posted so far (by Python and by a lane): one per run of fragments that continue each other."""
        return self._p.puts

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"in_flight={self.in_flight}"
        return f"UcxPoster({self.name!r}, {state})"
