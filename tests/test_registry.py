"""Typed registries: registration, lazy loading, duplicates, lookup errors; and ``resolve_backend`` with ``auto``."""

from __future__ import annotations

import logging
import sys

import pytest

from kvcore import hookimpl
from kvcore.config import TransceiverConfig, create_agent, resolve_backend
from kvcore.errors import DuplicateBackendError, PluginError, UnknownBackendError
from kvcore.extension.plugins import KVCORE_PLUGIN_API, PluginManager, make_plugin_manager
from kvcore.extension.registry import LayoutMapperRegistry, PageTableBuilderRegistry, Registries, TransferAgentRegistry
from kvcore.transport.agent import AgentCapabilities, MemoryKind


def test_add_get_and_lazy_import() -> None:
    reg = LayoutMapperRegistry()
    reg.add("json", "json:dumps", description="not really a mapper")
    entry = reg.entry("json")
    assert (entry.name, entry.target, entry.plugin, entry.description) == (
        "json",
        "json:dumps",
        "<direct>",
        "not really a mapper",
    )
    assert entry._loaded is None
    import json

    assert reg.get("json") is json.dumps
    assert reg.get("json") is json.dumps  # cached
    assert "json" in reg and list(reg) == ["json"] and len(reg) == 1


def test_dotted_attribute_target() -> None:
    reg = PageTableBuilderRegistry()
    reg.add("join", "os:path.join")
    import os

    assert reg.get("join") is os.path.join


def test_target_is_not_imported_until_used() -> None:
    reg = TransferAgentRegistry()
    reg.add("lazy", "kvcore_lazy_never_imported_mod:Agent")
    assert "kvcore_lazy_never_imported_mod" not in sys.modules
    with pytest.raises(UnknownBackendError, match="could not be imported from 'kvcore_lazy_never_imported_mod:Agent'"):
        reg.get("lazy")


def test_missing_attribute_is_reported() -> None:
    reg = TransferAgentRegistry()
    reg.add("x", "kvcore.transport.agent:NoSuchAgent", install_hint="pip install kvcore-x")
    with pytest.raises(UnknownBackendError) as exc:
        reg.get("x")
    assert "AttributeError" in str(exc.value)
    assert str(exc.value).endswith("\n  hint: pip install kvcore-x")


@pytest.mark.parametrize("name", ["", " padded", "padded ", 7])
def test_invalid_names(name: object) -> None:
    with pytest.raises(PluginError, match="invalid transfer agent name"):
        TransferAgentRegistry().add(name, "a:b")  # type: ignore[arg-type]


def test_target_without_colon() -> None:
    with pytest.raises(PluginError, match=r"expected 'package\.module:attribute'"):
        LayoutMapperRegistry().add("m", "package.module.Class")


def test_duplicate_raises_naming_both() -> None:
    reg = TransferAgentRegistry()
    reg._current_plugin = "first"
    reg.add("same", "a:b")
    reg._current_plugin = "second"
    with pytest.raises(DuplicateBackendError) as exc:
        reg.add("same", "c:d")
    assert "'first'" in str(exc.value) and "'second'" in str(exc.value)
    with pytest.raises(DuplicateBackendError):
        reg.entry("same")  # the conflict is remembered


def test_capabilities_are_typed() -> None:
    reg = TransferAgentRegistry()
    caps = AgentCapabilities(memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.VRAM}), read=True)
    reg.add("t", "a:b", capabilities=caps)
    assert reg.entry("t").capabilities is caps
    assert caps.describe() == "DRAM+VRAM WRITE/READ notif same-host"
    with pytest.raises(PluginError, match="must be AgentCapabilities, got dict"):
        reg.add("u", "a:b", capabilities={"read": True})  # type: ignore[arg-type]


def test_unknown_lists_registered_names_sorted() -> None:
    reg = LayoutMapperRegistry()
    reg.add("zeta", "a:b")
    reg.add("alpha", "a:b")
    with pytest.raises(UnknownBackendError) as exc:
        reg.get("beta")
    assert str(exc.value).splitlines()[:2] == ["layout mapper 'beta' is not available.", "  registered: alpha, zeta"]


def test_core_knows_no_plugin_names_for_hints() -> None:
    """A name no installed plugin registers gets the generic hint: install hints belong to the plugins."""
    with pytest.raises(UnknownBackendError) as exc:
        LayoutMapperRegistry().get("mamba_ssm")
    assert str(exc.value) == (
        "layout mapper 'mamba_ssm' is not available.\n"
        "  registered: none\n"
        "  hint: run 'kvcore plugins' to see installed plugins and their errors"
    )


def test_registries_bundle() -> None:
    regs = Registries()
    assert [r.kind for r in regs.all()] == ["transfer agent", "layout mapper", "page-table builder", "bench baseline"]


# --- selection ---------------------------------------------------------------------------------


class Provides:
    KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

    def __init__(self, name: str, target: str, auto_priority: int | None = None) -> None:
        self.name, self.target, self.auto_priority = name, target, auto_priority

    @hookimpl
    def kvcore_register_transfer_agents(self, registry):  # type: ignore[no-untyped-def]
        registry.add(self.name, self.target, auto_priority=self.auto_priority)


@pytest.fixture
def pm() -> PluginManager:
    return make_plugin_manager(load_entry_points=False, env={})


def test_resolve_by_name(pm: PluginManager) -> None:
    from kvcore.transport.builtin.shm import ShmAgent

    assert resolve_backend("shm", pm) == ("shm", ShmAgent)
    assert resolve_backend(TransceiverConfig(backend="shm"), pm) == ("shm", ShmAgent)


def test_auto_prefers_the_highest_priority_that_loads(pm: PluginManager) -> None:
    from kvcore.transport.builtin.shm import ShmAgent

    pm.register(Provides("fast", "kvcore.transport.builtin.shm:ShmAgent", auto_priority=100), name="fastplug")
    pm.register(
        Provides("never", "kvcore.transport.builtin.shm:ShmAgent"), name="neverplug"
    )  # no priority: not for auto
    assert pm.transfer_agents.auto_candidates() == ["fast", "shm"]
    assert resolve_backend("auto", pm) == ("fast", ShmAgent)


def test_auto_falls_back_to_shm(pm: PluginManager, caplog: pytest.LogCaptureFixture) -> None:
    pm.register(Provides("fast", "kvcore_fast_missing_native_lib:Agent", auto_priority=100), name="fastplug")
    with caplog.at_level(logging.INFO, logger="kvcore.config"):
        name, _ = resolve_backend("auto", pm)
    assert name == "shm"
    assert any("selected 'shm'" in r.getMessage() and "skipped fast" in r.getMessage() for r in caplog.records)


def test_auto_with_nothing_usable() -> None:
    pm = make_plugin_manager(load_entry_points=False, builtins=False, env={})
    with pytest.raises(UnknownBackendError) as exc:
        resolve_backend("auto", pm)
    assert str(exc.value) == (
        "backend 'auto' found no usable transfer agent: no installed plugin offers one for automatic selection "
        "(registered: none); name one with backend=..."
    )


def test_auto_with_no_candidate_that_loads(pm: PluginManager) -> None:
    pm = make_plugin_manager(load_entry_points=False, builtins=False, env={})
    pm.register(Provides("fast", "kvcore_fast_missing_native_lib:Agent", auto_priority=1), name="fastplug")
    with pytest.raises(UnknownBackendError) as exc:
        resolve_backend("auto", pm)
    lines = str(exc.value).splitlines()
    assert lines[0] == "backend 'auto' found no usable transfer agent:"
    assert lines[1].startswith("  fast: 'fast' from plugin 'fastplug' could not be imported")


def test_resolve_refuses_non_agent(pm: PluginManager) -> None:
    pm.register(Provides("notanagent", "json:dumps"), name="weird")
    with pytest.raises(UnknownBackendError, match=r"'notanagent' resolves to .* not a TransferAgent subclass"):
        resolve_backend("notanagent", pm)


def test_create_agent_passes_options(pm: PluginManager) -> None:
    agent = create_agent(TransceiverConfig(backend="shm", agent_options={"copy_threads": 3}), "a0", pm)
    try:
        assert agent.name == "a0" and agent.options == {"copy_threads": 3}
    finally:
        agent.close()
