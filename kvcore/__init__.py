"""kvcore: move the KV cache of LLM requests from prefill workers into decode workers' memory.

``import kvcore`` is cheap: it loads no plugin and imports no transport.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from kvcore.config import TransceiverConfig, create_agent, resolve_backend
from kvcore.errors import *  # noqa: F403
from kvcore.errors import __all__ as _errors_all
from kvcore.extension.hookspecs import hookimpl
from kvcore.extension.plugins import KVCORE_PLUGIN_API, get_plugin_manager, make_plugin_manager
from kvcore.transport.agent import (
    AgentCapabilities,
    MemoryKind,
    MemoryRegion,
    Notification,
    Registration,
    TransferAgent,
    TransferHandle,
    TransferOp,
    TransferStatus,
)

try:  # the installed distribution's version: stated once, in pyproject.toml
    __version__ = _metadata.version("kvcore")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

#: The engine-facing API, imported on first use (``import kvcore`` stays cheap: no ZeroMQ, no plugin).
_LAZY = {
    "Transceiver": "kvcore.transceiver",
    "PollResult": "kvcore.transceiver",
    "Outcome": "kvcore.transceiver",
    "RequestStatus": "kvcore.transceiver",
    "SessionState": "kvcore.transceiver",
    "TransferParams": "kvcore.params",
    "new_ticket": "kvcore.params",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcore' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "__version__",
    "hookimpl",
    "KVCORE_PLUGIN_API",
    "AgentCapabilities",
    "MemoryKind",
    "MemoryRegion",
    "Notification",
    "Registration",
    "TransferAgent",
    "TransferHandle",
    "TransferOp",
    "TransferStatus",
    "TransceiverConfig",
    "create_agent",
    "resolve_backend",
    "get_plugin_manager",
    "make_plugin_manager",
    *_LAZY,
    *_errors_all,
]
