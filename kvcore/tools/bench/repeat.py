"""``kvcore bench --invocations N``: the same bench run N times, each with fresh rank processes, and the measures
the per-request goals are stated in reported per invocation and as their median.

One invocation on a shared box moves by 10-20 % (docs/benchmarks.md): a goal such as "one-block overhead at most
1.5x the threaded floor, the median of three invocations" needs the invocations side by side. The measures
(:data:`MEASURES`) are read from each invocation's result as it is; nothing is re-measured here.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

__all__ = ["MEASURES", "goal_measures", "summarize_invocations", "print_summary"]


def _cpu_both(key: str, context: str, generation: str) -> Callable[[dict[str, Any]], float | None]:
    """The sum of a case's two sides of CPU per request (``key``: its dict; ``context``/``generation``: their keys)."""

    def read(case: dict[str, Any]) -> float | None:
        cpu = case.get(key) or {}
        if context not in cpu or generation not in cpu:
            return None
        return float(cpu[context] + cpu[generation])

    return read


def _latency(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda case: case.get("latency", {}).get(key)


def _ratio(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda case: case.get("ratios", {}).get(key)


#: ``(case kind, measure name, how to read it from the case's result)``; ``small`` covers ``small_auth`` too.
MEASURES: tuple[tuple[str, str, Callable[[dict[str, Any]], float | None]], ...] = (
    ("small", "overhead_vs_threaded_round_trip", _latency("overhead_vs_threaded_round_trip")),
    ("small", "overhead_ms_p50", _latency("overhead_ms_p50")),
    ("small", "threaded_round_trip_ms_p50", _latency("threaded_round_trip_ms_p50")),
    (
        "small",
        "cpu_us_per_request_both_processes",
        _cpu_both("cpu_us_per_request", "context.process", "generation.process"),
    ),
    # the lean floor (kvcore.tools.bench.floor): what a Python path of kvcore's shape reaches with no bookkeeping
    ("small", "lean_overhead_vs_threaded_round_trip", _latency("lean_overhead_vs_threaded_round_trip")),
    ("small", "lean_cpu_us_per_request_both_processes", _cpu_both("lean_cpu_us_per_request", "context", "generation")),
    ("small", "native_round_trip_ms_p50", _latency("native_round_trip_ms_p50")),
    ("transfer", "kvcore_vs_agent", _ratio("kvcore_vs_agent")),
    ("transfer", "kvcore_vs_bare", _ratio("kvcore_vs_bare")),
)


def _kind(case_name: str, case: dict[str, Any]) -> str:
    if case_name.startswith("small"):
        return "small"
    return "transfer" if "ratios" in case and "modes" in case else ""


def goal_measures(result: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """``{(backend, case, measure): value}`` of one invocation's result (cases and backends it lacks are absent)."""
    out: dict[tuple[str, str, str], float] = {}
    for backend, entry in result.get("backends", {}).items():
        for case_name, case in entry.get("cases", {}).items():
            kind = _kind(case_name, case)
            for measure_kind, measure, read in MEASURES:
                if measure_kind != kind:
                    continue
                value = read(case)
                if value is not None:
                    out[(backend, case_name, measure)] = float(value)
    return out


def summarize_invocations(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The invocations side by side: each one's load and verdict, and every measure's values and median.

    A measure missing from an invocation (its backend failed) is left out of that invocation's values; its
    ``invocations`` count says how many it has.
    """
    per = [goal_measures(r) for r in results]
    keys = sorted({k for p in per for k in p})
    rows = []
    for backend, case, measure in keys:
        values = [p[(backend, case, measure)] for p in per if (backend, case, measure) in p]
        rows.append(
            {
                "backend": backend,
                "case": case,
                "measure": measure,
                "values": values,
                "invocations": len(values),
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
        )
    runs = [
        {
            "loadavg": r.get("machine", {}).get("loadavg"),
            "loadavg_end": r.get("machine", {}).get("loadavg_end"),
            "seconds": r.get("seconds"),
            "ok": bool(r.get("ok")),
        }
        for r in results
    ]
    return {
        "invocations": len(results),
        "runs": runs,
        "measures": rows,
        "ok": bool(results) and all(x["ok"] for x in runs),
    }


def print_summary(summary: dict[str, Any]) -> None:
    """A table for people: every measure's median over the invocations and the values it is the median of."""
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(120, Console().width))
    for i, run in enumerate(summary["runs"], 1):
        verdict = "ok" if run["ok"] else "[red]FAILED[/]"
        con.print(f"invocation {i}: load {run['loadavg']} -> {run['loadavg_end']}, {run['seconds']:.0f} s, {verdict}")
    t = Table(title=f"median of {summary['invocations']} invocations (each with fresh rank processes)")
    for col in ("backend", "case", "measure", "median", "values"):
        t.add_column(col, justify="right" if col in ("median",) else "left")
    for row in summary["measures"]:
        t.add_row(
            row["backend"],
            row["case"],
            row["measure"],
            f"{row['median']:.3g}",
            ", ".join(f"{v:.3g}" for v in row["values"]),
        )
    con.print(t)
    con.print("OK: every invocation verified every transfer" if summary["ok"] else "[red]FAILED[/]: see the runs above")
