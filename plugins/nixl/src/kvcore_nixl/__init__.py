"""kvcore-nixl: the NIXL transfer agent for kvcore (backend name ``nixl``).

Importing this package imports neither nixl nor torch; the agent lives in
``kvcore_nixl.agent`` and is loaded only when the ``nixl`` backend is selected.
"""

from __future__ import annotations

from importlib import metadata as _metadata

try:  # the installed distribution's version: stated once, in pyproject.toml
    __version__ = _metadata.version("kvcore-nixl")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
__all__ = ["__version__"]
