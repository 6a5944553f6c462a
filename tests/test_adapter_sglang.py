"""The SGLang adapter (``kvcore.adapters.sglang``) driven as SGLang's prefill and decode schedulers drive a backend.

A prefill instance of two TP ranks (gloo) and two decode instances, each rank a process with real pools; the test
is SGLang's router (it starts each request on a prefill and a decode instance at once, with the same room) and
steps every rank of an instance alike, as SGLang's scheduler polls the same queue on every rank. Chunked prefill,
metadata rows carried with the KV, aborts on either side (before and after the decode's pages are known), a decode
instance SIGKILLed with requests in flight; every byte a decode got is compared with the oracle's expectation, and
every page the adapter let the scheduler free is overwritten at once and checked for late writes afterwards.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from _adapter_ranks import SPEC, start_instance

from kvcore.runtime import RankProcess

pytestmark = pytest.mark.timeout(300)

SECRET = b"sglang-adapter-test-secret-0001!"
N = SPEC["requests"]
SPEC = {**SPEC, "timeout_s": 20.0}  # the lease the dead decode's requests run out on the prefill


def _start(role: str, ranks: int, name: str, ctx_endpoint: str = "") -> list[RankProcess]:
    return start_instance("_adapter_ranks:sglang_rank_main", role, ranks, name, spec=SPEC, secret=SECRET,
                          ctx_endpoint=ctx_endpoint)  # fmt: skip


def _step(ranks: list[RankProcess], timeout: float = 120, **args: Any) -> dict[str, Any]:
    """One scheduler iteration on every rank of an instance; terminal values must agree on every rank.

    Non-terminal values may differ between ranks (SGLang takes their MIN); Success and Failed may not: SGLang frees
    the pages when the MIN is terminal, which must mean every rank is done with them."""
    for p in ranks:
        p.post("step", **{"new": [], "aborts": [], **args})
    answers = [p.reply("step", timeout) for p in ranks]
    for a in answers[1:]:
        assert a["success"] == answers[0]["success"] and a["polls"] == answers[0]["polls"]
        # The same requests failed; each rank names its own error (one saw the peer die, another only the agreement).
        assert [f[0] for f in a["failed"]] == [f[0] for f in answers[0]["failed"]], [x.get("why") for x in answers]
    return answers[0]


class _Log:
    def __init__(self) -> None:
        self.reported: dict[int, str] = {}
        self.errors: dict[int, str] = {}
        self.verified: dict[int, tuple[int, int, str, bool]] = {}

    def add(self, a: dict[str, Any]) -> None:
        for r in a["success"]:
            assert r not in self.reported, f"request {r} reported twice"
            self.reported[r] = "success"
        for r, err in a["failed"]:
            assert r not in self.reported, f"request {r} reported twice"
            self.reported[r], self.errors[r] = "failed", err
        for r, bad, nbytes, first, meta_ok in a["verified"]:
            self.verified[int(r)] = (bad, nbytes, first, meta_ok)


def test_sglang_schedulers_through_the_adapter_land_exact_bytes_and_free_only_when_safe() -> None:
    ctx = _start("context", 2, "sgl-ctx")
    endpoint = ctx[0].info["endpoint"]
    gen_a = _start("generation", 1, "sgl-gen-a", endpoint)
    gen_b = _start("generation", 1, "sgl-gen-b", endpoint)
    everyone = ctx + gen_a + gen_b
    try:
        to_b = [20, 21, 22, 23]
        prefill_abort = {3, 9}  # aborted on the prefill right after its last chunk
        decode_abort = {5, 13}  # aborted on the decode after send_metadata
        held = {7, 17}  # the decode knows the prefill but has no pages yet (expect: the lease is renewed)
        held_abort = {17}  # ... and gives the request up before its pages were allocated
        c_log, a_log, b_log = _Log(), _Log(), _Log()
        for first in range(0, 20, 4):
            batch = list(range(first, first + 4))
            # The router starts each request on both instances at once: prefill and decode in one iteration.
            c_log.add(_step(ctx, new=batch, aborts=[r for r in batch if r in prefill_abort]))
            a_log.add(_step(gen_a, new=batch, hold=[r for r in batch if r in held],
                            aborts=[r for r in batch if r in decode_abort]))  # fmt: skip
        a_log.add(_step(gen_a, meta=[7], aborts=sorted(held_abort)))
        c_log.add(_step(ctx, new=to_b))
        b_log.add(_step(gen_b, new=to_b))
        gen_b[0].kill()
        deadline = time.monotonic() + 90
        while True:
            c, a = _step(ctx), _step(gen_a)
            c_log.add(c)
            a_log.add(a)
            if c["pending"] == 0 and a["pending"] == 0:
                break
            assert time.monotonic() < deadline, f"still pending: prefill {c['states']}, decode {a['states']}"
            time.sleep(0.02)
        assert sorted(c_log.reported) == list(range(N)), "the prefill reported every request exactly once"
        assert sorted(a_log.reported) == list(range(20)), "decode A reported every request exactly once"
        normal = set(range(20)) - prefill_abort - decode_abort - held_abort
        for r in sorted(normal):
            assert c_log.reported[r] == "success", (r, c_log.reported[r], c_log.errors.get(r))
            assert a_log.reported[r] == "success", (r, a_log.reported[r], a_log.errors.get(r))
        for r, (bad, nbytes, first, meta_ok) in a_log.verified.items():  # every Success, aborted ones included
            assert bad == 0 and nbytes > 0, (r, first)
            assert meta_ok, f"request {r}: the prefill's metadata row did not reach the decode's row"
        assert set(a_log.verified) == {r for r, k in a_log.reported.items() if k == "success"}
        assert a_log.reported[17] == "failed" and a_log.errors[17] == "RequestCancelledError"
        for r in to_b:  # the dead decode's requests end on the prefill: delivered before the kill, or failed
            assert c_log.reported[r] in ("success", "failed"), (r, c_log.reported[r])
            if c_log.reported[r] == "failed":  # the decode died (its asks arrived) or never asked (lease ran out)
                assert c_log.errors[r] in ("PeerLostError", "LeaseExpiredError", "TransferFailedError"), c_log.errors
        for r in prefill_abort | held_abort:  # an abort before the decode's pages are written reaches both sides
            assert c_log.errors.get(r) == "RequestCancelledError", (r, c_log.reported[r], c_log.errors.get(r))
            assert a_log.errors.get(r) == "RequestCancelledError", (r, a_log.reported[r], a_log.errors.get(r))
        for r in decode_abort:  # aborted while the write may be under way: cancelled, or landed (and verified)
            assert c_log.errors.get(r, "RequestCancelledError") == "RequestCancelledError", (r, c_log.errors)
            assert a_log.errors.get(r, "RequestCancelledError") == "RequestCancelledError", (r, a_log.errors)
        polls = [p.call("step", new=[], aborts=[], timeout=30)["polls"] for p in ctx]
        assert polls[0] == polls[1], "the prefill ranks ran a different number of collective polls"

        time.sleep(0.5)  # any write still under way would land now
        for p in ctx + gen_a:
            s = p.call("sentinels", timeout=30)
            assert s["unsafe"] == [], s["unsafe"]
            assert s["broken"] == [], f"{p.name}: pages written after the adapter let them be freed: {s['broken']}"
            assert s["leaks"] == {}, s["leaks"]
    finally:
        for p in everyone:
            p.close(20)


class _KVArgs:
    """The fields of SGLang's ``KVArgs`` the adapter reads: one metadata buffer, one row of 4 int32 per request."""

    def __init__(self, rows: int) -> None:
        self.buf = np.zeros((rows, 4), dtype=np.int32)
        self.aux_data_ptrs = [int(self.buf.ctypes.data)]
        self.aux_data_lens = [int(self.buf.nbytes)]
        self.aux_item_lens = [int(self.buf[0].nbytes)]


def _until(mgr_objs: list[Any], want: set[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        got = [o.poll() for o in mgr_objs]
        if all(g in want for g in got):
            return got
        assert time.monotonic() < deadline, got
        time.sleep(0.005)


def test_prefix_hit_chunks_metadata_rows_and_typed_errors_in_one_process() -> None:
    """A decode prefix hit receives only the suffix pages; aborts before kvcore held a request end at once."""
    import torch
    from _instances import make_rank

    from kvcore import errors as E
    from kvcore.adapters.sglang import KvcoreKVManager, KvcoreKVReceiver, KvcoreKVSender, KVPoll

    cagent, ccache, ctx_tx = make_rank("context", "sgl-unit-ctx")
    gagent, gcache, gen_tx = make_rank("generation", "sgl-unit-gen")
    try:
        cargs, gargs = _KVArgs(8), _KVArgs(8)
        pm = KvcoreKVManager(cargs, "prefill", None, transceiver=ctx_tx, ticket_secret=SECRET)
        dm = KvcoreKVManager(gargs, "decode", None, transceiver=gen_tx, ticket_secret=SECRET,
                             endpoint_of=lambda addr: ctx_tx.info_endpoint)  # fmt: skip
        with pytest.raises(E.ConfigError, match="needs a generation transceiver"):
            KvcoreKVManager(gargs, "decode", None, transceiver=ctx_tx, ticket_secret=SECRET)
        with pytest.raises(E.TicketError, match="ticket_secret"):
            KvcoreKVManager(cargs, "prefill", None, transceiver=ctx_tx)
        ccache.normal_()
        gcache.fill_(-1.0)
        # Request 1: 4 pages of 8 tokens (32), prefilled in two chunks; the decode holds the first 16 tokens.
        s = KvcoreKVSender(pm, "127.0.0.1:8998", 1)
        assert s.poll() == KVPoll.WaitingForInput, "no bootstrap gate: the prefill may start at once"
        s.init(4, aux_index=2)
        cargs.buf[2] = [11, 12, 13, 14]
        s.send(np.array([4, 5], dtype=np.int32), num_kv_tokens=16)
        assert s.poll() == KVPoll.WaitingForInput and not s.started
        s.send(np.array([6, 7], dtype=np.int32), num_kv_tokens=16)
        assert s.started
        r = KvcoreKVReceiver(dm, "127.0.0.1:8998", 1)
        assert r.poll() == KVPoll.Bootstrapping
        r.init(0)
        assert r.poll() == KVPoll.WaitingForInput
        gcache[20:22] = 7.0  # the prefix hit: this decode's own pages, which kvcore must leave alone
        r.send_metadata(np.array([22, 23], dtype=np.int32), aux_index=5, decode_prefix_len=16)
        assert _until([s, r], {KVPoll.Success, KVPoll.Failed}) == [KVPoll.Success, KVPoll.Success]
        assert gargs.buf[5].tolist() == [11, 12, 13, 14], "the metadata row travels with the KV"
        assert torch.equal(gcache[22:24], ccache[6:8]), "the suffix pages hold the prefill's pages 6, 7"
        assert bool((gcache[20:22] == 7.0).all()), "the cached prefix pages were not written"
        metric = r.get_transfer_metric()
        assert metric.transfer_total_bytes == int(gcache[22:24].nbytes), metric
        s.clear()
        r.clear()

        # Request 2: aborted on the decode before init (nothing in kvcore): Failed at once, safe to free.
        r2 = KvcoreKVReceiver(dm, "127.0.0.1:8998", 2)
        r2.abort()
        assert r2.poll() == KVPoll.Failed and r2.is_abort_release_safe()
        with pytest.raises(E.RequestCancelledError):
            r2.failure_exception()
        # Request 3: aborted on the prefill after init, before its last chunk: Failed at once, no send after it.
        s3 = KvcoreKVSender(pm, "127.0.0.1:8998", 3)
        s3.init(2)
        s3.send(np.array([0], dtype=np.int32))
        s3.abort()
        assert s3.poll() == KVPoll.Failed
        s3.send(np.array([1], dtype=np.int32))  # SGLang may still flush a chunk: ignored
        assert ctx_tx.status(3) is None

        # Typed errors for scheduler mistakes.
        s4 = KvcoreKVSender(pm, "127.0.0.1:8998", 4)
        with pytest.raises(E.SessionError, match="before init"):
            s4.send(np.array([0], dtype=np.int32))
        s4.init(1)
        with pytest.raises(E.MappingError, match="init\\(\\) said 1"):
            s4.send(np.array([0, 1], dtype=np.int32))
        r5 = KvcoreKVReceiver(dm, "127.0.0.1:8998", 5)
        with pytest.raises(E.SessionError, match="before init"):
            r5.send_metadata(np.array([0], dtype=np.int32))
        r5.init(0)
        with pytest.raises(E.LayoutError, match="2 kinds of extra state"):
            r5.send_metadata(np.array([0], dtype=np.int32), state_indices=[[3], [4, 5]])
        with pytest.raises(E.SessionError, match="bootstrap_room"):
            KvcoreKVReceiver(dm, "127.0.0.1:8998", None)
    finally:
        for tx, agent in ((ctx_tx, cagent), (gen_tx, gagent)):
            tx.close()
            agent.close()
