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
    from kvcore.extension.registry import (
        BenchBaselineRegistry,
        LayoutMapperRegistry,
        PageTableBuilderRegistry,
        TransferAgentRegistry,
    )

PROJECT = "kvcore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# --- registration hooks: called once per plugin manager, results cached in the registries ------


@hookspec
def kvcore_register_transfer_agents(registry: TransferAgentRegistry) -> None:
    """Register the transfer agents (transports) this plugin provides.

    Call ``registry.add(name, "package.module:Class", capabilities=CAPABILITIES)``
    once per agent. ``name`` is the backend name users put in configuration
    (``backend="nixl"``). The class must subclass ``kvcore.TransferAgent`` and
    read the same ``CAPABILITIES`` object back as its ``capabilities``
    attribute (state them once, in the hook module). ``auto_priority=N`` lets
    ``backend="auto"`` pick the agent (highest first); ``install_hint=`` says
    how to get a native library the agent's module fails to import without.

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


@hookspec
def kvcore_register_bench_baselines(registry: BenchBaselineRegistry) -> None:
    """Register ``kvcore bench`` baselines: a transport's own API timed beside its kvcore agent.

    Call ``registry.add(mode, "package.module:Class", backend="nixl")`` once per
    mode; the class subclasses ``kvcore.transport.baselines.BenchBaseline``. The bench runs
    the mode (on the identical fragment plan, bytes verified) whenever it
    measures ``backend``. ``in_matrix=True`` (one per backend) also runs it in the
    matrix and reports it there as the backend's bare speed.

    :param registry: collects baselines by mode name; a duplicate name raises
        ``DuplicateBackendError`` naming both plugins.
    """
