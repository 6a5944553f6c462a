"""``make bench-vllm``: KvcoreConnector against vLLM's own NixlConnector, the same engines and prompts, one run.

For each model size each stack is deployed alone on this machine in turn (:func:`kvcore_vllm.demo.deployment`:
a prefill and a decode ``vllm serve``, the prefill on core 0 and the decode on core 1, and the proxy in front):
``KvcoreConnector``, then ``NixlConnector`` (the order alternates between sizes). NixlConnector is deployed as
vLLM's NixlConnector guide deploys it: ``kv_role`` ``kv_both``, a side-channel port of its own per instance
(``VLLM_NIXL_SIDE_CHANNEL_PORT``) on the instances' address (``VLLM_NIXL_SIDE_CHANNEL_HOST``),
``kv_buffer_device: cpu`` (NIXL over UCX on host memory), the proxy sending the prefill step the
``kv_transfer_params`` vLLM's own proxies send, and ``--nixl-num-threads`` UCX worker threads
(``kv_connector_extra_config.num_threads``; vLLM's default is 4). The stacks never run at once: as vLLM
configures NIXL, each NixlConnector engine keeps about one core busy while idle (``idle CPU`` below measures
it), which on two cores starved the other stack's engines and NixlConnector's own handshakes when all four
engines were up together.

Each stack answers the same batches of fresh prompts (``--reps`` plus ``--spare`` batches); for each it records

- **decode TTFT**: the decode instance's own mean time to first token over the batch (vLLM's
  ``time_to_first_token_seconds`` histogram), which holds the KV load;
- **end to end**: the wall time of the whole batch through the proxy (prefill, transfer, decode);

then takes the median over the batches that count and the ratio kvcore / NIXL (below 1: kvcore is faster).
A batch counts only when, on both stacks, the decode loaded every prompt token over its connector and
computed none, and neither connector reported a failure in it (NixlConnector: a ``NIXL transfer failure``
line in either instance's log, failed handshakes and transfers among them, or its failed transfer and
notification counters; kvcore: its load-failure and failed-transfer counters); otherwise it is dropped with
its reason. Different tokens from the two stacks stop the run: that is wrong KV, not a slow batch.

    python -m kvcore_vllm.bench [--sizes small,large] [--reps 5] [--spare 2] [--prompts 16]
                                [--nixl-num-threads 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvcore_vllm.demo import (
    COMPUTED,
    LOADED,
    PROMPT_TOKENS,
    TTFT_COUNT,
    TTFT_SUM,
    Deployment,
    deployment,
    stop_on_sigterm,
    text_prompts,
)
from kvcore_vllm.local import complete
from kvcore_vllm.tiny_model import LARGE_MODEL, MODEL, kv_bytes_per_token, write_model

#: name -> (model shape, words a prompt): about 1 MiB and 16 MiB of KV a request.
SIZES: dict[str, tuple[dict[str, int], int]] = {"small": (MODEL, 511), "large": (LARGE_MODEL, 1023)}
STACKS = ("kvcore", "nixl")
#: What NixlConnector writes to its log for every failure it handles (handshake, transfer, notification).
NIXL_FAILURE = re.compile(rb"NIXL transfer failure: (\w+)")
#: Counters whose growth in a repetition means a connector failed (and maybe retried or recomputed) something.
FAILURE_COUNTERS = {
    "kvcore": ("vllm:kvcore_load_failures_total", 'vllm:kvcore_transfers_total{outcome="failed"}'),
    "nixl": ("vllm:nixl_num_failed_transfers", "vllm:nixl_num_failed_notifications"),
}


class BenchError(RuntimeError):
    """A run whose evidence does not hold (the two stacks' tokens differ): no number is reported."""


@dataclass
class Rep:
    decode_ttft_s: float
    e2e_s: float
    kv_mib_per_request: float
    prompt_tokens: int


@dataclass
class SizeResult:
    size: str
    prompts: int
    prompt_tokens: int
    kv_mib_per_request: float
    reps: dict[str, list[Rep]] = field(default_factory=dict)
    #: Repetitions not counted, each with why (one line per stack that failed it).
    dropped: list[str] = field(default_factory=list)
    #: CPU cores each deployment's processes used while idle (after the warm-up), measured over a few seconds.
    idle_cores: dict[str, float] = field(default_factory=dict)

    def median(self, stack: str, what: str) -> float:
        return float(statistics.median(getattr(r, what) for r in self.reps[stack]))

    def ratio(self, what: str) -> float:
        return self.median("kvcore", what) / self.median("nixl", what)


class LogWatch:
    """What the instances' logs gained since ``mark()``."""

    def __init__(self, dep: Deployment) -> None:
        self.paths = [Path(s.log_path) for s in (dep.prefill, dep.decode) if s.log_path]
        self.offsets: dict[Path, int] = {}

    def mark(self) -> None:
        self.offsets = {p: p.stat().st_size if p.exists() else 0 for p in self.paths}

    def new(self) -> bytes:
        out = b""
        for p in self.paths:
            with open(p, "rb") as f:
                f.seek(self.offsets.get(p, 0))
                out += f.read()
        return out


def counter_sum(metrics: dict[str, float], name: str) -> float:
    """The sum of a counter over its labels (``name`` with its labels matches that series alone)."""
    if "{" in name:
        return metrics.get(name, 0.0)
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def failures(stack: str, before: list[dict[str, float]], after: list[dict[str, float]], log: bytes) -> list[str]:
    """Why this repetition of ``stack`` does not count: its failure counters grew, or NIXL logged failures."""
    out = []
    for name in FAILURE_COUNTERS[stack]:
        grew = sum(counter_sum(a, name) - counter_sum(b, name) for b, a in zip(before, after))
        if grew:
            out.append(f"{name} +{grew:.0f}")
    kinds = [m.decode() for m in NIXL_FAILURE.findall(log)]
    if kinds:
        out.append("NIXL transfer failure: " + ", ".join(f"{k} x{kinds.count(k)}" for k in sorted(set(kinds))))
    return out


def idle_cores(dep: Deployment, seconds: float = 4.0) -> float:
    """CPU cores the deployment's instances use while no request is in flight (NIXL's UCX threads spin)."""
    import psutil

    def cpu() -> float:
        total = 0.0
        for pid in [*dep.prefill.pids(), *dep.decode.pids()]:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    start, t0 = cpu(), time.monotonic()
    time.sleep(seconds)
    return (cpu() - start) / (time.monotonic() - t0)


def one_batch(
    dep: Deployment, prompts: list[str], max_tokens: int, kv_per_token: int, stack: str
) -> tuple[Rep, list[list[int]], list[str]]:
    """One batch through ``dep``'s proxy: its numbers, the tokens, and why it does not count (empty: it counts)."""
    watch = LogWatch(dep)
    watch.mark()
    before = [dep.decode.metrics(), dep.prefill.metrics()]
    started = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(dep.proxy.url, p, max_tokens, stream=True), prompts))
    e2e = time.monotonic() - started
    after = [dep.decode.metrics(), dep.prefill.metrics()]

    def d(key: str) -> float:
        return after[0].get(key, 0.0) - before[0].get(key, 0.0)

    tokens = int(d(PROMPT_TOKENS))
    why = failures(stack, before, after, watch.new())
    if int(d(LOADED)) != tokens or d(COMPUTED) != 0 or not tokens:
        why.insert(0, f"the decode loaded {int(d(LOADED))} of {tokens} prompt tokens and computed {int(d(COMPUTED))}")
    rep = Rep(
        decode_ttft_s=d(TTFT_SUM) / d(TTFT_COUNT) if d(TTFT_COUNT) else float("nan"),
        e2e_s=e2e,
        kv_mib_per_request=tokens * kv_per_token / len(prompts) / 2**20,
        prompt_tokens=tokens // len(prompts),
    )
    return rep, [g.token_ids for g in got], why


def run_stack(
    name: str,
    workdir: Path,
    model: str,
    seeds: list[int],
    n_prompts: int,
    words: int,
    max_tokens: int,
    kv_per_token: int,
    backend: str,
    mode: str,
    nixl_num_threads: int,
) -> tuple[float, dict[int, tuple[Rep, list[list[int]], list[str]]]]:
    """Deploy one stack alone, warm it up, measure its idle CPU, then one batch per seed."""
    if name == "kvcore":
        dep_cm = deployment(workdir, model, backend=backend, mode=mode)
    else:
        dep_cm = deployment(workdir, model, connector="nixl", extra={"num_threads": nixl_num_threads})
    out: dict[int, tuple[Rep, list[list[int]], list[str]]] = {}
    with dep_cm as dep:
        # One warm-up batch (first-contact handshakes, NIXL's metadata exchange), not counted.
        _, _, why = one_batch(dep, text_prompts(2, words, seed=10_000), max_tokens, kv_per_token, name)
        if why:
            print(f"    {name} warm-up: " + "; ".join(why), flush=True)
        idle = idle_cores(dep)
        print(f"    {name}: idle CPU of prefill + decode {idle:.2f} cores", flush=True)
        for seed in seeds:
            rep, tokens, why = one_batch(dep, text_prompts(n_prompts, words, seed=seed), max_tokens, kv_per_token, name)
            out[seed] = (rep, tokens, why)
            print(
                f"    {name} batch {seed}: decode TTFT {rep.decode_ttft_s * 1e3:.0f} ms, end to end {rep.e2e_s:.2f} s"
                + (" -- " + "; ".join(why) if why else ""),
                flush=True,
            )
    return idle, out


def bench_size(
    size: str,
    workdir: Path,
    reps: int,
    spare: int,
    n_prompts: int,
    max_tokens: int,
    backend: str,
    mode: str,
    nixl_num_threads: int,
    first: str = "kvcore",
) -> SizeResult:
    """Each stack deployed alone on the machine in turn (``first`` first), the same batches through each."""
    shape, words = SIZES[size]
    workdir.mkdir(parents=True, exist_ok=True)
    model = write_model(workdir / f"model-{size}", shape)
    kv_per_token = kv_bytes_per_token(shape)
    seeds = list(range(1, reps + spare + 1))
    result = SizeResult(size, n_prompts, 0, 0.0, {s: [] for s in STACKS})
    runs = {}
    for name in (first, *(s for s in STACKS if s != first)):
        print(f"  {size}: {name} alone (prefill and decode vllm serve, proxy) ...", flush=True)
        result.idle_cores[name], runs[name] = run_stack(
            name, workdir, model, seeds, n_prompts, words, max_tokens, kv_per_token, backend, mode, nixl_num_threads
        )
    for seed in seeds:
        why = [f"{name}: {w}" for name in STACKS for w in runs[name][seed][2]]
        if why:
            result.dropped.append(f"batch {seed}: " + "; ".join(why))
            continue
        if runs["kvcore"][seed][1] != runs["nixl"][seed][1]:
            raise BenchError(f"{size}, batch {seed}: the two connectors' decodes produced different tokens")
        if len(result.reps["kvcore"]) < reps:
            for name in STACKS:
                result.reps[name].append(runs[name][seed][0])
            result.kv_mib_per_request = runs["kvcore"][seed][0].kv_mib_per_request
            result.prompt_tokens = runs["kvcore"][seed][0].prompt_tokens
    if not result.reps["kvcore"]:
        raise BenchError(f"{size}: no batch counted: " + " | ".join(result.dropped))
    return result


def table(results: list[SizeResult], backend: str, mode: str, nixl_num_threads: int) -> str:
    head = (
        f"| KV / request | prompts x tokens | reps (dropped) | decode TTFT kvcore ({backend}, {mode}) "
        f"| NixlConnector (num_threads {nixl_num_threads}) | ratio | end to end kvcore | NixlConnector | ratio "
        "| idle CPU kvcore / NIXL |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {r.kv_mib_per_request:.1f} MiB | {r.prompts} x {r.prompt_tokens} | {len(r.reps['kvcore'])} "
        f"({len(r.dropped)}) | {r.median('kvcore', 'decode_ttft_s') * 1e3:.0f} ms "
        f"| {r.median('nixl', 'decode_ttft_s') * 1e3:.0f} ms | {r.ratio('decode_ttft_s'):.2f} "
        f"| {r.median('kvcore', 'e2e_s'):.2f} s | {r.median('nixl', 'e2e_s'):.2f} s | {r.ratio('e2e_s'):.2f} "
        f"| {r.idle_cores.get('kvcore', float('nan')):.2f} / {r.idle_cores.get('nixl', float('nan')):.2f} |"
        for r in results
    ]
    dropped = [f"- {r.size}, {d}" for r in results for d in r.dropped]
    return "\n".join([head, *rows, *(["", "Dropped:", *dropped] if dropped else [])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcore_vllm.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,large", help="comma-separated: " + ", ".join(SIZES))
    parser.add_argument("--reps", type=int, default=5, help="repetitions that count, per size")
    parser.add_argument(
        "--spare", type=int, default=2, help="batches run beyond --reps, to take the place of dropped ones"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--backend", default="nixl", help="kvcore's transport")
    parser.add_argument("--mode", default="pull", choices=("pull", "push"))
    parser.add_argument(
        "--nixl-num-threads",
        type=int,
        default=4,
        help="NixlConnector's UCX worker threads (kv_connector_extra_config.num_threads; vLLM's default 4)",
    )
    parser.add_argument("--json", help="write the repetitions here")
    parser.add_argument("--workdir", help="keep models and logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; known: {', '.join(SIZES)}")
    if args.reps < 1 or args.spare < 0 or args.nixl_num_threads < 0:
        parser.error("--reps must be >= 1, --spare and --nixl-num-threads >= 0")
    with ExitStack() as stack:
        workdir = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcore-vllm-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        results = []
        for i, size in enumerate(sizes):
            first = STACKS[i % 2]
            print(f"{size}: each stack alone on this machine, {first} first ...", flush=True)
            try:
                results.append(
                    bench_size(
                        size,
                        workdir / size,
                        args.reps,
                        args.spare,
                        args.prompts,
                        args.max_tokens,
                        args.backend,
                        args.mode,
                        args.nixl_num_threads,
                        first,
                    )
                )
            except BenchError as exc:
                print(f"kvcore-vllm bench: {exc}", file=sys.stderr)
                return 1
        print(table(results, args.backend, args.mode, args.nixl_num_threads))
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
