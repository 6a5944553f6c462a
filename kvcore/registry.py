"""Typed registries that plugins fill through the registration hooks; entries are imported lazily."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvcore.errors import DuplicateBackendError, PluginError, UnknownBackendError

if TYPE_CHECKING:
    from kvcore.agent import AgentCapabilities
    from kvcore.plugins import PluginRecord

__all__ = [
    "Entry",
    "Registry",
    "TransferAgentRegistry",
    "LayoutMapperRegistry",
    "PageTableBuilderRegistry",
    "Registries",
]

T = TypeVar("T")


@dataclass
class Entry:
    """One registered name: where its implementation lives and who registered it."""

    name: str
    target: str  # "package.module:attribute"
    plugin: str  # the registering plugin's name
    description: str = ""
    capabilities: AgentCapabilities | None = None
    install_hint: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    _loaded: Any = None

    def load(self) -> Any:
        """Import the target on first use and cache it."""
        if self._loaded is None:
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
        return self._loaded


class Registry(Generic[T]):
    """Name -> lazily imported implementation, with duplicate detection and helpful lookup errors."""

    kind: str = "entry"  # used in messages: "transfer agent", "layout mapper", ...

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
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
        self._entries[name] = Entry(
            name=name,
            target=target,
            plugin=self._current_plugin,
            description=description,
            install_hint=install_hint,
            extra=extra,
        )

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def entry(self, name: str) -> Entry:
        """The entry for ``name`` or ``UnknownBackendError`` listing what is registered and why plugins failed."""
        if name in self._conflicts:
            raise self._conflicts[name]
        try:
            return self._entries[name]
        except KeyError:
            raise self._unknown(name) from self._cause_for(name)

    def get(self, name: str) -> T:
        """The implementation registered as ``name``, imported on first use."""
        return self.entry(name).load()  # type: ignore[no-any-return]

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
        lines = [f"{self.kind} {name!r} is not available.", f"  registered: {', '.join(self.names()) or 'none'}"]
        for rec in self._failed:
            lines.append(f"  plugin {rec.name!r} ({rec.dist_label}) {rec.status}: {rec.error}")
        hint = _INSTALL_HINTS.get(name)
        if hint:
            lines.append(f"  hint: {hint}")
        else:
            lines.append("  hint: run 'kvcore plugins' to see installed plugins and their errors")
        return UnknownBackendError("\n".join(lines))


_INSTALL_HINTS = {
    "nixl": "pip install ./plugins/nixl  (distribution kvcore-nixl; needs the nixl-cu12 wheel)",
    "ucx": "pip install ./plugins/ucx  (distribution kvcore-ucx; needs ucxx-cu12 and libucx-cu12)",
    "head_mismatch_head_major": "pip install ./plugins/mixers  (distribution kvcore-mixers)",
    "head_mismatch_token_major": "pip install ./plugins/mixers  (distribution kvcore-mixers)",
    "replicated": "pip install ./plugins/mixers  (distribution kvcore-mixers)",
    "mamba_conv": "pip install ./plugins/mixers  (distribution kvcore-mixers)",
    "mamba_ssm": "pip install ./plugins/mixers  (distribution kvcore-mixers)",
}


class TransferAgentRegistry(Registry[Any]):
    """Transfer agents by backend name. ``add`` takes the agent's ``capabilities``."""

    kind = "transfer agent"

    def add(  # type: ignore[override]
        self,
        name: str,
        target: str,
        *,
        capabilities: AgentCapabilities | None = None,
        description: str = "",
        install_hint: str | None = None,
        **extra: Any,
    ) -> None:
        """Register transport ``name`` implemented by ``target`` (a ``TransferAgent`` subclass)."""
        from kvcore.agent import AgentCapabilities

        if capabilities is not None and not isinstance(capabilities, AgentCapabilities):
            raise PluginError(
                f"plugin {self._current_plugin!r}: capabilities of {name!r} must be AgentCapabilities, "
                f"got {type(capabilities).__name__}"
            )
        super().add(name, target, description=description, install_hint=install_hint, **extra)
        self._entries[name].capabilities = capabilities


class LayoutMapperRegistry(Registry[Any]):
    """Layout mappers by kind (``matching_heads``, ``head_mismatch_token_major``, ...)."""

    kind = "layout mapper"


class PageTableBuilderRegistry(Registry[Callable[..., Any]]):
    """Page-table builders by name."""

    kind = "page-table builder"


@dataclass
class Registries:
    """The three registries one plugin manager fills."""

    transfer_agents: TransferAgentRegistry = field(default_factory=TransferAgentRegistry)
    layout_mappers: LayoutMapperRegistry = field(default_factory=LayoutMapperRegistry)
    page_table_builders: PageTableBuilderRegistry = field(default_factory=PageTableBuilderRegistry)

    def all(self) -> tuple[Registry[Any], ...]:
        return (self.transfer_agents, self.layout_mappers, self.page_table_builders)
