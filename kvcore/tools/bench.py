"""``kvcore bench``: kvcore end to end vs the bare transport vs memcpy, on identical fragments, in one run.

For every selected backend the orchestrator (this process) starts one context
and one generation rank process (:class:`kvcore.testing.ranks.RankProcess`;
orchestration commands travel on pipes as msgpack frames, never pickle). Each *case* is a
function ``case(run: BackendRun) -> dict``; :data:`CASES` maps names to them.

* ``llama8b``: one Llama-3-8B-shaped request (32 layers, 8 KV heads, head dim
  128, bf16, 32-token blocks, 4096 tokens = 128 blocks = 512 MiB, K and V, TP1,
  one head-major pool per rank, so one 4 MiB fragment per block), blocks
  scattered on both sides (independent random permutations), moved

  - ``kvcore``: through the whole stack: ``Transceiver.start_send`` on the
    context rank, ``start_receive`` on the generation rank, control plane
    (ZeroMQ), ``plan_transfer``, the agent, completion report, ``poll()``;
    timed on the generation rank from ``start_receive`` to the DONE outcome;
  - ``agent``: the same backend's ``TransferAgent.submit`` of the identical
    fragment plan (built once with :func:`kvcore.layout.mapping.plan_transfer` from the
    same page tables), polled without back-off: the transport without kvcore's
    control plane;
  - the baselines the backend's plugin registers (``kvcore.transport.baselines``; NIXL's
    ``nixl_initialize`` / ``nixl_prepped``): the transport's own API on the
    identical descriptor list, no kvcore code in the loop;
  - ``memcpy``: numpy ``copyto`` of the same number of bytes between two
    pre-faulted buffers, and ``memcpy_scattered``: one ``memmove`` per fragment
    of the same plan into a local buffer (the physical references).

* ``frag16k``: the same modes on 4096 x 16 KiB fragments (64 MiB).
* ``small``: one-block requests of the ``frag16k`` pool (16 KiB): latency of
  requests sent one at a time (p50/p99) against the agent's own one-fragment
  time (the difference is kvcore's per-request overhead), and requests per
  second with many requests in flight.
* ``small_auth`` (``--auth``): the same case with CurveZMQ on both
  transceivers' control planes (a fresh key pair per instance, as
  ``kvcore demo --auth``), run by the same rank processes right after ``small``.

Every timed transfer lands in zeroed destination memory and is verified
afterwards, byte for byte, against an expectation the generation rank computes
from the seed and the block ids alone (no kvcore arithmetic). Destination
memory is touched before anything is timed; the first transfer of each mode
(and the first contact between the instances) is reported separately.

Why one module of this length: the orchestrator, the rank processes' commands and every case of one CLI
command share the same rank protocol and result format; the cases register themselves with ``register_case``.
"""

from __future__ import annotations

import argparse
import ctypes
import heapq
import itertools
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvcore.errors import KvcoreError
from kvcore.params import derive_ticket
from kvcore.testing.ranks import Channel, RankError, RankProcess, serve

if TYPE_CHECKING:
    from kvcore.extension.registry import BenchBaselineRegistry

__all__ = [
    "BenchError",
    "BenchTimeoutError",
    "BenchSpec",
    "Shape",
    "BackendRun",
    "CASES",
    "register_case",
    "installed_backends",
    "run_bench",
    "add_parser",
]

_GB = 1e9
_MIX = np.uint64(0x9E3779B97F4A7C15)  # per-block word offset: a misplaced or torn block never matches
SMALL_SLOTS = 8  # distinct one-block slots the small requests cycle through


class BenchError(KvcoreError):
    """A benchmark spec was refused, or a request or check inside a rank failed (the message says which)."""


class BenchTimeoutError(BenchError, TimeoutError):
    """A benchmark rank did not answer a command within its bound."""


# --- what is measured --------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One request's KV geometry (TP1, head-major pool: a block of every layer is one contiguous slot)."""

    name: str
    tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str = "bfloat16"

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.tokens_per_block)

    @property
    def block_bytes(self) -> int:
        from kvcore.layout.topology import dtype_bytes

        return self.layers * 2 * self.kv_heads * self.tokens_per_block * self.head_dim * dtype_bytes(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes


@dataclass
class BenchSpec:
    """Everything one benchmark run needs (sizes, iterations, bounds); sent to every rank as msgpack."""

    backends: list[str] | None = None  # None: every installed transfer agent
    cases: list[str] = field(default_factory=lambda: ["llama8b", "frag16k", "small"])
    tokens: int = 4096
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    tokens_per_block: int = 32
    dtype: str = "bfloat16"
    fragments: int = 4096  # the frag16k case: this many 16 KiB fragments
    iterations: int = 5
    small_requests: int = 1000  # one-block requests in flight together
    latency_requests: int = 200  # one-block requests sent one at a time
    hol_requests: int = 20  # the hol case: one-block requests per round (at least 8), alone and beside the big one
    poll_interval_s: float = 0.0001  # the generation rank's engine loop: poll(), then sleep this long
    timeout_s: float = 120.0  # bound on every command a rank runs
    agent_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # backend -> agent options
    seed: int = 1234
    # the soak case (issue 9): many one-block requests with random cancels from both sides
    requests: int = 10000
    inflight: int = 512
    cancel_rate: float = 0.1  # fraction of requests cancelled, half by each side, at a random moment
    soak_request_timeout_s: float = 10.0  # the transceivers' request_timeout_s in the soak (tombstones live as long)
    # the matrix case: request size x fragment size x requests in flight, Llama-3-70B-shaped bytes per token
    matrix_tokens: list[int] = field(default_factory=lambda: [32, 256, 1024, 4096])
    matrix_fragment_bytes: list[int] = field(default_factory=lambda: [4096, 16384, 65536, 262144, 1048576, 0])
    matrix_inflight: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    matrix_layers: int = 80  # Llama-3-70B; heads, head dim, dtype and block size are the fields above
    matrix_iterations: int = 3  # timed rounds per cell, after one warm-up round
    matrix_max_bytes: int = 4 << 30  # cells that would move more per round (requests x size) are skipped
    matrix_pool_bytes: int = 2 << 30  # per side: request-sized slots the in-flight requests cycle through
    auth: bool = False  # also run the small case with CURVE configured (small_auth), beside small without
    auth_config: dict[str, dict[str, str]] = field(default_factory=dict)  # role -> auth_* fields (set by run_bench)

    def validate(self) -> None:
        """Raise ``BenchError`` naming the first field out of range."""
        for name in (
            "tokens",
            "layers",
            "kv_heads",
            "head_dim",
            "tokens_per_block",
            "fragments",
            "iterations",
            "small_requests",
            "latency_requests",
            "hol_requests",
            "requests",
            "inflight",
            "matrix_layers",
            "matrix_iterations",
            "matrix_max_bytes",
            "matrix_pool_bytes",
        ):
            if int(getattr(self, name)) < 1:
                raise BenchError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.small_requests > 4000:
            raise BenchError(f"small_requests must be <= 4000 (max_inflight_requests), got {self.small_requests}")
        unknown = [c for c in self.cases if c not in CASES]
        if unknown:
            raise BenchError(f"unknown case(s) {unknown}; known: {sorted(CASES)}")
        if not self.timeout_s > 0:
            raise BenchError(f"timeout_s must be > 0, got {self.timeout_s}")
        for name in ("matrix_tokens", "matrix_inflight"):
            values = getattr(self, name)
            if not values or any(int(v) < 1 for v in values):
                raise BenchError(f"{name} must be a non-empty list of integers >= 1, got {values!r}")
        for f in self.matrix_fragment_bytes:
            if f != 0 and (f < 512 or f % 512):
                raise BenchError(f"matrix_fragment_bytes entries must be 0 (whole block) or multiples of 512, got {f}")
        if self.inflight > 4000:
            raise BenchError(f"inflight must be <= 4000 (max_inflight_requests), got {self.inflight}")
        if not 0.0 <= self.cancel_rate <= 1.0:
            raise BenchError(f"cancel_rate must be in [0, 1], got {self.cancel_rate}")
        if not self.soak_request_timeout_s > 0:
            raise BenchError(f"soak_request_timeout_s must be > 0, got {self.soak_request_timeout_s}")
        if not 0 <= self.poll_interval_s < 1:
            raise BenchError(f"poll_interval_s must be in [0, 1), got {self.poll_interval_s}")

    def llama_shape(self) -> Shape:
        return Shape(
            "llama8b", self.tokens, self.layers, self.kv_heads, self.head_dim, self.tokens_per_block, self.dtype
        )

    def matrix_block_bytes(self) -> int:
        """One block of the matrix's model (all layers, K and V): the 'whole block' fragment size."""
        from kvcore.layout.topology import dtype_bytes

        return self.matrix_layers * 2 * self.kv_heads * self.tokens_per_block * self.head_dim * dtype_bytes(self.dtype)

    def quick_matrix(self) -> BenchSpec:
        """The ``--quick`` matrix: 2 request sizes x 3 fragment sizes x 2 in-flight counts of a 2-layer model."""
        return replace(
            self,
            matrix_tokens=[32, 64],
            matrix_fragment_bytes=[4096, 16384, 0],
            matrix_inflight=[1, 4],
            matrix_layers=2,
            matrix_iterations=1,
        )

    def frag16k_shape(self) -> Shape:
        # 1 layer x {K,V} x 1 head x 32 tokens x 128 x bf16 = 16 KiB per block, one fragment per block.
        return Shape("frag16k", self.fragments * 32, 1, 1, 128, 32, "bfloat16")


# --- rank processes ----------------------------------------------------------------------------


def _block_ids(shape: Shape, seed: int, role: str) -> dict[str, np.ndarray]:
    """Physical block ids per region; both ranks compute them from the seed (different permutations per side).

    Pool index space: ``big`` request ``[0, blocks)``, ``small`` slots after it, one ``first``-contact block last.
    """
    rng = np.random.default_rng([seed, 0 if role == "context" else 1])
    nb = shape.blocks
    return {
        "big": rng.permutation(nb).astype(np.int64),
        "small": (nb + rng.permutation(SMALL_SLOTS)).astype(np.int64),
        "first": np.array([nb + SMALL_SLOTS], dtype=np.int64),
    }


def _region_span(shape: Shape, region: str) -> tuple[int, int]:
    nb = shape.blocks
    return {"big": (0, nb), "small": (nb, nb + SMALL_SLOTS), "first": (nb + SMALL_SLOTS, nb + SMALL_SLOTS + 1)}[region]


def _fill_logical(words: np.ndarray, phys: np.ndarray, logical: np.ndarray, seed: int) -> None:
    """Write logical block ``logical[i]`` into row ``phys[i]`` of ``words`` ([blocks, words] uint64), in chunks."""
    base = np.random.default_rng([seed, 7]).integers(0, 2**63, words.shape[1], dtype=np.uint64)
    chunk = max(1, (64 << 20) // max(1, words.shape[1] * 8))
    for a in range(0, len(phys), chunk):
        words[phys[a : a + chunk]] = base[None, :] + logical[a : a + chunk, None].astype(np.uint64) * _MIX  # type: ignore[index]


def _logical_ids(shape: Shape) -> dict[str, np.ndarray]:
    nb = shape.blocks
    return {
        "big": np.arange(nb, dtype=np.int64),
        "small": nb + np.arange(SMALL_SLOTS, dtype=np.int64),
        "first": np.array([nb + SMALL_SLOTS], dtype=np.int64),
    }


#: The environment variable that carries the run's ticket secret to its rank processes.
_SECRET_ENV = "KVCORE_BENCH_TICKET_SECRET"


class _Rank:
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
            config = replace(config, **keys)
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

    # --- context: bare transport and memcpy ----------------------------------------------------

    def op_peer(self, rank_info: bytes) -> dict[str, Any]:
        """Learn the generation rank's placement and agent descriptor (for the bare modes' identical plan)."""
        from kvcore.control import wire

        self.gen_info = msgspec.msgpack.decode(rank_info, type=wire.RankInfo)
        return {}

    def _plan(self, region: str, count: int | None = None) -> Any:
        from kvcore.extension.plugins import get_plugin_manager
        from kvcore.layout.mapping import plan_transfer

        assert self.shape is not None
        gen_ids = _block_ids(self.shape, self.spec.seed, "generation")[region]
        src, dst = self.ids[region][:count], gen_ids[:count]
        return plan_transfer(
            self.tx.placement,
            self.gen_info.placement,
            src,
            dst,
            mappers=get_plugin_manager().registries.layout_mappers,
            prompt_len=len(src) * self.shape.tokens_per_block,
        )

    def op_prepare(self, mode: str, region: str, count: int | None = None) -> dict[str, Any]:
        """Set up one bare mode on the plan of ``region`` (first ``count`` blocks); returns setup time and plan size."""
        from kvcore.transport.agent import MemoryRegion

        t0 = time.perf_counter()
        plan = self._plan(region, count)
        src, dst, sizes = plan.src, plan.dst, plan.sizes
        pool_base, pool_bytes = int(self.pool.data_ptr()), int(self.pool.numel())
        state: dict[str, Any] = {"plan": plan, "count": count}
        if mode == "agent":
            ag = self._create_agent(self.config, f"bench-bare-{os.getpid()}-{region}")
            ag.register_memory(MemoryRegion(pool_base, pool_bytes))
            state["agent"] = ag
            state["peer"] = ag.load_remote_agent(self.gen_info.agent_descriptor)
            state["descriptor"] = ag.descriptor()  # the generation side must load it first (see op_admit)
        elif mode in _baselines():
            from kvcore.transport.baselines import BaselinePlan

            native = BaselinePlan(
                src,
                dst,
                sizes,
                pool_base,
                pool_bytes,
                self.gen_info.agent_descriptor,
                self.config.agent_options,
                self.spec.timeout_s,
            )
            state["baseline"] = _baselines().get(mode)(native)
        elif mode == "memcpy":
            state["src"] = self.pool.numpy().reshape(-1)[: int(sizes.sum())]
            state["dst"] = np.empty_like(state["src"])
            state["dst"].fill(0)  # pre-fault
        elif mode == "memcpy_scattered":
            gen_base = int(self.gen_info.page_table.pools[0].base)
            span = int((dst - np.uint64(gen_base) + sizes).max())
            buf = np.empty(span, dtype=np.uint8)
            buf.fill(0)
            state["buf"] = buf
            local_dst = dst - np.uint64(gen_base) + np.uint64(buf.ctypes.data)
            state["frags"] = list(zip(local_dst.tolist(), src.tolist(), sizes.tolist()))
        else:
            raise BenchError(f"unknown mode {mode!r}")
        self.bare[mode] = state
        return {
            "setup_ms": (time.perf_counter() - t0) * 1e3,
            "descriptor": state.get("descriptor", b""),
            "fragments": int(plan.count),
            "bytes": int(plan.nbytes),
            "fragment_bytes": int(sizes.max()) if plan.count else 0,
        }

    def op_xfer(self, mode: str, repeat: int = 1) -> dict[str, Any]:
        """Run one bare mode ``repeat`` times; returns the wall time (and submit time) of each."""
        st = self.bare[mode]
        times, submits = [], []
        for _ in range(repeat):
            t, s = st["baseline"].once() if "baseline" in st else getattr(self, "_once_" + mode)(st)
            times.append(t)
            submits.append(s)
        return {"seconds": times, "submit_seconds": submits}

    def _once_agent(self, st: dict[str, Any]) -> tuple[float, float]:
        from kvcore.transport.agent import TransferOp, TransferStatus

        ag, plan = st["agent"], st["plan"]
        # An agent that copies on its own threads announces the end: wait for that instead of spinning on
        # poll, which would take a core from its copy threads (this bare agent is the bench's own).
        ended = threading.Event()
        announced = ag.capabilities.async_submit
        if announced:
            ag.set_completion_listener(lambda _hid: ended.set())
        t0 = time.perf_counter()
        h = ag.submit(TransferOp.WRITE, st["peer"], plan.src, plan.dst, plan.sizes)
        t1 = time.perf_counter()
        deadline = t0 + self.spec.timeout_s
        while ag.poll(h) is TransferStatus.PENDING:  # no back-off: the transport's own speed
            if announced:
                ended.wait(0.05)
                ended.clear()
            if time.perf_counter() > deadline:
                raise BenchTimeoutError(f"{self.backend} agent transfer still pending after {self.spec.timeout_s}s")
        t2 = time.perf_counter()
        err = h.error
        ag.release(h)
        if err is not None:
            raise err
        return t2 - t0, t1 - t0

    def _once_memcpy(self, st: dict[str, Any]) -> tuple[float, float]:
        t0 = time.perf_counter()
        np.copyto(st["dst"], st["src"])
        return time.perf_counter() - t0, 0.0

    def _once_memcpy_scattered(self, st: dict[str, Any]) -> tuple[float, float]:
        move = ctypes.memmove
        t0 = time.perf_counter()
        for d, s, n in st["frags"]:
            move(d, s, n)
        return time.perf_counter() - t0, 0.0

    def op_check(self, mode: str) -> dict[str, Any]:
        """Verify a memcpy mode's destination against the source blocks it copied (the reference modes only)."""
        import torch

        st = self.bare[mode]
        if mode == "memcpy":
            ok = torch.equal(torch.from_numpy(st["dst"]), torch.from_numpy(st["src"]))
            st["dst"].fill(0)
            return {"ok": ok}
        if mode != "memcpy_scattered":
            raise BenchError(f"op_check verifies the memcpy modes only, got {mode!r}")
        assert self.shape is not None
        bb = self.shape.block_bytes
        out = torch.from_numpy(st["buf"]).reshape(-1, bb)
        count = st.get("count")
        gen_big = _block_ids(self.shape, self.spec.seed, "generation")["big"][:count]
        ok = all(torch.equal(out[int(d)], self.pool[int(s)]) for s, d in zip(self.ids["big"][:count], gen_big))
        st["buf"].fill(0)
        return {"ok": ok}

    def _unprepare(self, mode: str) -> None:
        st = self.bare.pop(mode, None)
        if not st:
            return
        if "agent" in st:
            st["agent"].close()
        if "baseline" in st:
            st["baseline"].close()

    def op_unprepare(self, mode: str) -> dict[str, Any]:
        self._unprepare(mode)
        return {}

    # --- generation ----------------------------------------------------------------------------

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
        r = self.tx.poll()
        now = time.perf_counter()
        for o in r.outcomes:
            done[o.request_id] = now
            if o.state.value != "DONE" and len(not_done) < 5:
                not_done.append(f"request {o.request_id}: {o.state.value} {o.error}")
        released.update(r.released)
        if time.monotonic() > deadline:
            raise BenchTimeoutError(f"generation rank: {what} not released")
        time.sleep(self.spec.poll_interval_s)

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
            time.sleep(self.spec.poll_interval_s)
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

    def op_stats(self) -> dict[str, Any]:
        return {"stats": self.tx.stats() if self.tx is not None else {}}

    def close(self) -> None:
        try:
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


# --- orchestrator --------------------------------------------------------------------------------


class _RankProc(RankProcess):
    """The orchestrator's handle on one rank process: commands out, replies back, every wait bounded."""

    def __init__(self, role: str, backend: str, spec: BenchSpec) -> None:
        os.environ.setdefault(_SECRET_ENV, os.urandom(32).hex())  # inherited by every rank process of this run
        super().__init__(
            "kvcore.tools.bench:_rank_main",
            name=f"{backend} {role} rank",
            kwargs={"role": role, "backend": backend, "spec": asdict(spec)},
        )
        self.role, self.spec = role, spec

    def ready(self) -> None:
        """Wait until the rank has set up (its agent exists)."""
        self.recv(self.spec.timeout_s, op="start")

    def call(self, op: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """``RankProcess.call`` with the run's bound (``timeout_s`` + 30 s) as the default deadline."""
        return super().call(op, timeout=timeout or self.spec.timeout_s + 30, **args)

    def close(self, timeout: float = 30.0) -> int | None:
        """Ask the rank to tear down and exit; reaped (killed past ``timeout``) in any case."""
        if self.alive():
            try:
                self.call("exit", timeout=timeout)
            except RankError:
                pass
        return super().close(10.0)


class BackendRun:
    """One backend's pair of rank processes, handed to every case function."""

    def __init__(
        self, backend: str, spec: BenchSpec, say: Callable[[str], None], tick: Callable[[int], None] | None = None
    ) -> None:
        self.backend, self.spec, self.say = backend, spec, say
        self._tick = tick
        self._rid = itertools.count(1)
        self.ctx: _RankProc | None = None
        self.gen: _RankProc | None = None
        try:
            self.ctx = _RankProc("context", backend, spec)
            self.gen = _RankProc("generation", backend, spec)
            self.ctx.ready()
            self.gen.ready()
        except BaseException:
            self.close()
            raise

    def tick(self, n: int = 1) -> None:
        """Advance the progress bar by ``n`` of the units the case declared (``register_case(units=...)``)."""
        if self._tick is not None:
            self._tick(n)

    def rids(self, n: int) -> int:
        """``n`` fresh request ids; returns the first."""
        first = next(self._rid)
        for _ in range(n - 1):
            next(self._rid)
        return first

    def open(self, shape: Shape, request_timeout_s: float | None = None, auth: bool = False) -> dict[str, Any]:
        """Set up both ranks for ``shape`` and make first contact (a one-block request, timed on its own)."""
        assert self.ctx is not None and self.gen is not None
        c = self.ctx.call("init", shape=asdict(shape), request_timeout_s=request_timeout_s, auth=auth)
        g = self.gen.call("init", shape=asdict(shape), request_timeout_s=request_timeout_s, auth=auth)
        self.ctx.call("peer", rank_info=g["rank_info"])
        self.endpoint = c["endpoint"]
        rid = self.rids(1)
        self.ctx.call("send", rid0=rid, n=1, region="first")
        r = self.gen.call("receive", endpoint=self.endpoint, rid0=rid, n=1, region="first", pipelined=False)
        ok = self.gen.call("verify", region="first")["ok"] and not r["not_done"]
        return {
            "first_contact_ms": r["latency_s"][0] * 1e3,
            "first_contact_verified": ok,
            "curve_ranks": int(c.get("curve", False)) + int(g.get("curve", False)),
        }

    def close_shape(self) -> dict[str, Any]:
        """Drain the context side, check the whole destination pool, tear both ranks' case state down."""
        assert self.ctx is not None and self.gen is not None
        drain = self.ctx.call("drain")
        full = self.gen.call("verify_all")
        g_stats = self.gen.call("teardown")["stats"]
        c_stats = self.ctx.call("teardown")["stats"]
        from kvcore.transceiver import leaks as _leaks

        leaks = {
            f"{side}.{k}": v
            for side, st in (("context", c_stats), ("generation", g_stats))
            for k, v in _leaks(st).items()
        }
        return {
            "context_outcomes": drain["outcomes"],
            "context_errors": drain["errors"],
            "pool_verified": full["ok"],
            "pool_bad_bytes": full["bad_bytes"],
            "leaks": leaks,
        }

    def kvcore_once(self, region: str, mode: str = "push") -> float:
        """One request through both Transceivers into zeroed memory; returns seconds and checks the bytes."""
        assert self.ctx is not None and self.gen is not None
        rid = self.rids(1)
        params = self.ctx.call("send", rid0=rid, n=1, region=region, mode=mode)["params"]
        r = self.gen.call(
            "receive", endpoint=self.endpoint, rid0=rid, n=1, region=region, pipelined=False, params=params or None
        )
        if r["not_done"]:
            raise BenchError(f"{self.backend}: kvcore request failed: {r['not_done'][0]}")
        return float(r["latency_s"][0])

    def close(self) -> None:
        for p in (self.gen, self.ctx):
            if p is not None:
                p.close()


#: A case: ``fn(run) -> result dict``. Register more with :func:`register_case` (e.g. a TP2->TP4 bounce case).
CaseFn = Callable[[BackendRun], dict[str, Any]]
CASES: dict[str, CaseFn] = {}
#: Progress units of a case for a spec; a case with units calls ``run.tick()`` that many times.
CASE_UNITS: dict[str, Callable[[BenchSpec], int]] = {}


def _one_unit(spec: BenchSpec) -> int:
    """A case without declared units counts as one unit of the progress bar."""
    return 1


def register_case(name: str, units: Callable[[BenchSpec], int] | None = None) -> Callable[[CaseFn], CaseFn]:
    """Decorator: make ``fn(run: BackendRun) -> dict`` selectable as ``kvcore bench --cases name``.

    ``units(spec)`` is how many times the case calls ``run.tick()`` (its share of the progress bar); without
    it the case counts as one unit, ticked when it returns.
    """

    def deco(fn: CaseFn) -> CaseFn:
        if name in CASES:
            raise BenchError(f"benchmark case {name!r} is registered twice")
        CASES[name] = fn
        if units is not None:
            CASE_UNITS[name] = units
        return fn

    return deco


def _summarize(nbytes: int, times: list[float], first: float) -> dict[str, Any]:
    med = statistics.median(times)
    return {
        "gbps_median": nbytes / med / _GB,
        "gbps_best": nbytes / min(times) / _GB,
        "ms_median": med * 1e3,
        "ms_best": min(times) * 1e3,
        "first_ms": first * 1e3,
        "times_ms": [t * 1e3 for t in times],
    }


def _transfer_case(run: BackendRun, shape: Shape) -> dict[str, Any]:
    """kvcore vs the bare agent vs NIXL's own API vs memcpy on one request's identical fragment plan."""
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    out: dict[str, Any] = {"shape": asdict(shape), "bytes": shape.nbytes, "iterations": spec.iterations}
    out.update(run.open(shape))
    modes = ["kvcore", "agent"]
    natives = _baselines().for_backend(run.backend)  # the transport's own API, if its plugin registers it
    modes += natives
    modes += ["memcpy", "memcpy_scattered"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    submits: dict[str, list[float]] = {m: [] for m in modes}
    first: dict[str, float] = {}
    verified: dict[str, bool] = {m: True for m in modes}
    setup: dict[str, Any] = {}
    try:
        for m in modes[1:]:
            setup[m] = run.ctx.call("prepare", mode=m, region="big")
            if setup[m]["descriptor"]:
                setup[m]["admitted"] = run.gen.call("admit", descriptor=setup[m]["descriptor"])["name"]
        plan = setup["agent"]
        out.update(fragments=plan["fragments"], fragment_bytes=plan["fragment_bytes"], plan_bytes=plan["bytes"])
        # Round-robin over the modes so that load from other processes hits every mode alike; the first
        # round is the warm-up (registration caches, connections, list preparation), reported apart.
        for it in range(spec.iterations + 1):
            run.say(f"{run.backend} {shape.name}: round {it}/{spec.iterations}")
            if it:
                run.tick()
            for m in modes:
                memcpy = m.startswith("memcpy")
                if not memcpy:
                    run.gen.call("zero", region="big")
                if m == "kvcore":
                    t, s = run.kvcore_once("big"), None
                else:
                    r = run.ctx.call("xfer", mode=m)
                    t, s = r["seconds"][0], r["submit_seconds"][0]
                ok = run.ctx.call("check", mode=m)["ok"] if memcpy else run.gen.call("verify", region="big")["ok"]
                verified[m] = verified[m] and ok
                if it == 0:
                    first[m] = t
                else:
                    times[m].append(t)
                    if s is not None:
                        submits[m].append(s)
    finally:
        for m in setup:
            run.ctx.call("unprepare", mode=m)
            if "admitted" in setup[m]:
                run.gen.call("dismiss", name=setup[m]["admitted"])
        shape_checks = run.close_shape()
    run.tick()
    out["modes"] = {}
    for m in modes:
        res = _summarize(shape.nbytes, times[m], first[m])
        res["verified"] = verified[m]
        if submits[m]:
            res["submit_ms_median"] = statistics.median(submits[m]) * 1e3
        if m in setup:
            res["setup_ms"] = setup[m]["setup_ms"]
        out["modes"][m] = res
    g = {m: out["modes"][m]["gbps_median"] for m in modes}
    bare = max(natives, key=lambda m: g[m]) if natives else "agent"
    out["bare_mode"] = bare
    out["ratios"] = {
        "kvcore_vs_bare": g["kvcore"] / g[bare],
        "kvcore_vs_agent": g["kvcore"] / g["agent"],
        "kvcore_vs_memcpy": g["kvcore"] / g["memcpy"],
        "kvcore_vs_memcpy_scattered": g["kvcore"] / g["memcpy_scattered"],
        "bare_vs_memcpy": g[bare] / g["memcpy"],
        **{f"kvcore_vs_{m}": g["kvcore"] / g[m] for m in natives},
    }
    out.update(shape_checks)
    out["verified"] = (
        all(verified.values())
        and shape_checks["pool_verified"]
        and out["first_contact_verified"]
        and not shape_checks["context_errors"]
    )
    return out


@register_case("llama8b", units=lambda spec: spec.iterations + 1)
def case_llama8b(run: BackendRun) -> dict[str, Any]:
    """The Llama-3-8B-shaped request (``--tokens``/``--layers``... change it): every mode, same plan."""
    return _transfer_case(run, run.spec.llama_shape())


@register_case("frag16k", units=lambda spec: spec.iterations + 1)
def case_frag16k(run: BackendRun) -> dict[str, Any]:
    """``--fragments`` x 16 KiB fragments (4096 = 64 MiB by default): every mode, same plan."""
    return _transfer_case(run, run.spec.frag16k_shape())


@register_case("bounce")
def case_bounce(run: BackendRun) -> dict[str, Any]:
    """Token-major TP2 -> TP4 (one fragment per token) through the bounce path vs per-token fragments, same run.

    Runs ``kvcore demo`` twice on this backend with 6 rank processes (2 context, 4 generation): once with
    the bounce path forced on, once off. ``--tokens`` is split over 4 requests in flight; every byte is
    verified by the demo's independent check.
    """
    from kvcore.layout.topology import dtype_bytes
    from kvcore.tools.demo import DemoSpec, run_demo

    spec = run.spec
    requests = 4
    tokens = max(spec.tokens_per_block, spec.tokens // requests)
    per_rank = spec.layers * 2 * tokens * max(1, spec.kv_heads // 4) * spec.head_dim * dtype_bytes(spec.dtype)
    arena = max(64 << 20, 2 * requests * per_rank)  # every request's lease fits at once
    out: dict[str, Any] = {"topology": "context TP2 -> generation TP4, token-major", "requests": requests}
    modes: dict[str, Any] = {}
    for mode in ("off", "on"):
        run.say(f"{run.backend} bounce: {mode}")
        demo = DemoSpec(
            backend=run.backend,
            requests=requests,
            tokens=tokens,
            layers=spec.layers,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            tokens_per_block=spec.tokens_per_block,
            dtype=spec.dtype,
            layout="token_major",
            ctx_tp=2,
            gen_tp=4,
            bounce=mode,
            timeout_s=spec.timeout_s,
            extra={"bounce_buffer_bytes": arena},
        )
        r = run_demo(demo, progress=False)
        modes[mode] = {
            "gbps": r.get("gbps", 0.0),
            "seconds": r.get("seconds"),
            "bytes": r.get("bytes"),
            "verified": bool(r.get("ok")),
            "errors": r.get("errors", {}),
        }
    out["modes"] = {"per_token_fragments": modes["off"], "bounce": modes["on"]}
    off = modes["off"]["gbps"]
    out["ratio_bounce_vs_fragments"] = modes["on"]["gbps"] / off if off else None
    out["verified"] = modes["off"]["verified"] and modes["on"]["verified"]
    return out


@register_case("modes", units=lambda spec: spec.iterations + 2)
def case_modes(run: BackendRun) -> dict[str, Any]:
    """Push vs pull, same run: the Llama-3-8B-shaped request and one-block requests, alternating modes."""
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    out: dict[str, Any] = {"push_vs_pull": ["push", "pull"]}
    for label, shape, region, n in (
        ("big", spec.llama_shape(), "big", spec.iterations),
        ("one_block", replace(spec.frag16k_shape(), name="one_block", tokens=32), "first", spec.latency_requests),
    ):
        res: dict[str, Any] = {"shape": asdict(shape), "bytes": shape.nbytes if label == "big" else shape.block_bytes}
        res.update(run.open(shape))
        times: dict[str, list[float]] = {"push": [], "pull": []}
        verified = True
        try:
            run.say(f"{run.backend} modes: {label}, {n} requests per mode")
            for i in range(n):
                for mode in ("push", "pull") if i % 2 == 0 else ("pull", "push"):  # neither always goes first
                    run.gen.call("zero", region=region)
                    times[mode].append(run.kvcore_once(region, mode))
                    verified = verified and run.gen.call("verify", region=region)["ok"]
                if label == "big":
                    run.tick()
        finally:
            res.update(run.close_shape())
        for mode, ts in times.items():
            res[mode] = {
                "ms_median": statistics.median(ts) * 1e3,
                "ms_p90": _pct(ts, 90) * 1e3,
                "gbps_median": res["bytes"] / statistics.median(ts) / _GB,
            }
        res["pull_vs_push_time"] = statistics.median(times["pull"]) / statistics.median(times["push"])
        res["verified"] = verified and res["pool_verified"] and not res["leaks"]
        out[label] = res
        run.tick()
    out["verified"] = out["big"]["verified"] and out["one_block"]["verified"]
    return out


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


@register_case("small")
def case_small(run: BackendRun) -> dict[str, Any]:
    """One-block (16 KiB) requests: per-request latency vs the agent alone, and requests/s with many in flight."""
    return _small(run, auth=False)


@register_case("small_auth")
def case_small_auth(run: BackendRun) -> dict[str, Any]:
    """The ``small`` case with CurveZMQ on both control planes (one fresh key pair per instance)."""
    return _small(run, auth=True)


def _small(run: BackendRun, *, auth: bool) -> dict[str, Any]:
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    shape = replace(spec.frag16k_shape(), name="small", tokens=32)
    out: dict[str, Any] = {"shape": asdict(shape), "block_bytes": shape.block_bytes, "auth": auth}
    out.update(run.open(shape, auth=auth))
    try:
        warm = max(1, min(20, spec.latency_requests // 10))
        # warm-up requests, not counted
        rid = run.rids(warm)
        run.ctx.call("send", rid0=rid, n=warm, region="small")
        run.gen.call("receive", endpoint=run.endpoint, rid0=rid, n=warm, region="small", pipelined=False)
        # latency: one at a time
        run.say(f"{run.backend} small: {spec.latency_requests} requests one at a time")
        rid = run.rids(spec.latency_requests)
        run.ctx.call("send", rid0=rid, n=spec.latency_requests, region="small")
        steps0 = {"context": run.ctx.call("steps"), "generation": run.gen.call("steps")}
        r = run.gen.call(
            "receive", endpoint=run.endpoint, rid0=rid, n=spec.latency_requests, region="small", pipelined=False
        )
        steps1 = {"context": run.ctx.call("steps"), "generation": run.gen.call("steps")}
        lat_ms = [x * 1e3 for x in r["latency_s"]]
        not_done = list(r["not_done"])
        # the transport alone on the same one-block plan
        bare = run.ctx.call("prepare", mode="agent", region="small", count=1)
        admitted = run.gen.call("admit", descriptor=bare["descriptor"])["name"]
        try:
            a = run.ctx.call("xfer", mode="agent", repeat=spec.latency_requests + warm)
        finally:
            run.ctx.call("unprepare", mode="agent")
            run.gen.call("dismiss", name=admitted)
        agent_ms = [x * 1e3 for x in a["seconds"][warm:]]
        # throughput: every request in flight together
        run.say(f"{run.backend} small: {spec.small_requests} requests in flight")
        rid = run.rids(spec.small_requests)
        run.ctx.call("send", rid0=rid, n=spec.small_requests, region="small")
        t = run.gen.call(
            "receive", endpoint=run.endpoint, rid0=rid, n=spec.small_requests, region="small", pipelined=True
        )
        not_done += t["not_done"]
        ok = run.gen.call("verify", region="small")["ok"]
    finally:
        shape_checks = run.close_shape()
    out["latency"] = {
        "requests": len(lat_ms),
        "kvcore_ms_p50": _pct(lat_ms, 50),
        "kvcore_ms_p99": _pct(lat_ms, 99),
        "kvcore_ms_mean": statistics.fmean(lat_ms),
        "agent_ms_p50": _pct(agent_ms, 50),
        "agent_ms_p99": _pct(agent_ms, 99),
        "overhead_ms_p50": _pct(lat_ms, 50) - _pct(agent_ms, 50),
        "requests_per_s_one_at_a_time": len(lat_ms) / r["elapsed_s"],
    }
    # Mean ms per request of each step the transceivers time, over the one-at-a-time requests only.
    out["steps_ms_mean"] = {
        f"{side}.{name}": (v[0] - steps0[side][name][0]) / (v[1] - steps0[side][name][1]) * 1e3
        for side, names in steps1.items()
        for name, v in names.items()
        if v[1] > steps0[side][name][1]
    }
    out["throughput"] = {
        "requests": spec.small_requests,
        "seconds": t["elapsed_s"],
        "requests_per_s": spec.small_requests / t["elapsed_s"],
        "gbps": spec.small_requests * shape.block_bytes / t["elapsed_s"] / _GB,
    }
    out["not_done"] = not_done
    out.update(shape_checks)
    out["verified"] = (
        ok
        and not not_done
        and shape_checks["pool_verified"]
        and out["first_contact_verified"]
        and not shape_checks["context_errors"]
        and out["curve_ranks"] == (2 if auth else 0)  # CURVE on both ranks exactly when asked for
    )
    return out


@register_case("hol", units=lambda spec: spec.iterations + 1)
def case_hol(run: BackendRun) -> dict[str, Any]:
    """Head of line: one-block requests alone, and while the whole ``llama8b`` request moves on the same rank.

    Each round sends ``--hol-requests`` one-block requests one at a time with nothing else in flight, then
    starts the big request and sends as many one-block requests one at a time beside it; only those that
    ended before the big one are counted as ``during``. The first round is the warm-up.
    """
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    shape = replace(spec.llama_shape(), name="hol")
    n = max(spec.hol_requests, SMALL_SLOTS)  # every small slot is written, so the end-of-case check holds
    out: dict[str, Any] = {"shape": asdict(shape), "bytes": shape.nbytes, "block_bytes": shape.block_bytes}
    out.update(run.open(shape))
    alone: list[float] = []
    during: list[float] = []
    big_ms: list[float] = []
    not_done: list[str] = []
    try:
        for it in range(spec.iterations + 1):
            run.say(f"{run.backend} hol: round {it}/{spec.iterations}")
            if it:
                run.tick()
            rid = run.rids(n)
            run.ctx.call("send", rid0=rid, n=n, region="small")
            a = run.gen.call("receive", endpoint=run.endpoint, rid0=rid, n=n, region="small", pipelined=False)
            big, rid = run.rids(1), run.rids(n)
            run.ctx.call("send", rid0=big, n=1, region="big")
            run.ctx.call("send", rid0=rid, n=n, region="small")
            h = run.gen.call("hol", endpoint=run.endpoint, big_rid=big, rid0=rid, n=n)
            not_done += a["not_done"] + h["not_done"]
            if it:
                alone += [x * 1e3 for x in a["latency_s"]]
                during += [x * 1e3 for x, d in zip(h["latency_s"], h["during"], strict=True) if d]
                big_ms.append(h["big_s"] * 1e3)
        ok = run.gen.call("verify", region="small")["ok"] and run.gen.call("verify", region="big")["ok"]
    finally:
        shape_checks = run.close_shape()
    run.tick()
    out["one_block"] = {
        "requests_alone": len(alone),
        "requests_during": len(during),
        "alone_ms_p50": _pct(alone, 50),
        "alone_ms_p99": _pct(alone, 99),
        "during_ms_p50": _pct(during, 50) if during else None,
        "during_ms_p99": _pct(during, 99) if during else None,
        "during_vs_alone_p50": _pct(during, 50) / _pct(alone, 50) if during else None,
    }
    out["big_ms_median"] = statistics.median(big_ms)
    out["big_gbps_median"] = shape.nbytes / (statistics.median(big_ms) / 1e3) / _GB
    out["not_done"] = not_done
    out.update(shape_checks)
    out["verified"] = (
        ok
        and not not_done
        and shape_checks["pool_verified"]
        and out["first_contact_verified"]
        and not shape_checks["context_errors"]
    )
    return out


@register_case("soak")
def case_soak(run: BackendRun) -> dict[str, Any]:
    """Issue 9's soak: ``--requests`` one-block requests, ``--inflight`` at a time, random cancels from both sides.

    Both ranks run their side at once (separate processes). Every request must be reported exactly once and
    released on both sides, DONE ones must hold the right bytes, and once the transceivers have settled every
    live count (sessions, tombstones, quarantine, leases, transfers) must be back to zero.
    """
    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    shape = Shape("soak", tokens=spec.inflight * 32, layers=1, kv_heads=1, head_dim=128, tokens_per_block=32)
    out: dict[str, Any] = {
        "shape": asdict(shape),
        "requests": spec.requests,
        "inflight": spec.inflight,
        "cancel_rate": spec.cancel_rate,
        "request_timeout_s": spec.soak_request_timeout_s,
    }
    out.update(run.open(shape, request_timeout_s=spec.soak_request_timeout_s))
    sides: dict[str, dict[str, Any]] = {}
    try:
        rid0 = run.rids(spec.requests)
        # the loop's own bound: at least 50 requests/s, and never below --timeout
        deadline_s = max(spec.timeout_s, spec.requests / 50.0)
        args = {
            "rid0": rid0,
            "requests": spec.requests,
            "inflight": spec.inflight,
            "cancel_rate": spec.cancel_rate,
            "deadline_s": deadline_s,
        }
        run.say(
            f"{run.backend} soak: {spec.requests} requests, {spec.inflight} in flight, cancel rate {spec.cancel_rate}"
        )
        run.ctx.post("soak", **args)
        run.gen.post("soak", endpoint=run.endpoint, **args)
        wait = deadline_s + spec.soak_request_timeout_s + 60.0
        sides["generation"] = run.gen.reply("soak", wait)
        sides["context"] = run.ctx.reply("soak", wait)
    finally:
        shape_checks = run.close_shape()
    out.update(sides)
    out["seconds"] = max(side["seconds"] for side in sides.values())
    out.update(shape_checks)
    out["leaks"] = {
        **{f"{name}.{k}": v for name, side in sides.items() for k, v in side["leaks"].items()},
        **shape_checks["leaks"],
    }
    promises = {
        name: {
            "reported_once": side["duplicate_outcomes"] == 0 and sum(side["outcomes"].values()) == spec.requests,
            "released_after_outcome": side["released_before_outcome"] == 0,
            "all_released": side["unreleased"] == 0,
            "bytes": side["byte_mismatches"] == 0,
        }
        for name, side in sides.items()
    }
    out["promises"] = promises
    out["verified"] = (
        all(all(p.values()) for p in promises.values())
        and shape_checks["pool_verified"]
        and out["first_contact_verified"]
    )
    return out


def matrix_cells(spec: BenchSpec) -> list[tuple[int, int, int]]:
    """The matrix's (fragment bytes, request tokens, in flight) cells that run (the others exceed matrix_max_bytes)."""
    out = []
    block = spec.matrix_block_bytes()
    per_token = block // spec.tokens_per_block
    for f in spec.matrix_fragment_bytes:
        for tokens in sorted(spec.matrix_tokens):
            for n in sorted(spec.matrix_inflight):
                if n * tokens * per_token <= spec.matrix_max_bytes or n == 1:
                    out.append((f or block, tokens, n))
    return out


@register_case("matrix", units=lambda spec: len(matrix_cells(spec)))
def case_matrix(run: BackendRun) -> dict[str, Any]:
    """GB/s over request size x fragment size x requests in flight: kvcore, the bare transport and memcpy.

    A request of ``t`` tokens moves the bytes of ``t`` tokens of a Llama-3-70B-shaped cache (all layers, K and V),
    cut into fragments of ``f`` bytes (as per-layer, per-head or per-token pools would cut them; 0 = one whole
    block of the model per fragment). Each fragment size is one pool shape on both ranks (one fragment per
    block, blocks scattered on both sides), opened once; within it every request size runs the bare modes
    (one request) and kvcore with each in-flight count. In-flight requests cycle through request-sized slots
    (``matrix_pool_bytes`` per side), so concurrent writes to one slot carry identical bytes and stay checkable.
    """
    from kvcore.layout.topology import dtype_bytes

    assert run.ctx is not None and run.gen is not None
    spec = run.spec
    block = spec.matrix_block_bytes()
    per_token = block // spec.tokens_per_block
    native = _baselines().matrix_mode(run.backend)
    bare = ["agent"] + ([native] if native else []) + ["memcpy", "memcpy_scattered"]
    cells: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "model": {
            "name": "Llama-3-70B-shaped",
            "layers": spec.matrix_layers,
            "kv_heads": spec.kv_heads,
            "head_dim": spec.head_dim,
            "dtype": spec.dtype,
            "tokens_per_block": spec.tokens_per_block,
            "block_bytes": block,
            "bytes_per_token": per_token,
        },
        "iterations": spec.matrix_iterations,
        "cells": cells,
        "skipped": [],
        "leaks": {},
        "first_contact_ms": {},
    }
    todo = matrix_cells(spec)
    ok = True
    for frag in dict.fromkeys(f for f, _, _ in todo):
        sizes = sorted({t for f, t, _ in todo if f == frag})
        max_req = max(sizes) * per_token
        max_n = max(n for f, _, n in todo if f == frag)
        slot_blocks = -(-max_req // frag)
        slots = max(1, min(max_n, spec.matrix_pool_bytes // max(1, slot_blocks * frag)))
        head_dim = frag // (2 * dtype_bytes("bfloat16"))  # 1 layer, K and V, 1 head, 1 token per block: f bytes
        shape = Shape(f"matrix-{frag}", slots * slot_blocks, 1, 1, head_dim, 1, "bfloat16")
        opened = run.open(shape)
        out["first_contact_ms"][str(frag)] = opened["first_contact_ms"]
        ok = ok and opened["first_contact_verified"]
        try:
            for tokens in sizes:
                nbytes = tokens * per_token
                count = -(-nbytes // frag)
                moved = count * frag
                base = {"fragment_bytes": frag, "request_tokens": tokens, "request_bytes": moved, "fragments": count}
                for mode in bare:
                    run.say(f"{run.backend} matrix: {tokens} tokens, {frag} B fragments, {mode}")
                    prep = run.ctx.call("prepare", mode=mode, region="big", count=count)
                    admitted = None
                    if prep.get("descriptor"):  # the bare agent: the generation side loads it first
                        admitted = run.gen.call("admit", descriptor=prep["descriptor"])["name"]
                    try:
                        r = run.ctx.call("xfer", mode=mode, repeat=spec.matrix_iterations + 1)
                        if mode.startswith("memcpy"):
                            good = run.ctx.call("check", mode=mode)["ok"]
                        else:
                            good = run.gen.call("verify_slots", count=count, slot_blocks=slot_blocks, slots=1)["ok"]
                    finally:
                        run.ctx.call("unprepare", mode=mode)
                        if admitted is not None:
                            run.gen.call("dismiss", name=admitted)
                    cells.append(
                        {**base, "mode": mode, "inflight": 1, "verified": good}
                        | _summarize(moved, r["seconds"][1:], r["seconds"][0])
                    )
                    ok = ok and good
                for n in sorted({n for f, t, n in todo if f == frag and t == tokens}):
                    run.say(f"{run.backend} matrix: {tokens} tokens, {frag} B fragments, kvcore x{n}")
                    times, first = [], 0.0
                    good = True
                    for it in range(spec.matrix_iterations + 1):
                        rid = run.rids(n)
                        run.ctx.call("send", rid0=rid, n=n, region="big", count=count, slot_blocks=slot_blocks)
                        rr = run.gen.call(
                            "receive",
                            endpoint=run.endpoint,
                            rid0=rid,
                            n=n,
                            region="big",
                            pipelined=True,
                            count=count,
                            slot_blocks=slot_blocks,
                        )
                        v = run.gen.call("verify_slots", count=count, slot_blocks=slot_blocks, slots=min(n, slots))
                        good = good and v["ok"] and not rr["not_done"]
                        if it == 0:
                            first = rr["elapsed_s"]
                        else:
                            times.append(rr["elapsed_s"])
                    cell = {**base, "mode": "kvcore", "inflight": n, "verified": good}
                    cell |= _summarize(moved * n, times, first)
                    cells.append(cell)
                    ok = ok and good
                    run.tick()
        finally:
            checks = run.close_shape()
        out["leaks"].update({f"{frag}.{k}": v for k, v in checks["leaks"].items()})
        ok = ok and checks["pool_verified"] and not checks["context_errors"]
    for f in spec.matrix_fragment_bytes:
        for tokens in spec.matrix_tokens:
            for n in spec.matrix_inflight:
                if (f or block, tokens, n) not in todo:
                    out["skipped"].append({"fragment_bytes": f or block, "request_tokens": tokens, "inflight": n})
    out["verified"] = ok
    return out


# --- entry points ------------------------------------------------------------------------------


def installed_backends() -> list[str]:
    """Every transfer agent whose plugin loads here: network agents first (by auto-selection priority), then by name."""
    from kvcore.extension.plugins import get_plugin_manager

    reg = get_plugin_manager().registries.transfer_agents
    ok = []
    for name in reg.names():
        try:
            reg.get(name)
        except KvcoreError:
            continue
        ok.append(name)
    return reg.preferred_order(ok)


def _baselines() -> BenchBaselineRegistry:
    """The bench baselines the installed plugins register (a transport's own API); the core names none."""
    from kvcore.extension.plugins import get_plugin_manager

    return get_plugin_manager().registries.bench_baselines


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


class BenchProgress:
    """A progress bar on stderr (rich): the cases' units done of the total, the current step as its label."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description}", style="bold"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._task: Any = None

    def start(self, total: int) -> None:
        self._bar.start()
        self._task = self._bar.add_task("kvcore bench", total=max(1, total))

    def say(self, message: str) -> None:
        if self._task is not None:
            self._bar.update(self._task, description=message)

    def advance(self, n: int = 1) -> None:
        if self._task is not None:
            self._bar.advance(self._task, n)

    def stop(self) -> None:
        self._bar.stop()


def run_bench(
    spec: BenchSpec, *, say: Callable[[str], None] | None = None, progress: BenchProgress | None = None
) -> dict[str, Any]:
    """Run every selected case on every selected backend; returns the JSON-able result (``ok`` says all verified).

    A backend that fails is reported under its name (``ok: false`` and the error) and the others still run.
    ``progress`` (a :class:`BenchProgress`) shows a bar; ``say`` gets each step's label otherwise.
    """
    spec.validate()
    if "small_auth" in spec.cases and not spec.auth_config:
        from kvcore.tools.demo import instance_keys

        with instance_keys() as keys:  # private temporary directory, removed when the run ends
            result = run_bench(replace(spec, auth_config=keys), say=say, progress=progress)
        result["spec"]["auth_config"] = {}  # the paths are gone with the keys
        return result
    backends = spec.backends or installed_backends()
    if progress is not None:
        progress.start(len(backends) * sum(CASE_UNITS.get(c, _one_unit)(spec) for c in spec.cases))
        try:
            return _run_bench(spec, backends, progress.say, progress.advance)
        finally:
            progress.stop()
    return _run_bench(spec, backends, say or (lambda _msg: None), None)


def _run_bench(
    spec: BenchSpec, backends: list[str], say: Callable[[str], None], tick: Callable[[int], None] | None
) -> dict[str, Any]:
    result: dict[str, Any] = {"version": 1, "machine": _machine(), "spec": asdict(spec), "backends": {}}
    t0 = time.perf_counter()
    for backend in backends:
        entry: dict[str, Any] = {"cases": {}}
        result["backends"][backend] = entry
        run = None
        try:
            from kvcore.config import resolve_backend

            resolve_backend(backend)  # a missing or broken backend fails here, before any process starts
            say(f"{backend}: starting rank processes")
            run = BackendRun(backend, spec, say, tick)
            for case in spec.cases:
                entry["cases"][case] = CASES[case](run)
                if case not in CASE_UNITS:
                    run.tick()
            entry["ok"] = all(c.get("verified") and not c.get("leaks") for c in entry["cases"].values())
        except (KvcoreError, OSError, EOFError) as exc:
            entry["ok"] = False
            entry["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if run is not None:
                run.close()
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["seconds"] = time.perf_counter() - t0
    result["ok"] = bool(backends) and all(b["ok"] for b in result["backends"].values())
    return result


def add_parser(sub: Any) -> None:
    """Register ``kvcore bench`` on the CLI's subparsers."""
    d = BenchSpec()
    p = sub.add_parser("bench", help="kvcore end to end vs the bare transport vs memcpy, same fragments, one run")
    p.add_argument(
        "--backend", default="", help="comma-separated backends (nixl,ucx,shm); default: every installed one"
    )
    p.add_argument("--cases", default=",".join(d.cases), help=f"comma-separated cases (known: {', '.join(CASES)})")
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens of the llama8b request")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--tokens-per-block", type=int, default=d.tokens_per_block)
    p.add_argument("--fragments", type=int, default=d.fragments, help="16 KiB fragments of the frag16k case")
    p.add_argument("--iterations", type=int, default=d.iterations, help="timed rounds after one warm-up round")
    p.add_argument("--small-requests", type=int, default=d.small_requests, help="one-block requests in flight at once")
    p.add_argument("--latency-requests", type=int, default=d.latency_requests, help="one-block requests one at a time")
    p.add_argument(
        "--hol-requests",
        type=int,
        default=d.hol_requests,
        help="hol case: one-block requests per round, alone and beside the big request",
    )
    p.add_argument(
        "--poll-interval-us",
        type=float,
        default=d.poll_interval_s * 1e6,
        help="the generation rank's engine loop sleeps this long between poll() calls",
    )
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="bound in seconds on every rank command")
    p.add_argument("--agent-options", default="{}", help='JSON: {"nixl": {...}, "ucx": {...}}')
    soak = p.add_argument_group("soak case (--cases soak)")
    soak.add_argument("--requests", type=int, default=d.requests, help="one-block requests in the soak")
    soak.add_argument("--inflight", type=int, default=d.inflight, help="soak requests in flight on each side")
    soak.add_argument("--cancel-rate", type=float, default=d.cancel_rate, help="fraction cancelled, half by each side")
    soak.add_argument(
        "--soak-request-timeout",
        type=float,
        default=d.soak_request_timeout_s,
        help="the transceivers' request_timeout_s during the soak (seconds)",
    )
    mx = p.add_argument_group("matrix (--matrix)")
    mx.add_argument(
        "--matrix",
        action="store_true",
        help="GB/s over request size x fragment size x requests in flight (Llama-3-70B-shaped), bare and memcpy too",
    )
    mx.add_argument(
        "--quick", action="store_true", help="a small matrix (2 x 3 x 2 cells of a 2-layer model); implies --matrix"
    )
    mx.add_argument("--matrix-tokens", default="", help=f"request sizes in tokens (default {d.matrix_tokens})")
    mx.add_argument(
        "--matrix-fragment-bytes",
        default="",
        help=f"fragment sizes in bytes, 0 = one whole block (default {d.matrix_fragment_bytes})",
    )
    mx.add_argument("--matrix-inflight", default="", help=f"requests in flight (default {d.matrix_inflight})")
    mx.add_argument("--matrix-iterations", type=int, default=d.matrix_iterations, help="timed rounds per cell")
    p.add_argument("--plot", metavar="FILE.png", default="", help="plot GB/s against fragment size (needs matplotlib)")
    p.add_argument(
        "--auth",
        action="store_true",
        help="run the small case twice with the same rank processes: without, then with CurveZMQ on both control "
        "planes (case small_auth; a fresh key pair per instance in a private temporary directory, removed after)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON (no progress bar)")
    p.set_defaults(func=cmd_bench)


def _int_list(text: str, name: str) -> list[int] | None:
    if not text.strip():
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{name}: expected comma-separated integers, got {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    """``kvcore bench``: run, print a table (or JSON), exit 0 only when every byte was verified and nothing leaked."""
    try:
        spec = BenchSpec(
            backends=[b.strip() for b in args.backend.split(",") if b.strip()] or None,
            cases=[c.strip() for c in args.cases.split(",") if c.strip()],
            tokens=args.tokens,
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            tokens_per_block=args.tokens_per_block,
            fragments=args.fragments,
            iterations=args.iterations,
            small_requests=args.small_requests,
            latency_requests=args.latency_requests,
            hol_requests=args.hol_requests,
            timeout_s=args.timeout,
            poll_interval_s=args.poll_interval_us / 1e6,
            agent_options=json.loads(args.agent_options),
            requests=args.requests,
            inflight=args.inflight,
            cancel_rate=args.cancel_rate,
            soak_request_timeout_s=args.soak_request_timeout,
            matrix_iterations=args.matrix_iterations,
        )
        if args.matrix or args.quick:
            spec.cases = ["matrix"]
        if args.auth:
            spec.auth = True
            if "small" not in spec.cases:
                spec.cases.append("small")
            if "small_auth" not in spec.cases:
                spec.cases.insert(spec.cases.index("small") + 1, "small_auth")
        if args.quick:
            spec = spec.quick_matrix()
        for name in ("matrix_tokens", "matrix_fragment_bytes", "matrix_inflight"):
            values = _int_list(getattr(args, name), "--" + name.replace("_", "-"))
            if values is not None:
                setattr(spec, name, values)
        if args.plot and not args.plot.lower().endswith(".png"):
            raise BenchError(f"--plot: expected a .png file name, got {args.plot!r}")
        quiet = args.json or not sys.stderr.isatty()
        result = run_bench(spec, progress=None if quiet else BenchProgress())
        if args.plot:
            plot_result(result, args.plot)
    except (KvcoreError, ValueError) as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        else:
            print(f"kvcore bench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_result(result)
    return 0 if result["ok"] else 1


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
                    f"{thr['requests_per_s']:.0f} ({thr['requests']})",
                    f"{c['first_contact_ms']:.1f}",
                    "[green]yes[/]" if c["verified"] else "[red]NO[/]",
                )
    if t.row_count:
        con.print(t)
    if s.row_count:
        con.print(s)
    _print_hol(con, result)
    _print_soak(con, result)
    _print_matrix(con, result)
    con.print("[green]OK: every transfer verified, nothing leaked[/]" if result["ok"] else "[red]FAILED[/]")


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
