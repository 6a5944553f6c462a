"""``make bench-vllm``: KvcoreConnector against vLLM's own NixlConnector, the same engines and prompts, one run.

For each model size two deployments are up side by side (:func:`kvcore_vllm.demo.deployment`: a prefill
and a decode ``vllm serve`` and the proxy), one with ``KvcoreConnector`` and one with ``NixlConnector``
(``kv_buffer_device: cpu``, NIXL over UCX on host memory); the prefill instances share core 0 and the
decode instances core 1. Each repetition sends the same fresh batch of prompts through each proxy at
once (the order of the two alternates from one repetition to the next) and records

- **decode TTFT**: the decode instance's own mean time to first token over the batch (vLLM's
  ``time_to_first_token_seconds`` histogram), which holds the KV load;
- **end to end**: the wall time of the whole batch through the proxy (prefill, transfer, decode);

then takes the median over repetitions and the ratio kvcore / NIXL (below 1: kvcore is faster). A
repetition counts only if the decode loaded every prompt token over its connector and computed none, and
the tokens of the two stacks agree; otherwise the run stops with the evidence.

    python -m kvcore_vllm.bench [--sizes small,large] [--reps 5] [--prompts 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
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


class BenchError(RuntimeError):
    """A repetition whose evidence does not hold (tokens recomputed or different): no number is reported."""


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

    def median(self, stack: str, what: str) -> float:
        return float(statistics.median(getattr(r, what) for r in self.reps[stack]))

    def ratio(self, what: str) -> float:
        return self.median("kvcore", what) / self.median("nixl", what)


def one_batch(
    dep: Deployment, prompts: list[str], max_tokens: int, kv_per_token: int, stack: str
) -> tuple[Rep, list[list[int]]]:
    before = dep.decode.metrics()
    started = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(dep.proxy.url, p, max_tokens, stream=True), prompts))
    e2e = time.monotonic() - started
    after = dep.decode.metrics()

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    tokens = int(d(PROMPT_TOKENS))
    if int(d(LOADED)) != tokens or d(COMPUTED) != 0 or not tokens:
        raise BenchError(
            f"{stack}: the decode loaded {int(d(LOADED))} of {tokens} prompt tokens and computed {int(d(COMPUTED))}: "
            "this repetition does not measure a transfer"
        )
    rep = Rep(
        decode_ttft_s=d(TTFT_SUM) / d(TTFT_COUNT),
        e2e_s=e2e,
        kv_mib_per_request=tokens * kv_per_token / len(prompts) / 2**20,
        prompt_tokens=tokens // len(prompts),
    )
    return rep, [g.token_ids for g in got]


def bench_size(
    size: str, workdir: Path, reps: int, n_prompts: int, max_tokens: int, backend: str, mode: str
) -> SizeResult:
    shape, words = SIZES[size]
    model = write_model(workdir / f"model-{size}", shape)
    kv_per_token = kv_bytes_per_token(shape)
    with ExitStack() as stack:
        deps = {
            "kvcore": stack.enter_context(deployment(workdir, model, backend=backend, mode=mode)),
            "nixl": stack.enter_context(deployment(workdir, model, connector="nixl")),
        }
        # One warm-up batch each (first-contact handshakes, NIXL's metadata exchange), not counted.
        for name, dep in deps.items():
            one_batch(dep, text_prompts(2, words, seed=10_000), max_tokens, kv_per_token, name)
        result = SizeResult(size, n_prompts, 0, 0.0, {s: [] for s in STACKS})
        for r in range(reps):
            prompts = text_prompts(n_prompts, words, seed=r + 1)
            order = STACKS if r % 2 == 0 else STACKS[::-1]
            answers: dict[str, list[list[int]]] = {}
            for name in order:
                rep, answers[name] = one_batch(deps[name], prompts, max_tokens, kv_per_token, name)
                result.reps[name].append(rep)
                result.kv_mib_per_request, result.prompt_tokens = rep.kv_mib_per_request, rep.prompt_tokens
            if answers["kvcore"] != answers["nixl"]:
                raise BenchError(f"{size}, repetition {r}: the two connectors' decodes produced different tokens")
            print(
                f"  {size} rep {r + 1}/{reps}: decode TTFT kvcore {result.reps['kvcore'][-1].decode_ttft_s * 1e3:.0f} ms, "
                f"nixl {result.reps['nixl'][-1].decode_ttft_s * 1e3:.0f} ms; end to end kvcore "
                f"{result.reps['kvcore'][-1].e2e_s:.2f} s, nixl {result.reps['nixl'][-1].e2e_s:.2f} s",
                flush=True,
            )
        return result


def table(results: list[SizeResult], backend: str, mode: str) -> str:
    head = (
        f"| KV / request | prompts x tokens | decode TTFT kvcore ({backend}, {mode}) | NixlConnector | ratio "
        "| end to end kvcore | NixlConnector | ratio |\n|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {r.kv_mib_per_request:.1f} MiB | {r.prompts} x {r.prompt_tokens} "
        f"| {r.median('kvcore', 'decode_ttft_s') * 1e3:.0f} ms | {r.median('nixl', 'decode_ttft_s') * 1e3:.0f} ms "
        f"| {r.ratio('decode_ttft_s'):.2f} | {r.median('kvcore', 'e2e_s'):.2f} s | {r.median('nixl', 'e2e_s'):.2f} s "
        f"| {r.ratio('e2e_s'):.2f} |"
        for r in results
    ]
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcore_vllm.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,large", help="comma-separated: " + ", ".join(SIZES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--backend", default="nixl", help="kvcore's transport")
    parser.add_argument("--mode", default="pull", choices=("pull", "push"))
    parser.add_argument("--json", help="write the repetitions here")
    parser.add_argument("--workdir", help="keep models and logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; known: {', '.join(SIZES)}")
    with ExitStack() as stack:
        workdir = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcore-vllm-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        results = []
        for size in sizes:
            print(f"{size}: starting four vllm serve (kvcore and NixlConnector, prefill and decode) ...", flush=True)
            try:
                results.append(
                    bench_size(size, workdir, args.reps, args.prompts, args.max_tokens, args.backend, args.mode)
                )
            except BenchError as exc:
                print(f"kvcore-vllm bench: {exc}", file=sys.stderr)
                return 1
        print(table(results, args.backend, args.mode))
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
