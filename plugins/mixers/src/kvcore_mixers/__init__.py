"""kvcore-mixers: layout mappers that re-shard KV and state between peers with different parallelism."""

from __future__ import annotations

from importlib import metadata as _metadata

try:  # the installed distribution's version: stated once, in pyproject.toml
    __version__ = _metadata.version("kvcore-mixers")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
