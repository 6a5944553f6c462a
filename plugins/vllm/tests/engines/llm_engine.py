"""A real vLLM engine in a rank process: ``vllm.LLMEngine`` with forward passes, driven by commands.

The test starts ``RankProcess("llm_engine:run", ...)`` (kvcore's one harness) for each engine: a plain
engine (no connector), a prefill (``kv_producer``) or a decode (``kv_consumer``) engine with
``KvcoreConnector`` or vLLM's own ``NixlConnector``. vLLM runs as users run it: ``LLMEngine`` in this
process, its ``EngineCore`` and worker in processes of their own (vLLM's multiprocessing, the default),
request ids randomized by vLLM (the default), one CPU core per engine (``VLLM_CPU_OMP_THREADS_BIND``).

The test is the proxy: it sends a prompt to the prefill with ``{"do_remote_decode": true}`` and
``max_tokens=1``, then to the decode with the ``kv_transfer_params`` the prefill returned, unchanged.
Evidence comes back with every answer: the tokens, each request's ``kv_transfer_params`` and finish
reason, the time to its first token, and vLLM's own counters (``metrics``): prompt tokens by source
(``external_kv_transfer`` is KV that came over the connector; ``local_compute`` was recomputed here),
``external_prefix_cache_hits`` and the connector's ``vllm:kvcore_*`` counters.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from kvcore_vllm.tiny_model import LARGE_MODEL, MODEL, write_model  # noqa: F401  (the tests' model, made here)

from kvcore.runtime import Channel, serve


@dataclass
class LlmSpec:
    role: str  # "plain" | "prefill" | "decode"
    model_dir: str
    connector: str = "kvcore"  # "kvcore" | "nixl" (vLLM's NixlConnector)
    backend: str = "nixl"  # kvcore's transport
    mode: str = "pull"
    extra: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config
    kv_load_failure_policy: str = "recompute"
    max_model_len: int = 2048
    prefix_caching: bool = True
    seed: int = 0


def _kv_transfer_config(spec: LlmSpec) -> dict[str, Any] | None:
    if spec.role == "plain":
        return None
    role = "kv_producer" if spec.role == "prefill" else "kv_consumer"
    if spec.connector == "nixl":
        return {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": spec.kv_load_failure_policy,
        }
    return {
        "kv_connector": "KvcoreConnector",
        "kv_connector_module_path": "kvcore_vllm",
        "kv_role": role,
        "kv_load_failure_policy": spec.kv_load_failure_policy,
        "kv_connector_extra_config": {"backend": spec.backend, "mode": spec.mode, **spec.extra},
    }


@dataclass
class _Watch:
    added: float
    first_token: float | None = None
    tokens: list[int] = field(default_factory=list)
    params: dict[str, Any] | None = None
    finish_reason: str | None = None
    finished: bool = False


class LlmRank:
    """One vLLM engine; ``op_*`` are the commands."""

    def __init__(self, channel: Channel, spec: LlmSpec) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.channel, self.spec = channel, spec
        args = EngineArgs(
            model=spec.model_dir,
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=spec.max_model_len,
            seed=spec.seed,
            disable_log_stats=False,
            enable_prefix_caching=spec.prefix_caching,
            kv_transfer_config=_kv_transfer_config(spec),
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.watched: dict[str, _Watch] = {}

    def emit(self, **body: Any) -> None:
        self.channel.send(body)

    # --- requests ------------------------------------------------------------------------------------

    def op_submit(self, requests: list[dict[str, Any]]) -> None:
        """Add requests (``id``, ``prompt`` token ids, ``max_tokens``, optional ``kv_transfer_params``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for r in requests:
            extra = {"kv_transfer_params": r["kv_transfer_params"]} if r.get("kv_transfer_params") else None
            params = SamplingParams(
                max_tokens=int(r.get("max_tokens", 8)),
                temperature=0.0,
                detokenize=False,
                ignore_eos=True,
                extra_args=extra,
            )
            self.watched[r["id"]] = _Watch(added=time.monotonic())
            self.engine.add_request(r["id"], TokensPrompt(prompt_token_ids=list(r["prompt"])), params)

    def op_step(self, n: int = 1) -> dict[str, Any]:
        """Run ``n`` engine steps; the ids finished so far."""
        for _ in range(int(n)):
            self._step()
        return {"finished": sorted(i for i, w in self.watched.items() if w.finished)}

    def op_abort(self, ids: list[str]) -> None:
        self.engine.abort_request(list(ids))
        for i in ids:
            if i in self.watched:
                self.watched[i].finished = True
                self.watched[i].finish_reason = "aborted"

    def op_run(self, ids: list[str], timeout: float = 120.0) -> dict[str, Any]:
        """Step until every request in ``ids`` finished (at most ``timeout`` s); their outputs."""
        deadline = time.monotonic() + timeout
        while not all(self.watched[i].finished for i in ids):
            if time.monotonic() > deadline:
                pending = [i for i in ids if not self.watched[i].finished]
                raise TimeoutError(f"requests {pending} not finished within {timeout}s")
            self._step()
        return {"outputs": {i: self._output(i) for i in ids}}

    def op_generate(self, requests: list[dict[str, Any]], timeout: float = 120.0) -> dict[str, Any]:
        """``submit`` then ``run`` until they all finished."""
        self.op_submit(requests)
        return self.op_run([r["id"] for r in requests], timeout)

    def _output(self, rid: str) -> dict[str, Any]:
        w = self.watched[rid]
        return {
            "tokens": w.tokens,
            "kv_transfer_params": w.params,
            "finish_reason": w.finish_reason,
            "ttft_s": (w.first_token - w.added) if w.first_token is not None else None,
        }

    def _step(self) -> None:
        if not self.engine.has_unfinished_requests():
            time.sleep(0.001)
            return
        now = time.monotonic()
        for out in self.engine.step():
            w = self.watched.get(out.request_id)
            if w is None:
                continue
            c = out.outputs[0] if out.outputs else None
            if c is not None and c.token_ids and w.first_token is None:
                w.first_token = now
            if c is not None:
                w.tokens = list(c.token_ids)
                w.finish_reason = c.finish_reason
            if out.finished:
                w.finished = True
                w.params = out.kv_transfer_params

    # --- evidence ------------------------------------------------------------------------------------

    def op_metrics(self) -> dict[str, Any]:
        """vLLM's counters (summed over labels), prompt tokens by source, and the connector's by label."""
        out: dict[str, Any] = {"by_source": {}, "kvcore_load_failures": {}, "kvcore_transfers": {}}
        for m in self.engine.get_metrics():
            value = getattr(m, "value", None)
            if not isinstance(value, (int, float)):
                continue
            if m.name == "vllm:prompt_tokens_by_source":
                out["by_source"][m.labels["source"]] = value
            elif m.name == "vllm:kvcore_load_failures":
                out["kvcore_load_failures"][m.labels["reason"]] = value
            elif m.name == "vllm:kvcore_transfers":
                out["kvcore_transfers"][m.labels["outcome"]] = value
            else:
                out[m.name] = out.get(m.name, 0) + value
        return out

    def op_pids(self) -> dict[str, Any]:
        """This process and vLLM's processes under it (EngineCore, its worker)."""
        import psutil

        me = psutil.Process()
        return {"driver": me.pid, "children": [p.pid for p in me.children(recursive=True)]}

    def op_flush(self) -> None:
        """Log stats now (vLLM records Prometheus counters at each step; this makes the logger line appear too)."""
        self.engine.do_log_stats()

    def close(self) -> None:
        import contextlib

        with contextlib.suppress(Exception):
            self.engine.engine_core.shutdown()


def run(channel: Channel, *, log_path: str = "", cpu: str = "", **spec: Any) -> None:
    """The rank target ``llm_engine:run``: one engine (``spec``: LlmSpec's fields) served until the test exits it."""
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    started = time.monotonic()
    rank = LlmRank(channel, LlmSpec(**spec))
    try:
        rank.emit(event="ready", pid=os.getpid(), boot_s=time.monotonic() - started)
        serve(channel, rank)
    finally:
        rank.close()
