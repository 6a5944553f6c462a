"""Property tests (core only): random homogeneous-TP pairs with any PP split, move every byte exactly once.

Homogeneous = the same attention TP size on both sides (PP, uneven splits,
block ids, prefix cache and sliding window vary freely). These need no plugin:
the core's matching_heads mapper must handle all of them. Heterogeneous pairs
are covered in plugins/mixers/tests.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.extension.plugins import make_plugin_manager
from kvcore.layout.topology import AttentionGeometry, MambaGeometry
from kvcore.testing.oracle import Side, run_scenario

CORE = make_plugin_manager(load_entry_points=False).layout_mappers


@st.composite
def pp_split(draw, num_layers: int) -> tuple[int, list[int]]:
    pp = draw(st.integers(1, min(3, num_layers)))
    cuts = sorted(draw(st.lists(st.integers(1, num_layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True)))
    bounds = [0, *cuts, num_layers]
    return pp, [b - a for a, b in itertools.pairwise(bounds)]


@st.composite
def homogeneous_case(draw):
    num_layers = draw(st.integers(2, 5))
    kind = draw(st.sampled_from(["head_major", "token_major", "mla", "gqa"]))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    adp = draw(st.booleans())
    tpb = draw(st.sampled_from([1, 2, 4]))
    heads = {"gqa": draw(st.sampled_from([1, 2])), "mla": 1}.get(kind, 8)
    geom = AttentionGeometry(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=4,
        tokens_per_block=tpb,
        dtype=draw(st.sampled_from(["float16", "float32", "int8"])),
        kv_factor=1 if kind == "mla" else 2,
        block_order="token_major" if kind == "token_major" else "head_major",
    )
    arrangements = (
        ["token_major_layers", "token_major_layers_kv_first"] if kind == "token_major" else ["head_major_pool"]
    )
    ctx_pp, ctx_split = draw(pp_split(num_layers))
    gen_pp, gen_split = draw(pp_split(num_layers))
    ctx = Side(tp, ctx_pp, ctx_split, adp, draw(st.sampled_from(arrangements)))
    gen = Side(tp, gen_pp, gen_split, adp, draw(st.sampled_from(arrangements)))
    prompt_len = draw(st.integers(1, 6 * tpb))
    total = -(-prompt_len // tpb)
    mamba = None
    if draw(st.booleans()):
        layers = tuple(sorted(draw(st.sets(st.integers(0, num_layers - 1), min_size=1))))
        mamba = MambaGeometry(
            layers=layers, conv_sections=(16, 8, 8), d_conv=3, nheads=8, head_dim=2, d_state=2,
            conv_dtype="float32", ssm_dtype="float16",
        )  # fmt: skip
    return dict(
        ctx=ctx,
        gen=gen,
        geom=geom,
        prompt_len=prompt_len,
        gen_cached_blocks=draw(st.integers(0, total)),
        window=draw(st.one_of(st.none(), st.integers(1, 3 * tpb))),
        ctx_dp_rank=draw(st.integers(0, tp - 1)) if adp else 0,
        gen_dp_rank=draw(st.integers(0, tp - 1)) if adp else 0,
        mamba=mamba,
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(homogeneous_case())
def test_homogeneous_pairs_every_byte_once(case):
    out = run_scenario(case.pop("ctx"), case.pop("gen"), case.pop("geom"), mappers=CORE, **case)
    assert all(len(w) >= 1 for w in out.writers.values())


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_homogeneous_merges_to_one_fragment_per_block_run(tp):
    geom = AttentionGeometry(num_layers=4, num_kv_heads=4, head_dim=4, tokens_per_block=2, dtype="float16")
    out = run_scenario(Side(tp), Side(tp), geom, prompt_len=8, mappers=CORE)
    # every pair moves whole slots; no more fragments than blocks
    assert out.fragments <= 4 * tp
