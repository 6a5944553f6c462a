"""Hook specifications for kvcore plugins.

A plugin is a module exposed under ``[project.entry-points.kvcore]`` whose
functions are decorated with ``kvcore.hookimpl``. Each hook receives a typed
registry and adds lazy ``"module:attribute"`` targets to it; the target module
is imported only when that entry is used, so keep heavy imports (nixl, ucxx,
torch) out of the hook module. See docs/hooks.md and docs/writing-a-transport.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kvcore.registry import LayoutMapperRegistry, PageTableBuilderRegistry, TransferAgentRegistry

PROJECT = "kvcore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# --- registration hooks: called once per plugin manager, results cached in the registries ------


@hookspec
def kvcore_register_transfer_agents(registry: TransferAgentRegistry) -> None:
    """Register the transfer agents (transports) this plugin provides.

    Call ``registry.add(name, "package.module:Class", capabilities=AgentCapabilities(...))``
    once per agent. ``name`` is the backend name users put in configuration
    (``backend="nixl"``). The class must subclass ``kvcore.TransferAgent``.

    :param registry: collects agents by backend name; a duplicate name raises
        ``DuplicateBackendError`` naming both plugins.
    """


@hookspec
def kvcore_register_layout_mappers(registry: LayoutMapperRegistry) -> None:
    """Register layout mappers: policies that turn a matched pool pair into a fragment plan.

    Call ``registry.add(kind, "package.module:Class")`` once per mapper kind. A
    pool view names its mapper kind; both peers must name the same kind.

    :param registry: collects mappers by kind; a duplicate kind raises
        ``DuplicateBackendError`` naming both plugins.
    """


@hookspec
def kvcore_register_page_table_builders(registry: PageTableBuilderRegistry) -> None:
    """Register page-table builders: functions that describe an engine's KV cache as a ``PageTable``.

    Call ``registry.add(name, "package.module:callable_or_class")`` once per builder.

    :param registry: collects builders by name; a duplicate name raises
        ``DuplicateBackendError`` naming both plugins.
    """
