"""kvcore-ucx: the UCX transfer agent for kvcore (one-sided RMA over UCX through cffi).

Importing this package loads nothing native; ``kvcore_ucx.agent`` loads UCX on
first use of ``UcxAgent``.
"""

from __future__ import annotations

from importlib import metadata as _metadata

__all__ = ["__version__"]

try:  # the installed distribution's version: stated once, in pyproject.toml
    __version__ = _metadata.version("kvcore-ucx")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
