"""The result for people: rich tables per backend, case and mode (``--json`` prints the result dict itself)."""

from __future__ import annotations

import json
from typing import Any

from kvcore.tools.bench.bare import _baselines


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:g} KiB"


def print_result(result: dict[str, Any]) -> None:
    """Rich tables for people: bandwidth per backend, case and mode; small-request latency and rate."""
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(120, Console().width))
    m = result["machine"]
    con.print(
        f"[bold]kvcore bench[/] on {m['cpus']} CPUs, load {m['loadavg']} -> {m.get('loadavg_end')}, "
        f"{result['seconds']:.0f} s; GB/s = 1e9 B/s; 'vs bare' = kvcore / fastest bare transport mode"
    )
    t = Table(title="bandwidth (median of the timed rounds; best; first round apart)")
    for col in ("backend", "case", "mode", "GB/s", "best", "ms", "first ms", "kvcore/this", "verified"):
        t.add_column(col, justify="right" if col not in ("backend", "case", "mode") else "left")
    s = Table(title="one-block requests")
    for col in (
        "backend",
        "kvcore p50 ms",
        "p99 ms",
        "agent p50 ms",
        "overhead p50",
        "zmq round trip p50 / threaded / lean / native",
        "plan hot / after 1 ms sleep us",
        "CPU us/req ctx / gen (lean)",
        "req/s in flight",
        "first contact ms",
        "verified",
    ):
        s.add_column(col, justify="right" if col != "backend" else "left")
    for backend, entry in result["backends"].items():
        if entry.get("error"):
            t.add_row(backend, "-", "[red]error[/]", "", "", "", "", "", f"[red]{entry['error'][:80]}[/]")
        for case, c in entry["cases"].items():
            if "push_vs_pull" in c:
                for label in ("big", "one_block"):
                    r = c[label]
                    for i, mode in enumerate(("push", "pull")):
                        t.add_row(
                            backend if i == 0 else "",
                            f"{case} ({label}, {_size(r['bytes'])})" if i == 0 else "",
                            mode,
                            f"{r[mode]['gbps_median']:.2f}",
                            "",
                            f"{r[mode]['ms_median']:.2f}",
                            "",
                            f"pull/push time {r['pull_vs_push_time']:.2f}" if mode == "pull" else "",
                            "[green]yes[/]" if r["verified"] else "[red]NO[/]",
                            end_section=i == 1,
                        )
            elif "ratio_bounce_vs_fragments" in c:
                for i, (mode, r) in enumerate(c["modes"].items()):
                    ratio = c["ratio_bounce_vs_fragments"]
                    t.add_row(
                        backend if i == 0 else "",
                        f"{case} ({c['topology']})" if i == 0 else "",
                        mode,
                        f"{r['gbps']:.2f}",
                        "",
                        f"{(r['seconds'] or 0) * 1e3:.1f}",
                        "",
                        f"bounce/this {ratio:.2f}" if mode == "per_token_fragments" and ratio else "",
                        "[green]yes[/]" if r["verified"] else "[red]NO[/]",
                        end_section=i == 1,
                    )
            elif "modes" in c:
                kv = c["modes"]["kvcore"]["gbps_median"]
                label = f"{case} ({c['fragments']} x {c['fragment_bytes'] / 1024:g} KiB)"
                for i, (mode, r) in enumerate(c["modes"].items()):
                    t.add_row(
                        backend if i == 0 else "",
                        label if i == 0 else "",
                        mode + (" (bare)" if mode == c["bare_mode"] else ""),
                        f"{r['gbps_median']:.2f}",
                        f"{r['gbps_best']:.2f}",
                        f"{r['ms_median']:.2f}",
                        f"{r['first_ms']:.1f}",
                        "" if mode == "kvcore" else f"{kv / r['gbps_median']:.2f}",
                        "[green]yes[/]" if r["verified"] else "[red]NO[/]",
                    )
                t.add_row(
                    "", "", f"first contact {c['first_contact_ms']:.1f} ms", "", "", "", "", "", "", end_section=True
                )
                if c.get("leaks"):
                    t.add_row(backend, case, "[red]leaks[/]", json.dumps(c["leaks"])[:60], "", "", "", "", "")
            elif "latency" in c:
                lat, thr = c["latency"], c["throughput"]
                s.add_row(
                    backend + (" + CURVE" if c.get("auth") else ""),
                    f"{lat['kvcore_ms_p50']:.3f}",
                    f"{lat['kvcore_ms_p99']:.3f}",
                    f"{lat['agent_ms_p50']:.3f}",
                    f"{lat['overhead_ms_p50']:.3f}",
                    f"{lat['zmq_round_trip_ms_p50']:.3f} / {lat['threaded_round_trip_ms_p50']:.3f}"
                    + (f" / {lat['lean_round_trip_ms_p50']:.3f}" if "lean_round_trip_ms_p50" in lat else "")
                    + (f" / {lat['native_round_trip_ms_p50']:.3f}" if lat.get("native_round_trip_ms_p50") else ""),
                    _warmth(c.get("warmth")),
                    _cpu(c.get("cpu_us_per_request"), c.get("lean_cpu_us_per_request")),
                    f"{thr['requests_per_s']:.0f} ({thr['requests']})",
                    f"{c['first_contact_ms']:.1f}",
                    "[green]yes[/]" if c["verified"] else "[red]NO[/]",
                )
    if t.row_count:
        con.print(t)
    if s.row_count:
        con.print(s)
    _print_hol(con, result)
    _print_busy(con, result)
    _print_soak(con, result)
    _print_matrix(con, result)
    con.print("[green]OK: every transfer verified, nothing leaked[/]" if result["ok"] else "[red]FAILED[/]")


def _warmth(w: dict[str, float] | None) -> str:
    """``hot / after a 1 ms sleep`` of the warmth probe (``kvcore.tools.bench.floor``), in microseconds."""
    if not w:
        return ""
    return f"{w['hot_us_p50']:.0f} / {w['after_sleep_1ms_us_p50']:.0f} ({w['after_sleep_1ms_vs_hot']:.1f}x)"


def _cpu(cpu: dict[str, float] | None, lean: dict[str, float] | None = None) -> str:
    """CPU microseconds per one-at-a-time request, each side's whole process (its I/O thread in brackets), and
    the lean floor's (both processes) after it."""
    if not cpu:
        return ""
    out = (
        f"{cpu['context.process']:.0f} ({cpu['context.io']:.0f}) / "
        f"{cpu['generation.process']:.0f} ({cpu['generation.io']:.0f})"
    )
    return out + (f" ({lean['context'] + lean['generation']:.0f})" if lean else "")


def _lags(lag: dict[str, float] | None) -> str:
    """Mean wake lag of the context's and the generation's I/O threads (ms), from their own metrics."""
    return f"{lag['context']:.2f} / {lag['generation']:.2f}" if lag else ""


def _print_busy(con: Any, result: dict[str, Any]) -> None:
    """The busy case: one-block latency while one rank's engine thread runs Python, per GIL switch interval."""
    from rich.table import Table

    t = Table(title="one-block requests beside a busy engine thread (GIL switch interval)")
    cols = ("backend", "busy engine", "switch ms", "kvcore p50 ms", "p99 ms", "vs idle", "zmq p50 ms")
    for col in (*cols, "I/O wake lag ms ctx/gen", "verified"):
        t.add_column(col, justify="left" if col in ("backend", "busy engine") else "right")
    for backend, entry in result["backends"].items():
        c = entry.get("cases", {}).get("busy")
        if not c or "rows" not in c:
            continue
        for i, row in enumerate(c["rows"]):
            t.add_row(
                backend if i == 0 else "",
                row["busy"],
                f"{row['switch_interval_s'] * 1e3:g}",
                f"{row['kvcore_ms_p50']:.2f}",
                f"{row['kvcore_ms_p99']:.2f}",
                f"{row['kvcore_vs_idle_p50']:.1f}x",
                f"{row['zmq_round_trip_ms_p50']:.2f}",
                _lags(row.get("io_wake_lag_ms_mean")),
                ("[green]yes[/]" if c["verified"] else "[red]NO[/]") if i == 0 else "",
                end_section=i == len(c["rows"]) - 1,
            )
    if t.row_count:
        con.print(t)


def _print_hol(con: Any, result: dict[str, Any]) -> None:
    """The hol case: one-block latency alone and beside the big request, per backend."""
    from rich.table import Table

    t = Table(title="head of line: one-block requests alone and while the big request moves (same rank)")
    for col in ("backend", "block", "alone p50 ms", "during p50 ms", "during/alone", "during n", "big ms", "verified"):
        t.add_column(col, justify="left" if col == "backend" else "right")
    for backend, entry in result["backends"].items():
        c = entry.get("cases", {}).get("hol")
        if not c or "one_block" not in c:
            continue
        o = c["one_block"]
        t.add_row(
            backend,
            f"{c['block_bytes'] / 1024:g} KiB",
            f"{o['alone_ms_p50']:.3f}",
            "-" if o["during_ms_p50"] is None else f"{o['during_ms_p50']:.3f}",
            "-" if o["during_vs_alone_p50"] is None else f"{o['during_vs_alone_p50']:.2f}",
            str(o["requests_during"]),
            f"{c['big_ms_median']:.1f}",
            "[green]yes[/]" if c["verified"] else "[red]NO[/]",
        )
    if t.row_count:
        con.print(t)


def _print_soak(con: Any, result: dict[str, Any]) -> None:
    """The soak: outcomes per kind on each side, broken promises, leaks and latency."""
    from rich.table import Table

    t = Table(title="soak: every request reported once and released on both sides, nothing left behind")
    for col in ("backend", "side", "outcomes", "error kinds", "cancels", "unreleased", "p50 ms", "p99 ms", "leaks"):
        t.add_column(col, justify="left" if col in ("backend", "side", "outcomes", "error kinds", "leaks") else "right")
    for backend, entry in result["backends"].items():
        c = entry["cases"].get("soak")
        if not c:
            continue
        for i, side in enumerate(("context", "generation")):
            r = c.get(side)
            if r is None:
                continue
            lat = r["latency_ms"]
            broken = [k for k, ok in c["promises"][side].items() if not ok]
            t.add_row(
                backend if i == 0 else "",
                side,
                ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items())),
                ", ".join(f"{k} {v}" for k, v in sorted(r["error_kinds"].items())) or "-",
                f"{r['cancels_accepted']}/{r['cancel_calls']}",
                f"[red]{r['unreleased']}[/]" if r["unreleased"] else "0",
                f"{lat['p50']:.2f}" if lat["p50"] is not None else "-",
                f"{lat['p99']:.2f}" if lat["p99"] is not None else "-",
                ("[red]" + json.dumps(r["leaks"]) + "[/]" if r["leaks"] else "none")
                + (f" [red]broken: {', '.join(broken)}[/]" if broken else ""),
                end_section=i == 1,
            )
    if t.row_count:
        con.print(t)


def _matrix_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every matrix cell of every backend, with its backend."""
    return [
        {"backend": b, **cell}
        for b, entry in result["backends"].items()
        for cell in entry.get("cases", {}).get("matrix", {}).get("cells", [])
    ]


def _print_matrix(con: Any, result: dict[str, Any]) -> None:
    """One row per (backend, request size, fragment size): kvcore at each in-flight count, bare, memcpy."""
    from rich.table import Table

    rows = _matrix_rows(result)
    if not rows:
        return
    inflight = sorted({r["inflight"] for r in rows if r["mode"] == "kvcore"})
    t = Table(title="matrix: GB/s (median); kvcore xN = N requests in flight; bare = the transport alone")
    for col in ("backend", "request", "fragment", "fragments", *[f"kvcore x{n}" for n in inflight]):
        t.add_column(col, justify="left" if col == "backend" else "right")
    for col in ("bare", "memcpy", "memcpy scattered", "kvcore x1 / bare", "verified"):
        t.add_column(col, justify="right")
    keys = dict.fromkeys((r["backend"], r["request_tokens"], r["fragment_bytes"]) for r in rows)
    for backend, tokens, frag in keys:
        cell = {
            (r["mode"], r["inflight"]): r
            for r in rows
            if (r["backend"], r["request_tokens"], r["fragment_bytes"]) == (backend, tokens, frag)
        }
        native = _baselines().matrix_mode(backend)
        bare = (cell.get((native, 1)) if native else None) or cell.get(("agent", 1))
        kv1 = cell.get(("kvcore", 1))

        def g(key: tuple[str, int], cell: dict[tuple[str, int], dict[str, Any]] = cell) -> str:
            return f"{cell[key]['gbps_median']:.2f}" if key in cell else "-"

        any_row = next(iter(cell.values()))
        t.add_row(
            backend,
            f"{tokens} tok ({any_row['request_bytes'] / 2**20:.1f} MiB)",
            f"{frag / 1024:g} KiB",
            str(any_row["fragments"]),
            *[g(("kvcore", n)) for n in inflight],
            f"{bare['gbps_median']:.2f}" if bare else "-",
            g(("memcpy", 1)),
            g(("memcpy_scattered", 1)),
            f"{kv1['gbps_median'] / bare['gbps_median']:.2f}" if kv1 and bare else "-",
            "[green]yes[/]" if all(r["verified"] for r in cell.values()) else "[red]NO[/]",
        )
    con.print(t)
