"""kvcore settings from vLLM's ``kv_connector_extra_config``.

Every key is a :class:`kvcore.TransceiverConfig` field (``backend``,
``agent_options``, ``host``, ``port``, ``request_timeout_s``, ``lease_s``,
...), except three:

* ``config_file``: a kvcore TOML/YAML file read first. ``KVCORE_*``
  environment variables apply between the file and the keys given here, as
  everywhere in kvcore.
* ``mode``: ``"pull"`` (the default here: the decode instance reads the
  prefill's blocks as soon as it allocated its own, vLLM's usual flow) or
  ``"push"`` (the prefill writes into the decode's blocks once asked); the
  same as kvcore's ``transfer_mode``, which it overrides.
* ``metrics_port``: each worker serves kvcore's Prometheus metrics (kvcore's
  own families and the connector's ``kvcore_vllm_load_failures_total``) on
  ``http://<host>:<metrics_port + TP rank>/metrics``, on the transceiver's
  ``host`` (loopback by default). Off when absent.

An unknown key raises ``ConfigError`` naming it and the known ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcore.config import TransceiverConfig
from kvcore.errors import ConfigError

__all__ = ["DEFAULT_MODE", "ROLES", "ConnectorOptions", "connector_options", "transceiver_config", "transceiver_role"]

#: The transfer mode when ``kv_connector_extra_config`` names none (neither ``mode`` nor ``transfer_mode``).
DEFAULT_MODE = "pull"

#: vLLM ``kv_role`` -> kvcore transceiver role.
ROLES = {"kv_producer": "context", "kv_consumer": "generation"}


@dataclass(frozen=True)
class ConnectorOptions:
    """What ``kv_connector_extra_config`` asks for: kvcore's configuration and the connector's own keys."""

    config: TransceiverConfig
    metrics_port: int | None = None


def connector_options(extra_config: Mapping[str, Any] | None) -> ConnectorOptions:
    """The kvcore configuration and connector options ``kv_connector_extra_config`` asks for."""
    values = dict(extra_config or {})
    port = values.pop("metrics_port", None)
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise ConfigError(f"kv_connector_extra_config.metrics_port: expected a TCP port (1-65535), got {port!r}")
    return ConnectorOptions(transceiver_config(values), port)


def transceiver_config(extra_config: Mapping[str, Any] | None) -> TransceiverConfig:
    """The kvcore configuration ``kv_connector_extra_config`` asks for (without the connector's own keys)."""
    values = dict(extra_config or {})
    file = values.pop("config_file", None)
    if file is not None and not isinstance(file, str):
        raise ConfigError(f"kv_connector_extra_config.config_file: expected a path string, got {file!r}")
    if "mode" in values:
        mode = values.pop("mode")
        if mode not in ("pull", "push"):
            raise ConfigError(f"kv_connector_extra_config.mode: expected 'pull' or 'push', got {mode!r}")
        values["transfer_mode"] = mode
    config = TransceiverConfig.load(file, **values)
    if "transfer_mode" not in values and not _mode_set_outside(file):
        config.transfer_mode = DEFAULT_MODE
    return config


def _mode_set_outside(file: str | None) -> bool:
    """True when a config file or ``KVCORE_TRANSFER_MODE`` chose the transfer mode (they win over our default)."""
    import os
    from pathlib import Path

    if "KVCORE_TRANSFER_MODE" in os.environ:
        return True
    file = file or os.environ.get("KVCORE_CONFIG") or None
    # kvcore has no public "which fields were given" query; its own file reader tells (read-only use).
    return file is not None and "transfer_mode" in TransceiverConfig._read_file(Path(file))


def transceiver_role(kv_role: str | None) -> str:
    """kvcore's role for vLLM's ``kv_role``; ``kv_both`` is refused (one instance is either prefill or decode)."""
    try:
        return ROLES[kv_role or ""]
    except KeyError:
        raise ConfigError(
            f"kv_role: expected 'kv_producer' (prefill instance) or 'kv_consumer' (decode instance) for "
            f"KvcoreConnector, got {kv_role!r}"
        ) from None
