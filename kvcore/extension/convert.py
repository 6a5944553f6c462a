"""Settings to typed values, in one place: ``KVCORE_*`` environment variables, other strings, option mappings.

``TransceiverConfig`` (every ``KVCORE_<FIELD>``) and the plugin loader's
switches (``KVCORE_STRICT_PLUGINS``, ``KVCORE_TRACE_PLUGINS``) convert through
here, so "on" means the same everywhere and a bad value is a ``ConfigError``
naming the variable, the type expected and the text given. Transfer agents'
options (``TransceiverConfig.agent_options``) become each agent's typed options
struct through :func:`convert_options`, so an unknown key or a wrong type is a
``ConfigError`` naming the agent, the key, the type expected and the value given.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from kvcore.errors import ConfigError

__all__ = ["TRUE_WORDS", "FALSE_WORDS", "convert_options", "describe_type", "parse_bool", "from_text"]

S = TypeVar("S", bound=msgspec.Struct)

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


def describe_type(tp: Any) -> str:
    """``tp`` as people read it in an error: ``int in 1..64``, ``true, false or 'auto'``, ``mapping of str to str``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        base, bounds = describe_type(args[0]), []
        for meta in args[1:]:
            if isinstance(meta, msgspec.Meta):
                ge, le, gt, lt = meta.ge, meta.le, meta.gt, meta.lt
                if ge is not None and le is not None:
                    bounds.append(f"in {ge}..{le}")
                else:
                    bounds += [f"{op} {v}" for op, v in ((">=", ge), ("<=", le), (">", gt), ("<", lt)) if v is not None]
        return " ".join([base, *bounds])
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        # "true or false or 'auto'" reads well; among other types a bool is just "bool"
        words = all(a is bool or typing.get_origin(a) is typing.Literal for a in args)
        return " or ".join("bool" if a is bool and not words else describe_type(a) for a in args)
    if origin in (dict, Mapping) or tp is dict:
        key, value = args or (str, Any)
        return f"a mapping of {describe_type(key)} to {describe_type(value)}"
    if origin in (list, tuple):
        return f"a list of {describe_type(args[0]) if args else 'values'}"
    if tp is bool:
        return "true or false"
    return getattr(tp, "__name__", repr(tp))


def convert_options(tp: type[S], raw: Mapping[str, Any] | S | None, *, owner: str) -> S:
    """``raw`` (a mapping from configuration, or already a ``tp``) as the frozen options struct ``tp``.

    Missing keys take the struct's defaults. An unknown key, a value of the wrong type or out of its
    declared range is a ``ConfigError`` naming ``owner`` (``"shm agent"``), the key, the type expected
    and the value given; unknown keys are listed with the known ones.
    """
    if raw is None:
        return tp()
    if isinstance(raw, tp):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{owner} options: expected a mapping of option names to values, got {type(raw).__name__}")
    fields = {f.encode_name: f for f in msgspec.structs.fields(tp)}
    unknown = sorted(str(k) for k in raw if k not in fields)
    if unknown:
        raise ConfigError(
            f"{owner} option(s) {', '.join(repr(k) for k in unknown)}: unknown; "
            f"expected one of {', '.join(sorted(fields))}"
        )
    try:
        return msgspec.convert(dict(raw), tp)
    except msgspec.ValidationError as exc:
        text = str(exc)
        path = text.rpartition(" - at `$.")[2].rstrip("`") if " - at `$." in text else ""
        key = path.split("[", 1)[0].split(".", 1)[0]
        if key not in fields:  # a check of the struct itself (``__post_init__``), not of one field
            raise ConfigError(f"{owner} options: {text}") from exc
        value = raw[key]
        raise ConfigError(
            f"{owner} option {key!r}: expected {describe_type(fields[key].type)}, "
            f"got {value!r} ({type(value).__name__})"
        ) from exc
