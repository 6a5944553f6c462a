"""Page-table builders (torch tensors -> ``PageTable``) and allocators for the tensors they accept.

Builders declare each view's layout from the topology and geometry
(:func:`kvcore.peer.shard_position`) and its mapper kind from the layout
alone, so two peers with different TP sizes declare the same kind:

=====================  ==================  ==============================
role                   layout kind         mapper kind
=====================  ==================  ==============================
``kv`` head-major      head_major_sharded  ``head_mismatch_head_major``
``kv`` token-major     token_major_sharded ``head_mismatch_token_major``
``mla`` (kv_factor 1)  replicated          ``replicated``
``mamba_conv``         sectioned           ``mamba_conv``
``mamba_ssm``          head_major_sharded  ``mamba_ssm``
=====================  ==================  ==============================

A homogeneous pair uses the core's ``matching_heads`` mapper regardless (see
kvcore.mapping).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcore.errors import LayoutError
from kvcore.page import (
    DEFAULT_GROUP,
    HEAD_MAJOR,
    REPLICATED,
    SECTIONED,
    TOKEN_MAJOR,
    PageTable,
    Pool,
    PoolView,
    ViewLayout,
)
from kvcore.peer import shard_position
from kvcore.topology import AttentionGeometry, MambaGeometry, Topology, dtype_bytes

if TYPE_CHECKING:
    import torch

    from kvcore.plugins import PluginManager

__all__ = [
    "HEAD_MAJOR_POOL",
    "TOKEN_MAJOR_LAYERS",
    "TOKEN_MAJOR_LAYERS_KV_FIRST",
    "Allocator",
    "allocate_kv_cache",
    "allocate_mamba_state",
    "build_head_major_pool",
    "build_kv_page_table",
    "build_mamba_state",
    "build_page_table",
    "build_token_major_layers",
    "kv_view_layout",
    "torch_dtype",
]

HEAD_MAJOR_POOL = "head_major_pool"
TOKEN_MAJOR_LAYERS = "token_major_layers"
TOKEN_MAJOR_LAYERS_KV_FIRST = "token_major_layers_kv_first"

#: ``allocator(shape, dtype) -> tensor``; e.g. a shared-memory agent's ``allocate_tensor``.
Allocator = Callable[[tuple[int, ...], "torch.dtype"], "torch.Tensor"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``)."""
    import torch

    dtype_bytes(name)
    return getattr(torch, name.removeprefix("torch."))  # type: ignore[no-any-return]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    import torch

    return torch.zeros(shape, dtype=dtype)


def kv_view_layout(topology: Topology, geometry: AttentionGeometry) -> tuple[str, str, ViewLayout]:
    """``(role, mapper kind, layout)`` of the attention KV view of a rank."""
    size, rank = topology.attention_tp
    eb = geometry.element_bytes
    if geometry.is_mla:
        n, i, r, j = shard_position(size, rank, None)
        return (
            "mla",
            "replicated",
            ViewLayout(kind=REPLICATED, num_shards=n, shard_index=i, num_replicas=r, replica_index=j),
        )
    n, i, r, j = shard_position(size, rank, geometry.num_kv_heads)
    if geometry.layout == "head_major":
        layout = ViewLayout(
            kind=HEAD_MAJOR,
            num_shards=n,
            shard_index=i,
            num_replicas=r,
            replica_index=j,
            unit_bytes=geometry.head_bytes(),
        )
        return "kv", "head_mismatch_head_major", layout
    layout = ViewLayout(
        kind=TOKEN_MAJOR,
        num_shards=n,
        shard_index=i,
        num_replicas=r,
        replica_index=j,
        unit_bytes=geometry.head_dim * eb,
        rows=geometry.tokens_per_block,
    )
    return "kv", "head_mismatch_token_major", layout


def _check_tensor(t: Any, expected: tuple[int, ...], dtype: str, what: str) -> None:
    actual = tuple(t.shape)
    if actual != expected:
        raise LayoutError(f"{what}: expected shape {list(expected)}, got {list(actual)}")
    if str(t.dtype).removeprefix("torch.") != dtype.removeprefix("torch."):
        raise LayoutError(f"{what}: expected dtype {dtype}, got {str(t.dtype).removeprefix('torch.')}")
    if not t.is_contiguous():
        raise LayoutError(f"{what}: expected a contiguous tensor, got strides {list(t.stride())}")


def covered_layers(topology: Topology, geometry: AttentionGeometry, layers: Sequence[int] | None) -> tuple[int, ...]:
    """The global layers of ``layers`` (all model layers when ``None``) this rank holds, ascending.

    ``layers`` must be distinct model layers (``0 <= layer < geometry.num_layers``).
    """
    start, stop = topology.layer_range
    if layers is None:
        return tuple(range(start, stop))
    wanted = [int(layer) for layer in layers]
    if len(set(wanted)) != len(wanted) or any(not 0 <= layer < geometry.num_layers for layer in wanted):
        raise LayoutError(
            f"layers: expected distinct global layers in 0..{geometry.num_layers - 1} (num_layers), got {wanted}"
        )
    return tuple(sorted(layer for layer in wanted if start <= layer < stop))


def build_head_major_pool(
    kv_cache: torch.Tensor,
    *,
    topology: Topology,
    geometry: AttentionGeometry,
    role: str | None = None,
    window: int | None = None,
    layers: Sequence[int] | None = None,
    group: str = DEFAULT_GROUP,
) -> PageTable:
    """Page table of one tensor holding all local layers: ``[blocks, layers, kv, heads, tokens, dim]``.

    One pool (a slot is one block of every local layer); one view whose entry
    ``(layer, k)`` sits at ``(layer*kv + k) * buffer_bytes`` in the slot.
    ``window`` marks the layers as sliding-window attention (tokens).
    ``layers`` lists the model's global layers this cache covers (a hybrid's
    attention layers, or one layer group's); the tensor then holds only this
    rank's share of them, in order, and a rank holding none gets an empty
    table. ``group`` names the layer group (see :class:`kvcore.page.PoolView`).
    """
    if geometry.layout != "head_major":
        raise LayoutError(f"layout: expected 'head_major' for build_head_major_pool, got {geometry.layout!r}")
    heads = geometry.kv_heads_per_rank(topology)
    local = covered_layers(topology, geometry, layers)
    nl, kv = len(local), geometry.kv_factor
    if kv_cache.dim() != 6:
        raise LayoutError(
            f"kv_cache: expected shape [blocks, {nl}, {kv}, {heads}, {geometry.tokens_per_block}, "
            f"{geometry.head_dim}] (6 dims), got {list(kv_cache.shape)}"
        )
    blocks = kv_cache.shape[0]
    expected = (blocks, nl, kv, heads, geometry.tokens_per_block, geometry.head_dim)
    _check_tensor(kv_cache, expected, geometry.dtype, "kv_cache")
    if not nl:
        return PageTable(pools=(), views=())
    if blocks < 1:
        raise LayoutError("kv_cache: expected at least one block, got 0")
    buf = geometry.buffer_bytes(topology)
    slot = nl * kv * buf
    pool = Pool(base=kv_cache.data_ptr(), slot_bytes=slot, slot_stride=slot, num_slots=blocks)
    view_role, mapper, layout = kv_view_layout(topology, geometry)
    view = PoolView(
        role=role or view_role,
        mapper=mapper,
        layers=local,
        buffers_per_layer=kv,
        buffer_bytes=buf,
        pools=(0,) * (nl * kv),
        offsets=tuple(e * buf for e in range(nl * kv)),
        layout=layout,
        tokens_per_slot=geometry.tokens_per_block,
        window=window,
        dtype=geometry.dtype,
        group=group,
    )
    return PageTable(pools=(pool,), views=(view,))


def build_token_major_layers(
    kv_caches: Sequence[torch.Tensor],
    *,
    topology: Topology,
    geometry: AttentionGeometry,
    kv_first: bool | None = None,
    role: str | None = None,
    window: int | None = None,
    layers: Sequence[int] | None = None,
    group: str = DEFAULT_GROUP,
) -> PageTable:
    """Page table of one tensor per local layer: ``[kv, blocks, tokens, heads, dim]`` or ``[blocks, kv, tokens, heads, dim]``.

    ``kv_first=None`` detects the order from the shape (``LayoutError`` when both
    orders fit, i.e. ``blocks == kv_factor``). Blocks-first gives one pool per
    layer (K and V in one slot); kv-first gives one pool per layer and buffer
    (vLLM's FlashAttention layout). ``layers`` and ``group`` as in
    :func:`build_head_major_pool`: with ``layers``, ``kv_caches`` holds one
    tensor per local layer of that list.
    """
    if geometry.layout != "token_major":
        raise LayoutError(f"layout: expected 'token_major' for build_token_major_layers, got {geometry.layout!r}")
    heads = geometry.kv_heads_per_rank(topology)
    local = covered_layers(topology, geometry, layers)
    nl, kv, tpb, d = len(local), geometry.kv_factor, geometry.tokens_per_block, geometry.head_dim
    if len(kv_caches) != nl:
        raise LayoutError(f"kv_caches: expected {nl} tensors (local layers {list(local)}), got {len(kv_caches)}")
    if not nl:
        return PageTable(pools=(), views=())
    buf = geometry.buffer_bytes(topology)
    pools: list[Pool] = []
    pool_ids: list[int] = []
    offsets: list[int] = []
    for li, t in enumerate(kv_caches):
        what = f"kv_caches[{li}]"
        if t.dim() != 5:
            raise LayoutError(
                f"{what}: expected [{kv}, blocks, {tpb}, {heads}, {d}] or [blocks, {kv}, {tpb}, {heads}, {d}] "
                f"(5 dims), got {list(t.shape)}"
            )
        order = kv_first
        if order is None:
            fits_kv_first, fits_blocks_first = t.shape[0] == kv, t.shape[1] == kv
            if fits_kv_first and fits_blocks_first:
                raise LayoutError(f"{what}: shape {list(t.shape)} fits both orders; pass kv_first=True or False")
            order = fits_kv_first
        blocks = t.shape[1] if order else t.shape[0]
        expected = (kv, blocks, tpb, heads, d) if order else (blocks, kv, tpb, heads, d)
        _check_tensor(t, expected, geometry.dtype, what)
        base = t.data_ptr()
        if order:
            for k in range(kv):
                pool_ids.append(len(pools))
                offsets.append(0)
                pools.append(Pool(base=base + k * blocks * buf, slot_bytes=buf, slot_stride=buf, num_slots=blocks))
        else:
            pool_idx = len(pools)
            pools.append(Pool(base=base, slot_bytes=kv * buf, slot_stride=kv * buf, num_slots=blocks))
            for k in range(kv):
                pool_ids.append(pool_idx)
                offsets.append(k * buf)
    view_role, mapper, layout = kv_view_layout(topology, geometry)
    view = PoolView(
        role=role or view_role,
        mapper=mapper,
        layers=local,
        buffers_per_layer=kv,
        buffer_bytes=buf,
        pools=tuple(pool_ids),
        offsets=tuple(offsets),
        layout=layout,
        tokens_per_slot=tpb,
        window=window,
        dtype=geometry.dtype,
        group=group,
    )
    return PageTable(pools=tuple(pools), views=(view,))


def build_mamba_state(
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    *,
    topology: Topology,
    geometry: MambaGeometry,
) -> PageTable:
    """Page table of layer-major Mamba state: conv ``[layers, slots, conv_dim, d_conv-1]``, SSM ``[layers, slots, heads, head_dim, d_state]``.

    ``layers`` are this rank's Mamba layers (``geometry.local_layers``), one
    pool per layer and state kind; one slot per request.
    """
    size, rank = topology.attention_tp
    local = geometry.local_layers(topology)
    nl = len(local)
    conv_shape, ssm_shape = geometry.conv_shape(topology), geometry.ssm_shape(topology)
    if conv_state.dim() != 4 or ssm_state.dim() != 5:
        raise LayoutError(
            f"mamba state: expected conv [{nl}, slots, {conv_shape[0]}, {conv_shape[1]}] and ssm "
            f"[{nl}, slots, {', '.join(map(str, ssm_shape))}], got {list(conv_state.shape)} and {list(ssm_state.shape)}"
        )
    slots = conv_state.shape[1]
    _check_tensor(conv_state, (nl, slots, *conv_shape), geometry.conv_dtype, "conv_state")
    _check_tensor(ssm_state, (nl, slots, *ssm_shape), geometry.ssm_dtype, "ssm_state")
    if nl == 0:
        return PageTable(pools=(), views=())
    sections = geometry.conv_section_bytes(topology)
    conv_bytes = sum(sections)
    ssm_bytes = ssm_shape[0] * geometry.ssm_head_bytes()
    pools: list[Pool] = []
    for tensor, nbytes in ((conv_state, conv_bytes), (ssm_state, ssm_bytes)):
        base = tensor.data_ptr()
        for li in range(nl):
            pools.append(Pool(base=base + li * slots * nbytes, slot_bytes=nbytes, slot_stride=nbytes, num_slots=slots))
    n, i, r, j = shard_position(size, rank, size)
    conv_view = PoolView(
        role="mamba_conv",
        mapper="mamba_conv",
        layers=local,
        buffers_per_layer=1,
        buffer_bytes=conv_bytes,
        pools=tuple(range(nl)),
        offsets=(0,) * nl,
        layout=ViewLayout(
            kind=SECTIONED, num_shards=n, shard_index=i, num_replicas=r, replica_index=j, section_bytes=sections
        ),
        dtype=geometry.conv_dtype,
    )
    ssm_view = PoolView(
        role="mamba_ssm",
        mapper="mamba_ssm",
        layers=local,
        buffers_per_layer=1,
        buffer_bytes=ssm_bytes,
        pools=tuple(range(nl, 2 * nl)),
        offsets=(0,) * nl,
        layout=ViewLayout(
            kind=HEAD_MAJOR,
            num_shards=n,
            shard_index=i,
            num_replicas=r,
            replica_index=j,
            unit_bytes=geometry.ssm_head_bytes(),
        ),
        dtype=geometry.ssm_dtype,
    )
    return PageTable(pools=tuple(pools), views=(conv_view, ssm_view))


def build_page_table(name: str, *args: Any, pm: PluginManager | None = None, **kwargs: Any) -> PageTable:
    """Build a page table with the builder registered as ``name`` (``head_major_pool``, ``token_major_layers``...)."""
    if pm is None:
        from kvcore.plugins import get_plugin_manager

        pm = get_plugin_manager()
    builder = pm.page_table_builders.get(name)
    table = builder(*args, **kwargs)
    if not isinstance(table, PageTable):
        raise LayoutError(f"page-table builder {name!r}: expected a PageTable, got {type(table).__name__}")
    return table


def allocate_kv_cache(
    topology: Topology,
    geometry: AttentionGeometry,
    num_blocks: int,
    layout: str | None = None,
    allocator: Allocator | None = None,
    layers: Sequence[int] | None = None,
) -> Any:
    """Tensors a builder accepts for this rank: one tensor (``head_major_pool``) or a list (token-major layouts).

    ``layout`` is ``head_major_pool`` (default for head-major geometry),
    ``token_major_layers`` (``[blocks, kv, tokens, heads, dim]``, default for
    token-major) or ``token_major_layers_kv_first``. ``allocator(shape, dtype)``
    defaults to ``torch.zeros``; receivers pass their agent's ``allocate_tensor``.
    ``layers`` restricts the cache to those global layers (a hybrid's attention
    layers); a rank holding none of them gets a tensor with 0 layers (or ``[]``).
    """
    if num_blocks < 1:
        raise LayoutError(f"num_blocks: expected >= 1, got {num_blocks}")
    alloc = allocator or _zeros
    dtype = torch_dtype(geometry.dtype)
    if layout is None:
        layout = HEAD_MAJOR_POOL if geometry.layout == "head_major" else TOKEN_MAJOR_LAYERS
    heads = geometry.kv_heads_per_rank(topology)
    nl = len(covered_layers(topology, geometry, layers))
    kv, tpb, d = geometry.kv_factor, geometry.tokens_per_block, geometry.head_dim
    expected_layout = "head_major" if layout == HEAD_MAJOR_POOL else "token_major"
    if geometry.layout != expected_layout:
        raise LayoutError(f"layout: {layout!r} expected geometry.layout {expected_layout!r}, got {geometry.layout!r}")
    if layout == HEAD_MAJOR_POOL:
        return alloc((num_blocks, nl, kv, heads, tpb, d), dtype)
    if layout == TOKEN_MAJOR_LAYERS:
        return [alloc((num_blocks, kv, tpb, heads, d), dtype) for _ in range(nl)]
    if layout == TOKEN_MAJOR_LAYERS_KV_FIRST:
        return [alloc((kv, num_blocks, tpb, heads, d), dtype) for _ in range(nl)]
    raise LayoutError(
        f"layout: expected one of {[HEAD_MAJOR_POOL, TOKEN_MAJOR_LAYERS, TOKEN_MAJOR_LAYERS_KV_FIRST]}, got {layout!r}"
    )


def build_kv_page_table(
    kv_cache: Any,
    *,
    topology: Topology,
    geometry: AttentionGeometry,
    layout: str | None = None,
    layers: Sequence[int] | None = None,
    group: str = DEFAULT_GROUP,
    window: int | None = None,
) -> PageTable:
    """Page table of tensors made by :func:`allocate_kv_cache` with the same ``layout`` and ``layers``."""
    if layout is None:
        layout = HEAD_MAJOR_POOL if geometry.layout == "head_major" else TOKEN_MAJOR_LAYERS
    if layout == HEAD_MAJOR_POOL:
        return build_head_major_pool(
            kv_cache, topology=topology, geometry=geometry, layers=layers, group=group, window=window
        )
    return build_token_major_layers(
        kv_cache,
        topology=topology,
        geometry=geometry,
        kv_first=layout == TOKEN_MAJOR_LAYERS_KV_FIRST,
        layers=layers,
        group=group,
        window=window,
    )


def allocate_mamba_state(
    topology: Topology, geometry: MambaGeometry, num_slots: int, allocator: Allocator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(conv_state, ssm_state)`` tensors :func:`build_mamba_state` accepts for this rank."""
    if num_slots < 1:
        raise LayoutError(f"num_slots: expected >= 1, got {num_slots}")
    alloc = allocator or _zeros
    nl = len(geometry.local_layers(topology))
    conv = alloc((nl, num_slots, *geometry.conv_shape(topology)), torch_dtype(geometry.conv_dtype))
    ssm = alloc((nl, num_slots, *geometry.ssm_shape(topology)), torch_dtype(geometry.ssm_dtype))
    return conv, ssm
