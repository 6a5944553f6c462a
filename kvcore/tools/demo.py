"""``kvcore demo``: a context instance and a generation instance as separate processes, every byte verified.

The orchestrator (this process) spawns ``ctx_tp*ctx_pp`` context ranks and
``gen_tp*gen_pp`` generation ranks. Ranks of one instance agree through a gloo
process group. Context ranks fill their KV pools (and Mamba state slots) with
values derived from (request, layer, kv, head, token, dim); generation ranks
receive N requests concurrently, then compare every received byte with the
same formula computed independently on their own shard, and check that every
byte nothing may write (a cached prefix, another DP group's request) is still
zero. Each rank is a :class:`kvcore.runtime.RankProcess`; orchestration
messages are msgpack frames, never pickle.

What a run can cover: any TP/PP on each side (uneven PP splits too), GQA with
fewer KV heads than TP (replicated heads), MLA (one latent "head", replicated
on every TP rank), attention DP on either side (request ``r`` belongs to DP
group ``r % dp_size`` of each instance), a Mamba-hybrid model (conv state
sectioned ``x|B|C`` and SSM state head-sharded, one slot per request),
head-major or token-major block order, a cached prefix, and the bounce-buffer
setting of the transceiver.

``--auth`` turns CurveZMQ on for every rank of both instances, with a fresh
key pair per instance (:func:`instance_keys`). ``--two-hosts`` runs the
context instance and the generation instance in two namespaced hosts
(:mod:`kvcore.tools.demo_hosts`, built on :mod:`kvcore.runtime.hosts`).

The oracles (:func:`heads_of_rank`, :func:`layers_of_rank`,
:func:`conv_channels_of_rank`, :func:`ssm_heads_of_rank`, :func:`expected_values`,
:func:`expected_conv`, :func:`expected_ssm`) are written from the model
definition and never call kvcore's sharding or mapping code; they live in
:mod:`kvcore.testing.oracle`, the one oracle the tests and plugins use too.

Why one module of this length: the orchestrator, the rank processes' body and the summary table of one CLI
command; the scenario itself (spec, rank storage, oracle view) lives in :mod:`kvcore.testing.scenario`.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, fields, replace
from typing import Any, get_args

from kvcore.layout.topology import BlockOrder
from kvcore.params import TransferParams, derive_ticket
from kvcore.runtime import Channel, RankExitedError, RankProcess, StartMethod, ready
from kvcore.testing.oracle import (
    conv_channels_of_rank,
    expected_conv,
    expected_ssm,
    expected_values,
    heads_of_rank,
    layers_of_rank,
    ssm_heads_of_rank,
)
from kvcore.testing.scenario import BOUNCE_MODES, MAX_PROCESSES, DemoSpec, Rank, assignment

__all__ = [
    "BOUNCE_MODES",
    "MAX_PROCESSES",
    "DemoSpec",
    "add_parser",
    "conv_channels_of_rank",
    "expected_conv",
    "expected_ssm",
    "expected_values",
    "heads_of_rank",
    "instance_keys",
    "layers_of_rank",
    "run_demo",
    "ssm_heads_of_rank",
]

#: Seconds a rank may take to close its transceiver, agent and process group before it dumps its stacks.
_TEARDOWN_WATCHDOG_S = 8.0


def _rank_main(channel: Channel, role: str, rank: int, spec: dict[str, Any], dist_port: int) -> None:
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
        faulthandler.dump_traceback_later(_TEARDOWN_WATCHDOG_S, exit=False)
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


# --- orchestrator --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_method() -> StartMethod:
    """``forkserver`` with torch preloaded where available (one torch import for all ranks), else a subprocess each."""
    if "forkserver" in mp.get_all_start_methods() and os.environ.get("KVCORE_DEMO_START", "forkserver") == "forkserver":
        return StartMethod.FORKSERVER
    return StartMethod.SUBPROCESS


#: What the forkserver imports once for every rank it starts.
_PRELOAD = ("torch", "torch.distributed", "numpy", "msgspec", "kvcore.tools.demo")


def _leaks(stats: dict[str, int]) -> dict[str, int]:
    """Live per-request resources left over (sessions, leases, transfers...): all must be back at zero."""
    from kvcore.transceiver import leaks

    return leaks(stats)


class _Ranks:
    """The rank processes of one run; collects their messages, notices deaths."""

    def __init__(self) -> None:
        self.procs: dict[tuple[str, int], RankProcess] = {}
        self.stopped: dict[str, Any] | None = None

    def start(self, role: str, rank: int, spec: DemoSpec, dist_port: int) -> None:
        method = _start_method()
        self.procs[(role, rank)] = RankProcess(
            "kvcore.tools.demo:_rank_main",
            name=f"{role} rank {rank}",
            kwargs={"role": role, "rank": rank, "spec": asdict(spec), "dist_port": dist_port},
            start=method,
            preload=_PRELOAD if method is StartMethod.FORKSERVER else (),
        )

    def send(self, keys: list[tuple[str, int]], message: dict[str, Any]) -> None:
        for k in keys:
            self.procs[k].send(message)

    def wait(self, keys: list[tuple[str, int]], deadline: float, on_progress: Any = None) -> dict[tuple[str, int], Any]:
        """The next non-progress message of each rank in ``keys``; a rank's error or death raises at once."""
        out: dict[tuple[str, int], Any] = {}
        pending = {self.procs[k]: k for k in keys}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message from {sorted(pending.values())} in time")
            for p in ready(list(pending), min(left, 0.5)):
                while p in pending and (m := p.try_recv()) is not None:  # a failure or death raises here
                    if m["kind"] == "progress":
                        if on_progress is not None:
                            on_progress(m["n"])
                        continue
                    out[pending.pop(p)] = m
            for p in list(pending):
                if not p.alive() and p.try_recv() is None:
                    raise RankExitedError(rank=p.name, op="report", exitcode=p.exitcode)
        return out

    def stop(self, grace: float) -> dict[str, Any]:
        """Join every rank within ``grace`` seconds in all, then kill what is left; idempotent.

        Returns the ranks that had to be killed and those that exited non-zero.
        """
        if self.stopped is not None:
            return self.stopped
        end = time.monotonic() + grace
        for p in self.procs.values():
            p.join(max(0.0, end - time.monotonic()))
        killed = [f"{role}{rank}" for (role, rank), p in self.procs.items() if p.alive()]
        for p in self.procs.values():
            if p.alive():
                p.kill()
        for p in self.procs.values():
            p.close(5.0)
        failed = {
            f"{role}{rank}": p.exitcode
            for (role, rank), p in self.procs.items()
            if p.exitcode and f"{role}{rank}" not in killed
        }
        self.stopped = {"killed": killed, "exit_codes": failed}
        return self.stopped


@contextlib.contextmanager
def instance_keys() -> Iterator[dict[str, dict[str, str]]]:
    """A fresh CURVE key pair per instance in a private temporary directory; yields each role's ``auth_*`` fields.

    The directory is mode 0700 and each secret file 0600 (``write_key_pair``);
    both public ``*.key`` files sit in it, so it is the allow-list
    (``auth_allowed_keys_dir``) of every rank of both instances. Generation
    ranks are told the context's public key (``auth_server_key``): the key its
    info endpoint must prove. The context learns each generation rank's key
    from its ``RankInfo``, which arrives over the authenticated link. The
    directory and every key in it are removed when the block ends, also after
    a failure.
    """
    from kvcore.control.auth import AuthConfig, write_key_pair

    keydir = tempfile.mkdtemp(prefix="kvcore-demo-keys-")  # mkdtemp: mode 0700, owned by this user only
    try:
        os.chmod(keydir, 0o700)
        _, ctx_secret = write_key_pair(keydir, "context")
        _, gen_secret = write_key_pair(keydir, "generation")
        ctx_public = AuthConfig.from_files(ctx_secret).public_key.decode()
        yield {
            "context": {"auth_key_file": str(ctx_secret), "auth_allowed_keys_dir": keydir},
            "generation": {
                "auth_key_file": str(gen_secret),
                "auth_allowed_keys_dir": keydir,
                "auth_server_key": ctx_public,
            },
        }
    finally:
        shutil.rmtree(keydir, ignore_errors=True)


def run_demo(spec: DemoSpec, *, progress: bool = True) -> dict[str, Any]:
    """Run the whole demo and return the summary (raises nothing for transfer failures: see ``ok``).

    ``spec.auth`` without ``spec.auth_config``: fresh instance keys for this run
    (:func:`instance_keys`). ``spec.two_hosts``: the instances run in two
    namespaced hosts (:func:`kvcore.tools.demo_hosts.run_two_hosts`).
    """
    spec.validate()
    if spec.two_hosts:
        from kvcore.tools.demo_hosts import validate_two_hosts

        validate_two_hosts(spec)  # before any key or process is made
    if spec.auth and not spec.auth_config:
        with instance_keys() as keys:
            summary = run_demo(replace(spec, auth_config=keys), progress=progress)
        summary["spec"]["auth_config"] = {}  # the paths are gone with the keys
        return summary
    if spec.two_hosts:
        from kvcore.tools.demo_hosts import run_two_hosts

        return run_two_hosts(spec)
    return _run_local(spec, progress=progress)


def _run_local(spec: DemoSpec, *, progress: bool) -> dict[str, Any]:
    """Both instances as child processes of this one (the default)."""
    import numpy as np

    ranks = _Ranks()
    summary: dict[str, Any] = {"spec": asdict(spec), "ok": False}
    bar = None
    try:
        for role in ("context", "generation"):
            tp, pp, _, _ = spec.side(role)
            port = _free_port()
            for rank in range(tp * pp):
                ranks.start(role, rank, spec, port)
        t_spawned = time.monotonic()
        first = ranks.wait([("context", 0)], t_spawned + spec.timeout_s)[("context", 0)]
        t_ready = time.monotonic()
        summary["backend"] = first["backend"]
        secret = os.urandom(32)  # the run's ticket secret: only this driver and its ranks know it
        go = {"kind": "go", "endpoint": first["endpoint"], "secret": secret, "incarnation": first["incarnation"]}
        ranks.send(list(ranks.procs), go)
        gen_keys = [k for k in ranks.procs if k[0] == "generation"]
        if spec.mode == "pull":
            ranks.wait([k for k in ranks.procs if k[0] == "context"], time.monotonic() + spec.timeout_s)
            ranks.send(gen_keys, {"kind": "sent"})
        shown = len([r for r in range(spec.requests) if spec.dp_group("generation", r) == 0])
        on_progress = None
        if progress:
            from rich.progress import Progress

            bar = Progress(transient=True)
            bar.start()
            task = bar.add_task(f"moving {spec.requests} requests ({summary['backend']})", total=shown)

            def on_progress(n: int) -> None:
                bar.update(task, completed=n)

        reports = ranks.wait(list(ranks.procs), time.monotonic() + 2 * spec.timeout_s + 60, on_progress)
        ranks.send(list(ranks.procs), {"kind": "exit"})
        t_done = time.monotonic()
        # Every rank must close its transceiver, agent and process group by itself, promptly.
        teardown = ranks.stop(grace=_TEARDOWN_WATCHDOG_S + 2)
        summary["phases_s"] = {
            "startup": t_ready - t_spawned,
            "run": t_done - t_ready,
            "teardown": time.monotonic() - t_done,
        }
        gen = [reports[k] for k in gen_keys]
        ctx = [r for k, r in reports.items() if k[0] == "context"]
        lat = np.array([x for r in gen for x in r["outcomes"]["latency"]]) * 1000
        elapsed = max(r["seconds"] for r in gen)
        nbytes = sum(r["verified_bytes"] for r in gen)
        states = [s for r in gen + ctx for s in r["outcomes"]["states"].values()]
        expected = sum(r["expected"] for r in gen + ctx)
        all_errors = [
            (f"{r['role']} rank {r['rank']} request {k}", v)
            for r in gen + ctx
            for k, v in r["outcomes"]["errors"].items()
        ]
        errors = {"count": len(all_errors), "first": [f"{w}: {e}" for w, e in all_errors[:3]]} if all_errors else {}
        mismatches = sum(r["mismatches"] for r in gen)
        mismatches_at_done = sum(r["mismatches_at_done"] for r in gen)
        checked_at_done = sum(r["checked_at_done"] for r in gen)
        leaks = {f"{r['role']}{r['rank']}": _leaks(r["stats"]) for r in gen + ctx}
        leaks = {k: v for k, v in leaks.items() if v}
        counters: dict[str, int] = {}
        for r in gen + ctx:
            for k, v in r["stats"].items():
                if k.endswith("_total"):
                    counters[k] = counters.get(k, 0) + int(v)
        done = sum(s == "DONE" for s in states)
        done_gen = sum(s == "DONE" for r in gen for s in r["outcomes"]["states"].values())
        summary.update(
            requests=spec.requests,
            processes=len(ranks.procs),
            bytes=nbytes,
            seconds=elapsed,
            gbps=nbytes / elapsed / 1e9 if elapsed else 0.0,
            latency_ms_p50=float(np.percentile(lat, 50)) if lat.size else None,
            latency_ms_p99=float(np.percentile(lat, 99)) if lat.size else None,
            first_contact_ms=max(r["first_contact_s"] for r in gen) * 1000,
            done=done,
            not_done=expected - done,
            mismatches=mismatches,
            mismatches_at_done=mismatches_at_done,
            checked_at_done=checked_at_done,
            done_generation=done_gen,
            first_mismatch=next((r["first_bad"] for r in gen if r["first_bad"]), ""),
            errors=errors,
            leaks=leaks,
            counters=counters,
        )
        summary["teardown"] = teardown
        summary["auth_ranks"] = sum(bool(r.get("curve")) for r in gen + ctx)
        summary["ok"] = (
            mismatches == 0
            and mismatches_at_done == 0
            and checked_at_done == done_gen
            and summary["not_done"] == 0
            and not leaks
            and nbytes > 0
            and not teardown["killed"]
            and not teardown["exit_codes"]
            # Every rank authenticates: with --auth by the instance keys, on loopback by this user's local key
            # (the default); only the namespaced hosts without --auth run without (an isolated link, warned).
            and summary["auth_ranks"] == (len(gen + ctx) if spec.auth or not spec.two_hosts else 0)
        )
        return summary
    finally:
        if bar is not None:
            bar.stop()
        ranks.stop(grace=1.0)  # no-op after a clean run; kills whatever is left after a failure


# --- command line ----------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 3,1, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 3,1, got {text!r}")
    return values


#: ``--block-order`` values: :data:`kvcore.layout.topology.BlockOrder`'s.
BLOCK_ORDERS: tuple[str, ...] = get_args(BlockOrder)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="move KV between a context and a generation instance (separate processes) and verify every byte"
    )
    d = DemoSpec()
    p.add_argument("--backend", default=d.backend, help="transfer agent by name (auto, shm, nixl, ucx, ...)")
    p.add_argument("--requests", type=int, default=d.requests, help="requests moved concurrently")
    p.add_argument("--tokens", type=int, default=d.tokens, help="prompt tokens per request")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="total KV heads of the model (ignored with --mla)")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="head dim (the latent dim with --mla)")
    p.add_argument("--tokens-per-block", type=int, default=d.tokens_per_block)
    p.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float16"])
    p.add_argument(
        "--block-order",
        default=d.block_order,
        choices=list(BLOCK_ORDERS),
        help="axis order inside one block of one layer: [heads, tokens, dim] or [tokens, heads, dim]",
    )
    p.add_argument("--ctx-tp", type=int, default=d.ctx_tp)
    p.add_argument("--ctx-pp", type=int, default=d.ctx_pp)
    p.add_argument("--gen-tp", type=int, default=d.gen_tp)
    p.add_argument("--gen-pp", type=int, default=d.gen_pp)
    p.add_argument(
        "--ctx-layers-per-pp",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="uneven PP split of the context instance (e.g. 3,1)",
    )
    p.add_argument(
        "--gen-layers-per-pp",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="uneven PP split of the generation instance",
    )
    p.add_argument(
        "--ctx-attention-dp",
        action="store_true",
        help="context attention DP: every TP rank is its own DP group; request r runs on group r %% tp",
    )
    p.add_argument(
        "--gen-attention-dp", action="store_true", help="generation attention DP: request r is decoded by group r %% tp"
    )
    p.add_argument("--mla", action="store_true", help="MLA: one latent buffer (kv_factor 1) replicated over TP")
    p.add_argument(
        "--mamba",
        action="store_true",
        help="Mamba-hybrid: conv (x|B|C) and SSM state on the odd layers, one slot per request",
    )
    p.add_argument(
        "--bounce",
        default=d.bounce,
        choices=list(BOUNCE_MODES),
        help="bounce buffer for small scattered fragments: transceiver default, forced, or disabled",
    )
    p.add_argument(
        "--layerwise",
        action="store_true",
        help="context ranks mark half of their layers ready first, the rest afterwards (layer-wise sending)",
    )
    p.add_argument(
        "--mode",
        default=d.mode,
        choices=["push", "pull"],
        help="push: context ranks write into the generation side; pull: generation ranks read the context's blocks",
    )
    p.add_argument(
        "--cached-prefix-blocks",
        type=int,
        default=d.cached_prefix_blocks,
        help="blocks the generation side already holds",
    )
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s", help="per-request bound in seconds")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--auth",
        action="store_true",
        help="CurveZMQ on the control plane: a fresh key pair per instance (so the allow-list really decides: "
        "each rank admits exactly the two instances' public keys) in a private temporary directory "
        "(0700, secrets 0600), removed when the demo ends",
    )
    p.add_argument(
        "--two-hosts",
        action="store_true",
        help="context instance in namespaced host a, generation instance in host b, over a veth link "
        "(needs root; --backend nixl or ucx, auto picks one of them; shm cannot cross hosts)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    # Every option's dest is a DemoSpec field: the spec is built from them, never listed a third time.
    given = vars(args)
    spec = DemoSpec(**{f.name: given[f.name] for f in fields(DemoSpec) if f.name in given})
    try:
        summary = run_demo(spec, progress=not args.json and sys.stderr.isatty())
    except Exception as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        else:
            print(f"kvcore demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0 if summary["ok"] else 1


def _side_text(sp: dict[str, Any], pre: str) -> str:
    text = f"TP{sp[pre + '_tp']}/PP{sp[pre + '_pp']}"
    if sp.get(pre + "_layers_per_pp"):
        text += f" ({','.join(map(str, sp[pre + '_layers_per_pp']))} layers)"
    if sp.get(pre + "_attention_dp"):
        text += " attention-DP"
    return text


def _print_summary(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    sp = s["spec"]
    t = Table(title="kvcore demo", show_header=False)
    t.add_column("what")
    t.add_column("value")
    t.add_row("backend", str(s.get("backend")))
    t.add_row("topology", f"context {_side_text(sp, 'ctx')} -> generation {_side_text(sp, 'gen')}")
    model = "MLA (1 latent head)" if sp.get("mla") else f"{sp['kv_heads']} KV heads"
    if sp.get("mamba"):
        model += ", Mamba-hybrid (conv + SSM state on odd layers)"
    t.add_row("model", f"{sp['layers']} layers, {model}, head dim {sp['head_dim']}, {sp['dtype']}")
    t.add_row("block order", f"{sp['block_order']}, bounce {sp.get('bounce', 'auto')}")
    how = "the generation ranks read the context's blocks" if sp.get("mode") == "pull" else "the context writes"
    t.add_row("mode", f"{sp.get('mode', 'push')} ({how})")
    if s.get("hosts"):
        t.add_row("hosts", s["hosts"])
    t.add_row(
        "authentication",
        "on: CurveZMQ, one key pair per instance, allow-list of both public keys (temporary keys, removed)"
        + (f"; {s['auth_ranks']} of {s['processes']} ranks serve CURVE" if "auth_ranks" in s else "")
        if sp.get("auth")
        else (
            "off (an isolated link between the hosts)"
            if s.get("hosts")
            else "on: CurveZMQ with this user's local key (the default; other users are refused)"
            + (f"; {s['auth_ranks']} of {s['processes']} ranks serve CURVE" if "auth_ranks" in s else "")
        ),
    )
    t.add_row("requests", f"{s['requests']} ({s['done']} rank-outcomes DONE, {s['not_done']} not)")
    if "timed_requests" in s:  # two hosts: checked after release; first contact timed apart
        t.add_row("bytes verified", f"{s['bytes'] / 2**20:.1f} MiB, {s['mismatches']} mismatching elements")
        t.add_row(
            "throughput",
            f"{s['gbps']:.2f} GB/s over {s['seconds']:.3f} s ({s['timed_requests']} requests after first contact, "
            f"host a -> host b; first contact {s['first_contact_ms']:.1f} ms)",
        )
    else:
        t.add_row(
            "bytes verified",
            f"{s['bytes'] / 2**20:.1f} MiB, {s['mismatches']} mismatching elements (and at DONE, before release: "
            f"{s['checked_at_done']} rank-requests, {s['mismatches_at_done']} mismatching)",
        )
        t.add_row(
            "throughput",
            f"{s['gbps']:.2f} GB/s over {s['seconds']:.3f} s (start to last DONE, receive side; byte checks excluded)",
        )
    if s.get("latency_ms_p50") is not None:
        t.add_row(
            "latency",
            f"p50 {s['latency_ms_p50']:.1f} ms, p99 {s['latency_ms_p99']:.1f} ms "
            f"(all {s['requests']} started at once; first contact {s['first_contact_ms']:.1f} ms, paid once)",
        )
    if s["errors"]:
        t.add_row("errors", json.dumps(s["errors"])[:500])
    if s["leaks"]:
        t.add_row("leaks", json.dumps(s["leaks"]))
    if s["teardown"]["killed"] or s["teardown"]["exit_codes"]:
        t.add_row("teardown", json.dumps(s["teardown"]))
    if s.get("counters"):
        t.add_row("counters", json.dumps(s["counters"]))
    t.add_row("result", "[green]OK: every byte verified[/]" if s["ok"] else f"[red]FAILED[/] {s['first_mismatch']}")
    Console().print(t)
