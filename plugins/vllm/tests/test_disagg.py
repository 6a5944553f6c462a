"""A prefill and a decode vLLM instance in two processes, KV moved by kvcore through KvcoreConnector.

Each process runs vLLM's real Scheduler and the worker-side connector over
real KV views (see vllm_engine.py); the test is the router: it hands the
prefill's ``kv_transfer_params`` to the decode request, and checks every KV
byte the decode instance holds against the pattern computed here. Both
transfer modes run: pull (the connector's default: the decode side reads) and
push (``"mode": "push"``: the prefill side writes).
"""

from __future__ import annotations

import signal
import time
from typing import Any

import numpy as np
import pytest
from vllm_engine import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, NUM_LAYERS, SAMPLED_TOKEN, token_bytes

TOKEN_NBYTES = NUM_KV_HEADS * 2 * HEAD_SIZE * 4


def expected_kv(seed: int, prompt_len: int) -> bytes:
    return b"".join(
        token_bytes(seed, layer, pos, TOKEN_NBYTES).tobytes()
        for layer in range(NUM_LAYERS)
        for pos in range(prompt_len)
    )


def assert_kv(actual_hex: str, seed: int, prompt_len: int) -> None:
    actual = np.frombuffer(bytes.fromhex(actual_hex), dtype=np.uint8)
    expected = np.frombuffer(expected_kv(seed, prompt_len), dtype=np.uint8)
    assert actual.size == expected.size, f"got {actual.size} KV bytes, expected {expected.size}"
    bad = np.flatnonzero(actual != expected)
    if bad.size:
        token = int(bad[0]) // TOKEN_NBYTES
        layer, pos = divmod(token, prompt_len)
        raise AssertionError(f"{bad.size} KV bytes differ; first in layer {layer}, token {pos}")


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i) % 997 + 1 for i in range(n)]


def spec(role: str, backend: str, model_dir: str, mode: str | None = None, **more: Any) -> dict[str, Any]:
    """An engine process's spec; ``mode`` None leaves the connector's default (pull) in place."""
    extra = dict(more.pop("extra", {}))
    if mode is not None:
        extra["mode"] = mode
    return {
        "role": role,
        "backend": backend,
        "model_dir": model_dir,
        "engine_id": f"{role}-engine",
        # The shm agent exposes only memory it allocated: the decode side's for push, the prefill side's for pull.
        "shm_backing": backend == "shm",
        "extra": extra,
        **more,
    }


def prefill(p: Any, rid: str, n: int, seed: int, mode: str | None = None) -> dict[str, Any]:
    """Run request ``rid``'s prefill on ``p``; the kv_transfer_params it returns (what a router forwards)."""
    p.send(op="add", id=rid, prompt=prompt_of(n, seed), max_tokens=1, params={"do_remote_decode": True}, seed=seed)
    done = p.wait("finished", id=rid)
    assert done["tokens"] == [SAMPLED_TOKEN]
    params = done["params"]
    kv = params["kvcore"]  # kvcore.TransferParams.to_dict(), forwarded as it is
    assert params["do_remote_prefill"] is True and kv["prompt_len"] == n and kv["request_id"] == rid
    assert kv.get("mode", "push") == (mode or "pull") and len(bytes.fromhex(kv["ticket"])) == 16
    if kv.get("mode") == "pull":
        assert len(kv["block_ids"]) == -(-n // BLOCK_SIZE) and kv["incarnation"]
    return params


def assert_idle(e: Any, free_blocks: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        s = e.state()
        # kvcore's own leak check: every per-request resource (sessions, quarantine, leases, transfers) released.
        idle = s["requests"] == 0 and s["free_blocks"] == free_blocks and s["pending"] == 0 and s["leaks"] == {}
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, f"{e.spec['role']} not back to baseline ({free_blocks} free blocks): {s}"


@pytest.mark.parametrize(
    ("backend", "layout", "mode"),
    [
        ("shm", "LBHNC", None),  # the default: pull
        ("shm", "LBHNC", "push"),
        ("shm", "LBNHC", "pull"),
        ("shm", "LBNHC", "push"),
        ("nixl", "LBHNC", "pull"),
        ("nixl", "LBHNC", "push"),
    ],
)
def test_prefill_to_decode_every_byte(
    engines: Any, model_dir: str, backend: str, layout: str, mode: str | None
) -> None:
    p = engines(**spec("prefill", backend, model_dir, mode, layout=layout))
    d = engines(**spec("decode", backend, model_dir, mode, layout=layout))
    base_p, base_d = p.ready["free_blocks"], d.ready["free_blocks"]
    # Lengths: inside one block, exactly two blocks, a partial last block.
    for i, n in enumerate((5, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE + 7)):
        rid, seed = f"req-{i}", 100 + i
        params = prefill(p, rid, n, seed, mode)
        d.send(op="add", id=rid, prompt=prompt_of(n, seed), max_tokens=2, params=params, seed=seed)
        assert_kv(d.wait("loaded", id=rid)["kv"], seed, n)
        done = d.wait("finished", id=rid)
        assert done["tokens"] == [SAMPLED_TOKEN] and "length" in done["reason"].lower()
        p.wait("freed", id=rid)  # the prefill's blocks go back only after kvcore released the send
        d.wait("freed", id=rid)
    assert_idle(p, base_p)
    assert_idle(d, base_d)
    # get_kv_connector_stats -> KVConnectorOutput -> SchedulerStats, as vLLM's loggers see them.
    lengths = (5, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE + 7)
    moved = sum(NUM_LAYERS * -(-n // BLOCK_SIZE) * BLOCK_SIZE * TOKEN_NBYTES for n in lengths)
    for e in (p, d):
        stats = e.state()["connector_stats"]
        assert stats["transfers_done"] == 3 and stats["transfers_failed"] == 0, stats
    assert d.state()["connector_stats"]["bytes_moved"] == moved


@pytest.mark.parametrize(("backend", "mode"), [("shm", "pull"), ("shm", "push"), ("nixl", "pull"), ("nixl", "push")])
def test_context_dies_load_error_and_blocks_freed(engines: Any, model_dir: str, backend: str, mode: str) -> None:
    extra = {"first_contact_timeout_s": 3.0, "request_timeout_s": 10.0}
    p = engines(**spec("prefill", backend, model_dir, mode, extra=extra))
    d = engines(**spec("decode", backend, model_dir, mode, extra=extra))
    base_d = d.ready["free_blocks"]
    params = prefill(p, "doomed", 40, 7, mode)
    p.signal(signal.SIGKILL)
    p.wait_exit(timeout=10)
    d.send(op="add", id="doomed", prompt=prompt_of(40, 7), max_tokens=2, params=params, seed=7)
    done = d.wait("finished", id="doomed", timeout=60)
    assert "error" in done["reason"].lower()  # kv_load_failure_policy="fail": vLLM fails the request
    assert not [e for e in d.events if e.get("event") == "loaded"]
    d.wait("freed", id="doomed")
    assert_idle(d, base_d)


@pytest.mark.parametrize("backend", ["shm", "nixl"])
def test_decode_abort_holds_blocks_until_the_writer_is_done(engines: Any, model_dir: str, backend: str) -> None:
    # Push: the prefill writes into the decode's blocks, so an aborted receive must keep them until it is settled.
    p = engines(**spec("prefill", backend, model_dir, "push"))
    d = engines(**spec("decode", backend, model_dir, "push"))
    base_p, base_d = p.ready["free_blocks"], d.ready["free_blocks"]
    # First contact happens on a normal request, so the stopped prefill below is a known, live peer.
    params = prefill(p, "warm", 20, 1, "push")
    d.send(op="add", id="warm", prompt=prompt_of(20, 1), max_tokens=2, params=params, seed=1)
    assert_kv(d.wait("loaded", id="warm")["kv"], 1, 20)
    d.wait("freed", id="warm")
    p.wait("freed", id="warm")

    params = prefill(p, "aborted", 40, 2, "push")
    p.signal(signal.SIGSTOP)  # the writer exists but cannot answer
    d.send(op="add", id="aborted", prompt=prompt_of(40, 2), max_tokens=2, params=params, seed=2)
    time.sleep(1.0)
    d.send(op="abort", id="aborted")
    time.sleep(1.0)
    held = d.state()
    assert held["requests"] == 1 and held["free_blocks"] < base_d, f"blocks freed while the writer may write: {held}"
    p.signal(signal.SIGCONT)
    d.wait("freed", id="aborted", timeout=60)
    p.wait("freed", id="aborted", timeout=60)
    assert not [e for e in d.events if e.get("event") == "loaded" and e.get("id") == "aborted"]
    assert_idle(p, base_p)
    assert_idle(d, base_d)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_prefix_cache_hit_moves_only_the_suffix(engines: Any, model_dir: str, mode: str) -> None:
    # The prefill recomputes every token (no prefix cache) with a new pattern for the second request; the decode
    # instance caches the first request's blocks. If kvcore moved more than the uncached suffix, the decode side
    # would hold the second pattern in its cached prefix.
    p = engines(**spec("prefill", "shm", model_dir, mode, prefix_caching=False))
    d = engines(**spec("decode", "shm", model_dir, mode))
    n, cached = 3 * BLOCK_SIZE, 2 * BLOCK_SIZE  # vLLM caps a local hit below the last token: 2 full blocks
    prompt = prompt_of(n, 1)
    params = prefill(p, "first", n, 11, mode)
    d.send(op="add", id="first", prompt=prompt, max_tokens=2, params=params, seed=11)
    assert_kv(d.wait("loaded", id="first")["kv"], 11, n)
    d.wait("freed", id="first")
    p.send(op="add", id="second", prompt=prompt, max_tokens=1, params={"do_remote_decode": True}, seed=22)
    params = p.wait("finished", id="second")["params"]
    d.send(op="add", id="second", prompt=prompt, max_tokens=2, params=params, seed=22)
    got = bytes.fromhex(d.wait("loaded", id="second")["kv"])
    per_layer = n * TOKEN_NBYTES
    for layer in range(NUM_LAYERS):
        for pos in range(n):
            seed = 11 if pos < cached else 22
            at = layer * per_layer + pos * TOKEN_NBYTES
            want = token_bytes(seed, layer, pos, TOKEN_NBYTES).tobytes()
            assert got[at : at + TOKEN_NBYTES] == want, f"layer {layer} token {pos}: expected seed {seed}'s bytes"
    d.wait("freed", id="second")
    p.wait("freed", id="second")


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_prefill_aborted_after_its_send_started_early_is_cancelled_then_freed(
    engines: Any, model_dir: str, mode: str
) -> None:
    # The step that computes the prompt's last token starts the send early (its metadata); the request is aborted
    # before vLLM finishes it (async scheduling's window). kvcore cancels the send; vLLM frees the blocks only
    # once kvcore released it (finished_sending after request_finished), and no parameters go out.
    p = engines(**spec("prefill", "shm", model_dir, mode))
    base = p.ready["free_blocks"]
    p.send_many(
        {"op": "add", "id": "cut", "prompt": prompt_of(40, 5), "max_tokens": 1, "params": {"do_remote_decode": True},
         "seed": 5},
        {"op": "abort_after_schedule", "id": "cut"},
    )  # fmt: skip
    p.wait("freed", id="cut", timeout=60)
    assert_idle(p, base)
    stats = p.state()["connector_stats"]
    assert stats.get("sends_started_early") == 1 and stats.get("transfers_cancelled") == 1, stats
    assert not stats.get("transfers_done"), stats
    assert not any(e.get("event") == "finished" and e.get("params") for e in p.events), p.events


def test_a_proxy_prefill_starts_its_send_in_the_step_of_its_last_prompt_token(engines: Any, model_dir: str) -> None:
    # max_tokens 1 and do_remote_decode: the send starts early; max_tokens 2: from request_finished (not early).
    p = engines(**spec("prefill", "shm", model_dir, "pull"))
    prefill(p, "early", 40, 6, "pull")
    p.send(op="add", id="late", prompt=prompt_of(40, 7), max_tokens=2, params={"do_remote_decode": True}, seed=7)
    done = p.wait("finished", id="late")
    assert done["params"]["kvcore"]["prompt_len"] == 40 and len(done["params"]["kvcore"]["block_ids"]) == -(
        -40 // BLOCK_SIZE
    )
    deadline = time.monotonic() + 30
    while (stats := p.state()["connector_stats"]).get("sends_started", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats.get("sends_started") == 2 and stats.get("sends_started_early") == 1, stats


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_frees_blocks_when_no_decode_ever_asks(engines: Any, model_dir: str, mode: str) -> None:
    # The router lost the parameters: the request's lease (request_timeout_s, never renewed) bounds how long the
    # prefill holds the blocks; kvcore reports it failed (LeaseExpiredError) and the connector frees them.
    p = engines(**spec("prefill", "shm", model_dir, mode, extra={"request_timeout_s": 3.0, "lease_s": 3.0}))
    base = p.ready["free_blocks"]
    prefill(p, "orphan", 40, 3, mode)
    held = p.state()
    assert held["requests"] == 1 and held["free_blocks"] < base
    p.wait("freed", id="orphan", timeout=60)
    assert_idle(p, base)
    stats = p.state()["connector_stats"]
    assert stats.get("transfers_failed") == 1 and not stats.get("transfers_done"), stats


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_state(ranks: list[Any]) -> list[dict[str, Any]]:
    for r in ranks:  # every rank steps on "state": ask all before waiting (the poll is collective)
        r.ask_state()
    return [r.state_reply() for r in ranks]


@pytest.mark.parametrize(
    ("backend", "layout", "mode"),
    [("shm", "LBHNC", "pull"), ("shm", "LBNHC", "push"), ("nixl", "LBHNC", "pull"), ("nixl", "LBNHC", "push")],
)
def test_prefill_tp1_to_decode_tp2(engines: Any, model_dir: str, backend: str, layout: str, mode: str) -> None:
    # Heterogeneous TP: the prefill holds both KV heads, each decode rank one (kvcore-mixers re-shards).
    # The decode instance is two processes (TP ranks over gloo, vLLM's distributed state initialized as on a
    # CPU worker), each with a scheduler replica; each worker polls kvcore on its own and vLLM's
    # KVOutputAggregator combines their outputs every step (see vllm_engine.Engine.aggregate).
    p = engines(**spec("prefill", backend, model_dir, mode, layout=layout))
    port = _free_port()
    ranks = [
        engines(
            wait_ready=False,
            **spec("decode", backend, model_dir, mode, layout=layout, tp_size=2, tp_rank=r, dist_port=port),
        )
        for r in range(2)
    ]
    for r in ranks:
        r.ready = r.wait("ready", timeout=180)
    base_p, base_d = p.ready["free_blocks"], ranks[0].ready["free_blocks"]
    per_rank = TOKEN_NBYTES // 2
    for i, n in enumerate((5, 2 * BLOCK_SIZE + 3)):
        rid, seed = f"tp-{i}", 300 + i
        params = prefill(p, rid, n, seed, mode)
        for r in ranks:
            r.send(op="add", id=rid, prompt=prompt_of(n, seed), max_tokens=2, params=params, seed=seed)
        for tp_rank, r in enumerate(ranks):
            got = bytes.fromhex(r.wait("loaded", id=rid)["kv"])
            want = b"".join(
                token_bytes(seed, layer, pos, TOKEN_NBYTES).reshape(2, -1)[tp_rank].tobytes()
                for layer in range(NUM_LAYERS)
                for pos in range(n)
            )
            assert len(got) == len(want) == NUM_LAYERS * n * per_rank
            assert got == want, f"decode TP rank {tp_rank}: KV differs from head {tp_rank} of the prefill's"
        for r in ranks:
            r.wait("finished", id=rid)
            r.wait("freed", id=rid)
        p.wait("freed", id=rid)
    assert_idle(p, base_p)
    for s in _group_state(ranks):
        assert s["requests"] == 0 and s["free_blocks"] == base_d and s["pending"] == 0, s


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_abort_before_scheduling_releases_the_prefill(engines: Any, model_dir: str, mode: str) -> None:
    # The decode request is aborted in the same step it arrives, before vLLM ever allocates for it. The prefill
    # must not hold its blocks until its (here very long) request_timeout_s: the decode side tells it to release.
    extra = {"request_timeout_s": 600.0}
    p = engines(**spec("prefill", "shm", model_dir, mode, extra=extra))
    d = engines(**spec("decode", "shm", model_dir, mode, extra=extra))
    base_p, base_d = p.ready["free_blocks"], d.ready["free_blocks"]
    params = prefill(p, "never", 40, 5, mode)
    d.send_many(  # read together: both act before the first schedule
        {"op": "add", "id": "never", "prompt": prompt_of(40, 5), "max_tokens": 2, "params": params, "seed": 5},
        {"op": "abort", "id": "never"},
    )
    d.wait("freed", id="never")
    p.wait("freed", id="never", timeout=120)
    assert not [e for e in d.events if e.get("event") == "loaded"]
    assert_idle(p, base_p)
    assert_idle(d, base_d)


@pytest.mark.parametrize(
    ("policy", "reason", "mode"),
    [("fail", "error", "pull"), ("recompute", "length", "pull"), ("fail", "error", "push")],
)
def test_decode_too_late_for_the_prefill_lease(
    engines: Any, model_dir: str, policy: str, reason: str, mode: str
) -> None:
    # A decode instance that comes after the prefill's lease ran out (nobody renewed it) finds the send gone. The
    # load fails cleanly (get_block_ids_with_load_errors); vLLM then fails the request or recomputes it locally
    # (kv_load_failure_policy).
    p = engines(**spec("prefill", "shm", model_dir, mode, extra={"request_timeout_s": 2.0, "lease_s": 2.0}))
    d = engines(
        **spec("decode", "shm", model_dir, mode, extra={"request_timeout_s": 4.0}, kv_load_failure_policy=policy)
    )
    base_p, base_d = p.ready["free_blocks"], d.ready["free_blocks"]
    params = prefill(p, "late", 40, 9, mode)
    p.wait("freed", id="late", timeout=60)  # the prefill gave up on it
    d.send(op="add", id="late", prompt=prompt_of(40, 9), max_tokens=2, params=params, seed=9)
    done = d.wait("finished", id="late", timeout=60)
    assert reason in done["reason"].lower(), done
    d.wait("freed", id="late")
    assert_idle(p, base_p)
    assert_idle(d, base_d)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_without_the_ticket_gets_nothing(engines: Any, model_dir: str, mode: str) -> None:
    # The context serves a request only to a receiver presenting its ticket (from the parameters). A decode request
    # with forged parameters (another ticket) fails its load; the prefill keeps the request for its rightful
    # receiver, which then loads every byte.
    p = engines(**spec("prefill", "shm", model_dir, mode, extra={"request_timeout_s": 60.0}))
    d = engines(**spec("decode", "shm", model_dir, mode, extra={"request_timeout_s": 6.0}))
    base_p, base_d = p.ready["free_blocks"], d.ready["free_blocks"]
    params = prefill(p, "secret", 40, 4, mode)
    forged = {**params, "kvcore": {**params["kvcore"], "ticket": "ab" * 16}}
    d.send(op="add", id="secret", prompt=prompt_of(40, 4), max_tokens=2, params=forged, seed=4)
    done = d.wait("finished", id="secret", timeout=60)
    assert "error" in done["reason"].lower(), done  # kv_load_failure_policy="fail"
    assert not [e for e in d.events if e.get("event") == "loaded"]
    d.wait("freed", id="secret")
    held = p.state()
    assert held["requests"] == 1 and held["free_blocks"] < base_p, f"the prefill let a stranger end it: {held}"
    assert held["kvcore"]["tickets_refused"] >= 1, held["kvcore"]
    d.send(op="add", id="secret", prompt=prompt_of(40, 4), max_tokens=2, params=params, seed=4)
    assert_kv(d.wait("loaded", id="secret")["kv"], 4, 40)
    d.wait("freed", id="secret")
    p.wait("freed", id="secret")
    assert_idle(p, base_p)
    assert_idle(d, base_d)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_expected_requests_keep_the_prefill_lease_while_decode_waits_for_blocks(
    engines: Any, model_dir: str, mode: str
) -> None:
    # The decode instance is full: remote requests wait for blocks (vLLM keeps them WAITING, and looks only at the
    # head of its queue) while the engine makes no progress for several prefill leases. The connector announced
    # each on arrival (Transceiver.expect), so kvcore renews the prefill's leases; once blocks free up, every byte
    # arrives. One of them is aborted while expected: the prefill frees it at once, not at max_lease_s.
    lease = {"request_timeout_s": 2.0, "lease_s": 2.0, "max_lease_s": 300.0}
    p = engines(**spec("prefill", "shm", model_dir, mode, extra=lease))
    # kvcore renews every lease_s / 3 of the *receiver's* configuration: both sides must agree on lease_s.
    d = engines(**spec("decode", "shm", model_dir, mode, num_blocks=16, extra={"lease_s": 2.0, "max_lease_s": 300.0}))
    base_p, base_d = p.ready["free_blocks"], d.ready["free_blocks"]
    # First contact on a normal request, so the renewals below start at once.
    params = prefill(p, "warm", 20, 1, mode)
    d.send(op="add", id="warm", prompt=prompt_of(20, 1), max_tokens=2, params=params, seed=1)
    assert_kv(d.wait("loaded", id="warm")["kv"], 1, 20)
    d.wait("freed", id="warm")
    p.wait("freed", id="warm")
    remote = {rid: prefill(p, rid, 40, seed, mode) for rid, seed in (("patient", 6), ("queued", 7), ("quitter", 8))}
    # In one step: a local request takes all but 2 of the decode's blocks; each remote one needs 3, so they wait.
    hog_len = (base_d - 2) * BLOCK_SIZE - 4
    d.send_many(
        {"op": "add", "id": "hog", "prompt": prompt_of(hog_len, 9), "max_tokens": 3, "params": None, "seed": 9},
        *(
            {
                "op": "add",
                "id": rid,
                "prompt": prompt_of(40, seed),
                "max_tokens": 2,
                "params": remote[rid],
                "seed": seed,
            }
            for rid, seed in (("patient", 6), ("queued", 7), ("quitter", 8))
        ),
        then_freeze=7.0,  # then the engine stalls for 3.5 prefill leases
    )
    frozen = d.wait("frozen", timeout=60)
    for rid in ("patient", "queued", "quitter"):
        state = frozen["requests"][rid]
        assert "WAITING" in state and "REMOTE" not in state, frozen  # not allocated: only expected
    assert frozen["free_blocks"] < 3, frozen
    d.send(op="abort", id="quitter")  # read at the thaw, before the next step
    d.wait("thawed", timeout=60)
    p.state()  # reads every event the prefill emitted so far
    freed = [e["id"] for e in p.events if e.get("event") == "freed"]
    assert not freed, f"the prefill freed expected requests {freed}: their leases were not renewed"
    p.wait("freed", id="quitter", timeout=60)  # told at once; its lease alone would hold it for 300 s
    for rid, seed in (("patient", 6), ("queued", 7)):
        assert_kv(d.wait("loaded", id=rid, timeout=60)["kv"], seed, 40)
        d.wait("freed", id=rid)
        p.wait("freed", id=rid)
    d.wait("freed", id="hog", timeout=60)
    assert_idle(p, base_p)
    assert_idle(d, base_d)
    stats = p.state()["connector_stats"]
    assert stats.get("transfers_done") == 4 and not stats.get("transfers_failed"), stats
