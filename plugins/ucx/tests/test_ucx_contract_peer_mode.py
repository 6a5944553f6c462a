"""The kvcore contract suite against ``ucx`` with UCX peer-failure handling (``error_handling="peer"``: TCP lanes)."""

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


class TestUcxContractPeerMode(TransferAgentContract):
    backend = "ucx"
    agent_options = {"error_handling": "peer"}
