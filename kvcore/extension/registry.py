"""Typed registries that plugins fill through the registration hooks; entries are imported lazily.

This module sits below the loader (``kvcore.extension.plugins``) and the hook specs
(``kvcore.extension.hookspecs``): both import it, it imports neither, so the three never
form an import circle. It also holds what the registries report about plugins
(``PluginStatus``, ``PluginRecord``), which the loader fills.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvcore.errors import DuplicateBackendError, PluginError, UnknownBackendError

if TYPE_CHECKING:
    # LayoutMapper and BenchBaseline appear only in quoted base classes, which ruff does not count as uses
    # (hence the noqa); importing them for real would make the registries import the data plane.
    from kvcore.layout.mappers import LayoutMapper  # noqa: F401
    from kvcore.layout.page import PageTable
    from kvcore.transport.agent import AgentCapabilities, TransferAgent
    from kvcore.transport.baselines import BenchBaseline  # noqa: F401

__all__ = [
    "PluginStatus",
    "PluginRecord",
    "Entry",
    "Registry",
    "TransferAgentRegistry",
    "LayoutMapperRegistry",
    "PageTableBuilderRegistry",
    "BenchBaselineRegistry",
    "Registries",
]

T = TypeVar("T")

#: What a page-table builder is: a function (or class) that describes an engine's KV cache as a ``PageTable``.
PageTableBuilder = Callable[..., "PageTable"]


class PluginStatus(StrEnum):
    """What happened to one plugin; a ``str`` so JSON output and comparisons with the words keep working."""

    LOADED = "loaded"  # registered; its hooks ran (or will run) into the registries
    FAILED = "failed"  # raised while importing, validating or registering (``PluginRecord.phase`` says which)
    BLOCKED = "blocked"  # excluded by KVCORE_PLUGINS / KVCORE_DISABLE_PLUGINS before anything was imported
    API_MISMATCH = "api_mismatch"  # declares another KVCORE_PLUGIN_API than this core provides


@dataclass
class PluginRecord:
    """What happened to one plugin: where it came from, its status, what it registered, its error."""

    name: str
    dist: str | None
    version: str | None
    status: PluginStatus
    module: str = ""
    builtin: bool = False
    phase: str | None = None  # import | api | validate | register, for failures
    error: str | None = None
    exception: BaseException | None = field(default=None, repr=False)
    provides: dict[str, list[str]] = field(default_factory=dict)
    hooks: list[str] = field(default_factory=list)

    @property
    def dist_label(self) -> str:
        if self.builtin:
            return "kvcore (built-in)"
        if self.dist:
            return f"{self.dist} {self.version or '?'}"
        return "no distribution"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.dist,
            "version": self.version,
            "status": self.status.value,
            "builtin": self.builtin,
            "module": self.module,
            "phase": self.phase,
            "error": self.error,
            "provides": self.provides,
            "hooks": self.hooks,
        }


@dataclass
class Entry(Generic[T]):
    """One registered name: where its implementation lives, who registered it, and what that plugin declared."""

    name: str
    target: str  # "package.module:attribute"
    plugin: str  # the registering plugin's name
    description: str = ""
    install_hint: str | None = None  # shown when the target cannot be imported (a missing native library)
    # Transfer agents only: what the agent can do, and whether ``backend="auto"`` may pick it (highest first).
    capabilities: AgentCapabilities | None = None
    auto_priority: int | None = None
    # Bench baselines only: the transfer agent they run beside, and whether the matrix reports them as "bare".
    backend: str | None = None
    in_matrix: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    _loaded: T | None = None

    def load(self) -> T:
        """Import the target on first use and cache it."""
        if self._loaded is not None:
            return self._loaded
        module_name, _, attr = self.target.partition(":")
        if not module_name or not attr:
            raise PluginError(f"{self.name!r} target {self.target!r} must look like 'package.module:attribute'")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as exc:
            hint = f"\n  hint: {self.install_hint}" if self.install_hint else ""
            raise UnknownBackendError(
                f"{self.name!r} from plugin {self.plugin!r} could not be imported from {self.target!r}: "
                f"{type(exc).__name__}: {exc}{hint}"
            ) from exc
        self._loaded = obj
        return obj  # type: ignore[no-any-return]  # what the target is, its plugin promised (checked by users)


class Registry(Generic[T]):
    """Name -> lazily imported implementation, with duplicate detection and helpful lookup errors."""

    kind: str = "entry"  # used in messages: "transfer agent", "layout mapper", ...

    def __init__(self) -> None:
        self._entries: dict[str, Entry[T]] = {}
        self._current_plugin = "<direct>"
        self._failed: list[PluginRecord] = []
        self._conflicts: dict[str, DuplicateBackendError] = {}

    def add(
        self,
        name: str,
        target: str,
        *,
        description: str = "",
        install_hint: str | None = None,
        **extra: Any,
    ) -> None:
        """Register ``name`` -> ``target`` ("package.module:attribute"); raises on a duplicate name."""
        self._add(
            Entry(
                name=name,
                target=target,
                plugin=self._current_plugin,
                description=description,
                install_hint=install_hint,
                extra=extra,
            )
        )

    def _add(self, entry: Entry[T]) -> None:
        name, target = entry.name, entry.target
        if not isinstance(name, str) or not name or name != name.strip():
            raise PluginError(f"plugin {self._current_plugin!r} registered an invalid {self.kind} name {name!r}")
        if ":" not in target:
            raise PluginError(
                f"plugin {self._current_plugin!r} registered {self.kind} {name!r} with target {target!r}; "
                "expected 'package.module:attribute'"
            )
        if name in self._entries:
            other = self._entries[name].plugin
            exc = DuplicateBackendError(
                f"{self.kind} {name!r} is registered by both plugin {other!r} and plugin {self._current_plugin!r}; "
                f"uninstall one or block it with KVCORE_DISABLE_PLUGINS={self._current_plugin}"
            )
            self._conflicts[name] = exc
            raise exc
        self._entries[name] = entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry[T]]:
        return [self._entries[n] for n in self.names()]

    def entry(self, name: str) -> Entry[T]:
        """The entry for ``name`` or ``UnknownBackendError`` listing what is registered and why plugins failed."""
        if name in self._conflicts:
            raise self._conflicts[name]
        try:
            return self._entries[name]
        except KeyError:
            raise self._unknown(name) from self._cause_for(name)

    def get(self, name: str) -> T:
        """The implementation registered as ``name``, imported on first use."""
        return self.entry(name).load()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def _cause_for(self, name: str) -> BaseException | None:
        for rec in self._failed:
            if rec.name == name and rec.exception is not None:
                return rec.exception
        return None

    def _unknown(self, name: str) -> UnknownBackendError:
        # The core names no plugin: what provides ``name`` is known only to an installed plugin, which
        # states its own install hint (shown when its target fails to import, see ``Entry.load``).
        lines = [f"{self.kind} {name!r} is not available.", f"  registered: {', '.join(self.names()) or 'none'}"]
        for rec in self._failed:
            lines.append(f"  plugin {rec.name!r} ({rec.dist_label}) {rec.status}: {rec.error}")
        lines.append("  hint: run 'kvcore plugins' to see installed plugins and their errors")
        return UnknownBackendError("\n".join(lines))


class TransferAgentRegistry(Registry["type[TransferAgent]"]):
    """Transfer agents by backend name. ``add`` takes the agent's ``capabilities`` and its ``auto_priority``."""

    kind = "transfer agent"

    def add(
        self,
        name: str,
        target: str,
        *,
        capabilities: AgentCapabilities | None = None,
        auto_priority: int | None = None,
        description: str = "",
        install_hint: str | None = None,
        **extra: Any,
    ) -> None:
        """Register transport ``name`` implemented by ``target`` (a ``TransferAgent`` subclass).

        ``capabilities`` is the one statement of what the agent can do: the agent class reads it back as its
        ``capabilities`` attribute (see ``TransferAgent``), ``kvcore plugins`` and the tools read it here without
        importing the agent. ``auto_priority``: ``backend="auto"`` tries the agents that set one, highest first;
        ``None`` (the default) keeps the agent out of automatic selection.
        """
        from kvcore.transport.agent import AgentCapabilities

        if capabilities is not None and not isinstance(capabilities, AgentCapabilities):
            raise PluginError(
                f"plugin {self._current_plugin!r}: capabilities of {name!r} must be AgentCapabilities, "
                f"got {type(capabilities).__name__}"
            )
        if auto_priority is not None and (isinstance(auto_priority, bool) or not isinstance(auto_priority, int)):
            raise PluginError(
                f"plugin {self._current_plugin!r}: auto_priority of {name!r} must be an int or None, "
                f"got {auto_priority!r}"
            )
        self._add(
            Entry(
                name=name,
                target=target,
                plugin=self._current_plugin,
                description=description,
                install_hint=install_hint,
                capabilities=capabilities,
                auto_priority=auto_priority,
                extra=extra,
            )
        )

    def get(self, name: str) -> type[TransferAgent]:
        """The agent class registered as ``name``, imported on first use; its ``capabilities`` must be the registered ones.

        A class that states other capabilities than its plugin registered raises ``PluginError`` naming both:
        the tools read the registry, the agent reads its class attribute, and the two must never disagree.
        """
        entry = self.entry(name)
        cls = entry.load()
        declared = getattr(cls, "capabilities", None)
        if entry.capabilities is not None and declared is not None and declared != entry.capabilities:
            raise PluginError(
                f"transfer agent {name!r} from plugin {entry.plugin!r}: {getattr(cls, '__name__', cls)}.capabilities "
                f"is {declared}, but the plugin registered {entry.capabilities}; state them once (a constant in "
                "the hook module that the class reads back)"
            )
        return cls

    def auto_candidates(self) -> list[str]:
        """The agents ``backend="auto"`` tries, in order: highest ``auto_priority`` first, then by name."""
        ranked = [e for e in self._entries.values() if e.auto_priority is not None]
        return [e.name for e in sorted(ranked, key=lambda e: (-(e.auto_priority or 0), e.name))]

    def remote_names(self) -> list[str]:
        """The agents whose capabilities reach peers on other hosts, highest ``auto_priority`` first, then by name."""
        remote = [e for e in self._entries.values() if e.capabilities is not None and e.capabilities.remote]
        return [e.name for e in sorted(remote, key=_preference)]

    def preferred_order(self, names: list[str]) -> list[str]:
        """``names`` ordered as the tools list backends: network agents first, then by ``auto_priority``, then name."""
        return sorted(names, key=lambda n: _preference(self._entries[n]) if n in self._entries else (2, 0, n))


def _preference(e: Entry[Any]) -> tuple[int, int, str]:
    remote = e.capabilities is not None and e.capabilities.remote
    return (0 if remote else 1, -(e.auto_priority if e.auto_priority is not None else -1), e.name)


class LayoutMapperRegistry(Registry["type[LayoutMapper]"]):
    """Layout mappers by kind (``matching_heads``, ``head_mismatch_token_major``, ...)."""

    kind = "layout mapper"


class PageTableBuilderRegistry(Registry[PageTableBuilder]):
    """Page-table builders by name."""

    kind = "page-table builder"


class BenchBaselineRegistry(Registry["type[BenchBaseline]"]):
    """``kvcore bench`` baselines by mode name: a transport's own API run beside its kvcore agent."""

    kind = "bench baseline"

    def add(  # type: ignore[override]
        self,
        name: str,
        target: str,
        *,
        backend: str,
        in_matrix: bool = False,
        description: str = "",
        install_hint: str | None = None,
        **extra: Any,
    ) -> None:
        """Register bench mode ``name`` (a ``kvcore.transport.baselines.BenchBaseline`` subclass) beside agent ``backend``.

        ``in_matrix``: the matrix case runs this mode too and reports it as the backend's "bare" speed (at
        most one per backend; without one the bare agent is reported).
        """
        if not isinstance(backend, str) or not backend:
            raise PluginError(
                f"plugin {self._current_plugin!r}: bench baseline {name!r} must name its transfer agent, "
                f"got backend={backend!r}"
            )
        self._add(
            Entry(
                name=name,
                target=target,
                plugin=self._current_plugin,
                description=description,
                install_hint=install_hint,
                backend=backend,
                in_matrix=bool(in_matrix),
                extra=extra,
            )
        )

    def for_backend(self, backend: str) -> list[str]:
        """The baseline modes registered beside ``backend``, by name."""
        return [e.name for e in self.entries() if e.backend == backend]

    def matrix_mode(self, backend: str) -> str | None:
        """The baseline the matrix reports as ``backend``'s bare speed, if its plugin names one."""
        return next((e.name for e in self.entries() if e.backend == backend and e.in_matrix), None)


@dataclass
class Registries:
    """The registries one plugin manager fills."""

    transfer_agents: TransferAgentRegistry = field(default_factory=TransferAgentRegistry)
    layout_mappers: LayoutMapperRegistry = field(default_factory=LayoutMapperRegistry)
    page_table_builders: PageTableBuilderRegistry = field(default_factory=PageTableBuilderRegistry)
    bench_baselines: BenchBaselineRegistry = field(default_factory=BenchBaselineRegistry)

    def all(self) -> tuple[Registry[Any], ...]:
        return (self.transfer_agents, self.layout_mappers, self.page_table_builders, self.bench_baselines)
