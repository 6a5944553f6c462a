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


def _keydirs() -> set[str]:
    import glob
    import tempfile

    return set(glob.glob(f"{tempfile.gettempdir()}/kvcore-demo-keys-*"))


def test_demo_cli_auth_verifies_every_byte_and_removes_the_keys() -> None:
    before = _keydirs()
    cmd = ["kvcore", "demo", "--auth", "--backend", "shm", "--json", "--ctx-tp", "2", "--gen-tp", "2", *SMALL]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    summary = json.loads(p.stdout)
    assert p.returncode == 0, p.stderr[-2000:]
    assert summary["ok"] and summary["spec"]["auth"]
    assert summary["auth_ranks"] == summary["processes"] == 4  # every rank served and connected with CURVE
    assert summary["mismatches"] == 0 and summary["bytes"] > 0 and summary["not_done"] == 0
    assert _keydirs() <= before  # the temporary key directory is gone


def test_demo_cli_auth_table_says_authentication_was_on() -> None:
    p = subprocess.run(
        ["kvcore", "demo", "--auth", "--backend", "shm", *SMALL], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "every byte verified" in p.stdout and "CurveZMQ" in p.stdout


def test_demo_cli_two_hosts_refuses_shm_clearly() -> None:
    p = subprocess.run(
        ["kvcore", "demo", "--two-hosts", "--backend", "shm", *SMALL], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    assert "--two-hosts needs a network transport" in p.stderr and "shm agent only reaches" in p.stderr


def test_demo_cli_two_hosts_without_namespaces_says_why() -> None:
    """As an unprivileged user (setpriv to nobody) namespaces cannot be made: one clear line, no traceback."""
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the CLI as an unprivileged user")
    kvcore_cli = shutil.which("kvcore")
    assert kvcore_cli is not None
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", kvcore_cli]
    probe = subprocess.run([*as_nobody, "--version"], capture_output=True, text=True, timeout=120, cwd="/")
    if probe.returncode != 0:  # e.g. Python installed under /root (mode 0700): nobody cannot even start it
        pytest.skip(f"uid nobody cannot run {kvcore_cli} here: {probe.stderr.strip()[:200]}")
    cmd = [*as_nobody, "demo", "--two-hosts"]
    p = subprocess.run([*cmd, "--backend", "nixl", *SMALL], capture_output=True, text=True, timeout=300, cwd="/")
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    assert "cannot build namespaced hosts here" in p.stderr and "root" in p.stderr, p.stderr


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_demo_cli_two_hosts_verifies_every_byte(backend: str) -> None:
    from kvcore.runtime.hosts import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    if not _installed(backend):
        pytest.skip(f"transfer agent {backend!r} is not installed (pip install ./plugins/{backend})")
    cmd = ["kvcore", "demo", "--two-hosts", "--backend", backend, "--json", "--ctx-tp", "1", "--gen-tp", "1", *SMALL]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    summary = json.loads(p.stdout)
    assert p.returncode == 0, p.stderr[-2000:]
    assert summary["ok"] and summary["backend"] == backend
    assert "198.18.0.1" in summary["hosts"] and "198.18.0.2" in summary["hosts"]
    # 6 requests x 4 layers x K,V x 4 heads x 48 tokens x 32 dims x 2 bytes, every one compared with the oracle
    assert summary["bytes"] == 6 * 4 * 2 * 4 * 48 * 32 * 2 and summary["mismatches"] == 0
    assert summary["not_done"] == 0 and summary["gbps"] > 0 and not summary["leaks"]


def test_two_hosts_spec_refuses_what_the_host_ranks_cannot_do() -> None:
    from kvcore.tools.demo import DemoSpec
    from kvcore.tools.demo.two_hosts import validate_two_hosts

    for field, value in (("mamba", True), ("layerwise", True), ("cached_prefix_blocks", 1)):
        with pytest.raises(ValueError, match=field):
            validate_two_hosts(DemoSpec(two_hosts=True, backend="nixl", **{field: value}))
    with pytest.raises(ValueError, match="network transport"):
        validate_two_hosts(DemoSpec(two_hosts=True, backend="shm"))


def test_demo_block_order_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """``--block-order`` sets DemoSpec.block_order; the spelling never released (``--layout``) is not an option."""
    from kvcore.tools.cli import build_parser

    args = build_parser().parse_args(["demo", "--block-order", "token_major"])
    assert args.block_order == "token_major"
    assert capsys.readouterr().err == ""
    assert build_parser().parse_args(["demo"]).block_order == "head_major"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--layout", "token_major"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--block-order", "diagonal"])
    with pytest.raises(ValueError, match="block_order: expected 'head_major' or 'token_major', got 'diagonal'"):
        from kvcore.tools.demo import DemoSpec

        DemoSpec(block_order="diagonal").validate()


def test_demo_cli_runs_token_major() -> None:
    """``--block-order token_major`` end to end: the real console script moves and verifies a token-major run."""
    cmd = ["kvcore", "demo", "--backend", "shm", "--json", "--block-order", "token_major", *SMALL]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads(p.stdout)
    assert summary["ok"] and summary["spec"]["block_order"] == "token_major" and summary["mismatches"] == 0
