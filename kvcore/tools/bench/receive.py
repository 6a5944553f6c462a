"""A bench generation rank's receives: requests one at a time or pipelined, and the head-of-line case."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvcore.params import derive_ticket
from kvcore.tools.bench.blocks import request_blocks
from kvcore.tools.bench.spec import BenchSpec, BenchTimeoutError, Shape


class _ReceiveModes:
    """The generation rank's receive commands (a mixin of :class:`kvcore.tools.bench.rank._Rank`, which owns these
    attributes)."""

    spec: BenchSpec
    tx: Any
    shape: Shape | None
    secret: bytes
    written: set[str]
    ids: dict[str, np.ndarray]

    def _poll_once(
        self, done: dict[int, float], released: set[int], not_done: list[str], deadline: float, what: str
    ) -> None:
        """One poll of the generation transceiver: note outcomes (when) and releases; bounded by ``deadline``."""
        self._pause(deadline)
        r = self.tx.poll()
        now = time.perf_counter()
        for o in r.outcomes:
            done[o.request_id] = now
            if o.state.value != "DONE" and len(not_done) < 5:
                not_done.append(f"request {o.request_id}: {o.state.value} {o.error}")
        released.update(r.released)
        if time.monotonic() > deadline:
            raise BenchTimeoutError(f"generation rank: {what} not released")

    def _pause(self, deadline: float) -> None:
        """The engine loop's wait before a poll: ``Transceiver.wait`` (the default), or a timer of
        ``--poll-interval-us`` when that is above 0 (an engine that polls on its own clock)."""
        if self.spec.poll_interval_s > 0:
            time.sleep(self.spec.poll_interval_s)
        else:
            self.tx.wait(min(0.05, max(0.0, deadline - time.monotonic())))

    def op_receive(
        self,
        endpoint: str,
        rid0: int,
        n: int,
        region: str,
        pipelined: bool,
        count: int | None = None,
        slot_blocks: int | None = None,
        params: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Receive ``n`` requests, one at a time (latency each) or all started at once (elapsed until all DONE).

        With ``params`` (pull mode: the context's transfer parameters, one per request) they are received with them.
        """
        assert self.shape is not None
        tpb = self.shape.tokens_per_block
        latency: list[float] = []
        not_done: list[str] = []
        deadline = time.monotonic() + self.spec.timeout_s
        self.written.add(region)

        def wait(ids: set[int]) -> dict[int, float]:
            done: dict[int, float] = {}
            released: set[int] = set()
            while not (ids <= released and ids <= set(done)):
                self._poll_once(done, released, not_done, deadline, f"{len(ids - released)} request(s)")
            return done

        def start(i: int, blocks: Any) -> None:
            if params:
                self.tx.start_receive(params=params[i], block_ids=blocks)
                return
            self.tx.start_receive(
                rid0 + i, endpoint, blocks, prompt_len=len(blocks) * tpb, ticket=derive_ticket(self.secret, rid0 + i)
            )

        if pipelined:
            t0 = time.perf_counter()
            for i in range(n):
                start(i, request_blocks(self.ids, region, i, count, slot_blocks))
            done = wait(set(range(rid0, rid0 + n)))
            elapsed = max(done.values()) - t0
        else:
            t_all = time.perf_counter()
            for i in range(n):
                blocks = request_blocks(self.ids, region, i, count, slot_blocks)
                t0 = time.perf_counter()
                start(i, blocks)
                latency.append(wait({rid0 + i})[rid0 + i] - t0)
            elapsed = time.perf_counter() - t_all
        return {"latency_s": latency, "elapsed_s": elapsed, "not_done": not_done}

    def op_hol(self, endpoint: str, big_rid: int, rid0: int, n: int) -> dict[str, Any]:
        """Start the whole ``big`` request, then ``n`` one-block requests one at a time while it may still run.

        Returns each one-block request's latency, whether the big request was still unreported when it
        ended (``during``), and the big request's own time.
        """
        assert self.shape is not None
        tpb = self.shape.tokens_per_block
        deadline = time.monotonic() + self.spec.timeout_s
        self.written.update(("big", "small"))
        done: dict[int, float] = {}
        released: set[int] = set()
        not_done: list[str] = []

        def until(rid: int) -> None:
            while rid not in done or rid not in released:
                self._poll_once(done, released, not_done, deadline, f"request {rid} (hol case)")

        big = request_blocks(self.ids, "big", 0)
        t_big = time.perf_counter()
        self.tx.start_receive(
            big_rid, endpoint, big, prompt_len=len(big) * tpb, ticket=derive_ticket(self.secret, big_rid)
        )
        latency: list[float] = []
        during: list[bool] = []
        for i in range(n):
            blocks = request_blocks(self.ids, "small", i)
            t0 = time.perf_counter()
            self.tx.start_receive(
                rid0 + i, endpoint, blocks, prompt_len=len(blocks) * tpb, ticket=derive_ticket(self.secret, rid0 + i)
            )
            until(rid0 + i)
            latency.append(done[rid0 + i] - t0)
            during.append(big_rid not in done)
        until(big_rid)
        return {"latency_s": latency, "during": during, "big_s": done[big_rid] - t_big, "not_done": not_done}
