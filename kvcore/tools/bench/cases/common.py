"""What the cases share when they assemble a result: bandwidth summaries and the end-of-shape checks."""

from __future__ import annotations

import statistics
from typing import Any

from kvcore.tools.bench.spec import _GB


def _summarize(nbytes: int, times: list[float], first: float) -> dict[str, Any]:
    """GB/s and ms (median, best) of the timed rounds ``times``, the warm-up round ``first`` apart."""
    med = statistics.median(times)
    return {
        "gbps_median": nbytes / med / _GB,
        "gbps_best": nbytes / min(times) / _GB,
        "ms_median": med * 1e3,
        "ms_best": min(times) * 1e3,
        "first_ms": first * 1e3,
        "times_ms": [t * 1e3 for t in times],
    }


def shape_verified(out: dict[str, Any], shape_checks: dict[str, Any]) -> bool:
    """The checks every case that opened a shape shares: the whole pool verified, first contact verified, no
    context-side error."""
    return bool(shape_checks["pool_verified"] and out["first_contact_verified"] and not shape_checks["context_errors"])
