"""``kvcore demo``'s command line: its options (each one a :class:`~kvcore.testing.scenario.DemoSpec` field), the run
and the summary table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any, get_args

from kvcore.layout.topology import BlockOrder
from kvcore.testing.scenario import BOUNCE_MODES, DemoSpec
from kvcore.tools.demo.run import run_demo

__all__ = ["BLOCK_ORDERS", "add_parser", "cmd_demo"]


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
