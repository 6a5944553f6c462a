"""``KvcoreConnector``: a vLLM V1 KV connector that moves disaggregated-prefill KV with kvcore.

Load it with ``--kv-transfer-config '{"kv_connector": "KvcoreConnector",
"kv_connector_module_path": "kvcore_vllm.connector", "kv_role": "kv_producer"
| "kv_consumer", "kv_connector_extra_config": {"backend": "nixl", ...}}'``.

How a request flows (pull, the default: the decode instance reads the prefill
instance's blocks as soon as it allocated its own; ``"mode": "push"`` in
``kv_connector_extra_config`` makes the prefill write them instead):

* prefill scheduler, ``request_finished``: keeps the blocks (returns True) and
  returns ``kv_transfer_params`` carrying kvcore's :class:`kvcore.TransferParams`
  (a fresh ticket; in pull mode with the prefill's block ids and incarnation).
  The worker's ``start_send`` with those parameters comes **early** for the
  common request (``do_remote_decode`` with ``max_tokens`` 1): the parameters
  are made in ``build_connector_meta`` of the step that computes the prompt's
  last token, and that step's own metadata tells the worker to send, after
  the forward. Otherwise, vLLM's scheduling one step ahead (async scheduling,
  on by default) puts it in the metadata of the step after the next, a whole
  forward later, and the decode waits for it: its read ends at once, but the
  prefill confirms it only once ``start_send`` came (issue 26's 16 MiB
  measurement). A request announced early and then aborted or preempted is
  cancelled on the worker, and vLLM is told it finished sending only after
  ``request_finished`` returned True for it (``update_connector_output``).
* decode scheduler: ``get_num_new_matched_tokens`` reports the prompt tokens
  from the parameters as an asynchronous load; a request that then waits for
  blocks is *expected* (its worker calls ``Transceiver.expect``, which renews
  the prefill's lease on it); ``update_state_after_alloc`` records the blocks
  allocated, and the worker's ``start_load_kv`` calls
  ``start_receive(params=..., block_ids=...)``.
* both workers: ``get_transfer_results`` polls this rank's transceiver
  (``poll_local``; vLLM's KVOutputAggregator combines the workers) and reports
  a request only once kvcore released it: finished sending (the prefill frees
  its blocks), finished receiving (the decode schedules it), with failed
  receives also in ``failed_recving`` and their blocks in
  ``get_block_ids_with_load_errors``.

kvcore's request id is the prefill's vLLM request id, carried in the parameters;
the decode request has an id of its own (vLLM appends a random suffix to every
request id), mapped to it by :class:`kvcore_vllm.engine_api.KvcoreEngine`.
A load that cannot happen is never silent: it is logged at WARNING with its
reason, counted (``load_failures_<reason>`` in the connector stats, vLLM's
``vllm:kvcore_load_failures`` Prometheus counter and, with ``metrics_port``,
kvcore's own export), and vLLM's ``kv_load_failure_policy`` decides: ``fail``
(vLLM's default) fails the request, ``recompute`` computes the prompt locally.
Only the worker side talks to kvcore
(through :mod:`kvcore_vllm.engine_api`); the scheduler side learns the prefill
instance's endpoint and incarnation from the workers' handshake metadata, as
vLLM's NIXL connector does.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvcore.config import create_agent
from kvcore.errors import ConfigError, KvcoreError
from kvcore.layout.topology import Topology
from kvcore.params import TransferParams
from kvcore_vllm.engine_api import (
    COUNTERS,
    PARAMS_KEY,
    InvalidTransferParamsError,
    KvcoreEngine,
    LoadFailure,
    parse_params,
)
from kvcore_vllm.layout import KvDescription, describe_kv_caches
from kvcore_vllm.options import connector_options, transceiver_role

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvcore.transport.agent import TransferAgent

__all__ = [
    "KvcoreConnector",
    "KvcoreConnectorMetadata",
    "KvcoreConnectorStats",
    "KvcoreHandshakeMetadata",
    "KvcorePromMetrics",
    "RecvSpec",
    "SendSpec",
]

log = logging.getLogger("kvcore_vllm.connector")


@dataclass
class SendSpec:
    """Prefill side: send the request's KV from ``block_ids`` (token order) to holders of ``params``' ticket."""

    params: dict[str, Any]  # kvcore.TransferParams.to_dict(), as returned to the router
    block_ids: list[int]
    prompt_len: int
    early: bool = False  # started in the step computing the prompt's last token (before request_finished)


@dataclass
class RecvSpec:
    """Decode side: receive the request described by ``params`` (TransferParams.to_dict()) into ``block_ids``."""

    params: dict[str, Any]
    block_ids: list[int]
    num_tokens: int = 0  # the prompt tokens the load brings (beyond the local prefix-cache hit)
    cached_tokens: int = 0  # the local prefix-cache hit: leading prompt tokens this engine holds already


@dataclass
class FailSpec:
    """Decode side, policy ``fail``: the scheduler refused the parameters; report the load failed into these blocks."""

    error: str
    block_ids: list[int]


@dataclass
class KvcoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: the sends, expectations, receives and drops to start.

    Every ``params`` value is kvcore's ``TransferParams.to_dict()`` (checked by the scheduler side).
    """

    sends: dict[str, SendSpec] = field(default_factory=dict)
    cancels: dict[str, str] = field(default_factory=dict)  # prefill: sends started early, given up: the reason
    expects: dict[str, dict[str, Any]] = field(default_factory=dict)  # decode requests waiting for blocks
    recvs: dict[str, RecvSpec] = field(default_factory=dict)
    drops: dict[str, dict[str, Any]] = field(default_factory=dict)  # decode requests that will never load
    fails: dict[str, FailSpec] = field(default_factory=dict)  # refused parameters, policy fail
    fallbacks: dict[str, str] = field(default_factory=dict)  # refused parameters, policy recompute: the reason


@dataclass
class KvcoreHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: where this rank's kvcore transceiver listens."""

    info_endpoint: str  # the instance's rank 0 (the one a decode instance contacts first)
    endpoint: str  # this rank's own control endpoint
    instance_name: str
    incarnation: str  # this rank's process incarnation (rank 0's goes into pull-mode parameters)


@dataclass
class KvcoreConnectorStats(KVConnectorStats):
    """kvcore's outcomes, bytes and loads in one interval, summed over workers and steps (vLLM logs ``reduce()``).

    Keys (:data:`kvcore_vllm.engine_api.COUNTERS`): ``transfers_done``, ``transfers_failed``,
    ``transfers_cancelled``, ``bytes_moved``, ``tokens_loaded`` (prompt tokens loaded over kvcore on the decode
    side), ``sends_started`` and ``sends_started_early`` (prefill side) and ``load_failures_<reason>`` for each
    :class:`~kvcore_vllm.engine_api.LoadFailure` (per worker: a request whose load failed on both ranks of a TP2
    decode counts twice; refused parameters count once).
    """

    def __post_init__(self) -> None:
        for key in COUNTERS:
            self.data.setdefault(key, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in COUNTERS:
            self.data[key] = int(self.data.get(key, 0)) + int(other.data.get(key, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: int(self.data.get(key, 0)) for key in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(key, 0) for key in COUNTERS)


class KvcorePromMetrics(KVConnectorPromMetrics):
    """vLLM's Prometheus metrics for the connector (on vLLM's ``/metrics``), fed from :class:`KvcoreConnectorStats`.

    ``vllm:kvcore_load_failures_total{reason}``, ``vllm:kvcore_tokens_loaded_total``,
    ``vllm:kvcore_transfers_total{outcome}`` and ``vllm:kvcore_bytes_moved_total``, each with vLLM's engine labels.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls

        def per_engine(metric: Any, *extra: str) -> dict[int, Any]:
            return {i: metric.labels(*values, *extra) for i, values in per_engine_labelvalues.items()}

        failures = counter(
            name="vllm:kvcore_load_failures",
            documentation="Decode requests whose KV kvcore did not load, by reason (recomputed or failed per "
            "kv_load_failure_policy).",
            labelnames=[*labelnames, "reason"],
        )
        transfers = counter(
            name="vllm:kvcore_transfers",
            documentation="kvcore requests ended on this instance's workers, by outcome (summed over workers).",
            labelnames=[*labelnames, "outcome"],
        )
        self._counters: dict[str, dict[int, Any]] = {
            f"load_failures_{r.value}": per_engine(failures, r.value) for r in LoadFailure
        }
        for outcome in ("done", "failed", "cancelled"):
            self._counters[f"transfers_{outcome}"] = per_engine(transfers, outcome)
        for key, name, doc in (
            ("tokens_loaded", "vllm:kvcore_tokens_loaded", "Prompt tokens loaded over kvcore (decode side)."),
            ("bytes_moved", "vllm:kvcore_bytes_moved", "Bytes of KV kvcore moved (summed over workers)."),
            ("sends_started", "vllm:kvcore_sends_started", "Sends kvcore started (prefill side, summed over workers)."),
            (
                "sends_started_early",
                "vllm:kvcore_sends_started_early",
                "Of those, sends started in the step that computed the prompt's last token, before the request "
                "finished in vLLM (prefill side).",
            ),
        ):
            self._counters[key] = per_engine(counter(name=name, documentation=doc, labelnames=labelnames))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, children in self._counters.items():
            value = int(transfer_stats_data.get(key, 0) or 0)
            if value > 0:
                children[engine_idx].inc(value)


class _AgentAllocation:
    """Inside vLLM's KV allocation: answer the zeroed int8 CPU buffer it makes with the agent's own memory.

    A ``TorchFunctionMode`` (entered for the duration of vLLM's ``allocate_kv_cache`` only) that replaces
    ``torch.zeros(n, dtype=torch.int8)`` on the CPU by :meth:`KvcoreConnector.allocate_kv_backing`; every
    other call goes through unchanged.
    """

    def __init__(self, connector: KvcoreConnector) -> None:
        self._connector = connector
        self._mode: Any = None

    def __enter__(self) -> _AgentAllocation:
        import torch
        from torch.overrides import TorchFunctionMode

        connector = self._connector

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if func is torch.zeros and kwargs.get("dtype") is torch.int8 and len(args) == 1:
                    device = torch.device(kwargs.get("device") or "cpu")
                    size = args[0]
                    n = size if isinstance(size, int) else (size[0] if len(size) == 1 else None)
                    if device.type == "cpu" and isinstance(n, int):
                        return connector.allocate_kv_backing(n)
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        self._mode = None


class KvcoreConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector on kvcore; ``kv_role`` ``kv_producer`` (prefill) or ``kv_consumer`` (decode)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self._kvcore_role = transceiver_role(ktc.kv_role)
        options = connector_options(ktc.kv_connector_extra_config)
        self._config = options.config
        self._metrics_port = options.metrics_port
        self._metrics_server: Any = None
        self._mode = self._config.transfer_mode
        # vLLM's own option decides what a failed load does, also when the parameters are refused here.
        self._recompute_failures = getattr(ktc, "kv_load_failure_policy", "fail") == "recompute"
        self._engine_id: str = ktc.engine_id or ""
        self._block_size: int = vllm_config.cache_config.block_size
        # Scheduler side.
        self._info_endpoint: str | None = None
        self._incarnation: str = ""
        self._sends: dict[str, SendSpec] = {}
        self._recvs: dict[str, RecvSpec] = {}
        self._drops: dict[str, dict[str, Any]] = {}
        self._waiting: dict[str, dict[str, Any]] = {}  # decode: matched this step, maybe not allocated
        self._expected: set[str] = set()  # decode: expect() sent to the workers, receive not yet started
        self._refused: dict[str, str] = {}  # decode, policy fail: parameters refused, the reason (until finished)
        self._fails: dict[str, FailSpec] = {}
        self._fallbacks: dict[str, str] = {}
        # Prefill: early sends (see the module docstring). Every entry is removed at request_finished or preemption.
        self._candidates: dict[str, Request] = {}  # do_remote_decode, max_tokens 1, its last prompt token not scheduled
        self._tracked_blocks: dict[str, list[int]] = {}  # a candidate's blocks, from the scheduler outputs
        self._announced: dict[str, tuple[TransferParams, list[int]]] = {}  # sent early, request_finished not yet
        self._released_early: set[str] = set()  # announced, and kvcore let go before request_finished
        self._revoked: set[str] = set()  # announced, then preempted: its finished_sending is not vLLM's to see
        self._delayed: set[str] = set()  # request_finished returned True: vLLM waits for its finished_sending
        self._cancels: dict[str, str] = {}
        # Worker side.
        self._agent: TransferAgent | None = None
        self._engine: KvcoreEngine | None = None
        self._description: KvDescription | None = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.WORKER:
            tp = vllm_config.parallel_config.tensor_parallel_size
            self._tp_rank = self._worker_tp_rank(vllm_config)
            name = f"vllm-{self._engine_id[:8]}-{self._kvcore_role}-tp{self._tp_rank}-{os.getpid()}"
            self._agent = create_agent(self._config, agent_name=name)
            log.info(
                "kvcore %s worker (tp %d/%d) on backend %s", self._kvcore_role, self._tp_rank, tp, self._agent.backend
            )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: kvcore registers the KV memory once, for the transceiver's lifetime (no unregister/restore yet)."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Prefer head-major pages (``LBHNC``): re-sharding between TP sizes then moves whole heads, not tokens.

        vLLM drops the preference (with a warning) when the attention backend cannot use it; every
        page-contiguous layout works (see kvcore_vllm.layout).
        """
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    @staticmethod
    def _worker_tp_rank(vllm_config: VllmConfig) -> int:
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise ConfigError(
                f"pipeline_parallel_size: KvcoreConnector supports 1 for now, got {pc.pipeline_parallel_size}"
            )
        if pc.tensor_parallel_size == 1:
            return 0
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)

    # ==============================================================================================
    # Worker side
    # ==============================================================================================

    def get_mem_pool_context(self) -> Any:
        """vLLM's KV cache allocation runs inside this: its one backing buffer comes from this rank's agent.

        vLLM allocates the KV cache as one zeroed int8 buffer (``torch.zeros(n, dtype=torch.int8)``) inside the
        context its connector returns here. The connector answers that allocation with
        :meth:`allocate_kv_backing`, so the ``shm`` backend (which exposes only memory its agent allocated) works
        in a real engine; NIXL and UCX get an ordinary buffer. CUDA allocations are left alone.
        """
        if self._agent is None:
            return None
        return _AgentAllocation(self)

    def allocate_kv_backing(self, nbytes: int) -> torch.Tensor:
        """A zeroed int8 buffer of ``nbytes`` this rank's transfer agent can expose to peers.

        Decode instances on the ``shm`` backend must keep their KV in such memory
        (the shm agent only exports its own segments); NIXL and UCX register any
        memory. vLLM allocates its KV itself, so the shm backend serves engines
        that let the connector allocate; ``vllm serve`` needs nixl or ucx.
        """
        import torch

        if self._agent is None:
            raise ConfigError("allocate_kv_backing: only the worker-side connector has a transfer agent")
        return self._agent.allocate_tensor((nbytes,), torch.int8)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe vLLM's KV views to kvcore and start this rank's transceiver."""
        from kvcore.control.collective import LocalCollective, TorchCollective
        from kvcore.transceiver import Transceiver

        assert self._agent is not None
        vc = self._vllm_config
        pc = vc.parallel_config
        topology = Topology.create(
            tp_size=pc.tensor_parallel_size,
            pp_size=1,
            rank=self._tp_rank,
            num_layers=vc.model_config.get_total_num_hidden_layers(),
        )
        self._description = describe_kv_caches(
            kv_caches,
            topology=topology,
            num_kv_heads=vc.model_config.get_total_num_kv_heads(),
            head_size=vc.model_config.get_head_size(),
            block_size=self._block_size,
        )
        collective: Any = LocalCollective()
        if pc.tensor_parallel_size > 1:
            # The ranks exchange their RankInfo once at start-up over the TP group's CPU (gloo) group; per step
            # each rank polls on its own (poll_local) and vLLM's KVOutputAggregator combines the workers.
            from vllm.distributed.parallel_state import get_tp_group

            collective = TorchCollective(get_tp_group().cpu_group)
        d = self._description
        # Where the KV lives decides how the agent registers it (DRAM or VRAM).
        first = next(iter(kv_caches.values()))
        device = f"cuda:{first.device.index or 0}" if first.device.type == "cuda" else "cpu"
        tx = Transceiver(
            self._config,
            role=self._kvcore_role,
            agent=self._agent,
            topology=d.topology,
            geometry=d.geometry,
            page_table=d.page_table,
            collective=collective,
            # Unique per vLLM engine: DP engines of one deployment may share the engine id.
            instance_name=f"vllm-{self._engine_id}-dp{pc.data_parallel_index}",
            device=device,
        )
        self._engine = KvcoreEngine(tx, rank=self._tp_rank)
        if self._metrics_port is not None:
            from prometheus_client import CollectorRegistry

            from kvcore.metrics import serve_metrics
            from kvcore_vllm.engine_api import EngineCollector

            registry = CollectorRegistry()
            registry.register(EngineCollector(self._engine))
            port = self._metrics_port + self._tp_rank
            self._metrics_server = serve_metrics(port, host=self._config.host, registry=registry)
            log.info("kvcore metrics on http://%s:%d/metrics", self._config.host, port)
        log.info(
            "kvcore %s: %d layers, %s pages, info endpoint %s",
            self._kvcore_role,
            len(d.layer_names),
            d.kind,
            tx.info_endpoint,
        )

    @property
    def kv_description(self) -> KvDescription | None:
        """How this rank's KV was described to kvcore (after ``register_kv_caches``)."""
        return self._description

    @property
    def engine(self) -> KvcoreEngine | None:
        """The kvcore adapter of this worker (after ``register_kv_caches``)."""
        return self._engine

    def get_handshake_metadata(self) -> KvcoreHandshakeMetadata | None:
        if self._engine is None:
            return None
        tx = self._engine.transceiver
        return KvcoreHandshakeMetadata(
            info_endpoint=tx.info_endpoint,
            endpoint=tx.endpoint,
            instance_name=tx.instance_name,
            incarnation=tx.incarnation,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's sends (prefill), expectations, receives and drops (decode); all asynchronous."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcoreConnectorMetadata)
        engine = self._require_engine()
        for name, send in meta.sends.items():
            engine.send(name, send.block_ids, send.prompt_len, TransferParams.from_dict(send.params), early=send.early)
        for name, why in meta.cancels.items():
            engine.cancel(name, why)  # reported in finished_sending once kvcore released it
        # The scheduler side parsed every decode parameter already (parse_params): these cannot fail.
        for name, raw in meta.expects.items():
            engine.expect(name, TransferParams.from_dict(raw))
        for name, recv in meta.recvs.items():
            engine.receive(
                name, TransferParams.from_dict(recv.params), recv.block_ids, recv.num_tokens, recv.cached_tokens
            )
        for name, raw in meta.drops.items():
            engine.drop(name, TransferParams.from_dict(raw) if raw else None, "the decode instance dropped it")
        for name, fail in meta.fails.items():
            engine.fail_load(name, fail.block_ids, InvalidTransferParamsError(fail.error))
        for name, why in meta.fallbacks.items():
            engine.note_fallback(name, why)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """kvcore reads the KV from vLLM's blocks after the request finished: nothing to save per layer."""

    def wait_for_save(self) -> None:
        """Nothing to save: sends start from the blocks themselves."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Poll kvcore; report requests it released. Cancels the receives of requests vLLM finished (aborts)."""
        engine = self._require_engine()
        if engine.role == "generation":
            meta = self._connector_metadata
            # An id in finished_req_ids that this step's metadata starts is a reused id: the finished one is gone.
            started = set(meta.recvs) | set(meta.expects) if isinstance(meta, KvcoreConnectorMetadata) else set()
            for name in finished_req_ids - started:
                if engine.is_waited_for(name):
                    engine.cancel(name, "request finished (aborted) on the decode instance")
        r = engine.poll()  # logs each failed load once, with its reason
        if len(self._kv_cache_config.kv_cache_groups) == 1:
            # Block ids are unique only within one KV cache group; vLLM refuses block-level errors otherwise.
            self._load_errors |= r.failed_block_ids
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=set(r.failed_recving),
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_kv_connector_stats(self) -> KvcoreConnectorStats | None:
        """This worker's kvcore outcomes and bytes since the last call (None on the scheduler side or when idle)."""
        if self._engine is None:
            return None
        stats = KvcoreConnectorStats(data=dict(self._engine.take_counters()))
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvcoreConnectorStats:
        return KvcoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvcorePromMetrics:
        return KvcorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of receives that failed, reported in the same step as their request's finished_recving."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    def _require_engine(self) -> KvcoreEngine:
        if self._engine is None:
            raise KvcoreError("KvcoreConnector: register_kv_caches was not called on this worker")
        return self._engine

    # ==============================================================================================
    # Scheduler side
    # ==============================================================================================

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Learn the instance's kvcore info endpoint (every rank reports the same one: its rank 0's)."""
        if not metadata:
            raise ConfigError("handshake metadata: expected one entry per worker, got none")
        md = metadata.get(0) or next(iter(metadata.values()))
        if not isinstance(md, KvcoreHandshakeMetadata):
            raise ConfigError(f"handshake metadata: expected KvcoreHandshakeMetadata, got {type(md).__name__}")
        self._info_endpoint = md.info_endpoint
        self._incarnation = md.incarnation

    def _remote_params(self, request: Request) -> TransferParams | None:
        """Decode side: the request's kvcore parameters if it is to load its prompt's KV remotely, else None.

        Refused parameters are a load failure (:data:`LoadFailure.INVALID_PARAMS`), never a silent local prefill:
        with ``kv_load_failure_policy`` ``recompute`` the prompt is computed here (the worker logs and counts
        it); with ``fail`` the request is remembered in ``_refused`` and fails once vLLM allocated it.
        """
        params = request.kv_transfer_params
        if self._kvcore_role != "generation" or not params or not params.get("do_remote_prefill"):
            return None
        try:
            return parse_params(params)
        except InvalidTransferParamsError as exc:
            rid = request.request_id
            if self._recompute_failures:
                params["do_remote_prefill"] = False
                self._fallbacks[rid] = str(exc)
            else:
                self._refused.setdefault(rid, str(exc))
            return None

    def on_new_request(self, request: Request) -> None:
        """Decode side: a remote request arrived; expect it (renew the prefill's lease) unless allocated this step.

        vLLM considers only the head of its waiting queue while blocks are short, so a request queued behind it
        would not reach ``get_num_new_matched_tokens`` for a while: it is announced here, on arrival.
        """
        self._note_candidate(request)
        tp = self._remote_params(request)
        if tp is not None and request.request_id not in self._expected:
            self._waiting[request.request_id] = tp.to_dict()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode side: the prompt tokens the prefill instance holds beyond the local prefix, loaded asynchronously."""
        self._note_candidate(request)
        tp = self._remote_params(request)
        if tp is None:
            if request.request_id in self._refused:
                # Policy fail: claim the uncached prompt as a load that will fail, so vLLM fails the request.
                count = len(request.prompt_token_ids or ()) - num_computed_tokens
                return (count, True) if count > 0 else (0, False)
            return 0, False
        count = min(tp.prompt_len, len(request.prompt_token_ids or ())) - num_computed_tokens
        if count <= 0:
            return 0, False
        if request.request_id not in self._expected:
            # Expected unless allocated in this same step (update_state_after_alloc takes it back out).
            self._waiting[request.request_id] = tp.to_dict()
        return count, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Decode side: remember the blocks allocated for the remote tokens; the worker starts the receive."""
        params = request.kv_transfer_params
        rid = request.request_id
        tp = self._remote_params(request)
        if tp is None or params is None:
            refused = self._refused.pop(rid, None)
            if refused is not None and params is not None:
                params["do_remote_prefill"] = False
                self._fails[rid] = FailSpec(error=refused, block_ids=blocks.get_unhashed_block_ids())
            return
        self._waiting.pop(rid, None)
        self._expected.discard(rid)
        # One transfer per request, even if vLLM calls this again (after the load, or on preemption).
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            # Nothing to load (the local prefix cache covers the prompt): let the prefill free its blocks now.
            self._drops[rid] = tp.to_dict()
            return
        # The load fills what get_num_new_matched_tokens counted: the prompt beyond the local prefix-cache hit, which
        # kvcore is told (cached_tokens) so that it knows the unhashed blocks are a suffix, not a short allocation.
        prompt = min(tp.prompt_len, len(request.prompt_token_ids or ()))
        self._recvs[rid] = RecvSpec(
            params=tp.to_dict(),
            block_ids=blocks.get_unhashed_block_ids(),
            num_tokens=num_external_tokens,
            cached_tokens=max(0, prompt - num_external_tokens),
        )

    # --- prefill: early sends ------------------------------------------------------------------------

    def _note_candidate(self, request: Request) -> None:
        """Prefill side: a request whose send may start in the step that computes its last prompt token.

        Only ``do_remote_decode`` requests with ``max_tokens`` 1 (what a disaggregating proxy sends): they
        finish in that step for certain unless aborted or preempted, both of which cancel the early send.
        """
        params = request.kv_transfer_params
        rid = request.request_id
        if (
            self._kvcore_role != "context"
            or not params
            or not params.get("do_remote_decode")
            or rid in self._announced
            or rid in self._revoked
            or getattr(request.sampling_params, "max_tokens", None) != 1
        ):
            return
        self._candidates.setdefault(rid, request)

    def _forget_candidate(self, rid: str) -> None:
        self._candidates.pop(rid, None)
        self._tracked_blocks.pop(rid, None)

    def _announce_sends(self, out: SchedulerOutput) -> None:
        """Prefill side: start the send of each candidate whose last prompt token this step computes.

        Its blocks are followed from the scheduler outputs (vLLM's own record of what the worker sees); a
        preempted or resumed candidate is given up, and a preempted announced one is cancelled.
        """
        cached = out.scheduled_cached_reqs
        for rid in set(out.preempted_req_ids or ()) | set(getattr(cached, "resumed_req_ids", ()) or ()):
            self._forget_candidate(rid)
            if self._announced.pop(rid, None) is not None:
                self._revoked.add(rid)
                self._cancels[rid] = "preempted after its send was started"
        if not self._candidates:
            return
        steps: list[tuple[str, int]] = []
        for new in out.scheduled_new_reqs:
            if new.req_id in self._candidates:
                if len(new.block_ids) != 1:  # more than one KV cache group: request_finished's path
                    self._forget_candidate(new.req_id)
                    continue
                self._tracked_blocks[new.req_id] = list(new.block_ids[0])
                steps.append((new.req_id, new.num_computed_tokens))
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._candidates:
                continue
            if rid not in self._tracked_blocks:  # first seen as a cached request: its blocks are not known here
                self._forget_candidate(rid)
                continue
            grown = cached.new_block_ids[i]
            if grown is not None:
                if len(grown) != 1:
                    self._forget_candidate(rid)
                    continue
                self._tracked_blocks[rid].extend(grown[0])
            steps.append((rid, cached.num_computed_tokens[i]))
        for rid, computed in steps:
            request = self._candidates[rid]
            prompt_len = request.num_prompt_tokens
            if computed + out.num_scheduled_tokens.get(rid, 0) < prompt_len:
                continue
            blocks = self._tracked_blocks[rid][: -(-prompt_len // self._block_size)]
            self._forget_candidate(rid)
            if len(blocks) * self._block_size < prompt_len or self._info_endpoint is None:
                continue  # request_finished's path (it logs a missing endpoint)
            tp = self._make_params(rid, prompt_len, blocks)
            self._sends[rid] = SendSpec(params=tp.to_dict(), block_ids=blocks, prompt_len=prompt_len, early=True)
            self._announced[rid] = (tp, blocks)

    def _make_params(self, rid: str, prompt_len: int, block_ids: list[int]) -> TransferParams:
        assert self._info_endpoint is not None
        pull = self._mode == "pull"
        return TransferParams.make(
            rid,
            self._info_endpoint,
            mode="pull" if pull else "push",
            prompt_len=prompt_len,
            block_ids=block_ids if pull else (),
            incarnation=self._incarnation if pull else "",
            lease_ms=int(self._config.lease_s * 1000),  # the decode side renews at a third of this
        )

    def _router_params(self, rid: str, tp: TransferParams) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._engine_id,
            "remote_request_id": rid,
            PARAMS_KEY: tp.to_dict(),
        }

    def _finish_announced(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side, ``request_finished`` of a request whose send started early."""
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        tp, blocks = self._announced.pop(rid)
        released = rid in self._released_early
        self._released_early.discard(rid)
        finished = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if finished and list(block_ids[: len(blocks)]) == blocks:
            if released:
                # kvcore let go already (its lease ran out, or the send was refused): the decode that presents
                # these parameters is refused and says so; the blocks are vLLM's again.
                return False, self._router_params(rid, tp)
            self._delayed.add(rid)
            return True, self._router_params(rid, tp)
        if finished:
            log.error(
                "request %r: the blocks its send started with (%s...) are not the blocks it finished with (%s...); "
                "not sending it",
                rid,
                blocks[:4],
                list(block_ids[:4]),
            )
        if released:
            return False, None
        self._cancels[rid] = "the request did not finish its prefill" if not finished else "its blocks changed"
        self._delayed.add(rid)  # freed once kvcore released the cancelled send
        return True, None

    def update_connector_output(self, connector_output: Any) -> None:
        """Prefill side: pass vLLM a finished send only once ``request_finished`` returned True for it.

        A send started early can end (its lease ran out) before the request finished in vLLM, whose scheduler
        would then free the blocks of a running request.
        """
        done = connector_output.finished_sending
        if not done or self._kvcore_role != "context":
            return
        keep: set[str] = set()
        for name in done:
            if name in self._delayed:
                self._delayed.discard(name)
                keep.add(name)
            elif name in self._announced:
                self._released_early.add(name)
            elif name in self._revoked:
                self._revoked.discard(name)
            else:
                keep.add(name)
        connector_output.finished_sending = keep

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvcoreConnectorMetadata:
        if self._kvcore_role == "context":
            self._announce_sends(scheduler_output)
        expects, self._waiting = self._waiting, {}
        self._expected.update(expects)
        meta = KvcoreConnectorMetadata(
            sends=self._sends,
            cancels=self._cancels,
            expects=expects,
            recvs=self._recvs,
            drops=self._drops,
            fails=self._fails,
            fallbacks=self._fallbacks,
        )
        self._sends, self._recvs, self._drops, self._fails, self._fallbacks = {}, {}, {}, {}, {}
        self._cancels = {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: keep the blocks until kvcore released the send; return the parameters for the router."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        rid = request.request_id
        if self._kvcore_role == "generation":
            self._waiting.pop(rid, None)
            self._refused.pop(rid, None)
            expected = rid in self._expected
            self._expected.discard(rid)
            if params and params.get("do_remote_prefill"):
                # Finished (aborted) before it was allocated: it will not load, tell the prefill to free.
                params["do_remote_prefill"] = False
                try:
                    self._drops[rid] = parse_params(params).to_dict()
                except InvalidTransferParamsError:
                    if expected:
                        self._drops[rid] = {}  # just give the expectation up
            return False, None
        if self._kvcore_role != "context":
            return False, None
        self._forget_candidate(rid)
        if rid in self._announced:
            return self._finish_announced(request, block_ids)
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted before its prefill completed: nothing to send
        if not block_ids:
            return False, None
        if self._info_endpoint is None:
            log.error("request %r: no kvcore endpoint known (handshake metadata not set); not sending", rid)
            return False, None
        # The prompt's KV only: a request that generated more than one token here computed their KV too (and holds
        # a block for them), but the decode request carries the prompt alone and would refuse the rest.
        prompt_len = min(request.num_computed_tokens, request.num_prompt_tokens)
        blocks = list(block_ids)[: -(-prompt_len // self._block_size)]  # the blocks that hold the prompt
        tp = self._make_params(rid, prompt_len, blocks)
        self._sends[rid] = SendSpec(params=tp.to_dict(), block_ids=blocks, prompt_len=prompt_len)
        self._delayed.add(rid)
        return True, self._router_params(rid, tp)
