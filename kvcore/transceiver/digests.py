"""What both roles hash the same way: the digest of the blocks a pull receiver read (below both roles)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from kvcore.layout.blocks import BlockIds

__all__ = ["blocks_digest"]


def blocks_digest(block_ids: BlockIds, state_slot: int, incarnation: str) -> bytes:
    """What a pull receiver must have read: the context blocks (per group), state slot and incarnation (16 bytes)."""
    h = hashlib.blake2b(digest_size=16)
    groups = dict(block_ids) if isinstance(block_ids, Mapping) else {"": block_ids}
    if len(groups) <= 1:  # one group travels as a plain list: both sides hash just the ids
        groups = {"": next(iter(groups.values()), np.zeros(0, np.int64))}
    for name in sorted(groups):
        h.update(name.encode() + b"\0" + np.asarray(groups[name], dtype="<i8").tobytes())
    h.update(int(state_slot).to_bytes(8, "little", signed=True))
    h.update(incarnation.encode())
    return h.digest()
