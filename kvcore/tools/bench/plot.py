"""``--plot``: a PNG of GB/s against fragment size (matplotlib, optional)."""

from __future__ import annotations

from typing import Any

from kvcore.tools.bench.bare import _baselines
from kvcore.tools.bench.report import _matrix_rows
from kvcore.tools.bench.spec import BenchError


def plot_result(result: dict[str, Any], path: str) -> None:
    """Write a PNG of GB/s against fragment size per backend: one panel per request size, kvcore against bare.

    Uses the matrix cells when the run has them, else the transfer cases (llama8b, frag16k). Needs matplotlib
    (``pip install 'kvcore[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError("--plot needs matplotlib: pip install 'kvcore[plot]'") from exc
    rows = _matrix_rows(result)
    if not rows:  # the transfer cases: one point per case and mode, all in one panel
        for b, entry in result["backends"].items():
            for c in entry.get("cases", {}).values():
                for mode, r in c.get("modes", {}).items() if "fragment_bytes" in c else ():
                    rows.append(
                        {
                            "backend": b,
                            "mode": mode,
                            "inflight": 1,
                            "request_tokens": 0,
                            "request_bytes": c["bytes"],
                            "fragment_bytes": c["fragment_bytes"],
                            "gbps_median": r["gbps_median"],
                        }
                    )
    if not rows:
        raise BenchError("--plot: this run has no matrix cells and no transfer cases to plot")
    sizes = sorted({r["request_bytes"] for r in rows}) if any(r["request_tokens"] for r in rows) else [None]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4.2), squeeze=False, sharey=True)
    backends = list(result["backends"])
    natives = {b: m for b in backends if (m := _baselines().matrix_mode(b))}  # plotted as the backend's "bare"
    styles = {"kvcore": "-", "agent": "--", **dict.fromkeys(natives.values(), "--"), "memcpy_scattered": ":"}
    colors = {b: f"C{i}" for i, b in enumerate(backends)}
    for ax, size in zip(axes[0], sizes):
        here = [r for r in rows if size is None or r["request_bytes"] == size]
        for b in backends:
            for mode, style in styles.items():
                if mode == "agent" and b in natives and any(r["mode"] == natives[b] for r in here):
                    continue  # the bare transport is its own API
                pts = sorted(
                    (r["fragment_bytes"], r["gbps_median"])
                    for r in here
                    if r["backend"] == b and r["mode"] == mode and r["inflight"] == 1
                )
                if pts:
                    label = f"{b} {'bare' if mode == 'agent' or mode == natives.get(b) else mode}"
                    ax.plot(*zip(*pts), style, marker="o", color=colors[b], label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # GB/s spans decades: one-block kvcore requests to memcpy
        ax.set_xlabel("fragment size (bytes)")
        ax.set_title("all requests" if size is None else f"request {size / 2**20:.1f} MiB")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("GB/s (1e9 B/s, median)")
    axes[0][-1].legend(fontsize="small")
    m = result["machine"]
    fig.suptitle(f"kvcore bench: {m['cpus']} CPUs, load {m['loadavg']} -> {m.get('loadavg_end')}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
