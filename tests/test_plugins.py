"""The plugin loader: in-process registration on a fresh manager, and the real entry-point path via a tmp distribution."""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pluggy
import pytest

import kvcore.extension.plugins
from kvcore import hookimpl
from kvcore.errors import (
    DuplicateBackendError,
    PluginAPIVersionError,
    PluginError,
    PluginLoadError,
    UnknownBackendError,
)
from kvcore.extension.plugins import KVCORE_PLUGIN_API, PluginManager, make_plugin_manager


class AgentsPlugin:
    """An in-process plugin registering transfer agents under the given names."""

    KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

    def __init__(self, *names: str, target: str = "kvcore.transport.builtin.shm:ShmAgent") -> None:
        self.names, self.target = names, target

    @hookimpl
    def kvcore_register_transfer_agents(self, registry):  # type: ignore[no-untyped-def]
        for n in self.names:
            registry.add(n, self.target, description=f"fake {n}")


@pytest.fixture
def pm() -> PluginManager:
    """A fresh manager with the built-ins and no installed entry points."""
    return make_plugin_manager(load_entry_points=False, env={})


# --- in-process -----------------------------------------------------------------------------------


def test_builtins_register_shm(pm: PluginManager) -> None:
    rec = pm.record("builtin")
    assert rec is not None and rec.status == "loaded" and rec.builtin
    assert "shm" in pm.transfer_agents
    assert rec.provides["transfer_agents"] == ["shm"]
    assert rec.hooks == sorted(
        ["kvcore_register_transfer_agents", "kvcore_register_layout_mappers", "kvcore_register_page_table_builders"]
    )


def test_in_process_plugin_registers_and_loads_lazily(pm: PluginManager) -> None:
    pm.register(AgentsPlugin("fake", target="kvcore.transport.builtin.shm:ShmAgent"), name="fakeplug")
    entry = pm.transfer_agents.entry("fake")
    assert entry.plugin == "fakeplug" and entry._loaded is None  # nothing imported yet
    from kvcore.transport.builtin.shm import ShmAgent

    assert pm.transfer_agents.get("fake") is ShmAgent
    assert pm.record("fakeplug").provides == {"transfer_agents": ["fake"]}  # type: ignore[union-attr]


def test_api_mismatch_is_recorded_not_raised(pm: PluginManager) -> None:
    plugin = AgentsPlugin("old")
    plugin.KVCORE_PLUGIN_API = 0
    rec = pm.register(plugin, name="oldplug")
    assert rec.status == "api_mismatch" and rec.phase == "api"
    assert (
        "declares KVCORE_PLUGIN_API = 0" in rec.error
        and f"provides KVCORE_PLUGIN_API = {KVCORE_PLUGIN_API}" in rec.error
    )
    assert "old" not in pm.transfer_agents


def test_missing_api_declaration(pm: PluginManager) -> None:
    class NoApi:
        @hookimpl
        def kvcore_register_transfer_agents(self, registry):  # type: ignore[no-untyped-def]
            registry.add("x", "a.b:C")

    rec = pm.register(NoApi(), name="noapi")
    assert rec.status == "api_mismatch" and "does not declare KVCORE_PLUGIN_API" in rec.error


def test_api_mismatch_strict_raises() -> None:
    pm = make_plugin_manager(load_entry_points=False, env={}, strict=True)
    plugin = AgentsPlugin("old")
    plugin.KVCORE_PLUGIN_API = 99
    with pytest.raises(PluginAPIVersionError, match=r"'oldplug'.*99"):
        pm.register(plugin, name="oldplug")


def test_misspelled_hook_fails_check_pending(pm: PluginManager) -> None:
    class Typo:
        KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

        @hookimpl
        def kvcore_register_transfer_agent(self, registry):  # type: ignore[no-untyped-def]  # missing "s"
            pass

    rec = pm.register(Typo(), name="typo")
    assert rec.status == "failed" and rec.phase == "validate"
    assert "kvcore_register_transfer_agent" in rec.error
    assert isinstance(rec.exception, pluggy.PluginValidationError)
    assert pm.pm.get_plugin("typo") is None  # unregistered again, so later plugins still validate
    assert pm.register(AgentsPlugin("after"), name="after").status == "loaded"


def test_duplicate_name_names_both_and_is_unselectable(pm: PluginManager) -> None:
    pm.register(AgentsPlugin("dup", "only-a"), name="plugin-a")
    pm.register(AgentsPlugin("dup"), name="plugin-b")
    registry = pm.transfer_agents
    assert "dup" not in registry and "only-a" in registry
    with pytest.raises(DuplicateBackendError) as exc:
        registry.get("dup")
    assert "'plugin-a'" in str(exc.value) and "'plugin-b'" in str(exc.value)
    assert "KVCORE_DISABLE_PLUGINS=plugin-b" in str(exc.value)
    failed = pm.record("plugin-b")
    assert failed is not None and failed.status == "failed" and failed.phase == "register"


def test_duplicate_name_strict_raises() -> None:
    pm = make_plugin_manager(load_entry_points=False, env={}, strict=True)
    pm.register(AgentsPlugin("dup"), name="plugin-a")
    pm.register(AgentsPlugin("dup"), name="plugin-b")
    with pytest.raises(DuplicateBackendError, match=r"'plugin-a'.*'plugin-b'"):
        pm.registries  # noqa: B018 - the hooks run here


def test_register_hook_exception_is_attributed(pm: PluginManager, caplog: pytest.LogCaptureFixture) -> None:
    class Boom:
        KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

        @hookimpl
        def kvcore_register_transfer_agents(self, registry):  # type: ignore[no-untyped-def]
            registry.add("half", "a.b:C")
            raise RuntimeError("kaboom")

    pm.register(Boom(), name="boom")
    with caplog.at_level(logging.WARNING, logger="kvcore.extension.plugins"):
        assert "half" not in pm.transfer_agents  # its partial registrations are rolled back
    assert "shm" in pm.transfer_agents
    rec = pm.record("boom")
    assert rec is not None and rec.status == "failed" and rec.error == "RuntimeError: kaboom"
    assert any("'boom'" in r.getMessage() and "kaboom" in r.getMessage() for r in caplog.records)


def test_unknown_backend_message_shape(pm: PluginManager) -> None:
    with pytest.raises(UnknownBackendError) as exc:
        pm.transfer_agents.get("nope")
    assert str(exc.value) == (
        "transfer agent 'nope' is not available.\n"
        "  registered: shm\n"
        "  hint: run 'kvcore plugins' to see installed plugins and their errors"
    )


def test_unknown_backend_lists_failures_and_points_at_kvcore_plugins(pm: PluginManager) -> None:
    """The core names no plugin: the hint for a name nobody registers is generic (plugins state their own hints)."""
    bad = AgentsPlugin("nixl")
    bad.KVCORE_PLUGIN_API = 7
    pm.register(bad, name="nixl", dist="kvcore-nixl", version="0.0.1")
    with pytest.raises(UnknownBackendError) as exc:
        pm.transfer_agents.get("nixl")
    lines = str(exc.value).splitlines()
    assert lines[0] == "transfer agent 'nixl' is not available."
    assert lines[1] == "  registered: shm"
    assert lines[2].startswith("  plugin 'nixl' (kvcore-nixl 0.0.1) api_mismatch: PluginAPIVersionError: ")
    assert lines[3] == "  hint: run 'kvcore plugins' to see installed plugins and their errors"
    assert isinstance(exc.value.__cause__, PluginAPIVersionError)  # the original error is chained


def test_unimportable_target_names_plugin_and_target(pm: PluginManager) -> None:
    pm.register(AgentsPlugin("ghost", target="kvcore_no_such_module_xyz:Agent"), name="ghostplug")
    with pytest.raises(UnknownBackendError) as exc:
        pm.transfer_agents.get("ghost")
    assert str(exc.value).startswith(
        "'ghost' from plugin 'ghostplug' could not be imported from 'kvcore_no_such_module_xyz:Agent': "
        "ModuleNotFoundError"
    )
    assert isinstance(exc.value.__cause__, ModuleNotFoundError)


def test_invalid_registrations_rejected(pm: PluginManager) -> None:
    class Bad:
        KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

        @hookimpl
        def kvcore_register_transfer_agents(self, registry):  # type: ignore[no-untyped-def]
            registry.add("nocolon", "just.a.module")

    pm.register(Bad(), name="bad")
    assert "nocolon" not in pm.transfer_agents
    assert "expected 'package.module:attribute'" in pm.record("bad").error  # type: ignore[union-attr, operator]


# --- the real entry-point path ---------------------------------------------------------------------


def write_dist(root: Path, ep_name: str, source: str, *, dist: str = "fake-plugin", version: str = "1.0") -> str:
    """Write ``<dist>-<version>.dist-info`` plus a module under ``root``; returns the (unique) module name."""
    module = f"fake_kvcore_plugin_{uuid.uuid4().hex[:8]}"
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kvcore]\n{ep_name} = {module}\n")
    return module


GOOD = """
    from kvcore import hookimpl
    KVCORE_PLUGIN_API = 1

    @hookimpl
    def kvcore_register_transfer_agents(registry):
        registry.add("fakeagent", "kvcore.transport.builtin.shm:ShmAgent", description="fake")
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for throw-away distributions; the entry-point cache is reset around each test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    kvcore.extension.plugins.reset_plugin_manager()
    yield tmp_path
    kvcore.extension.plugins.reset_plugin_manager()
    for name in [m for m in sys.modules if m.startswith("fake_kvcore_plugin_")]:
        del sys.modules[name]


def _only(*names: str) -> dict[str, str]:
    return {"KVCORE_PLUGINS": ",".join(names)}


def test_entry_point_loads_and_registers(site: Path) -> None:
    write_dist(site, "fake", GOOD)
    pm = make_plugin_manager(env=_only("fake"))
    rec = pm.record("fake")
    assert rec is not None and rec.status == "loaded"
    assert (rec.dist, rec.version, rec.dist_label) == ("fake-plugin", "1.0", "fake-plugin 1.0")
    assert "fakeagent" in pm.transfer_agents
    assert rec.provides == {"transfer_agents": ["fakeagent"]}


def test_entry_point_broken_import(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_dist(site, "broken", "import kvcore_definitely_missing_dependency\n")
    with caplog.at_level(logging.WARNING, logger="kvcore.extension.plugins"):
        pm = make_plugin_manager(env=_only("broken"))
    rec = pm.record("broken")
    assert rec is not None and rec.status == "failed" and rec.phase == "import"
    assert rec.error == "ModuleNotFoundError: No module named 'kvcore_definitely_missing_dependency'"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "kvcore: plugin 'broken' (fake-plugin 1.0) failed to load: ModuleNotFoundError: No module named "
        "'kvcore_definitely_missing_dependency' — run 'kvcore plugins' for details"
    ]
    assert "shm" in pm.transfer_agents  # the built-ins are unaffected


def test_entry_point_broken_import_strict(site: Path) -> None:
    write_dist(site, "broken", "raise RuntimeError('plugin exploded')\n")
    with pytest.raises(PluginLoadError, match=r"'broken' \(fake-plugin 1.0\) failed during import.*exploded") as exc:
        make_plugin_manager(env={**_only("broken"), "KVCORE_STRICT_PLUGINS": "1"})
    assert isinstance(exc.value.__cause__, RuntimeError)


def test_entry_point_api_mismatch(site: Path) -> None:
    write_dist(site, "future", GOOD.replace("KVCORE_PLUGIN_API = 1", "KVCORE_PLUGIN_API = 2"))
    pm = make_plugin_manager(env=_only("future"))
    rec = pm.record("future")
    assert rec is not None and rec.status == "api_mismatch"
    assert "fakeagent" not in pm.transfer_agents


def test_entry_point_misspelled_hook(site: Path) -> None:
    write_dist(site, "typo", GOOD.replace("kvcore_register_transfer_agents", "kvcore_register_transfer_agnets"))
    pm = make_plugin_manager(env=_only("typo"))
    rec = pm.record("typo")
    assert rec is not None and rec.status == "failed" and rec.phase == "validate"
    assert "kvcore_register_transfer_agnets" in rec.error


def test_entry_point_duplicate_backend_between_distributions(site: Path) -> None:
    write_dist(site, "first", GOOD, dist="first-plugin")
    write_dist(site, "second", GOOD, dist="second-plugin")
    pm = make_plugin_manager(env=_only("first", "second"))
    with pytest.raises(DuplicateBackendError) as exc:
        pm.transfer_agents.get("fakeagent")
    assert "'first'" in str(exc.value) and "'second'" in str(exc.value)


def test_entry_point_same_plugin_name_in_two_distributions(site: Path) -> None:
    write_dist(site, "twin", GOOD, dist="twin-a")
    write_dist(site, "twin", GOOD, dist="twin-b")
    pm = make_plugin_manager(env=_only("twin"))
    twins = [r for r in pm.records if r.name == "twin"]
    assert [r.status for r in twins] == ["loaded", "failed"]
    assert "is provided by both" in twins[1].error and "twin-a 1.0" in twins[1].error


@pytest.mark.parametrize(
    ("env", "status"),
    [
        ({}, "loaded"),
        ({"KVCORE_PLUGINS": "fake"}, "loaded"),
        ({"KVCORE_PLUGINS": "other,fake"}, "loaded"),
        ({"KVCORE_PLUGINS": ""}, "blocked"),  # set but empty: no external plugin at all
        ({"KVCORE_PLUGINS": "other"}, "blocked"),
        ({"KVCORE_DISABLE_PLUGINS": "fake"}, "blocked"),
        ({"KVCORE_PLUGINS": "fake", "KVCORE_DISABLE_PLUGINS": "x, fake"}, "blocked"),
    ],
)
def test_allow_and_block_lists(site: Path, env: dict[str, str], status: str) -> None:
    module = write_dist(site, "fake", GOOD)
    pm = make_plugin_manager(env=env)
    rec = pm.record("fake")
    assert rec is not None and rec.status == status
    assert ("fakeagent" in pm.transfer_agents) is (status == "loaded")
    # Blocked plugins are never imported, so a broken one costs nothing.
    assert (module in sys.modules) is (status == "loaded")
    if status == "blocked":
        why = "KVCORE_DISABLE_PLUGINS" if "KVCORE_DISABLE_PLUGINS" in env else "KVCORE_PLUGINS"
        assert rec.error == f"not loaded: excluded by {why}"
        assert "shm" in pm.transfer_agents  # built-ins stay


def test_blocked_plugin_is_not_listed_as_failure(site: Path) -> None:
    write_dist(site, "broken", "raise ImportError('never imported')\n")
    pm = make_plugin_manager(env={"KVCORE_DISABLE_PLUGINS": "broken"})
    with pytest.raises(UnknownBackendError) as exc:
        pm.transfer_agents.get("nope")
    assert "broken" not in str(exc.value)


def test_entry_points_read_once_per_process(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_dist(site, "fake", GOOD)
    calls = []
    real = kvcore.extension.plugins.metadata.entry_points

    def counting(**kw):  # type: ignore[no-untyped-def]
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(kvcore.extension.plugins.metadata, "entry_points", counting)
    make_plugin_manager(env=_only("fake"))
    make_plugin_manager(env=_only("fake"))
    assert calls == [{"group": "kvcore"}]
    kvcore.extension.plugins.reset_plugin_manager()
    make_plugin_manager(env=_only("fake"))
    assert len(calls) == 2


def test_get_plugin_manager_is_cached_and_reset(site: Path) -> None:
    first = kvcore.extension.plugins.get_plugin_manager()
    assert kvcore.extension.plugins.get_plugin_manager() is first
    kvcore.extension.plugins.reset_plugin_manager()
    assert kvcore.extension.plugins.get_plugin_manager() is not first


def test_import_kvcore_loads_no_plugin() -> None:
    import subprocess

    code = "import sys, kvcore; print(any(m.startswith(('kvcore_nixl', 'kvcore_ucx', 'kvcore.transport.builtin')) for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_external_plugin_cannot_shadow_builtin(pm: PluginManager) -> None:
    """An installed plugin re-registering ``shm`` is the one blamed (and the one the hint says to block)."""
    pm.register(AgentsPlugin("shm"), name="shadow")
    with pytest.raises(DuplicateBackendError) as exc:
        pm.transfer_agents.get("shm")
    assert str(exc.value) == (
        "transfer agent 'shm' is registered by both plugin 'builtin' and plugin 'shadow'; "
        "uninstall one or block it with KVCORE_DISABLE_PLUGINS=shadow"
    )


# --- hooks are called through pluggy's own call path ----------------------------------------------


def test_trace_records_each_registration_call(caplog: pytest.LogCaptureFixture) -> None:
    """KVCORE_TRACE_PLUGINS=1 sees the registration hooks: they run through pluggy, not around it."""
    with caplog.at_level(logging.DEBUG, logger="kvcore.extension.plugins"):
        pm = make_plugin_manager(load_entry_points=False, env={"KVCORE_TRACE_PLUGINS": "1"})
        pm.register(AgentsPlugin("traced"), name="tracer")
        assert "traced" in pm.transfer_agents
    calls = [r.getMessage().strip() for r in caplog.records if r.name == "kvcore.extension.plugins"]
    traced = [m for m in calls if m.startswith("kvcore_register_transfer_agents [hook]")]
    assert len(traced) == 2, calls  # pluggy's tracer saw one call per plugin: the built-ins, then 'tracer'


def test_tryfirst_impl_runs_first_and_takes_the_name() -> None:
    """A ``tryfirst`` impl registered last still runs first: the plain plugin that repeats its name is blamed."""
    calls: list[str] = []

    class Plain:
        KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

        @hookimpl
        def kvcore_register_transfer_agents(self, registry):  # type: ignore[no-untyped-def]
            calls.append("plain")
            registry.add("contested", "kvcore.transport.builtin.shm:ShmAgent")

    class Eager:
        KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

        @hookimpl(tryfirst=True)
        def kvcore_register_transfer_agents(self, registry):  # type: ignore[no-untyped-def]
            calls.append("eager")
            registry.add("contested", "kvcore.transport.builtin.shm:ShmAgent")

    pm = make_plugin_manager(load_entry_points=False, builtins=False, env={})
    pm.register(Plain(), name="plain")
    pm.register(Eager(), name="eager")
    pm.registries  # noqa: B018 - the hooks run here
    assert calls == ["eager", "plain"]
    plain, eager = pm.record("plain"), pm.record("eager")
    assert eager is not None and eager.status == "loaded" and eager.provides == {"transfer_agents": ["contested"]}
    assert plain is not None and plain.status == "failed" and plain.phase == "register"
    assert "KVCORE_DISABLE_PLUGINS=plain" in str(plain.error)


def test_wrapper_impl_wraps_every_plugins_call(pm: PluginManager) -> None:
    """A ``wrapper=True`` impl sees each plugin's registration call (pluggy ignored it when impls were called raw)."""
    seen: list[list[str]] = []

    class Wrapper:
        KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

        @hookimpl(wrapper=True)
        def kvcore_register_transfer_agents(self, registry):  # type: ignore[no-untyped-def]
            before = set(registry.names())
            result = yield
            seen.append(sorted(set(registry.names()) - before))
            return result

    pm.register(AgentsPlugin("wrapped"), name="wrapped")
    pm.register(Wrapper(), name="wrapper")
    pm.registries  # noqa: B018 - the hooks run here
    assert seen == [["shm"], ["wrapped"]]


def test_plugin_status_is_an_enum_that_reads_as_its_word(pm: PluginManager) -> None:
    from kvcore.extension.plugins import PluginStatus

    rec = pm.record("builtin")
    assert rec is not None and rec.status is PluginStatus.LOADED
    assert rec.status == "loaded" and rec.as_dict()["status"] == "loaded" and f"{rec.status}" == "loaded"


def test_bench_baselines_come_from_plugins(pm: PluginManager) -> None:
    """``kvcore bench`` learns a transport's native baselines from its plugin; the core registers none."""

    class Native:
        KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

        @hookimpl
        def kvcore_register_bench_baselines(self, registry):  # type: ignore[no-untyped-def]
            registry.add("fast_native", "kvcore_no_such_module:Fast", backend="fake", in_matrix=True)
            registry.add("slow_native", "kvcore_no_such_module:Slow", backend="fake")

    assert pm.bench_baselines.names() == []
    pm.register(Native(), name="native")
    reg = pm.bench_baselines
    assert reg.for_backend("fake") == ["fast_native", "slow_native"] and reg.for_backend("shm") == []
    assert reg.matrix_mode("fake") == "fast_native" and reg.matrix_mode("shm") is None
    rec = pm.record("native")
    assert rec is not None and rec.provides == {"bench_baselines": ["fast_native", "slow_native"]}


def test_auto_selection_and_network_agents_follow_what_plugins_declare(pm: PluginManager) -> None:
    from kvcore import AgentCapabilities
    from kvcore.config import resolve_backend

    class Declares:
        KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

        @hookimpl
        def kvcore_register_transfer_agents(self, registry):  # type: ignore[no-untyped-def]
            from kvcore.transport.builtin.plugin import SHM_CAPABILITIES

            net = AgentCapabilities(remote=True)
            registry.add("net_b", "kvcore_no_such_module:Agent", capabilities=net)
            registry.add("net_a", "kvcore_no_such_module:Agent", capabilities=net, auto_priority=5)
            registry.add(
                "local", "kvcore.transport.builtin.shm:ShmAgent", capabilities=SHM_CAPABILITIES, auto_priority=7
            )
            registry.add("broken", "kvcore_no_such_module:Agent", capabilities=net, auto_priority=50)
            registry.add(
                "liar", "kvcore.transport.builtin.shm:ShmAgent", capabilities=net
            )  # ShmAgent says remote=False

    pm.register(Declares(), name="declares")
    reg = pm.transfer_agents
    assert reg.auto_candidates() == ["broken", "local", "net_a", "shm"]
    assert reg.remote_names() == ["broken", "net_a", "liar", "net_b"]
    assert reg.preferred_order(["shm", "net_b", "net_a", "local"]) == ["net_a", "net_b", "local", "shm"]
    assert resolve_backend("auto", pm)[0] == "local"  # 'broken' does not import: the next one is chosen
    with pytest.raises(PluginError, match=r"'liar' from plugin 'declares': ShmAgent.capabilities is .*remote=False"):
        reg.get("liar")
