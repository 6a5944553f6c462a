"""Property tests: random context/generation topology pairs and geometries, every generation byte checked.

TP 1/2/4/8 with uneven PP, attention DP on either side, GQA with fewer KV heads
than TP, MLA, Mamba hybrid (conv + SSM), head-major and token-major, prefix
cache and sliding window. The oracle (kvcore.testing.oracle) shards the logical
request with plain indexing, executes every contacted pair's plan as memcpy on
real memory and asserts each destination byte is written exactly once.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.extension.plugins import make_plugin_manager
from kvcore.layout.topology import AttentionGeometry, MambaGeometry
from kvcore.testing.oracle import Side, run_scenario

MAPPERS = make_plugin_manager().layout_mappers


@st.composite
def side(draw, num_layers: int, arrangements: list[str]) -> Side:
    pp = draw(st.integers(1, min(3, num_layers)))
    cuts = sorted(draw(st.lists(st.integers(1, num_layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True)))
    split = [b - a for a, b in itertools.pairwise([0, *cuts, num_layers])]
    return Side(
        tp=draw(st.sampled_from([1, 2, 4, 8])),
        pp=pp,
        layers_per_pp=split,
        attention_dp=draw(st.booleans()),
        arrangement=draw(st.sampled_from(arrangements)),
    )


@st.composite
def hetero_case(draw):
    num_layers = draw(st.integers(2, 4))
    kind = draw(st.sampled_from(["head_major", "token_major", "mla", "gqa"]))
    tpb = draw(st.sampled_from([1, 2, 4]))
    heads = {"gqa": draw(st.sampled_from([1, 2, 4])), "mla": 1}.get(kind, 8)
    geom = AttentionGeometry(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=draw(st.sampled_from([2, 4])),
        tokens_per_block=tpb,
        dtype=draw(st.sampled_from(["float16", "float32", "int8"])),
        kv_factor=1 if kind == "mla" else 2,
        block_order="token_major" if kind == "token_major" else "head_major",
    )
    arrangements = (
        ["token_major_layers", "token_major_layers_kv_first"] if kind == "token_major" else ["head_major_pool"]
    )
    ctx, gen = draw(side(num_layers, arrangements)), draw(side(num_layers, arrangements))
    prompt_len = draw(st.integers(1, 5 * tpb))
    total = -(-prompt_len // tpb)
    mamba = None
    if draw(st.integers(0, 2)) == 0:
        layers = tuple(sorted(draw(st.sets(st.integers(0, num_layers - 1), min_size=1))))
        mamba = MambaGeometry(
            layers=layers, conv_sections=(16, 8, 8), d_conv=3, nheads=8, head_dim=2, d_state=2,
            conv_dtype="float32", ssm_dtype=draw(st.sampled_from(["float16", "float32"])),
        )  # fmt: skip
    ctx_dp = draw(st.integers(0, ctx.tp - 1)) if ctx.attention_dp else 0
    gen_dp = draw(st.integers(0, gen.tp - 1)) if gen.attention_dp else 0
    return dict(
        ctx=ctx,
        gen=gen,
        geom=geom,
        prompt_len=prompt_len,
        gen_cached_blocks=draw(st.integers(0, total)),
        window=draw(st.one_of(st.none(), st.integers(1, 3 * tpb))),
        ctx_dp_rank=ctx_dp,
        gen_dp_rank=gen_dp,
        mamba=mamba,
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hetero_case())
def test_heterogeneous_pairs_every_byte_once(case):
    ctx, gen = case["ctx"], case["gen"]
    out = run_scenario(case.pop("ctx"), case.pop("gen"), case.pop("geom"), mappers=MAPPERS, **case)
    # writer count: one completion per contacted context rank, PP stages x TP shard overlap
    for writers in out.writers.values():
        assert 1 <= len(writers) <= ctx.pp * max(1, ctx.tp // (1 if gen.attention_dp else gen.tp))
