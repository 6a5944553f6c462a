"""kvcore-mixers: layout mappers that re-shard KV and state between peers with different parallel layouts."""

from __future__ import annotations

__version__ = "0.1.0"
