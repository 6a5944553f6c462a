"""The kvcore transfer-agent contract suite against the ``ucx`` backend (two real processes, real UCX)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution

import pytest

try:
    distribution("kvcore-ucx")
except PackageNotFoundError:  # only an absent plugin skips; a broken UCX install fails below
    pytest.skip("kvcore-ucx is not installed (pip install ./plugins/ucx)", allow_module_level=True)

from kvcore_ucx import _ucp

from kvcore.testing.contract import TransferAgentContract

_ucp.load()  # a broken UCX install fails every test here instead of skipping them


class TestUcxContract(TransferAgentContract):
    backend = "ucx"
