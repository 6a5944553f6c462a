"""kvcore plugin module for kvcore-nixl: registers the ``nixl`` transfer agent (lazily, nothing heavy imported)."""

from __future__ import annotations

from kvcore.agent import AgentCapabilities, MemoryKind
from kvcore.hookspecs import hookimpl
from kvcore.registry import TransferAgentRegistry

KVCORE_PLUGIN_API = 1

INSTALL_HINT = (
    "pip install 'kvcore-nixl[cu12]'  (or kvcore-nixl[cu13]; needs the nixl-cu12 / nixl-cu13 wheel "
    "matching your CUDA; the 'nixl' meta package is optional)"
)


@hookimpl
def kvcore_register_transfer_agents(registry: TransferAgentRegistry) -> None:
    """Register ``nixl``: one-sided WRITE/READ over NIXL (UCX by default), DRAM and VRAM, notifications."""
    registry.add(
        "nixl",
        "kvcore_nixl.agent:NixlAgent",
        capabilities=AgentCapabilities(
            memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.VRAM}),
            write=True,
            read=True,
            notifications=True,
            remote=True,
            can_abort=False,
        ),
        description="NVIDIA NIXL (UCX backend by default; LIBFABRIC and others via agent options)",
        install_hint=INSTALL_HINT,
    )
