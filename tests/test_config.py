"""Configuration: defaults < file (TOML or YAML) < KVCORE_* environment < keyword arguments; validation errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.config import TransceiverConfig, check_required_plugins
from kvcore.errors import ConfigError
from kvcore.extension.plugins import make_plugin_manager


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture(params=["toml", "yaml"])
def config_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "toml":
        return write(
            tmp_path / "kv.toml",
            '[kvcore]\nbackend = "nixl"\nport = 5000\ntransfer_timeout_s = 3.5\nagent_options = { threads = 2 }\n',
        )
    return write(
        tmp_path / "kv.yaml",
        "kvcore:\n  backend: nixl\n  port: 5000\n  transfer_timeout_s: 3.5\n  agent_options:\n    threads: 2\n",
    )


def test_defaults() -> None:
    cfg = TransceiverConfig.load(env={})
    assert cfg == TransceiverConfig()
    assert (cfg.backend, cfg.host, cfg.port) == ("auto", "127.0.0.1", 0)


def test_file(config_file: Path) -> None:
    cfg = TransceiverConfig.load(config_file, env={})
    assert (cfg.backend, cfg.port, cfg.transfer_timeout_s, cfg.agent_options) == ("nixl", 5000, 3.5, {"threads": 2})


def test_env_beats_file_and_kwargs_beat_env(config_file: Path) -> None:
    env = {"KVCORE_BACKEND": "ucx", "KVCORE_PORT": "6000", "KVCORE_AGENT_OPTIONS": '{"threads": 4}'}
    cfg = TransceiverConfig.load(config_file, env=env)
    assert (cfg.backend, cfg.port, cfg.agent_options, cfg.transfer_timeout_s) == ("ucx", 6000, {"threads": 4}, 3.5)
    cfg = TransceiverConfig.load(config_file, env=env, backend="shm")
    assert (cfg.backend, cfg.port) == ("shm", 6000)


def test_config_file_from_env(config_file: Path) -> None:
    assert TransceiverConfig.load(env={"KVCORE_CONFIG": str(config_file)}).backend == "nixl"


def test_flat_file_without_section(tmp_path: Path) -> None:
    assert TransceiverConfig.load(write(tmp_path / "c.yml", "backend: shm\n"), env={}).backend == "shm"


def test_env_types() -> None:
    env = {
        "KVCORE_REQUEST_TIMEOUT_S": "2.5",
        "KVCORE_MAX_INFLIGHT_REQUESTS": "12",
        "KVCORE_BOUNCE_ENABLED": "no",
        "KVCORE_REQUIRED_PLUGINS": "kvcore-nixl>=0.1, kvcore-ucx",
    }
    cfg = TransceiverConfig.load(env=env)
    assert cfg.request_timeout_s == 2.5 and cfg.max_inflight_requests == 12 and cfg.bounce_enabled is False
    assert cfg.required_plugins == ["kvcore-nixl>=0.1", "kvcore-ucx"]


def test_bad_env_value_names_variable() -> None:
    with pytest.raises(ConfigError, match=r"KVCORE_PORT='eighty' is not a valid int"):
        TransceiverConfig.load(env={"KVCORE_PORT": "eighty"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": ""}, "backend must be a non-empty string, got ''"),
        ({"port": 70000}, "port must be in 0..65535, got 70000"),
        ({"transfer_timeout_s": 0}, "transfer_timeout_s must be > 0, got 0"),
        ({"max_message_bytes": -1}, "max_message_bytes must be > 0, got -1"),
        ({"agent_options": []}, "agent_options must be a mapping, got list"),
        ({"port": "5600"}, "port must be an integer, got '5600' (str)"),
        ({"max_peers": True}, "max_peers must be an integer, got True (bool)"),
        ({"lease_s": "60"}, "lease_s must be a number, got '60' (str)"),
        ({"gil_switch_interval_s": None}, "gil_switch_interval_s must be a number, got None (NoneType)"),
        ({"require_tickets": 1}, "require_tickets must be true or false, got 1 (int)"),
        (
            {"gil_switch_interval_s": -0.001},
            "gil_switch_interval_s must be 0 (leave the interpreter's alone) or at most 0.1 s, got -0.001",
        ),
        (
            {"gil_switch_interval_s": 0.5},
            "gil_switch_interval_s must be 0 (leave the interpreter's alone) or at most 0.1 s, got 0.5",
        ),
    ],
)
def test_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        TransceiverConfig(**kwargs)  # type: ignore[arg-type]
    assert str(exc.value) == message


def test_unknown_field_lists_known(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown configuration field\(s\): bakend; known: backend, "):
        TransceiverConfig.load(write(tmp_path / "c.toml", 'bakend = "shm"\n'), env={})


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("c.toml", "backend = ", "is not valid"),
        ("c.yaml", "backend: [", "is not valid"),
        ("c.yaml", "- a list\n", "must hold a table of settings"),
        ("c.json", "{}", "must end in .toml, .yaml or .yml"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TransceiverConfig.load(write(tmp_path / name, text), env={})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read configuration file"):
        TransceiverConfig.load(tmp_path / "nope.toml", env={})


def test_required_plugins() -> None:
    pm = make_plugin_manager(load_entry_points=False, env={})
    check_required_plugins(TransceiverConfig(required_plugins=["kvcore>=0.1"]), pm)  # the built-in record
    with pytest.raises(ConfigError, match=r"required plugin 'kvcore>=99' but kvcore .* is installed"):
        check_required_plugins(TransceiverConfig(required_plugins=["kvcore>=99"]), pm)
    with pytest.raises(ConfigError, match="required plugin 'kvcore-nothing' is not installed"):
        check_required_plugins(TransceiverConfig(required_plugins=["kvcore-nothing"]), pm)


# --- text conversion (kvcore.extension.convert): one place for every KVCORE_* value ---------------------------


def test_env_values_convert_by_declared_type() -> None:
    cfg = TransceiverConfig.load(
        env={
            "KVCORE_PORTS": "7001, 7002",
            "KVCORE_ALLOW_INSECURE_BIND": "on",
            "KVCORE_AUTH_ALLOWED_KEYS": "a,b",
            "KVCORE_AGENT_OPTIONS": '{"x": [1, 2]}',
        }
    )
    assert cfg.ports == [7001, 7002] and cfg.allow_insecure_bind is True
    assert cfg.auth_allowed_keys == ["a", "b"] and cfg.agent_options == {"x": [1, 2]}


def test_env_boolean_that_is_no_boolean_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"KVCORE_BOUNCE_ENABLED='maybe' is not a boolean"):
        TransceiverConfig.load(env={"KVCORE_BOUNCE_ENABLED": "maybe"})


def test_env_json_that_is_no_object_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"KVCORE_AGENT_OPTIONS='\[1\]' is not a JSON object"):
        TransceiverConfig.load(env={"KVCORE_AGENT_OPTIONS": "[1]"})


def test_plugin_switches_use_the_same_words() -> None:
    from kvcore.extension.plugins import make_plugin_manager

    assert make_plugin_manager(load_entry_points=False, env={"KVCORE_STRICT_PLUGINS": "yes"}).strict is True
    assert make_plugin_manager(load_entry_points=False, env={"KVCORE_STRICT_PLUGINS": "off"}).strict is False
    with pytest.raises(ConfigError, match="KVCORE_STRICT_PLUGINS='sometimes' is not a boolean"):
        make_plugin_manager(load_entry_points=False, env={"KVCORE_STRICT_PLUGINS": "sometimes"})


def test_gil_switch_interval_is_lowered_by_a_transceiver_never_raised() -> None:
    """``gil_switch_interval_s`` lowers the process's switch interval when a transceiver starts; a lower one set
    by the engine stays; 0 leaves it alone; the environment variable reaches it."""
    import sys

    from kvcore.transceiver.facade import lower_switch_interval

    assert TransceiverConfig.load(env={"KVCORE_GIL_SWITCH_INTERVAL_S": "0.0005"}).gil_switch_interval_s == 0.0005
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert lower_switch_interval(0.0) == 0.005  # 0: left alone
        assert lower_switch_interval(0.002) == pytest.approx(0.002)
        assert lower_switch_interval(0.004) == pytest.approx(0.002)  # never raised
        sys.setswitchinterval(0.005)
        from _faults import RankGroup

        group = RankGroup.build("context", gil_switch_interval_s=0.0007)
        try:
            assert sys.getswitchinterval() == pytest.approx(0.0007)
        finally:
            group.close()
        group = RankGroup.build("context")  # the default: nothing changes
        try:
            assert sys.getswitchinterval() == pytest.approx(0.0007)
        finally:
            group.close()
    finally:
        sys.setswitchinterval(before)


def test_numbers_of_any_numeric_type_are_accepted() -> None:
    """numpy integers and floats, and ints for float fields, are numbers like any other."""
    import numpy as np

    cfg = TransceiverConfig(port=np.int64(5600), lease_s=30, request_timeout_s=np.float32(5.0))
    assert cfg.control_port(1) == 5601 and cfg.lease_s == 30
