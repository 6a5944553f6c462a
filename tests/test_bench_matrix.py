"""``kvcore bench --matrix --quick``, ``--plot`` and the progress bar: real rank processes, tiny sizes.

Assertions are on the result's shape and on byte verification, never on GB/s (shared, noisy machines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.tools.bench import BenchError, BenchProgress, BenchSpec, matrix_cells, plot_result, run_bench


def _plot_args(png: Path) -> list[str]:
    return ["--plot", str(png), "--timeout", "60"]


class RecordingProgress(BenchProgress):
    """The real progress bar, also remembering what it was told."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.advanced = 0
        self.messages: list[str] = []

    def start(self, total: int) -> None:
        self.total = total
        super().start(total)

    def say(self, message: str) -> None:
        self.messages.append(message)
        super().say(message)

    def advance(self, n: int = 1) -> None:
        self.advanced += n
        super().advance(n)


@pytest.mark.timeout(180)
def test_cli_quick_matrix_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcore",
            "bench",
            "--json",
            "--backend",
            "shm",
            "--matrix",
            "--quick",
            *_plot_args(png),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "━" not in proc.stderr  # --json: no progress bar
    result = json.loads(proc.stdout)
    matrix = result["backends"]["shm"]["cases"]["matrix"]
    spec = BenchSpec().quick_matrix()
    assert matrix["model"]["layers"] == 2 and matrix["model"]["block_bytes"] == spec.matrix_block_bytes()
    cells = matrix["cells"]
    # 2 request sizes x 3 fragment sizes x (agent, memcpy, memcpy_scattered, kvcore x1, kvcore x4)
    assert len(cells) == 2 * 3 * 5
    per_token = matrix["model"]["bytes_per_token"]
    for c in cells:
        assert c["verified"] is True, c
        assert c["request_bytes"] == c["request_tokens"] * per_token
        assert c["fragments"] * c["fragment_bytes"] == c["request_bytes"]
        assert c["gbps_median"] > 0 and len(c["times_ms"]) == spec.matrix_iterations
    assert {c["fragment_bytes"] for c in cells} == {4096, 16384, matrix["model"]["block_bytes"]}
    assert {(c["mode"], c["inflight"]) for c in cells} == {
        ("agent", 1),
        ("memcpy", 1),
        ("memcpy_scattered", 1),
        ("kvcore", 1),
        ("kvcore", 4),
    }
    assert matrix["leaks"] == {} and matrix["verified"] is True
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.timeout(120)
def test_progress_advances_to_its_total_and_plot_reads_the_transfer_cases(tmp_path: Path) -> None:
    spec = BenchSpec(
        backends=["shm"], cases=["frag16k", "small"], fragments=8, iterations=2, small_requests=8, latency_requests=4
    )
    progress = RecordingProgress()
    result = run_bench(spec, progress=progress)
    assert result["ok"] is True
    assert progress.total == (spec.iterations + 1) + 1  # frag16k: one unit per round; small: one unit
    assert progress.advanced == progress.total
    assert any("frag16k" in m for m in progress.messages)
    png = tmp_path / "cases.png"
    plot_result(result, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_matrix_cells_skip_what_exceeds_the_byte_bound_but_keep_single_requests() -> None:
    spec = BenchSpec(matrix_tokens=[32, 4096], matrix_fragment_bytes=[4096, 0], matrix_inflight=[1, 64])
    block = spec.matrix_block_bytes()
    assert block == 80 * 2 * 8 * 32 * 128 * 2  # one 32-token block of Llama-3-70B, K and V: 10 MiB
    cells = matrix_cells(spec)
    assert (4096, 32, 64) in cells  # 64 x 10 MiB fits in 4 GiB
    assert (4096, 4096, 64) not in cells  # 64 x 1.25 GiB does not
    assert (block, 4096, 1) in cells  # a single request always runs


def test_bad_matrix_and_plot_arguments_are_refused() -> None:
    with pytest.raises(BenchError, match="matrix_fragment_bytes"):
        BenchSpec(matrix_fragment_bytes=[1000]).validate()
    with pytest.raises(BenchError, match="matrix_inflight"):
        BenchSpec(matrix_inflight=[]).validate()
    proc = subprocess.run(
        [sys.executable, "-m", "kvcore", "bench", "--matrix", "--quick", "--plot", "out.txt"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "--plot: expected a .png file name" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "kvcore", "bench", "--matrix", "--matrix-tokens", "32,x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "--matrix-tokens: expected comma-separated integers" in proc.stderr
