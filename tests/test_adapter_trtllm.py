"""The TensorRT-LLM adapter (``kvcore.adapters.trtllm``) driven as PyExecutor drives ``KvCacheTransceiver``.

A context instance of two TP ranks (gloo) and two generation instances, each rank a process with real pools; the
test is the disaggregated server (it forwards ``opaque_state``) and steps every rank of an instance alike. Many
requests, cancels on either side (before and after the receive started), a generation instance SIGKILLed with
requests in flight; every byte the generation side got is compared with the oracle's expectation, and every block
the adapter let the engine free is overwritten at once and checked for late writes afterwards.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _adapter_ranks import SPEC, start_instance

from kvcore.runtime import RankProcess

pytestmark = pytest.mark.timeout(300)

SECRET = b"trtllm-adapter-test-secret-0001!"
N = SPEC["requests"]


def _start(role: str, ranks: int, name: str) -> list[RankProcess]:
    return start_instance("_adapter_ranks:trt_rank_main", role, ranks, name, spec=SPEC, secret=SECRET)


def _step(ranks: list[RankProcess], timeout: float = 120, **args: Any) -> dict[str, Any]:
    """One executor iteration on every rank of an instance (the same arguments); the ranks' answers must agree."""
    for p in ranks:
        p.post("step", **args)
    answers = [p.reply("step", timeout) for p in ranks]
    for a in answers[1:]:
        assert {k: a[k] for k in ("completed", "cancelled", "failed", "cancel", "opaque")} == {
            k: answers[0][k] for k in ("completed", "cancelled", "failed", "cancel", "opaque")
        }, "the ranks of one instance reported differently"
    return answers[0]


class _Log:
    """Everything one instance reported, across steps."""

    def __init__(self) -> None:
        self.reported: dict[int, str] = {}
        self.errors: dict[int, str] = {}
        self.verified: dict[int, tuple[int, int, str]] = {}
        self.cancel: dict[int, bool] = {}

    def add(self, a: dict[str, Any]) -> None:
        for kind in ("completed", "cancelled"):
            for r in a[kind]:
                assert r not in self.reported, f"request {r} reported twice"
                self.reported[r] = kind
        for r, err in a["failed"]:
            assert r not in self.reported, f"request {r} reported twice"
            self.reported[r], self.errors[r] = "failed", err
        for r, bad, nbytes, first in a["verified"]:
            self.verified[r] = (bad, nbytes, first)
        for r, ok in a["cancel"]:
            self.cancel[r] = ok


def test_an_executor_loop_through_the_trtllm_adapter_lands_exact_bytes_and_frees_only_when_safe() -> None:
    ctx = _start("context", 2, "trt-ctx")
    gen_a = _start("generation", 1, "trt-gen-a")
    gen_b = _start("generation", 1, "trt-gen-b")
    everyone = ctx + gen_a + gen_b
    try:
        to_b = {20, 21, 22, 23}
        ctx_cancel = {3, 9}
        gen_cancel_after = {5, 13}
        gen_cancel_before = {17}  # the generation side drops it before receiving; the server tells the context
        c_log, a_log = _Log(), _Log()
        for first in range(0, 20, 4):
            batch = list(range(first, first + 4))
            a = _step(ctx, new=batch, cancels=[r for r in batch if r in ctx_cancel | gen_cancel_before])
            c_log.add(a)
            opaque = dict((r, o) for r, o in a["opaque"])
            assert set(opaque) == set(batch) and all(opaque.values())
            g = _step(
                gen_a,
                new=[[r, opaque[r]] for r in batch if r not in gen_cancel_before],
                cancels=[r for r in batch if r in gen_cancel_after | gen_cancel_before],
            )
            a_log.add(g)
        # Generation instance B takes four requests, then dies with them in flight or just finished.
        a = _step(ctx, new=sorted(to_b), cancels=[])
        c_log.add(a)
        opaque = dict((r, o) for r, o in a["opaque"])
        _step(gen_b, new=[[r, opaque[r]] for r in sorted(to_b)], cancels=[])
        gen_b[0].kill()
        # Both instances block until every request they hold is reported (at_least_request_num=None).
        for p in ctx + gen_a:
            p.post("step", new=[], cancels=[], at_least=None)
        answers = [p.reply("step", 120) for p in ctx + gen_a]
        assert answers[0]["completed"] == answers[1]["completed"] and answers[0]["failed"] == answers[1]["failed"]
        c_log.add(answers[0])
        a_log.add(answers[2])
        assert answers[0]["pending"] == 0 and answers[2]["pending"] == 0
        # A request already reported may be freed at once: cancel_request says so.
        c_log.add(_step(ctx, new=[], cancels=[0]))
        a_log.add(_step(gen_a, new=[], cancels=[0]))

        assert sorted(c_log.reported) == list(range(N)), "the context reported every request exactly once"
        received_by_a = set(range(20)) - gen_cancel_before
        assert sorted(a_log.reported) == sorted(received_by_a)
        normal = received_by_a - ctx_cancel - gen_cancel_after
        for r in sorted(normal):
            assert c_log.reported[r] == "completed", (r, c_log.reported[r], c_log.errors.get(r))
            assert a_log.reported[r] == "completed", (r, a_log.reported[r], a_log.errors.get(r))
        for bad, nbytes, first in a_log.verified.values():  # every completed receive, cancelled ones included
            assert bad == 0 and nbytes > 0, first
        assert set(a_log.verified) == {r for r, k in a_log.reported.items() if k == "completed"}
        for r in ctx_cancel | gen_cancel_after:
            assert c_log.cancel.get(r, False) is False and a_log.cancel.get(r, False) is False, r
        assert a_log.cancel[17] is True, "a request never handed to kvcore may be freed at once"
        assert c_log.cancel[17] is False and c_log.reported[17] == "cancelled"
        for r in to_b:  # the dead receiver's requests end on the context (delivered before the kill, or failed)
            assert c_log.reported[r] in ("completed", "failed"), (r, c_log.reported[r])
        assert c_log.cancel[0] is True and a_log.cancel[0] is True

        time.sleep(0.5)  # any write still under way would land now
        for p in ctx + gen_a:
            s = p.call("sentinels", timeout=30)
            assert s["unsafe"] == [], s["unsafe"]
            assert s["broken"] == [], f"{p.name}: blocks written after the adapter let them be freed: {s['broken']}"
            assert s["leaks"] == {}, s["leaks"]
    finally:
        for p in everyone:
            p.close(20)


def test_at_least_request_num_validates_and_none_means_every_pending_request() -> None:
    """A one-rank pair in this process: None blocks for all, 0 never blocks, a bad value is a typed error."""
    from _adapter_ranks import Req
    from _instances import make_rank

    from kvcore import errors as E
    from kvcore.adapters.trtllm import KvcoreCacheTransceiver

    cagent, _, ctx_tx = make_rank("context", "trt-unit-ctx")
    gagent, _, gen_tx = make_rank("generation", "trt-unit-gen")
    try:
        ctx = KvcoreCacheTransceiver(ctx_tx, ticket_secret=SECRET)
        gen = KvcoreCacheTransceiver(gen_tx)
        reqs = [Req(i, 16, [2 * i, 2 * i + 1]) for i in range(6)]
        for r in reqs:
            ctx.respond_and_send_async(r)
        assert ctx.check_context_transfer_status(0).all == []  # nothing asked yet: returns at once
        for r in reqs:
            gen.request_and_receive_async(Req(r.request_id, 16, [10 + 2 * r.request_id, 11 + 2 * r.request_id],
                                              r.opaque_state))  # fmt: skip
        got = gen.check_gen_transfer_status(None)
        assert sorted(got.completed) == list(range(6)) and gen.check_gen_transfer_complete()
        sent = ctx.check_context_transfer_status(None)
        assert sorted(sent.completed) == list(range(6)) and ctx.pending() == []
        with pytest.raises(E.SessionError, match="at_least_request_num"):
            ctx.check_context_transfer_status(-1)
        with pytest.raises(E.SessionError, match="context side"):
            gen.check_context_transfer_status(0)
        with pytest.raises(E.SessionError, match="opaque_state"):
            gen.request_and_receive_async(Req(99, 16, [40]))
        assert ctx.cancel_request(reqs[0]) is True  # reported: free now
    finally:
        for tx, agent in ((ctx_tx, cagent), (gen_tx, gagent)):
            tx.close()
            agent.close()
