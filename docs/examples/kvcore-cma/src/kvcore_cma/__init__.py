"""kvcore-cma: an example kvcore transport over Linux cross-memory attach (process_vm_writev/readv)."""

from importlib import metadata as _metadata

try:  # the installed distribution's version: stated once, in pyproject.toml
    __version__ = _metadata.version("kvcore-cma")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
