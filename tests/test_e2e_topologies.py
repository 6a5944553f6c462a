"""Multi-process end-to-end transfers over real agents, across topologies; every byte verified, no leaks.

Each case is one ``kvcore demo`` run (:func:`kvcore.tools.demo.run_demo`): context and
generation ranks are separate processes (gloo groups inside each instance),
the context ranks fill their pools from a formula, the generation ranks verify
every received byte against the same formula computed independently for their
own shard (and that cached prefixes and other DP groups' requests stay zero).
``summary["ok"]`` means: every rank-outcome DONE, zero mismatching elements,
both at the moment each request was reported DONE (before its release) and
after every request was released, bytes actually verified, every live resource (sessions, leases, transfers,
quarantine) back to zero on every rank, and every rank closing its
transceiver, agent and process group by itself within a few seconds.

Geometries are small (4 layers, 4-8 KV heads, head dim 32, 32-64 tokens, 8-16
requests) so that the file runs in a few minutes on two busy cores. The shared-
memory agent runs every case; NIXL and UCX run a representative subset when
their plugins are installed.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.tools.demo import DemoSpec, run_demo

pytestmark = pytest.mark.timeout(180)

SMALL: dict[str, Any] = dict(
    requests=8, tokens=32, layers=4, kv_heads=4, head_dim=32, tokens_per_block=8, timeout_s=60.0
)

# name -> DemoSpec overrides (on top of SMALL)
CASES: dict[str, dict[str, Any]] = {
    "tp2-tp2-head_major": dict(ctx_tp=2, gen_tp=2),
    "tp2-tp2-token_major": dict(ctx_tp=2, gen_tp=2, block_order="token_major"),
    "pp2-pp2-head_major": dict(ctx_tp=1, ctx_pp=2, gen_tp=1, gen_pp=2),
    "pp2-pp2-token_major": dict(ctx_tp=1, ctx_pp=2, gen_tp=1, gen_pp=2, block_order="token_major"),
    "tp2-tp2-64-concurrent": dict(ctx_tp=2, gen_tp=2, requests=64),
    "tp2-tp2-prefix-cached": dict(ctx_tp=2, gen_tp=2, tokens=64, cached_prefix_blocks=3),
    "tp2-tp4": dict(ctx_tp=2, gen_tp=4),
    "tp4-tp2": dict(ctx_tp=4, gen_tp=2),
    "tp1pp4-tp2pp2": dict(ctx_tp=1, ctx_pp=4, gen_tp=2, gen_pp=2),
    "tp4pp1-tp2pp2": dict(ctx_tp=4, ctx_pp=1, gen_tp=2, gen_pp=2),
    "uneven-pp-3,1-to-1,3": dict(
        ctx_tp=1, ctx_pp=2, ctx_layers_per_pp=[3, 1], gen_tp=2, gen_pp=2, gen_layers_per_pp=[1, 3]
    ),
    "gqa-2heads-tp1-tp4": dict(kv_heads=2, ctx_tp=1, gen_tp=4),
    "gqa-2heads-tp4-tp1": dict(kv_heads=2, ctx_tp=4, gen_tp=1),
    "mla-tp4-tp2": dict(mla=True, head_dim=64, ctx_tp=4, gen_tp=2),
    "ctx-adp-tp2-tp2": dict(ctx_tp=2, ctx_attention_dp=True, gen_tp=2),
    "gen-adp-tp2-tp2": dict(ctx_tp=2, gen_tp=2, gen_attention_dp=True),
    "mamba-tp2-tp4": dict(mamba=True, ctx_tp=2, gen_tp=4),
    "mamba-adp-pp2-prefix": dict(
        mamba=True, ctx_tp=2, ctx_attention_dp=True, gen_tp=1, gen_pp=2, tokens=48, cached_prefix_blocks=2
    ),
    # attention DP + uneven PP on the context, Mamba, token-major, bounce, partial last block, cached prefix
    "kitchen-sink": dict(
        requests=16,
        tokens=61,
        layers=6,
        kv_heads=8,
        ctx_tp=2,
        ctx_pp=2,
        ctx_layers_per_pp=[4, 2],
        ctx_attention_dp=True,
        gen_tp=4,
        mamba=True,
        block_order="token_major",
        bounce="on",
        cached_prefix_blocks=3,
    ),
    "token_major-tp2-tp4-bounce-off": dict(kv_heads=8, ctx_tp=2, gen_tp=4, block_order="token_major", bounce="off"),
    "token_major-tp2-tp4-bounce-on": dict(kv_heads=8, ctx_tp=2, gen_tp=4, block_order="token_major", bounce="on"),
    # layer-wise sending: half of each context rank's layers first, the rest afterwards
    "layerwise-pp2-tp4": dict(ctx_tp=1, ctx_pp=2, gen_tp=4, layerwise=True),
}

#: Pull mode (the generation ranks read the context's blocks) over the same matrix as push.
PULL_CASES: dict[str, dict[str, Any]] = {
    "pull-tp2-tp4": dict(ctx_tp=2, gen_tp=4),
    "pull-tp4-tp2": dict(ctx_tp=4, gen_tp=2),
    "pull-tp1pp4-tp2pp2": dict(ctx_tp=1, ctx_pp=4, gen_tp=2, gen_pp=2),
    "pull-gqa-2heads-tp1-tp4": dict(kv_heads=2, ctx_tp=1, gen_tp=4),
    "pull-mla-tp4-tp2": dict(mla=True, head_dim=64, ctx_tp=4, gen_tp=2),
    "pull-mamba-tp2-tp4": dict(mamba=True, ctx_tp=2, gen_tp=4),
    "pull-token_major-prefix-cached": dict(
        ctx_tp=2, gen_tp=2, tokens=64, cached_prefix_blocks=3, block_order="token_major"
    ),
    "pull-ctx-adp-tp2-tp2": dict(ctx_tp=2, ctx_attention_dp=True, gen_tp=2),
}
#: Pull cases run on every installed transport besides shm.
PULL_SUBSET = ("pull-tp2-tp4", "pull-tp4-tp2", "pull-mamba-tp2-tp4")

#: Run on every installed transport besides shm.
SUBSET = (
    "tp2-tp2-head_major",
    "tp2-tp4",
    "token_major-tp2-tp4-bounce-off",
    "token_major-tp2-tp4-bounce-on",
    "kitchen-sink",
    "layerwise-pp2-tp4",
)


def _backend_available(name: str) -> str | None:
    """None when the transport's plugin distribution is installed, else the skip reason.

    Only an absent plugin skips: an installed plugin whose native library is broken must fail these tests.
    """
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(f"kvcore-{name}")
    except PackageNotFoundError:
        return f"kvcore-{name} is not installed (pip install ./plugins/{name})"
    return None


def _run(backend: str, overrides: dict[str, Any]) -> dict[str, Any]:
    spec = DemoSpec(backend=backend, **{**SMALL, **overrides})
    summary = run_demo(spec, progress=False)
    brief = {
        k: summary.get(k)
        for k in (
            "backend",
            "done",
            "not_done",
            "mismatches",
            "mismatches_at_done",
            "first_mismatch",
            "errors",
            "leaks",
            "bytes",
            "teardown",
        )
    }
    assert summary["ok"], f"{backend} {overrides}: {brief}"
    assert summary["backend"] == backend
    assert summary["bytes"] > 0 and summary["mismatches"] == 0 and summary["not_done"] == 0
    # Every generation rank-request was checked at the moment DONE was reported, before its release.
    assert summary["mismatches_at_done"] == 0 and summary["checked_at_done"] == summary["done_generation"] > 0
    assert summary["teardown"] == {"killed": [], "exit_codes": {}}  # every rank closed by itself, promptly
    return summary


def _check_bounce(summary: dict[str, Any], mode: str) -> None:
    """The cumulative bounce counter (``bounced_writes_total``, summed over every rank) follows the mode."""
    counters = summary["counters"]
    assert "bounced_writes_total" in counters, f"the transceiver reports no bounce counter: {sorted(counters)}"
    used = counters["bounced_writes_total"]
    if mode == "on":
        assert used > 0, f"bounce forced on but no write was bounced: {counters}"
    elif mode == "off":
        assert used == 0, f"bounce off but {used} writes were bounced: {counters}"


@pytest.mark.parametrize("case", list(CASES))
def test_shm(case: str) -> None:
    overrides = CASES[case]
    summary = _run("shm", overrides)
    _check_bounce(summary, overrides.get("bounce", "auto"))


@pytest.mark.parametrize("backend", ["nixl", "ucx"])
@pytest.mark.parametrize("case", list(SUBSET))
def test_other_transports(backend: str, case: str) -> None:
    why = _backend_available(backend)
    if why is not None:
        pytest.skip(why)
    overrides = CASES[case]
    summary = _run(backend, overrides)
    _check_bounce(summary, overrides.get("bounce", "auto"))


@pytest.mark.parametrize("case", list(PULL_CASES))
def test_pull_shm(case: str) -> None:
    summary = _run("shm", {**PULL_CASES[case], "mode": "pull"})
    assert summary["counters"].get("bounced_writes_total", 0) == 0  # a pull reads fragments directly


@pytest.mark.parametrize("backend", ["nixl", "ucx"])
@pytest.mark.parametrize("case", list(PULL_SUBSET))
def test_pull_other_transports(backend: str, case: str) -> None:
    why = _backend_available(backend)
    if why is not None:
        pytest.skip(why)
    _run(backend, {**PULL_CASES[case], "mode": "pull"})


def test_wrong_bytes_are_detected() -> None:
    """The verification is not vacuous: one request filled with another request's values fails the run."""
    spec = DemoSpec(backend="shm", **{**SMALL, "gen_tp": 4, "poison": 5})
    summary = run_demo(spec, progress=False)
    assert not summary["ok"]
    assert summary["mismatches"] > 0 and summary["not_done"] == 0
    assert summary["first_mismatch"].startswith("request 5 ")


def test_oracles_follow_the_model_definition() -> None:
    from kvcore.tools.demo import conv_channels_of_rank, heads_of_rank, layers_of_rank, ssm_heads_of_rank

    assert heads_of_rank(8, 2, 1, False) == [4, 5, 6, 7]
    assert [heads_of_rank(2, 4, r, False) for r in range(4)] == [[0], [0], [1], [1]]  # GQA replicas
    assert heads_of_rank(8, 4, 3, True) == list(range(8))  # attention DP: every head
    assert [heads_of_rank(1, 4, r, False, mla=True) for r in range(4)] == [[0]] * 4
    assert [layers_of_rank(4, 2, p, [3, 1]) for p in range(2)] == [[0, 1, 2], [3]]
    assert [layers_of_rank(5, 2, p) for p in range(2)] == [[0, 1, 2], [3, 4]]
    assert conv_channels_of_rank((4, 2, 2), 2, 1, False) == [2, 3, 5, 7]
    assert ssm_heads_of_rank(8, 4, 2, False) == [4, 5]


def test_spec_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="bounce"):
        DemoSpec(bounce="sometimes").validate()
    with pytest.raises(ValueError, match="layers_per_pp"):
        DemoSpec(ctx_pp=2, ctx_layers_per_pp=[3, 3], layers=4).validate()
    with pytest.raises(ValueError, match="layerwise"):
        DemoSpec(mode="pull", layerwise=True).validate()
    with pytest.raises(ValueError, match="mode"):
        DemoSpec(mode="teleport").validate()
    with pytest.raises(ValueError, match="processes"):
        DemoSpec(ctx_tp=8, gen_tp=8, ctx_pp=2).validate()
    assert DemoSpec(bounce="on").config_overrides()["bounce_min_fragments"] == 1
    assert DemoSpec(bounce="off").config_overrides()["bounce_enabled"] is False
