"""kvcore-mpi: the MPI transfer agent for kvcore (MPI-3 RMA between processes joined by connect/accept).

Importing this package loads nothing native; ``kvcore_mpi.agent`` initializes MPI on first use of ``MpiAgent``.
"""

from __future__ import annotations

from importlib import metadata as _metadata

__all__ = ["__version__"]

try:  # the installed distribution's version: stated once, in pyproject.toml
    __version__ = _metadata.version("kvcore-mpi")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
