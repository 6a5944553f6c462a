"""Page-table builder and allocator for the Mamba state of hybrid models (conv and SSM state, one slot per request).

The views this builder declares (``mamba_conv``, ``mamba_conv_groups``, ``mamba_ssm``) and their sharding are
summarized in :mod:`kvcore.layout.builders`, which also re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcore.errors import LayoutError
from kvcore.layout.page import HEAD_MAJOR, SECTIONED, PageTable, Pool, PoolView, ViewSharding
from kvcore.layout.peer import shard_position
from kvcore.layout.tensors import Allocator, check_tensor, torch_dtype, zeros
from kvcore.layout.topology import MambaGeometry, Topology, dtype_bytes

__all__ = [
    "MAMBA_ARRANGEMENTS",
    "MAMBA_LAYER_MAJOR",
    "MAMBA_VLLM",
    "allocate_mamba_state",
    "build_mamba_state",
]

#: Mamba state arrangements :func:`build_mamba_state` accepts.
MAMBA_LAYER_MAJOR = "layer_major"
MAMBA_VLLM = "vllm"
MAMBA_ARRANGEMENTS = (MAMBA_LAYER_MAJOR, MAMBA_VLLM)


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

    Args:
        conv_state: the conv state tensor (``layer_major``) or list of per-layer tensors (``vllm``), of
            ``geometry.conv_dtype``.
        ssm_state: the SSM state tensor or list, of ``geometry.ssm_dtype``.
        topology: the rank's parallelism.
        geometry: the Mamba geometry (layers, conv and SSM shapes, ``n_groups``).
        arrangement: ``layer_major`` or ``vllm``; None: ``layer_major``.

    Returns:
        A :class:`~kvcore.layout.page.PageTable` with one pool per layer and state (conv, SSM) and the views
        ``mamba_conv`` (and ``mamba_conv_groups`` with ``n_groups``) and ``mamba_ssm``.

    Raises:
        LayoutError: an unknown ``arrangement``; a tensor count, shape, dtype, contiguity or slot stride that
            differs from the expected one (the message names the tensor, expected and actual); a slot-less tensor.
        TopologyError: the geometry's heads, channels or groups do not shard over the attention TP size.
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
        check_tensor(conv_state, (nl, slots, conv_dim, rows), geometry.conv_dtype, "conv_state")
        check_tensor(ssm_state, (nl, slots, *ssm_shape), geometry.ssm_dtype, "ssm_state")
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

    Args:
        topology: the rank's parallelism.
        geometry: the Mamba geometry.
        num_slots: state slots per layer (>= 1): one per request in flight.
        allocator: ``allocator(shape, dtype) -> tensor``; None: ``torch.zeros``.
        arrangement: ``layer_major`` or ``vllm``; None: ``layer_major``.
        page_bytes: ``vllm`` only: bytes per page (default: conv and SSM rounded up to their element sizes).

    Returns:
        ``(conv_state, ssm_state)``: two tensors (``layer_major``) or two lists of per-layer views (``vllm``).

    Raises:
        LayoutError: ``num_slots < 1``; an unknown ``arrangement``; ``page_bytes`` smaller than a page or not a
            multiple of both element sizes; an unknown dtype.
        TopologyError: the geometry's heads, channels or groups do not shard over the attention TP size.
    """
    arrangement = MAMBA_LAYER_MAJOR if arrangement is None else arrangement
    if num_slots < 1:
        raise LayoutError(f"num_slots: expected >= 1, got {num_slots}")
    if arrangement not in MAMBA_ARRANGEMENTS:
        raise LayoutError(f"arrangement: expected one of {list(MAMBA_ARRANGEMENTS)}, got {arrangement!r}")
    alloc = allocator or zeros
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
