"""The transport without kvcore: the bare agent, the plugins' baselines and memcpy, on kvcore's own fragment plan.

Each mode is prepared, timed and checked on the context rank (the ``prepare``/``xfer``/``check`` commands).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvcore.tools.bench.blocks import _block_ids
from kvcore.tools.bench.spec import BenchError, BenchSpec, BenchTimeoutError, Shape

if TYPE_CHECKING:
    from kvcore.extension.registry import BenchBaselineRegistry


class _BareModes:
    """The context rank's bare modes: the backend's agent, the plugin's baselines and memcpy on kvcore's plan.

    A mixin of :class:`kvcore.tools.bench.rank._Rank`, which owns the attributes declared here.
    """

    role: str
    backend: str
    spec: BenchSpec
    config: Any
    agent: Any
    tx: Any
    shape: Shape | None
    pool: Any
    ids: dict[str, np.ndarray]
    bare: dict[str, Any]
    gen_info: Any
    _create_agent: Callable[..., Any]

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
        return agent_once(st, self.backend, self.spec.timeout_s)

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


def agent_once(st: dict[str, Any], backend: str, timeout_s: float) -> tuple[float, float]:
    """One write of the prepared ``agent`` mode's plan (``st``), polled to its end; seconds in all and in ``submit``."""
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
    deadline = t0 + timeout_s
    while ag.poll(h) is TransferStatus.PENDING:  # no back-off: the transport's own speed
        if announced:
            ended.wait(0.05)
            ended.clear()
        if time.perf_counter() > deadline:
            raise BenchTimeoutError(f"{backend} agent transfer still pending after {timeout_s}s")
    t2 = time.perf_counter()
    err = h.error
    ag.release(h)
    if err is not None:
        raise err
    return t2 - t0, t1 - t0


def _baselines() -> BenchBaselineRegistry:
    """The bench baselines the installed plugins register (a transport's own API); the core names none."""
    from kvcore.extension.plugins import get_plugin_manager

    return get_plugin_manager().registries.bench_baselines
