"""``kvcore bench --cases modes``: push and pull in the same run, every byte verified, both modes timed.

The assertions are on the shape of the result and on verification, never on durations.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_modes_case_times_push_and_pull_and_verifies_both() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcore",
            "bench",
            "--json",
            "--backend",
            "shm",
            "--cases",
            "modes",
            "--tokens",
            "256",
            "--iterations",
            "2",
            "--latency-requests",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    case = result["backends"]["shm"]["cases"]["modes"]
    assert case["verified"] is True
    for label in ("big", "one_block"):
        r = case[label]
        assert r["verified"] and r["pool_verified"] and r["leaks"] == {}
        for mode in ("push", "pull"):
            assert r[mode]["ms_median"] > 0 and r[mode]["gbps_median"] > 0
        assert r["pull_vs_push_time"] > 0
    assert case["big"]["bytes"] > case["one_block"]["bytes"]
