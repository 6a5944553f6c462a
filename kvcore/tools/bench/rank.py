"""The rank processes: each owns an agent, and per case a pool, a page table and a ``Transceiver``.

The orchestrator (:mod:`kvcore.tools.bench.run`) starts ``_rank_main`` in a fresh interpreter through
:class:`kvcore.runtime.RankProcess` and calls its ``op_*`` methods by name (msgpack on a pipe, never pickle).
The bare modes' commands come from :class:`kvcore.tools.bench.bare._BareModes`.
"""

from __future__ import annotations

import heapq
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import msgspec
import numpy as np

from kvcore.params import derive_ticket
from kvcore.runtime import Channel, serve
from kvcore.tools.bench.bare import _BareModes
from kvcore.tools.bench.blocks import SMALL_SLOTS, _block_ids, _fill_logical, _logical_ids, _region_span
from kvcore.tools.bench.floor import _FloorModes
from kvcore.tools.bench.spec import BenchError, BenchSpec, BenchTimeoutError, Shape, _pct

#: The environment variable that carries the run's ticket secret to its rank processes.
_SECRET_ENV = "KVCORE_BENCH_TICKET_SECRET"


class _Rank(_BareModes, _FloorModes):
    """One rank process: owns an agent, and per case a pool, a page table and a ``Transceiver``; serves commands."""

    def __init__(self, role: str, backend: str, spec: BenchSpec) -> None:
        import torch

        from kvcore.config import TransceiverConfig, create_agent

        torch.set_num_threads(1)
        self.role, self.backend, self.spec = role, backend, spec
        # Both sides derive every request's ticket from the run's secret (the orchestrator set it before spawning).
        self.secret = bytes.fromhex(os.environ[_SECRET_ENV])
        self.config = TransceiverConfig.load(
            backend=backend,
            agent_options=dict(spec.agent_options.get(backend, {})),
            request_timeout_s=spec.timeout_s,
            transfer_timeout_s=spec.timeout_s,
        )
        self._create_agent = create_agent
        self.agent = create_agent(self.config, f"bench-{role}-{os.getpid()}")
        self.tx: Any = None
        self.shape: Shape | None = None
        self.pending: dict[int, float] = {}  # context: requests started, not yet released
        self.outcomes: dict[str, int] = {}
        self.errors: list[str] = []
        # the busy case (op_busy): a thread that runs Python without pause, and the interpreter's switch interval
        self._busy_thread: threading.Thread | None = None
        self._busy_stop = threading.Event()
        self._switch0 = sys.getswitchinterval()

    # --- the loop ------------------------------------------------------------------------------

    def serve(self, channel: Channel) -> None:
        """Answer the orchestrator's commands; between them, poll while requests are in flight."""
        serve(channel, self, idle=self._tick, idle_wait=lambda: 0.001 if self.pending else 0.05)

    def _tick(self) -> None:
        """The context rank's engine loop: poll the transceiver while requests are in flight."""
        if self.tx is None or not self.pending:
            return
        r = self.tx.poll()
        self._record(r.outcomes)
        for rid in r.released:
            self.pending.pop(rid, None)

    def _record(self, outcomes: Iterable[Any]) -> None:
        for o in outcomes:
            self.outcomes[o.state.value] = self.outcomes.get(o.state.value, 0) + 1
            if o.error is not None and len(self.errors) < 5:
                self.errors.append(f"request {o.request_id}: {type(o.error).__name__}: {o.error}")

    # --- per-case setup ------------------------------------------------------------------------

    def op_init(
        self, shape: dict[str, Any], request_timeout_s: float | None = None, auth: bool = False
    ) -> dict[str, Any]:
        """Allocate and fill (context) or zero (generation) the pool, build the page table, start a Transceiver.

        ``request_timeout_s`` overrides the transceivers' request bound for this case (the soak's is short);
        ``auth`` configures CURVE with this role's keys from ``spec.auth_config``.
        """
        import torch

        from kvcore.layout.builders import allocate_kv_cache, build_page_table
        from kvcore.layout.topology import AttentionGeometry, Topology
        from kvcore.transceiver import Transceiver

        self.op_teardown()
        sh = self.shape = Shape(**shape)
        topology = Topology.create(tp_size=1, pp_size=1, rank=0, num_layers=sh.layers)
        geometry = AttentionGeometry(
            num_layers=sh.layers,
            num_kv_heads=sh.kv_heads,
            head_dim=sh.head_dim,
            tokens_per_block=sh.tokens_per_block,
            dtype=sh.dtype,
            block_order="head_major",
        )
        num_blocks = sh.blocks + SMALL_SLOTS + 1
        self.caches = allocate_kv_cache(topology, geometry, num_blocks, allocator=self.agent.allocate_tensor)
        self.pool = self.caches.view(torch.uint8).reshape(num_blocks, sh.block_bytes)
        self.pool.zero_()  # touch every page: page faults are not transfer cost
        self.ids = _block_ids(sh, self.spec.seed, self.role)
        logical = _logical_ids(sh)
        if self.role == "context":
            words = self.pool.numpy().view(np.uint64)
            for region in ("big", "small", "first"):
                _fill_logical(words, self.ids[region], logical[region], self.spec.seed)
        else:
            self.expected = torch.zeros_like(self.pool)
            words = self.expected.numpy().view(np.uint64)
            for region in ("big", "small", "first"):
                _fill_logical(words, self.ids[region], logical[region], self.spec.seed)
            self.written: set[str] = set()
        self.page_table = build_page_table("head_major_pool", self.caches, topology=topology, geometry=geometry)
        config = self.config
        if request_timeout_s is not None:
            config = replace(config, request_timeout_s=request_timeout_s)
        if auth:
            if not self.spec.auth_config:
                raise BenchError("auth: the case asks for CURVE but the run made no keys (spec.auth_config is empty)")
            keys: dict[str, Any] = dict(self.spec.auth_config[self.role])
            config = replace(config, auth_mode="auto", **keys)  # even beside KVCORE_AUTH_MODE=none (the other row)
        self.tx = Transceiver(
            config,
            role=self.role,
            agent=self.agent,
            topology=topology,
            geometry=geometry,
            page_table=self.page_table,
            instance_name=f"bench-{self.role}",
        )
        self.outcomes, self.errors = {}, []
        self.bare: dict[str, Any] = {}
        return {
            "endpoint": self.tx.info_endpoint,
            "rank_info": msgspec.msgpack.encode(self.tx.rank_info),
            "curve": bool(self.tx.rank_info.curve_public_key),  # this Transceiver serves and connects with CURVE
        }

    def op_teardown(self) -> dict[str, Any]:
        """Close this case's bare modes and Transceiver and drop its memory; returns the Transceiver's last stats."""
        stats: dict[str, int] = {}
        for name in list(getattr(self, "bare", {})):
            self._unprepare(name)
        if self.tx is not None:
            stats = self.tx.stats()
            self.tx.close()
            self.tx = None
        self.pending.clear()
        for attr in ("pool", "caches", "expected", "mc_dst", "plan"):
            if hasattr(self, attr):
                delattr(self, attr)
        return {"stats": stats}

    def _blocks(self, region: str, i: int, count: int | None = None, slot_blocks: int | None = None) -> np.ndarray:
        """Request ``i``'s blocks: a small slot, the whole region, or the first ``count`` of slot ``i % slots``."""
        ids = self.ids[region]
        if region == "small":
            return ids[i % SMALL_SLOTS : i % SMALL_SLOTS + 1]
        if slot_blocks:
            k = i % (len(ids) // slot_blocks)
            return ids[k * slot_blocks : k * slot_blocks + (count or slot_blocks)]
        return ids[:count]

    # --- context: kvcore -----------------------------------------------------------------------

    def op_send(
        self,
        rid0: int,
        n: int,
        region: str,
        count: int | None = None,
        slot_blocks: int | None = None,
        mode: str = "push",
    ) -> dict[str, Any]:
        """Start sending ``n`` requests (ids ``rid0..``); the serve loop polls them until released.

        Pull mode returns each request's transfer parameters (``to_dict()``) for the generation rank.
        """
        assert self.shape is not None
        now = time.monotonic()
        params = []
        for i in range(n):
            blocks = self._blocks(region, i, count, slot_blocks)
            p = self.tx.start_send(
                rid0 + i,
                blocks,
                prompt_len=len(blocks) * self.shape.tokens_per_block,
                ticket=derive_ticket(self.secret, rid0 + i),
                mode=mode,
            )
            if mode == "pull":
                params.append(p.to_dict())
            self.pending[rid0 + i] = now
        return {"params": params}

    def op_drain(self) -> dict[str, Any]:
        """Wait until every started request is released; returns outcome counts, errors and live stats."""
        deadline = time.monotonic() + self.spec.timeout_s
        while self.pending:
            if time.monotonic() > deadline:
                raise BenchTimeoutError(f"context rank: {len(self.pending)} request(s) never released")
            self._tick()
            time.sleep(0.001)
        return {"outcomes": self.outcomes, "errors": self.errors, "stats": self.tx.stats()}

    def op_admit(self, descriptor: bytes) -> dict[str, Any]:
        """Load the context's bare agent, as a transceiver loads its writers: transports such as shm hand out
        memory only to agents the owner loaded."""
        return {"name": self.agent.load_remote_agent(descriptor)}

    def op_dismiss(self, name: str) -> dict[str, Any]:
        if name in self.agent.remote_agents:
            self.agent.unload_remote_agent(name)
        return {}

    def op_zero(self, region: str) -> dict[str, Any]:
        assert self.shape is not None
        a, b = _region_span(self.shape, region)
        self.pool[a:b].zero_()
        self.written.discard(region)
        return {}

    def op_verify(self, region: str) -> dict[str, Any]:
        """Compare a region with the expectation computed from the seed and block ids (not from kvcore's plans)."""
        import torch

        assert self.shape is not None
        a, b = _region_span(self.shape, region)
        got, want = self.pool[a:b], self.expected[a:b]
        if torch.equal(got, want):
            self.written.add(region)  # the region now holds its expectation (whoever wrote it)
            return {"ok": True, "bad_bytes": 0, "bytes": int(got.numel())}
        return {"ok": False, "bad_bytes": int((got != want).sum()), "bytes": int(got.numel())}

    def op_verify_slots(self, count: int, slot_blocks: int, slots: int) -> dict[str, Any]:
        """The first ``count`` blocks of the first ``slots`` slots hold their expectation, the rest of the region is zero.

        Then zero the region again, ready for the next cell.
        """
        import torch

        assert self.shape is not None
        ids = self.ids["big"]
        rows = torch.from_numpy(np.concatenate([ids[k * slot_blocks : k * slot_blocks + count] for k in range(slots)]))
        got, want = self.pool.index_select(0, rows), self.expected.index_select(0, rows)
        bad = int((got != want).sum())
        a, b = _region_span(self.shape, "big")
        bad += int(self.pool[a:b].count_nonzero()) - int(got.count_nonzero())  # nothing outside the written rows
        self.pool[a:b].zero_()
        self.written.discard("big")  # zero again: the end-of-case check expects zeros there
        return {"ok": bad == 0, "bad_bytes": bad}

    def op_verify_all(self) -> dict[str, Any]:
        """Written regions hold their expectation; the others are still zero (nothing landed outside its blocks)."""
        assert self.shape is not None
        bad = 0
        for region in ("big", "small", "first"):
            a, b = _region_span(self.shape, region)
            if region in self.written:
                bad += int((self.pool[a:b] != self.expected[a:b]).sum())
            else:
                bad += int(self.pool[a:b].count_nonzero())
        return {"ok": bad == 0, "bad_bytes": bad, "written": sorted(self.written)}

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
                start(i, self._blocks(region, i, count, slot_blocks))
            done = wait(set(range(rid0, rid0 + n)))
            elapsed = max(done.values()) - t0
        else:
            t_all = time.perf_counter()
            for i in range(n):
                blocks = self._blocks(region, i, count, slot_blocks)
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

        big = self._blocks("big", 0)
        t_big = time.perf_counter()
        self.tx.start_receive(
            big_rid, endpoint, big, prompt_len=len(big) * tpb, ticket=derive_ticket(self.secret, big_rid)
        )
        latency: list[float] = []
        during: list[bool] = []
        for i in range(n):
            blocks = self._blocks("small", i)
            t0 = time.perf_counter()
            self.tx.start_receive(
                rid0 + i, endpoint, blocks, prompt_len=len(blocks) * tpb, ticket=derive_ticket(self.secret, rid0 + i)
            )
            until(rid0 + i)
            latency.append(done[rid0 + i] - t0)
            during.append(big_rid not in done)
        until(big_rid)
        return {"latency_s": latency, "during": during, "big_s": done[big_rid] - t_big, "not_done": not_done}

    # --- both roles: the soak --------------------------------------------------------------------

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
        import sys

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

    def op_stats(self) -> dict[str, Any]:
        return {"stats": self.tx.stats() if self.tx is not None else {}}

    def close(self) -> None:
        try:
            self.op_busy(False)
            self.op_echo_stop()
            self.op_teardown()
        finally:
            self.agent.close()


def _rank_main(channel: Channel, role: str, backend: str, spec: dict[str, Any]) -> None:
    """A rank process's function: set up, say so, serve commands until told to exit (a failure is reported)."""
    rank = _Rank(role, backend, BenchSpec(**spec))
    try:
        channel.send({"pid": os.getpid()})
        rank.serve(channel)
    finally:
        rank.close()
