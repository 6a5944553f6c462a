"""kvcore-mooncake: Mooncake's transfer engine as a kvcore transfer agent (``backend="mooncake"``).

Importing this package loads nothing native; ``kvcore_mooncake.agent`` imports ``mooncake.engine`` on first use
of ``MooncakeAgent``.
"""

from __future__ import annotations

from importlib import metadata as _metadata

__all__ = ["__version__"]

try:  # the installed distribution's version: stated once, in pyproject.toml
    __version__ = _metadata.version("kvcore-mooncake")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
