"""The layout-mapper contract: a fragment plan, a matched view pair, and the mapper base plugins subclass.

Below :mod:`kvcore.layout.mapping` (which plans with mappers) and :mod:`kvcore.extension.registry` (which registers
them): neither of those is imported here, so the registry can name ``LayoutMapper`` without a circle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvcore.errors import MappingError
from kvcore.layout.page import PoolView, ViewSharding
from kvcore.transport.fragments import merge_runs

__all__ = ["MATCHING_HEADS", "FragmentPlan", "LayoutMapper", "MatchingHeadsMapper", "ViewPair", "shard_split"]

MATCHING_HEADS = "matching_heads"
_U64 = np.uint64


@dataclass(frozen=True, slots=True, eq=False)
class FragmentPlan:
    """Parallel uint64 arrays: fragment ``i`` copies ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]``."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray

    def __post_init__(self) -> None:
        for name in ("src", "dst", "sizes"):
            arr = np.ascontiguousarray(getattr(self, name), dtype=_U64).reshape(-1)
            object.__setattr__(self, name, arr)
        if not (len(self.src) == len(self.dst) == len(self.sizes)):
            raise MappingError(
                f"fragment plan: expected equal lengths, got src {len(self.src)}, dst {len(self.dst)}, "
                f"sizes {len(self.sizes)}"
            )

    @classmethod
    def trusted(cls, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> FragmentPlan:
        """A plan from arrays the caller built as this class keeps them (flat, contiguous uint64, equal lengths):
        no conversion and no check, for the planner's per-request path."""
        plan = object.__new__(cls)
        object.__setattr__(plan, "src", src)
        object.__setattr__(plan, "dst", dst)
        object.__setattr__(plan, "sizes", sizes)
        return plan

    @classmethod
    def empty(cls) -> FragmentPlan:
        z = np.zeros(0, dtype=_U64)
        return cls(z, z, z)

    @classmethod
    def concat(cls, plans: Iterable[FragmentPlan]) -> FragmentPlan:
        plans = [p for p in plans if p.count]
        if not plans:
            return cls.empty()
        if len(plans) == 1:
            return plans[0]
        return cls(
            np.concatenate([p.src for p in plans]),
            np.concatenate([p.dst for p in plans]),
            np.concatenate([p.sizes for p in plans]),
        )

    @property
    def count(self) -> int:
        return len(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum(dtype=_U64))

    def merge_contiguous(self) -> FragmentPlan:
        """Merge neighbours contiguous on both sides (``src[i] == src[i-1]+size[i-1]``, same for dst); order kept."""
        src, dst, sizes, _ = merge_runs(self.src, self.dst, self.sizes)
        # merge_runs keeps the dtype and returns flat, contiguous arrays of one length: nothing to convert or check
        return self if sizes is self.sizes else FragmentPlan.trusted(src, dst, sizes)

    def __repr__(self) -> str:
        return f"FragmentPlan(count={self.count}, nbytes={self.nbytes})"


def shard_split(src: ViewSharding, dst: ViewSharding, src_bytes: int, dst_bytes: int) -> tuple[int, int, int]:
    """``(src_offset, dst_offset, size)`` of the bytes two paired shards share, for one sharded run.

    ``src_bytes``/``dst_bytes`` are the run's per-rank sizes (a buffer, a row or a
    section). Equal shard counts copy the whole run; a coarser source copies the
    destination's share from offset ``(dst_shard % k)*dst_bytes``; a finer source
    lands at ``(src_shard % k)*src_bytes``. GQA duplication is handled because
    shard indices (not TP ranks) are used (peers.md B6.3).
    """
    ns, nd = src.num_shards, dst.num_shards
    if ns == nd:
        if src_bytes != dst_bytes:
            raise MappingError(
                f"shard bytes: expected equal sizes with equal shard counts, got {src_bytes} and {dst_bytes}"
            )
        return 0, 0, src_bytes
    if ns < nd:
        k = nd // ns
        if nd % ns or src_bytes != k * dst_bytes:
            raise MappingError(f"shard bytes: expected src {src_bytes} == {k} x dst {dst_bytes} ({ns} vs {nd} shards)")
        return (dst.shard_index % k) * dst_bytes, 0, dst_bytes
    k = ns // nd
    if ns % nd or dst_bytes != k * src_bytes:
        raise MappingError(f"shard bytes: expected dst {dst_bytes} == {k} x src {src_bytes} ({ns} vs {nd} shards)")
    return 0, (src.shard_index % k) * src_bytes, src_bytes


@dataclass(frozen=True, slots=True, eq=False)
class ViewPair:
    """One matched view pair with the buffer addresses to copy between.

    ``src_addrs``/``dst_addrs`` have shape ``(entries, blocks)``: the start of
    matched buffer ``e`` in aligned block/slot ``b``. Entries come in runs of
    ``group`` that share a source pool (all buffers of a slot); fragments are
    ordered run, block, entry-in-run, so neighbours in memory are neighbours in
    the plan and :meth:`FragmentPlan.merge_contiguous` can merge them.
    """

    src: PoolView
    dst: PoolView
    src_addrs: np.ndarray
    dst_addrs: np.ndarray
    group: int = 1


class LayoutMapper(ABC):
    """Turns one matched view pair into fragments; plugins subclass it and register ``kind``."""

    kind: ClassVar[str]

    @abstractmethod
    def buffer_fragments(self, src: PoolView, dst: PoolView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src_offsets, dst_offsets, sizes)`` of the fragments inside one buffer pair; raise ``MappingError`` if unmappable.

        Called once per view pair (not per block): the result is broadcast over
        every matched buffer and block. Read only ``view.sharding`` and
        ``view.buffer_bytes``.
        """

    def map(self, pair: ViewPair) -> FragmentPlan:
        """The fragments of ``pair``: ``outer(buffer addresses, in-buffer offsets)``, no Python loop per fragment."""
        so, do, sz = (np.asarray(a, dtype=_U64).reshape(-1) for a in self.buffer_fragments(pair.src, pair.dst))
        sa, da = pair.src_addrs, pair.dst_addrs
        e, b = sa.shape
        g = pair.group if pair.group >= 1 and e % pair.group == 0 else 1
        # (runs, group, blocks) -> (runs, blocks, group): memory order within a pool
        sa = sa.reshape(e // g, g, b).transpose(0, 2, 1)
        da = da.reshape(e // g, g, b).transpose(0, 2, 1)
        src = (sa[..., None] + so).reshape(-1)
        dst = (da[..., None] + do).reshape(-1)
        sizes = np.broadcast_to(sz, sa.shape + sz.shape).reshape(-1)
        return FragmentPlan(src, dst, sizes)


class MatchingHeadsMapper(LayoutMapper):
    """Identical per-buffer sharding on both sides: copy each buffer whole; contiguous layers/blocks merge."""

    kind = MATCHING_HEADS

    def buffer_fragments(self, src: PoolView, dst: PoolView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if src.sharding.shape_key() != dst.sharding.shape_key() or src.buffer_bytes != dst.buffer_bytes:
            raise MappingError(
                f"view {src.role!r}: matching_heads expected identical shardings, got "
                f"{src.sharding.shape_key()} / {src.buffer_bytes} B and {dst.sharding.shape_key()} / {dst.buffer_bytes} B"
            )
        return np.zeros(1, _U64), np.zeros(1, _U64), np.array([src.buffer_bytes], _U64)
