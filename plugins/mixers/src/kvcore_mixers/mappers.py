"""Re-sharding layout mappers. Each reads only the two views' sharding declarations and buffer sizes.

All of them reduce to :func:`kvcore.layout.mapping.shard_split` on a run of bytes that
is sharded contiguously: the whole buffer (head-major heads, SSM heads), one
row of it (token-major: every token's heads) or one section (conv state).
Owner election already happened in the core; these only say where bytes go.
"""

from __future__ import annotations

import numpy as np

from kvcore.errors import IncompatiblePeerError, MappingError
from kvcore.layout.mapping import LayoutMapper, shard_split
from kvcore.layout.page import HEAD_MAJOR, REPLICATED, SECTIONED, TOKEN_MAJOR, PoolView

__all__ = ["HeadMajorShardMapper", "ReplicatedMapper", "SectionedMapper", "SsmHeadMapper", "TokenMajorShardMapper"]

_U64 = np.uint64
Fragments = tuple[np.ndarray, np.ndarray, np.ndarray]


def _require(src: PoolView, dst: PoolView, kind: str, mapper: str) -> None:
    if src.sharding.kind != kind or dst.sharding.kind != kind:
        raise MappingError(
            f"view {src.role!r}: mapper {mapper!r} expected sharding kind {kind!r} on both sides, "
            f"got {src.sharding.kind!r} and {dst.sharding.kind!r}"
        )
    if src.sharding.unit_bytes != dst.sharding.unit_bytes:
        raise MappingError(
            f"view {src.role!r} unit_bytes: expected equal on both sides, got {src.sharding.unit_bytes} "
            f"and {dst.sharding.unit_bytes}"
        )


def _one(so: int, do: int, size: int) -> Fragments:
    return np.array([so], _U64), np.array([do], _U64), np.array([size], _U64)


class HeadMajorShardMapper(LayoutMapper):
    """Head-major buffers ``[heads][tokens][dim]``: the shared heads are one run; one fragment per buffer (B6.3)."""

    kind = "head_mismatch_head_major"

    def buffer_fragments(self, src: PoolView, dst: PoolView) -> Fragments:
        _require(src, dst, HEAD_MAJOR, self.kind)
        return _one(*shard_split(src.sharding, dst.sharding, src.buffer_bytes, dst.buffer_bytes))


class SsmHeadMapper(HeadMajorShardMapper):
    """Mamba SSM state ``[heads][head_dim][d_state]`` per slot: re-sharded by heads like head-major KV (B7)."""

    kind = "mamba_ssm"


class TokenMajorShardMapper(LayoutMapper):
    """Token-major buffers ``[tokens][heads][dim]``: one fragment per token row (B6.4); consider a bounce buffer."""

    kind = "head_mismatch_token_major"

    def buffer_fragments(self, src: PoolView, dst: PoolView) -> Fragments:
        _require(src, dst, TOKEN_MAJOR, self.kind)
        rows = src.sharding.rows
        if dst.sharding.rows != rows:
            raise MappingError(
                f"view {src.role!r} rows (tokens per block): expected equal, got {rows} and {dst.sharding.rows}"
            )
        src_row, dst_row = src.buffer_bytes // rows, dst.buffer_bytes // rows
        so, do, size = shard_split(src.sharding, dst.sharding, src_row, dst_row)
        t = np.arange(rows, dtype=_U64)
        return t * _U64(src_row) + _U64(so), t * _U64(dst_row) + _U64(do), np.full(rows, size, _U64)


class ReplicatedMapper(LayoutMapper):
    """Replicated buffers (MLA latent, index keys): the whole buffer; replicated *state* across TP groups is refused."""

    kind = "replicated"

    def buffer_fragments(self, src: PoolView, dst: PoolView) -> Fragments:
        _require(src, dst, REPLICATED, self.kind)
        if src.is_state and src.sharding.num_replicas != dst.sharding.num_replicas:
            raise IncompatiblePeerError(
                f"view {src.role!r}: replicated state is pre-scaled per TP group and cannot move between "
                f"groups of {src.sharding.num_replicas} and {dst.sharding.num_replicas} ranks"
            )
        if src.buffer_bytes != dst.buffer_bytes:
            raise MappingError(
                f"view {src.role!r} buffer_bytes: expected equal replicated buffers, got {src.buffer_bytes} "
                f"and {dst.buffer_bytes}"
            )
        return _one(0, 0, src.buffer_bytes)


class SectionedMapper(LayoutMapper):
    """Sectioned buffers (conv state ``x|B|C`` / ``q|k|v``): every section re-sharded on its own (B7 conv)."""

    kind = "mamba_conv"

    def buffer_fragments(self, src: PoolView, dst: PoolView) -> Fragments:
        _require(src, dst, SECTIONED, self.kind)
        ss, ds = src.sharding.section_bytes, dst.sharding.section_bytes
        if len(ss) != len(ds):
            raise MappingError(f"view {src.role!r} sections: expected the same count, got {len(ss)} and {len(ds)}")
        split = np.array([shard_split(src.sharding, dst.sharding, s, d) for s, d in zip(ss, ds)], dtype=_U64)
        s_start = np.concatenate(([0], np.cumsum(ss[:-1]))).astype(_U64)
        d_start = np.concatenate(([0], np.cumsum(ds[:-1]))).astype(_U64)
        return s_start + split[:, 0], d_start + split[:, 1], split[:, 2]
