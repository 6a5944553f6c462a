"""Rank processes that run an engine's executor loop through a kvcore adapter (TensorRT-LLM or SGLang shaped).

Each rank process holds real pools (``kvcore.testing.scenario.Rank``: filled and verified from the model-definition
oracle, never from kvcore's arithmetic), a real ``Transceiver`` (ranks of one instance agree over gloo) and the
adapter. The test is the disaggregated server: it steps every rank of an instance with the same command, as an
executor loop runs the same schedule on every rank, and forwards the context's ``opaque_state``.

Freeing is checked by reuse: whenever the adapter says a request's blocks may be freed (``cancel_request`` True, or
the request reported by a status check / ``KVPoll.Success``/``Failed``), the rank overwrites those blocks with a
sentinel at once, as an engine reusing them would. A context that frees too early sends the sentinel (the
generation's verify fails); a generation that frees too early finds its sentinel overwritten by a late write
(``op_sentinels``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcore.runtime import Channel, RankProcess, serve

SENTINEL = -3.0
HERE = os.path.dirname(os.path.abspath(__file__))

#: The deployment both adapter tests run: 24 requests of 32 tokens (4 blocks), a TP2 context instance and TP1
#: generation instances, on shm; peers that go silent are lost after 2 s.
SPEC: dict[str, Any] = dict(
    backend="shm",
    requests=24,
    tokens=32,
    layers=4,
    kv_heads=4,
    head_dim=32,
    tokens_per_block=8,
    ctx_tp=2,
    gen_tp=1,
    timeout_s=40.0,
    extra={"peer_lost_timeout_s": 2.0},
)


def start_instance(target: str, role: str, ranks: int, name: str, **kwargs: Any) -> list[RankProcess]:
    """``ranks`` rank processes of one instance running ``target`` (``"_adapter_ranks:..._main"``), started.

    ``kwargs`` go to every rank (``spec``, ``secret``...); each process's start message is kept as ``p.info``.
    """
    from _instances import free_port

    port = free_port()
    procs = [
        RankProcess(
            target, name=f"{name}-{r}", kwargs={"role": role, "rank": r, "dist_port": port, **kwargs}, path=[HERE]
        )
        for r in range(ranks)
    ]
    for p in procs:
        p.info = p.recv(120, op="start")
    return procs


@dataclass
class Req:
    """A TensorRT-LLM ``LlmRequest`` as the adapter reads it (``kvcore.adapters.trtllm.LlmRequestLike``)."""

    request_id: int
    prompt_len: int
    block_ids: list[int]
    opaque_state: bytes | None = None


class _Engine:
    """One rank: pools, transceiver, and what the engine freed."""

    def __init__(self, channel: Channel, role: str, rank: int, spec: dict[str, Any], dist_port: int) -> None:
        import torch

        from kvcore.config import TransceiverConfig, create_agent
        from kvcore.control.collective import LocalCollective, TorchCollective
        from kvcore.testing.scenario import DemoSpec, Rank
        from kvcore.transceiver import Transceiver

        torch.set_num_threads(1)
        self.channel, self.role, self.rank = channel, role, rank
        self.spec = DemoSpec(**spec)
        tp, pp, _, _ = self.spec.side(role)
        self.dist = None
        if tp * pp > 1:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{dist_port}",
                rank=rank,
                world_size=tp * pp,
                timeout=datetime.timedelta(seconds=120),
            )
            self.dist = dist
            collective: Any = TorchCollective()
        else:
            collective = LocalCollective()
        config = TransceiverConfig.load(backend=self.spec.backend, **self.spec.config_overrides(role))
        self.agent = create_agent(config, f"{role}-{rank}-{os.getpid()}")
        self.me = Rank(role, rank, self.spec, self.agent)
        self.tx = Transceiver(
            config,
            role=role,
            agent=self.agent,
            topology=self.me.topology,
            geometry=self.me.geometry,
            page_table=self.me.page_table,
            collective=collective,
            instance_name=f"{role}-{os.getpid()}",
        )
        self.freed: set[int] = set()
        self.unsafe: list[str] = []  # frees the adapter allowed while kvcore still held the request

    def blocks(self, r: int) -> list[int]:
        return [int(b) for b in self.me.blocks[r]]

    def free(self, r: int, why: str) -> None:
        """The engine reuses the request's blocks at once (the sentinel stands for the next request's KV)."""
        import torch

        if self.tx.status(r) is not None:
            self.unsafe.append(f"request {r} freed ({why}) while kvcore holds it as {self.tx.status(r)}")
        self.me.caches.index_fill_(0, torch.as_tensor(self.blocks(r)), SENTINEL)
        self.freed.add(r)

    def op_verify(self, r: int) -> dict[str, Any]:
        bad, nbytes, first = self.me.verify(r, True)
        return {"bad": bad, "nbytes": nbytes, "first": first}

    def op_sentinels(self) -> dict[str, Any]:
        """Freed requests whose blocks no longer hold the sentinel (a write landed after the free)."""
        import torch

        broken = [
            r
            for r in sorted(self.freed)
            if not bool((self.me.caches[torch.as_tensor(self.blocks(r))] == SENTINEL).all())
        ]
        return {"broken": broken, "unsafe": self.unsafe, "leaks": self.tx.leaks()}

    def close(self) -> None:
        self.tx.close()
        self.agent.close()
        if self.dist is not None:
            self.dist.destroy_process_group()


class _Trt(_Engine):
    """TensorRT-LLM's executor on one rank, through ``KvcoreCacheTransceiver``."""

    def __init__(self, *args: Any, secret: bytes) -> None:
        from kvcore.adapters.trtllm import KvcoreCacheTransceiver

        super().__init__(*args)
        self.ad = KvcoreCacheTransceiver(self.tx, ticket_secret=secret)
        self.reqs: dict[int, Req] = {}
        self.checked: list[int] = []

    def op_step(
        self, new: list[Any], cancels: list[int], at_least: int | None = 0, verify: bool = True
    ) -> dict[str, Any]:
        """One executor iteration: start ``new`` requests, cancel ``cancels``, check the transfer status."""
        out: dict[str, Any] = {"opaque": [], "cancel": []}
        ctx = self.role == "context"
        for item in new:
            if ctx:
                r = int(item)
                self.me.fill(r)
                req = Req(r, self.spec.tokens, self.blocks(r))
                self.ad.respond_and_send_async(req)
                out["opaque"].append([r, req.opaque_state])
            else:
                r, opaque = int(item[0]), bytes(item[1])
                req = Req(r, self.spec.tokens, self.blocks(r), opaque)
                self.ad.request_and_receive_async(req)
            self.reqs[r] = req
        for r in cancels:
            ok = self.ad.cancel_request(self.reqs.get(r) or Req(r, self.spec.tokens, self.blocks(r)))
            out["cancel"].append([r, ok])
            if ok:
                self.free(r, "cancel_request returned True")
        st = self.ad.check_context_transfer_status(at_least) if ctx else self.ad.check_gen_transfer_status(at_least)
        out["completed"], out["cancelled"] = st.completed, st.cancelled
        out["failed"] = [[r, type(st.errors[r]).__name__ if r in st.errors else ""] for r in st.failed]
        out["verified"] = []
        for r in st.completed:
            if not ctx and verify:
                v = self.op_verify(r)
                out["verified"].append([r, v["bad"], v["nbytes"], v["first"]])
        for r in st.all:
            self.free(r, "reported by a status check")
        out["pending"] = len(self.ad.pending())
        return out


def trt_rank_main(channel: Channel, role: str, rank: int, spec: dict[str, Any], dist_port: int, secret: bytes) -> None:
    eng = _Trt(channel, role, rank, spec, dist_port, secret=secret)
    channel.send({"endpoint": eng.tx.info_endpoint, "pid": os.getpid()})
    try:
        serve(channel, eng)
    finally:
        eng.close()


class _SGLang(_Engine):
    """SGLang's prefill or decode scheduler on one rank, through ``KvcoreKVManager``/``KVSender``/``KVReceiver``."""

    def __init__(self, *args: Any, secret: bytes, ctx_endpoint: str) -> None:
        from kvcore.adapters.sglang import KvcoreKVManager

        super().__init__(*args)
        # SGLang's metadata buffers: one row per request of 8 int32 (output token id and friends).
        self.meta = np.zeros((self.spec.requests, 8), dtype=np.int32)
        self.kv_args = type("KVArgs", (), {})()
        self.kv_args.aux_data_ptrs = [int(self.meta.ctypes.data)]
        self.kv_args.aux_data_lens = [int(self.meta.nbytes)]
        self.kv_args.aux_item_lens = [int(self.meta[0].nbytes)]
        mode = "prefill" if self.role == "context" else "decode"
        self.mgr = KvcoreKVManager(
            self.kv_args, mode, None, transceiver=self.tx, ticket_secret=secret, endpoint_of=lambda addr: ctx_endpoint
        )
        self.queue: dict[int, Any] = {}  # room -> sender / receiver, in SGLang's queue order

    def op_step(
        self,
        new: list[int],
        aborts: list[int],
        hold: list[int] | None = None,
        meta: list[int] | None = None,
        verify: bool = True,
    ) -> dict[str, Any]:
        """One scheduler iteration: new requests (prefill: sender, init and a chunked send; decode: receiver and
        init, then send_metadata unless held), held requests' send_metadata, aborts, then every queued request
        polled in queue order (what SGLang's poll_and_all_reduce does on every rank)."""
        from kvcore.adapters.sglang import POLL_NAMES, KvcoreKVReceiver, KvcoreKVSender, KVPoll

        ctx = self.role == "context"
        for r in new:
            if ctx:
                self.me.fill(r)
                self.meta[r] = np.arange(8, dtype=np.int32) + 1000 * r  # the first output token and friends
                s: Any = KvcoreKVSender(self.mgr, "127.0.0.1:8998", r)
                s.init(len(self.blocks(r)), aux_index=r)
                blocks = self.blocks(r)
                half = len(blocks) // 2
                tpb = self.spec.tokens_per_block
                s.send(np.asarray(blocks[:half], dtype=np.int32), num_kv_tokens=half * tpb)  # chunked prefill
                s.send(np.asarray(blocks[half:], dtype=np.int32), num_kv_tokens=self.spec.tokens - half * tpb)
            else:
                self.meta[r] = -1
                s = KvcoreKVReceiver(self.mgr, "127.0.0.1:8998", r)
                s.init(prefill_dp_rank=0)
                if r not in (hold or ()):
                    s.send_metadata(np.asarray(self.blocks(r), dtype=np.int32), aux_index=r)
            self.queue[r] = s
        for r in meta or ():
            self.queue[r].send_metadata(np.asarray(self.blocks(r), dtype=np.int32), aux_index=r)
        for r in aborts:
            if r in self.queue:
                self.queue[r].abort()
        out: dict[str, Any] = {"success": [], "failed": [], "verified": [], "states": {}}
        for r, s in list(self.queue.items()):
            v = s.poll()
            out["states"][r] = POLL_NAMES[v]
            if v in (KVPoll.Success, KVPoll.Failed):
                if v == KVPoll.Success:
                    out["success"].append(r)
                    if not ctx and verify:
                        ver = self.op_verify(r)
                        meta_ok = self.meta[r].tolist() == [1000 * r + i for i in range(8)]
                        out["verified"].append([r, ver["bad"], ver["nbytes"], ver["first"], meta_ok])
                else:
                    try:
                        s.failure_exception()
                        err, why = "", ""
                    except Exception as exc:
                        err, why = type(exc).__name__, str(exc)
                    out["failed"].append([r, err])
                    out.setdefault("why", {})[r] = why
                    if not ctx and not s.is_abort_release_safe():
                        self.unsafe.append(f"request {r} Failed but is_abort_release_safe() is False")
                self.free(r, f"KVPoll {POLL_NAMES[v]}")
                s.clear()
                del self.queue[r]
        out["pending"] = len(self.queue)
        out["polls"] = self.mgr.polls
        return out


def sglang_rank_main(
    channel: Channel, role: str, rank: int, spec: dict[str, Any], dist_port: int, secret: bytes, ctx_endpoint: str
) -> None:
    eng = _SGLang(channel, role, rank, spec, dist_port, secret=secret, ctx_endpoint=ctx_endpoint)
    channel.send({"endpoint": eng.tx.info_endpoint, "pid": os.getpid()})
    try:
        serve(channel, eng)
    finally:
        eng.close()
