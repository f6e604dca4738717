"""A streaming client that closes its connection as soon as it reads ``[DONE]`` (as
``disagg bench`` does), before the chunked encoding's end reaches it: the proxy's request
still ends as answered, with its ``done`` line and every moment (``consumer_sent``
included) logged. One that closes after its first token, mid-answer, ends as
``client_gone``: counted, its ``done`` line logged, no error. The proxy runs in this
process in front of two small aiohttp upstreams; the consumer holds its stream (before
its events, or before its end) until the client has closed, so the proxy's writes after
that point always come after the close."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiohttp import web

from disagg.proxy.app import ProxyState, build_app

pytestmark = pytest.mark.timeout(60)


def _event(ids: list[int], finish: str | None) -> bytes:
    choice = {"index": 0, "text": "x", "token_ids": ids, "finish_reason": finish}
    return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()


async def _site(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def _stream(request: web.Request, events: list[bytes]) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for e in events:
        await resp.write(e)
    return resp


async def _through_proxy(until: bytes = b"data: [DONE]") -> tuple[dict[str, float], bytes]:
    """The client reads until ``until`` and closes; the request's outcome counts."""
    closed = asyncio.Event()  # the client has closed: the consumer may go on

    async def produce(request: web.Request) -> web.StreamResponse:
        resp = await _stream(request, [_event([5], "length"), b"data: [DONE]\n\n"])
        await resp.write_eof()
        return resp

    async def consume(request: web.Request) -> web.StreamResponse:
        if until == b"data: [DONE]":
            resp = await _stream(request, [_event([6], None), b"data: [DONE]\n\n"])
            await asyncio.wait_for(closed.wait(), 10)
        else:  # the client leaves before the consumer's token
            resp = await _stream(request, [_event([6], None)])
            await asyncio.wait_for(closed.wait(), 10)
            try:  # the proxy relays these to a closed client, then closes this stream
                for _ in range(20):
                    await resp.write(_event([7], None))
                    await asyncio.sleep(0.01)
            except ConnectionResetError:
                return resp
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"continuation": True, "prefetch": False})

    producer, consumer = web.Application(), web.Application()
    producer.router.add_post("/v1/completions", produce)
    consumer.router.add_post("/v1/completions", consume)
    consumer.router.add_get("/disagg/info", info)
    for app in (producer, consumer):
        app.router.add_get("/health", health)
    runners = []
    try:
        p_runner, p_url = await _site(producer)
        runners.append(p_runner)
        c_runner, c_url = await _site(consumer)
        runners.append(c_runner)
        state = ProxyState([p_url], [c_url], prefetch=False)
        x_runner, x_url = await _site(build_app(state))
        runners.append(x_runner)
        host, port = x_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2, "stream": True}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nX-Request-Id: closing-1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = b""
        while until not in got:
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, got
            got += data
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.2)  # the proxy sees the close before the consumer's end
        closed.set()
        counts: dict[str, float] = {}
        for _ in range(200):  # the handler's end (its outcome counted)
            counts = {o: state.m_requests.labels(o)._value.get() for o in ("ok", "client_gone")}
            if any(counts.values()):
                break
            await asyncio.sleep(0.02)
        return counts, got
    finally:
        for r in reversed(runners):
            await r.cleanup()


def test_done_logged_when_the_client_closes_at_done(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="disagg"):
        counts, got = asyncio.run(_through_proxy())
    assert b'"token_ids": [5]' in got and b'"token_ids": [6]' in got  # both tokens came
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    done = [r for r in caplog.records if r.getMessage() == "done"]
    assert len(done) == 1, caplog.text
    assert getattr(done[0], "request_id", None) == "closing-1"
    marks = getattr(done[0], "marks", {})
    assert {"client_token", "consumer_sent", "consumer_first"} <= marks.keys(), marks
    assert marks["client_token"] <= marks["consumer_sent"] <= marks["consumer_first"]
    assert counts == {"ok": 1, "client_gone": 0}


def test_a_client_gone_mid_answer_is_counted_not_an_error(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="disagg"):
        counts, got = asyncio.run(_through_proxy(until=b'"token_ids": [5]'))
    assert b'"token_ids": [5]' in got
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    done = [r for r in caplog.records if r.getMessage() == "done"]
    assert len(done) == 1 and getattr(done[0], "status", None) == 499, caplog.text
    assert counts == {"ok": 0, "client_gone": 1}
