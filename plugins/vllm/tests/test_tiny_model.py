"""``python -m kvcore_vllm.tiny_model [--large] DIR`` writes a model folder that ``vllm serve --model DIR`` takes.

It runs as a user runs it, in a subprocess; the model is made with ``transformers``, so without it there is nothing
to test (skipped).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvcore_vllm.tiny_model import LARGE_MODEL, MODEL

pytest.importorskip("transformers", reason="the tiny model is made with transformers")


def make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcore_vllm.tiny_model", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(("flags", "shape"), [((), MODEL), (("--large",), LARGE_MODEL)], ids=["tiny", "large"])
def test_the_command_writes_a_model_folder_and_prints_its_path(
    tmp_path: Path, flags: tuple[str, ...], shape: dict[str, int]
) -> None:
    folder = tmp_path / "new" / "model"  # a folder that does not exist yet, parents included

    done = make(*flags, str(folder))

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(folder.resolve())
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {key: config[key] for key in shape} == shape
    assert (folder / "model.safetensors").stat().st_size > 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), f"{name} missing from {sorted(p.name for p in folder.iterdir())}"


def test_the_command_without_a_folder_is_a_usage_error() -> None:
    done = make()

    assert done.returncode == 2
    assert "DIR" in done.stderr
