"""kvcore's transfer-agent contract suite, run against the installed ``nixl`` backend across two processes."""

from __future__ import annotations

import pytest

pytest.importorskip("kvcore.testing.contract", reason="kvcore.testing (the contract suite) is not available")
from kvcore_nixl.agent import load_nixl

try:
    load_nixl()
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"nixl is not importable: {exc}", allow_module_level=True)

from kvcore.testing.contract import *  # noqa: F403

KVCORE_CONTRACT_BACKEND = "nixl"
KVCORE_CONTRACT_OPTIONS: dict[str, object] = {}
