"""Describe vLLM's KV cache tensors to kvcore: geometry, topology and a page table.

vLLM 0.33 (RFC vllm#42082) allocates one backing buffer and hands each
attention layer a 4-D view ``[B, H, N, C]``: blocks, KV heads, tokens of a
(kernel) block, and ``C = head_size + head_size_v`` elements holding one
token's K and V of one head side by side. ``KVCacheLayout`` permutes the
physical order. A layer's page (one block) is contiguous in the four layouts
whose block holds ``H, N, C`` innermost, and those are the ones supported:

=========  ==========================  ==================================
layout     one layer's page            kvcore declaration
=========  ==========================  ==================================
``LBHNC``  ``[H][N][K|V]`` head-major   ``head_major_sharded``, unit = one head
``BLHNC``  same, blocks outermost       same
``LBNHC``  ``[N][H][K|V]`` token-major  ``token_major_sharded``, unit = one head of one token
``BLNHC``  same, blocks outermost       same
=========  ==========================  ==================================

``LHBNC`` and ``BHLNC`` (a page split per head) are refused with
``LayoutError``. The layout is read from the tensors' strides, not from a
name, so any view with these strides is accepted.

Because the unit of sharding is a whole head (its K and V together), the
mixers' head-mismatch mappers re-shard these pages correctly between
different TP sizes. The legacy (vLLM <= 0.2x FlashAttention) per-layer
``[2, B, N, H, D]`` tensors go through kvcore's own ``token_major_layers``
builder. MLA and Mamba state are not described yet (``LayoutError``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvcore.errors import LayoutError
from kvcore.layout.builders import build_token_major_layers, kv_view_sharding
from kvcore.layout.page import HEAD_MAJOR, TOKEN_MAJOR, PageTable, Pool, PoolView
from kvcore.layout.topology import AttentionGeometry, Topology

if TYPE_CHECKING:
    import torch

__all__ = ["KvDescription", "describe_kv_caches", "layer_index"]

_INT = re.compile(r"\d+")


def layer_index(name: str) -> int:
    """The global layer index in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = _INT.findall(name)
    if len(found) != 1:
        raise LayoutError(f"layer name {name!r}: expected exactly one integer (the layer index), got {found}")
    return int(found[0])


@dataclass(frozen=True)
class KvDescription:
    """What kvcore needs to know about one rank's KV cache."""

    topology: Topology
    geometry: AttentionGeometry
    page_table: PageTable
    layer_names: tuple[str, ...]  # in global layer order; aliases (shared KV) left out
    kind: str  # "head_major" (LBHNC, BLHNC), "token_major" (LBNHC, BLNHC) or "legacy_kv_first"
    kernel_blocks_per_block: int  # > 1 when the attention kernel splits a vLLM block


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    topology: Topology,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
) -> KvDescription:
    """Geometry and page table of vLLM's per-layer KV views on this rank.

    ``num_kv_heads`` is the model's total; ``block_size`` is vLLM's (scheduler)
    block size in tokens; a kernel block size that divides it is handled.
    """
    if not kv_caches:
        raise LayoutError("kv_caches: expected at least one attention layer, got none")
    # Layers that share another layer's KV (cross-layer KV sharing) alias its memory: describe each buffer once.
    by_ptr: dict[tuple[int, tuple[int, ...]], str] = {}
    for name in sorted(kv_caches, key=layer_index):
        t = kv_caches[name]
        by_ptr.setdefault((t.data_ptr(), tuple(t.shape)), name)
    names = tuple(sorted(by_ptr.values(), key=layer_index))
    tensors = [kv_caches[n] for n in names]
    dims = {t.dim() for t in tensors}
    if dims == {5}:
        return _describe_legacy(names, tensors, topology, num_kv_heads, head_size, block_size)
    if dims != {4}:
        raise LayoutError(
            f"kv_caches: expected 4-D [blocks, heads, tokens, K|V] views (vLLM >= 0.33) or legacy 5-D "
            f"[2, blocks, tokens, heads, dim] tensors, got dims {sorted(dims)}"
        )
    first = tensors[0]
    n_blocks, heads, tokens, content = (int(x) for x in first.shape)
    dtype = _dtype_name(first)
    es = first.element_size()
    for n, t in zip(names, tensors):
        if tuple(t.shape) != tuple(first.shape) or tuple(t.stride()) != tuple(first.stride()) or t.dtype != first.dtype:
            raise LayoutError(
                f"kv_caches[{n!r}]: expected the same shape, strides and dtype as {names[0]!r} "
                f"({list(first.shape)}, {list(first.stride())}, {dtype}), got "
                f"({list(t.shape)}, {list(t.stride())}, {_dtype_name(t)})"
            )
    if content != 2 * head_size:
        raise LayoutError(
            f"kv_caches[{names[0]!r}]: expected K and V of one head side by side in the last dim "
            f"(2*head_size = {2 * head_size}), got {content} (MLA and packed/quantized caches are not supported yet)"
        )
    if block_size % tokens:
        raise LayoutError(f"kernel block size: expected a divisor of block_size {block_size}, got {tokens}")
    ratio = block_size // tokens
    if n_blocks % ratio:
        raise LayoutError(f"kv_caches: {n_blocks} kernel blocks are not a multiple of {ratio} per vLLM block")
    sb, sh, sn, sc = (int(x) for x in first.stride())
    if sc != 1:
        raise LayoutError(f"kv_caches[{names[0]!r}]: expected a contiguous last dim, got stride {sc}")
    if sn == content and sh == tokens * content:
        kind, sharding_kind, unit, rows = "head_major", HEAD_MAJOR, tokens * content * es, 1
    elif sh == content and sn == heads * content:
        kind, sharding_kind, unit, rows = "token_major", TOKEN_MAJOR, content * es, tokens
    else:
        raise LayoutError(
            f"kv_caches[{names[0]!r}]: expected a page-contiguous layout (LBHNC, BLHNC, LBNHC or BLNHC: strides "
            f"[*, {tokens * content}, {content}, 1] or [*, {content}, {heads * content}, 1]), got {list(first.stride())}"
        )
    page = heads * tokens * content * es
    if ratio > 1 and sb * es != page:
        raise LayoutError(
            f"kv_caches: a vLLM block split into {ratio} kernel blocks must be dense pages "
            f"(block stride {page} bytes), got {sb * es}"
        )
    geometry = AttentionGeometry(
        num_layers=topology.num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        tokens_per_block=block_size,
        dtype=dtype,
        kv_factor=2,
        block_order="head_major" if kind == "head_major" else "token_major",
    )
    expected_heads = geometry.kv_heads_per_rank(topology)
    if heads != expected_heads:
        raise LayoutError(
            f"kv_caches[{names[0]!r}]: expected {expected_heads} KV heads on this rank "
            f"({num_kv_heads} over TP {topology.attention_tp[0]}), got {heads}"
        )
    layers = tuple(layer_index(n) for n in names)
    lo, hi = topology.layer_range
    outside = [x for x in layers if not lo <= x < hi]
    if outside:
        raise LayoutError(f"kv_caches: layers {outside} are outside this rank's layer range [{lo}, {hi})")
    pools = tuple(
        Pool(base=t.data_ptr(), slot_bytes=ratio * page, slot_stride=ratio * sb * es, num_slots=n_blocks // ratio)
        for t in tensors
    )
    role, mapper, shard = kv_view_sharding(topology, geometry)
    view = PoolView(
        role=role,
        mapper=mapper,
        layers=layers,
        buffers_per_layer=ratio,
        buffer_bytes=page,
        pools=tuple(p for p in range(len(pools)) for _ in range(ratio)),
        offsets=tuple(k * page for _ in pools for k in range(ratio)),
        sharding=msgspec.structs.replace(shard, kind=sharding_kind, unit_bytes=unit, rows=rows),
        tokens_per_slot=block_size,
    )
    return KvDescription(
        topology=topology,
        geometry=geometry,
        page_table=PageTable(pools=pools, views=(view,)),
        layer_names=names,
        kind=kind,
        kernel_blocks_per_block=ratio,
    )


def _describe_legacy(
    names: tuple[str, ...],
    tensors: list[torch.Tensor],
    topology: Topology,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
) -> KvDescription:
    """Per-layer ``[2, blocks, tokens, heads, dim]`` tensors (vLLM's FlashAttention layout before 0.33)."""
    layers = tuple(layer_index(n) for n in names)
    if layers != tuple(range(*topology.layer_range)):
        raise LayoutError(
            f"kv_caches: the legacy layout needs every layer of [{topology.layer_range[0]}, "
            f"{topology.layer_range[1]}), got {list(layers)}"
        )
    geometry = AttentionGeometry(
        num_layers=topology.num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        tokens_per_block=block_size,
        dtype=_dtype_name(tensors[0]),
        block_order="token_major",
    )
    table = build_token_major_layers(tensors, topology=topology, geometry=geometry, kv_first=True)
    return KvDescription(
        topology=topology,
        geometry=geometry,
        page_table=table,
        layer_names=names,
        kind="legacy_kv_first",
        kernel_blocks_per_block=1,
    )
