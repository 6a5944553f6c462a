"""The kvcore hook module of kvcore-cma: registers the ``cma`` transfer agent. Imports nothing heavy.

The agent itself (``kvcore_cma.agent``) is imported only when a user selects
``backend="cma"``.
"""

from __future__ import annotations

from kvcore import AgentCapabilities, MemoryKind, hookimpl
from kvcore.extension.registry import TransferAgentRegistry

#: The kvcore plugin API this module was written for; kvcore refuses to load a mismatch.
KVCORE_PLUGIN_API = 1

#: What ``CmaAgent`` can do: stated once here (the registry shows it without importing the agent), and read
#: back by ``CmaAgent.capabilities``.
CAPABILITIES = AgentCapabilities(
    memory_kinds=frozenset({MemoryKind.DRAM}), write=True, read=True, notifications=True, remote=False
)


@hookimpl
def kvcore_register_transfer_agents(registry: TransferAgentRegistry) -> None:
    registry.add(
        "cma",
        "kvcore_cma.agent:CmaAgent",
        capabilities=CAPABILITIES,
        description="same-host cross-memory attach (process_vm_writev/readv); Linux only",
    )
