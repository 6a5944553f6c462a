"""Run kvcore's transfer-agent contract suite against the installed ``cma`` backend."""

from importlib.metadata import PackageNotFoundError, distribution

import pytest

try:
    distribution("kvcore-cma")
except PackageNotFoundError:  # only an absent example skips; a broken install fails
    pytest.skip("install the example first: pip install ./docs/examples/kvcore-cma", allow_module_level=True)

from kvcore.testing.contract import TransferAgentContract


class TestCmaContract(TransferAgentContract):
    backend = "cma"
