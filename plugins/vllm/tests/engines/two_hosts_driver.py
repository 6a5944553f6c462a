"""The decode side of the two-host test, run inside host ``b``: a decode ``vllm serve`` and the proxy beside it.

``python two_hosts_driver.py SPEC_JSON`` (started by ``test_two_hosts.py`` inside host ``b`` of kvcore's
``TwoHosts``): it starts a decode ``vllm serve`` with ``KvcoreConnector`` whose control plane binds this host's
address, waits for the prefill instance in host ``a`` (over the link) and for its own, starts
``kvcore_vllm.proxy`` on this host's loopback in front of both, sends the prompts through the proxy as an
OpenAI client would (streamed, a few at once), and prints one JSON line: each prompt's tokens and the
counters of both instances before and after. Everything it started is stopped before it exits.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvcore_vllm.demo import Proxy, free_port
from kvcore_vllm.local import ServerError, VllmServer, complete, healthy, prometheus


def wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if time.monotonic() > deadline:
            raise ServerError(f"{url} was not healthy within {timeout:.0f}s (from host b, over the link)")
        time.sleep(1.0)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    work = Path(spec["workdir"])
    decode = VllmServer(
        spec["model_dir"],
        free_port(),
        "decode",
        "kvcore",
        spec["backend"],
        spec["mode"],
        {"host": spec["kvcore_host"], "gil_switch_interval_s": 0.0005, **spec["kvcore_extra"]},
        cpu=spec["cpu"],
        log_path=str(work / f"decode-{spec['backend']}.log"),
    )
    proxy = Proxy([spec["prefill_url"]], [decode.url], 0, str(work / f"proxy-{spec['backend']}.log"))
    try:
        decode.start()
        wait_healthy(spec["prefill_url"], spec["boot_timeout_s"])
        decode.wait_ready(spec["boot_timeout_s"])
        proxy.port = free_port()
        proxy.start().wait_ready()
        before = {"decode": decode.metrics(), "prefill": prometheus(spec["prefill_url"])}
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: complete(proxy.url, p, spec["max_tokens"], stream=True), spec["prompts"]))
        after = {"decode": decode.metrics(), "prefill": prometheus(spec["prefill_url"])}
        return {"tokens": [g.token_ids for g in got], "before": before, "after": after}
    finally:
        proxy.close()
        decode.close()


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        out = run(spec)
    except Exception:
        out = {"error": traceback.format_exc()[-6000:]}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
