"""The one independent KV oracle: what each rank holds, the logical values of a request, and a plan checker.

Written from the model definition, never from kvcore's own arithmetic (no shard
offsets, no mapper formulas): which KV heads, layers, conv channels and SSM
heads a rank holds (:func:`heads_of_rank`, :func:`layers_of_rank`,
:func:`conv_channels_of_rank`, :func:`ssm_heads_of_rank`), the logical values
of a request (:func:`expected_values`, :func:`expected_conv`,
:func:`expected_ssm`), and :func:`run_scenario`, which fills every rank's real
CPU tensors from a random logical request by plain indexing, executes kvcore's
plans as memcpy on their memory, and checks and write-counts every destination
byte. Used by ``kvcore demo``, the core's tests and the plugins' tests (the
mixers' property tests), so all of them agree on, say, MLA: one latent buffer
(``num_kv_heads`` is 1), replicated on every TP rank.

Importing it does not import torch (``kvcore demo --help`` stays fast); the functions that need torch do.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcore.layout.builders import allocate_kv_cache, allocate_mamba_state, build_kv_page_table, build_mamba_state
from kvcore.layout.mapping import FragmentPlan, RankPlacement, plan_transfer
from kvcore.layout.page import PageTable
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology

if TYPE_CHECKING:
    import torch

__all__ = [
    "SENTINEL",
    "heads_of_rank",
    "layers_of_rank",
    "conv_channels_of_rank",
    "ssm_heads_of_rank",
    "expected_values",
    "expected_conv",
    "expected_ssm",
    "Memory",
    "Side",
    "Outcome",
    "run_scenario",
]

# --- who holds what: written from the model definition ------------------------------------------


def _tp_pp_rank(rank: int, tp_size: int) -> tuple[int, int]:
    """``(tp_rank, pp_rank)`` of an instance-global rank (TP-minor: ``rank = pp*tp_size + tp``)."""
    return rank % tp_size, rank // tp_size


def heads_of_rank(total_heads: int, tp_size: int, tp_rank: int, attention_dp: bool, mla: bool = False) -> list[int]:
    """Global KV-head ids a rank holds (independent of kvcore's own arithmetic).

    Attention DP or TP1: all heads. MLA: the latent buffer (``total_heads`` is 1) on every rank.
    Heads >= TP: a contiguous share. Fewer heads than ranks: each head is
    replicated on ``tp_size // total_heads`` consecutive ranks.
    """
    if mla or attention_dp or tp_size == 1:
        return list(range(total_heads))
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return list(range(tp_rank * per, (tp_rank + 1) * per))
    return [tp_rank * total_heads // tp_size]


def layers_of_rank(num_layers: int, pp_size: int, pp_rank: int, layers_per_pp: list[int] | None = None) -> list[int]:
    """Global layers of a PP stage: ``layers_per_pp`` when given, else an even split (earlier stages get the remainder)."""
    if layers_per_pp is None:
        per, extra = divmod(num_layers, pp_size)
        layers_per_pp = [per + (1 if p < extra else 0) for p in range(pp_size)]
    start = sum(layers_per_pp[:pp_rank])
    return list(range(start, start + layers_per_pp[pp_rank]))


def conv_channels_of_rank(sections: tuple[int, ...], tp_size: int, tp_rank: int, attention_dp: bool) -> list[int]:
    """Global conv channels a rank holds: its contiguous share of every section, sections concatenated."""
    n = 1 if attention_dp else tp_size
    i = 0 if attention_dp else tp_rank
    out: list[int] = []
    start = 0
    for size in sections:
        per = size // n
        out.extend(range(start + i * per, start + (i + 1) * per))
        start += size
    return out


def ssm_heads_of_rank(nheads: int, tp_size: int, tp_rank: int, attention_dp: bool) -> list[int]:
    """Global SSM heads a rank holds: all under attention DP, else a contiguous share."""
    if attention_dp:
        return list(range(nheads))
    per = nheads // tp_size
    return list(range(tp_rank * per, (tp_rank + 1) * per))


def _index(values: list[int] | range, dims: int, axis: int) -> Any:
    import torch

    shape = [1] * dims
    shape[axis] = -1
    return torch.tensor(list(values), dtype=torch.int64).view(shape)


def expected_values(
    request: int, layers: list[int], kv: int, heads: list[int], tokens: range, dim: int, dtype: Any
) -> Any:
    """The logical KV ``[layers, kv, heads, tokens, dim]`` of a request: small integers, exact in bf16/fp16."""
    lt, kt, ht = _index(layers, 5, 0), _index(range(kv), 5, 1), _index(heads, 5, 2)
    tt, dt = _index(tokens, 5, 3), _index(range(dim), 5, 4)
    v = (request * 7919 + lt * 131 + kt * 31 + ht * 17 + tt * 3 + dt) % 251 - 125
    return v.to(dtype)


def expected_conv(request: int, layers: list[int], channels: list[int], taps: int, dtype: Any) -> Any:
    """The logical Mamba conv state ``[layers, channels, taps]`` of a request."""
    lt, ct, tt = _index(layers, 3, 0), _index(channels, 3, 1), _index(range(taps), 3, 2)
    v = (request * 6007 + lt * 101 + ct * 13 + tt * 7 + 3) % 241 - 120
    return v.to(dtype)


def expected_ssm(request: int, layers: list[int], heads: list[int], head_dim: int, d_state: int, dtype: Any) -> Any:
    """The logical Mamba SSM state ``[layers, heads, head_dim, d_state]`` of a request."""
    lt, ht = _index(layers, 4, 0), _index(heads, 4, 1)
    it, st = _index(range(head_dim), 4, 2), _index(range(d_state), 4, 3)
    v = (request * 4999 + lt * 89 + ht * 37 + it * 5 + st * 11 + 1) % 239 - 119
    return v.to(dtype)


# --- the scenario checker: kvcore's plans executed as memcpy on real tensors ------------------------

SENTINEL = 0x5A


def _bytes(t: torch.Tensor) -> np.ndarray:
    import torch

    return t.view(torch.uint8).numpy().reshape(-1) if t.numel() else np.zeros(0, np.uint8)


class Memory:
    """All tensors of all ranks, addressable by real address; executes plans as memcpy and counts writes."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.arrays: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []

    def add(self, t: torch.Tensor) -> None:
        if t.numel() == 0:
            return
        self.starts.append(t.data_ptr())
        self.arrays.append(_bytes(t))
        self.counts.append(np.zeros(t.numel() * t.element_size(), np.int32))

    def _find(self, addr: int, size: int) -> tuple[int, int]:
        for i, (s, a) in enumerate(zip(self.starts, self.arrays)):
            if s <= addr and addr + size <= s + len(a):
                return i, addr - s
        raise AssertionError(f"fragment [{addr:#x}, +{size}) lies outside every tensor")

    def execute(self, plan: FragmentPlan) -> None:
        for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()):
            si, so = self._find(s, n)
            di, do = self._find(d, n)
            ctypes.memmove(d, s, n)
            self.counts[di][do : do + n] += 1
            assert si != di or so + n <= do or do + n <= so

    def count_of(self, t: torch.Tensor) -> np.ndarray:
        return self.counts[self.starts.index(t.data_ptr())]


def make_logical(geom: AttentionGeometry, num_tokens: int, seed: int) -> np.ndarray:
    """Logical KV ``[layers, kv, heads, tokens, dim]`` of one request, as raw element bytes (uint8 view)."""
    rng = np.random.default_rng(seed)
    eb = geom.element_bytes
    shape = (geom.num_layers, geom.kv_factor, geom.num_kv_heads, num_tokens, geom.head_dim * eb)
    return rng.integers(0, 255, size=shape, dtype=np.uint8)


def fill_kv(
    rank_tensors: list[torch.Tensor] | torch.Tensor,
    topo: Topology,
    geom: AttentionGeometry,
    arrangement: str,
    logical: np.ndarray,
    block_ids: np.ndarray,
    first_block: int,
) -> None:
    """Write the request's logical KV for blocks ``first_block..`` into ``block_ids`` of a rank's tensors."""
    tpb, eb = geom.tokens_per_block, geom.element_bytes
    heads = heads_of_rank(geom.num_kv_heads, topo.tp_size, topo.tp_rank, topo.attention_dp, geom.is_mla)
    own = layers_of_rank(geom.num_layers, topo.pp_size, topo.pp_rank, list(topo.layers_per_pp))
    for j, blk in enumerate(block_ids.tolist()):
        toks = slice((first_block + j) * tpb, (first_block + j + 1) * tpb)
        for li, layer in enumerate(own):
            for k in range(geom.kv_factor):
                part = logical[layer, k][heads][:, toks]  # [h, tpb, D*eb]
                if arrangement == "head_major_pool":
                    dst = _bytes(rank_tensors[blk, li, k])  # type: ignore[call-overload]
                    dst[:] = part.reshape(-1)
                elif arrangement == "token_major_layers":
                    _bytes(rank_tensors[li][blk, k])[:] = part.transpose(1, 0, 2).reshape(-1)
                else:
                    _bytes(rank_tensors[li][k, blk])[:] = part.transpose(1, 0, 2).reshape(-1)
    del eb


def make_kv_ranks(
    tp: int,
    pp: int,
    geom: AttentionGeometry,
    arrangement: str,
    num_blocks: int,
    *,
    layers_per_pp: list[int] | None = None,
    attention_dp: bool = False,
    extra_tables: dict[int, PageTable] | None = None,
) -> list[tuple[Topology, object, RankPlacement]]:
    """Every rank of an instance: topology, its KV tensor(s) (sentinel-filled) and its RankPlacement."""
    out = []
    for r in range(tp * pp):
        topo = Topology.create(tp, pp, r, geom.num_layers, layers_per_pp, attention_dp=attention_dp)
        kv = allocate_kv_cache(topo, geom, num_blocks, arrangement=arrangement)
        for t in kv if isinstance(kv, list) else [kv]:
            _bytes(t)[:] = SENTINEL
        table = build_kv_page_table(kv, topology=topo, geometry=geom, arrangement=arrangement)
        if extra_tables and r in extra_tables:
            table = PageTable.combine([table, extra_tables[r]])
        out.append((topo, kv, RankPlacement(topology=topo, geometry=geom, page_table=table)))
    return out


# --- Mamba -----------------------------------------------------------------------------------


def make_logical_mamba(mg: MambaGeometry, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Logical state of one request: conv ``[layers, conv_dim, (d_conv-1)*eb]`` and SSM ``[layers, heads, hd*ds*eb]``."""
    import torch

    rng = np.random.default_rng(seed)
    ceb = torch.tensor([], dtype=getattr(torch, mg.conv_dtype)).element_size()
    seb = torch.tensor([], dtype=getattr(torch, mg.ssm_dtype)).element_size()
    nl = len(mg.layers)
    conv = rng.integers(0, 255, size=(nl, sum(mg.conv_sections), (mg.d_conv - 1) * ceb), dtype=np.uint8)
    ssm = rng.integers(0, 255, size=(nl, mg.nheads, mg.head_dim * mg.d_state * seb), dtype=np.uint8)
    return conv, ssm


def make_mamba_state(topo: Topology, mg: MambaGeometry, num_slots: int) -> tuple[Any, Any, Any]:
    conv, ssm = allocate_mamba_state(topo, mg, num_slots)
    _bytes(conv)[:] = SENTINEL
    _bytes(ssm)[:] = SENTINEL
    return conv, ssm, build_mamba_state(conv, ssm, topology=topo, geometry=mg)


def fill_mamba(conv: Any, ssm: Any, topo: Topology, mg: MambaGeometry, logical: Any, slot: int) -> None:
    lconv, lssm = logical
    chans = conv_channels_of_rank(tuple(mg.conv_sections), topo.tp_size, topo.tp_rank, topo.attention_dp)
    heads = ssm_heads_of_rank(mg.nheads, topo.tp_size, topo.tp_rank, topo.attention_dp)
    for li, layer in enumerate(mg.local_layers(topo)):
        gi = mg.layers.index(layer)
        _bytes(conv[li, slot])[:] = lconv[gi][chans].reshape(-1)
        _bytes(ssm[li, slot])[:] = lssm[gi][heads].reshape(-1)


# --- scenario runner -------------------------------------------------------------------------


@dataclass
class Side:
    """One instance's parallel configuration and cache arrangement in a scenario."""

    tp: int
    pp: int = 1
    layers_per_pp: list[int] | None = None
    attention_dp: bool = False
    arrangement: str = "head_major_pool"


@dataclass
class Outcome:
    pairs: int = 0
    nonempty: int = 0
    fragments: int = 0
    nbytes: int = 0
    writers: dict[int, list[int]] = field(default_factory=dict)


def _tensors(obj: Any) -> list[torch.Tensor]:
    return list(obj) if isinstance(obj, list | tuple) else [obj]


def run_scenario(
    ctx: Side,
    gen: Side,
    geom: AttentionGeometry,
    *,
    prompt_len: int,
    gen_cached_blocks: int = 0,
    ctx_dp_rank: int = 0,
    gen_dp_rank: int = 0,
    window: int | None = None,
    mamba: MambaGeometry | None = None,
    mappers: Any = None,
    seed: int = 0,
) -> Outcome:
    """Move one request from every contacted context rank to every receiving generation rank and check every byte.

    Asserts: every generation byte equals the independently sharded expectation
    (sentinel where nothing may be written), every destination byte is written
    exactly once, peer relations are symmetric, writer counts match.
    """
    import torch

    from kvcore.layout.peer import expected_receivers, expected_writers, peer_ranks

    tpb = geom.tokens_per_block
    total = -(-prompt_len // tpb)
    rng = np.random.default_rng(seed)
    num_blocks = total + 3
    ctx_ids = rng.permutation(num_blocks)[:total].astype(np.int64)
    gen_ids = rng.permutation(num_blocks)[: total - gen_cached_blocks].astype(np.int64)
    ctx_slot, gen_slot, num_slots = 1, 2, 3
    logical = make_logical(geom, total * tpb, seed)
    ones = np.ones_like(logical)
    lmamba = make_logical_mamba(mamba, seed + 1) if mamba else None

    def build(side: Side) -> list[dict[str, Any]]:
        ranks = []
        for r in range(side.tp * side.pp):
            topo = Topology.create(
                side.tp, side.pp, r, geom.num_layers, side.layers_per_pp, attention_dp=side.attention_dp
            )
            kv = allocate_kv_cache(topo, geom, num_blocks, arrangement=side.arrangement)
            for t in _tensors(kv):
                _bytes(t)[:] = SENTINEL
            table = build_kv_page_table(kv, topology=topo, geometry=geom, arrangement=side.arrangement)
            rank: dict[str, Any] = {"topo": topo, "kv": kv}
            if mamba is not None:
                conv, ssm, mtable = make_mamba_state(topo, mamba, num_slots)
                table = PageTable.combine([table, mtable])
                rank.update(conv=conv, ssm=ssm)
            rank["placement"] = RankPlacement(topology=topo, geometry=geom, page_table=table, mamba=mamba)
            ranks.append(rank)
        return ranks

    ctx_ranks, gen_ranks = build(ctx), build(gen)
    mem = Memory()
    for rank in ctx_ranks + gen_ranks:
        for key in ("kv", "conv", "ssm"):
            if key in rank:
                for t in _tensors(rank[key]):
                    mem.add(t)
    for rank in ctx_ranks:
        fill_kv(rank["kv"], rank["topo"], geom, ctx.arrangement, logical, ctx_ids, 0)
        if mamba is not None:
            fill_mamba(rank["conv"], rank["ssm"], rank["topo"], mamba, lmamba, ctx_slot)

    # which request blocks must land: the receiver's suffix, minus SWA-stale blocks
    first = total - len(gen_ids)
    if window is not None:
        first = max(first, max(0, (prompt_len + 1 - window) // tpb))
    out = Outcome()
    ctx_any = ctx_ranks[0]["topo"]
    gen_any = gen_ranks[0]["topo"]
    receivers = [g for g in gen_ranks if g["topo"].dp_rank == gen_dp_rank]
    for g in receivers:
        gt = g["topo"]
        contacted = peer_ranks(gt, ctx_any, ctx_dp_rank)
        assert expected_writers(ctx_any, gt, ctx_dp_rank) == len(contacted)
        out.writers[gt.rank] = contacted
        for c in contacted:
            ct = ctx_ranks[c]["topo"]
            back = peer_ranks(ct, gen_any, gen_dp_rank)
            assert gt.rank in back, (c, gt.rank, back)
            assert expected_receivers(ct, gen_any, gen_dp_rank) == len(back)
            plan = plan_transfer(
                ctx_ranks[c]["placement"],
                g["placement"],
                ctx_ids,
                gen_ids,
                mappers=mappers,
                src_state_slot=ctx_slot,
                dst_state_slot=gen_slot,
                prompt_len=prompt_len,
                sliding_window=window,
                cached_tokens=min(gen_cached_blocks * tpb, prompt_len),
            )
            out.pairs += 1
            out.nonempty += bool(plan.count)
            out.fragments += plan.count
            out.nbytes += plan.nbytes
            mem.execute(plan)

    # the contact relation is symmetric: every context rank expecting a receiver is contacted by it
    for crank in ctx_ranks:
        ct = crank["topo"]
        if ct.dp_rank != ctx_dp_rank:
            continue
        for gr in peer_ranks(ct, gen_any, gen_dp_rank):
            assert ct.rank in out.writers[gr], (ct.rank, gr)

    for g in gen_ranks:
        gt = g["topo"]
        receiving = g in receivers
        blocks = gen_ids[first - (total - len(gen_ids)) :] if receiving else gen_ids[:0]
        exp = [t.clone() for t in _tensors(g["kv"])]
        mask = [torch.zeros_like(t) for t in exp]
        for t in exp:
            _bytes(t)[:] = SENTINEL
        fill_kv(exp if isinstance(g["kv"], list) else exp[0], gt, geom, gen.arrangement, logical, blocks, first)
        fill_kv(mask if isinstance(g["kv"], list) else mask[0], gt, geom, gen.arrangement, ones, blocks, first)
        for t, e, m in zip(_tensors(g["kv"]), exp, mask):
            actual = _bytes(t)
            assert np.array_equal(actual, _bytes(e)), (
                f"gen rank {gt.rank}: KV bytes differ ({np.count_nonzero(actual != _bytes(e))} bytes)"
            )
            counts = mem.count_of(t)
            assert np.array_equal(counts, _bytes(m).astype(np.int32)), (
                f"gen rank {gt.rank}: write counts {np.unique(counts)} (expected each written byte once)"
            )
        if mamba is not None:
            conv_e, ssm_e = g["conv"].clone(), g["ssm"].clone()
            conv_m, ssm_m = torch.zeros_like(conv_e), torch.zeros_like(ssm_e)
            for t in (conv_e, ssm_e):
                _bytes(t)[:] = SENTINEL
            if receiving:
                assert lmamba is not None
                fill_mamba(conv_e, ssm_e, gt, mamba, lmamba, gen_slot)
                mones = tuple(np.ones_like(a) for a in lmamba)
                fill_mamba(conv_m, ssm_m, gt, mamba, mones, gen_slot)
            for t, e, m in ((g["conv"], conv_e, conv_m), (g["ssm"], ssm_e, ssm_m)):
                if t.numel() == 0:
                    continue
                assert np.array_equal(_bytes(t), _bytes(e)), f"gen rank {gt.rank}: Mamba state bytes differ"
                assert np.array_equal(mem.count_of(t), _bytes(m).astype(np.int32)), (
                    f"gen rank {gt.rank}: Mamba write counts {np.unique(mem.count_of(t))}"
                )
    return out
