"""``kvcore bench --cases soak`` (issue 9's soak, small): real rank processes, random cancels from both sides.

Every request must be reported exactly once and released on both sides, DONE requests must hold the
bytes of their source block, and both transceivers' live counts must be back to zero afterwards. The
assertions are on those promises, never on durations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcore.tools.bench import BenchError, BenchSpec

REQUESTS, INFLIGHT = 200, 32


@pytest.mark.timeout(240)
def test_soak_every_request_terminal_and_released_on_both_sides_nothing_leaks() -> None:
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
            "soak",
            "--requests",
            str(REQUESTS),
            "--inflight",
            str(INFLIGHT),
            "--cancel-rate",
            "0.2",
            "--soak-request-timeout",
            "5",
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=230,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    result = json.loads(proc.stdout)
    entry = result["backends"]["shm"]
    assert entry.get("error") is None, entry.get("error")
    soak = entry["cases"]["soak"]
    assert soak["requests"] == REQUESTS and soak["inflight"] == INFLIGHT
    for side in ("context", "generation"):
        s = soak[side]
        report = f"{side}: outcomes {s['outcomes']}, errors {s['errors']}, unreleased {s['unreleased_ids']}"
        assert s["started"] == REQUESTS, report
        assert s["duplicate_outcomes"] == 0 and s["released_before_outcome"] == 0, report
        assert sum(s["outcomes"].values()) == REQUESTS, report  # each reported exactly once
        assert s["unreleased"] == 0, report  # ... and released
        assert set(s["outcomes"]) <= {"DONE", "CANCELLED"}, report  # nothing waits for a timeout
        assert s["byte_mismatches"] == 0, report
        assert s["leaks"] == {}, f"{side} leaks {s['leaks']} ({report})"
        assert s["latency_ms"]["p50"] is not None and s["latency_ms"]["p50"] <= s["latency_ms"]["p99"]
    # both sides agree on which requests completed, up to cancels racing with the completion
    assert soak["generation"]["outcomes"].get("DONE", 0) >= REQUESTS * 0.6
    assert soak["leaks"] == {} and soak["pool_verified"] is True
    assert all(all(p.values()) for p in soak["promises"].values()), soak["promises"]
    assert soak["verified"] is True and entry["ok"] is True
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_soak_spec_refuses_bad_values() -> None:
    with pytest.raises(BenchError, match="cancel_rate"):
        BenchSpec(cases=["soak"], cancel_rate=1.5).validate()
    with pytest.raises(BenchError, match="inflight"):
        BenchSpec(cases=["soak"], inflight=0).validate()
    with pytest.raises(BenchError, match="requests"):
        BenchSpec(cases=["soak"], requests=0).validate()
