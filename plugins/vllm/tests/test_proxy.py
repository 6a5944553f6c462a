"""kvcore_vllm.proxy against instances that misbehave: a decode that dies mid-stream, more clients than the cap.

The prefill and decode "instances" here are small aiohttp servers on loopback that answer as vLLM's OpenAI API
does (a fault-injection tool: the real-engine path is tests/engines/test_serve.py); the proxy is the real one.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web
from kvcore_vllm.proxy import make_app

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "kvcore": {"request_id": "r"}}


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _prefill_app() -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["max_tokens"] == 1 and body["kv_transfer_params"] == {"do_remote_decode": True}
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def _decode_app(gate: asyncio.Event | None = None, die_after: int | None = None) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["kv_transfer_params"] == PARAMS  # the prefill's parameters, passed on unchanged
        if gate is not None:
            await gate.wait()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for k in range(4):
            if die_after is not None and k == die_after:
                assert request.transport is not None
                request.transport.abort()  # the instance dies: the connection breaks mid-answer
                return out
            await out.write(b"data: " + json.dumps({"choices": [{"text": f"t{k}"}]}).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _events(session: aiohttp.ClientSession, url: str) -> tuple[int, list[Any]]:
    async with session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
        text = (await r.read()).decode()
    if r.status != 200:
        return r.status, [json.loads(text)]
    data = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return r.status, [d if d == "[DONE]" else json.loads(d) for d in data]


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_decode_dying_mid_stream_ends_the_stream_with_an_error_event_and_no_done() -> None:
    async def main() -> None:
        runners = []
        try:
            for app in (_prefill_app(), _decode_app(die_after=2), _decode_app()):
                runners.append(await _serve(app))
            (_, p_url), (_, dying), (_, healthy) = runners
            for decode, cut in ((dying, True), (healthy, False)):
                proxy = await _serve(make_app([p_url], [decode], timeout_s=20))
                runners.append(proxy)
                async with aiohttp.ClientSession() as s:
                    status, events = await _events(s, proxy[1])
                assert status == 200
                texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and "choices" in e]
                if cut:
                    assert texts == ["t0", "t1"], events
                    assert "[DONE]" not in events and "decode instance" in events[-1]["error"]["message"], events
                    assert events[-1]["error"]["code"] == 502
                else:  # the same proxy code with an instance that does not die: the whole answer, then [DONE]
                    assert texts == ["t0", "t1", "t2", "t3"] and events[-1] == "[DONE]", events
        finally:
            for runner, _ in runners:
                await runner.cleanup()

    _run(main())


def test_a_request_over_the_in_flight_cap_is_answered_503_at_once() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        runners = []
        try:
            for app in (_prefill_app(), _decode_app(gate=gate)):
                runners.append(await _serve(app))
            (_, p_url), (_, d_url) = runners
            proxy = await _serve(make_app([p_url], [d_url], timeout_s=20, max_in_flight=2))
            runners.append(proxy)
            async with aiohttp.ClientSession() as s:
                held = [asyncio.create_task(_events(s, proxy[1])) for _ in range(2)]
                await asyncio.sleep(0.5)  # both are in the proxy, waiting for the decode
                status, body = await _events(s, proxy[1])
                assert status == 503 and "--max-in-flight" in body[0]["error"]["message"], body
                gate.set()
                for status, events in await asyncio.gather(*held):
                    assert status == 200 and events[-1] == "[DONE]", events
                status, events = await _events(s, proxy[1])  # below the cap again
                assert status == 200 and events[-1] == "[DONE]"
        finally:
            for runner, _ in runners:
                await runner.cleanup()

    _run(main())


def test_a_prefill_answering_garbage_is_a_502_naming_it() -> None:
    async def main() -> None:
        async def garbage(request: web.Request) -> web.Response:
            return web.Response(text="not json{", status=200)

        app = web.Application()
        app.router.add_post("/v1/completions", garbage)
        runners = [await _serve(app)]
        try:
            proxy = await _serve(make_app([runners[0][1]], ["http://127.0.0.1:9"], timeout_s=5))
            runners.append(proxy)
            async with aiohttp.ClientSession() as s:
                status, body = await _events(s, proxy[1])
            assert status == 502 and "not JSON" in body[0]["error"]["message"], body
            assert runners[0][1] in body[0]["error"]["message"]
        finally:
            for runner, _ in runners:
                await runner.cleanup()

    _run(main())
