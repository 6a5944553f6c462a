"""Old names that still work for one release, each with a ``DeprecationWarning`` naming its replacement.

Renamed keywords of functions (:func:`renamed_keyword`), of msgspec struct constructors
(:class:`RenamingStructMeta`) and module attributes (:func:`module_getattr`). kvcore itself uses only the new
names; these exist so that engines and plugins written against the old ones keep running while they move.
Imports nothing from kvcore, so any module may use it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec

__all__ = ["module_getattr", "renamed_keyword", "RenamingStructMeta", "warn_renamed"]

T = TypeVar("T")


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn (``DeprecationWarning``) that ``old`` is deprecated in favour of ``new``."""
    warnings.warn(
        f"{old} is deprecated; use {new} (the old name goes in the next release)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_keyword(where: str, old: str, old_value: T | None, new: str, new_value: T | None) -> T | None:
    """The value of keyword ``new`` of ``where``, taken from deprecated keyword ``old`` when only that was given.

    Passing both is a ``TypeError`` (as Python says for a keyword given twice); passing ``old`` warns.
    """
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{where}() got both {old}= (deprecated) and {new}=; pass only {new}=")
    warn_renamed(f"{where}({old}=...)", f"{new}=", stacklevel=4)
    return old_value


class RenamingStructMeta(msgspec.StructMeta):
    """A msgspec ``StructMeta`` whose classes also accept deprecated constructor keywords.

    A class using it names them in ``__renamed_keywords__`` (old keyword -> new field name). Only
    construction is affected: what goes on the wire is decided by each field's ``msgspec.field(name=...)``.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        renames: Mapping[str, str] = getattr(cls, "__renamed_keywords__", {})
        for old, new in renames.items():
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{cls.__name__}() got both {old}= (deprecated) and {new}=; pass only {new}=")
                warn_renamed(f"{cls.__name__}({old}=...)", f"{new}=")
                kwargs[new] = kwargs.pop(old)
        return super().__call__(*args, **kwargs)


def module_getattr(module: str, renames: Mapping[str, str], namespace: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves each old name in ``renames`` (old -> new) with a warning."""

    def __getattr__(name: str) -> Any:
        new = renames.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_renamed(f"{module}.{name}", f"{module}.{new}")
        return namespace[new]

    return __getattr__
