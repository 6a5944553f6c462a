"""``kvcore bench`` on the command line: its options, the spec built from them, and the exit status."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvcore.errors import KvcoreError
from kvcore.tools.bench.plot import plot_result
from kvcore.tools.bench.report import print_result
from kvcore.tools.bench.run import CASES, BenchProgress, run_bench
from kvcore.tools.bench.spec import BenchError, BenchSpec


def add_parser(sub: Any) -> None:
    """Register ``kvcore bench`` on the CLI's subparsers."""
    d = BenchSpec()
    p = sub.add_parser("bench", help="kvcore end to end vs the bare transport vs memcpy, same fragments, one run")
    p.add_argument(
        "--backend", default="", help="comma-separated backends (nixl,ucx,shm); default: every installed one"
    )
    p.add_argument("--cases", default=",".join(d.cases), help=f"comma-separated cases (known: {', '.join(CASES)})")
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens of the llama8b request")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--tokens-per-block", type=int, default=d.tokens_per_block)
    p.add_argument("--fragments", type=int, default=d.fragments, help="16 KiB fragments of the frag16k case")
    p.add_argument("--iterations", type=int, default=d.iterations, help="timed rounds after one warm-up round")
    p.add_argument("--small-requests", type=int, default=d.small_requests, help="one-block requests in flight at once")
    p.add_argument("--latency-requests", type=int, default=d.latency_requests, help="one-block requests one at a time")
    p.add_argument(
        "--hol-requests",
        type=int,
        default=d.hol_requests,
        help="hol case: one-block requests per round, alone and beside the big request",
    )
    p.add_argument(
        "--poll-interval-us",
        type=float,
        default=d.poll_interval_s * 1e6,
        help="the generation rank's engine loop sleeps this long between poll() calls; 0 (the default): it "
        "blocks in Transceiver.wait() until there is news",
    )
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="bound in seconds on every rank command")
    p.add_argument("--agent-options", default="{}", help='JSON: {"nixl": {...}, "ucx": {...}}')
    p.add_argument(
        "--native-lane",
        action="store_true",
        help="run the transceivers with config.native_lane: common push requests on kvcore-native's lane (nixl, "
        "ucx); each case then reports lane_requests, the requests each side's lane served or was answered",
    )
    soak = p.add_argument_group("soak case (--cases soak)")
    soak.add_argument("--requests", type=int, default=d.requests, help="one-block requests in the soak")
    soak.add_argument("--inflight", type=int, default=d.inflight, help="soak requests in flight on each side")
    soak.add_argument("--cancel-rate", type=float, default=d.cancel_rate, help="fraction cancelled, half by each side")
    soak.add_argument(
        "--soak-request-timeout",
        type=float,
        default=d.soak_request_timeout_s,
        help="the transceivers' request_timeout_s during the soak (seconds)",
    )
    mx = p.add_argument_group("matrix (--matrix)")
    mx.add_argument(
        "--matrix",
        action="store_true",
        help="GB/s over request size x fragment size x requests in flight (Llama-3-70B-shaped), bare and memcpy too",
    )
    mx.add_argument(
        "--quick", action="store_true", help="a small matrix (2 x 3 x 2 cells of a 2-layer model); implies --matrix"
    )
    mx.add_argument("--matrix-tokens", default="", help=f"request sizes in tokens (default {d.matrix_tokens})")
    mx.add_argument(
        "--matrix-fragment-bytes",
        default="",
        help=f"fragment sizes in bytes, 0 = one whole block (default {d.matrix_fragment_bytes})",
    )
    mx.add_argument("--matrix-inflight", default="", help=f"requests in flight (default {d.matrix_inflight})")
    mx.add_argument("--matrix-iterations", type=int, default=d.matrix_iterations, help="timed rounds per cell")
    p.add_argument("--plot", metavar="FILE.png", default="", help="plot GB/s against fragment size (needs matplotlib)")
    p.add_argument(
        "--auth",
        action="store_true",
        help="run the small case twice with the same rank processes: without, then with CurveZMQ on both control "
        "planes (case small_auth; a fresh key pair per instance in a private temporary directory, removed after)",
    )
    p.add_argument(
        "--invocations",
        type=int,
        default=1,
        help="run the whole bench this many times (1-20), each with fresh rank processes, and report the goal "
        "measures (one-block overhead vs the threaded floor, CPU per request, kvcore/agent) per invocation and "
        "their median",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON (no progress bar)")
    p.set_defaults(func=cmd_bench)


def _int_list(text: str, name: str) -> list[int] | None:
    if not text.strip():
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{name}: expected comma-separated integers, got {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    """``kvcore bench``: run, print a table (or JSON), exit 0 only when every byte was verified and nothing leaked."""
    try:
        spec = BenchSpec(
            backends=[b.strip() for b in args.backend.split(",") if b.strip()] or None,
            cases=[c.strip() for c in args.cases.split(",") if c.strip()],
            tokens=args.tokens,
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            tokens_per_block=args.tokens_per_block,
            fragments=args.fragments,
            iterations=args.iterations,
            small_requests=args.small_requests,
            latency_requests=args.latency_requests,
            hol_requests=args.hol_requests,
            timeout_s=args.timeout,
            poll_interval_s=args.poll_interval_us / 1e6,
            agent_options=json.loads(args.agent_options),
            requests=args.requests,
            inflight=args.inflight,
            cancel_rate=args.cancel_rate,
            soak_request_timeout_s=args.soak_request_timeout,
            matrix_iterations=args.matrix_iterations,
            native_lane=args.native_lane,
        )
        if args.matrix or args.quick:
            spec.cases = ["matrix"]
        if args.auth:
            spec.auth = True
            if "small" not in spec.cases:
                spec.cases.append("small")
            if "small_auth" not in spec.cases:
                spec.cases.insert(spec.cases.index("small") + 1, "small_auth")
        if args.quick:
            spec = spec.quick_matrix()
        for name in ("matrix_tokens", "matrix_fragment_bytes", "matrix_inflight"):
            values = _int_list(getattr(args, name), "--" + name.replace("_", "-"))
            if values is not None:
                setattr(spec, name, values)
        if args.plot and not args.plot.lower().endswith(".png"):
            raise BenchError(f"--plot: expected a .png file name, got {args.plot!r}")
        if not 1 <= args.invocations <= 20:
            raise BenchError(f"--invocations must be 1..20, got {args.invocations}")
        if args.invocations > 1 and args.plot:
            raise BenchError("--plot plots one invocation: leave out --invocations")
        if args.invocations > 1:
            return _repeat(spec, args.invocations, args.json)
        result = run_bench(spec, **_reporter(args.json))
        if args.plot:
            plot_result(result, args.plot)
    except (KvcoreError, ValueError) as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        else:
            print(f"kvcore bench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_result(result)
    return 0 if result["ok"] else 1


def _reporter(as_json: bool) -> dict[str, Any]:
    """How ``run_bench`` reports its steps: nothing with ``--json``; a bar on a terminal; else a line per step.

    A log (stderr to a file or a pipe, as on CI or a remote machine) gets each step with the seconds since the
    bench started, so a run stopped by a time limit still shows how far it got.
    """
    if as_json:
        return {}
    if sys.stderr.isatty():
        return {"progress": BenchProgress()}
    t0 = time.monotonic()

    def say(message: str) -> None:
        print(f"kvcore bench [{time.monotonic() - t0:5.0f} s]: {message}", file=sys.stderr, flush=True)

    return {"say": say}


def _repeat(spec: BenchSpec, n: int, as_json: bool) -> int:
    """``--invocations n``: ``run_bench`` n times; the summary (and, as JSON, every invocation's result)."""
    from kvcore.tools.bench.repeat import print_summary, summarize_invocations

    results = []
    for i in range(n):
        if not as_json:
            print(f"kvcore bench: invocation {i + 1} of {n}", file=sys.stderr, flush=True)
        results.append(run_bench(spec, **_reporter(as_json)))
    summary = summarize_invocations(results)
    if as_json:
        print(json.dumps({"version": 1, "summary": summary, "invocations": results, "ok": summary["ok"]}, indent=2))
    else:
        print_summary(summary)
    return 0 if summary["ok"] else 1
