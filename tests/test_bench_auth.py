"""``kvcore bench --auth``: the small case without and with CurveZMQ, one invocation, real rank processes.

Without authentication is a choice made explicitly (``KVCORE_AUTH_MODE=none``); by default the small case runs
with this user's local key.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import tempfile


def test_bench_auth_runs_small_with_and_without_curve_and_removes_the_keys() -> None:
    before = set(glob.glob(f"{tempfile.gettempdir()}/kvcore-demo-keys-*"))
    cmd = ["kvcore", "bench", "--backend", "shm", "--auth", "--cases", "small", "--json"]
    cmd += ["--small-requests", "20", "--latency-requests", "20"]
    env = {**os.environ, "KVCORE_AUTH_MODE": "none"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    result = json.loads(p.stdout)
    assert p.returncode == 0, p.stderr[-2000:]
    assert result["ok"] and result["spec"]["cases"] == ["small", "small_auth"]
    cases = result["backends"]["shm"]["cases"]
    assert cases["small"]["auth"] is False and cases["small"]["curve_ranks"] == 0
    assert cases["small_auth"]["auth"] is True and cases["small_auth"]["curve_ranks"] == 2
    for c in cases.values():
        assert c["verified"] and not c["not_done"] and not c["leaks"]
        assert c["latency"]["requests"] == 20 and c["latency"]["kvcore_ms_p99"] >= c["latency"]["kvcore_ms_p50"] > 0
    assert set(glob.glob(f"{tempfile.gettempdir()}/kvcore-demo-keys-*")) <= before
