"""Producer and consumer `disagg serve` processes of different TP sizes (reference engine,
every rank simulated in its process), each pair behind its own `disagg proxy`: producer
TP 2 into consumer TP 1 (a consumer page merged from both producer ranks' heads) and TP 1
into TP 2 (one producer page split over both consumer ranks), 4 KV heads. Every answer,
streamed or not, equals the monolithic engine's token for token; the consumer loaded every
whole block of the prompt (its pages counted, every producer rank's pushes counted), took
the lease its prefetch held on every producer rank, and its engine thread claimed nothing.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import serve_procs as sp

pytestmark = pytest.mark.timeout(180)

KV_HEADS = 4
SHAPE_ARGS = ["--kv-heads", str(KV_HEADS)]
TPB = sp.SHAPE["tokens_per_block"]


def _producer_yaml(d: Path, name: str, tp: int) -> Path:
    path = d / f"{name}.yaml"
    path.write_text(
        f"role: producer\ninstance_id: {name}\ntensor_parallel_size: {tp}\nproducer:\n"
        "  control: tcp://127.0.0.1:0\n  events: tcp://127.0.0.1:0\n  store_size: 64MiB\n"
    )
    return path


def _consumer_yaml(d: Path, name: str, controls: list[str]) -> Path:
    path = d / f"{name}.yaml"
    path.write_text(
        f"role: consumer\ninstance_id: {name}\nconsumer:\n"
        f"  producers: [{json.dumps(controls)}]\n  claim_timeout_s: 3\n"
    )
    return path


Started = tuple[str, subprocess.Popen[bytes], Path, Callable[[], "Started"]]


def _start(d: Path, procs: list[subprocess.Popen[bytes]], args: list[str], name: str) -> Started:
    """Spawn on a free port; with the way to spawn it again on another one."""
    port = sp.free_port()
    log = d / f"{name}.log"
    procs.append(sp.spawn([*args, "--host", "127.0.0.1", "--port", str(port)], log))
    return f"http://127.0.0.1:{port}", procs[-1], log, lambda: _start(d, procs, args, name)


def _healthy(started: list[Started]) -> list[str]:
    """Each server's URL once healthy. Servers started at once bind ports of their own
    while they start, so one may take the port another was handed before it bound it:
    that one is started again on another port."""
    urls = []
    for url, proc, log, again in started:
        for _ in range(3):
            try:
                sp.wait_healthy(url, proc, log)
                break
            except RuntimeError:
                if "address already in use" not in log.read_text():
                    raise
                url, proc, log, again = again()
        urls.append(url)
    return urls


def _info(url: str) -> dict[str, Any]:
    status, text = sp.get(f"{url}/disagg/info")
    assert status == 200, text
    return dict(json.loads(text))


PAIRS = ((2, 1), (1, 2))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[int, int], Any]]:
    """Every pair's processes, each stage started at once (producers, consumers, proxies)."""
    d = tmp_path_factory.mktemp("serve-tp")
    procs: list[subprocess.Popen[bytes]] = []

    def serve(role: str, cfg: Path, extra: list[str]) -> list[str]:
        return ["serve", "--role", role, "--config", str(cfg), *SHAPE_ARGS, *extra]

    try:
        # the producer's TP size from its config, the consumer's from --tp
        producers = _healthy(
            [
                _start(
                    d, procs, serve("producer", _producer_yaml(d, f"p{p}{c}", p), []), f"p{p}{c}"
                )
                for p, c in PAIRS
            ]
        )
        controls = []
        for (p, _), url in zip(PAIRS, producers):
            info = _info(url)
            assert (info["tp"], info["num_kv_heads"], info["engine"]["tp"]) == (p, KV_HEADS, p)
            assert len(info["controls"]) == p
            controls.append(info["controls"])
        consumers = _healthy(
            [
                _start(
                    d,
                    procs,
                    serve("consumer", _consumer_yaml(d, f"c{p}{c}", ctl), ["--tp", str(c)]),
                    f"c{p}{c}",
                )
                for (p, c), ctl in zip(PAIRS, controls)
            ]
        )
        for (p, c), url in zip(PAIRS, consumers):
            info = _info(url)
            assert (info["tp"], info["producer_tps"], info["prefetch"]) == (c, [p], True)
        proxies = _healthy(
            [
                _start(d, procs, ["proxy", "--producer", pu, "--consumer", cu], f"x{i}")
                for i, (pu, cu) in enumerate(zip(producers, consumers))
            ]
        )
        yield {
            pair: {"producer": pu, "consumer": cu, "proxy": xu}
            for pair, pu, cu, xu in zip(PAIRS, producers, consumers, proxies)
        }
    finally:
        sp.stop(procs)


def _counter(url: str, name: str) -> float:
    _, text = sp.get(f"{url}/metrics")
    return sp.metric(text, name) if name in text else 0.0


def _monolithic(tokens: list[int], max_tokens: int) -> list[int]:
    from disagg.engine.reference import Engine, EngineConfig

    cfg = EngineConfig(**sp.SHAPE, num_kv_heads=KV_HEADS)
    return Engine(cfg).generate([tokens], max_tokens=max_tokens)[0]


COUNTERS = {
    "consumer": (
        "disagg_consumer_pages_loaded_total",
        "disagg_consumer_prefetch_taken_total",
        "disagg_consumer_claims_hit_total",
    ),
    "producer": ("disagg_producer_pages_pushed_total",),
}


def _counters(urls: dict[str, str]) -> dict[str, float]:
    return {name: _counter(urls[role], name) for role, names in COUNTERS.items() for name in names}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("p", "d"), PAIRS, ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_unequal_tp_through_the_proxy_matches_monolithic(
    pairs: dict[tuple[int, int], Any], p: int, d: int, stream: bool
):
    urls = pairs[(p, d)]
    tokens = sp.prompt(seed=10 * p + d + stream)
    want = _monolithic(tokens, 5)
    before = _counters(urls)
    status, out = sp.post(
        f"{urls['proxy']}/v1/completions", {"prompt": tokens, "max_tokens": 5, "stream": stream}
    )
    assert status == 200, out
    got = sp.streamed_tokens(out) if stream else out["choices"][0]["token_ids"]
    assert got == want
    blocks = len(tokens) // TPB
    matched = (out[-2] if stream else out)["disagg"]["connector_matched_tokens"]
    assert matched == blocks * TPB  # every whole block of the prompt loaded, none computed
    grew = {k: v - before[k] for k, v in _counters(urls).items()}
    # every consumer rank loaded its heads of every block; every producer rank holding
    # heads a consumer rank needs pushed them (TP 2 -> 1: both ranks; 1 -> 2: twice)
    assert grew["disagg_consumer_pages_loaded_total"] == blocks * d
    assert grew["disagg_producer_pages_pushed_total"] == blocks * max(p, d)
    assert grew["disagg_consumer_prefetch_taken_total"] == 1  # every producer rank's lease
    assert grew["disagg_consumer_claims_hit_total"] == 0, "the engine thread claimed anyway"


def test_every_rank_counts_under_its_instance_once(pairs: dict[tuple[int, int], Any]):
    """The ranks of one instance in one process are summed into one series per labels (a
    Prometheus scrape refuses a repeated series)."""
    for urls in pairs.values():
        for role in ("producer", "consumer"):
            _, text = sp.get(f"{urls[role]}/metrics")
            series = [ln.rsplit(" ", 1)[0] for ln in text.splitlines() if ln[:1] not in "#"]
            assert series and len(series) == len(set(series)), role
