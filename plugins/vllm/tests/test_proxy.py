"""kvcore_vllm.proxy against instances and clients that misbehave: a decode that dies mid-stream, a client that
closes its connection (after ``data: [DONE]`` or in the middle), more clients than the cap.

The prefill and decode "instances" here are small aiohttp servers on loopback that answer as vLLM's OpenAI API
does (a fault-injection tool: the real-engine path is tests/engines/test_serve.py); the proxy is the real one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kvcore_vllm.proxy import PREFILL_PARAMS, make_app

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "kvcore": {"request_id": "r"}}


async def _serve(app: web.Application, *, handler_cancellation: bool = False) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _prefill_app() -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["max_tokens"] == 1 and body["kv_transfer_params"] == PREFILL_PARAMS
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return _with_health(app)


def _with_health(app: web.Application) -> web.Application:
    """The instance answers ``GET /health`` (the proxy's own ``/health`` asks every instance)."""

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app.router.add_get("/health", health)
    return app


def _decode_app(
    gate: asyncio.Event | None = None,
    die_after: int | None = None,
    *,
    linger_s: float = 0.0,
    hold_first: asyncio.Event | None = None,
    ends: list[str] | None = None,
) -> web.Application:
    """A decode instance: four tokens and ``[DONE]``, streamed.

    ``gate``: every answer waits for it. ``die_after``: the connection breaks after that many tokens.
    ``linger_s``: the answer ends that long after ``[DONE]``. ``hold_first``: the first answer stops after two
    tokens until it is set, then goes on slowly (4 s of keep-alive comments). ``ends``: each answer appends
    ``"done"`` (it ended) or ``"closed"`` (writing failed: the proxy closed the connection).
    """
    served = itertools.count()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["kv_transfer_params"] == PARAMS  # the prefill's parameters, passed on unchanged
        held = hold_first is not None and next(served) == 0
        if gate is not None:
            await gate.wait()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            for k in range(4):
                if die_after is not None and k == die_after:
                    assert request.transport is not None
                    request.transport.abort()  # the instance dies: the connection breaks mid-answer
                    return out
                await out.write(b"data: " + json.dumps({"choices": [{"text": f"t{k}"}]}).encode() + b"\n\n")
                if held and k == 1:
                    assert hold_first is not None
                    await hold_first.wait()
                    for _ in range(400):
                        await asyncio.sleep(0.01)
                        await out.write(b": still generating\n\n")
            await out.write(b"data: [DONE]\n\n")
            await asyncio.sleep(linger_s)
            await out.write_eof()
        except ConnectionError:
            if ends is not None:
                ends.append("closed")
            return out
        if ends is not None:
            ends.append("done")
        return out

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return _with_health(app)


async def _events(session: aiohttp.ClientSession, url: str) -> tuple[int, list[Any]]:
    async with session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
        text = (await r.read()).decode()
    if r.status != 200:
        return r.status, [json.loads(text)]
    data = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return r.status, [d if d == "[DONE]" else json.loads(d) for d in data]


async def _read_until_and_close(session: aiohttp.ClientSession, url: str, stop: bytes) -> list[bytes]:
    """A streaming client that reads the events up to the one holding ``stop`` and closes its connection."""
    lines = []
    async with session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.strip():
                lines.append(line.strip())
            if stop in line:
                break
        r.close()  # the client goes: its connection closes, the rest of the answer unread
    return lines


async def _relay_counts(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with session.get(url + "/health") as r:
        body = await r.json()
    assert r.status == 200, body
    counts: dict[str, int] = body["relay"]
    return counts


async def _until(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``done()`` (a deadline passed is left for the caller's assertion to report)."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def _relay_counts_once(
    session: aiohttp.ClientSession, url: str, settled: Callable[[dict[str, int]], bool]
) -> dict[str, int]:
    """The proxy's ``/health`` counts once ``settled`` holds (the proxy sees a client's close at its next write)."""
    counts = await _relay_counts(session, url)
    deadline = time.monotonic() + 10.0
    while not settled(counts) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        counts = await _relay_counts(session, url)
    return counts


def _problems(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What a client's close must not log: a WARNING or worse from the proxy, an ERROR (a traceback) from aiohttp."""
    return [
        f"{r.name} {r.levelname} {r.getMessage()}"
        for r in caplog.records
        if (r.name == "kvcore_vllm.proxy" and r.levelno >= logging.WARNING)
        or (r.name.startswith("aiohttp") and r.levelno >= logging.ERROR)
    ]


def _proxy_debug(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvcore_vllm.proxy" and r.levelno == logging.DEBUG]


def _texts(events: list[Any]) -> list[str]:
    return [e["choices"][0]["text"] for e in events if isinstance(e, dict) and "choices" in e]


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_decode_dying_mid_stream_ends_the_stream_with_an_error_event_and_no_done(
    caplog: pytest.LogCaptureFixture,
) -> None:
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
                    counts = await _relay_counts(s, proxy[1])
                assert status == 200
                texts = _texts(events)
                if cut:
                    assert texts == ["t0", "t1"], events
                    assert "[DONE]" not in events and "decode instance" in events[-1]["error"]["message"], events
                    assert events[-1]["error"]["code"] == 502
                else:  # the same proxy code with an instance that does not die: the whole answer, then [DONE]
                    assert texts == ["t0", "t1", "t2", "t3"] and events[-1] == "[DONE]", events
                # a decode's failure is counted as one, not as a client's close
                assert counts == {
                    "client_closed_after_done": 0,
                    "client_closed_mid_stream": 0,
                    "decode_failed_mid_stream": int(cut),
                }
        finally:
            for runner, _ in runners:
                await runner.cleanup()

    caplog.set_level(logging.DEBUG, logger="kvcore_vllm.proxy")
    _run(main())
    warnings = [
        r.getMessage() for r in caplog.records if r.name == "kvcore_vllm.proxy" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1 and "failed in the middle of a stream" in warnings[0], warnings


def test_a_client_closing_after_done_is_counted_and_logged_at_debug_not_as_a_decode_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> dict[str, int]:
        runners = []
        try:
            # The decode ends its answer 0.3 s after [DONE], as a client that has its [DONE] closes at once.
            for app in (_prefill_app(), _decode_app(linger_s=0.3)):
                runners.append(await _serve(app))
            (_, p_url), (_, d_url) = runners
            proxy = await _serve(make_app([p_url], [d_url], timeout_s=20))
            runners.append(proxy)
            async with aiohttp.ClientSession() as s:
                lines = await _read_until_and_close(s, proxy[1], b"[DONE]")
                assert len(lines) == 5 and lines[-1] == b"data: [DONE]", lines
                counts = await _relay_counts_once(s, proxy[1], lambda c: c["client_closed_after_done"] > 0)
                status, events = await _events(s, proxy[1])  # the proxy serves the next request whole
                assert status == 200 and _texts(events) == ["t0", "t1", "t2", "t3"] and events[-1] == "[DONE]"
            return counts
        finally:
            for runner, _ in runners:
                await runner.cleanup()

    caplog.set_level(logging.DEBUG, logger="kvcore_vllm.proxy")
    counts = _run(main())
    assert _problems(caplog) == []
    assert counts == {"client_closed_after_done": 1, "client_closed_mid_stream": 0, "decode_failed_mid_stream": 0}
    assert [m for m in _proxy_debug(caplog) if "closed its connection after data: [DONE]" in m], caplog.records


@pytest.mark.parametrize("handler_cancellation", [False, True], ids=["write-fails", "handler-cancelled"])
def test_a_client_closing_mid_stream_closes_the_decode_answer_and_is_counted_not_logged_as_a_failure(
    caplog: pytest.LogCaptureFixture, handler_cancellation: bool
) -> None:
    async def main() -> dict[str, int]:
        hold, ends = asyncio.Event(), list[str]()
        runners = []
        try:
            for app in (_prefill_app(), _decode_app(hold_first=hold, ends=ends)):
                runners.append(await _serve(app))
            (_, p_url), (_, d_url) = runners
            app = make_app([p_url], [d_url], timeout_s=20)
            proxy = await _serve(app, handler_cancellation=handler_cancellation)
            runners.append(proxy)
            async with aiohttp.ClientSession() as s:
                lines = await _read_until_and_close(s, proxy[1], b'"t1"')
                assert len(lines) == 2, lines
                hold.set()  # the decode goes on generating, for a client that is gone
                counts = await _relay_counts_once(s, proxy[1], lambda c: c["client_closed_mid_stream"] > 0)
                await _until(lambda: bool(ends))
                # The proxy closed the decode's answer: its next write failed, 4 s before the answer's end.
                assert ends == ["closed"], ends
                status, events = await _events(s, proxy[1])  # the proxy serves the next request whole
                assert status == 200 and _texts(events) == ["t0", "t1", "t2", "t3"] and events[-1] == "[DONE]"
                assert ends == ["closed", "done"], ends
            return counts
        finally:
            for runner, _ in runners:
                await runner.cleanup()

    caplog.set_level(logging.DEBUG, logger="kvcore_vllm.proxy")
    counts = _run(main())
    assert _problems(caplog) == []
    assert counts == {"client_closed_after_done": 0, "client_closed_mid_stream": 1, "decode_failed_mid_stream": 0}
    assert [m for m in _proxy_debug(caplog) if "closed its connection in the middle of the answer" in m], caplog.records


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
