"""``make demo-vllm``: disaggregated serving on this machine with two ``vllm serve`` and kvcore between them.

It makes a tiny random Llama here (no download), asks one plain ``vllm serve`` (no connector) for the
prompts' tokens, then starts a prefill instance and a decode instance with ``KvcoreConnector`` (one CPU
core each) and the proxy of :mod:`kvcore_vllm.proxy` in front of them and sends the same prompts through
the proxy as an OpenAI client would (streamed). It prints whether the tokens are identical, how many of the prompt
tokens the decode instance loaded over kvcore rather than computed itself (vLLM's own counters), and the
time to first token. It exits 1 when the tokens differ or any prompt token was recomputed: identical
tokens alone would not show that the KV moved, since a decode that recomputes produces them too.

    python -m kvcore_vllm.demo [--backend nixl|shm] [--mode pull|push] [--prompts 8] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcore_vllm.local import LOOPBACK, Completion, ServerError, VllmServer, complete, healthy
from kvcore_vllm.tiny_model import WORDS, kv_bytes_per_token, write_model

#: Counters of the decode instance read before and after the run.
LOADED = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
COMPUTED = 'vllm:prompt_tokens_by_source_total{source="local_compute"}'
CACHED = 'vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'
PROMPT_TOKENS = "vllm:prompt_tokens_total"
TTFT_SUM, TTFT_COUNT = "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def text_prompts(n: int, words: int, seed: int = 0) -> list[str]:
    """``n`` different prompts of ``words`` words (about as many tokens) drawn from the tokenizer's text."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


@dataclass
class Proxy:
    """``python -m kvcore_vllm.proxy`` in a process of its own."""

    prefill: list[str]
    decode: list[str]
    port: int
    log_path: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> Proxy:
        cmd = [sys.executable, "-m", "kvcore_vllm.proxy", "--port", str(self.port)]
        for u in self.prefill:
            cmd += ["--prefill", u]
        for u in self.decode:
            cmd += ["--decode", u]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise ServerError(f"the proxy exited\n{Path(self.log_path).read_text(errors='replace')[-3000:]}")
            if healthy(self.url):
                return
            time.sleep(0.5)
        raise ServerError(f"the proxy was not healthy within {timeout:.0f}s")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None


@dataclass
class Deployment:
    """A prefill and a decode ``vllm serve`` and the proxy in front of them."""

    prefill: VllmServer
    decode: VllmServer
    proxy: Proxy
    servers: list[VllmServer] = field(default_factory=list)


@contextlib.contextmanager
def deployment(
    workdir: str | Path,
    model_dir: str,
    *,
    connector: str = "kvcore",
    backend: str = "nixl",
    mode: str = "pull",
    extra: dict[str, Any] | None = None,
    cores: tuple[str, str] = ("0", "1"),
    tensor_parallel: tuple[int, int] = (1, 1),
    boot_timeout_s: float = 600.0,
) -> Iterator[Deployment]:
    """Start the two instances side by side and the proxy; stop all of them on the way out."""
    workdir = Path(workdir)
    extra = {"gil_switch_interval_s": 0.0005, **(extra or {})} if connector == "kvcore" else dict(extra or {})
    tag = f"{connector}-{backend}-{mode}" if connector == "kvcore" else connector

    def side_channel() -> dict[str, str]:
        # vLLM's NixlConnector: every instance's handshake listener on a port of its own (its default, 5600, is
        # shared by every instance on a host), on loopback.
        if connector != "nixl":
            return {}
        return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK}

    prefill = VllmServer(
        model_dir, free_port(), "prefill", connector, backend, mode, extra, cpu=cores[0],
        tensor_parallel_size=tensor_parallel[0], log_path=str(workdir / f"prefill-{tag}.log"), env=side_channel(),
    )  # fmt: skip
    decode = VllmServer(
        model_dir, free_port(), "decode", connector, backend, mode, extra, cpu=cores[1],
        tensor_parallel_size=tensor_parallel[1], log_path=str(workdir / f"decode-{tag}.log"), env=side_channel(),
    )  # fmt: skip
    proxy = Proxy([prefill.url], [decode.url], 0, str(workdir / f"proxy-{tag}.log"))
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready(boot_timeout_s)
        decode.wait_ready(boot_timeout_s)
        proxy.port = free_port()  # taken now, not before the boot: a port free a minute ago may be in use by now
        proxy.start().wait_ready()
        yield Deployment(prefill, decode, proxy, [prefill, decode])
    finally:
        proxy.close()
        for s in (decode, prefill):
            s.close()


@dataclass
class DemoResult:
    """What one run showed; ``ok`` when the tokens are identical and no prompt token was recomputed."""

    prompts: int
    identical: int
    prompt_tokens: int
    loaded: int
    computed: int
    cached: int
    ttft_s: list[float]
    decode_ttft_s: float | None
    kv_bytes_per_request: float
    mismatches: list[tuple[list[int], list[int]]]

    @property
    def ok(self) -> bool:
        return self.identical == self.prompts and self.loaded == self.prompt_tokens and self.computed == 0


def plain_tokens(
    workdir: str | Path, model_dir: str, prompts: list[str], max_tokens: int, cpu: str = "0"
) -> list[list[int]]:
    """The greedy tokens of one plain ``vllm serve`` (no connector) for ``prompts``; the server is gone after."""
    server = VllmServer(model_dir, free_port(), "plain", cpu=cpu, log_path=str(Path(workdir) / "plain.log"))
    try:
        server.start().wait_ready()
        return [complete(server.url, p, max_tokens, stream=False).token_ids for p in prompts]
    finally:
        server.close()


def run_through(
    dep: Deployment, prompts: list[str], max_tokens: int, kv_per_token: int, want: list[list[int]] | None = None
) -> DemoResult:
    """Send ``prompts`` through the proxy (streamed); compare with ``want`` and count.

    ``want`` is a plain engine's tokens (:func:`plain_tokens`); without it the prefill instance answers the
    same prompts on its own (a quicker check: it has the connector, but computes the whole answer itself).
    """
    before = dep.decode.metrics()
    got: list[Completion] = [complete(dep.proxy.url, p, max_tokens, stream=True) for p in prompts]
    after = dep.decode.metrics()
    if want is None:
        want = [complete(dep.prefill.url, p, max_tokens, stream=False).token_ids for p in prompts]

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    count = d(TTFT_COUNT)
    mismatches = [(w, g.token_ids) for w, g in zip(want, got) if w != g.token_ids]
    prompt_tokens = int(d(PROMPT_TOKENS))
    return DemoResult(
        prompts=len(prompts),
        identical=len(prompts) - len(mismatches),
        prompt_tokens=prompt_tokens,
        loaded=int(d(LOADED)),
        computed=int(d(COMPUTED)),
        cached=int(d(CACHED)),
        ttft_s=[g.ttft_s for g in got],
        decode_ttft_s=d(TTFT_SUM) / count if count else None,
        kv_bytes_per_request=prompt_tokens * kv_per_token / max(1, len(prompts)),
        mismatches=mismatches,
    )


def report(result: DemoResult, backend: str, mode: str) -> str:
    mib = result.kv_bytes_per_request / 2**20
    ttft = statistics.median(result.ttft_s) if result.ttft_s else float("nan")
    lines = [
        f"kvcore-vllm demo: prefill and decode vllm serve, KvcoreConnector over {backend} ({mode}), proxy in front",
        f"  tokens identical to a plain engine (no connector): {result.identical} of {result.prompts} prompts",
        f"  prompt tokens loaded over kvcore: {result.loaded} of {result.prompt_tokens} "
        f"({result.computed} recomputed, {result.cached} from the decode's own cache; {mib:.2f} MiB of KV a request)",
        f"  time to first token (client, through the proxy): median {ttft * 1e3:.0f} ms"
        + (f"; decode instance's own TTFT: mean {result.decode_ttft_s * 1e3:.0f} ms" if result.decode_ttft_s else ""),
        "  OK"
        if result.ok
        else "  FAILED: " + ("tokens differ" if result.mismatches else "prompt tokens were recomputed"),
    ]
    return "\n".join(lines)


def stop_on_sigterm() -> None:
    """SIGTERM ends the run like Ctrl-C does: the servers (in sessions of their own) are stopped on the way out."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcore_vllm.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="nixl", help="kvcore transport (nixl, shm, ucx, ...)")
    parser.add_argument("--mode", default="pull", choices=("pull", "push"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--words", type=int, default=256, help="words a prompt (about as many tokens)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--workdir", help="keep the model and the logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcore-vllm-demo-"))
        Path(workdir).mkdir(parents=True, exist_ok=True)
        print(f"making a tiny random Llama in {workdir} ...", flush=True)
        model = write_model(Path(workdir) / "model")
        from kvcore_vllm.tiny_model import MODEL

        prompts = text_prompts(args.prompts, args.words)
        try:
            print("asking one plain engine (no connector) for the reference tokens (about a minute) ...", flush=True)
            want = plain_tokens(workdir, model, prompts, args.max_tokens)
            print("starting the prefill and decode instances (about a minute) ...", flush=True)
            with deployment(workdir, model, backend=args.backend, mode=args.mode) as dep:
                result = run_through(dep, prompts, args.max_tokens, kv_bytes_per_token(MODEL), want)
        except ServerError as exc:
            print(f"kvcore-vllm demo: {exc}", file=sys.stderr)
            return 2
        print(report(result, args.backend, args.mode))
        return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
