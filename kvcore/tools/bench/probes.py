"""A bench rank's probes: the Transceiver's step histograms, CPU seconds per thread, a busy engine thread."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any


class _ProbeModes:
    """Probe commands of both roles (a mixin of :class:`kvcore.tools.bench.rank._Rank`, which owns these attributes)."""

    tx: Any
    _busy_thread: threading.Thread | None
    _busy_stop: threading.Event
    _switch0: float

    def op_steps(self) -> dict[str, Any]:
        """This Transceiver's step histograms so far, as ``name -> [sum seconds, count]`` (for the breakdown)."""
        t = self.tx.metrics.snapshot().total
        out = {
            name: [getattr(t, f"{name}_seconds").sum, getattr(t, f"{name}_seconds").count]
            for name in ("plan", "post", "transfer", "queue", "round_trip", "service")
        }
        done = t.request_seconds.get("DONE")
        out["request"] = [done.sum, done.count] if done is not None else [0.0, 0]
        return out

    def op_cpu(self) -> dict[str, Any]:
        """CPU seconds used so far: this process, the thread serving commands (the engine's), the I/O thread; and
        the I/O thread's waits (``kvcore_io_thread_stall_seconds``, the sum and count of its wake lags)."""
        out: dict[str, Any] = {"process": time.process_time(), "engine": time.thread_time()}
        if self.tx is None:
            return {**out, "io": 0.0, "io_stall": 0.0, "lag_sum_s": 0.0, "lag_count": 0}
        snap = self.tx.metrics.snapshot()
        lag = snap.io_thread_wake_lag
        return {
            **out,
            "io": snap.io_thread_cpu_seconds,
            "io_stall": snap.io_thread_stall_seconds,
            "lag_sum_s": lag.sum,
            "lag_count": lag.count,
        }

    def op_busy(self, on: bool, switch_s: float = 0.0) -> dict[str, Any]:
        """Start (``on``) or stop a thread that runs Python without pause, as an engine's step loop does.

        ``switch_s`` > 0 lowers the GIL switch interval meanwhile (what ``gil_switch_interval_s`` does);
        stopping restores the interpreter's interval. Returns the interval in force.
        """

        if self._busy_thread is not None:
            self._busy_stop.set()
            self._busy_thread.join(10)
            self._busy_thread = None
            sys.setswitchinterval(self._switch0)
        if on:
            from kvcore.transceiver.facade import lower_switch_interval

            if switch_s > 0:
                lower_switch_interval(switch_s)
            stop = self._busy_stop = threading.Event()

            def spin() -> None:
                x = 0
                while not stop.is_set():
                    for i in range(2000):  # pure Python: the GIL is given up only when another thread asks
                        x ^= i

            self._busy_thread = threading.Thread(target=spin, name="bench-busy-engine", daemon=True)
            self._busy_thread.start()
        return {"switch_s": sys.getswitchinterval()}
