"""kvcore plugin hooks of ``kvcore-mooncake``: the ``mooncake`` transfer agent and its bench baseline.

Imports nothing heavy: ``mooncake.engine`` is imported only when ``backend="mooncake"`` is selected. What this
module does check on import is that the system libraries the engine links are loadable (``syslibs``), so that
``kvcore plugins`` shows this plugin failed with the missing library named, not an ImportError traceback later.
"""

from __future__ import annotations

from importlib.util import find_spec

from kvcore.errors import PluginLoadError
from kvcore.extension.hookspecs import hookimpl
from kvcore.extension.registry import BenchBaselineRegistry, TransferAgentRegistry
from kvcore.transport.agent import AgentCapabilities, MemoryKind
from kvcore_mooncake import syslibs

KVCORE_PLUGIN_API = 1

#: How to get the plugin, its wheel and the system libraries: the one wording of the hint.
INSTALL_HINT = (
    "pip install ./plugins/mooncake  (distribution kvcore-mooncake; depends on "
    "mooncake-transfer-engine-non-cuda==0.3.13.post1, which needs Debian's libibverbs1 libnl-3-200 "
    "libnl-route-3-200: make install installs all of it)"
)

#: What ``MooncakeAgent`` can do: stated once here, read back by ``MooncakeAgent.capabilities``. The transfers
#: run on the agent's submit threads (Mooncake's synchronous batch call), so ``submit`` returns at once.
CAPABILITIES = AgentCapabilities(
    memory_kinds=frozenset({MemoryKind.DRAM}),
    write=True,
    read=True,
    notifications=True,
    remote=True,
    can_abort=False,
    async_submit=True,
)

if find_spec("mooncake") is None:
    raise PluginLoadError(f"the mooncake package (its transfer-engine wheel) is not installed; {INSTALL_HINT}")
_absent = syslibs.missing()
if _absent:
    raise PluginLoadError(syslibs.describe_missing(_absent))


@hookimpl
def kvcore_register_transfer_agents(registry: TransferAgentRegistry) -> None:
    """Register ``mooncake``: Mooncake's transfer engine (P2P handshake, TCP or RDMA) as a kvcore agent."""
    registry.add(
        "mooncake",
        "kvcore_mooncake.agent:MooncakeAgent",
        capabilities=CAPABILITIES,
        description="Mooncake transfer engine (batch_transfer_sync on submit threads; P2PHANDSHAKE; tcp or rdma)",
        install_hint=INSTALL_HINT,
    )


@hookimpl
def kvcore_register_bench_baselines(registry: BenchBaselineRegistry) -> None:
    """Register bare Mooncake (one ``batch_transfer_sync_write`` of the plan) as the baseline of ``mooncake``."""
    registry.add(
        "mooncake_batch",
        "kvcore_mooncake.bench.baselines:MooncakeBatchWrite",
        backend="mooncake",
        in_matrix=True,
        description="a second bare TransferEngine, batch_transfer_sync_write of the plan as given, in this thread",
        install_hint=INSTALL_HINT,
    )
