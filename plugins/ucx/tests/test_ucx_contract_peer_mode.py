"""The kvcore contract suite against ``ucx`` with UCX peer-failure handling (``error_handling="peer"``: TCP lanes)."""

from __future__ import annotations

import pytest

from kvcore.testing.contract import *  # noqa: F403

try:
    from kvcore_ucx import _ucp

    _ucp.load()
except ImportError as exc:  # UcxUnavailableError is an ImportError
    pytest.skip(f"UCX libraries cannot be loaded: {exc}", allow_module_level=True)

KVCORE_CONTRACT_BACKEND = "ucx"
KVCORE_CONTRACT_OPTIONS = {"error_handling": "peer"}
