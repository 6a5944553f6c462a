"""`kvcore demo` as a person runs it: the real console script, separate processes, every byte verified."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SMALL = [
    "--requests",
    "6",
    "--tokens",
    "48",
    "--layers",
    "4",
    "--kv-heads",
    "4",
    "--head-dim",
    "32",
    "--tokens-per-block",
    "8",
    "--timeout",
    "60",
]


def _installed(backend: str) -> bool:
    """The plugin distribution is installed (then a broken native library fails the test instead of skipping it)."""
    from importlib.metadata import PackageNotFoundError, distribution

    if backend == "shm":
        return True
    try:
        distribution(f"kvcore-{backend}")
    except PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize("backend", ["shm", "nixl", "ucx"])
def test_demo_cli_json(backend: str) -> None:
    if not _installed(backend):
        pytest.skip(f"transfer agent {backend!r} is not installed (pip install ./plugins/{backend})")
    cmd = ["kvcore", "demo", "--backend", backend, "--json", "--ctx-tp", "2", "--gen-tp", "4", *SMALL]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    summary = json.loads(p.stdout)  # stdout is JSON only, even with native libraries logging
    assert p.returncode == 0, p.stderr[-2000:]
    assert summary["ok"] and summary["backend"] == backend
    assert summary["mismatches"] == 0 and summary["bytes"] > 0 and summary["not_done"] == 0


def test_demo_module_entry_point_and_table() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "kvcore", "demo", "--backend", "shm", *SMALL],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "every byte verified" in p.stdout


def test_demo_unknown_backend_fails_clearly() -> None:
    p = subprocess.run(
        ["kvcore", "demo", "--backend", "nope", "--json", *SMALL], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 1
    out = json.loads(p.stdout)
    assert not out["ok"] and "'nope' is not available" in out["error"]
