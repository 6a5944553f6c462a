"""kvcore plugin hooks of ``kvcore-mpi``: the ``mpi`` transfer agent; imports nothing heavy."""

from __future__ import annotations

from kvcore.extension.hookspecs import hookimpl
from kvcore.extension.registry import TransferAgentRegistry
from kvcore.transport.agent import AgentCapabilities, MemoryKind

KVCORE_PLUGIN_API = 1

#: How to get the MPI plugin and its MPI: the one wording of the hint.
INSTALL_HINT = "pip install ./plugins/mpi  (distribution kvcore-mpi; depends on mpi4py and the mpich wheel)"

#: What ``MpiAgent`` can do: stated once here, read back by ``MpiAgent.capabilities``. VRAM needs a CUDA-aware
#: MPI; the agent checks that when VRAM is registered and refuses it otherwise (the mpich wheel is not).
CAPABILITIES = AgentCapabilities(
    memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.VRAM}),
    write=True,
    read=True,
    notifications=True,
    remote=True,
    can_abort=False,
    async_submit=True,
)


@hookimpl
def kvcore_register_transfer_agents(registry: TransferAgentRegistry) -> None:
    """Register ``mpi``: MPI-3 RMA (Put/Get + Flush on a dynamic window per peer) through mpi4py."""
    registry.add(
        "mpi",
        "kvcore_mpi.agent:MpiAgent",
        capabilities=CAPABILITIES,
        description="MPI RMA (MPI_Put/MPI_Get on dynamic windows, hindexed datatypes); peers meet by MPI_Comm_connect",
        install_hint=INSTALL_HINT,
    )
