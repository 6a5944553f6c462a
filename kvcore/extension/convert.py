"""Text settings to typed values, in one place: ``KVCORE_*`` environment variables and other strings.

``TransceiverConfig`` (every ``KVCORE_<FIELD>``) and the plugin loader's
switches (``KVCORE_STRICT_PLUGINS``, ``KVCORE_TRACE_PLUGINS``) convert through
here, so "on" means the same everywhere and a bad value is a ``ConfigError``
naming the variable, the type expected and the text given.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import msgspec

from kvcore.errors import ConfigError

__all__ = ["TRUE_WORDS", "FALSE_WORDS", "parse_bool", "from_text"]

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"", "0", "false", "no", "off"})


def parse_bool(raw: str | None, *, name: str = "value") -> bool:
    """``True`` for 1/true/yes/on, ``False`` for 0/false/no/off/empty/unset; anything else is a ``ConfigError``."""
    word = (raw or "").strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; expected one of 1/true/yes/on or 0/false/no/off")


def from_text(raw: str, tp: Any, *, name: str) -> Any:
    """Convert ``raw`` to type ``tp``: bool, int, float, str, ``list[str]`` / ``list[int]`` (comma-separated)
    or ``dict[...]`` (a JSON object). ``name`` (the variable) goes into the ``ConfigError`` of a bad value."""
    origin = typing.get_origin(tp)
    if tp is bool:
        return parse_bool(raw, name=name)
    if origin is list:
        (item,) = typing.get_args(tp) or (str,)
        return [from_text(part.strip(), item, name=name) for part in raw.split(",") if part.strip()]
    if origin is dict or tp is dict:
        try:
            return msgspec.json.decode(raw.encode(), type=tp)
        except msgspec.DecodeError as exc:  # ValidationError included: not JSON, or not an object
            raise ConfigError(f"{name}={raw!r} is not a JSON object: {exc}") from exc
    if tp in (int, float):
        try:
            return tp(raw.strip())
        except ValueError as exc:
            raise ConfigError(f"{name}={raw!r} is not a valid {tp.__name__}: {exc}") from exc
    if tp is str:
        return raw
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{name}: a union type {tp!r} cannot be read from text")  # no such field today
    raise ConfigError(f"{name}: no text conversion for type {tp!r}")
