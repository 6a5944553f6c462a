"""docs/examples/two_ranks.py runs as a user runs it, and its output proves the bytes moved and were checked."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "two_ranks.py"
#: One block of the example's cache: 4 layers x (K, V) x 2 heads x 16 tokens x 64 dims of float16.
BLOCK_BYTES = 4 * 2 * 2 * 16 * 64 * 2


def _run(path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_the_two_rank_example_moves_the_request_and_checks_every_byte(tmp_path: Path) -> None:
    run = _run(EXAMPLE, tmp_path)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    # Computed here from the example's stated pattern, not taken from its output: source blocks 3, 1, 4.
    want = b"".join(
        ((np.arange(BLOCK_BYTES, dtype=np.int64) * 7 + b * 31) % 251).astype(np.uint8).tobytes() for b in (3, 1, 4)
    )
    m = re.search(r"received 3 blocks, (\d+) bytes, sha256 ([0-9a-f]{64})", out)
    assert m, out
    assert int(m.group(1)) == len(want) == 3 * BLOCK_BYTES
    assert m.group(2) == hashlib.sha256(want).hexdigest(), "the generation rank holds other bytes than were sent"
    assert f"request 7 DONE, transceiver counted {len(want)} bytes" in out
    assert f"verified: all {8 * BLOCK_BYTES} bytes of the generation cache match" in out
    assert "two ranks: OK" in out
    assert "context: request 7 DONE" in run.stderr


def test_the_example_fails_when_the_bytes_differ_from_its_expectation(tmp_path: Path) -> None:
    """The example's check is not vacuous: expecting other bytes than the context sends makes it exit non-zero."""
    source = EXAMPLE.read_text()
    wrong = "expected[dst] = pattern(src + 1, got.shape[1])"
    assert source.count("expected[dst] = pattern(src, got.shape[1])") == 1
    copy = tmp_path / "two_ranks.py"
    copy.write_text(source.replace("expected[dst] = pattern(src, got.shape[1])", wrong))
    run = _run(copy, tmp_path)
    assert run.returncode != 0
    assert "MISMATCH" in run.stdout and "two ranks: FAILED" in run.stdout, run.stdout + run.stderr
