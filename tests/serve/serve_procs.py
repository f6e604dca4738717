"""Helpers to run `disagg serve` / `disagg proxy` as subprocesses in tests (also used by
tests/test_two_node.py). Every process is started by us and stopped by its own pid."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from disagg.bench.ports import free_port

PROMPT_LEN = 300
SHAPE = dict(num_layers=4, tokens_per_block=32, num_blocks=1024, kv_manager="v2", seed=0)


def prompt(seed: int = 1, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def monolithic(tokens: list[int], max_tokens: int) -> list[int]:
    """The same prompt on the reference engine without any connector."""
    from disagg.engine.reference import Engine, EngineConfig

    return Engine(EngineConfig(**SHAPE)).generate([tokens], max_tokens=max_tokens)[0]


def write_configs(
    d: Path, host_p: str = "127.0.0.1", host_c: str = "127.0.0.1"
) -> tuple[Path, Path]:
    cport, eport, dport = free_port(), free_port(), free_port()
    p = d / "producer.yaml"
    p.write_text(
        f"role: producer\ninstance_id: prefill-t\nproducer:\n"
        f"  control: tcp://{host_p}:{cport}\n  events: tcp://{host_p}:{eport}\n"
        f"  store_size: 256MiB\n"
    )
    c = d / "consumer.yaml"
    c.write_text(
        f"role: consumer\ninstance_id: decode-t\nconsumer:\n"
        f"  producers: [tcp://{host_p}:{cport}]\n  data: tcp://{host_c}:{dport}\n"
    )
    return p, c


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e.pop("DISAGG_CONFIG", None)
    e.pop("TRTLLM_DISAGG_CONFIG", None)
    return e


def spawn(args: list[str], log: Path, prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
    cmd = [*(prefix or []), sys.executable, "-m", "disagg", *args]
    f = open(log, "wb")  # noqa: SIM115 - closed by the process's end
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env())


def serve_args(role: str, config: Path, host: str, port: int) -> list[str]:
    return ["serve", "--role", role, "--config", str(config), "--host", host, "--port", str(port)]


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited rc={proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy in {timeout}s:\n{log.read_text()[-3000:]}")


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def post(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            ctype = r.headers.get("Content-Type", "")
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if ctype.startswith("text/event-stream"):
        return status, sse_events(raw.decode())
    return status, json.loads(raw)


def sse_events(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed_tokens(events: list[Any]) -> list[int]:
    assert events and events[-1] == "[DONE]", events[-3:]
    return [t for ev in events[:-1] for t in ev["choices"][0]["token_ids"]]


def get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (any labels) in Prometheus text."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in metrics"
    return total


def wait_prefix_route(proxy_url: str, tokens: list[int], timeout_s: float = 15.0) -> None:
    """Repeat a prompt until the proxy routes it by prefix: the producer's stored events
    (and the proxy's discovery of its event stream) reach the proxy asynchronously."""
    import time

    routed = 'disagg_proxy_routing_total{reason="prefix"}'
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = post(f"{proxy_url}/v1/completions", {"prompt": tokens, "max_tokens": 2})
        assert status == 200, body
        _, px = get(f"{proxy_url}/metrics")
        if routed in px and metric(px, routed) >= 1:
            return
        assert time.monotonic() < deadline, "the proxy never routed by prefix"
        time.sleep(0.2)


class ThreadedApp:
    """An aiohttp application on its own thread and event loop, on a free loopback port
    (``url``), for stand-in upstreams; subclasses add their routes in ``routes``."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def routes(self, app: Any) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        import asyncio

        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        app = web.Application()
        self.routes(app)
        self._runner = runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
