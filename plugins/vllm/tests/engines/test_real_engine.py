"""KvcoreConnector in running vLLM engines: forward passes, vLLM's request ids, and proof that KV was loaded.

Each test is the proxy between a prefill engine and a decode engine (separate processes, one core each):
the prompt goes to the prefill with ``{"do_remote_decode": true}`` and ``max_tokens=1``; its
``kv_transfer_params`` go to the decode request unchanged. vLLM randomizes request ids (its default), so
the decode request's id never equals the prefill's.

Identical tokens alone prove nothing (a decode that recomputed its prefill produces them too), so each
test also reads the decode engine's own counters: every prompt token must come from
``external_kv_transfer`` and none from ``local_compute``; a failed load must show in
``vllm:kvcore_load_failures`` with its reason, and as a recompute (``local_compute``) or a failed request.
"""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from typing import Any

import numpy as np
import pytest
from conftest import Engines, Llm, Reference, free_port

PROMPT_LEN = 256
MAX_TOKENS = 8


def prompts(wave: int, n: int = 8, length: int = PROMPT_LEN, prefix: list[int] | None = None) -> list[list[int]]:
    """``n`` prompts of random token ids (seeded by ``wave``), each starting with ``prefix`` if given."""
    rng = np.random.default_rng(1000 + wave)
    head = list(prefix or [])
    return [head + rng.integers(1, 999, length - len(head)).tolist() for _ in range(n)]


def delta(after: dict[str, Any], before: dict[str, Any], *path: str) -> float:
    a, b = after, before
    for p in path[:-1]:
        a, b = a.get(p, {}), b.get(p, {})
    return float(a.get(path[-1], 0)) - float(b.get(path[-1], 0))


def prefill_step(prefill: Llm, ids: list[str], batch: list[list[int]]) -> dict[str, dict[str, Any]]:
    reqs = [
        {"id": i, "prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        for i, p in zip(ids, batch)
    ]
    outs = prefill.call("generate", requests=reqs)["outputs"]
    for i in ids:
        params = outs[i]["kv_transfer_params"]
        assert params and params["do_remote_prefill"] is True, outs[i]
        # vLLM's own id for the request: the external id and a random suffix (randomization is on).
        assert re.fullmatch(rf"{re.escape(i)}-[0-9a-f]{{8}}", params["kvcore"]["request_id"]), params
    return outs


def decode_step(decode: Llm, ids: list[str], batch: list[list[int]], params: list[dict[str, Any]]) -> dict[str, Any]:
    reqs = [
        {"id": i, "prompt": p, "max_tokens": MAX_TOKENS, "kv_transfer_params": kv}
        for i, p, kv in zip(ids, batch, params)
    ]
    return decode.call("generate", requests=reqs)["outputs"]


def disagg(prefill: Llm, decode: Llm, tag: str, batch: list[list[int]]) -> dict[str, Any]:
    """Prefill then decode ``batch``, the test acting as the proxy; the decode's outputs."""
    ids = [f"{tag}-{k}" for k in range(len(batch))]
    pouts = prefill_step(prefill, ids, batch)
    return decode_step(decode, ids, batch, [pouts[i]["kv_transfer_params"] for i in ids])


def tokens_of(outs: dict[str, Any], tag: str, n: int) -> list[list[int]]:
    return [outs[f"{tag}-{k}"]["tokens"] for k in range(n)]


# --- one pair per backend and mode -------------------------------------------------------------------------

# (backend, mode, native lane): "lane" runs both engines' transceivers with native_lane (kvcore-native's C thread
# serves the push requests it can; the decode's lane counters are the evidence that it did).
PAIRS = [("nixl", "pull", ""), ("nixl", "push", ""), ("nixl", "push", "lane"), ("shm", "pull", ""), ("shm", "push", "")]


class Pair:
    def __init__(self, prefill: Llm, decode: Llm, backend: str, mode: str, lane: bool, metrics_port: int) -> None:
        self.prefill, self.decode, self.backend, self.mode, self.lane = prefill, decode, backend, mode, lane
        self.metrics_port = metrics_port

    def lane_requests(self) -> float:
        """The decode's lane requests answered so far (kvcore's own Prometheus export, ``metrics_port``)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        found = [
            float(v)
            for v in re.findall(r'^kvcore_control_events_total\{[^}]*kind="lane_requests"[^}]*\} (\S+)$', text, re.M)
        ]
        assert found, text[-3000:]
        return sum(found)


@pytest.fixture(scope="module", params=PAIRS, ids=["-".join(x for x in p if x) for p in PAIRS])
def pair(request: pytest.FixtureRequest, model_dir: str, llm_logs: Any) -> Any:
    backend, mode, lane = request.param
    e = Engines(llm_logs)
    port = free_port()
    extra: dict[str, Any] = {"gil_switch_interval_s": 0.0005, **({"native_lane": True} if lane else {})}
    common = {"model_dir": model_dir, "backend": backend, "mode": mode, "extra": extra}
    prefill = e.start(role="prefill", **common)
    decode = e.start(role="decode", **{**common, "extra": {**common["extra"], "metrics_port": port}})
    prefill.up()
    decode.up()
    yield Pair(prefill, decode, backend, mode, bool(lane), port)
    e.close()


def test_decode_loads_every_prompt_token_and_matches_one_engine(pair: Pair, reference: Reference) -> None:
    """Two waves of 8 prompts: tokens equal one plain engine's, every prompt token loaded, none recomputed."""
    for wave in (1, 2):
        batch = prompts(wave)
        before, sent_before = pair.decode.metrics(), pair.prefill.metrics()
        lane_before = pair.lane_requests()
        outs = disagg(pair.prefill, pair.decode, f"w{wave}", batch)
        after, sent_after = pair.decode.metrics(), pair.prefill.metrics()
        # The path taken: with the lane every request was answered there; without it, none was.
        assert pair.lane_requests() - lane_before == (len(batch) if pair.lane else 0)
        # Every send started in the step that computed its prompt's last token, not a step after vLLM finished it.
        assert delta(sent_after, sent_before, "vllm:kvcore_sends_started") == len(batch), (sent_before, sent_after)
        assert delta(sent_after, sent_before, "vllm:kvcore_sends_started_early") == len(batch)
        assert tokens_of(outs, f"w{wave}", len(batch)) == reference.tokens(batch, MAX_TOKENS)
        total = sum(map(len, batch))
        assert delta(after, before, "by_source", "external_kv_transfer") == total, (before, after)
        assert delta(after, before, "by_source", "local_compute") == 0, (before, after)
        assert delta(after, before, "vllm:external_prefix_cache_hits") == total
        assert delta(after, before, "vllm:kvcore_tokens_loaded") == total
        assert delta(after, before, "kvcore_transfers", "done") == len(batch)
        assert sum(after["kvcore_load_failures"].values()) == sum(before["kvcore_load_failures"].values())


def test_a_prefill_of_more_than_one_token_sends_when_it_finishes(pair: Pair, reference: Reference) -> None:
    """``max_tokens`` 2 on the prefill: not sure to finish with its prompt, so its send starts at request_finished
    (not early); the decode still loads every prompt token and matches one engine."""
    batch = prompts(12, n=2)
    ids = [f"mt2-{k}" for k in range(len(batch))]
    reqs = [
        {"id": i, "prompt": p, "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}}
        for i, p in zip(ids, batch)
    ]
    sent_before, before = pair.prefill.metrics(), pair.decode.metrics()
    pouts = pair.prefill.call("generate", requests=reqs)["outputs"]
    outs = decode_step(pair.decode, ids, batch, [pouts[i]["kv_transfer_params"] for i in ids])
    after = pair.decode.metrics()
    # The offline engine records the connector stats of steps it ran after generate() returned only when it next
    # reads outputs: a plain one-token request makes it (bounded).
    for k in range(10):
        sent_after = pair.prefill.metrics()
        if delta(sent_after, sent_before, "vllm:kvcore_sends_started") >= len(batch):
            break
        pair.prefill.call("generate", requests=[{"id": f"mt2-nudge-{k}", "prompt": [1, 2, 3], "max_tokens": 1}])
        time.sleep(0.2)
    assert delta(sent_after, sent_before, "vllm:kvcore_sends_started") == len(batch), (sent_before, sent_after)
    assert delta(sent_after, sent_before, "vllm:kvcore_sends_started_early") == 0
    assert tokens_of(outs, "mt2", len(batch)) == reference.tokens(batch, MAX_TOKENS)
    assert delta(after, before, "by_source", "external_kv_transfer") == sum(map(len, batch))
    assert delta(after, before, "by_source", "local_compute") == 0


def test_a_decode_prefix_cache_hit_loads_only_the_rest(pair: Pair, reference: Reference) -> None:
    """A prompt sharing 128 tokens with one the decode already holds: those come from its cache, the rest over kvcore."""
    first = prompts(10, n=1)
    disagg(pair.prefill, pair.decode, "pc-a", first)
    batch = prompts(11, n=1, prefix=first[0][:128])
    before = pair.decode.metrics()
    outs = disagg(pair.prefill, pair.decode, "pc-b", batch)
    after = pair.decode.metrics()
    assert tokens_of(outs, "pc-b", 1) == reference.tokens(batch, MAX_TOKENS)
    assert delta(after, before, "by_source", "local_cache_hit") == 128
    assert delta(after, before, "by_source", "external_kv_transfer") == PROMPT_LEN - 128
    assert delta(after, before, "by_source", "local_compute") == 0


def test_a_refused_ticket_is_counted_recomputed_and_the_rightful_receiver_still_loads(
    pair: Pair, reference: Reference
) -> None:
    """A decode request with another ticket: load refused (ticket_refused), recomputed; the real params then load."""
    batch = prompts(20, n=1)
    ids = ["tk-0"]
    pouts = prefill_step(pair.prefill, ids, batch)
    good = pouts["tk-0"]["kv_transfer_params"]
    forged = {**good, "kvcore": {**good["kvcore"], "ticket": "ab" * 16}}
    before = pair.decode.metrics()
    outs = decode_step(pair.decode, ["tk-forged"], batch, [forged])
    after = pair.decode.metrics()
    assert outs["tk-forged"]["tokens"] == reference.tokens(batch, MAX_TOKENS)[0]
    assert delta(after, before, "kvcore_load_failures", "ticket_refused") == 1
    assert delta(after, before, "by_source", "local_compute") == PROMPT_LEN
    assert delta(after, before, "by_source", "external_kv_transfer") == 0
    assert "ticket_refused" in pair.decode.log() and "tk-forged" in pair.decode.log()
    # kvcore's own Prometheus export (metrics_port) counts it too.
    with urllib.request.urlopen(f"http://127.0.0.1:{pair.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'kvcore_vllm_load_failures_total\{rank="0",reason="ticket_refused"\} (\S+)', text) or re.search(
        r'kvcore_vllm_load_failures_total\{reason="ticket_refused",rank="0"\} (\S+)', text
    )
    assert m and float(m.group(1)) == after["kvcore_load_failures"]["ticket_refused"], text[-3000:]
    assert "kvcore_requests_finished_total" in text  # kvcore's own families beside the connector's
    # The prefill kept the request for the rightful receiver. (The recompute above left the prompt's full blocks in
    # the decode's prefix cache: those are hits now, and only the rest moves.)
    before = pair.decode.metrics()
    outs = decode_step(pair.decode, ["tk-0"], batch, [good])
    after = pair.decode.metrics()
    assert outs["tk-0"]["tokens"] == reference.tokens(batch, MAX_TOKENS)[0]
    assert delta(after, before, "by_source", "local_compute") == 0
    assert delta(after, before, "by_source", "external_kv_transfer") > 0
    assert (
        delta(after, before, "by_source", "external_kv_transfer") + delta(after, before, "by_source", "local_cache_hit")
        == PROMPT_LEN
    )


def test_malformed_params_are_counted_and_recomputed(pair: Pair, reference: Reference) -> None:
    batch = prompts(30, n=1)
    pouts = prefill_step(pair.prefill, ["bad-0"], batch)
    good = pouts["bad-0"]["kv_transfer_params"]
    bad = {**good, "kvcore": {**good["kvcore"], "version": 99}}
    before = pair.decode.metrics()
    outs = decode_step(pair.decode, ["bad-0"], batch, [bad])
    after = pair.decode.metrics()
    assert outs["bad-0"]["tokens"] == reference.tokens(batch, MAX_TOKENS)[0]
    assert delta(after, before, "kvcore_load_failures", "invalid_params") == 1
    assert delta(after, before, "by_source", "local_compute") == PROMPT_LEN
    assert "invalid_params" in pair.decode.log()
    # Give the prefill its request back so it frees it now.
    decode_step(pair.decode, ["bad-0-ok"], batch, [good])


def test_an_abort_while_the_load_is_in_flight_leaves_both_engines_serving(pair: Pair, reference: Reference) -> None:
    """Push: the prefill is stopped (SIGSTOP) so its writes cannot land; the decode request is aborted meanwhile."""
    if pair.mode != "push":
        pytest.skip("in pull mode the decode reads on its own: a stopped prefill does not hold a load in flight")
    batch = prompts(40, n=1)
    pouts = prefill_step(pair.prefill, ["ab-0"], batch)
    before = pair.decode.metrics()
    pair.prefill.signal_vllm(signal.SIGSTOP)
    try:
        pair.decode.call(
            "submit",
            requests=[
                {
                    "id": "ab-0",
                    "prompt": batch[0],
                    "max_tokens": MAX_TOKENS,
                    "kv_transfer_params": pouts["ab-0"]["kv_transfer_params"],
                }
            ],
        )
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert "ab-0" not in pair.decode.call("step", n=5)["finished"]  # its KV cannot arrive
        pair.decode.call("abort", ids=["ab-0"])
        pair.decode.call("step", n=20)
    finally:
        pair.prefill.signal_vllm(signal.SIGCONT)
    # Both engines go on: the next wave loads every token.
    batch2 = prompts(41, n=2)
    outs = disagg(pair.prefill, pair.decode, "ab-next", batch2)
    after = pair.decode.metrics()
    assert tokens_of(outs, "ab-next", 2) == reference.tokens(batch2, MAX_TOKENS)
    assert delta(after, before, "by_source", "external_kv_transfer") == 2 * PROMPT_LEN
    assert sum(after["kvcore_load_failures"].values()) == sum(before["kvcore_load_failures"].values())
