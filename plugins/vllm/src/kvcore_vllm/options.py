"""kvcore settings from vLLM's ``kv_connector_extra_config``.

Every key is a :class:`kvcore.TransceiverConfig` field (``backend``,
``agent_options``, ``host``, ``port``, ``request_timeout_s``, ...), except
``config_file``: a kvcore TOML/YAML file read first. ``KVCORE_*`` environment
variables apply between the file and the keys given here, as everywhere in
kvcore. An unknown key raises ``ConfigError`` naming it and the known ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvcore.config import TransceiverConfig
from kvcore.errors import ConfigError

__all__ = ["ROLES", "transceiver_config", "transceiver_role"]

#: vLLM ``kv_role`` -> kvcore transceiver role.
ROLES = {"kv_producer": "context", "kv_consumer": "generation"}


def transceiver_config(extra_config: Mapping[str, Any] | None) -> TransceiverConfig:
    """The kvcore configuration ``kv_connector_extra_config`` asks for."""
    values = dict(extra_config or {})
    file = values.pop("config_file", None)
    if file is not None and not isinstance(file, str):
        raise ConfigError(f"kv_connector_extra_config.config_file: expected a path string, got {file!r}")
    return TransceiverConfig.load(file, **values)


def transceiver_role(kv_role: str | None) -> str:
    """kvcore's role for vLLM's ``kv_role``; ``kv_both`` is refused (one instance is either prefill or decode)."""
    try:
        return ROLES[kv_role or ""]
    except KeyError:
        raise ConfigError(
            f"kv_role: expected 'kv_producer' (prefill instance) or 'kv_consumer' (decode instance) for "
            f"KvcoreConnector, got {kv_role!r}"
        ) from None
