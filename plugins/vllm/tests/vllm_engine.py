"""A vLLM engine core without a model: vLLM's real Scheduler and the worker-side connector over real KV views.

What is real: ``VllmConfig`` from a tiny Llama config on disk, the
``Scheduler`` (which loads ``KvcoreConnector`` through vLLM's
``KVConnectorFactory`` from ``kv_connector_module_path``), vLLM's KV cache
planning (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``) and
views (``create_kv_cache_views``), the worker connector's lifecycle driven by
``KVConnectorModelRunnerMixin`` inside ``set_forward_context``, and the
handshake-metadata hand-off EngineCore does at start-up.

What stands in for the model: :meth:`Engine.forward` writes a deterministic
byte pattern (a function of request seed, layer and token position) into the
KV of the prompt tokens a prefill instance computes, and samples token 7.
The decode instance's forward writes nothing, so every prompt byte it holds
came through kvcore.

As a process it is a ``kvcore.runtime`` rank: the test starts
``RankProcess("vllm_engine:run", ...)`` and drives :class:`EngineRank` with
commands; events come back as messages, msgpack frames on the harness's pipe
(vLLM's own logging goes to a log file).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcore.runtime import Channel, serve

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16
BLOCK_SIZE = 16
SAMPLED_TOKEN = 7


def token_seed(seed: int, layer: int, pos: int) -> int:
    return (seed * 1_000_003 + layer * 10_007 + pos) & 0xFFFF_FFFF


def token_bytes(seed: int, layer: int, pos: int, nbytes: int) -> np.ndarray:
    """The KV bytes (all heads, K and V) the fake model writes for token ``pos`` of layer ``layer``."""
    return np.random.default_rng(token_seed(seed, layer, pos)).integers(0, 256, nbytes, dtype=np.uint8)


def write_model_dir(path: str) -> str:
    from transformers import LlamaConfig

    LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=NUM_KV_HEADS * 2 * HEAD_SIZE,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_KV_HEADS * 2,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_SIZE,
        vocab_size=1000,
        max_position_embeddings=2048,
    ).save_pretrained(path)
    return path


@dataclass
class EngineSpec:
    role: str  # "prefill" | "decode"
    backend: str
    layout: str = "LBHNC"
    num_blocks: int = 64
    engine_id: str = ""
    model_dir: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config
    shm_backing: bool = False  # allocate the KV through the connector's agent (shm decode side)
    kv_load_failure_policy: str = "fail"
    prefix_caching: bool = True
    tp_size: int = 1  # > 1: this process is TP rank tp_rank, with a scheduler replica (see Engine)
    tp_rank: int = 0
    dist_port: int = 0  # torch.distributed rendezvous (gloo) for tp_size > 1


class Engine:
    """One vLLM instance: scheduler, worker-side connector, KV views; ``step()`` is EngineCore.step.

    With ``tp_size > 1`` the process is one TP rank: vLLM's distributed state is initialized over gloo (as a
    CPU worker does) and the rank runs its own replica of the scheduler. Every rank gets the same commands,
    so the replicas decide identically. Each worker reports its own transfers (kvcore's per-rank
    ``poll_local``); every step the ranks exchange their ``KVConnectorOutput`` over the TP group and feed all
    of them to vLLM's real ``KVOutputAggregator``, as vLLM's executor does for its one scheduler, so every
    replica sees the same combined output.
    """

    def __init__(self, spec: EngineSpec) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.spec = spec
        model_dir = spec.model_dir or write_model_dir(tempfile.mkdtemp(prefix="kvcore-vllm-model-"))
        model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=1024)
        kv_role = "kv_producer" if spec.role == "prefill" else "kv_consumer"
        extra = {"backend": spec.backend, **spec.extra}
        self.vllm_config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(
                max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=1024, is_encoder_decoder=False
            ),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=spec.prefix_caching),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvcoreConnector",
                kv_connector_module_path="kvcore_vllm.connector",
                kv_role=kv_role,
                kv_connector_extra_config=extra,
                engine_id=spec.engine_id or None,
                kv_load_failure_policy=spec.kv_load_failure_policy,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=spec.tp_size),
            device_config=DeviceConfig("cpu"),
        )
        vc = self.vllm_config
        if spec.tp_size > 1:
            from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

            with set_current_vllm_config(vc):
                init_distributed_environment(
                    world_size=spec.tp_size,
                    rank=spec.tp_rank,
                    distributed_init_method=f"tcp://127.0.0.1:{spec.dist_port}",
                    local_rank=spec.tp_rank,
                    backend="gloo",
                )
                initialize_model_parallel(tensor_model_parallel_size=spec.tp_size)
        self.heads = NUM_KV_HEADS // spec.tp_size
        vc.cache_config.kv_cache_layout = spec.layout  # what the engine core's resolve_kv_cache_layout records
        specs = {
            f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=self.heads, head_size=HEAD_SIZE, dtype=torch.float32
            )
            for i in range(NUM_LAYERS)
        }
        groups = get_kv_cache_groups(vc, specs)
        page = groups[0].kv_cache_spec.page_size_bytes
        self.kv_cache_config = get_kv_cache_config_from_groups(vc, groups, page * NUM_LAYERS * spec.num_blocks)
        vc.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        # Worker side, as ensure_kv_transfer_initialized + initialize_kv_cache + register_kv_caches do it.
        self.worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, self.kv_cache_config)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        self.kv_caches = self._allocate_kv()
        self.worker.register_kv_caches(self.kv_caches)
        # Scheduler side, then the handshake hand-off EngineCore does (_set_kv_connector_handshake_metadata).
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        self.connector_stats: dict[str, int] = {}  # summed SchedulerStats.kv_connector_stats
        self.scheduler.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, spec.tp_rank): self.worker.get_handshake_metadata()}
        )
        self.token_nbytes = self.heads * 2 * HEAD_SIZE * 4
        self.outputs: dict[str, Any] = {}  # request id -> its final EngineCoreOutput
        self.seeds: dict[str, int] = {}
        self.aggregator: Any = None
        if spec.tp_size > 1:
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
            from vllm.distributed.parallel_state import get_tp_group

            from kvcore.control.collective import TorchCollective

            self.aggregator = KVOutputAggregator.from_connector(self.worker, spec.tp_size)
            self.tp_collective = TorchCollective(get_tp_group().cpu_group)

    def _allocate_kv(self) -> dict[str, Any]:
        import torch
        from vllm.v1.kv_cache_interface import create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        layout = KVCacheLayout[self.spec.layout]
        kcc = self.kv_cache_config
        if not self.spec.shm_backing:
            return allocate_kv_cache(kcc, torch.device("cpu"), layout)
        # vLLM's allocate_kv_cache, with the backing buffer from the connector's agent instead of torch.zeros.
        (size,) = {t.size for t in kcc.kv_cache_tensors}
        raw = self.worker.allocate_kv_backing(size)
        views: dict[str, Any] = {}
        for tensor in kcc.kv_cache_tensors:
            spec = kcc.kv_cache_groups[0].kv_cache_spec
            views.update(
                zip(tensor.layers, create_kv_cache_views(raw, spec, kcc.num_blocks_of(tensor), layout, tensor))
            )
        return views

    # --- requests ------------------------------------------------------------------------------

    def add_request(
        self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, seed: int
    ) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        request.kv_transfer_params = params
        self.seeds[req_id] = seed
        self.scheduler.add_request(request)

    abort_after_schedule: list[str] = []  # aborted by the next step() between its schedule() and its forward

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # --- one engine step -----------------------------------------------------------------------

    def step(self) -> None:
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as Mixin

        so = self.scheduler.schedule()
        # The window vLLM's async scheduling opens: a request finished (aborted) after its step was scheduled.
        for rid in self.abort_after_schedule:
            self.abort(rid)
        self.abort_after_schedule = []
        if so.total_num_scheduled_tokens == 0:
            mro = Mixin.kv_connector_no_forward(so, self.vllm_config)
        else:
            with set_forward_context(None, self.vllm_config), Mixin._get_kv_connector_output(so) as kv_out:
                sampled = self.forward(so)
            ids = list(sampled)
            mro = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[sampled[r] for r in ids],
                kv_connector_output=kv_out,
            )
        if self.aggregator is not None:
            mro = self.aggregate(mro)
        for eco in self.scheduler.update_from_output(so, mro).values():
            stats = eco.scheduler_stats.kv_connector_stats if eco.scheduler_stats else None
            for key, value in (stats or {}).items():
                self.connector_stats[key] = self.connector_stats.get(key, 0) + int(value)
            for out in eco.outputs:
                if out.finished:
                    self.outputs[out.request_id] = out

    def aggregate(self, mro: Any) -> Any:
        """Every TP rank's KVConnectorOutput of this step through vLLM's KVOutputAggregator (JSON between ranks)."""
        import copy

        from vllm.v1.outputs import KVConnectorOutput

        kv = mro.kv_connector_output or KVConnectorOutput()
        mine = {
            "sending": sorted(kv.finished_sending or ()),
            "recving": sorted(kv.finished_recving or ()),
            "failed": sorted(kv.failed_recving or ()),
            "invalid": sorted(kv.invalid_block_ids or ()),
            "stats": dict(kv.kv_connector_stats.data) if kv.kv_connector_stats else None,
        }
        outputs = []
        for raw in self.tp_collective.allgather(json.dumps(mine).encode()):
            d = json.loads(raw)
            o = copy.copy(mro)
            stats = self.worker.build_kv_connector_stats(d["stats"]) if d["stats"] else None
            o.kv_connector_output = KVConnectorOutput(
                finished_sending=set(d["sending"]) or None,
                finished_recving=set(d["recving"]) or None,
                failed_recving=set(d["failed"]),
                invalid_block_ids=set(d["invalid"]),
                kv_connector_stats=stats,
            )
            outputs.append(o)
        return self.aggregator.aggregate(outputs, output_rank=self.spec.tp_rank)

    def forward(self, so: Any) -> dict[str, list[int]]:
        """Write the prompt tokens' KV (prefill) and sample one token for requests whose prompt is done."""
        import torch

        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # the scheduler advanced it already
            if self.spec.role == "prefill":
                (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
                for pos in range(end - n, min(end, req.num_prompt_tokens)):
                    b, off = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                    for layer in range(NUM_LAYERS):
                        data = token_bytes(self.seeds[req_id], layer, pos, self.token_nbytes)
                        view = self.layer_bytes(layer)
                        view[b, :, off, :] = torch.from_numpy(data.reshape(self.heads, -1))
            sampled[req_id] = [SAMPLED_TOKEN] if end >= req.num_tokens else []
        return sampled

    def layer_bytes(self, layer: int) -> Any:
        import torch

        return self.kv_caches[f"model.layers.{layer}.self_attn.attn"].view(torch.uint8)

    def prompt_kv(self, req_id: str, num_tokens: int) -> bytes:
        """The KV bytes of the first ``num_tokens`` positions, layer-major then position (what ``token_bytes`` makes)."""
        (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        parts = []
        for layer in range(NUM_LAYERS):
            view = self.layer_bytes(layer)
            for pos in range(num_tokens):
                parts.append(view[blocks[pos // BLOCK_SIZE], :, pos % BLOCK_SIZE, :].contiguous().numpy().tobytes())
        return b"".join(parts)

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        self.scheduler.connector.shutdown()
        self.worker.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None


# --- the process: a kvcore.runtime rank -----------------------------------------------------


class EngineRank:
    """One engine served as a rank (``kvcore.runtime.serve``): commands in, events out as messages.

    Commands: ``add``, ``abort``, ``abort_after_schedule`` and ``freeze`` (the test ``tell``s them: no reply, a failure still comes back),
    ``batch`` (several of those, all acted on before the same step) and ``state`` (a call: one step, then the
    counters). Between commands the engine steps while it has requests, as EngineCore's busy loop does. Events
    are messages ``{"event": name, ...}``: ``ready``, ``loaded`` (with the prompt's KV), ``finished``,
    ``freed``, ``frozen``, ``thawed`` and ``closed``.
    """

    BATCHABLE = ("add", "abort", "abort_after_schedule", "freeze")

    def __init__(self, channel: Channel, spec: EngineSpec) -> None:
        self.channel, self.spec = channel, spec
        self.engine = Engine(spec)
        self.watched: dict[str, dict[str, Any]] = {}  # request id -> what to report about it
        self.freeze = 0.0  # seconds to stop stepping after the next step (kvcore's own threads keep running)
        self.busy = False  # the engine had requests before the command just read (EngineCore steps only then)

    def emit(self, **event: Any) -> None:
        self.channel.send(event)

    # --- commands ----------------------------------------------------------------------------------

    def op_add(self, id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, seed: int) -> None:
        self.engine.add_request(id, prompt, max_tokens, params, seed)
        self.watched[id] = {
            "loaded": not params,  # a local request loads nothing
            "finished": False,
            "prompt_len": len(prompt),
        }

    def op_abort(self, id: str) -> None:
        self.engine.abort(id)
        self.watched[id]["aborted"] = True

    def op_abort_after_schedule(self, id: str) -> None:
        """Abort ``id`` in the next step, after the scheduler scheduled it (and its connector metadata was built)."""
        self.engine.abort_after_schedule = [*self.engine.abort_after_schedule, id]
        self.watched[id]["aborted"] = True

    def op_freeze(self, seconds: float) -> None:
        self.freeze = float(seconds)

    def op_batch(self, commands: list[dict[str, Any]]) -> None:
        """Several commands in one frame: they all act before the next step."""
        for command in commands:
            args = dict(command)
            op = args.pop("op")
            if op not in self.BATCHABLE:
                raise ValueError(f"batch: command {op!r} cannot be batched (expected one of {self.BATCHABLE})")
            getattr(self, f"op_{op}")(**args)

    def op_state(self) -> dict[str, Any]:
        engine = self.engine
        engine.step()
        return {
            "requests": len(engine.scheduler.requests),
            "free_blocks": engine.free_blocks(),
            "pending": engine.worker.engine.num_pending,
            "kvcore": engine.worker.engine.transceiver.stats(),
            "leaks": engine.worker.engine.transceiver.leaks(),
            "connector_stats": engine.connector_stats,
        }

    # --- the engine loop (serve's idle) ------------------------------------------------------------

    def idle_wait(self) -> float:
        """How long to wait for a command before stepping: short while the engine has requests."""
        self.busy = self.engine.scheduler.has_requests()
        return 0.002 if self.busy else 0.05

    def idle(self) -> None:
        """One engine step (if it had requests), then the events it caused."""
        from vllm.v1.request import RequestStatus

        if not self.busy:
            return
        engine = self.engine
        engine.step()
        if self.freeze:
            # An engine busy elsewhere (or stalled) for a while: the scheduler and workers make no calls.
            req_states = {rid: str(r.status) for rid, r in engine.scheduler.requests.items()}
            self.emit(event="frozen", seconds=self.freeze, requests=req_states, free_blocks=engine.free_blocks())
            time.sleep(self.freeze)
            self.freeze = 0.0
            self.emit(event="thawed")
        for rid, w in self.watched.items():
            req = engine.scheduler.requests.get(rid)
            if self.spec.role == "decode" and not w["loaded"] and req is not None:
                if req.status == RequestStatus.RUNNING:
                    # Scheduled after its load: every prompt byte must be here now (the decode forward writes none).
                    w["loaded"] = True
                    kv = engine.prompt_kv(rid, w["prompt_len"])
                    self.emit(event="loaded", id=rid, kv=kv.hex())
            if not w["finished"] and rid in engine.outputs:
                w["finished"] = True
                o = engine.outputs[rid]
                self.emit(
                    event="finished",
                    id=rid,
                    reason=str(o.finish_reason),
                    tokens=list(o.new_token_ids),
                    params=o.kv_transfer_params,
                )
            if (w["finished"] or w.get("aborted")) and not w.get("freed") and req is None:
                w["freed"] = True
                self.emit(event="freed", id=rid, free_blocks=engine.free_blocks())


def run(channel: Channel, *, log_path: str = "", **spec: Any) -> None:
    """The rank target ``vllm_engine:run``: one engine (``spec``: EngineSpec's fields) served until the test exits it.

    ``log_path``: where the process's stdout and stderr go (vLLM's logging; the frames travel on the harness's
    own pipe), so a failing test can show the tail.
    """
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    started = time.monotonic()
    rank = EngineRank(channel, EngineSpec(**spec))
    try:
        rank.emit(
            event="ready",
            pid=os.getpid(),
            info_endpoint=rank.engine.worker.engine.info_endpoint,
            free_blocks=rank.engine.free_blocks(),
        )
        serve(channel, rank, idle=rank.idle, idle_wait=rank.idle_wait)
        rank.engine.close()
        with contextlib.suppress(OSError):  # the test may have stopped reading already
            rank.emit(event="closed")
    finally:
        print(f"engine {spec['role']} ran {time.monotonic() - started:.1f}s", file=sys.stderr)
