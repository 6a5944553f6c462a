"""The rank processes: each owns an agent, and per case a pool, a page table and a ``Transceiver``.

The orchestrator (:mod:`kvcore.tools.bench.run`) starts ``_rank_main`` in a fresh interpreter through
:class:`kvcore.runtime.RankProcess` and calls its ``op_*`` methods by name (msgpack on a pipe, never pickle).
:class:`_Rank` holds the agent, the per-case setup and the context's sends; its other commands come from one
mixin per concern: the bare modes (:mod:`~kvcore.tools.bench.bare`), the floor (:mod:`~kvcore.tools.bench.floor`),
the byte checks (:mod:`~kvcore.tools.bench.verify`), the generation's receives (:mod:`~kvcore.tools.bench.receive`),
the soak (:mod:`~kvcore.tools.bench.soak`) and the CPU and step probes (:mod:`~kvcore.tools.bench.probes`).
"""

from __future__ import annotations

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
from kvcore.tools.bench.blocks import SMALL_SLOTS, _block_ids, _fill_logical, _logical_ids, request_blocks
from kvcore.tools.bench.floor import _FloorModes
from kvcore.tools.bench.probes import _ProbeModes
from kvcore.tools.bench.receive import _ReceiveModes
from kvcore.tools.bench.soak import _SoakModes
from kvcore.tools.bench.spec import BenchError, BenchSpec, BenchTimeoutError, Shape
from kvcore.tools.bench.verify import _VerifyModes

#: The environment variable that carries the run's ticket secret to its rank processes.
_SECRET_ENV = "KVCORE_BENCH_TICKET_SECRET"


class _Rank(_BareModes, _FloorModes, _VerifyModes, _ReceiveModes, _SoakModes, _ProbeModes):
    """One rank process: owns an agent, and per case a pool, a page table and a ``Transceiver``; serves commands."""

    def __init__(self, role: str, backend: str, spec: BenchSpec) -> None:
        import torch

        from kvcore.config import TransceiverConfig, create_agent

        torch.set_num_threads(1)
        self.role, self.backend, self.spec = role, backend, spec
        # Both sides derive every request's ticket from the run's secret (the orchestrator set it before spawning).
        self.secret = bytes.fromhex(os.environ[_SECRET_ENV])
        lane: dict[str, Any] = {"native_lane": True} if spec.native_lane else {}
        self.config = TransceiverConfig.load(
            backend=backend,
            agent_options=dict(spec.agent_options.get(backend, {})),
            request_timeout_s=spec.timeout_s,
            transfer_timeout_s=spec.timeout_s,
            **lane,
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
            blocks = request_blocks(self.ids, region, i, count, slot_blocks)
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
