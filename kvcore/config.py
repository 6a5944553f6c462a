"""Transceiver configuration and backend selection by name.

Precedence, highest first: keyword arguments given in Python, ``KVCORE_*``
environment variables, a YAML or TOML file, then the defaults below.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcore.errors import ConfigError, UnknownBackendError

if TYPE_CHECKING:
    from kvcore.extension.plugins import PluginManager
    from kvcore.transport.agent import TransferAgent

__all__ = ["TransceiverConfig", "config_table", "resolve_backend", "create_agent"]

log = logging.getLogger("kvcore.config")

# A host name, an IPv4 address, or an IPv6 address with or without brackets.
#: The largest ``gil_switch_interval_s`` accepted (the interpreter's default is 0.005).
MAX_GIL_SWITCH_INTERVAL_S = 0.1
#: The hard bound on ``max_aux_bytes``: an aux payload travels in one control frame.
MAX_AUX_BYTES = 1024 * 1024

_ADVERTISE_RE = re.compile(r"\A(?:[A-Za-z0-9.\-]+|\[?[0-9A-Fa-f:.]+\]?)\Z")


@functools.cache
def _field_types() -> dict[str, Any]:
    """``TransceiverConfig``'s field types, resolved once."""
    return typing.get_type_hints(TransceiverConfig)


@dataclass
class TransceiverConfig:
    """Everything a transceiver needs to know; every field has a safe default."""

    backend: str = "auto"  # transport plugin by name (shm, nixl, ucx, ...); "auto": the best one installed
    agent_options: dict[str, Any] = field(default_factory=dict)  # options passed to the backend's agent
    host: str = "127.0.0.1"  # control-plane bind address; loopback unless asked otherwise ("0.0.0.0"/"::": all)
    port: int = 0  # rank 0's control port; rank r binds port + r * port_stride; 0 picks free ports
    advertise_host: str = ""  # the address peers dial (pod/node IP); "" = host (a wildcard host: the hostname)
    port_stride: int = 1  # distance between consecutive ranks' ports when port is set
    ports: list[int] = field(default_factory=list)  # explicit per-rank ports (rank r binds ports[r]); wins over port
    request_timeout_s: float = 60.0  # bound on one request from start to terminal outcome
    first_contact_timeout_s: float = 10.0  # bound on fetching a peer's RankInfo
    transfer_timeout_s: float = 30.0  # bound on one submitted transfer at the transport
    max_message_bytes: int = 16 * 1024 * 1024  # control-plane frame size bound
    max_inflight_requests: int = 4096  # requests this rank holds at once (more: ResourceExhaustedError at the call)
    # Lifecycles (see docs/architecture.md): how long a silent peer stays SUSPECT before it is LOST; how long
    # after that a writer on another host is still assumed able to write (fencing); refusals are remembered.
    peer_lost_timeout_s: float = 5.0  # a silent peer (connection down, no goodbye) is SUSPECT this long, then LOST
    fencing_grace_s: float = 60.0  # must exceed the writer's transfer_timeout_s
    refused_peer_ttl_s: float = 30.0  # how long an incompatible peer stays refused before it is tried again
    quarantine_query_interval_s: float = 2.0  # re-ask a live writer for its final word on a quarantined request
    # Caps on what peers can make this rank hold.
    max_peers: int = 1024  # generation ranks registered with one context rank
    idle_peer_ttl_s: float = 300.0  # a registered generation rank that asks for nothing this long is dropped
    max_early_requests: int = 4096  # RequestData waiting for start_send, in total ...
    max_early_per_peer: int = 1024  # ... per generation rank ...
    max_early_bytes: int = 64 * 1024 * 1024  # ... and their block lists in bytes
    max_early_bytes_per_peer: int = 0  # ... of which one generation rank may hold this much; 0: an eighth of it
    max_tombstones: int = 65536  # outcomes of released requests kept for late receivers (~512 B each)
    max_peer_tombstones: int = 16384  # apart from those: requests peers declined or cancelled before start_send
    bounce_min_fragments: int = 256  # plans with at least this many fragments ...
    bounce_max_fragment_bytes: int = 4096  # ... all this small or smaller go through a bounce buffer
    bounce_enabled: bool = True  # False: fragmented plans are written as they are, never through a bounce buffer
    bounce_buffer_bytes: int = 64 * 1024 * 1024  # receiver arena and sender staging buffer, per rank
    required_plugins: list[str] = field(
        default_factory=list
    )  # plugins that must be installed, "name>=version" (create_agent fails fast otherwise)
    transfer_mode: str = (
        "push"  # per request default: "push" (the context writes) or "pull" (the generation side reads)
    )
    require_tickets: bool = True  # serve a request only to a receiver presenting its ticket (from TransferParams)
    max_aux_bytes: int = 64 * 1024  # bound on one request's aux payload (first token, draft tokens...)
    lease_s: float = 60.0  # the context keeps a request's pages this long after start_send or the last renewal
    max_lease_s: float = 600.0  # ... but never longer than this from start_send, however often it is renewed
    # --- control-plane authentication (docs/security.md) ---
    # "auto": the configured key if any; else, on a loopback host, this uid's local key (created on first use,
    # mode 0600, in auth_local_dir), so other local users are refused; "none": no authentication (logged).
    auth_mode: str = "auto"  # "auto": configured key, else this uid's local key on loopback; "none": off (logged)
    auth_local_dir: str = ""  # where the local key lives; empty: $KVCORE_STATE_DIR, else ~/.local/state/kvcore
    auth_key_file: str = ""  # this rank's secret CurveZMQ certificate (*.key_secret, from `kvcore keygen`)
    auth_secret_key: str = field(default="", repr=False)  # or its Z85 secret key itself (KVCORE_AUTH_SECRET_KEY)
    auth_allowed_keys_dir: str = ""  # directory of public certificates (*.key) of the clients admitted
    auth_allowed_keys: list[str] = field(default_factory=list)  # and/or their Z85 public keys
    auth_server_key: str = ""  # Z85 public key peers' control sockets serve with; empty: our own (one shared pair)
    allow_insecure_bind: bool = False  # True: a non-loopback host without authentication is accepted (warned)
    # The interpreter's GIL switch interval, lowered to this (seconds) when the transceiver starts; 0: left alone.
    # An engine thread running Python holds the GIL up to the interval each time the I/O thread gives it up
    # (every ZeroMQ or transport call): 5 ms by default, about 10 ms per one-block request (docs/engine-guide.md).
    gil_switch_interval_s: float = 0.0  # lower the process's GIL switch interval to this at start; 0: leave it

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first invalid field."""
        self._check_kinds()
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend must be a non-empty string, got {self.backend!r}")
        if not isinstance(self.agent_options, dict):
            raise ConfigError(f"agent_options must be a mapping, got {type(self.agent_options).__name__}")
        if not (0 <= int(self.port) <= 65535):
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if int(self.port_stride) < 1:
            raise ConfigError(f"port_stride must be >= 1, got {self.port_stride}")
        if not isinstance(self.ports, list) or not all(isinstance(p, int) and 0 < p <= 65535 for p in self.ports):
            raise ConfigError(f"ports must be a list of ports in 1..65535, got {self.ports!r}")
        if len(set(self.ports)) != len(self.ports):
            raise ConfigError(f"ports must not repeat a port, got {self.ports!r}")
        if self.ports and self.port and self.port != self.ports[0]:
            raise ConfigError(f"port ({self.port}) and ports[0] ({self.ports[0]}) disagree; set one of them")
        if self.advertise_host and not _ADVERTISE_RE.match(self.advertise_host):
            raise ConfigError(
                f"advertise_host must be a host name, an IPv4 or an IPv6 address, got {self.advertise_host!r}"
            )
        if self.advertise_host in ("0.0.0.0", "::", "[::]", "*"):
            raise ConfigError(
                f"advertise_host must be an address peers can dial, not the wildcard {self.advertise_host!r}"
            )
        for name in (
            "request_timeout_s",
            "first_contact_timeout_s",
            "transfer_timeout_s",
            "peer_lost_timeout_s",
            "fencing_grace_s",
            "refused_peer_ttl_s",
            "idle_peer_ttl_s",
            "quarantine_query_interval_s",
            "lease_s",
            "max_lease_s",
        ):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in (
            "max_message_bytes",
            "max_inflight_requests",
            "max_peers",
            "max_early_requests",
            "max_early_per_peer",
            "max_early_bytes",
            "max_tombstones",
            "max_peer_tombstones",
            "bounce_min_fragments",
            "bounce_max_fragment_bytes",
            "bounce_buffer_bytes",
        ):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if int(self.max_early_bytes_per_peer) < 0:
            raise ConfigError(
                "max_early_bytes_per_peer must be >= 0 (0: an eighth of max_early_bytes), "
                f"got {self.max_early_bytes_per_peer!r}"
            )
        if self.transfer_mode not in ("push", "pull"):
            raise ConfigError(f"transfer_mode must be 'push' or 'pull', got {self.transfer_mode!r}")
        if not 0 <= int(self.max_aux_bytes) <= MAX_AUX_BYTES:
            raise ConfigError(f"max_aux_bytes must be in 0..{MAX_AUX_BYTES}, got {self.max_aux_bytes!r}")
        if not 0.0 <= float(self.gil_switch_interval_s) <= MAX_GIL_SWITCH_INTERVAL_S:
            raise ConfigError(
                f"gil_switch_interval_s must be 0 (leave the interpreter's alone) or at most "
                f"{MAX_GIL_SWITCH_INTERVAL_S} s, got {self.gil_switch_interval_s!r}"
            )
        if float(self.max_lease_s) < float(self.lease_s):
            raise ConfigError(f"max_lease_s ({self.max_lease_s}) must be >= lease_s ({self.lease_s})")
        if self.auth_mode not in ("auto", "none"):
            raise ConfigError(f"auth_mode must be 'auto' or 'none', got {self.auth_mode!r}")
        if not isinstance(self.auth_allowed_keys, list):
            raise ConfigError(
                f"auth_allowed_keys must be a list of Z85 keys, got {type(self.auth_allowed_keys).__name__}"
            )
        from kvcore.hostinfo import is_loopback_host

        authenticated = bool(self.auth_key_file or self.auth_secret_key)
        if not is_loopback_host(str(self.host)) and not authenticated and not self.allow_insecure_bind:
            raise ConfigError(
                f"host {self.host!r} is not a loopback address and no authentication is configured: anyone who can "
                "reach the port could drive this rank. Set auth_key_file (see `kvcore keygen`, docs/security.md) "
                "or, on an isolated network, allow_insecure_bind=True (KVCORE_ALLOW_INSECURE_BIND=1)"
            )

    def _check_kinds(self) -> None:
        """Every boolean, integer and float field holds a value of its kind (``ConfigError`` naming it otherwise).

        Integers may be any integral type (numpy's too) and floats any real number; a bool is never taken for a
        number, and nothing else for a bool.
        """
        import numbers

        hints = _field_types()
        for f in dataclasses.fields(self):
            kind, value = hints[f.name], getattr(self, f.name)
            if kind is bool:
                ok, want = isinstance(value, bool), "true or false"
            elif kind is int:
                ok, want = isinstance(value, numbers.Integral) and not isinstance(value, bool), "an integer"
            elif kind is float:
                ok, want = isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"
            else:
                continue
            if not ok:
                raise ConfigError(f"{f.name} must be {want}, got {value!r} ({type(value).__name__})")

    def control_port(self, rank: int) -> int:
        """The control-plane port rank ``rank`` binds: ``ports[rank]``, else ``port + rank * port_stride``, else 0 (free)."""
        if self.ports:
            if not 0 <= rank < len(self.ports):
                raise ConfigError(f"ports lists {len(self.ports)} port(s); rank {rank} has none")
            return self.ports[rank]
        if not self.port:
            return 0
        port = self.port + rank * self.port_stride
        if port > 65535:
            raise ConfigError(f"rank {rank}: port {self.port} + {rank} * port_stride {self.port_stride} exceeds 65535")
        return port

    # --- loading -------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        file: str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> TransceiverConfig:
        """Build a config from defaults < ``file`` < ``KVCORE_*`` environment < keyword ``overrides``."""
        values: dict[str, Any] = {}
        env = os.environ if env is None else env
        if file is None and env.get("KVCORE_CONFIG"):
            file = env["KVCORE_CONFIG"]
        if file is not None:
            values.update(cls._read_file(Path(file)))
        values.update(cls._from_env(env))
        values.update(overrides)
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(
                f"unknown configuration field(s): {', '.join(sorted(unknown))}; "
                f"known: {', '.join(f.name for f in dataclasses.fields(cls))}"
            )
        return cls(**values)

    @classmethod
    def _read_file(cls, path: Path) -> dict[str, Any]:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read configuration file {str(path)!r}: {exc}") from exc
        try:
            if path.suffix == ".toml":
                import tomllib

                data: Any = tomllib.loads(text)
            elif path.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text) or {}
            else:
                raise ConfigError(f"configuration file {str(path)!r} must end in .toml, .yaml or .yml")
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"configuration file {str(path)!r} is not valid: {exc}") from exc
        if isinstance(data, dict) and isinstance(data.get("kvcore"), dict):
            data = data["kvcore"]  # allow a [kvcore] table / kvcore: section
        if not isinstance(data, dict):
            raise ConfigError(f"configuration file {str(path)!r} must hold a table of settings")
        return dict(data)

    @classmethod
    def _from_env(cls, env: Mapping[str, str]) -> dict[str, Any]:
        """The ``KVCORE_<FIELD>`` variables present, each converted to its field's declared type (kvcore.extension.convert)."""
        from kvcore.extension.convert import from_text

        types = typing.get_type_hints(cls)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = "KVCORE_" + f.name.upper()
            if key in env:
                out[f.name] = from_text(env[key], types[f.name], name=key)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_required_plugins(config: TransceiverConfig, pm: PluginManager) -> None:
    """Fail fast when a ``required_plugins`` entry (``"kvcore-nixl>=0.1"``) is missing or too old."""
    from packaging.requirements import Requirement

    from kvcore.extension.registry import PluginStatus

    for spec in config.required_plugins:
        req = Requirement(spec)
        rec = next((r for r in pm.records if r.dist and r.dist.replace("_", "-") == req.name.replace("_", "-")), None)
        if rec is None or rec.status is not PluginStatus.LOADED:
            state = "not installed" if rec is None else f"{rec.status}: {rec.error}"
            raise ConfigError(f"required plugin {spec!r} is {state}")
        if rec.version and req.specifier and rec.version not in req.specifier:
            raise ConfigError(f"required plugin {spec!r} but {rec.dist} {rec.version} is installed")


def resolve_backend(
    config: TransceiverConfig | str, pm: PluginManager | None = None
) -> tuple[str, type[TransferAgent]]:
    """The backend name and agent class the configuration selects.

    ``auto`` tries the agents whose plugins gave them an ``auto_priority``, highest first (the core names none).
    """
    from kvcore.extension.plugins import get_plugin_manager
    from kvcore.transport.agent import TransferAgent

    pm = pm or get_plugin_manager()
    name = config if isinstance(config, str) else config.backend
    if not isinstance(config, str):
        check_required_plugins(config, pm)
    registry = pm.registries.transfer_agents
    if name == "auto":
        failures = []
        candidates = registry.auto_candidates()
        if not candidates:
            raise UnknownBackendError(
                "backend 'auto' found no usable transfer agent: no installed plugin offers one for automatic "
                f"selection (registered: {', '.join(registry.names()) or 'none'}); name one with backend=..."
            )
        for candidate in candidates:
            try:
                cls = registry.get(candidate)
            except UnknownBackendError as exc:
                failures.append(f"{candidate}: {str(exc).splitlines()[0]}")
                continue
            log.info("backend 'auto' selected %r%s", candidate, f" (skipped {'; '.join(failures)})" if failures else "")
            return candidate, cls
        raise UnknownBackendError("backend 'auto' found no usable transfer agent:\n  " + "\n  ".join(failures))
    cls = registry.get(name)
    if not (isinstance(cls, type) and issubclass(cls, TransferAgent)):
        raise UnknownBackendError(f"transfer agent {name!r} resolves to {cls!r}, which is not a TransferAgent subclass")
    return name, cls


def create_agent(config: TransceiverConfig | str, agent_name: str, pm: PluginManager | None = None) -> TransferAgent:
    """Instantiate the selected transfer agent with the configuration's ``agent_options``."""
    _, cls = resolve_backend(config, pm)
    options = {} if isinstance(config, str) else config.agent_options
    return cls(agent_name, options)


def config_table() -> str:
    """``TransceiverConfig``'s fields as a Markdown table (field, environment variable, default, what it does).

    Built from the class itself (its defaults and the comments on its field lines), so the table in
    docs/engine-guide.md cannot drift: a test compares the two (regenerate it with ``python -c "from kvcore.config
    import config_table; print(config_table())"``).
    """
    import ast
    import inspect
    import io
    import tokenize

    source = inspect.getsource(TransceiverConfig)
    comments: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.setdefault(tok.start[0], []).append(tok.string.lstrip("#").strip())
    cls = ast.parse(source).body[0]
    assert isinstance(cls, ast.ClassDef)
    spans = {
        node.target.id: (node.lineno, node.end_lineno or node.lineno)
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    rows = ["| field | environment | default | what it does |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(TransceiverConfig):
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:  # pragma: no cover - every field has a default
            default = None
        first, last = spans[f.name]
        what = " ".join(c for line in range(first, last + 1) for c in comments.get(line, [])) or "—"
        what = what.replace("|", "\\|")
        rows.append(f"| `{f.name}` | `KVCORE_{f.name.upper()}` | `{default!r}` | {what} |")
    return "\n".join(rows) + "\n"
