"""kvcore plugin module for kvcore-nixl: the ``nixl`` transfer agent and its bench baselines (lazily; nothing heavy imported)."""

from __future__ import annotations

from kvcore.extension.hookspecs import hookimpl
from kvcore.extension.registry import BenchBaselineRegistry, TransferAgentRegistry
from kvcore.transport.agent import AgentCapabilities, MemoryKind

KVCORE_PLUGIN_API = 1

#: How to get NIXL's native library: the one wording, used by the registry entry and by ``load_nixl``'s error.
INSTALL_HINT = (
    "pip install 'kvcore-nixl[cu12]'  (or kvcore-nixl[cu13]; needs the nixl-cu12 / nixl-cu13 wheel "
    "matching your CUDA; the 'nixl' meta package is optional)"
)

#: What ``NixlAgent`` can do: stated once here, read back by ``NixlAgent.capabilities``.
CAPABILITIES = AgentCapabilities(
    memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.VRAM}),
    write=True,
    read=True,
    notifications=True,
    remote=True,
    can_abort=False,
)


@hookimpl
def kvcore_register_transfer_agents(registry: TransferAgentRegistry) -> None:
    """Register ``nixl``: one-sided WRITE/READ over NIXL (UCX by default), DRAM and VRAM, notifications."""
    registry.add(
        "nixl",
        "kvcore_nixl.agent:NixlAgent",
        capabilities=CAPABILITIES,
        auto_priority=100,  # backend="auto" picks NIXL first when its native library loads
        description="NVIDIA NIXL (UCX backend by default; LIBFABRIC and others via agent options)",
        install_hint=INSTALL_HINT,
    )


@hookimpl
def kvcore_register_bench_baselines(registry: BenchBaselineRegistry) -> None:
    """Register NIXL's own API as ``kvcore bench`` baselines beside the ``nixl`` agent."""
    registry.add(
        "nixl_initialize",
        "kvcore_nixl.bench.baselines:NixlInitialize",
        backend="nixl",
        in_matrix=True,
        description="bare nixl_agent, initialize_xfer per transfer",
        install_hint=INSTALL_HINT,
    )
    registry.add(
        "nixl_prepped",
        "kvcore_nixl.bench.baselines:NixlPrepped",
        backend="nixl",
        description="bare nixl_agent, prepared descriptor lists re-posted",
        install_hint=INSTALL_HINT,
    )
