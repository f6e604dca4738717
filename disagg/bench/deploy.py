"""Deployments that ``disagg bench serve`` starts on this machine, each process its own.

- **aggregated**: K reference-engine instances without a connector, each prefilling and
  decoding locally (its own device prefix cache on), behind the OpenAI-compatible server of
  :mod:`disagg.serve.app`; started as ``python -m disagg.bench.deploy instance --port N
  [shape flags]``. The client spreads requests by least load (fewest in flight). Given
  several devices, instance i runs on device i mod their number (one per GPU).
- **disaggregated**: P ``disagg serve --role producer`` + D ``disagg serve --role consumer``
  (every consumer knows every producer) + one ``disagg proxy``; clients talk to the proxy.
  Producers run on the producer device, consumers on the consumer device (default: the
  shape's).
- **target**: URLs of deployments already running (nothing is started or stopped).

Every process gets free loopback ports, logs to a file in the run's directory, and is
stopped by its own pid. :meth:`Deployment.start` waits until every server answers (and,
disaggregated, until the proxy's ``/health`` is 200 and it has learnt the producers);
a process that exits or a timeout raises :class:`StartError` with one line naming the
process, its URL and the last line of its log. ``engine_urls`` lists the servers whose
``/metrics`` carry engine and connector counters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .ports import free_port


class StartError(RuntimeError):
    pass


@dataclass
class Shape:
    """Reference-engine shape, the same on every instance (``disagg serve``'s shape flags,
    :data:`disagg.serve.SHAPE_FLAGS`)."""

    layers: int = 4
    tokens_per_block: int = 32
    num_blocks: int = 1024
    seed: int = 0
    device: str = "cpu"
    hidden_size: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_seq_len: int = 8192
    max_num_tokens: int = 8192
    max_batch_size: int = 2048
    dtype: str = "float32"

    def flags(self) -> list[str]:
        from ..serve import SHAPE_FLAGS

        out = []
        for flag in SHAPE_FLAGS:
            out += [flag, str(getattr(self, flag[2:].replace("-", "_")))]
        return out + ["--dtype", self.dtype, "--seed", str(self.seed), "--device", self.device]


def _env(threads: int = 1) -> dict[str, str]:
    """The children's environment: no config from ours, and ``threads`` compute threads
    each (unless OMP_NUM_THREADS is set): several engines on few cores otherwise
    oversubscribe the CPU and their spinning threads slow every step."""
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e.setdefault("OMP_NUM_THREADS", str(threads))
    e.pop("DISAGG_CONFIG", None)
    e.pop("TRTLLM_DISAGG_CONFIG", None)
    return e


@dataclass
class _Proc:
    name: str
    url: str
    log: Path
    cmd: list[str]
    proc: subprocess.Popen[bytes] | None = None


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][-300:] if lines else "(empty log)"


@dataclass
class Deployment:
    name: str
    kind: str  # aggregated | disaggregated | target
    client_urls: list[str]
    engine_urls: list[str] = field(default_factory=list)
    layout: str = ""
    procs: list[_Proc] = field(default_factory=list)
    _ready: list[tuple[_Proc, str]] = field(default_factory=list)  # (proc, readiness path)

    def start(self, timeout_s: float = 120.0) -> None:
        engines = max(1, len(self.engine_urls))
        env = _env(max(1, (os.cpu_count() or 1) // engines))
        try:
            for p, _ in self._ready:
                with open(p.log, "wb") as f:  # the child keeps its own descriptor
                    p.proc = subprocess.Popen(p.cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + timeout_s
            for p, path in self._ready:
                self._wait(p, path, deadline)
        except BaseException:
            self.stop()
            raise

    def _wait(self, p: _Proc, path: str, deadline: float) -> None:
        assert p.proc is not None
        while True:
            rc = p.proc.poll()
            if rc is not None:
                raise StartError(
                    f"{self.name}: {p.name} ({p.url}) exited rc={rc}: {_last_line(p.log)} "
                    f"(log: {p.log})"
                )
            try:
                status, body = _get(p.url + path)
                if status == 200 and self._ready_body(path, body):
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise StartError(
                    f"{self.name}: {p.name} ({p.url}) not ready{path and ' at ' + path} "
                    f"in time: {_last_line(p.log)} (log: {p.log})"
                )
            time.sleep(0.2)

    @staticmethod
    def _ready_body(path: str, body: bytes) -> bool:
        if path != "/health":
            return True
        try:
            d = json.loads(body)
        except ValueError:
            return False
        return d.get("status", "ok") == "ok"

    def stop(self) -> None:
        live = [p.proc for p in self.procs if p.proc is not None and p.proc.poll() is None]
        for proc in live:
            proc.terminate()
        for proc in live:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _proc(name: str, port: int, cmd: list[str], logdir: Path) -> _Proc:
    return _Proc(name, f"http://127.0.0.1:{port}", logdir / f"{name}.log", cmd)


def aggregated(engines: int, shape: Shape, logdir: Path, devices: Sequence[str] = ()) -> Deployment:
    """``engines`` instances; with ``devices``, instance i on ``devices[i % len]``."""
    places = list(dict.fromkeys(devices)) or [shape.device]  # each device once, in order
    layout = f"{engines} instances" + (f" on {','.join(places)}" if len(places) > 1 else "")
    d = Deployment("aggregated", "aggregated", [], layout=layout)
    for i in range(engines):
        port = free_port()
        cmd = [sys.executable, "-m", "disagg.bench.deploy", "instance", "--port", str(port)]
        on = replace(shape, device=places[i % len(places)])
        p = _proc(f"instance-{i}", port, [*cmd, *on.flags()], logdir)
        d.procs.append(p)
        d._ready.append((p, "/v1/models"))
        d.client_urls.append(p.url)
        d.engine_urls.append(p.url)
    return d


def disaggregated(
    producers: int,
    consumers: int,
    shape: Shape,
    logdir: Path,
    transport: str = "tcp",
    store_size: str = "256MiB",
    store_device: str = "cpu",
    producer_device: str | None = None,
    consumer_device: str | None = None,
    proxy_args: tuple[str, ...] = (),
    consumer_section: str = "",
) -> Deployment:
    """Producers' engines on ``producer_device``, consumers' on ``consumer_device`` (None:
    the shape's device); a producer's ``store_device: cuda`` is its engine's GPU.
    ``consumer_section``: more lines of each consumer's ``consumer:`` section."""
    pshape = replace(shape, device=producer_device or shape.device)
    cshape = replace(shape, device=consumer_device or shape.device)
    layout = f"{producers}P+{consumers}D"
    if pshape.device != cshape.device:
        layout += f" ({pshape.device} / {cshape.device})"
    d = Deployment("disaggregated", "disaggregated", [], layout=layout)
    controls: list[str] = []
    serve = [sys.executable, "-m", "disagg", "serve"]
    prod_urls, cons_urls = [], []
    for i in range(producers):
        port, control = free_port(), f"tcp://127.0.0.1:{free_port()}"
        events = f"tcp://127.0.0.1:{free_port()}"
        cfg = logdir / f"producer-{i}.yaml"
        cfg.write_text(
            f"role: producer\ninstance_id: bench-prefill-{i}\ntransport: {transport}\n"
            f"producer:\n  control: {control}\n  events: {events}\n  store_size: {store_size}\n"
            f"  store_device: {store_device}\n"
        )
        controls.append(control)
        cmd = [*serve, "--role", "producer", "--config", str(cfg), "--host", "127.0.0.1"]
        p = _proc(f"producer-{i}", port, [*cmd, "--port", str(port), *pshape.flags()], logdir)
        d.procs.append(p)
        prod_urls.append(p.url)
    for i in range(consumers):
        port = free_port()
        cfg = logdir / f"consumer-{i}.yaml"
        data = f"\n  data: tcp://127.0.0.1:{free_port()}" if transport == "tcp" else ""
        cfg.write_text(
            f"role: consumer\ninstance_id: bench-decode-{i}\ntransport: {transport}\n"
            f"consumer:\n  producers: [{', '.join(controls)}]{data}\n{consumer_section}"
        )
        cmd = [*serve, "--role", "consumer", "--config", str(cfg), "--host", "127.0.0.1"]
        p = _proc(f"consumer-{i}", port, [*cmd, "--port", str(port), *cshape.flags()], logdir)
        d.procs.append(p)
        cons_urls.append(p.url)
    port = free_port()
    cmd = [sys.executable, "-m", "disagg", "proxy", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--producers", ",".join(prod_urls), "--consumers", ",".join(cons_urls)]
    cmd += proxy_args
    proxy = _proc("proxy", port, cmd, logdir)
    d.procs.append(proxy)
    # producers first (consumers connect to them), then consumers, then the proxy
    d._ready = [(p, "/health") for p in d.procs[:-1]] + [(proxy, "/health")]
    d.client_urls = [proxy.url]
    d.engine_urls = prod_urls + cons_urls
    return d


def target(url: str) -> Deployment:
    u = url.rstrip("/")
    return Deployment(f"target {u}", "target", [u], layout="external")


def wait_routing(d: Deployment, producers: int, timeout_s: float = 30.0) -> None:
    """Disaggregated: until the proxy knows every producer's blocks (its gauge of known
    blocks is exported per producer once discovery ran)."""
    if d.kind != "disaggregated":
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _, body = _get(d.client_urls[0] + "/metrics")
            text = body.decode()
            if text.count("disagg_proxy_producer_known_blocks{") >= producers:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)


# --------------------------------------------------------------------------- instance


def run_instance(argv: list[str]) -> int:
    """One aggregated instance: the reference engine without a connector, served."""
    from ..serve import add_shape_args, logs, shape_kwargs

    ap = argparse.ArgumentParser(prog="python -m disagg.bench.deploy instance")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    add_shape_args(ap)
    args = ap.parse_args(argv)
    logs.setup("info")  # each request's moments (``bench overhead --http``'s local split)

    from ..engine.reference import Engine, EngineConfig
    from ..serve.app import build_app
    from ..serve.engine_loop import EngineLoop
    from ..serve.runner import run_app

    ecfg = EngineConfig(kv_manager="v2", **shape_kwargs(args))
    loop = EngineLoop(lambda: Engine(ecfg))
    loop.start()
    app = build_app(loop, "aggregated", f"bench-instance-{args.port}")

    async def on_cleanup(_app: Any) -> None:
        loop.stop()

    app.on_cleanup.append(on_cleanup)
    print(f"aggregated instance on http://{args.host}:{args.port}", flush=True)
    run_app(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["instance"]:
        raise SystemExit(run_instance(sys.argv[2:]))
    raise SystemExit("usage: python -m disagg.bench.deploy instance --port N [shape flags]")
