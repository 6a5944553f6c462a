"""Plugin discovery and loading: entry points of group ``kvcore`` -> ``PluginRecord`` list + filled registries.

Loading is lazy (never at ``import kvcore``), happens once per process (keyed by
pid, so forked workers reload), de-duplicates entry points, applies the
``KVCORE_PLUGINS`` allow-list and ``KVCORE_DISABLE_PLUGINS`` block-list before
anything is imported, checks each plugin's ``KVCORE_PLUGIN_API``, isolates
every plugin in its own try/except and ends with ``check_pending()`` so a
misspelled hook is reported against the plugin that has it.

Environment switches (entry-point names, comma-separated):

``KVCORE_PLUGINS``          allow-list; set but empty means no external plugin
``KVCORE_DISABLE_PLUGINS``  block-list
``KVCORE_STRICT_PLUGINS=1`` every plugin failure raises instead of warning
``KVCORE_TRACE_PLUGINS=1``  log every hook call to the ``kvcore.extension.plugins`` logger
"""

from __future__ import annotations

import importlib
import logging
import os
import traceback
from collections.abc import Mapping
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from kvcore.errors import DuplicateBackendError, PluginAPIVersionError, PluginLoadError
from kvcore.extension import hookspecs
from kvcore.extension.convert import parse_bool
from kvcore.extension.registry import (
    BenchBaselineRegistry,
    LayoutMapperRegistry,
    PageTableBuilderRegistry,
    PluginRecord,
    PluginStatus,
    Registries,
    Registry,
    TransferAgentRegistry,
)

__all__ = [
    "KVCORE_PLUGIN_API",
    "ENTRY_POINT_GROUP",
    "PluginRecord",
    "PluginStatus",
    "PluginManager",
    "make_plugin_manager",
    "get_plugin_manager",
    "reset_plugin_manager",
]

log = logging.getLogger("kvcore.extension.plugins")

#: The plugin API this core implements. A plugin module declares the value it was written for.
KVCORE_PLUGIN_API = 1
ENTRY_POINT_GROUP = "kvcore"
BUILTIN_PLUGINS = ("kvcore.transport.builtin.plugin",)

LOADED, FAILED, BLOCKED, API_MISMATCH = (
    PluginStatus.LOADED,
    PluginStatus.FAILED,
    PluginStatus.BLOCKED,
    PluginStatus.API_MISMATCH,
)


def _split(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {v.strip() for v in value.split(",") if v.strip()}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__


_EP_CACHE: tuple[int, list[metadata.EntryPoint]] | None = None


def _entry_points() -> list[metadata.EntryPoint]:
    """``entry_points(group="kvcore")`` once per process, de-duplicated by (name, value)."""
    global _EP_CACHE
    if _EP_CACHE is None or _EP_CACHE[0] != os.getpid():
        seen: set[tuple[str, str]] = set()
        eps = []
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            key = (ep.name, ep.value)
            if key not in seen:
                seen.add(key)
                eps.append(ep)
        _EP_CACHE = (os.getpid(), sorted(eps, key=lambda e: e.name))
    return list(_EP_CACHE[1])


class PluginManager:
    """A pluggy manager plus kvcore's records and registries. Tests make a fresh one each."""

    def __init__(self, *, env: Mapping[str, str] | None = None, strict: bool | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        if strict is None:
            strict = parse_bool(self.env.get("KVCORE_STRICT_PLUGINS"), name="KVCORE_STRICT_PLUGINS")
        self.strict = strict
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        if parse_bool(self.env.get("KVCORE_TRACE_PLUGINS"), name="KVCORE_TRACE_PLUGINS"):
            self.pm.trace.root.setwriter(lambda msg: log.debug("%s", msg.rstrip()))
            self.pm.enable_tracing()
        self.records: list[PluginRecord] = []
        self._registries: Registries | None = None

    # --- registration ------------------------------------------------------------------------

    def load_builtins(self) -> None:
        """Register the core's own plugins (the shm agent, the matching-heads mapper, the builders)."""
        from importlib.metadata import version

        try:
            core_version: str | None = version("kvcore")
        except metadata.PackageNotFoundError:
            core_version = None
        for modname in BUILTIN_PLUGINS:
            module = importlib.import_module(modname)
            self.register(module, name="builtin", dist="kvcore", version=core_version, builtin=True)

    def load_entry_points(self) -> None:
        """Discover and load the ``kvcore`` entry points, applying the allow- and block-lists first."""
        allow = _split(self.env.get("KVCORE_PLUGINS"))
        block = _split(self.env.get("KVCORE_DISABLE_PLUGINS")) or set()
        for ep in _entry_points():
            dist = getattr(ep, "dist", None)
            rec = PluginRecord(
                name=ep.name,
                dist=dist.name if dist else None,
                version=dist.version if dist else None,
                status=LOADED,
                module=ep.value,
            )
            if any(r.name == ep.name for r in self.records):
                other = next(r for r in self.records if r.name == ep.name)
                self._fail(
                    rec,
                    "import",
                    PluginLoadError(
                        f"plugin name {ep.name!r} is provided by both {other.dist_label} and {rec.dist_label}"
                    ),
                )
                continue
            if (allow is not None and ep.name not in allow) or ep.name in block:
                rec.status = BLOCKED
                why = "KVCORE_DISABLE_PLUGINS" if ep.name in block else "KVCORE_PLUGINS"
                rec.error = f"not loaded: excluded by {why}"
                self.pm.set_blocked(ep.name)
                self.records.append(rec)
                log.debug("plugin %r blocked by %s", ep.name, why)
                continue
            try:
                module = ep.load()
            except Exception as exc:
                self._fail(rec, "import", exc)
                continue
            self._register_checked(module, rec)

    def register(
        self,
        plugin: ModuleType | object,
        name: str,
        *,
        dist: str | None = None,
        version: str | None = None,
        builtin: bool = False,
    ) -> PluginRecord:
        """Register an in-process plugin (a module or an object with ``@hookimpl`` methods)."""
        rec = PluginRecord(
            name=name,
            dist=dist,
            version=version,
            status=LOADED,
            module=getattr(plugin, "__name__", type(plugin).__name__),
            builtin=builtin,
        )
        self._register_checked(plugin, rec)
        return rec

    def _register_checked(self, plugin: Any, rec: PluginRecord) -> None:
        api = getattr(plugin, "KVCORE_PLUGIN_API", None)
        if api != KVCORE_PLUGIN_API:
            what = "does not declare KVCORE_PLUGIN_API" if api is None else f"declares KVCORE_PLUGIN_API = {api!r}"
            exc = PluginAPIVersionError(
                f"plugin {rec.name!r} ({rec.dist_label}) {what}; this kvcore provides "
                f"KVCORE_PLUGIN_API = {KVCORE_PLUGIN_API}. Install a plugin version built for this core."
            )
            self._fail(rec, "api", exc, status=API_MISMATCH)
            return
        try:
            self.pm.register(plugin, name=rec.name)
        except Exception as exc:
            self._fail(rec, "validate", exc)
            return
        try:
            self.pm.check_pending()
        except Exception as exc:
            self.pm.unregister(name=rec.name)
            self._fail(rec, "validate", exc)
            return
        rec.hooks = sorted(hc.name for hc in self.pm.get_hookcallers(self.pm.get_plugin(rec.name)) or ())
        self.records.append(rec)
        self._registries = None

    def _fail(self, rec: PluginRecord, phase: str, exc: BaseException, status: PluginStatus = FAILED) -> None:
        rec.status, rec.phase, rec.exception = status, phase, exc
        rec.error = _describe(exc)
        self.records.append(rec)
        if self.strict:
            if isinstance(exc, (PluginAPIVersionError, PluginLoadError, DuplicateBackendError)):
                raise exc
            raise PluginLoadError(
                f"plugin {rec.name!r} ({rec.dist_label}) failed during {phase}: {rec.error} (KVCORE_STRICT_PLUGINS=1)"
            ) from exc
        log.warning(
            "kvcore: plugin %r (%s) failed to load: %s — run 'kvcore plugins' for details",
            rec.name,
            rec.dist_label,
            rec.error,
        )
        log.debug("plugin %r traceback:\n%s", rec.name, "".join(traceback.format_exception(exc)))

    # --- registries ----------------------------------------------------------------------------

    @property
    def registries(self) -> Registries:
        """The registries, filled by calling every loaded plugin's registration hooks (once)."""
        if self._registries is None:
            self._registries = self._build_registries()
        return self._registries

    def _build_registries(self) -> Registries:
        regs = Registries()
        hooks: tuple[tuple[str, Registry[Any], str], ...] = (
            ("kvcore_register_transfer_agents", regs.transfer_agents, "transfer_agents"),
            ("kvcore_register_layout_mappers", regs.layout_mappers, "layout_mappers"),
            ("kvcore_register_page_table_builders", regs.page_table_builders, "page_table_builders"),
            ("kvcore_register_bench_baselines", regs.bench_baselines, "bench_baselines"),
        )
        by_name = {r.name: r for r in self.records}
        for hook_name, registry, key in hooks:
            for plugin_name, call in self._isolated_calls(hook_name):
                rec = by_name.get(plugin_name)
                if rec is None or rec.status != LOADED:
                    continue
                before = set(registry.names())
                registry._current_plugin = plugin_name
                try:
                    call(registry=registry)
                except Exception as exc:
                    self._record_register_failure(rec, exc, registry, before)
                    continue
                finally:
                    registry._current_plugin = "<direct>"
                added = sorted(set(registry.names()) - before)
                if added:
                    rec.provides.setdefault(key, []).extend(added)
            for dup in registry._conflicts:
                # An ambiguous name is removed so it can never be selected by accident.
                registry._entries.pop(dup, None)
            registry._failed = [r for r in self.records if r.status not in (LOADED, BLOCKED)]
        return regs

    def _isolated_calls(self, hook_name: str) -> list[tuple[str, Any]]:
        """One pluggy call per plugin implementing ``hook_name``: (plugin name, hook caller for it alone).

        Each call goes through pluggy's own call path (``subset_hook_caller``), so ``KVCORE_TRACE_PLUGINS``
        traces it and wrapper impls wrap it, while a failure stays attributed to the one plugin that raised.
        Order: ``tryfirst`` impls, then plain ones, then ``trylast``; within each, registration order (built-ins
        first), so a duplicate name blames the later, blockable plugin.
        """
        caller = getattr(self.pm.hook, hook_name)
        impls = caller.get_hookimpls()
        wrappers = {id(i.plugin) for i in impls if i.wrapper or i.hookwrapper}
        plain = [i for i in impls if id(i.plugin) not in wrappers]
        order = {name: n for n, (name, _) in enumerate(self.pm.list_name_plugin())}
        plain.sort(key=lambda i: (0 if i.tryfirst else 2 if i.trylast else 1, order.get(i.plugin_name, 0)))
        calls = []
        for impl in plain:
            others = [i.plugin for i in plain if i.plugin is not impl.plugin]
            calls.append((impl.plugin_name, self.pm.subset_hook_caller(hook_name, remove_plugins=others)))
        return calls

    def _record_register_failure(
        self, rec: PluginRecord, exc: BaseException, registry: Registry[Any], before: set[str]
    ) -> None:
        for name in set(registry.names()) - before:
            registry._entries.pop(name, None)
        rec.status, rec.phase, rec.exception, rec.error = FAILED, "register", exc, _describe(exc)
        if self.strict:
            if isinstance(exc, DuplicateBackendError):
                raise exc
            raise PluginLoadError(
                f"plugin {rec.name!r} ({rec.dist_label}) failed during register: {rec.error}"
            ) from exc
        log.warning("kvcore: plugin %r (%s) failed to register: %s", rec.name, rec.dist_label, rec.error)

    # --- convenience ---------------------------------------------------------------------------

    def record(self, name: str) -> PluginRecord | None:
        return next((r for r in self.records if r.name == name), None)

    @property
    def transfer_agents(self) -> TransferAgentRegistry:
        return self.registries.transfer_agents

    @property
    def layout_mappers(self) -> LayoutMapperRegistry:
        return self.registries.layout_mappers

    @property
    def page_table_builders(self) -> PageTableBuilderRegistry:
        return self.registries.page_table_builders

    @property
    def bench_baselines(self) -> BenchBaselineRegistry:
        return self.registries.bench_baselines


def make_plugin_manager(
    *,
    load_entry_points: bool = True,
    builtins: bool = True,
    env: Mapping[str, str] | None = None,
    strict: bool | None = None,
) -> PluginManager:
    """A new plugin manager: built-ins, then (optionally) the installed entry points."""
    pm = PluginManager(env=env, strict=strict)
    if builtins:
        pm.load_builtins()
    if load_entry_points:
        pm.load_entry_points()
    if pm.records:
        loaded = [r for r in pm.records if r.status == LOADED and not r.builtin]
        log.info(
            "loaded %d plugin(s): %s", len(loaded), ", ".join(f"{r.name} ({r.dist_label})" for r in loaded) or "none"
        )
    return pm


_GLOBAL: tuple[int, PluginManager] | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, created on first use (and again in a forked child)."""
    global _GLOBAL
    if _GLOBAL is None or _GLOBAL[0] != os.getpid():
        _GLOBAL = (os.getpid(), make_plugin_manager())
    return _GLOBAL[1]


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests, or after installing a plugin at run time)."""
    global _GLOBAL, _EP_CACHE
    _GLOBAL = None
    _EP_CACHE = None
