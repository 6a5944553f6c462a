"""The ``kvcore`` command: ``plugins`` (table, ``--json``, ``--check``) and ``--version``, with a broken plugin installed."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcore.extension.plugins
from kvcore.tools.cli import main

GOOD = """
    from kvcore import hookimpl
    KVCORE_PLUGIN_API = 1

    @hookimpl
    def kvcore_register_transfer_agents(registry):
        registry.add("fakeagent", "kvcore.transport.builtin.shm:ShmAgent")
"""


def write_dist(root: Path, ep_name: str, source: str, dist: str) -> str:
    """A throw-away distribution ``dist`` 1.0 exposing ``ep_name`` in the kvcore group; returns its module name."""
    module = f"fake_kvcore_cli_{uuid.uuid4().hex[:8]}"
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[kvcore]\n{ep_name} = {module}\n")
    return module


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A tmp site with one good and one broken plugin (others installed are blocked by the allow-list)."""
    write_dist(tmp_path, "fakegood", GOOD, "fake-good")
    write_dist(tmp_path, "fakebroken", "import kvcore_missing_native_library\n", "fake-broken")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "fakegood,fakebroken")
    monkeypatch.delenv("KVCORE_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("KVCORE_STRICT_PLUGINS", raising=False)
    importlib.invalidate_caches()
    kvcore.extension.plugins.reset_plugin_manager()
    yield tmp_path
    kvcore.extension.plugins.reset_plugin_manager()


def run_kvcore(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The real console script, in a fresh process that sees the tmp site through PYTHONPATH."""
    exe = shutil.which("kvcore") or pytest.skip("the kvcore console script is not installed")
    full_env = {**os.environ, "PYTHONPATH": str(site), "KVCORE_PLUGINS": "fakegood,fakebroken", "COLUMNS": "200", **env}
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, env=full_env)


def test_plugins_json_in_process(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {n for n, r in records.items() if r["status"] != "blocked"} == {"builtin", "fakegood", "fakebroken"}
    assert records["fakegood"]["status"] == "loaded"
    assert records["fakegood"]["provides"] == {"transfer_agents": ["fakeagent"]}
    assert (records["fakegood"]["distribution"], records["fakegood"]["version"]) == ("fake-good", "1.0")
    assert records["fakebroken"]["status"] == "failed" and records["fakebroken"]["phase"] == "import"
    assert records["fakebroken"]["error"] == "ModuleNotFoundError: No module named 'kvcore_missing_native_library'"
    assert records["builtin"]["builtin"] is True and "shm" in records["builtin"]["provides"]["transfer_agents"]


def test_plugins_check_in_process(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--check", "--json"]) == 1
    assert capsys.readouterr().err.strip() == "1 plugin(s) broken: fakebroken"


def test_console_script_table_with_broken_plugin(site: Path) -> None:
    out = run_kvcore(site, "plugins")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    for text in (
        "fakegood",
        "fake-good",
        "loaded",
        "fakeagent",
        "fakebroken",
        "failed",
        "kvcore_missing_native_library",
    ):
        assert text in out.stdout, f"{text!r} missing from:\n{out.stdout}"
    assert "shm" in out.stdout  # the built-in is listed too


def test_console_script_json_and_check(site: Path) -> None:
    out = run_kvcore(site, "plugins", "--json")
    assert out.returncode == 0, out.stderr
    statuses = {r["name"]: r["status"] for r in json.loads(out.stdout) if r["status"] != "blocked"}
    assert statuses == {"builtin": "loaded", "fakegood": "loaded", "fakebroken": "failed"}
    check = run_kvcore(site, "plugins", "--check")
    assert check.returncode == 1 and "1 plugin(s) broken: fakebroken" in check.stderr


def test_console_script_allow_list_empty_hides_external(site: Path) -> None:
    out = run_kvcore(site, "plugins", "--json", KVCORE_PLUGINS="")
    statuses = {r["name"]: r["status"] for r in json.loads(out.stdout)}
    assert statuses == {"builtin": "loaded", **{r: "blocked" for r in statuses if r != "builtin"}}
    assert run_kvcore(site, "plugins", "--check", KVCORE_PLUGINS="").returncode == 0


def test_version(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"kvcore {kvcore.__version__}"
    assert "  fakegood: fake-good 1.0 (loaded)" in lines
    assert "  fakebroken: fake-broken 1.0 (failed)" in lines


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "plugins" in capsys.readouterr().out


def test_python_dash_m(site: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(site), "KVCORE_PLUGINS": ""}
    out = subprocess.run(
        [sys.executable, "-m", "kvcore", "plugins", "--json"], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert [r["name"] for r in json.loads(out.stdout) if r["status"] == "loaded"] == ["builtin"]
