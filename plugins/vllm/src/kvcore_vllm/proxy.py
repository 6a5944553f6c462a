"""A small disaggregated-serving proxy for vLLM's OpenAI API: prefill on one instance, decode on another.

Run it in front of a prefill ``vllm serve`` (``kv_producer``) and a decode ``vllm serve`` (``kv_consumer``),
both with ``KvcoreConnector`` (or any connector that follows vLLM's P/D protocol)::

    python -m kvcore_vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

For each ``POST /v1/completions`` (and ``/v1/chat/completions``) it sends the request to a prefill instance
with ``max_tokens: 1``, ``stream: false`` and ``"kv_transfer_params": {"do_remote_decode": true, ...}`` (the
keys vLLM's own proxies send: :data:`PREFILL_PARAMS`), then
sends the client's request, unchanged but for the ``kv_transfer_params`` the prefill answered, to a decode
instance, and relays that answer (streamed when the client asked for a stream). Several ``--prefill`` and
``--decode`` URLs are taken in turn (round robin). ``GET /v1/models`` is a decode instance's;
``GET /health`` is 200 only when every instance answers its own ``/health``.

At most ``--max-in-flight`` requests (default 256) are relayed at once; one more is answered 503 at once
rather than queued without bound. A decode instance that fails in the middle of a stream (it died, the
connection broke, its answer ran past ``--timeout-s``) ends the client's stream with an error event,
``data: {"error": {...}}``, and no ``data: [DONE]``: the client can tell a cut answer from a whole one; it is
logged at WARNING. A client that closes its connection before the proxy ended its stream (after ``data: [DONE]``
or in the middle) is no failure: the proxy closes the decode's answer, logs it at DEBUG and counts it.
``GET /health`` carries the counts in its JSON (``"relay"``, both when it answers 200 and 503):
``client_closed_after_done``, ``client_closed_mid_stream`` and ``decode_failed_mid_stream``.

It binds 127.0.0.1 unless ``--host`` says otherwise. It does not authenticate clients: put it behind what
guards your API. The ``kv_transfer_params`` are a credential for the request's KV (they carry kvcore's
ticket): the proxy passes them only to the decode instance and never to the client of the prefill step.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger("kvcore_vllm.proxy")

#: The largest request body the proxy reads (a long prompt as token ids is a few MiB).
MAX_BODY_BYTES = 32 * 1024 * 1024
#: The ``kv_transfer_params`` of the prefill step: vLLM's own P/D proxies send these keys (the remote fields empty),
#: so a connector that reads any of them (vLLM's NixlConnector among them) gets what it gets from vLLM's proxy.
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: Headers passed on to the instances (the client's API key among them).
FORWARDED_HEADERS = ("authorization", "x-request-id")


class ProxyError(Exception):
    """A request the proxy cannot serve: ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill instance gets: one token, not streamed, asking to hand the KV to a decode."""
    if int(body.get("n", 1) or 1) != 1:
        raise ProxyError(400, "n: the disaggregated proxy serves one completion per request (n=1)")
    if body.get("best_of") not in (None, 1):
        raise ProxyError(400, "best_of: the disaggregated proxy serves one completion per request")
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PARAMS))
    if "min_tokens" in out:
        out["min_tokens"] = 0
    return out


def decode_body(body: dict[str, Any], prefill_answer: Any, prefill_url: str) -> dict[str, Any]:
    """The client's request with the prefill's ``kv_transfer_params`` (``ProxyError`` 502 when it gave none)."""
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise ProxyError(
            502,
            f"the prefill instance {prefill_url} answered without kv_transfer_params for a remote decode: "
            "is it started with a kv_producer connector (--kv-transfer-config)?",
        )
    return {**body, "kv_transfer_params": params}


@dataclasses.dataclass
class RelayCounts:
    """How the proxy's streams ended other than whole: ``GET /health`` reports these (``"relay"``)."""

    #: The client closed its connection after ``data: [DONE]``, before the proxy ended the stream.
    client_closed_after_done: int = 0
    #: The client closed its connection in the middle of the answer (the decode's answer is closed).
    client_closed_mid_stream: int = 0
    #: The decode instance failed in the middle of a stream (the client got an error event).
    decode_failed_mid_stream: int = 0


def _ends_done(tail: bytes) -> bool:
    """Whether the bytes relayed so far end with the stream's last event, ``data: [DONE]``."""
    return tail.rstrip().endswith(b"data: [DONE]")


class _RoundRobin:
    def __init__(self, name: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"{name}: at least one instance URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self._next: Iterator[str] = itertools.cycle(self.urls)

    def pick(self) -> str:
        return next(self._next)


def make_app(
    prefill: Sequence[str], decode: Sequence[str], *, timeout_s: float = 600.0, max_in_flight: int = 256
) -> Any:
    """The proxy as an ``aiohttp.web.Application`` (aiohttp comes with vLLM)."""
    import aiohttp
    from aiohttp import web

    if max_in_flight < 1:
        raise ValueError(f"max_in_flight: expected >= 1, got {max_in_flight}")
    in_flight = 0
    counts = RelayCounts()

    prefills, decodes = _RoundRobin("prefill", prefill), _RoundRobin("decode", decode)
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def on_startup(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def on_cleanup(app: web.Application) -> None:
        await app[session_key].close()

    def error(status: int, message: str, **extra: object) -> web.Response:
        answer = {"error": {"message": message, "type": "proxy_error", "code": status}, **extra}
        return web.json_response(answer, status=status)

    async def relay(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight
        if in_flight >= max_in_flight:
            return error(503, f"the proxy relays {max_in_flight} requests at once (--max-in-flight); try again later")
        in_flight += 1
        try:
            return await relay_one(request)
        finally:
            in_flight -= 1

    async def relay_one(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        session = request.app[session_key]
        p_url, d_url = prefills.pick(), decodes.pick()
        try:
            first = prefill_body(body)
            async with session.post(p_url + request.path, json=first, headers=headers) as r:
                if r.status != 200:
                    text = (await r.read())[:4000].decode(errors="replace")
                    return error(r.status, f"the prefill instance {p_url} answered {r.status}: {text}")
                try:
                    answer = await r.json(content_type=None)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    return error(502, f"the prefill instance {p_url} answered 200 with a body that is not JSON: {exc}")
            second = decode_body(body, answer, p_url)
        except ProxyError as exc:
            return error(exc.status, str(exc))
        except (TimeoutError, aiohttp.ClientError) as exc:
            return error(502, f"the prefill instance {p_url} is unreachable or too slow: {exc!r}")
        try:
            async with session.post(d_url + request.path, json=second, headers=headers) as r:
                if not body.get("stream"):
                    return web.Response(
                        body=await r.read(), status=r.status, content_type=r.content_type or "application/json"
                    )
                return await relay_stream(request, r, d_url)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return error(502, f"the decode instance {d_url} is unreachable or too slow: {exc!r}")

    async def relay_stream(request: web.Request, r: aiohttp.ClientResponse, d_url: str) -> web.StreamResponse:
        """Relay the decode's stream: a failed read is the decode's failure, a failed write the client's close.

        The two are told apart by where the error is raised, not by its type: a write to a client that went raises
        ``ClientConnectionResetError``, an ``aiohttp.ClientError`` as every failure of the decode's answer is (and
        a ``ConnectionResetError``).
        """
        out = web.StreamResponse(
            status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "text/event-stream")}
        )
        tail = b""  # the last bytes relayed: did the client have its [DONE]?
        try:
            await out.prepare(request)
            chunks = r.content.iter_any()
            while True:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except (TimeoutError, aiohttp.ClientError) as exc:
                    await decode_failed(out, d_url, exc)
                    return out
                await out.write(chunk)
                tail = (tail + chunk)[-32:]
            await out.write_eof()
        except ConnectionError as exc:  # only a write to the client raises here: the client closed its connection
            client_closed(r, _ends_done(tail), repr(exc))
        except asyncio.CancelledError:
            # The handler is cancelled when the client goes if the server runs with handler_cancellation; a
            # cancellation with the client still there (the server stopping) is not the client's close.
            if request.transport is None or request.transport.is_closing():
                client_closed(r, _ends_done(tail), "the handler was cancelled")
            raise
        return out

    def client_closed(r: aiohttp.ClientResponse, after_done: bool, why: str) -> None:
        r.close()  # lets go of the decode's connection: in the middle of an answer, the decode stops generating
        if after_done:
            counts.client_closed_after_done += 1
        else:
            counts.client_closed_mid_stream += 1
        where = "after data: [DONE]" if after_done else "in the middle of the answer"
        log.debug("a client closed its connection %s (%s); the decode's answer is closed", where, why)

    async def decode_failed(out: web.StreamResponse, d_url: str, exc: Exception) -> None:
        # The status line went out already: end the stream with an error event (and no [DONE]).
        counts.decode_failed_mid_stream += 1
        log.warning("the decode instance %s failed in the middle of a stream: %r", d_url, exc)
        event = {
            "error": {
                "message": f"the decode instance {d_url} failed in the middle of the answer: {exc!r}",
                "type": "proxy_error",
                "code": 502,
            }
        }
        try:
            await out.write(b"\n\ndata: " + json.dumps(event).encode() + b"\n\n")
            await out.write_eof()
        except ConnectionError as write_exc:  # the client went too: there is no one to tell
            log.debug("the client closed its connection before the error event: %r", write_exc)

    async def models(request: web.Request) -> web.Response:
        url = decodes.urls[0]
        try:
            async with request.app[session_key].get(url + "/v1/models") as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except aiohttp.ClientError as exc:
            return error(502, f"the decode instance {url} is unreachable: {exc}")

    async def health(request: web.Request) -> web.Response:
        down = []
        for url in [*prefills.urls, *decodes.urls]:
            try:
                async with request.app[session_key].get(url + "/health") as r:
                    if r.status != 200:
                        down.append(f"{url} ({r.status})")
            except aiohttp.ClientError as exc:
                down.append(f"{url} ({exc.__class__.__name__})")
        relayed = dataclasses.asdict(counts)
        if down:
            return error(503, "not every instance is healthy: " + ", ".join(down), relay=relayed)
        return web.json_response({"status": "ok", "prefill": prefills.urls, "decode": decodes.urls, "relay": relayed})

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", relay)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcore_vllm.proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--prefill", action="append", required=True, metavar="URL", help="a prefill instance (repeat for more)"
    )
    parser.add_argument(
        "--decode", action="append", required=True, metavar="URL", help="a decode instance (repeat for more)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit for each instance's answer")
    parser.add_argument(
        "--max-in-flight", type=int, default=256, help="requests relayed at once; one more is answered 503"
    )
    args = parser.parse_args(argv)
    from aiohttp import web

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = make_app(args.prefill, args.decode, timeout_s=args.timeout_s, max_in_flight=args.max_in_flight)
    log.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
