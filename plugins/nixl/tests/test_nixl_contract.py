"""kvcore's transfer-agent contract suite, run against the installed ``nixl`` backend across two processes."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution

import pytest

try:
    distribution("kvcore-nixl")
except PackageNotFoundError:  # only an absent plugin skips; a broken NIXL install fails below
    pytest.skip("kvcore-nixl is not installed (pip install './plugins/nixl[cu12]')", allow_module_level=True)

from kvcore_nixl.agent import load_nixl

from kvcore.testing.contract import TransferAgentContract

load_nixl()  # a broken NIXL install fails every test here instead of skipping them


class TestNixlContract(TransferAgentContract):
    backend = "nixl"
