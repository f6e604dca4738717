"""The proxy tells the consumer about a prompt as it sends the prefill, and hands the first
token over as soon as the producer's token event is read: `disagg serve` (both roles) and
`disagg proxy` as real processes. Every answer equals the monolithic engine's, token for
token, with the consumer's claim taken from its prefetch; without the prefetch
(``--no-prefetch``) the answers are the same; a producer whose stream says, after its
token, that the answer is whole (a stop) has the last word, even though the consumer was
already asked to continue."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator

import pytest
import serve_procs as sp
from aiohttp import web

from disagg.serve import chat, tokenizer

pytestmark = pytest.mark.timeout(180)


class StoppingProducer(sp.ThreadedApp):
    """A producer whose streamed answer is token ``TOKEN``, then, a moment later, a last
    event whose finish reason is ``stop`` (TensorRT-LLM may end an answer at its first
    token that way)."""

    TOKEN = 7

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def event(ids: list[int], finish: str | None) -> bytes:
            choice = {"index": 0, "text": "x", "token_ids": ids, "finish_reason": finish}
            return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

        await resp.write(event([self.TOKEN], None))
        await asyncio.sleep(0.5)  # the proxy has asked the consumer to continue by now
        await resp.write(event([], "stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    d = tmp_path_factory.mktemp("prefetch")
    pcfg, ccfg = sp.write_configs(d)
    names = ("producer", "consumer", "proxy", "plain", "stopping")
    ports = {k: sp.free_port() for k in names}
    urls = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
    procs: list[subprocess.Popen[bytes]] = []
    stopping = StoppingProducer()
    try:
        for role, cfg in (("producer", pcfg), ("consumer", ccfg)):
            procs.append(sp.spawn(sp.serve_args(role, cfg, "127.0.0.1", ports[role]), d / role))
            sp.wait_healthy(urls[role], procs[-1], d / role)
        for name, producer, extra in (
            ("proxy", urls["producer"], []),
            ("plain", urls["producer"], ["--no-prefetch"]),
            ("stopping", stopping.url, []),
        ):
            args = ["proxy", "--host", "127.0.0.1", "--port", str(ports[name]), *extra]
            args += ["--producer", producer, "--consumer", urls["consumer"]]
            procs.append(sp.spawn(args, d / name))
            sp.wait_healthy(urls[name], procs[-1], d / name)
        yield urls
    finally:
        stopping.close()
        sp.stop(procs)


def _consumer(urls: dict[str, str], name: str) -> float:
    _, text = sp.get(f"{urls['consumer']}/metrics")
    return sp.metric(text, f"disagg_consumer_{name}_total") if name in text else 0.0


@pytest.mark.parametrize(
    ("stream", "chat_api"), [(True, False), (False, True)], ids=["stream", "chat-json"]
)
def test_the_consumer_continues_from_its_prefetched_lease(
    system: dict[str, str], stream: bool, chat_api: bool
):
    if chat_api:
        messages = [{"role": "user", "content": f"Tell me about prefetching, {stream}. " * 9}]
        tokens = tokenizer.encode(chat.render(messages))
        path, body = "/v1/chat/completions", {"messages": messages}
    else:
        tokens = sp.prompt(seed=81 + stream)
        path, body = "/v1/completions", {"prompt": tokens}
    want = sp.monolithic(tokens, 6)
    taken, claimed = _consumer(system, "prefetch_taken"), _consumer(system, "claims_hit")
    status, out = sp.post(f"{system['proxy']}{path}", {**body, "max_tokens": 6, "stream": stream})
    assert status == 200, out
    got = sp.streamed_tokens(out) if stream else out["choices"][0]["token_ids"]
    assert got == want
    matched = (out[-2] if stream else out)["disagg"]["connector_matched_tokens"]
    assert matched == len(tokens) // 32 * 32  # every whole block of the prompt loaded
    assert _consumer(system, "prefetch_taken") == taken + 1
    assert _consumer(system, "claims_hit") == claimed, "the engine thread claimed anyway"


def test_without_the_prefetch_the_answer_is_the_same(system: dict[str, str]):
    tokens = sp.prompt(seed=91)
    started, claimed = _consumer(system, "prefetch_started"), _consumer(system, "claims_hit")
    status, out = sp.post(
        f"{system['plain']}/v1/completions", {"prompt": tokens, "max_tokens": 5, "stream": True}
    )
    assert status == 200, out
    assert sp.streamed_tokens(out) == sp.monolithic(tokens, 5)
    assert _consumer(system, "prefetch_started") == started
    assert _consumer(system, "claims_hit") == claimed + 1


def test_a_stop_after_the_token_makes_the_producers_answer_the_whole_one(
    system: dict[str, str],
):
    served = _consumer(system, "prefetch_started")
    status, out = sp.post(
        f"{system['stopping']}/v1/completions",
        {"prompt": sp.prompt(seed=95), "max_tokens": 5, "stream": True},
    )
    assert status == 200, out
    assert sp.streamed_tokens(out) == [StoppingProducer.TOKEN]
    finishes = [ev["choices"][0]["finish_reason"] for ev in out if isinstance(ev, dict)]
    assert finishes[-1] == "stop" and "length" not in finishes
    assert _consumer(system, "prefetch_started") == served + 1  # the consumer was told


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [1, 2, 3], "max_tokens": 4},
        {"disagg": {"first_tokens": [9], "x": 1}, "prompt": "a", "stream": True},
        {"prompt": "\u0000first-tokens\u0000", "user": "\u0000first-tokens\u0000"},
    ],
    ids=["plain", "client-disagg", "client-holds-the-slot"],
)
def test_the_encoded_continuation_is_the_continuation(body: dict[str, object]):
    from disagg.proxy.first_token import Template, continuation

    got = json.loads(Template.of(body).fill([5, 6]))
    assert got == continuation(body, [5, 6])
    assert list(got)[-1] == "disagg"
