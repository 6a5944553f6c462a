"""The kvcore transfer-agent contract suite against the ``mooncake`` backend (two real processes, real engines)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution

import pytest

try:
    distribution("kvcore-mooncake")
except PackageNotFoundError:  # only an absent plugin skips; a broken Mooncake install fails below
    pytest.skip(
        "kvcore-mooncake is not installed (make install, or pip install ./plugins/mooncake)", allow_module_level=True
    )

import kvcore_mooncake.plugin  # noqa: F401  (missing system libraries fail every test here instead of skipping)

from kvcore.testing.contract import TransferAgentContract


class TestMooncakeContract(TransferAgentContract):
    backend = "mooncake"
