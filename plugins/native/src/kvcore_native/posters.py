"""The native posters by kvcore backend name, made from the transceiver's ``agent_options``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvcore_native.errors import NativeTransportError

__all__ = ["NativePoster", "create_poster", "missing_library", "POSTER_BACKENDS"]

#: kvcore backends with a native poster.
POSTER_BACKENDS = ("nixl", "ucx")


class NativePoster(Protocol):
    """What the transceiver's lane uses of a poster (``kvcore_native.ucx.UcxPoster``, ``.nixl.NixlPoster``)."""

    backend: str

    def register(self, addr: int, length: int) -> None: ...
    def descriptor(self) -> bytes: ...
    def connect(self, descriptor: bytes) -> int: ...
    def capsule(self) -> object: ...
    def close(self) -> None: ...


def _options(backend: str, agent_options: Mapping[str, Any], local: bool) -> dict[str, str]:
    """A poster's options from the agent's: its UCX settings (``ucx_*`` keys, and the UCX agent's ``ucx_config``
    entries, which either backend's poster applies to its own UCX) and, for UCX, the error-handling mode the agent
    would choose for these peers."""
    out = {k: str(v) for k, v in agent_options.items() if k.lower().startswith("ucx_") and isinstance(v, str)}
    config = agent_options.get("ucx_config")
    if isinstance(config, Mapping):
        out.update({f"ucx_{str(k).removeprefix('UCX_').lower()}": str(v) for k, v in config.items()})
    if backend == "ucx":
        # As kvcore-ucx's "auto": "none" between processes of one host (CMA, no progress needed on the target),
        # "peer" across hosts (UCX 1.22 emulates puts in software there, so the target's thread must progress).
        mode = str(agent_options.get("error_handling", "auto"))
        if mode not in ("none", "peer"):
            mode = "none" if local else "peer"
        out["error_handling"] = mode
        out["progress_thread"] = "true" if mode == "peer" else "false"
    return out


def missing_library(backend: str) -> str:
    """Why ``backend``'s poster cannot start here ("" when its library is found), without loading the library."""
    try:
        if backend == "ucx":
            from kvcore_native.ucx import libucp_path

            libucp_path()
        elif backend == "nixl":
            from kvcore_native.nixl import nixl_capi_path

            nixl_capi_path()
        else:
            return f"no native poster for backend {backend!r}"
    except NativeTransportError as exc:
        return str(exc)
    return ""


def create_poster(
    backend: str, name: str, agent_options: Mapping[str, Any] | None = None, *, local: bool = False
) -> NativePoster:
    """A poster of ``backend`` named ``name`` (unique among the peers), with the agent's UCX settings; ``local``:
    every peer runs on this host (the lane binds loopback)."""
    options = _options(backend, agent_options or {}, local)
    if backend == "ucx":
        from kvcore_native.ucx import UcxPoster

        return UcxPoster(name, options)
    if backend == "nixl":
        from kvcore_native.nixl import NixlPoster

        return NixlPoster(name, options)
    raise NativeTransportError(f"no native poster for backend {backend!r} (there are: {', '.join(POSTER_BACKENDS)})")
