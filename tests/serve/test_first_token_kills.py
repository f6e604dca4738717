"""Real kills around the first token: `disagg serve` processes SIGKILLed by the test at a
known point of their forward (``stalling_serve.py`` stops the engine there), behind a real
`disagg proxy`. The client gets the monolithic engine's tokens, or a clear error event;
never a wrong token, and the proxy keeps serving.

- a producer killed in the middle of its prefill (before its answer): the proxy tries
  the next producer;
- a decode instance killed between the client's first token (the producer's) and its
  second: the proxy sends the continuation to the next consumer; with none left, the
  stream ends with an error event naming the dead one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import serve_procs as sp

pytestmark = pytest.mark.timeout(180)

STALLING = Path(__file__).with_name("stalling_serve.py")
MAX_TOKENS = 6
ZONE_YAML = "  landing_zone_size: 16MiB\n"


def _producer_yaml(d: Path, name: str) -> tuple[Path, str]:
    control = f"tcp://127.0.0.1:{sp.free_port()}"
    p = d / f"{name}.yaml"
    p.write_text(
        f"role: producer\ninstance_id: {name}\nproducer:\n  control: {control}\n"
        f"  events: tcp://127.0.0.1:{sp.free_port()}\n  store_size: 64MiB\n"
    )
    return p, control


def _consumer_yaml(d: Path, name: str, control: str, extra: str = "") -> Path:
    c = d / f"{name}.yaml"
    c.write_text(
        f"role: consumer\ninstance_id: {name}\nconsumer:\n  producers: [{control}]\n"
        f"  data: tcp://127.0.0.1:{sp.free_port()}\n{extra}"
    )
    return c


class Victim:
    """A server that stops at its first forward's layer-1 save hook, to be SIGKILLed."""

    def __init__(self, d: Path, name: str, role: str, cfg: Path, layer: int = 1, **env_: str):
        self.port = sp.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stalled = d / f"{name}.stalled"
        self.log = d / f"{name}.log"
        env = dict(
            sp.env(), DISAGG_TEST_STALL_LAYER=str(layer), DISAGG_TEST_STALL_FILE=str(self.stalled)
        )
        env.update(env_)
        args = sp.serve_args(role, cfg, "127.0.0.1", self.port)
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, str(STALLING), *args], stdout=f, stderr=subprocess.STDOUT, env=env
            )

    def kill_when_stalled(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.stalled.exists():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server never reached the stall point"
            time.sleep(0.02)
        assert int(self.stalled.read_text()) == self.proc.pid
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=10) == -signal.SIGKILL


class Pausing(Victim):
    """A consumer that stops at its first scheduler query (a continuation, before its
    claim) until ``resume``."""

    def __init__(self, d: Path, name: str, cfg: Path) -> None:
        self.resume_file = d / f"{name}.resume"
        super().__init__(
            d,
            name,
            "consumer",
            cfg,
            DISAGG_TEST_STALL_HOOK="get_num_new_matched_tokens",
            DISAGG_TEST_RESUME_FILE=str(self.resume_file),
        )

    def wait_stalled(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.stalled.exists():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the consumer never reached its claim"
            time.sleep(0.02)

    def resume(self) -> None:
        self.resume_file.write_text("go")


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("kills")
    pcfg, control = _producer_yaml(d, "prefill-ok")
    vcfg, _ = _producer_yaml(d, "prefill-victim")
    urls = {k: f"http://127.0.0.1:{sp.free_port()}" for k in ("producer", "consumer")}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for role, cfg in (
            ("producer", pcfg),
            ("consumer", _consumer_yaml(d, "decode-ok", control)),
        ):
            port = int(urls[role].rsplit(":", 1)[1])
            procs.append(sp.spawn(sp.serve_args(role, cfg, "127.0.0.1", port), d / f"{role}.log"))
        victims = {
            "producer": Victim(d, "prefill-victim", "producer", vcfg),
            "consumer": Victim(
                d, "decode-victim", "consumer", _consumer_yaml(d, "decode-victim", control)
            ),
            "last_consumer": Victim(
                d, "decode-last", "consumer", _consumer_yaml(d, "decode-last", control)
            ),
        }
        procs += [v.proc for v in victims.values()]
        for (name, url), proc in zip(urls.items(), procs, strict=False):
            sp.wait_healthy(url, proc, d / f"{name}.log")
        for v in victims.values():
            sp.wait_healthy(v.url, v.proc, v.log)
        # a producer killed after its first token: the consumer stops before its claim
        # (its prefetch has leased the victim's blocks meanwhile) until the kill is done
        late_cfg, late_control = _producer_yaml(d, "prefill-late")
        late = Victim(d, "prefill-late", "producer", late_cfg, layer=99)
        pausing = Pausing(d, "decode-pausing", _consumer_yaml(d, "decode-pausing", late_control))
        victims["late_producer"] = late
        # a producer killed mid-prefill while a landing zone waits for its pages: the
        # zone's consumer knows it and the surviving producer; its rows are reserved at the
        # first layer's save, so the prefetch leases them before the stall
        zcfg, zcontrol = _producer_yaml(d, "prefill-zone")
        zvictim = victims["zone_producer"] = Victim(
            d, "prefill-zone", "producer", zcfg, DISAGG_SAVE_RESERVE_LAYERS="1"
        )
        zone = sp.spawn(
            sp.serve_args(
                "consumer",
                _consumer_yaml(d, "decode-zone", f"{zcontrol}, {control}", ZONE_YAML),
                "127.0.0.1",
                zone_port := sp.free_port(),
            ),
            d / "decode-zone.log",
        )
        zone_url = f"http://127.0.0.1:{zone_port}"
        procs += [late.proc, pausing.proc, zvictim.proc, zone]
        sp.wait_healthy(late.url, late.proc, late.log)
        sp.wait_healthy(pausing.url, pausing.proc, pausing.log)
        sp.wait_healthy(zvictim.url, zvictim.proc, zvictim.log)
        sp.wait_healthy(zone_url, zone, d / "decode-zone.log")
        proxies = {  # each tries its victim first (ties keep the order given)
            "producer": ([victims["producer"].url, urls["producer"]], [urls["consumer"]]),
            "consumer": ([urls["producer"]], [victims["consumer"].url, urls["consumer"]]),
            "last_consumer": ([urls["producer"]], [victims["last_consumer"].url]),
            "late_producer": ([late.url, urls["producer"]], [pausing.url]),
            "zone": ([zvictim.url, urls["producer"]], [zone_url]),
        }
        proxy_urls = {}
        for name, (producers, consumers) in proxies.items():
            port = sp.free_port()
            args = ["proxy", "--host", "127.0.0.1", "--port", str(port)]
            args += [a for u in producers for a in ("--producer", u)]
            args += [a for u in consumers for a in ("--consumer", u)]
            procs.append(sp.spawn(args, d / f"proxy-{name}.log"))
            proxy_urls[name] = f"http://127.0.0.1:{port}"
            sp.wait_healthy(proxy_urls[name], procs[-1], d / f"proxy-{name}.log")
        yield {
            "proxies": proxy_urls,
            "victims": victims,
            "pausing": pausing,
            "zone_consumer": zone_url,
        }
    finally:
        sp.stop(procs)


def _in_background(url: str, body: dict[str, Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(sp.post(url, body, timeout=90)), daemon=True)
    t.start()
    return t, out


def _answer(url: str, victim: Victim, seed: int) -> tuple[list[int], list[Any]]:
    """Stream a fresh prompt through ``url``, kill ``victim`` at its stall point."""
    tokens = sp.prompt(seed=seed)
    body = {"prompt": tokens, "max_tokens": MAX_TOKENS, "stream": True}
    assert not victim.stalled.exists(), "stalled before this request: the kill would miss it"
    t, out = _in_background(f"{url}/v1/completions", body)
    victim.kill_when_stalled()
    t.join(90)
    assert out, "the client got no answer"
    status, events = out[0]
    assert status == 200, events
    return tokens, events


def _still_serves(url: str, seed: int) -> None:
    assert sp.get(f"{url}/health")[0] == 200
    tokens = sp.prompt(seed=seed)
    status, out = sp.post(f"{url}/v1/completions", {"prompt": tokens, "max_tokens": MAX_TOKENS})
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == sp.monolithic(tokens, MAX_TOKENS)


def test_a_producer_killed_mid_prefill_is_replaced_by_the_next(system: dict[str, Any]) -> None:
    url = system["proxies"]["producer"]
    tokens, events = _answer(url, system["victims"]["producer"], seed=301)
    assert sp.streamed_tokens(events) == sp.monolithic(tokens, MAX_TOKENS)
    _, metrics = sp.get(f"{url}/metrics")
    assert sp.metric(metrics, "disagg_proxy_upstream_errors_total") >= 1
    _still_serves(url, seed=302)


def test_a_decode_instance_killed_before_the_second_token_is_replaced(
    system: dict[str, Any],
) -> None:
    url = system["proxies"]["consumer"]
    tokens, events = _answer(url, system["victims"]["consumer"], seed=311)
    assert sp.streamed_tokens(events) == sp.monolithic(tokens, MAX_TOKENS)
    _, metrics = sp.get(f"{url}/metrics")
    assert sp.metric(metrics, "disagg_proxy_consumer_retries_total") >= 1
    _still_serves(url, seed=312)


def test_the_last_decode_instance_killed_ends_the_stream_with_an_error(
    system: dict[str, Any],
) -> None:
    url = system["proxies"]["last_consumer"]
    victim = system["victims"]["last_consumer"]
    tokens, events = _answer(url, victim, seed=321)
    assert events[-1] == "[DONE]"
    *data, err = events[:-1]
    got = [t for ev in data for t in ev["choices"][0]["token_ids"]]
    assert got == sp.monolithic(tokens, 1), "the first token is the producer's, and right"
    assert victim.url in err["error"]["message"] and err["error"]["code"] == 502, err
    status, health = sp.get(f"{url}/health")  # up, answering, with no consumer left
    assert status == 503 and "consumer" in health, health
    status, out = sp.post(f"{url}/v1/completions", {"prompt": tokens, "max_tokens": 2})
    assert status == 502 and victim.url in out["error"]["message"], out


def test_a_producer_killed_after_its_first_token_costs_a_recompute(
    system: dict[str, Any],
) -> None:
    """The producer answers the first token and dies before the consumer claims; the
    consumer's prefetched lease on it is found dead when taken, its fresh claim misses, and
    it computes the prompt itself: the client's tokens are the monolithic run's."""
    url = system["proxies"]["late_producer"]
    victim, pausing = system["victims"]["late_producer"], system["pausing"]
    tokens = sp.prompt(seed=331)
    body = {"prompt": tokens, "max_tokens": MAX_TOKENS, "stream": True}
    t, out = _in_background(f"{url}/v1/completions", body)
    pausing.wait_stalled()  # the continuation reached the consumer: the first token is out
    # the producer commits its blocks after answering: the kill waits for the prefetch's
    # lease on them, or the take would find no lease to drop
    deadline = time.monotonic() + 30
    while _counter(pausing.url, "prefetch_granted") < 1:
        assert time.monotonic() < deadline, "the prefetch was never granted its lease"
        time.sleep(0.02)
    os.kill(victim.proc.pid, signal.SIGKILL)
    assert victim.proc.wait(timeout=10) == -signal.SIGKILL
    pausing.resume()
    t.join(90)
    assert out, "the client got no answer"
    status, events = out[0]
    assert status == 200, events
    assert sp.streamed_tokens(events) == sp.monolithic(tokens, MAX_TOKENS)
    _, metrics = sp.get(f"{pausing.url}/metrics")
    assert sp.metric(metrics, "disagg_consumer_prefetch_dropped_down_total") == 1
    _still_serves(url, seed=332)


def _counter(url: str, name: str) -> float:
    """A consumer counter (``disagg_consumer_<name>_total``); 0 before its first count."""
    _, text = sp.get(f"{url}/metrics")
    full = f"disagg_consumer_{name}_total"
    return sp.metric(text, full) if full in text else 0.0


def test_a_producer_killed_while_the_landing_zone_fills_is_never_read(
    system: dict[str, Any],
) -> None:
    """The consumer's prefetch leases the victim's planned blocks and has them pushed into
    its landing zone; the victim dies mid-prefill before sending a page. The proxy's next
    producer prefills; taking the lease finds the fill unfinished and its producer gone,
    aborts the fill and claims afresh from the survivor: the monolithic tokens."""
    url, cons = system["proxies"]["zone"], system["zone_consumer"]
    victim = system["victims"]["zone_producer"]
    tokens = sp.prompt(seed=341)
    body = {"prompt": tokens, "max_tokens": MAX_TOKENS, "stream": True}
    t, out = _in_background(f"{url}/v1/completions", body)
    deadline = time.monotonic() + 60
    while not (victim.stalled.exists() and _counter(cons, "zone_fills") >= 1):
        assert victim.proc.poll() is None and time.monotonic() < deadline, "no zone fill"
        time.sleep(0.02)
    victim.kill_when_stalled()
    t.join(90)
    assert out, "the client got no answer"
    status, events = out[0]
    assert status == 200, events
    assert sp.streamed_tokens(events) == sp.monolithic(tokens, MAX_TOKENS)
    assert _counter(cons, "prefetch_dropped_down") == 1 and _counter(cons, "zone_loads") == 0
    _still_serves(url, seed=342)  # the survivor's pages, through the zone
    assert _counter(cons, "zone_loads") == 1
