"""The client's first token comes from the producer, and the consumer continues after it:
`disagg serve` (both roles) and `disagg proxy` as real processes on 127.0.0.1. Every answer
equals the monolithic engine's, token for token; the edge cases of the hand-over (one
token, a character split across the first two tokens, an upstream without the extension, a
consumer failing before its first byte) keep it so."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import serve_procs as sp
from aiohttp import ClientSession, web

from disagg.serve import chat, tokenizer

pytestmark = pytest.mark.timeout(180)


class Relay(sp.ThreadedApp):
    """An upstream in front of a real server, standing for one without our extension:
    ``no_info`` answers 404 to ``/disagg/info`` (a consumer that takes no continuation, as
    ``trtllm-serve``); ``no_ids`` strips ``token_ids`` from the answers (a producer that
    gives none); ``dies`` drops every completion's connection unanswered (a consumer
    killed before its first byte). Counts the completions it forwards."""

    def __init__(self, target: str, mode: str) -> None:
        self.target, self.mode, self.forwarded = target, mode, 0
        super().__init__()

    def _strip(self, data: bytes) -> bytes:
        if self.mode != "no_ids":
            return data
        out = []
        for line in data.split(b"\n"):
            if line.startswith(b"data: {") or line.startswith(b"{"):
                pre = b"data: " if line.startswith(b"data: ") else b""
                d = json.loads(line[len(pre) :])
                for c in d.get("choices", []):
                    c.pop("token_ids", None)
                line = pre + json.dumps(d).encode()
            out.append(line)
        return b"\n".join(out)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/disagg/info" and self.mode == "no_info":
            return web.json_response({"error": {"message": "not found"}}, status=404)
        body = await request.read()
        if request.method == "POST":
            self.forwarded += 1
            if self.mode == "dies":
                assert request.transport is not None
                request.transport.close()
                raise ConnectionResetError("the relay died")
        async with (
            ClientSession() as s,
            s.request(
                request.method, self.target + request.path_qs, data=body, headers=request.headers
            ) as r,
        ):
            data = self._strip(await r.read())
            return web.Response(
                body=data, status=r.status, headers={"Content-Type": r.headers["Content-Type"]}
            )

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self._handle)


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("first")
    pcfg, ccfg = sp.write_configs(d)
    ports = {k: sp.free_port() for k in ("producer", "consumer", "proxy", "plain", "retry")}
    urls = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
    procs: list[subprocess.Popen[bytes]] = []
    relays: list[Relay] = []
    logs = {k: d / f"{k}.log" for k in ports}
    try:
        for role, cfg in (("producer", pcfg), ("consumer", ccfg)):
            procs.append(sp.spawn(sp.serve_args(role, cfg, "127.0.0.1", ports[role]), logs[role]))
        for name in ("producer", "consumer"):
            sp.wait_healthy(urls[name], procs[-2 if name == "producer" else -1], logs[name])
        no_info = Relay(urls["consumer"], "no_info")
        no_ids = Relay(urls["producer"], "no_ids")
        dies = Relay(urls["consumer"], "dies")
        relays += [no_info, no_ids, dies]

        def proxy(name: str, producers: list[str], consumers: list[str]) -> None:
            args = ["proxy", "--host", "127.0.0.1", "--port", str(ports[name])]
            for u in producers:
                args += ["--producer", u]
            for u in consumers:
                args += ["--consumer", u]
            procs.append(sp.spawn(args, logs[name]))
            sp.wait_healthy(urls[name], procs[-1], logs[name])

        proxy("proxy", [urls["producer"]], [urls["consumer"]])
        # the plain path: a producer without token ids, or a consumer without the extension
        proxy("plain", [no_ids.url], [no_info.url])
        # a consumer failing before its first byte: retried on the next one
        proxy("retry", [urls["producer"]], [dies.url, urls["consumer"]])
        yield {"urls": urls, "no_info": no_info, "no_ids": no_ids, "dies": dies}
    finally:
        for r in relays:
            r.close()
        sp.stop(procs)


def _metric(url: str, name: str, label: str) -> float:
    _, text = sp.get(f"{url}/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line
    )


def _requests(url: str) -> float:
    return _metric(url, "disagg_requests_total", 'outcome="ok"')


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("chat_api", [False, True], ids=["completions", "chat"])
def test_first_token_from_the_producer(system: dict[str, Any], stream: bool, chat_api: bool):
    urls = system["urls"]
    if chat_api:
        messages = [{"role": "user", "content": "Say something about KV caches. " * 8}]
        tokens = tokenizer.encode(chat.render(messages))
        path, body = "/v1/chat/completions", {"messages": messages}
    else:
        tokens = sp.prompt(seed=61 + stream)
        path, body = "/v1/completions", {"prompt": tokens}
    want = sp.monolithic(tokens, 7)
    before = _metric(urls["proxy"], "disagg_proxy_first_token_total", 'source="producer"')
    status, out = sp.post(f"{urls['proxy']}{path}", {**body, "max_tokens": 7, "stream": stream})
    assert status == 200, out
    after = _metric(urls["proxy"], "disagg_proxy_first_token_total", 'source="producer"')
    assert after == before + 1, "the consumer computed the first token again"
    if not stream:
        choice = out["choices"][0]
        assert choice["token_ids"] == want
        text = choice["message"]["content"] if chat_api else choice["text"]
        assert text == tokenizer.decode(want)
        assert out["usage"]["completion_tokens"] == 7
        assert out["usage"]["prompt_tokens"] == len(tokens)
        assert out["disagg"]["connector_matched_tokens"] > 0
        return
    assert sp.streamed_tokens(out) == want
    assert out[0]["choices"][0]["token_ids"] == want[:1]  # the producer's chunk
    if chat_api:  # the role comes once, with the first delta
        roles = [ev["choices"][0]["delta"].get("role") for ev in out[:-1]]
        assert roles[0] == "assistant" and not any(roles[1:])
    last = out[-2]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 7
    assert last["disagg"]["connector_matched_tokens"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_one_token_is_the_producers_answer(system: dict[str, Any], stream: bool):
    urls = system["urls"]
    tokens = sp.prompt(seed=71 + stream)
    served = _requests(urls["consumer"])
    status, out = sp.post(
        f"{urls['proxy']}/v1/completions", {"prompt": tokens, "max_tokens": 1, "stream": stream}
    )
    assert status == 200, out
    got = sp.streamed_tokens(out) if stream else out["choices"][0]["token_ids"]
    assert got == sp.monolithic(tokens, 1)
    if not stream:
        assert out["usage"]["completion_tokens"] == 1
    assert _requests(urls["consumer"]) == served, "a consumer was asked for one token"


def _split_character_prompt() -> tuple[list[int], list[int]]:
    """A prompt whose first two answer tokens are the two bytes of one UTF-8 character."""
    from disagg.engine.reference import Engine, EngineConfig

    eng = Engine(EngineConfig(**sp.SHAPE))
    for seed in range(500):
        tokens = sp.prompt(seed=1000 + seed, n=100)
        out = eng.generate([tokens], max_tokens=4)[0]
        a, b = out[0] % 256, out[1] % 256
        if 0xC2 <= a <= 0xDF and 0x80 <= b <= 0xBF:
            return tokens, out
    pytest.fail("no prompt of 500 starts its answer with a two-byte character")


def test_a_character_split_across_the_first_two_tokens_streams_whole(system: dict[str, Any]):
    urls = system["urls"]
    tokens, want = _split_character_prompt()
    status, out = sp.post(
        f"{urls['proxy']}/v1/completions", {"prompt": tokens, "max_tokens": 4, "stream": True}
    )
    assert status == 200, out
    assert sp.streamed_tokens(out) == want
    text = "".join(ev["choices"][0]["text"] for ev in out[:-1])
    assert text == tokenizer.decode(want)
    assert out[0]["choices"][0]["text"] == "", "half a character was sent as text"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_upstreams_without_the_extension_take_the_plain_path(
    system: dict[str, Any], stream: bool
) -> None:
    urls = system["urls"]
    tokens = sp.prompt(seed=81 + stream)
    want = sp.monolithic(tokens, 5)
    status, out = sp.post(
        f"{urls['plain']}/v1/completions", {"prompt": tokens, "max_tokens": 5, "stream": stream}
    )
    assert status == 200, out
    got = sp.streamed_tokens(out) if stream else out["choices"][0]["token_ids"]
    assert got == want
    # the producer's answer had no ids: the consumer computed the first token itself
    reason = 'source="producer_gave_no_token_ids"'
    assert _metric(urls["plain"], "disagg_proxy_first_token_total", reason) >= 1
    _, health = sp.get(f"{urls['plain']}/health")
    assert json.loads(health)["first_token_plain_path"]["producer_gave_no_token_ids"] >= 1


def test_a_consumer_without_continuations_computes_the_first_token(system: dict[str, Any]):
    """A producer with ids in front of a consumer without the extension (the relay of the
    real consumer answers no /disagg/info)."""
    urls, no_info = system["urls"], system["no_info"]
    port = sp.free_port()
    log = Path(sp.__file__).parent / f".proxy-{port}.log"
    proc = sp.spawn(
        [
            "proxy",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--producer",
            urls["producer"],
            "--consumer",
            no_info.url,
        ],
        log,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        sp.wait_healthy(url, proc, log)
        tokens = sp.prompt(seed=91)
        status, out = sp.post(f"{url}/v1/completions", {"prompt": tokens, "max_tokens": 5})
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == sp.monolithic(tokens, 5)
        reason = 'source="consumer_takes_no_continuation"'
        assert _metric(url, "disagg_proxy_first_token_total", reason) == 1
        _, health = sp.get(f"{url}/health")
        body = json.loads(health)
        assert body["status"] == "ok"
        assert body["first_token_plain_path"]["consumer_takes_no_continuation"] == 1
    finally:
        sp.stop([proc])
        log.unlink(missing_ok=True)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_consumer_failing_before_its_first_byte_is_retried_with_the_first_token(
    system: dict[str, Any], stream: bool
) -> None:
    urls = system["urls"]
    tokens = sp.prompt(seed=101 + stream)
    status, out = sp.post(
        f"{urls['retry']}/v1/completions", {"prompt": tokens, "max_tokens": 6, "stream": stream}
    )
    assert status == 200, out
    got = sp.streamed_tokens(out) if stream else out["choices"][0]["token_ids"]
    assert got == sp.monolithic(tokens, 6)
    assert system["dies"].forwarded >= 1, "the failing consumer was never tried"
    _, metrics = sp.get(f"{urls['retry']}/metrics")
    assert sp.metric(metrics, "disagg_proxy_consumer_retries_total") >= 1
    assert _metric(urls["retry"], "disagg_proxy_first_token_total", 'source="producer"') >= 1


def test_a_continuation_the_consumer_cannot_serve_is_refused_by_name(system: dict[str, Any]):
    urls = system["urls"]
    tokens = sp.prompt(seed=111)
    for ext, field in (
        ({"first_tokens": [1, 2, 3]}, "leave nothing"),
        ({"first_tokens": [-1]}, "disagg.first_tokens"),
        ("x", "disagg: must be an object"),
    ):
        body = {"prompt": tokens, "max_tokens": 3, "disagg": ext}
        status, out = sp.post(f"{urls['consumer']}/v1/completions", body)
        assert status == 400 and field in out["error"]["message"], out
