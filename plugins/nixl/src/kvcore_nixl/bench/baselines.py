"""``kvcore bench`` baselines of kvcore-nixl: NIXL's own API on kvcore's identical fragment plan.

Registered by ``kvcore_nixl.plugin`` beside the ``nixl`` agent:

* ``nixl_initialize``: a second, bare ``nixl_agent`` in the context rank process; ``initialize_xfer`` per
  transfer (the bare speed the bench matrix reports for nixl);
* ``nixl_prepped``: the same agent with prepared descriptor lists made once and re-posted.

No kvcore code runs in the timed loop.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from kvcore.errors import TransferFailedError, TransferTimeoutError
from kvcore.transport.baselines import BaselinePlan, BenchBaseline
from kvcore_nixl.agent import DEFAULT_BACKEND_PARAMS, decode_payload, load_nixl

__all__ = ["NixlInitialize", "NixlPrepped"]


class _BareNixl(BenchBaseline):
    """A bare ``nixl_agent`` holding the local pool and the generation rank's NIXL agent."""

    prepped = False

    def __init__(self, plan: BaselinePlan) -> None:
        super().__init__(plan)
        api = load_nixl()
        opts = plan.agent_options
        backend = str(opts.get("nixl_backend", "UCX"))
        params = {
            **DEFAULT_BACKEND_PARAMS.get(backend, {}),
            **{str(k): str(v) for k, v in dict(opts.get("backend_params", {})).items()},
        }
        name = f"bench-bare-nixl-{os.getpid()}-{'prepped' if self.prepped else 'init'}-{time.monotonic_ns()}"
        bare = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        bare.create_backend(backend, params)
        self.nixl: Any = bare
        self.reg = bare.register_memory(np.array([[plan.pool_base, plan.pool_bytes, 0]], dtype=np.uint64), "DRAM")
        rname = bare.add_remote_agent(decode_payload(plan.peer_descriptor).metadata)
        self.rname = rname.decode() if isinstance(rname, bytes) else rname
        zeros = np.zeros_like(plan.sizes)
        self.ld = np.ascontiguousarray(np.stack([plan.src, plan.sizes, zeros], axis=1))
        self.rd = np.ascontiguousarray(np.stack([plan.dst, plan.sizes, zeros], axis=1))
        self.handles: dict[str, Any] = {}

    def _wait(self, h: Any, state: str, t0: float) -> None:
        deadline = t0 + self.plan.timeout_s
        while state == "PROC":
            if time.perf_counter() > deadline:
                raise TransferTimeoutError(f"bare NIXL transfer still pending after {self.plan.timeout_s}s")
            state = self.nixl.check_xfer_state(h)
        if state != "DONE":
            raise TransferFailedError(f"bare NIXL transfer ended in state {state!r}")

    def close(self) -> None:
        for key in ("xh", "lh", "rh"):
            if key in self.handles:
                self.handles[key].release()
        self.handles.clear()
        self.nixl.remove_remote_agent(self.rname)
        self.nixl.deregister_memory(self.reg)


class NixlInitialize(_BareNixl):
    """``initialize_xfer`` + ``transfer`` per request, polled without back-off."""

    def once(self) -> tuple[float, float]:
        nx = self.nixl
        t0 = time.perf_counter()
        h = nx.initialize_xfer(
            "WRITE", nx.get_xfer_descs(self.ld, "DRAM"), nx.get_xfer_descs(self.rd, "DRAM"), self.rname, b""
        )
        state = nx.transfer(h, b"")
        t1 = time.perf_counter()
        try:
            self._wait(h, state, t0)
        finally:
            t2 = time.perf_counter()
            h.release()
        return t2 - t0, t1 - t0


class NixlPrepped(_BareNixl):
    """Prepared local and remote descriptor lists and one prepared transfer, re-posted per request."""

    prepped = True

    def __init__(self, plan: BaselinePlan) -> None:
        super().__init__(plan)
        nx = self.nixl
        self.handles["lh"] = nx.prep_xfer_dlist("NIXL_INIT_AGENT", self.ld, "DRAM")
        self.handles["rh"] = nx.prep_xfer_dlist(self.rname, self.rd, "DRAM")
        idx = np.arange(plan.sizes.size, dtype=np.int32)
        self.handles["xh"] = nx.make_prepped_xfer("WRITE", self.handles["lh"], idx, self.handles["rh"], idx, b"")

    def once(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        state = self.nixl.transfer(self.handles["xh"], b"")
        t1 = time.perf_counter()
        self._wait(self.handles["xh"], state, t0)
        return time.perf_counter() - t0, t1 - t0
