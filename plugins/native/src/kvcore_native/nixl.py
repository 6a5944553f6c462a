"""NIXL's poster: one NIXL agent (UCX backend) in this process that moves bytes by one-sided WRITE, in C.

:class:`NixlPoster` wraps ``kvcore_native._nixl``, a C extension that opens NIXL's C API (``libnixl_capi.so``
from the installed ``nixl-cu12`` or ``nixl-cu13`` wheel, found by :func:`nixl_capi_path`) at run time, so the
package builds and imports where NIXL is missing; constructing a poster then raises
:class:`~kvcore_native.errors.NativeTransportError` saying so. Its :meth:`~NixlPoster.capsule` hands the same
poster to C (``kvn_poster.h``): kvcore-native's lane posts, polls and releases writes through it with no Python
on the path.

One agent per poster, named by the constructor (NIXL agent names must be unique among the peers), created with no
progress thread (NIXL 1.5's default spins a core) and no listener; one UCX backend with
:data:`DEFAULT_BACKEND_PARAMS` under the options given; DRAM registrations. The descriptor is the agent's NIXL
metadata; :meth:`~NixlPoster.connect` checks it against the layout NIXL writes (every count and length bounded,
at most 1 MiB) before NIXL loads it, and takes the peer's registered DRAM from it, so that a write outside either
side's registrations is refused here, naming the fragment. What this cannot check is UCX's own packing of the
worker address and rkeys inside, which UCX unpacks without bounds (a forged rkey can crash the process in
``ucp_ep_rkey_unpack``): descriptors must come from peers the control plane authenticated.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvcore_native import _nixl
from kvcore_native.errors import NativeTransportError

if TYPE_CHECKING:
    from types import TracebackType
    from typing import Self

    from typing_extensions import Buffer

__all__ = ["DEFAULT_BACKEND_PARAMS", "NIXL_CAPI_ENV", "NIXL_PACKAGES", "NixlPoster", "nixl_capi_path"]

#: UCX backend params under the options a poster is given: ``none`` lets same-host writes be one-sided CMA puts
#: over shared-memory wireup (no progress needed on the target; a dead target is still reported).
DEFAULT_BACKEND_PARAMS: dict[str, str] = {"ucx_error_handling_mode": "none"}
#: The NIXL wheels whose C API a poster opens, in order.
NIXL_PACKAGES = ("nixl_cu12", "nixl_cu13")
#: An explicit path to ``libnixl_capi.so``, taking precedence over the wheels.
NIXL_CAPI_ENV = "KVCORE_NIXL_CAPI"

_CAPI = "libnixl_capi.so"
_lock = threading.Lock()
_nixl.set_error_type(NativeTransportError)


def nixl_capi_path() -> str:
    """The file of NIXL's C API: ``$KVCORE_NIXL_CAPI``, else the installed NIXL wheel's ``libnixl_capi.so``.

    Raises :class:`NativeTransportError` naming where it looked when there is none.
    """
    explicit = os.environ.get(NIXL_CAPI_ENV)
    if explicit:
        if not os.path.isfile(explicit):
            raise NativeTransportError(f"{NIXL_CAPI_ENV}={explicit!r} is not a file")
        return explicit
    looked: list[str] = []
    for package in NIXL_PACKAGES:
        spec = importlib.util.find_spec(package)  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            # meson-python wheels keep their libraries in site-packages/.<package>.mesonpy.libs
            path = os.path.join(os.path.dirname(location), f".{package}.mesonpy.libs", _CAPI)
            if os.path.isfile(path):
                return path
            looked.append(path)
    where = f" (looked at {', '.join(looked)})" if looked else ""
    raise NativeTransportError(
        f"NIXL's C API ({_CAPI}) not found: install nixl-cu12 or nixl-cu13, or set {NIXL_CAPI_ENV}{where}"
    )


def _load() -> None:
    with _lock:
        if not _nixl.loaded():
            _nixl.load(nixl_capi_path())


def _params(options: Mapping[str, str] | None) -> list[tuple[str, str]]:
    merged = dict(DEFAULT_BACKEND_PARAMS)
    for key, value in (options or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise NativeTransportError(
                f"nixl poster options: UCX backend params are str to str, got {key!r}: {type(value).__name__}"
            )
        merged[key] = value
    return sorted(merged.items())


class NixlPoster:
    """A NIXL agent of this process's own that writes registered DRAM into a peer poster's, one-sided.

    ``options`` are NIXL UCX backend params (``{"num_workers": "2"}``), merged over :data:`DEFAULT_BACKEND_PARAMS`.
    Every method takes the poster's own mutex (C threads using :meth:`capsule` take it too) and releases the GIL
    while it may wait. Refusals and failures raise :class:`NativeTransportError` naming what was wrong.
    """

    backend: str = "nixl"

    def __init__(self, name: str, options: Mapping[str, str] | None = None) -> None:
        params = _params(options)
        _load()
        self._poster = _nixl.Poster(name, params)

    @property
    def name(self) -> str:
        """The NIXL agent name, as peers see it."""
        return self._poster.name

    @property
    def in_flight(self) -> int:
        """Writes posted and not released, plus released ones still pending (abandoned, driven to their end)."""
        return self._poster.in_flight

    @property
    def closed(self) -> bool:
        return self._poster.closed

    def register(self, addr: int, length: int) -> None:
        """Register ``length`` bytes of host memory at ``addr``: a source of this side's writes, or a destination
        of a peer's (registrations made after :meth:`descriptor` reach peers that connect later)."""
        self._poster.register(addr, length)

    def descriptor(self) -> bytes:
        """What a peer's :meth:`connect` needs: this agent's NIXL metadata, its registrations included."""
        return self._poster.descriptor()

    def connect(self, descriptor: bytes) -> int:
        """Load a peer's descriptor and return the peer's slot (a small int).

        The descriptor is checked against NIXL's layout before NIXL sees it (a :class:`NativeTransportError`
        names what is wrong). An agent connected already is refused: disconnect it first, to load the
        registrations it made since. The UCX worker address and rkeys inside are UCX's own packed formats,
        which UCX reads without bounds: a descriptor must come from a peer the control plane authenticated.
        """
        return self._poster.connect(descriptor)

    def disconnect(self, peer: int) -> None:
        """Forget a peer. Refused while writes to it are posted and not released; abandoned ones are drained first."""
        self._poster.disconnect(peer)

    def write(
        self,
        peer: int,
        src: Sequence[int] | Buffer,
        dst: Sequence[int] | Buffer,
        lengths: Sequence[int] | Buffer,
        timeout_s: float = 10.0,
    ) -> None:
        """Write local ``[src[i], src[i] + lengths[i])`` to the peer's ``[dst[i], ...)`` for every i, as one WRITE.

        Returns when every byte is in the peer's memory. The three are equally long sequences of ints or uint64
        buffers (numpy ``uint64`` arrays are read in place). Raises :class:`NativeTransportError` on refusal (a
        fragment outside either side's registrations, an unknown or disconnected peer, no fragment), on failure
        (a dead peer) or when the write did not end within ``timeout_s`` (it is then abandoned: driven to its end
        by later writes and by :meth:`close`).
        """
        self._poster.write(peer, src, dst, lengths, timeout_s)

    def capsule(self) -> object:
        """A ``PyCapsule`` named ``kvcore_native.poster`` holding this poster's ``kvn_poster_ref``; it keeps the
        poster alive while it lives."""
        return self._poster.capsule()

    def close(self) -> None:
        """Drain abandoned writes (bounded), deregister the memory and destroy the agent; again: nothing.

        Refused while writes are posted and not released, and when abandoned writes do not end in time (the
        poster then stays open with its registrations).
        """
        self._poster.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"in_flight={self.in_flight}"
        return f"NixlPoster({self.name!r}, {state})"
