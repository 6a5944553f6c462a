"""``kvcore demo``: a context instance and a generation instance as separate processes, every byte verified.

The orchestrator (this process) spawns ``ctx_tp*ctx_pp`` context ranks and
``gen_tp*gen_pp`` generation ranks. Ranks of one instance agree through a gloo
process group. Context ranks fill their KV pools with values derived from
(request, layer, kv, head, token, dim); generation ranks receive N requests
concurrently, then compare every received byte with the same formula computed
independently on their own shard. Orchestration messages are msgpack bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

__all__ = ["DemoSpec", "run_demo", "add_parser", "expected_values", "heads_of_rank"]


@dataclass
class DemoSpec:
    """Everything one demo run needs; sent to every rank as msgpack."""

    backend: str = "auto"
    requests: int = 32
    tokens: int = 256
    layers: int = 8
    kv_heads: int = 8
    head_dim: int = 128
    tokens_per_block: int = 16
    dtype: str = "bfloat16"
    layout: str = "head_major"
    ctx_tp: int = 2
    ctx_pp: int = 1
    gen_tp: int = 2
    gen_pp: int = 1
    ctx_attention_dp: bool = False
    gen_attention_dp: bool = False
    cached_prefix_blocks: int = 0
    spare_blocks: int = 8  # at least one: the first-contact request uses it
    timeout_s: float = 120.0
    seed: int = 1234

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.tokens_per_block)

    @property
    def num_blocks(self) -> int:
        return self.requests * self.blocks_per_request + self.spare_blocks


def heads_of_rank(total_heads: int, tp_size: int, tp_rank: int, attention_dp: bool) -> list[int]:
    """Global KV-head ids a rank holds (independent of kvcore's own arithmetic)."""
    if attention_dp or tp_size == 1:
        return list(range(total_heads))
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return list(range(tp_rank * per, (tp_rank + 1) * per))
    return [tp_rank * total_heads // tp_size]  # fewer heads than ranks: each head replicated


def layers_of_rank(num_layers: int, pp_size: int, pp_rank: int) -> list[int]:
    per, extra = divmod(num_layers, pp_size)
    start = pp_rank * per + min(pp_rank, extra)
    return list(range(start, start + per + (1 if pp_rank < extra else 0)))


def expected_values(request: int, layers: list[int], kv: int, heads: list[int], tokens: range, dim: int, dtype: Any) -> Any:
    """The logical KV ``[layers, kv, heads, tokens, dim]`` of a request: small integers, exact in bf16/fp16."""
    import torch

    lt = torch.tensor(layers, dtype=torch.int64).view(-1, 1, 1, 1, 1)
    kt = torch.arange(kv, dtype=torch.int64).view(1, -1, 1, 1, 1)
    ht = torch.tensor(heads, dtype=torch.int64).view(1, 1, -1, 1, 1)
    tt = torch.tensor(list(tokens), dtype=torch.int64).view(1, 1, 1, -1, 1)
    dt = torch.arange(dim, dtype=torch.int64).view(1, 1, 1, 1, -1)
    v = (request * 7919 + lt * 131 + kt * 31 + ht * 17 + tt * 3 + dt) % 251 - 125
    return v.to(dtype)


def _logical(caches: Any, layout: str, blocks: Any) -> Any:
    """Gather a request's blocks from this rank's pools as ``[layers, kv, heads, tokens, dim]``."""
    import torch

    idx = torch.as_tensor(blocks, dtype=torch.int64)
    if layout == "head_major":
        x = caches.index_select(0, idx)  # [nb, L, kv, H, tpb, D]
        nb, L, kv, H, tpb, D = x.shape
        return x.permute(1, 2, 3, 0, 4, 5).reshape(L, kv, H, nb * tpb, D)
    per_layer = []
    for c in caches:  # [blocks, kv, tpb, H, D]
        y = c.index_select(0, idx)  # [nb, kv, tpb, H, D]
        nb, kv, tpb, H, D = y.shape
        per_layer.append(y.permute(1, 3, 0, 2, 4).reshape(kv, H, nb * tpb, D))
    return torch.stack(per_layer)


def _scatter(caches: Any, layout: str, blocks: Any, values: Any) -> None:
    """Write ``[layers, kv, heads, tokens, dim]`` values into this rank's pools at ``blocks``."""
    import torch

    idx = torch.as_tensor(blocks, dtype=torch.int64)
    L, kv, H, T, D = values.shape
    nb = idx.numel()
    tpb = T // nb
    if layout == "head_major":
        x = values.reshape(L, kv, H, nb, tpb, D).permute(3, 0, 1, 2, 4, 5).contiguous()
        caches.index_copy_(0, idx, x)
        return
    for li, c in enumerate(caches):  # [blocks, kv, tpb, H, D]
        y = values[li].reshape(kv, H, nb, tpb, D).permute(2, 0, 3, 1, 4).contiguous()
        c.index_copy_(0, idx, y)


def _send(conn: Any, obj: Any) -> None:
    conn.send_bytes(msgspec.msgpack.encode(obj))


def _recv(conn: Any, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no message from a demo rank within {timeout:.0f}s")
    return msgspec.msgpack.decode(conn.recv_bytes())


def _rank_main(role: str, rank: int, spec_d: dict[str, Any], dist_port: int, conn: Any) -> None:
    """Entry point of one rank process."""
    try:
        _rank_body(role, rank, DemoSpec(**spec_d), dist_port, conn)
    except BaseException as exc:  # report, never hang the orchestrator
        try:
            _send(conn, {"kind": "error", "role": role, "rank": rank,
                         "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        except Exception:
            pass
        raise SystemExit(1) from None


def _rank_body(role: str, rank: int, spec: DemoSpec, dist_port: int, conn: Any) -> None:
    import numpy as np
    import torch

    from kvcore.builders import allocate_kv_cache, build_page_table
    from kvcore.collective import LocalCollective, TorchCollective
    from kvcore.config import TransceiverConfig, create_agent
    from kvcore.topology import AttentionGeometry, Topology
    from kvcore.transceiver import Transceiver

    torch.set_num_threads(1)
    ctx = role == "context"
    tp, pp = (spec.ctx_tp, spec.ctx_pp) if ctx else (spec.gen_tp, spec.gen_pp)
    adp = spec.ctx_attention_dp if ctx else spec.gen_attention_dp
    world = tp * pp
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world)
        collective: Any = TorchCollective()
    else:
        collective = LocalCollective()
    topology = Topology.create(tp_size=tp, pp_size=pp, rank=rank, num_layers=spec.layers, attention_dp=adp)
    geometry = AttentionGeometry(num_layers=spec.layers, num_kv_heads=spec.kv_heads, head_dim=spec.head_dim,
                                 tokens_per_block=spec.tokens_per_block, dtype=spec.dtype, layout=spec.layout)
    config = TransceiverConfig.load(backend=spec.backend, request_timeout_s=spec.timeout_s)
    agent = create_agent(config, f"{role}-{rank}-{os.getpid()}")
    caches = allocate_kv_cache(topology, geometry, spec.num_blocks, allocator=agent.allocate_tensor)
    for c in caches if isinstance(caches, list) else [caches]:
        c.fill_(0)  # touch every page now, as an engine's warm pools would be: page faults are not transfer cost
    builder = "head_major_pool" if spec.layout == "head_major" else "token_major_layers"
    page_table = build_page_table(builder, caches, topology=topology, geometry=geometry)
    tx = Transceiver(config, role=role, agent=agent, topology=topology, geometry=geometry, page_table=page_table,
                     collective=collective, instance_name=f"{role}-demo")
    dtype = getattr(torch, spec.dtype)
    layers = layers_of_rank(spec.layers, pp, topology.pp_rank)
    heads = heads_of_rank(spec.kv_heads, tp, topology.tp_rank, adp)
    nbpr = spec.blocks_per_request
    # Same block assignment on every rank of an instance (as a real block manager would do),
    # different between the instances so addresses never line up by accident.
    perm = np.random.default_rng(spec.seed + (0 if ctx else 1)).permutation(spec.num_blocks)
    blocks = {r: perm[r * nbpr:(r + 1) * nbpr] for r in range(spec.requests)}
    padded = range(nbpr * spec.tokens_per_block)
    warm_id, warm_blocks = spec.requests, perm[spec.requests * nbpr:][:1]  # first contact, paid once per peer
    try:
        if ctx:
            for r in range(spec.requests):
                _scatter(caches, spec.layout, blocks[r], expected_values(r, layers, 2, heads, padded, spec.head_dim, dtype))
            if rank == 0:
                _send(conn, {"kind": "endpoint", "endpoint": tx.info_endpoint, "backend": agent.backend})
            _recv(conn, spec.timeout_s)  # go
            tx.start_send(warm_id, warm_blocks, prompt_len=spec.tokens_per_block)
            _drive(tx, spec, ids=[warm_id])
            t0 = time.perf_counter()
            for r in range(spec.requests):
                tx.start_send(r, blocks[r], prompt_len=spec.tokens)
            outcomes = _drive(tx, spec)
            report = {"kind": "report", "role": role, "rank": rank, "seconds": time.perf_counter() - t0,
                      "outcomes": outcomes, "stats": tx.stats()}
        else:
            go = _recv(conn, spec.timeout_s)
            skip = spec.cached_prefix_blocks
            starts: dict[int, float] = {warm_id: time.perf_counter()}
            tx.start_receive(warm_id, go["endpoint"], warm_blocks, prompt_len=spec.tokens_per_block)
            first_contact = _drive(tx, spec, starts, ids=[warm_id])["latency"][0]
            t0 = time.perf_counter()
            for r in range(spec.requests):
                starts[r] = time.perf_counter()
                tx.start_receive(r, go["endpoint"], blocks[r][skip:], prompt_len=spec.tokens)
            outcomes = _drive(tx, spec, starts, conn if rank == 0 else None)
            elapsed = time.perf_counter() - t0
            mismatches, checked = 0, 0
            first_bad = ""
            for r in range(spec.requests):
                tok = range(skip * spec.tokens_per_block, nbpr * spec.tokens_per_block)
                got = _logical(caches, spec.layout, blocks[r][skip:])
                want = expected_values(r, layers, 2, heads, tok, spec.head_dim, dtype)
                bad = int((got.view(torch.int16) != want.view(torch.int16)).sum())
                checked += got.numel() * got.element_size()
                if bad and not first_bad:
                    first_bad = f"request {r}: {bad} elements differ"
                mismatches += bad
                if skip:  # the cached prefix must be untouched
                    pre = _logical(caches, spec.layout, blocks[r][:skip])
                    mismatches += int((pre != 0).sum())
            report = {"kind": "report", "role": role, "rank": rank, "seconds": elapsed, "outcomes": outcomes,
                      "first_contact_s": first_contact,
                      "verified_bytes": checked, "mismatches": mismatches, "first_bad": first_bad,
                      "stats": tx.stats()}
        _send(conn, report)
        _recv(conn, spec.timeout_s)  # hold memory until everyone reported
    finally:
        tx.close()
        agent.close()
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _drive(
    tx: Any, spec: DemoSpec, starts: dict[int, float] | None = None, progress: Any = None, ids: list[int] | None = None
) -> dict[str, Any]:
    """Poll until every request is reported and released; returns states, errors and latencies."""
    want = set(range(spec.requests) if ids is None else ids)
    states: dict[int, str] = {}
    errors: dict[int, str] = {}
    latency: dict[int, float] = {}
    released: set[int] = set()
    deadline = time.monotonic() + spec.timeout_s + 10
    while not (want <= released):
        r = tx.poll()
        now = time.perf_counter()
        for o in r.outcomes:
            states[o.request_id] = o.state.value
            if o.error is not None:
                errors[o.request_id] = f"{type(o.error).__name__}: {o.error}"
            if starts is not None:
                latency[o.request_id] = now - starts[o.request_id]
        released.update(r.released)
        if progress is not None and r.outcomes:
            _send(progress, {"kind": "progress", "n": len(states)})
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(want - released)} request(s) never released")
        time.sleep(0.0005)
    return {"states": {str(k): v for k, v in states.items()}, "errors": {str(k): v for k, v in errors.items()},
            "latency": [latency[k] for k in sorted(latency)]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_demo(spec: DemoSpec, *, progress: bool = True) -> dict[str, Any]:
    """Run the whole demo and return the summary (raises nothing for transfer failures: see ``ok``)."""
    import numpy as np

    mpctx = mp.get_context("spawn")
    procs: list[Any] = []
    conns: dict[tuple[str, int], Any] = {}
    ctx_port, gen_port = _free_port(), _free_port()
    summary: dict[str, Any] = {"spec": asdict(spec), "ok": False}
    try:
        for role, world, port in (("context", spec.ctx_tp * spec.ctx_pp, ctx_port),
                                  ("generation", spec.gen_tp * spec.gen_pp, gen_port)):
            for rank in range(world):
                parent, child = mpctx.Pipe()
                p = mpctx.Process(target=_rank_main, args=(role, rank, asdict(spec), port, child),
                                  name=f"kvcore-demo-{role}-{rank}", daemon=True)
                p.start()
                procs.append(p)
                conns[(role, rank)] = parent
        first = _recv(conns[("context", 0)], spec.timeout_s)
        if first["kind"] == "error":
            raise RuntimeError(f"context rank 0 failed: {first['error']}\n{first.get('trace', '')}")
        summary["backend"] = first["backend"]
        for key, c in conns.items():
            _send(c, {"kind": "go", "endpoint": first["endpoint"]})
        reports: dict[tuple[str, int], dict[str, Any]] = {}
        bar = None
        if progress:
            from rich.progress import Progress

            bar = Progress(transient=True)
            bar.start()
            task = bar.add_task(f"moving {spec.requests} requests ({summary['backend']})", total=spec.requests)
        deadline = time.monotonic() + spec.timeout_s + 30
        pending = dict(conns)
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no report from {sorted(pending)}")
            for key, c in list(pending.items()):
                while c.poll(0.01):
                    m = msgspec.msgpack.decode(c.recv_bytes())
                    if m["kind"] == "progress":
                        if bar is not None:
                            bar.update(task, completed=m["n"])
                    elif m["kind"] == "error":
                        raise RuntimeError(f"{key[0]} rank {key[1]} failed: {m['error']}\n{m.get('trace', '')}")
                    else:
                        reports[key] = m
                        pending.pop(key)
                        break
        if bar is not None:
            bar.stop()
        for c in conns.values():
            _send(c, {"kind": "exit"})
        gen = [r for (role, _), r in reports.items() if role == "generation"]
        ctx = [r for (role, _), r in reports.items() if role == "context"]
        lat = np.array([x for r in gen for x in r["outcomes"]["latency"]]) * 1000
        elapsed = max(r["seconds"] for r in gen)
        nbytes = sum(r["verified_bytes"] for r in gen)
        states = [s for r in gen + ctx for s in r["outcomes"]["states"].values()]
        all_errors = [(f"{r['role']} rank {r['rank']} request {k}", v) for r in gen + ctx for k, v in r["outcomes"]["errors"].items()]
        errors = {"count": len(all_errors), "first": [f"{w}: {e}" for w, e in all_errors[:3]]} if all_errors else {}
        mismatches = sum(r["mismatches"] for r in gen)
        leaks = {f"{r['role']}{r['rank']}": {k: v for k, v in r["stats"].items()
                                              if v and k not in ("ctx_instances", "gen_peers")} for r in gen + ctx}
        leaks = {k: v for k, v in leaks.items() if v}
        summary.update(
            requests=spec.requests,
            bytes=nbytes,
            seconds=elapsed,
            gbps=nbytes / elapsed / 1e9 if elapsed else 0.0,
            latency_ms_p50=float(np.percentile(lat, 50)) if lat.size else None,
            latency_ms_p99=float(np.percentile(lat, 99)) if lat.size else None,
            first_contact_ms=max(r["first_contact_s"] for r in gen) * 1000,
            done=sum(s == "DONE" for s in states),
            not_done=sum(s != "DONE" for s in states),
            mismatches=mismatches,
            first_mismatch=next((r["first_bad"] for r in gen if r["first_bad"]), ""),
            errors=errors,
            leaks=leaks,
        )
        summary["ok"] = mismatches == 0 and summary["not_done"] == 0 and not leaks and nbytes > 0
        return summary
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="move KV between a context and a generation instance (separate processes) and verify every byte")
    d = DemoSpec()
    p.add_argument("--backend", default=d.backend, help="transfer agent by name (auto, shm, nixl, ucx, ...)")
    p.add_argument("--requests", type=int, default=d.requests, help="requests moved concurrently")
    p.add_argument("--tokens", type=int, default=d.tokens, help="prompt tokens per request")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="total KV heads of the model")
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--tokens-per-block", type=int, default=d.tokens_per_block)
    p.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float16"])
    p.add_argument("--layout", default=d.layout, choices=["head_major", "token_major"])
    p.add_argument("--ctx-tp", type=int, default=d.ctx_tp)
    p.add_argument("--ctx-pp", type=int, default=d.ctx_pp)
    p.add_argument("--gen-tp", type=int, default=d.gen_tp)
    p.add_argument("--gen-pp", type=int, default=d.gen_pp)
    p.add_argument("--cached-prefix-blocks", type=int, default=0, help="blocks the generation side already holds")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="per-request bound in seconds")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    spec = DemoSpec(backend=args.backend, requests=args.requests, tokens=args.tokens, layers=args.layers,
                    kv_heads=args.kv_heads, head_dim=args.head_dim, tokens_per_block=args.tokens_per_block,
                    dtype=args.dtype, layout=args.layout, ctx_tp=args.ctx_tp, ctx_pp=args.ctx_pp,
                    gen_tp=args.gen_tp, gen_pp=args.gen_pp, cached_prefix_blocks=args.cached_prefix_blocks,
                    timeout_s=args.timeout)
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


def _print_summary(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    sp = s["spec"]
    t = Table(title="kvcore demo", show_header=False)
    t.add_column("what")
    t.add_column("value")
    t.add_row("backend", str(s.get("backend")))
    t.add_row("topology", f"context TP{sp['ctx_tp']}/PP{sp['ctx_pp']} -> generation TP{sp['gen_tp']}/PP{sp['gen_pp']}")
    t.add_row("layout", sp["layout"])
    t.add_row("requests", f"{s['requests']} ({s['done']} rank-outcomes DONE, {s['not_done']} not)")
    t.add_row("bytes verified", f"{s['bytes'] / 2**20:.1f} MiB, {s['mismatches']} mismatching elements")
    t.add_row("throughput", f"{s['gbps']:.2f} GB/s over {s['seconds']:.3f} s (all requests, receive side)")
    if s.get("latency_ms_p50") is not None:
        t.add_row("latency", f"p50 {s['latency_ms_p50']:.1f} ms, p99 {s['latency_ms_p99']:.1f} ms "
                  f"(all {s['requests']} started at once; first contact {s['first_contact_ms']:.1f} ms, paid once)")
    if s["errors"]:
        t.add_row("errors", json.dumps(s["errors"])[:500])
    if s["leaks"]:
        t.add_row("leaks", json.dumps(s["leaks"]))
    t.add_row("result", "[green]OK: every byte verified[/]" if s["ok"] else f"[red]FAILED[/] {s['first_mismatch']}")
    Console().print(t)
