"""A ``kvcore demo`` rank process: build one rank's storage and ``Transceiver``, send or receive, verify, report.

The orchestrator (:mod:`kvcore.tools.demo.run`) starts each rank as a :class:`kvcore.runtime.RankProcess`
running :func:`rank_main`; what a rank reports travels as msgpack messages on its channel.
"""

from __future__ import annotations

import faulthandler
import os
import time
from typing import Any

from kvcore.params import TransferParams, derive_ticket
from kvcore.runtime import Channel
from kvcore.testing.scenario import DemoSpec, Rank, assignment

__all__ = ["TEARDOWN_WATCHDOG_S", "rank_main"]

#: Seconds a rank may take to close its transceiver, agent and process group before it dumps its stacks.
TEARDOWN_WATCHDOG_S = 8.0


def rank_main(channel: Channel, role: str, rank: int, spec: dict[str, Any], dist_port: int) -> None:
    """A rank process's function (a failure reaches the orchestrator as a typed error naming the rank)."""
    _rank_body(role, rank, DemoSpec(**spec), dist_port, channel)


def _rank_body(role: str, rank: int, spec: DemoSpec, dist_port: int, conn: Channel) -> None:
    import datetime

    import torch

    from kvcore.config import TransceiverConfig, create_agent
    from kvcore.control.collective import LocalCollective, TorchCollective
    from kvcore.transceiver import Transceiver

    torch.set_num_threads(1)
    ctx = role == "context"
    tp, pp, _, _ = spec.side(role)
    world = tp * pp
    if world > 1:
        import torch.distributed as dist

        # A bounded wait: a rank that died must not leave its peers in a collective for gloo's default 30 min.
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{dist_port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=spec.timeout_s + 30),
        )
        collective: Any = TorchCollective()
    else:
        collective = LocalCollective()
    config = TransceiverConfig.load(backend=spec.backend, **spec.config_overrides(role))
    agent = create_agent(config, f"{role}-{rank}-{os.getpid()}")
    tx = None
    try:
        me = Rank(role, rank, spec, agent)
        tx = Transceiver(
            config,
            role=role,
            agent=agent,
            topology=me.topology,
            geometry=me.geometry,
            page_table=me.page_table,
            collective=collective,
            instance_name=f"{role}-demo",
            mamba=me.mamba,
        )
        warm, work = me.mine(spec.warm_ids), me.mine(range(spec.requests))
        if ctx:
            for r in work:
                me.fill(r)
            if rank == 0:
                conn.send(
                    {
                        "kind": "endpoint",
                        "endpoint": tx.info_endpoint,
                        "backend": agent.backend,
                        "incarnation": tx.incarnation,
                    }
                )
            go = conn.recv(spec.timeout_s)
            secret = go["secret"]  # every request's ticket is derived from the run's secret (both sides know it)
            first, stop = me.topology.layer_range
            half = first + (stop - first) // 2 if spec.layerwise else None

            def send(r: int, prompt_len: int, layers: int | None) -> None:
                tx.start_send(
                    r,
                    me.blocks[r],
                    prompt_len=prompt_len,
                    state_slot=me.state_slot(r),
                    layers_ready=layers,
                    ticket=derive_ticket(secret, r),
                    mode=spec.mode,
                )

            for w in warm:
                send(w, spec.tokens_per_block, None)
            if spec.mode == "pull":
                # The parameters of a pull request exist only once start_send ran: send everything, then say so.
                for r in work:
                    send(r, spec.tokens, None)
                conn.send({"kind": "sent"})
            seen: dict[str, Any] = {}
            _drive(tx, collective, spec, warm, seen=seen)
            t0 = time.perf_counter()
            for r in work if spec.mode == "push" else ():
                send(r, spec.tokens, half)
            if spec.layerwise:
                tx.poll()  # let the first slices go out before the rest is declared ready
                for r in work:
                    tx.layers_ready(r, stop)
            outcomes = _drive(tx, collective, spec, work, seen=seen)
            outcomes.pop("paused")
            report = {
                "kind": "report",
                "role": role,
                "rank": rank,
                "seconds": time.perf_counter() - t0,
                "expected": len(work),
                "outcomes": outcomes,
                "stats": tx.stats(),
                "curve": bool(tx.rank_info.curve_public_key),  # this rank serves and connects with CURVE
            }
        else:
            go = conn.recv(spec.timeout_s)
            skip = spec.cached_prefix_blocks
            if spec.mode == "pull":
                conn.recv(spec.timeout_s)  # every context rank has started sending
            ctx_blocks, ctx_slots = assignment(spec, "context")

            def receive(r: int, prompt_len: int, first_block: int) -> None:
                starts[r] = time.perf_counter()
                # What the context's start_send returned, as a router would forward it (rebuilt here from the
                # run's shared facts: the secret, the context's block assignment and its incarnation).
                params = TransferParams.make(
                    r,
                    go["endpoint"],
                    ticket=derive_ticket(go["secret"], r),
                    mode=spec.mode,  # type: ignore[arg-type]
                    dp_rank=spec.dp_group("context", r),
                    prompt_len=prompt_len,
                    block_ids=ctx_blocks[r].tolist() if spec.mode == "pull" else (),
                    state_slot=ctx_slots[r] if spec.mode == "pull" and spec.mamba else -1,
                    incarnation=go["incarnation"] if spec.mode == "pull" else "",
                )
                tx.start_receive(
                    params=params,
                    block_ids=me.blocks[r][first_block:],
                    state_slot=me.state_slot(r),
                    cached_tokens=first_block * spec.tokens_per_block,
                )

            starts: dict[int, float] = {}
            for w in warm:
                receive(w, spec.tokens_per_block, 0)
            first_contact = max(_drive(tx, collective, spec, warm, starts)["latency"], default=0.0)
            t0 = time.perf_counter()
            for r in work:
                receive(r, spec.tokens, skip)
            at_done: dict[int, tuple[int, str]] = {}

            def check_at_done(r: int) -> None:
                # DONE is the promise that every byte is in place: check it now, before release and reuse.
                if r in mine:
                    bad, _, why = me.verify(r, True)
                    at_done[r] = (bad, why.replace(" elements differ", " elements differ at DONE"))

            mine = set(work)
            outcomes = _drive(tx, collective, spec, work, starts, conn if rank == 0 else None, check_at_done)
            paused = outcomes.pop("paused")
            # Until the last request was DONE, without the byte checks made at DONE (they delay only the observing).
            elapsed = max(outcomes["latency"], default=time.perf_counter() - t0 - paused)
            mismatches, checked = 0, 0
            first_bad = next((why for bad, why in at_done.values() if bad), "")
            mismatches_at_done = sum(bad for bad, _ in at_done.values())
            for r in range(spec.requests):
                bad, nbytes, why = me.verify(r, r in mine)
                mismatches += bad
                checked += nbytes
                first_bad = first_bad or why
            report = {
                "kind": "report",
                "role": role,
                "rank": rank,
                "seconds": elapsed,
                "expected": len(work),
                "outcomes": outcomes,
                "first_contact_s": first_contact,
                "verified_bytes": checked,
                "mismatches": mismatches,
                "mismatches_at_done": mismatches_at_done,
                "checked_at_done": len(at_done),
                "first_bad": first_bad,
                "stats": tx.stats(),
                "curve": bool(tx.rank_info.curve_public_key),  # this rank serves and connects with CURVE
            }
        conn.send(report)
        conn.recv(spec.timeout_s)  # hold memory until everyone reported
        # Teardown must be quick; if it is not, show where every thread is before the orchestrator kills us.
        faulthandler.dump_traceback_later(TEARDOWN_WATCHDOG_S, exit=False)
    finally:
        if tx is not None:
            tx.close()
        agent.close()
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _drive(
    tx: Any,
    collective: Any,
    spec: DemoSpec,
    ids: list[int],
    starts: dict[int, float] | None = None,
    progress: Any = None,
    on_done: Any = None,
    seen: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Poll until every rank of the instance has its requests ``ids`` reported and released.

    ``poll`` is collective, and under attention DP ranks wait for different
    requests: every rank keeps polling until all of them are done. ``on_done(rid)``
    runs as soon as a request is reported DONE, before anything of it is released; the time
    it takes is left out of the latencies (transfers go on meanwhile: only observing them waits).
    """
    want = set(ids)
    paused = 0.0
    # ``seen`` carries what polls reported across calls: in pull mode the context ranks start every request
    # before they drive the warm-up ones, and a request reported during that first call counts in the second.
    seen = seen if seen is not None else {}
    states: dict[int, str] = seen.setdefault("states", {})
    errors: dict[int, str] = seen.setdefault("errors", {})
    released: set[int] = seen.setdefault("released", set())
    latency: dict[int, float] = {}
    deadline = time.monotonic() + spec.timeout_s + 10
    while True:
        r = tx.poll()
        now = time.perf_counter() - paused
        if on_done is not None and r.done:
            t0 = time.perf_counter()
            for o in r.done:
                on_done(o.request_id)
            paused += time.perf_counter() - t0
        for o in r.outcomes:
            states[o.request_id] = o.state.value
            if o.error is not None:
                errors[o.request_id] = f"{type(o.error).__name__}: {o.error}"
            if starts is not None and o.request_id in starts:
                latency[o.request_id] = now - starts[o.request_id]
        released.update(r.released)
        if progress is not None and r.outcomes:
            progress.send({"kind": "progress", "n": len(states)})
        flags = collective.allgather(b"\x01" if want <= released else b"\x00")
        if all(f == b"\x01" for f in flags):
            break
        if time.monotonic() > deadline:
            stuck = sorted(want - released)[:8]
            where = {rid: tx.status(rid) for rid in stuck}  # where each one stands here, so a failure explains itself
            raise TimeoutError(
                f"{len(want - released)} request(s) never released: "
                + ", ".join(f"{rid} ({'not held here' if st is None else st.value})" for rid, st in where.items())
                + f"; this rank's counters: { {k: v for k, v in tx.stats().items() if v} }"
            )
        time.sleep(0.0005)
    return {
        "states": {str(k): v for k, v in states.items() if k in want},
        "errors": {str(k): v for k, v in errors.items() if k in want},
        "latency": [latency[k] for k in sorted(latency)],
        "paused": paused,
    }
