"""``kvcore bench`` baseline of kvcore-ucx: UCX's own API on kvcore's identical fragment plan, no kvcore code timed.

Registered by ``kvcore_ucx.plugin`` beside the ``ucx`` agent:

* ``ucx_put``: a second, bare UCP context and worker in the context rank process (the plugin's cffi binding,
  :mod:`kvcore_ucx._ucp`), the local pool mapped with ``ucp_mem_map``, one endpoint to the generation rank's
  worker and its packed rkeys unpacked, all from the descriptor the kvcore agent gets; per transfer one
  ``ucp_put_nbx`` per fragment of the plan as given (no merging), one ``ucp_ep_flush_nbx``, then
  ``ucp_worker_progress`` without back-off until every request and the flush completed (the bytes are in the
  target's memory). No notification is sent: the bare speed of the data path.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

from kvcore.errors import TransferFailedError, TransferTimeoutError
from kvcore.extension.convert import convert_options
from kvcore.hostinfo import host_identity
from kvcore.transport.agent import TransferAgent
from kvcore.transport.baselines import BaselinePlan, BenchBaseline
from kvcore_ucx import _ucp
from kvcore_ucx.agent import UcxOptions, _Payload, _resolve_mode, ucx_settings

__all__ = ["UcxPut"]


class UcxPut(BenchBaseline):
    """Bare UCX RMA: ``ucp_put_nbx`` per fragment and one endpoint flush per transfer, progressed in this thread."""

    def __init__(self, plan: BaselinePlan) -> None:
        super().__init__(plan)
        self._u = u = _ucp.load()
        ffi, lib = u.ffi, u.lib
        self._ffi, self._lib = ffi, lib
        self._context: Any = None
        self._worker: Any = None
        self._memh: Any = None
        self._ep: Any = None
        self._rkeys: list[Any] = []
        try:
            self._setup(plan)
        except BaseException:
            self.close()
            raise

    def _check(self, status: int, what: str) -> None:
        if status != _ucp.UCS_OK:
            raise TransferFailedError(f"bare UCX baseline: {what} failed: UCS_ERR_{self._u.status_string(status)}")

    def _setup(self, plan: BaselinePlan) -> None:
        ffi, lib = self._ffi, self._lib
        opts = convert_options(UcxOptions, plan.agent_options, owner="ucx agent")
        # The same UCX settings as the kvcore agent of this run (transports and devices are per context); AM: the
        # same lanes the agent's endpoint gets.
        self._context = _ucp.create_context(
            self._u, ucx_settings(opts), features=_ucp.UCP_FEATURE_RMA | _ucp.UCP_FEATURE_AM, check=self._check
        )
        # One thread, no lock: the bare API at its cheapest.
        self._worker = _ucp.create_worker(
            self._u, self._context, thread_mode=_ucp.UCS_THREAD_MODE_SINGLE, check=self._check
        )

        mparams = _ucp.mem_map_params(self._u, plan.pool_base, plan.pool_bytes, _ucp.UCS_MEMORY_TYPE_HOST)
        memh = ffi.new("ucp_mem_h *")
        self._check(lib.ucp_mem_map(self._context, mparams, memh), "ucp_mem_map of the local pool")
        self._memh = memh[0]

        # The generation rank's worker address and rkeys, from the descriptor its kvcore agent published.
        desc = TransferAgent.decode_descriptor(plan.peer_descriptor)
        payload = msgspec.msgpack.decode(desc.payload, type=_Payload)
        mine = host_identity()
        same_host = bool(mine) and payload.host_identity == mine  # as the agent decides it
        mode = _resolve_mode(opts.error_handling, same_host)
        self._force_close = mode == "peer"
        self._ep = _ucp.create_endpoint(
            self._u, self._worker, payload.worker_address, peer_mode=mode == "peer", check=self._check
        )
        out = ffi.new("ucp_rkey_h *")
        for info in payload.rkeys:
            self._check(lib.ucp_ep_rkey_unpack(self._ep, ffi.from_buffer(info.rkey), out), "ucp_ep_rkey_unpack")
            self._rkeys.append(out[0])

        # Which rkey covers each destination fragment: worked out once, outside the timed loop.
        starts = np.array([r.address for r in payload.rkeys], dtype=np.uint64)
        ends = np.array([r.address + r.length for r in payload.rkeys], dtype=np.uint64)
        idx = np.searchsorted(starts, plan.dst, side="right").astype(np.int64) - 1
        if (idx < 0).any() or (plan.dst + plan.sizes > ends[np.maximum(idx, 0)]).any():
            raise TransferFailedError("bare UCX baseline: a destination fragment lies outside the peer's registrations")
        self._posts = list(
            zip(plan.src.tolist(), plan.sizes.tolist(), plan.dst.tolist(), [self._rkeys[i] for i in idx.tolist()])
        )
        self._param = ffi.new("ucp_request_param_t *")
        self._param.op_attr_mask = _ucp.UCP_OP_ATTR_FIELD_MEMH
        self._param.memh = self._memh
        self._param_plain = ffi.new("ucp_request_param_t *")

    def once(self) -> tuple[float, float]:
        lib, ep, param = self._lib, self._ep, self._param
        put = lib.ucp_put_nbx
        requests: list[int] = []
        t0 = time.perf_counter()
        for src, size, dst, rkey in self._posts:
            st = put(ep, src, size, dst, rkey, param)
            if st:
                if st >= _ucp.PTR_ERR_MIN:
                    self._finish(requests)
                    self._check(st - (1 << 64), "ucp_put_nbx")
                requests.append(st)
        flush = lib.ucp_ep_flush_nbx(ep, self._param_plain)
        st = _ucp.ptr_status(flush)
        if st == _ucp.UCS_INPROGRESS:
            requests.append(flush)
        t1 = time.perf_counter()
        try:
            self._check(st if st != _ucp.UCS_INPROGRESS else _ucp.UCS_OK, "ucp_ep_flush_nbx")
            deadline = t0 + self.plan.timeout_s
            while requests:
                lib.ucp_worker_progress(self._worker)
                while requests and lib.ucp_request_check_status(requests[-1]) != _ucp.UCS_INPROGRESS:
                    self._check(lib.ucp_request_check_status(requests[-1]), "a put or the flush")
                    lib.ucp_request_free(requests.pop())
                if requests and time.perf_counter() > deadline:
                    raise TransferTimeoutError(
                        f"bare UCX transfer: {len(requests)} request(s) still pending after {self.plan.timeout_s}s"
                    )
            t2 = time.perf_counter()
        finally:
            self._finish(requests)
        return t2 - t0, t1 - t0

    def _finish(self, requests: list[int]) -> None:
        """Cancel and free what is still pending (after a failure): UCX must not write into freed requests."""
        lib = self._lib
        for req in requests:
            if lib.ucp_request_check_status(req) == _ucp.UCS_INPROGRESS:
                lib.ucp_request_cancel(self._worker, req)
            lib.ucp_request_free(req)
        requests.clear()

    def close(self) -> None:
        lib, ffi = self._lib, self._ffi
        for rkey in self._rkeys:
            lib.ucp_rkey_destroy(rkey)
        self._rkeys = []
        if self._ep is not None:
            cparams = ffi.new("ucp_request_param_t *")
            cparams.op_attr_mask = _ucp.UCP_OP_ATTR_FIELD_FLAGS
            cparams.flags = _ucp.UCP_EP_CLOSE_FLAG_FORCE if self._force_close else 0
            ep, self._ep = self._ep, None
            _ucp.close_endpoint(self._u, self._worker, ep, cparams, timeout_s=5.0)
        if self._memh is not None:
            lib.ucp_mem_unmap(self._context, self._memh)
            self._memh = None
        if self._worker is not None:
            lib.ucp_worker_destroy(self._worker)
            self._worker = None
        if self._context is not None:
            lib.ucp_cleanup(self._context)
            self._context = None
