"""`disagg serve` (both roles, reference engine) + `disagg proxy` as real processes on
127.0.0.1: completions through the proxy match the monolithic engine token for token, and
the metrics show the transfer."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import serve_procs as sp

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("serve")
    pcfg, ccfg = sp.write_configs(d)
    pport, cport, xport, x2port = (sp.free_port() for _ in range(4))
    dead = f"http://127.0.0.1:{sp.free_port()}"  # nothing listens there
    urls = {
        "producer": f"http://127.0.0.1:{pport}",
        "consumer": f"http://127.0.0.1:{cport}",
        "proxy": f"http://127.0.0.1:{xport}",
        "proxy_retry": f"http://127.0.0.1:{x2port}",
        "dead": dead,
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        logs = {k: d / f"{k}.log" for k in ("producer", "consumer", "proxy", "proxy_retry")}
        procs.append(
            sp.spawn(sp.serve_args("producer", pcfg, "127.0.0.1", pport), logs["producer"])
        )
        procs.append(
            sp.spawn(sp.serve_args("consumer", ccfg, "127.0.0.1", cport), logs["consumer"])
        )
        proxy_args = ["proxy", "--host", "127.0.0.1", "--producers", urls["producer"]]
        procs.append(
            sp.spawn(
                [*proxy_args, "--consumers", urls["consumer"], "--port", str(xport)], logs["proxy"]
            )
        )
        # A dead consumer listed first: every request must fail over to the live one.
        procs.append(
            sp.spawn(
                [
                    *proxy_args,
                    "--consumer",
                    dead,
                    "--consumer",
                    urls["consumer"],
                    "--port",
                    str(x2port),
                ],
                logs["proxy_retry"],
            )
        )
        for name, proc in zip(("producer", "consumer", "proxy", "proxy_retry"), procs):
            sp.wait_healthy(urls[name], proc, logs[name])
        yield {"urls": urls, "logs": logs, "procs": procs}
    finally:
        sp.stop(procs)


def test_completion_through_proxy_matches_monolithic(system: dict[str, Any]) -> None:
    urls = system["urls"]
    tokens = sp.prompt(seed=11)
    want = sp.monolithic(tokens, 12)

    status, body = sp.post(f"{urls['proxy']}/v1/completions", {"prompt": tokens, "max_tokens": 12})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == want
    assert body["usage"] == {"prompt_tokens": 300, "completion_tokens": 12, "total_tokens": 312}
    # The consumer loaded the producer's pages rather than computing the prompt.
    assert body["disagg"]["connector_matched_tokens"] == 288

    status, events = sp.post(
        f"{urls['proxy']}/v1/completions", {"prompt": tokens, "max_tokens": 12, "stream": True}
    )
    assert status == 200
    assert sp.streamed_tokens(events) == want
    assert events[-2]["choices"][0]["finish_reason"] == "length"

    _, prod = sp.get(f"{urls['producer']}/metrics")
    _, cons = sp.get(f"{urls['consumer']}/metrics")
    assert sp.metric(prod, "disagg_producer_pages_pushed_total") > 0
    assert sp.metric(prod, "disagg_producer_bytes_pushed_total") > 0
    assert sp.metric(prod, "disagg_producer_store_used_bytes") > 0
    assert sp.metric(prod, "disagg_producer_claims_hit_total") > 0
    assert sp.metric(cons, "disagg_consumer_pages_loaded_total") > 0
    assert sp.metric(cons, "disagg_engine_connector_matched_tokens_total") > 0
    assert sp.metric(cons, "disagg_request_seconds_count") >= 2
    _, px = sp.get(f"{urls['proxy']}/metrics")
    assert sp.metric(px, "disagg_proxy_requests_total") >= 2


def test_text_prompt_and_cache_salt(system: dict[str, Any]) -> None:
    from disagg.serve import tokenizer

    urls = system["urls"]
    text = "The quick brown fox jumps over the lazy dog. " * 4  # 180 bytes -> 5 full blocks
    body = {"prompt": text, "max_tokens": 5, "cache_salt": "tenant-a"}
    status, out = sp.post(f"{urls['proxy']}/v1/completions", body)
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == sp.monolithic(tokenizer.encode(text), 5)
    assert out["choices"][0]["text"] == tokenizer.decode(out["choices"][0]["token_ids"])


def test_second_request_routes_by_prefix(system: dict[str, Any]) -> None:
    urls = system["urls"]
    tokens = sp.prompt(seed=12)
    sp.wait_prefix_route(urls["proxy"], tokens)
    _, px = sp.get(f"{urls['proxy']}/metrics")
    assert sp.metric(px, "disagg_proxy_matched_blocks_total") >= 9


def test_health(system: dict[str, Any]) -> None:
    for name in ("producer", "consumer", "proxy"):
        status, text = sp.get(f"{system['urls'][name]}/health")
        assert status == 200, text


def test_consumer_failover_before_first_token(system: dict[str, Any]) -> None:
    urls = system["urls"]
    tokens = sp.prompt(seed=13)
    want = sp.monolithic(tokens, 4)
    for stream in (False, True):
        status, out = sp.post(
            f"{urls['proxy_retry']}/v1/completions",
            {"prompt": tokens, "max_tokens": 4, "stream": stream},
        )
        assert status == 200, out
        got = sp.streamed_tokens(out) if stream else out["choices"][0]["token_ids"]
        assert got == want
    # The dead consumer is known down (refused connections: a heartbeat or a retry), and
    # /health names why, while the proxy stays healthy on the live one.
    status, text = sp.get(f"{urls['proxy_retry']}/health")
    assert status == 200, text
    assert json.loads(text)["consumers"][urls["dead"]].startswith("unreachable: ")
    _, px = sp.get(f"{urls['proxy_retry']}/metrics")
    assert sp.metric(px, "disagg_proxy_upstream_down_total") >= 1


def test_bad_requests_are_refused_or_forwarded(system: dict[str, Any]) -> None:
    urls = system["urls"]
    status, out = sp.post(f"{urls['proxy']}/v1/completions", {"prompt": [1, 2], "max_tokens": 0})
    assert status == 400
    # The proxy validates the body itself: no upstream saw it.
    assert "max_tokens" in out["error"]["message"] and "upstream" not in out["error"]
    # What only the engine knows (its vocabulary) is the upstream's to refuse.
    status, out = sp.post(f"{urls['proxy']}/v1/completions", {"prompt": [9999], "max_tokens": 1})
    assert status == 400 and "token ids" in out["error"]["message"]
    # A bool or a negative id deep in a long prompt: refused by position, by either server.
    for bad, shown in ((True, "true"), (-3, "-3")):
        ids: list[object] = list(sp.prompt(seed=5, n=12288))
        ids[12000] = bad
        for url in (urls["proxy"], urls["consumer"]):
            status, out = sp.post(f"{url}/v1/completions", {"prompt": ids, "max_tokens": 1})
            assert status == 400 and f"prompt[12000] is {shown}" in out["error"]["message"], out


def test_upstream_down_is_502(tmp_path: Path, system: dict[str, Any]) -> None:
    port = sp.free_port()
    dead = system["urls"]["dead"]
    log = tmp_path / "proxy.log"
    proc = sp.spawn(
        [
            "proxy",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--producers",
            system["urls"]["producer"],
            "--consumers",
            dead,
        ],
        log,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        status, text = 0, ""
        for _ in range(100):
            try:
                status, text = sp.get(f"{url}/health")
                break
            except OSError:  # not listening yet
                time.sleep(0.1)
        assert status == 503 and "unreachable" in text
        status, out = sp.post(f"{url}/v1/completions", {"prompt": [1] * 40, "max_tokens": 2})
        assert status == 502
        assert (
            out["error"]["upstream"] == dead and "every consumer failed" in out["error"]["message"]
        )
        # one token is the producer's whole answer: no consumer is needed for it
        status, out = sp.post(f"{url}/v1/completions", {"prompt": [1] * 40, "max_tokens": 1})
        assert status == 200 and out["choices"][0]["token_ids"] == sp.monolithic([1] * 40, 1)
    finally:
        sp.stop([proc])


def test_chat_through_proxy_matches_monolithic(system: dict[str, Any]) -> None:
    """Chat messages become one prompt through the reference chat template, the same on
    the proxy (routing), the producer and the consumer."""
    from disagg.serve import chat, tokenizer

    urls = system["urls"]
    for stream, topic in ((False, "disaggregated serving"), (True, "KV caches")):
        messages = [
            {"role": "system", "content": "You answer briefly and precisely. " * 5},
            {"role": "user", "content": [{"type": "text", "text": f"Tell me about {topic}. " * 6}]},
        ]
        tokens = tokenizer.encode(chat.render(messages))
        want = sp.monolithic(tokens, 8)
        body = {"model": "m", "messages": messages, "max_tokens": 8, "stream": stream}
        status, out = sp.post(f"{urls['proxy']}/v1/chat/completions", body)
        assert status == 200, out
        if not stream:
            assert out["object"] == "chat.completion"
            choice = out["choices"][0]
            assert choice["token_ids"] == want and choice["message"]["role"] == "assistant"
            assert choice["message"]["content"] == tokenizer.decode(want)
            assert out["disagg"]["connector_matched_tokens"] > 0
            continue
        assert sp.streamed_tokens(out) == want
        assert out[0]["object"] == "chat.completion.chunk"
        assert out[0]["choices"][0]["delta"]["role"] == "assistant"
        # the last chunk carries the usage and what the connector served, as a whole answer
        assert out[-2]["disagg"]["connector_matched_tokens"] > 0
        assert out[-2]["usage"]["completion_tokens"] == 8


def test_streamed_completion_ends_with_matched_tokens(system: dict[str, Any]) -> None:
    urls = system["urls"]
    tokens = sp.prompt(seed=23)
    body = {"prompt": tokens, "max_tokens": 6, "stream": True}
    status, events = sp.post(f"{urls['proxy']}/v1/completions", body)
    assert status == 200, events
    assert sp.streamed_tokens(events) == sp.monolithic(tokens, 6)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["disagg"]["connector_matched_tokens"] == 288


def test_models_on_proxy_and_consumer(system: dict[str, Any]) -> None:
    urls = system["urls"]
    for url in (urls["proxy"], urls["consumer"], urls["producer"]):
        status, text = sp.get(f"{url}/v1/models")
        assert status == 200, text
        body = json.loads(text)
        assert body["object"] == "list" and body["data"][0]["object"] == "model"
        assert body["data"][0]["id"]


def test_chat_bad_messages_refused_by_the_proxy(system: dict[str, Any]) -> None:
    urls = system["urls"]
    for messages, field in (([], "messages"), ([{"role": "wizard", "content": "x"}], "role")):
        status, out = sp.post(f"{urls['proxy']}/v1/chat/completions", {"messages": messages})
        assert status == 400 and field in out["error"]["message"], out
        assert "upstream" not in out["error"]
