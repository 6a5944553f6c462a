"""The core's built-in plugin: the same-host shared-memory agent, the matching-heads mapper, the page-table builders.

Registered through the same hooks as any installed plugin; nothing heavy is
imported here.
"""

from __future__ import annotations

from kvcore.extension.hookspecs import hookimpl
from kvcore.extension.registry import LayoutMapperRegistry, PageTableBuilderRegistry, TransferAgentRegistry
from kvcore.transport.agent import AgentCapabilities, MemoryKind

KVCORE_PLUGIN_API = 1

#: What the shm agent can do: stated once here, read back by ``ShmAgent.capabilities``.
SHM_CAPABILITIES = AgentCapabilities(
    memory_kinds=frozenset({MemoryKind.DRAM}),
    write=True,
    read=True,
    notifications=True,
    remote=False,
    async_submit=True,  # transfers over 256 KiB are copied by the agent's copy threads, which announce the end
)


@hookimpl
def kvcore_register_transfer_agents(registry: TransferAgentRegistry) -> None:
    registry.add(
        "shm",
        "kvcore.transport.builtin.shm:ShmAgent",
        capabilities=SHM_CAPABILITIES,
        auto_priority=0,  # backend="auto" falls back to it: no native dependency, one host only
        description="same-host shared memory (POSIX shm segments); no native dependency",
    )


@hookimpl
def kvcore_register_layout_mappers(registry: LayoutMapperRegistry) -> None:
    registry.add(
        "matching_heads",
        "kvcore.layout.mapping:MatchingHeadsMapper",
        description="identical per-buffer sharding on both sides (same heads per rank)",
    )


@hookimpl
def kvcore_register_page_table_builders(registry: PageTableBuilderRegistry) -> None:
    registry.add(
        "head_major_pool",
        "kvcore.layout.builders:build_head_major_pool",
        description="one tensor holding all layers: [blocks, layers, kv, heads, tokens, dim]",
    )
    registry.add(
        "token_major_layers",
        "kvcore.layout.builders:build_token_major_layers",
        description="one tensor per layer: [kv, blocks, tokens, heads, dim] or [blocks, kv, tokens, heads, dim]",
    )
    registry.add(
        "mamba_state",
        "kvcore.layout.builders:build_mamba_state",
        description="Mamba2/GDN state per layer: conv [layers, slots, conv_dim, d_conv-1], SSM [layers, slots, heads, head_dim, d_state]; arrangement='vllm': one [slots, d_conv-1, conv_dim] and one SSM tensor per layer",
    )
