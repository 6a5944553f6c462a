"""Loads that cannot happen, in running engines: each is counted with its reason, logged, and follows the policy.

One prefill engine (a short request timeout, so a lease runs out within the test) serves two decode
engines: one with ``kv_load_failure_policy="recompute"`` (the prompt is computed locally: tokens still
right, ``local_compute`` shows it) and one with ``"fail"`` (vLLM fails the request). The prefill is
killed last, between a prefill and its decode.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import Engines, Llm, Reference
from test_real_engine import MAX_TOKENS, PROMPT_LEN, decode_step, delta, prefill_step, prompts

LEASE_S = 3.0


class Trio:
    def __init__(self, prefill: Llm, recompute: Llm, fail: Llm) -> None:
        self.prefill, self.recompute, self.fail = prefill, recompute, fail


@pytest.fixture(scope="module")
def trio(model_dir: str, llm_logs: Any) -> Any:
    e = Engines(llm_logs)
    timeouts = {"request_timeout_s": LEASE_S, "lease_s": LEASE_S, "max_lease_s": LEASE_S}
    prefill = e.start(role="prefill", model_dir=model_dir, backend="nixl", mode="pull", extra=timeouts)
    recompute = e.start(role="decode", model_dir=model_dir, backend="nixl", kv_load_failure_policy="recompute")
    fail = e.start(role="decode", model_dir=model_dir, backend="nixl", kv_load_failure_policy="fail")
    for llm in (prefill, recompute, fail):
        llm.up()
    yield Trio(prefill, recompute, fail)
    e.close()


def _failed(decode: Llm, tag: str, batch: list[list[int]], params: list[dict[str, Any]]) -> dict[str, Any]:
    return decode_step(decode, [tag], batch, params)[tag]


def test_refused_params_fail_the_request_under_fail(trio: Trio) -> None:
    batch = prompts(50, n=1)
    good = prefill_step(trio.prefill, ["f-bad"], batch)["f-bad"]["kv_transfer_params"]
    bad = {**good, "kvcore": {**good["kvcore"], "endpoint": "not an endpoint"}}
    before = trio.fail.metrics()
    out = _failed(trio.fail, "f-bad", batch, [bad])
    after = trio.fail.metrics()
    assert out["finish_reason"] == "error", out
    assert delta(after, before, "kvcore_load_failures", "invalid_params") == 1
    assert delta(after, before, "by_source", "local_compute") == 0  # failed, not recomputed
    assert "invalid_params" in trio.fail.log()


def _decode_both(trio: Trio, ids: list[str], batch: list[list[int]], params: list[dict[str, Any]]) -> Any:
    """The first request to the recompute engine, the second to the fail engine, both started at once."""
    before = (trio.recompute.metrics(), trio.fail.metrics())
    for llm, i, p, kv in zip((trio.recompute, trio.fail), ids, batch, params):
        llm.call("submit", requests=[{"id": i, "prompt": p, "max_tokens": MAX_TOKENS, "kv_transfer_params": kv}])
    for llm in (trio.recompute, trio.fail):
        llm.call("step")  # the worker asks the prefill now: both questions reach it together
    outs = [llm.call("run", ids=[i])["outputs"][i] for llm, i in zip((trio.recompute, trio.fail), ids)]
    after = (trio.recompute.metrics(), trio.fail.metrics())
    return outs, before, after


def test_a_lease_that_ran_out_is_counted_and_follows_the_policy(trio: Trio, reference: Reference) -> None:
    batch = prompts(51, n=2)
    ids = ["ls-0", "ls-1"]
    pouts = prefill_step(trio.prefill, ids, batch)
    time.sleep(LEASE_S + 1.0)  # nobody came: the prefill frees the blocks when its lease runs out
    (rec, fail), before, after = _decode_both(trio, ids, batch, [pouts[i]["kv_transfer_params"] for i in ids])
    assert rec["tokens"] == reference.tokens(batch[:1], MAX_TOKENS)[0]
    assert delta(after[0], before[0], "kvcore_load_failures", "lease_expired") == 1, after[0]["kvcore_load_failures"]
    assert delta(after[0], before[0], "by_source", "local_compute") == PROMPT_LEN
    assert fail["finish_reason"] == "error", fail
    assert delta(after[1], before[1], "kvcore_load_failures", "lease_expired") == 1, after[1]["kvcore_load_failures"]
    assert delta(after[1], before[1], "by_source", "local_compute") == 0
    assert "lease_expired" in trio.fail.log()


def test_the_prefill_killed_between_prefill_and_decode(trio: Trio, reference: Reference) -> None:
    """Last in this module: the prefill engine crashes (SIGKILL) after it returned the parameters."""
    batch = prompts(52, n=2)
    ids = ["k-0", "k-1"]
    pouts = prefill_step(trio.prefill, ids, batch)
    trio.prefill.crash()
    (rec, fail), before, after = _decode_both(trio, ids, batch, [pouts[i]["kv_transfer_params"] for i in ids])
    assert rec["tokens"] == reference.tokens(batch[:1], MAX_TOKENS)[0]
    assert delta(after[0], before[0], "kvcore_load_failures", "prefill_lost") == 1, after[0]["kvcore_load_failures"]
    assert delta(after[0], before[0], "by_source", "local_compute") == PROMPT_LEN
    assert "prefill_lost" in trio.recompute.log()
    assert fail["finish_reason"] == "error", fail
    assert delta(after[1], before[1], "kvcore_load_failures", "prefill_lost") == 1, after[1]["kvcore_load_failures"]
