"""Files of shm agents killed without closing are removed; a live agent's files are never touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from kvcore.builtin.shm import SHM_DIR, ShmAgent, sweep_dead_segments

_CHILD = """
import os, sys, torch
from kvcore.builtin.shm import ShmAgent
a = ShmAgent("doomed")
a.allocate_tensor((1 << 16,), torch.uint8)
print(a._prefix, flush=True)
sys.stdin.read()  # wait to be killed
"""


def _files(prefix: str) -> list[str]:
    return [os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR) if n.startswith(prefix)]


def _age(paths: list[str], seconds: float) -> None:
    t = time.time() - seconds
    for p in paths:
        os.utime(p, (t, t))


def test_sweep_removes_a_killed_agents_files_and_keeps_live_ones() -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    live = ShmAgent("alive")
    try:
        live.allocate_tensor((1 << 16,), torch.uint8)
        dead_prefix = child.stdout.readline().strip()  # type: ignore[union-attr]
        assert dead_prefix.startswith("kvcore-shm-")
        child.kill()
        child.wait(10)
        dead = _files(dead_prefix)
        alive = _files(live._prefix)
        assert len(dead) >= 2 and len(alive) >= 2  # control block + segment each
        first = sweep_dead_segments()  # too young: an agent may be between create and lock
        assert not set(first) & set(dead + alive)
        _age(dead + alive, 120)
        removed = sweep_dead_segments()  # other dead agents' old files may go too; these must
        assert set(dead) <= set(removed) and not set(alive) & set(removed)
        assert _files(dead_prefix) == []
        assert sorted(_files(live._prefix)) == sorted(alive)  # its owner holds the lock
    finally:
        if child.poll() is None:
            child.kill()
        live.close()
    assert _files(live._prefix) == []
