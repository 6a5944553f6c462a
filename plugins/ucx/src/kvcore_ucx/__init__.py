"""kvcore-ucx: the UCX transfer agent for kvcore (one-sided RMA over UCX through cffi).

Importing this package loads nothing native; ``kvcore_ucx.agent`` loads UCX on
first use of ``UcxAgent``.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
