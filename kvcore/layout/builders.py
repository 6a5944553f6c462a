"""Page-table builders (torch tensors -> ``PageTable``) and allocators for the tensors they accept.

Builders declare each view's sharding from the topology and geometry
(:func:`kvcore.layout.peer.shard_position`) and its mapper kind from the sharding
alone, so two peers with different TP sizes declare the same kind:

=====================  ==================  ==============================
role                   sharding kind       mapper kind
=====================  ==================  ==============================
``kv`` head-major      head_major_sharded  ``head_mismatch_head_major``
``kv`` token-major     token_major_sharded ``head_mismatch_token_major``
``mla`` (kv_factor 1)  replicated          ``replicated``
``mamba_conv``         sectioned           ``mamba_conv``
``mamba_conv_groups``  sectioned           ``mamba_conv``
``mamba_ssm``          head_major_sharded  ``mamba_ssm``
=====================  ==================  ==============================

``mamba_conv_groups`` (the B|C sections, sharded by whole groups) exists when
``MambaGeometry.n_groups`` is declared; ``mamba_conv`` then holds x only. A
homogeneous pair uses the core's ``matching_heads`` mapper regardless (see
kvcore.layout.mapping).

The *arrangement* (``arrangement=``) names how an engine's tensors hold the cache: for KV
``head_major_pool`` (one tensor), ``token_major_layers`` or ``token_major_layers_kv_first`` (one
tensor per layer); for Mamba state ``layer_major`` or ``vllm``.

Why one module of this length: every builder declares its views through the same sharding and tensor checks
(``kv_view_sharding``, ``_check_tensor``) that the table above summarizes, and each allocator returns exactly what
its builder accepts; kept together, a builder and the tensors it accepts are read side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcore.errors import LayoutError
from kvcore.layout.page import (
    DEFAULT_GROUP,
    HEAD_MAJOR,
    REPLICATED,
    SECTIONED,
    TOKEN_MAJOR,
    PageTable,
    Pool,
    PoolView,
    ViewSharding,
)
from kvcore.layout.peer import shard_position
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology, dtype_bytes

if TYPE_CHECKING:
    import torch

    from kvcore.extension.plugins import PluginManager

__all__ = [
    "HEAD_MAJOR_POOL",
    "KV_ARRANGEMENTS",
    "MAMBA_ARRANGEMENTS",
    "MAMBA_LAYER_MAJOR",
    "MAMBA_VLLM",
    "TOKEN_MAJOR_LAYERS",
    "TOKEN_MAJOR_LAYERS_KV_FIRST",
    "Allocator",
    "allocate_kv_cache",
    "allocate_mamba_state",
    "build_head_major_pool",
    "build_kv_page_table",
    "covered_layers",
    "build_mamba_state",
    "build_page_table",
    "build_token_major_layers",
    "kv_view_sharding",
    "torch_dtype",
]

HEAD_MAJOR_POOL = "head_major_pool"
#: Mamba state arrangements :func:`build_mamba_state` accepts.
MAMBA_LAYER_MAJOR = "layer_major"
MAMBA_VLLM = "vllm"
MAMBA_ARRANGEMENTS = (MAMBA_LAYER_MAJOR, MAMBA_VLLM)
TOKEN_MAJOR_LAYERS = "token_major_layers"
TOKEN_MAJOR_LAYERS_KV_FIRST = "token_major_layers_kv_first"
#: KV arrangements :func:`allocate_kv_cache` and :func:`build_kv_page_table` accept.
KV_ARRANGEMENTS = (HEAD_MAJOR_POOL, TOKEN_MAJOR_LAYERS, TOKEN_MAJOR_LAYERS_KV_FIRST)

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


def kv_view_sharding(topology: Topology, geometry: AttentionGeometry) -> tuple[str, str, ViewSharding]:
    """``(role, mapper kind, sharding)`` of the attention KV view of a rank."""
    size, rank = topology.attention_tp
    eb = geometry.element_bytes
    if geometry.is_mla:
        n, i, r, j = shard_position(size, rank, None)
        return (
            "mla",
            "replicated",
            ViewSharding(kind=REPLICATED, num_shards=n, shard_index=i, num_replicas=r, replica_index=j),
        )
    n, i, r, j = shard_position(size, rank, geometry.num_kv_heads)
    if geometry.block_order == "head_major":
        sharding = ViewSharding(
            kind=HEAD_MAJOR,
            num_shards=n,
            shard_index=i,
            num_replicas=r,
            replica_index=j,
            unit_bytes=geometry.head_bytes(),
        )
        return "kv", "head_mismatch_head_major", sharding
    sharding = ViewSharding(
        kind=TOKEN_MAJOR,
        num_shards=n,
        shard_index=i,
        num_replicas=r,
        replica_index=j,
        unit_bytes=geometry.head_dim * eb,
        rows=geometry.tokens_per_block,
    )
    return "kv", "head_mismatch_token_major", sharding


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
    table. ``group`` names the layer group (see :class:`kvcore.layout.page.PoolView`).
    """
    if geometry.block_order != "head_major":
        raise LayoutError(f"block_order: expected 'head_major' for build_head_major_pool, got {geometry.block_order!r}")
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
    view_role, mapper, sharding = kv_view_sharding(topology, geometry)
    view = PoolView(
        role=role or view_role,
        mapper=mapper,
        layers=local,
        buffers_per_layer=kv,
        buffer_bytes=buf,
        pools=(0,) * (nl * kv),
        offsets=tuple(e * buf for e in range(nl * kv)),
        sharding=sharding,
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
    (vLLM's FlashAttention arrangement). ``layers`` and ``group`` as in
    :func:`build_head_major_pool`: with ``layers``, ``kv_caches`` holds one
    tensor per local layer of that list.
    """
    if geometry.block_order != "token_major":
        raise LayoutError(
            f"block_order: expected 'token_major' for build_token_major_layers, got {geometry.block_order!r}"
        )
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
    view_role, mapper, sharding = kv_view_sharding(topology, geometry)
    view = PoolView(
        role=role or view_role,
        mapper=mapper,
        layers=local,
        buffers_per_layer=kv,
        buffer_bytes=buf,
        pools=tuple(pool_ids),
        offsets=tuple(offsets),
        sharding=sharding,
        tokens_per_slot=tpb,
        window=window,
        dtype=geometry.dtype,
        group=group,
    )
    return PageTable(pools=tuple(pools), views=(view,))


def _check_slot_tensor(t: Any, expected: tuple[int, ...], dtype: str, what: str) -> int:
    """Check a ``[slots, ...]`` tensor whose slots may be strided (vLLM's page views); return the slot stride in bytes."""
    actual = tuple(t.shape)
    if actual != expected:
        raise LayoutError(f"{what}: expected shape {list(expected)}, got {list(actual)}")
    if str(t.dtype).removeprefix("torch.") != dtype.removeprefix("torch."):
        raise LayoutError(f"{what}: expected dtype {dtype}, got {str(t.dtype).removeprefix('torch.')}")
    inner: list[int] = []
    step = 1
    for n in reversed(expected[1:]):
        inner.append(step)
        step *= n
    inner.reverse()
    strides = list(t.stride())
    if strides[1:] != inner:
        raise LayoutError(f"{what}: expected each slot contiguous (strides {['*', *inner]}), got strides {strides}")
    eb = dtype_bytes(dtype)
    if expected[0] > 1 and strides[0] < step:
        raise LayoutError(f"{what}: expected a slot stride >= {step} elements (one slot), got {strides[0]}")
    return (strides[0] if expected[0] > 1 else step) * eb


def _conv_views(
    topology: Topology,
    geometry: MambaGeometry,
    pools: Sequence[int],
    rows: int,
    row_sections: tuple[int, ...],
    layers: tuple[int, ...],
) -> list[PoolView]:
    """Conv views over ``rows`` rows per slot, each row the sections ``row_sections`` (bytes) side by side.

    Without ``n_groups`` one view re-shards every section over TP; with it the
    x section (``mamba_conv``) and the B|C sections (``mamba_conv_groups``,
    sharded by whole groups, replicated when TP exceeds ``n_groups``) are
    separate views, so owner election picks one writer for each.
    """
    size, rank = topology.attention_tp
    row_bytes = sum(row_sections)
    position = shard_position(size, rank, size)
    parts: list[tuple[str, int, tuple[int, ...], tuple[int, int, int, int]]] = []
    if geometry.n_groups:
        parts.append(("mamba_conv", 0, row_sections[:1], position))
        parts.append(("mamba_conv_groups", row_sections[0], row_sections[1:], geometry.group_position(topology)))
    else:
        parts.append(("mamba_conv", 0, row_sections, position))
    views = []
    for role, start, sections, (n, i, r, j) in parts:
        views.append(
            PoolView(
                role=role,
                mapper="mamba_conv",
                layers=layers,
                buffers_per_layer=rows,
                buffer_bytes=sum(sections),
                pools=tuple(p for p in pools for _ in range(rows)),
                offsets=tuple(row * row_bytes + start for _ in pools for row in range(rows)),
                sharding=ViewSharding(
                    kind=SECTIONED, num_shards=n, shard_index=i, num_replicas=r, replica_index=j, section_bytes=sections
                ),
                dtype=geometry.conv_dtype,
            )
        )
    return views


def build_mamba_state(
    conv_state: Any,
    ssm_state: Any,
    *,
    topology: Topology,
    geometry: MambaGeometry,
    arrangement: str | None = None,
) -> PageTable:
    """Page table of this rank's Mamba state (``geometry.local_layers``), one slot per request.

    ``arrangement="layer_major"`` (default): one conv tensor ``[layers, slots,
    conv_dim, d_conv-1]`` (channel-major) and one SSM tensor ``[layers, slots,
    heads, head_dim, d_state]``, both contiguous.

    ``arrangement="vllm"``: vLLM's arrangement, one tensor per layer: ``conv_state`` is a
    list of ``[slots, d_conv-1, conv_dim]`` and ``ssm_state`` a list of
    ``[slots, heads, head_dim, d_state]``; each slot contiguous, slots strided
    as vLLM's page views are (conv and SSM interleaved in one page buffer).
    Its rows of ``x|B|C`` make ``d_conv-1`` conv fragments per layer and section.

    Both peers must use the same arrangement. A rank without Mamba layers gets an
    empty table (``[]`` tensors or tensors with 0 layers).
    """
    arrangement = MAMBA_LAYER_MAJOR if arrangement is None else arrangement
    if arrangement not in MAMBA_ARRANGEMENTS:
        raise LayoutError(f"arrangement: expected one of {list(MAMBA_ARRANGEMENTS)}, got {arrangement!r}")
    local = geometry.local_layers(topology)
    nl = len(local)
    conv_dim, rows = geometry.conv_dim(topology), geometry.d_conv - 1
    ssm_shape = geometry.ssm_shape(topology)
    ceb = dtype_bytes(geometry.conv_dtype)
    conv_bytes = conv_dim * rows * ceb
    ssm_bytes = ssm_shape[0] * geometry.ssm_head_bytes()
    pools: list[Pool] = []
    if arrangement == MAMBA_LAYER_MAJOR:
        if conv_state.dim() != 4 or ssm_state.dim() != 5:
            raise LayoutError(
                f"mamba state: expected conv [{nl}, slots, {conv_dim}, {rows}] and ssm "
                f"[{nl}, slots, {', '.join(map(str, ssm_shape))}], got {list(conv_state.shape)} and "
                f"{list(ssm_state.shape)}"
            )
        slots = conv_state.shape[1]
        _check_tensor(conv_state, (nl, slots, conv_dim, rows), geometry.conv_dtype, "conv_state")
        _check_tensor(ssm_state, (nl, slots, *ssm_shape), geometry.ssm_dtype, "ssm_state")
        if nl == 0:
            return PageTable(pools=(), views=())
        for tensor, nbytes in ((conv_state, conv_bytes), (ssm_state, ssm_bytes)):
            base = tensor.data_ptr()
            for li in range(nl):
                pools.append(
                    Pool(base=base + li * slots * nbytes, slot_bytes=nbytes, slot_stride=nbytes, num_slots=slots)
                )
        conv_rows, row_sections = 1, geometry.conv_section_bytes(topology)
    else:
        if len(conv_state) != nl or len(ssm_state) != nl:
            raise LayoutError(
                f"mamba state: expected {nl} conv and {nl} ssm tensors (local Mamba layers {list(local)}), "
                f"got {len(conv_state)} and {len(ssm_state)}"
            )
        if nl == 0:
            return PageTable(pools=(), views=())
        specs: list[tuple[Any, int, tuple[int, ...], str, str]] = [
            (conv_state, conv_bytes, (rows, conv_dim), geometry.conv_dtype, "conv_state")
        ]
        specs.append((ssm_state, ssm_bytes, ssm_shape, geometry.ssm_dtype, "ssm_state"))
        for tensors, nbytes, shape, dtype, name in specs:
            for li, t in enumerate(tensors):
                what = f"{name}[{li}] (layer {local[li]})"
                if t.dim() != 1 + len(shape):
                    raise LayoutError(f"{what}: expected [slots, {', '.join(map(str, shape))}], got {list(t.shape)}")
                stride = _check_slot_tensor(t, (t.shape[0], *shape), dtype, what)
                if t.shape[0] < 1:
                    raise LayoutError(f"{what}: expected at least one slot, got 0")
                pools.append(Pool(base=t.data_ptr(), slot_bytes=nbytes, slot_stride=stride, num_slots=t.shape[0]))
        conv_rows = rows
        row_sections = tuple(c * ceb for c in geometry.conv_section_channels(topology))
    size, rank = topology.attention_tp
    n, i, r, j = shard_position(size, rank, size)
    views = _conv_views(topology, geometry, range(nl), conv_rows, row_sections, local)
    views.append(
        PoolView(
            role="mamba_ssm",
            mapper="mamba_ssm",
            layers=local,
            buffers_per_layer=1,
            buffer_bytes=ssm_bytes,
            pools=tuple(range(nl, 2 * nl)),
            offsets=(0,) * nl,
            sharding=ViewSharding(
                kind=HEAD_MAJOR,
                num_shards=n,
                shard_index=i,
                num_replicas=r,
                replica_index=j,
                unit_bytes=geometry.ssm_head_bytes(),
            ),
            dtype=geometry.ssm_dtype,
        )
    )
    return PageTable(pools=tuple(pools), views=tuple(views))


def build_page_table(name: str, *args: Any, pm: PluginManager | None = None, **kwargs: Any) -> PageTable:
    """Build a page table with the builder registered as ``name`` (``head_major_pool``, ``token_major_layers``...)."""
    if pm is None:
        from kvcore.extension.plugins import get_plugin_manager

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
    arrangement: str | None = None,
    allocator: Allocator | None = None,
    layers: Sequence[int] | None = None,
) -> Any:
    """Tensors a builder accepts for this rank: one tensor (``head_major_pool``) or a list (token-major arrangements).

    ``arrangement`` is ``head_major_pool`` (default for head-major geometry),
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
    if arrangement is None:
        arrangement = HEAD_MAJOR_POOL if geometry.block_order == "head_major" else TOKEN_MAJOR_LAYERS
    heads = geometry.kv_heads_per_rank(topology)
    nl = len(covered_layers(topology, geometry, layers))
    kv, tpb, d = geometry.kv_factor, geometry.tokens_per_block, geometry.head_dim
    expected_order = "head_major" if arrangement == HEAD_MAJOR_POOL else "token_major"
    if geometry.block_order != expected_order:
        raise LayoutError(
            f"arrangement: {arrangement!r} expected geometry.block_order {expected_order!r}, "
            f"got {geometry.block_order!r}"
        )
    if arrangement == HEAD_MAJOR_POOL:
        return alloc((num_blocks, nl, kv, heads, tpb, d), dtype)
    if arrangement == TOKEN_MAJOR_LAYERS:
        return [alloc((num_blocks, kv, tpb, heads, d), dtype) for _ in range(nl)]
    if arrangement == TOKEN_MAJOR_LAYERS_KV_FIRST:
        return [alloc((kv, num_blocks, tpb, heads, d), dtype) for _ in range(nl)]
    raise LayoutError(f"arrangement: expected one of {list(KV_ARRANGEMENTS)}, got {arrangement!r}")


def build_kv_page_table(
    kv_cache: Any,
    *,
    topology: Topology,
    geometry: AttentionGeometry,
    arrangement: str | None = None,
    layers: Sequence[int] | None = None,
    group: str = DEFAULT_GROUP,
    window: int | None = None,
) -> PageTable:
    """Page table of tensors made by :func:`allocate_kv_cache` with the same ``arrangement`` and ``layers``."""
    if arrangement is None:
        arrangement = HEAD_MAJOR_POOL if geometry.block_order == "head_major" else TOKEN_MAJOR_LAYERS
    if arrangement not in KV_ARRANGEMENTS:
        raise LayoutError(f"arrangement: expected one of {list(KV_ARRANGEMENTS)}, got {arrangement!r}")
    if arrangement == HEAD_MAJOR_POOL:
        return build_head_major_pool(
            kv_cache, topology=topology, geometry=geometry, layers=layers, group=group, window=window
        )
    return build_token_major_layers(
        kv_cache,
        topology=topology,
        geometry=geometry,
        kv_first=arrangement == TOKEN_MAJOR_LAYERS_KV_FIRST,
        layers=layers,
        group=group,
        window=window,
    )


def allocate_mamba_state(
    topology: Topology,
    geometry: MambaGeometry,
    num_slots: int,
    allocator: Allocator | None = None,
    arrangement: str | None = None,
    page_bytes: int | None = None,
) -> tuple[Any, Any]:
    """``(conv_state, ssm_state)`` that :func:`build_mamba_state` accepts for this rank with the same ``arrangement``.

    ``arrangement="vllm"`` allocates as vLLM does: per local Mamba layer one buffer
    of ``num_slots`` pages, each page ``conv | ssm`` (``page_bytes``, default
    the two rounded up to their element sizes; vLLM pads it to the attention
    page), returned as two lists of strided views.
    """
    arrangement = MAMBA_LAYER_MAJOR if arrangement is None else arrangement
    if num_slots < 1:
        raise LayoutError(f"num_slots: expected >= 1, got {num_slots}")
    if arrangement not in MAMBA_ARRANGEMENTS:
        raise LayoutError(f"arrangement: expected one of {list(MAMBA_ARRANGEMENTS)}, got {arrangement!r}")
    alloc = allocator or _zeros
    nl = len(geometry.local_layers(topology))
    cdt, sdt = torch_dtype(geometry.conv_dtype), torch_dtype(geometry.ssm_dtype)
    conv_shape, ssm_shape = geometry.conv_shape(topology), geometry.ssm_shape(topology)
    if arrangement == MAMBA_LAYER_MAJOR:
        return alloc((nl, num_slots, *conv_shape), cdt), alloc((nl, num_slots, *ssm_shape), sdt)
    import torch

    ceb, seb = dtype_bytes(geometry.conv_dtype), dtype_bytes(geometry.ssm_dtype)
    rows, dim = conv_shape[1], conv_shape[0]
    ssm_off = -(-(dim * rows * ceb) // seb) * seb
    unit = max(ceb, seb)
    need = -(-(ssm_off + ssm_shape[0] * geometry.ssm_head_bytes()) // unit) * unit
    page = need if page_bytes is None else page_bytes
    if page < need or page % ceb or page % seb:
        raise LayoutError(
            f"page_bytes: expected >= {need} and a multiple of {ceb} and {seb} (element sizes), got {page_bytes}"
        )
    convs, ssms = [], []
    hd_ds = ssm_shape[1] * ssm_shape[2]
    for _ in range(nl):
        raw = alloc((num_slots * page,), torch.uint8)
        convs.append(torch.as_strided(raw.view(cdt), (num_slots, rows, dim), (page // ceb, dim, 1), 0))
        ssms.append(
            torch.as_strided(
                raw.view(sdt), (num_slots, *ssm_shape), (page // seb, hd_ds, ssm_shape[2], 1), ssm_off // seb
            )
        )
    return convs, ssms
