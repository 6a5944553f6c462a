"""kvcore plugin hooks of ``kvcore-ucx``: the ``ucx`` transfer agent and its bench baseline; imports nothing heavy."""

from __future__ import annotations

from kvcore.extension.hookspecs import hookimpl
from kvcore.extension.registry import BenchBaselineRegistry, TransferAgentRegistry
from kvcore.transport.agent import AgentCapabilities, MemoryKind

KVCORE_PLUGIN_API = 1

#: How to get the UCX plugin and its native library: the one wording of the hint.
INSTALL_HINT = "pip install ./plugins/ucx  (distribution kvcore-ucx; depends on libucx-cu12 and cffi)"

#: What ``UcxAgent`` can do: stated once here, read back by ``UcxAgent.capabilities``.
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
    """Register ``ucx``: one-sided UCX RMA (put/get) through cffi against the libucx-cu12 wheel."""
    registry.add(
        "ucx",
        "kvcore_ucx.agent:UcxAgent",
        capabilities=CAPABILITIES,
        description="UCX RMA (ucp_put_nbx/ucp_get_nbx, rkeys in the descriptor); CMA/shm on one host, TCP/IB across",
        install_hint=INSTALL_HINT,
    )


@hookimpl
def kvcore_register_bench_baselines(registry: BenchBaselineRegistry) -> None:
    """Register bare UCX (``ucp_put_nbx`` per fragment + one flush) as the ``kvcore bench`` baseline of ``ucx``."""
    registry.add(
        "ucx_put",
        "kvcore_ucx.bench.baselines:UcxPut",
        backend="ucx",
        in_matrix=True,
        description="bare UCP worker, ucp_put_nbx per fragment + ucp_ep_flush_nbx, progressed without back-off",
        install_hint=INSTALL_HINT,
    )
