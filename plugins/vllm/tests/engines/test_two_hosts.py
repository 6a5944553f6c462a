"""Real engines on two hosts: the prefill ``vllm serve`` in one, the decode and the proxy in the other.

kvcore's :class:`~kvcore.runtime.hosts.TwoHosts` builds two namespaced hosts on this machine (own network, pid,
UTS, IPC and mount namespaces, a fresh ``/dev/shm`` each), joined by a veth pair: 198.18.0.1 and 198.18.0.2.
The prefill instance runs in host ``a`` (core 0), its HTTP server and kvcore's control plane on ``a``'s
address; ``two_hosts_driver.py`` runs in host ``b``: the decode instance (core 1, kvcore bound to ``b``'s
address) and ``kvcore_vllm.proxy`` on ``b``'s loopback, and sends the prompts through the proxy.

The evidence: tokens identical to one plain engine; every prompt token counted by the decode as
``external_kv_transfer`` and none as ``local_compute``; kvcore's own bytes and tokens loaded on the decode;
and the veth's own counters: host ``b`` received at least the KV bytes kvcore says it moved (the link is the
only way from ``a`` to ``b``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Reference
from kvcore_vllm.bench import counter_sum
from kvcore_vllm.demo import COMPUTED, LOADED, PROMPT_TOKENS
from kvcore_vllm.local import VllmServer
from kvcore_vllm.tiny_model import MODEL, kv_bytes_per_token

from kvcore.control.auth import write_key_pair
from kvcore.runtime.hosts import TwoHosts, unavailable_reason

HERE = Path(__file__).parent
MAX_TOKENS = 8
PROMPTS = 6
PROMPT_LEN = 300
BYTES_MOVED = "vllm:kvcore_bytes_moved_total"
TOKENS_LOADED = "vllm:kvcore_tokens_loaded_total"

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"two hosts: {unavailable_reason()}")


def rx_bytes(hosts: TwoHosts, label: str) -> int:
    """Bytes host ``label`` received on its end of the veth (the kernel's own counter)."""
    h = hosts.hosts[label]
    out = subprocess.run(
        ["ip", "-s", "-j", "-n", h.netns, "link", "show", "dev", h.link], capture_output=True, text=True, check=True
    )
    return int(json.loads(out.stdout)[0]["stats64"]["rx"]["bytes"])


def curve(tmp: Path) -> tuple[dict[str, str], dict[str, str]]:
    """CURVE as docs/deployment.md configures it across hosts: a key pair per instance, each admitting both
    public keys, the decode told the prefill's public key. kvcore refuses a non-loopback bind without it."""
    keys = tmp / "keys"
    keys.mkdir(mode=0o700)
    _, p_secret = write_key_pair(keys, "prefill")
    _, d_secret = write_key_pair(keys, "decode")
    found = re.search(r'public-key = "([^"]+)"', (keys / "prefill.key").read_text())
    assert found is not None
    common = {"auth_allowed_keys_dir": str(keys)}
    return (
        {**common, "auth_key_file": str(p_secret)},
        {**common, "auth_key_file": str(d_secret), "auth_server_key": found.group(1)},
    )


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    with TwoHosts(shm_size="2g") as th:
        th.wait_link()
        yield th


@pytest.mark.parametrize(("backend", "mode"), [("nixl", "pull"), ("ucx", "pull"), ("ucx", "push")])
def test_prefill_on_one_host_decode_on_the_other_every_prompt_token_loaded_over_the_link(
    hosts: TwoHosts, model_dir: str, reference: Reference, tmp_path: Path, backend: str, mode: str
) -> None:
    a, b = hosts.a, hosts.b
    rng = np.random.default_rng(77)
    prompts = [rng.integers(1, 999, PROMPT_LEN).tolist() for _ in range(PROMPTS)]
    prefill_auth, decode_auth = curve(tmp_path)
    prefill = VllmServer(
        model_dir,
        8100,
        "prefill",
        "kvcore",
        backend,
        mode,
        {"host": a.address, "port": 5600, "gil_switch_interval_s": 0.0005, **prefill_auth},
        cpu="0",
        host=a.address,
        launcher=a.launcher(),
        log_path=str(tmp_path / f"prefill-{backend}.log"),
    )
    spec = {
        "model_dir": model_dir,
        "prefill_url": prefill.url,
        "backend": backend,
        "mode": mode,
        "kvcore_host": b.address,
        "kvcore_extra": decode_auth,
        "cpu": "1",
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        "workdir": str(tmp_path),
        "boot_timeout_s": 420,
    }
    rx_before = rx_bytes(hosts, "b")
    prefill.start()
    try:
        driver = b.popen(
            [sys.executable, str(HERE / "two_hosts_driver.py"), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = driver.communicate(timeout=840)
    finally:
        prefill.close()
    rx_after = rx_bytes(hosts, "b")
    logs = f"\nprefill log:\n{prefill.tail()}\ndriver stderr:\n{err.decode(errors='replace')[-4000:]}"
    assert out.strip(), "the driver in host b printed nothing" + logs
    got: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    assert "error" not in got, got.get("error", "") + logs

    assert got["tokens"] == reference.tokens(prompts, MAX_TOKENS)

    def delta(side: str, name: str) -> float:
        return counter_sum(got["after"][side], name) - counter_sum(got["before"][side], name)

    prompt_tokens = delta("decode", PROMPT_TOKENS)
    assert prompt_tokens == PROMPTS * PROMPT_LEN
    assert delta("decode", LOADED) == prompt_tokens, got["after"]["decode"]
    assert delta("decode", COMPUTED) == 0
    assert delta("decode", TOKENS_LOADED) == prompt_tokens
    moved = delta("decode", BYTES_MOVED) or delta("prefill", BYTES_MOVED)
    # Every prompt token's KV (whole blocks: at least the tokens' bytes) crossed the veth into host b.
    assert moved >= prompt_tokens * kv_bytes_per_token(MODEL)
    assert rx_after - rx_before >= moved
