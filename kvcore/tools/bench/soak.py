"""A bench rank's side of the soak (both roles): start, randomly cancel and poll many one-block requests.

The case itself (both ranks driven together, the verdict) is :mod:`kvcore.tools.bench.cases.soak`.
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcore.params import derive_ticket
from kvcore.tools.bench.blocks import _region_span
from kvcore.tools.bench.spec import BenchSpec, Shape, _pct


class _SoakModes:
    """The soak command (a mixin of :class:`kvcore.tools.bench.rank._Rank`, which owns these attributes)."""

    role: str
    spec: BenchSpec
    tx: Any
    shape: Shape | None
    secret: bytes
    pool: Any
    expected: Any
    written: set[str]
    ids: dict[str, np.ndarray]
    pending: dict[int, float]

    if TYPE_CHECKING:

        def op_drain(self) -> dict[str, Any]:
            """The context's drain (:meth:`kvcore.tools.bench.rank._Rank.op_drain`)."""
            raise NotImplementedError

    def op_soak(
        self, rid0: int, requests: int, inflight: int, cancel_rate: float, deadline_s: float, endpoint: str = ""
    ) -> dict[str, Any]:
        """Run this side of the soak: start, randomly cancel and poll ``requests`` one-block requests.

        Request ``rid0 + i`` reads context block ``i % inflight`` (logical id ``i % inflight``) and lands in a
        free generation slot, zeroed first and reused only after its release. Each side cancels about
        ``cancel_rate / 2`` of the requests, 0-5 ms after starting them. Returns outcome counts, what broke
        a promise (a request reported twice, released before its outcome, never released, wrong bytes),
        latencies, and the transceiver's stats once it has settled (tombstones expired).
        """
        import torch

        assert self.shape is not None
        gen = self.role == "generation"
        tpb = self.shape.tokens_per_block
        rng = np.random.default_rng([self.spec.seed, 11 if gen else 12])
        ids = self.ids["big"]
        nslots = len(ids)
        free = list(range(nslots))  # generation: free slots (indexes into ids)
        slot_of: dict[int, int] = {}
        src_of: dict[int, int] = {}
        pending: dict[int, float] = {}  # started, not yet released -> start time
        reported: dict[int, str] = {}
        latency: dict[int, float] = {}
        cancels: list[tuple[float, int]] = []  # heap of (due time, request id)
        out: dict[str, Any] = {
            "outcomes": {},
            "error_kinds": {},
            "cancel_calls": 0,
            "cancels_accepted": 0,
            "duplicate_outcomes": 0,
            "released_before_outcome": 0,
            "byte_mismatches": 0,
            "errors": [],
        }
        from kvcore.transceiver import leaks

        if not gen:
            self.op_drain()  # the first-contact request is released by the serve loop's poll, not by ours
        started, released = 0, 0
        t0 = time.monotonic()
        deadline = t0 + deadline_s

        def handle(r: Any, now: float) -> int:
            n = 0
            for o in r.outcomes:
                rid = o.request_id
                if rid in reported:
                    out["duplicate_outcomes"] += 1
                    continue
                state = o.state.value
                reported[rid] = state
                latency[rid] = now - pending.get(rid, now)
                out["outcomes"][state] = out["outcomes"].get(state, 0) + 1
                if o.error is not None:
                    kind = type(o.error).__name__
                    out["error_kinds"][kind] = out["error_kinds"].get(kind, 0) + 1
                    if state != "CANCELLED" and len(out["errors"]) < 5:
                        out["errors"].append(f"request {rid}: {kind}: {o.error}")
                if gen and state == "DONE":
                    row = int(ids[slot_of[rid]])
                    want = int(self.ids["big"][src_of[rid]])
                    if not torch.equal(self.pool[row], self.expected[want]):
                        out["byte_mismatches"] += 1
            for rid in r.released:
                self.pending.pop(rid, None)  # a request started before the soak (not one of ours)
                if rid not in reported:
                    out["released_before_outcome"] += 1
                if pending.pop(rid, None) is not None:
                    n += 1
                if gen and rid in slot_of:
                    free.append(slot_of.pop(rid))
            return n

        # Every request ends within its timeout on a healthy transceiver: no release for two of them means stuck.
        stall_s = 2 * self.tx.config.request_timeout_s + 5.0
        progress = t0
        while (started < requests or pending) and time.monotonic() < deadline:
            if started == requests and time.monotonic() - progress > stall_s:
                break
            while started < requests and len(pending) < inflight and (free or not gen):
                rid = rid0 + started
                src = started % nslots
                if gen:
                    slot = free.pop()
                    self.pool[int(ids[slot])].zero_()  # a missing write cannot pass for a done one
                    slot_of[rid], src_of[rid] = slot, src
                    pending[rid] = time.monotonic()
                    self.tx.start_receive(
                        rid, endpoint, ids[slot : slot + 1], prompt_len=tpb, ticket=derive_ticket(self.secret, rid)
                    )
                else:
                    pending[rid] = time.monotonic()
                    self.tx.start_send(rid, ids[src : src + 1], prompt_len=tpb, ticket=derive_ticket(self.secret, rid))
                if rng.random() < cancel_rate / 2:
                    heapq.heappush(cancels, (time.monotonic() + float(rng.uniform(0.0, 0.005)), rid))
                started += 1
            now = time.monotonic()
            while cancels and cancels[0][0] <= now:
                _, rid = heapq.heappop(cancels)
                if rid in pending:
                    out["cancel_calls"] += 1
                    out["cancels_accepted"] += bool(self.tx.cancel(rid, "soak: random cancel"))
            n = handle(self.tx.poll(), time.monotonic())
            if n:
                released += n
                progress = time.monotonic()
            time.sleep(self.spec.poll_interval_s or 0.0001)  # cancels are due on a clock: a timer, not wait()
        out["seconds"] = time.monotonic() - t0
        out["started"], out["released"], out["unreleased"] = started, released, len(pending)
        out["unreleased_ids"] = sorted(pending)[:10]
        # Settle: tombstones and timers expire on the transceiver's own clock; keep polling so that
        # anything still quiescent is released, then read the live counts.
        settle = time.monotonic() + self.tx.config.request_timeout_s + 5.0
        while time.monotonic() < settle:
            handle(self.tx.poll(), time.monotonic())
            st = self.tx.stats()
            if not pending and not leaks(st):
                break
            time.sleep(0.05)
        out["unreleased"] = len(pending)
        out["stats"] = self.tx.stats()
        out["leaks"] = leaks(out["stats"])
        lat = sorted(latency.values())
        done = sorted(v for rid, v in latency.items() if reported.get(rid) == "DONE")
        out["latency_ms"] = {
            "p50": _pct(lat, 50) * 1e3 if lat else None,
            "p99": _pct(lat, 99) * 1e3 if lat else None,
            "done_p50": _pct(done, 50) * 1e3 if done else None,
            "done_p99": _pct(done, 99) * 1e3 if done else None,
        }
        if gen:
            a, b = _region_span(self.shape, "big")
            self.pool[a:b].zero_()  # slots hold other blocks' bytes: make the end-of-case pool check meaningful
            self.written.discard("big")
        return out
