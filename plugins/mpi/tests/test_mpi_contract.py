"""The kvcore transfer-agent contract suite against the ``mpi`` backend (two real processes, real MPICH)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution

import pytest

try:
    distribution("kvcore-mpi")
except PackageNotFoundError:  # only an absent plugin skips; a broken MPI install fails below
    pytest.skip("kvcore-mpi is not installed (pip install ./plugins/mpi)", allow_module_level=True)

from kvcore_mpi._bootstrap import mpi

from kvcore.testing.contract import TransferAgentContract

mpi()  # a broken MPI install fails every test here instead of skipping them


class TestMpiContract(TransferAgentContract):
    backend = "mpi"
