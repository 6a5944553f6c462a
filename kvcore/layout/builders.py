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

The Mamba state's builder and allocator live in :mod:`kvcore.layout.mamba_builders`, the tensor checks every
builder shares in :mod:`kvcore.layout.tensors`; this module re-exports their public names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcore.errors import LayoutError
from kvcore.layout.mamba_builders import (
    MAMBA_ARRANGEMENTS,
    MAMBA_LAYER_MAJOR,
    MAMBA_VLLM,
    allocate_mamba_state,
    build_mamba_state,
)
from kvcore.layout.page import (
    DEFAULT_GROUP,
    HEAD_MAJOR,
    REPLICATED,
    TOKEN_MAJOR,
    PageTable,
    Pool,
    PoolView,
    ViewSharding,
)
from kvcore.layout.peer import shard_position
from kvcore.layout.tensors import Allocator, check_tensor, torch_dtype, zeros
from kvcore.layout.topology import AttentionGeometry, Topology

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
TOKEN_MAJOR_LAYERS = "token_major_layers"
TOKEN_MAJOR_LAYERS_KV_FIRST = "token_major_layers_kv_first"
#: KV arrangements :func:`allocate_kv_cache` and :func:`build_kv_page_table` accept.
KV_ARRANGEMENTS = (HEAD_MAJOR_POOL, TOKEN_MAJOR_LAYERS, TOKEN_MAJOR_LAYERS_KV_FIRST)


def kv_view_sharding(topology: Topology, geometry: AttentionGeometry) -> tuple[str, str, ViewSharding]:
    """``(role, mapper kind, sharding)`` of the attention KV view of a rank.

    Args:
        topology: the rank's parallelism (its attention TP size and rank decide the shard).
        geometry: the attention geometry (MLA, block order, heads).

    Returns:
        ``("mla", "replicated", ...)`` for MLA (``kv_factor`` 1), else ``("kv", "head_mismatch_head_major" or
        "head_mismatch_token_major", ...)`` with the :class:`~kvcore.layout.page.ViewSharding` of this rank.

    Raises:
        TopologyError: the attention TP size is neither a divisor nor a multiple of ``num_kv_heads``.
    """
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


def covered_layers(topology: Topology, geometry: AttentionGeometry, layers: Sequence[int] | None) -> tuple[int, ...]:
    """The global layers of ``layers`` (all model layers when ``None``) this rank holds, ascending.

    Args:
        topology: the rank's parallelism (its pipeline stage's ``layer_range``).
        geometry: the model's attention geometry (``num_layers``).
        layers: distinct global layers (``0 <= layer < geometry.num_layers``); None: every layer.

    Returns:
        Those of ``layers`` inside this rank's ``layer_range``, ascending (empty when it holds none).

    Raises:
        LayoutError: ``layers`` repeats a layer or names one outside ``0..num_layers-1``.
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

    Args:
        kv_cache: a contiguous tensor ``[blocks, local layers, kv_factor, heads per rank, tokens_per_block,
            head_dim]`` of ``geometry.dtype`` (:func:`allocate_kv_cache` makes one).
        topology: the rank's parallelism.
        geometry: the attention geometry; its ``block_order`` must be ``head_major``.
        role: the view's role; None: ``kv`` (``mla`` for MLA).
        window: sliding-window size in tokens; None: full attention.
        layers: the global layers this cache covers; None: every layer of this rank's stage.
        group: the layer group's name.

    Returns:
        A :class:`~kvcore.layout.page.PageTable` with one pool and one view (no pool and no view when this rank
        holds none of ``layers``).

    Raises:
        LayoutError: the block order is not ``head_major``; the tensor's shape, dtype or contiguity differs from
            the expected one (the message names both); no block; ``layers`` invalid.
        TopologyError: the attention TP size is neither a divisor nor a multiple of ``num_kv_heads``.
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
    check_tensor(kv_cache, expected, geometry.dtype, "kv_cache")
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

    Args:
        kv_caches: one contiguous tensor per local layer, ``[kv_factor, blocks, tokens_per_block, heads per
            rank, head_dim]`` (kv-first) or ``[blocks, kv_factor, ...]`` (blocks-first), of ``geometry.dtype``.
        topology: the rank's parallelism.
        geometry: the attention geometry; its ``block_order`` must be ``token_major``.
        kv_first: the tensors' order; None: detected from each shape.
        role, window, layers, group: as :func:`build_head_major_pool`.

    Returns:
        A :class:`~kvcore.layout.page.PageTable` with one view over one pool per layer (per layer and buffer
        when kv-first); an empty table when this rank holds none of ``layers``.

    Raises:
        LayoutError: the block order is not ``token_major``; the number of tensors is not the number of local
            layers; a tensor's shape, dtype or contiguity differs (the message names the tensor, expected and
            actual); a shape fits both orders and ``kv_first`` is None; ``layers`` invalid.
        TopologyError: the attention TP size is neither a divisor nor a multiple of ``num_kv_heads``.
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
        check_tensor(t, expected, geometry.dtype, what)
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


def build_page_table(name: str, *args: Any, pm: PluginManager | None = None, **kwargs: Any) -> PageTable:
    """Build a page table with the builder registered as ``name`` (``head_major_pool``, ``token_major_layers``...).

    Args:
        name: a page-table builder registered through ``kvcore_register_page_table_builders`` (built in:
            ``head_major_pool``, ``token_major_layers``, ``mamba_state``; plugins add their engine's).
        args, kwargs: passed to the builder (e.g. ``kv_cache, topology=..., geometry=...``).
        pm: the plugin manager to ask; None: the process-wide one.

    Returns:
        The builder's :class:`~kvcore.layout.page.PageTable`.

    Raises:
        UnknownBackendError: no builder is registered as ``name`` (the message lists the registered ones), or
            its target failed to import.
        DuplicateBackendError: two plugins registered ``name``.
        LayoutError: the builder returned something other than a ``PageTable``; or whatever the builder raises
            for tensors that do not match (the built-in ones raise ``LayoutError`` and ``TopologyError``).
    """
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

    Args:
        topology: the rank's parallelism.
        geometry: the attention geometry (dtype, heads, block order).
        num_blocks: blocks per layer (>= 1).
        arrangement: one of ``KV_ARRANGEMENTS``; None: the default for ``geometry.block_order``.
        allocator: ``allocator(shape, dtype) -> tensor``; None: ``torch.zeros``.
        layers: the global layers to hold; None: every layer of this rank's stage.

    Returns:
        What :func:`build_kv_page_table` accepts with the same ``arrangement`` and ``layers``: one tensor for
        ``head_major_pool``, a list of one tensor per local layer otherwise.

    Raises:
        LayoutError: ``num_blocks < 1``; an unknown ``arrangement`` or one that does not match
            ``geometry.block_order``; ``layers`` invalid; an unknown dtype.
        TopologyError: the attention TP size is neither a divisor nor a multiple of ``num_kv_heads``.
    """
    if num_blocks < 1:
        raise LayoutError(f"num_blocks: expected >= 1, got {num_blocks}")
    alloc = allocator or zeros
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
    """Page table of tensors made by :func:`allocate_kv_cache` with the same ``arrangement`` and ``layers``.

    Args:
        kv_cache: the tensor (``head_major_pool``) or list of tensors (token-major arrangements).
        topology: the rank's parallelism.
        geometry: the attention geometry.
        arrangement: one of ``KV_ARRANGEMENTS``; None: the default for ``geometry.block_order``.
        layers, group, window: as :func:`build_head_major_pool`.

    Returns:
        The :class:`~kvcore.layout.page.PageTable` of :func:`build_head_major_pool` or
        :func:`build_token_major_layers`.

    Raises:
        LayoutError: an unknown ``arrangement``, or as the builder it calls.
        TopologyError: the attention TP size is neither a divisor nor a multiple of ``num_kv_heads``.
    """
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
