"""One log line per key per interval: for lines a peer can cause at will."""

from __future__ import annotations

import collections
import logging
import time

log = logging.getLogger("kvcore.control.messenger")


class RateLimitedLog:
    """At most one line per key per interval; the next line says how many were suppressed.

    For lines a peer can cause at will (a refused frame, a refused ticket): they are all counted elsewhere, and a
    flood of them must not become a flood of log lines.
    """

    def __init__(self, interval_s: float = 5.0, logger: logging.Logger | None = None) -> None:
        self._log = logger or log
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()

    def __call__(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self._interval:
            self._suppressed[key] += 1
            return
        if len(self._last) > 256:  # keys are few and fixed; bound the table anyway
            self._last.clear()
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        self._log.log(level, msg + (f" ({n} similar suppressed)" if n else ""), *args, exc_info=exc_info)
