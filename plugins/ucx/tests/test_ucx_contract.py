"""The kvcore transfer-agent contract suite against the ``ucx`` backend (two real processes, real UCX)."""

from __future__ import annotations

import pytest

from kvcore.testing.contract import *  # noqa: F403

try:
    from kvcore_ucx import _ucp

    _ucp.load()
except ImportError as exc:  # UcxUnavailableError is an ImportError
    pytest.skip(f"UCX libraries cannot be loaded: {exc}", allow_module_level=True)

KVCORE_CONTRACT_BACKEND = "ucx"
