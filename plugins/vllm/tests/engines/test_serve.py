"""``vllm serve`` as users deploy it: two OpenAI servers with KvcoreConnector and kvcore_vllm.proxy in front.

Everything goes over HTTP on loopback, text prompts in (the tiny model has a tokenizer of its own), the
answers streamed back through the proxy. The evidence that the KV moved is the decode server's own
``/metrics``: every prompt token from ``external_kv_transfer``, none from ``local_compute``.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kvcore_vllm.demo import COMPUTED, LOADED, PROMPT_TOKENS, Proxy, deployment, free_port, run_through, text_prompts
from kvcore_vllm.local import LOOPBACK, complete
from kvcore_vllm.tiny_model import MODEL, kv_bytes_per_token, write_model

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = tmp_path_factory.mktemp("serve")
    model = write_model(work / "model")
    with deployment(work, model, backend="nixl", mode="pull") as dep:
        yield dep


def post(port: int, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def wait_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((LOOPBACK, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_streamed_through_the_proxy_every_prompt_token_is_loaded_and_tokens_match(served: Any) -> None:
    """Two waves of 8 prompts: identical to the prefill server's own answer, every prompt token loaded."""
    for wave in (1, 2):
        result = run_through(served, text_prompts(8, 200, seed=wave), MAX_TOKENS, kv_bytes_per_token(MODEL))
        assert result.mismatches == []
        assert result.identical == 8
        assert result.prompt_tokens >= 8 * 200
        assert result.loaded == result.prompt_tokens, result
        assert result.computed == 0, result
        assert all(t > 0 for t in result.ttft_s)


def test_a_plain_answer_through_the_proxy_carries_no_credential(served: Any) -> None:
    """Not streamed: same tokens; the answer the client sees holds no kvcore parameters (they are a credential)."""
    prompt = text_prompts(1, 120, seed=7)[0]
    before = served.decode.metrics()
    got = complete(served.proxy.url, prompt, MAX_TOKENS, stream=False)
    after = served.decode.metrics()
    assert got.token_ids == complete(served.prefill.url, prompt, MAX_TOKENS, stream=False).token_ids
    assert len(got.token_ids) == MAX_TOKENS
    assert "kvcore" not in json.dumps(got.kv_transfer_params or {})
    assert after[LOADED] - before[LOADED] == after[PROMPT_TOKENS] - before[PROMPT_TOKENS] > 0
    assert after[COMPUTED] == before[COMPUTED]


def test_the_proxy_refuses_what_it_cannot_serve(served: Any) -> None:
    port = served.proxy.port
    status, body = post(port, "/v1/completions", b"not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, body = post(port, "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = post(port, "/v1/completions", json.dumps({"prompt": "the cache", "n": 2}).encode())
    assert status == 400 and body["error"]["message"].startswith("n:")


def test_a_proxy_whose_instances_are_gone_answers_502_and_unhealthy(served: Any, tmp_path: Path) -> None:
    dead = f"http://{LOOPBACK}:{free_port()}"
    proxy = Proxy([dead], [served.decode.url], free_port(), str(tmp_path / "proxy.log")).start()
    try:
        wait_listening(proxy.port)
        status, body = post(proxy.port, "/v1/completions", json.dumps({"prompt": "the cache"}).encode())
        assert status == 502 and "prefill instance" in body["error"]["message"] and dead in body["error"]["message"]
        conn = http.client.HTTPConnection(LOOPBACK, proxy.port, timeout=30)
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 503 and dead in r.read().decode()
        conn.close()
    finally:
        proxy.close()


def test_the_demo_command_reports_identical_tokens_and_prompt_tokens_loaded(tmp_path: Path) -> None:
    """``python -m kvcore_vllm.demo`` (``make demo-vllm``) on shm in push mode: exit 0 and the three lines."""
    out = subprocess.run(
        [sys.executable, "-m", "kvcore_vllm.demo", "--backend", "shm", "--mode", "push", "--prompts", "4",
         "--words", "96", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert "tokens identical to a plain engine (no connector): 4 of 4 prompts" in out.stdout
    # The reference is a vllm serve of its own without a connector, not the prefill instance.
    plain_log = (tmp_path / "plain.log").read_text(errors="replace")
    assert "vllm" in plain_log.lower() and "KvcoreConnector" not in plain_log
    line = next(ln for ln in out.stdout.splitlines() if "prompt tokens loaded over kvcore" in ln)
    loaded, total = (int(x) for x in line.split(":")[1].split("(")[0].split(" of "))
    assert loaded == total >= 4 * 96 and "(0 recomputed" in line
    assert "time to first token" in out.stdout and out.stdout.rstrip().endswith("OK")
