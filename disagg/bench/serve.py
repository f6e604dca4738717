"""``disagg bench serve``: serving latency and throughput on a request trace, aggregated
against disaggregated, over the real HTTP path.

    disagg bench serve --trace T.jsonl [--limit N] [--time-scale S] [--length-scale L]
                       [--seed S] [--engines K] [--producers P] [--transport tcp|ipc|ucx]
                       [--store-size 256MiB] [--store-device cpu|pinned|cuda]
                       [--layers 4 --hidden-size 128 --heads 4 --kv-heads 2 --head-dim 32
                        --intermediate-size 256 --dtype float32 --device cpu|cuda[:N]
                        --num-blocks 1024 --tokens-per-block 32 --max-seq-len 8192
                        --max-num-tokens 8192 --max-batch-size 2048]
                       [--producer-device D --consumer-device D] (default: --device)
                       [--deployments aggregated,disaggregated] [--target URL ...]
                       [--slo-ttft 1s] [--slo-tbt 100ms] [--quick] [--json] [--plot PNG]
    disagg bench serve --rate R --requests N [--input-len I] [--output-len O]
                       [--shared-prefix F] [--prefix-groups G] ...   (synthetic workload)

Workload: each trace line becomes a prompt (:func:`disagg.bench.traces.prompt_tokens`:
one fixed seeded block of token ids per hash id) of ``input_length * length_scale``
tokens in blocks of ``512 * length_scale``, asking for ``output_length * length_scale``
tokens (cut to fit the engine's ``--max-seq-len``), sent at ``timestamp *
time_scale``. The scale is rounded so that a trace block is a whole number of engine
blocks (``--tokens-per-block``), so shared trace prefixes are shared engine blocks. ``--rate`` makes a synthetic one (Poisson arrivals, shared prefixes from
``--prefix-groups`` documents for a ``--shared-prefix`` share of the requests); a list of
rates (``--rate 1,3,10``) makes one per rate, each served in turn by every deployment
started once, each with prompts of its own (seed + its index).

Deployments (:mod:`disagg.bench.deploy`), started here one after the other with the same
reference-engine shape (the shape flags, passed to every engine as ``disagg serve`` takes
them; checked here first) and ``K`` engines in all: ``aggregated`` (K instances, least load
by the client), ``disaggregated`` (P producers + K-P consumers + ``disagg proxy``); and
``--target URL`` for one already running (OpenAI ``/v1/completions`` with streaming).
Per-role devices: producers on ``--producer-device``, consumers on ``--consumer-device``;
aggregated instances alternate over those devices (one per GPU on two GPUs).
Each gets ``--warmup`` short requests first (not measured). A deployment that cannot
start gets a row with its ``error`` (one line on stderr too) and the command exits 1.

Each request is ``POST /v1/completions`` with ``stream: true`` (aiohttp), timed per chunk;
see :mod:`disagg.bench.serve_report` for every reported field. ``--json`` prints
``{"results": [row per deployment], "workload": {...}, ...}`` on the last line of stdout.
``--quick``: 2 engines of 2 layers, 1 warmup request, and (unless given) ``--limit 40
--length-scale 0.05 --time-scale 0.02``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..cliargs import cuda_problem, transport
from ..config import STORE_DEVICES
from ..serve import SHAPE_FLAGS, add_shape_args, shape_error, shape_kwargs
from . import deploy, devices
from .reuse import OneLineParser
from .serve_report import Record, parse_metrics, plot, summarize, table
from .traces import Trace, TraceError, load_trace, prompt_tokens, scaled, synthetic_trace

VOCAB = 512  # the reference engine's vocabulary


@dataclass
class Request:
    arrival: float  # seconds after the run's start
    tokens: list[int]
    max_tokens: int


class UsageError(ValueError):
    pass


def workload(trace: Trace, time_scale: float, seed: int) -> list[Request]:
    out = []
    t0 = float(trace.timestamp_ms[0]) if len(trace) else 0.0
    for i in range(len(trace)):
        toks = prompt_tokens(
            trace.ids_of(i), int(trace.input_length[i]), trace.block_tokens, VOCAB, seed
        )
        arrival = (float(trace.timestamp_ms[i]) - t0) / 1000.0 * time_scale
        out.append(Request(arrival, toks, int(trace.output_length[i])))
    return out


# --------------------------------------------------------------------------- client


class _Progress:
    """tqdm when installed, else a line on stderr that counts up."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self._bar: Any = None
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)
        except ImportError:
            pass

    def update(self) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.update(1)
        elif sys.stderr.isatty():
            end = "\n" if self.n == self.total else ""
            print(f"\r{self.desc}: {self.n}/{self.total} requests", end=end, file=sys.stderr)
        elif self.n == self.total or self.n % max(1, self.total // 4) == 0:
            print(f"{self.desc}: {self.n}/{self.total} requests", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _one(
    http: Any, url: str, req: Request, rec: Record, request_id: str | None = None
) -> None:
    import aiohttp

    body = {"prompt": req.tokens, "max_tokens": req.max_tokens, "stream": True}
    headers = {"X-Request-Id": request_id} if request_id else None
    rec.sent = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                text = (await r.text())[:200].replace("\n", " ")
                rec.error = f"HTTP {r.status} from {url}: {text}"
                return
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    rec.error = f"stream error from {url}: {ev['error'].get('message')}"
                    break
                n = len(ev["choices"][0].get("token_ids") or ())
                if n:
                    rec.chunks.append((time.perf_counter(), n))
                    rec.output_tokens += n
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__} from {url}: {e}"
    finally:
        rec.done = time.perf_counter()


async def replay(
    urls: list[str], reqs: list[Request], desc: str, timeout_s: float
) -> tuple[list[Record], float]:
    """Send every request at its arrival time; with several URLs, each to the one with the
    fewest requests in flight (ties round-robin). Returns the records and the wall time
    from the first send to the last answer."""
    import aiohttp

    in_flight = [0] * len(urls)
    recs = [Record(i, len(r.tokens), r.max_tokens, r.arrival) for i, r in enumerate(reqs)]
    bar = _Progress(len(reqs), desc)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        start = time.perf_counter()

        async def go(i: int) -> None:
            delay = start + reqs[i].arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            k = min(range(len(urls)), key=lambda j: (in_flight[j], (j - i) % len(urls)))
            in_flight[k] += 1
            try:
                await _one(http, urls[k], reqs[i], recs[i])
            finally:
                in_flight[k] -= 1
                bar.update()

        await asyncio.gather(*(go(i) for i in range(len(reqs))))
    bar.close()
    sent = [r.sent for r in recs if r.sent]
    wall = max(r.done for r in recs) - min(sent) if sent else 0.0
    return recs, wall


def _counters(urls: list[str]) -> dict[str, float] | None:
    total: dict[str, float] = {}
    for u in urls:
        try:
            with urllib.request.urlopen(f"{u}/metrics", timeout=10) as r:
                got = parse_metrics(r.read().decode())
        except OSError:
            return None
        for k, v in got.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _delta(a: dict[str, float] | None, b: dict[str, float] | None) -> dict[str, float] | None:
    if a is None or b is None:
        return None
    return {k: b[k] - a.get(k, 0.0) for k in b}


def engine_shape(urls: list[str], want: str | None) -> str | None:
    """What the started engines report they run (``/disagg/info``'s ``engine``: model name,
    dtype, device), one string; ``StartError`` when one runs another model than ``want``
    (the shape flags did not reach it). None for servers without that field."""
    seen: set[str] = set()
    for u in urls:
        try:
            with urllib.request.urlopen(f"{u}/disagg/info", timeout=10) as r:
                eng = json.loads(r.read()).get("engine")
        except (OSError, ValueError):
            eng = None
        if not isinstance(eng, dict):
            continue
        if want is not None and eng.get("model") != want:
            raise deploy.StartError(
                f"the engine at {u} runs {eng.get('model')}, not the requested {want}"
            )
        seen.add(f"{eng.get('model')} {eng.get('dtype')} {eng.get('device')}")
    return " | ".join(sorted(seen)) or None


def _warmup(urls: list[str], n: int, seed: int, timeout_s: float) -> None:
    """``n`` short requests per URL, prompts unrelated to the workload's."""
    rng = np.random.default_rng(seed + 10_007)
    reqs = [Request(0.0, rng.integers(0, VOCAB, 64).tolist(), 2) for _ in range(n * len(urls))]
    if reqs:
        recs, _ = asyncio.run(replay(urls, reqs, "warmup", timeout_s))
        bad = [r.error for r in recs if r.error]
        if bad:
            raise deploy.StartError(f"warmup request failed: {bad[0]}")


def run_deployment(
    dep: deploy.Deployment,
    loads: list[tuple[str, list[Request]]],
    args: argparse.Namespace,
) -> list[tuple[dict[str, Any], list[Record]]]:
    """Start ``dep``, serve each workload in turn (``(label, requests)``), stop it: a row
    and the records per workload (one row with ``error`` if it could not start)."""
    try:
        dep.start(args.start_timeout)
        deploy.wait_routing(dep, args.producers)
        engine = engine_shape(dep.engine_urls, args.model)
        _warmup(dep.client_urls, args.warmup, args.seed, args.request_timeout)
    except deploy.StartError as e:
        dep.stop()
        print(f"disagg bench serve: deployment {e}", file=sys.stderr)
        return [({"deployment": dep.name, "layout": dep.layout, "error": str(e)}, [])]
    out = []
    try:
        for label, reqs in loads:
            before = _counters(dep.engine_urls) if dep.engine_urls else None
            desc = f"{dep.name} {label}".strip()
            recs, wall = asyncio.run(replay(dep.client_urls, reqs, desc, args.request_timeout))
            after = _counters(dep.engine_urls) if dep.engine_urls else None
            row = summarize(
                dep.name, dep.layout, recs, wall, _delta(before, after), args.slo_ttft, args.slo_tbt
            )
            row["engine"] = engine
            if label:
                row["workload"] = label
            out.append((row, recs))
    finally:
        dep.stop()
    return out


# --------------------------------------------------------------------------- CLI


def parse_seconds(text: str, flag: str) -> float:
    """``250ms``, ``1.5s``, ``2`` (seconds) -> seconds (> 0)."""
    t = text.strip().lower()
    scale = 1e-3 if t.endswith("ms") else 1.0
    t = t[:-2] if t.endswith("ms") else t[:-1] if t.endswith("s") else t
    try:
        v = float(t) * scale
    except ValueError:
        v = -1.0
    if not v > 0:
        raise UsageError(f"{flag} {text!r}: expected a duration > 0, e.g. 500ms or 1.5s")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="disagg bench serve", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake-format JSONL trace")
    src.add_argument(
        "--rate",
        help="synthetic workload: requests per second; a comma list (1,3,10) runs one "
        "workload per rate on each deployment, started once",
    )
    ap.add_argument("--limit", type=int, help="trace: only the first N requests")
    ap.add_argument("--requests", type=int, default=100, help="synthetic: number of requests")
    ap.add_argument("--time-scale", type=float, help="multiply arrival times (default 1)")
    ap.add_argument("--length-scale", type=float, help="multiply lengths (trace; default 1)")
    ap.add_argument("--input-len", type=int, default=1024, help="synthetic: mean prompt tokens")
    ap.add_argument("--output-len", type=int, default=32, help="synthetic: mean output tokens")
    ap.add_argument("--shared-prefix", type=float, default=0.5, help="synthetic: share 0..1")
    ap.add_argument("--prefix-groups", type=int, default=8, help="synthetic: shared documents")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", type=int, help="engines per deployment (default 2)")
    ap.add_argument("--producers", type=int, help="disaggregated: producers (default K/2)")
    add_shape_args(ap, defaults=False, seed=False)  # --layers: 2 with --quick, else 4
    ap.add_argument("--transport", type=transport, default="tcp", help="tcp, ipc or ucx")
    ap.add_argument("--store-size", default="256MiB", help="each producer's block store")
    ap.add_argument("--store-device", choices=STORE_DEVICES, default="cpu", help="its memory")
    devices.add_role_devices(ap, None, cpu=True)
    ap.add_argument("--deployments", default="aggregated,disaggregated")
    ap.add_argument("--target", action="append", default=[], metavar="URL")
    ap.add_argument("--slo-ttft", default="1s", help="TTFT objective (e.g. 500ms, 1s)")
    ap.add_argument("--slo-tbt", default="100ms", help="mean time-between-tokens objective")
    ap.add_argument("--warmup", type=int, help="unmeasured requests per client URL (default 2)")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--quick", action="store_true", help="CI size (see the module help)")
    ap.add_argument("--log-dir", help="keep the servers' logs and configs here")
    ap.add_argument("--json", action="store_true", help="one JSON object on the last line")
    ap.add_argument("--plot", metavar="PNG", help="latency CDFs and the request timeline")
    return ap


def _resolve(args: argparse.Namespace) -> list[tuple[str, Trace]]:
    """Fill defaults (``--quick``), check every argument, build the workloads' traces
    (one, or one per ``--rate``, each with its own seed: no prefix of one is in another)."""
    q = args.quick
    try:
        args.rates = None if args.rate is None else [float(x) for x in args.rate.split(",")]
    except ValueError:
        args.rates = [-1.0]
    if args.trace and q:
        args.limit = 40 if args.limit is None else args.limit
        args.length_scale = 0.05 if args.length_scale is None else args.length_scale
        args.time_scale = 0.02 if args.time_scale is None else args.time_scale
    args.time_scale = 1.0 if args.time_scale is None else args.time_scale
    args.length_scale = 1.0 if args.length_scale is None else args.length_scale
    args.engines = (2 if q else 2) if args.engines is None else args.engines
    args.layers = (2 if q else 4) if args.layers is None else args.layers
    for flag, (_, default) in SHAPE_FLAGS.items():
        attr = flag[2:].replace("-", "_")
        if getattr(args, attr) is None:
            setattr(args, attr, default)
    args.dtype = args.dtype or "float32"
    args.warmup = (1 if q else 2) if args.warmup is None else args.warmup
    args.producers = max(1, args.engines // 2) if args.producers is None else args.producers
    args.slo_ttft = parse_seconds(args.slo_ttft, "--slo-ttft")
    args.slo_tbt = parse_seconds(args.slo_tbt, "--slo-tbt")
    checks = [
        ("--limit", args.limit, args.limit is None or args.limit >= 1, "a count >= 1"),
        ("--requests", args.requests, args.requests >= 1, "a count >= 1"),
        ("--time-scale", args.time_scale, args.time_scale >= 0, "a factor >= 0"),
        ("--length-scale", args.length_scale, args.length_scale > 0, "a factor > 0"),
        ("--engines", args.engines, args.engines >= 2 or not _wants_disagg(args), ">= 2"),
        ("--engines", args.engines, args.engines >= 1, ">= 1"),
        ("--producers", args.producers, 1 <= args.producers < max(2, args.engines), "1..K-1"),
        ("--warmup", args.warmup, args.warmup >= 0, ">= 0"),
        ("--max-seq-len", args.max_seq_len, args.max_seq_len >= 128, ">= 128 tokens"),
        ("--shared-prefix", args.shared_prefix, 0 <= args.shared_prefix <= 1, "0..1"),
        ("--prefix-groups", args.prefix_groups, args.prefix_groups >= 1, ">= 1"),
        ("--input-len", args.input_len, args.input_len >= 1, ">= 1"),
        ("--output-len", args.output_len, args.output_len >= 1, ">= 1"),
        ("--rate", args.rate, args.rates is None or min(args.rates) > 0, "requests/s > 0"),
    ]
    for flag, value, ok, accepted in checks:
        if not ok:
            raise UsageError(f"{flag} {value!r}: expected {accepted}")
    from ..engine.reference import EngineConfig

    try:
        args.model = EngineConfig(kv_manager="v2", **shape_kwargs(args)).model_name
    except ValueError as e:
        raise UsageError(shape_error(e)) from None
    devices.resolve(args, args.device)
    if args.device != "cpu" and _starts_engines(args):
        why = cuda_problem(args.device)
        if why is not None:
            raise UsageError(f"argument --device: {args.device!r}: {why}")
    if _starts_engines(args):
        why = devices.problem(args, cpu=True)
        if why is not None:
            raise UsageError(why)
    names = [d.strip() for d in args.deployments.split(",") if d.strip()]
    bad = [d for d in names if d not in ("aggregated", "disaggregated")]
    if bad:
        raise UsageError(
            f"--deployments {args.deployments!r}: unknown {bad}; use aggregated,disaggregated"
        )
    args.deployment_names = [] if args.target and args.deployments == _DEFAULT_DEPS else names
    for u in args.target:
        if not u.startswith(("http://", "https://")):
            raise UsageError(f"--target {u!r}: expected an http(s) URL, e.g. http://host:8000")
    if args.trace:
        return [("", _aligned(load_trace(args.trace, args.limit), args))]
    if args.rates is None:
        raise UsageError("give --trace FILE (Mooncake JSONL) or --rate R (synthetic workload)")
    out = []
    for i, rate in enumerate(args.rates):
        t = synthetic_trace(
            args.limit or args.requests,
            rate=rate,
            mean_input=args.input_len,
            mean_output=args.output_len,
            shared_ratio=args.shared_prefix,
            groups=args.prefix_groups,
            seed=args.seed + i,
            block_tokens=args.tokens_per_block,
        )
        out.append((f"{rate:g}/s" if len(args.rates) > 1 else "", _aligned(t, args)))
    return out


def _aligned(t: Trace, args: argparse.Namespace) -> Trace:
    """Scale lengths so a trace block becomes a whole number of engine blocks (at least
    one): shared trace prefixes are then shared engine blocks. ``args.length_scale`` is
    updated to the factor applied."""
    tpb = args.tokens_per_block
    bt = max(tpb, round(t.block_tokens * args.length_scale / tpb) * tpb)
    args.length_scale = bt / t.block_tokens
    return scaled(t, args.length_scale, args.max_seq_len)


_DEFAULT_DEPS = "aggregated,disaggregated"


def _wants_disagg(args: argparse.Namespace) -> bool:
    return "disaggregated" in args.deployments and not args.target


def _starts_engines(args: argparse.Namespace) -> bool:
    return not args.target or args.deployments != _DEFAULT_DEPS


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        traces = _resolve(args)
    except (UsageError, TraceError) as e:
        print(f"disagg bench serve: {e}", file=sys.stderr)
        return 2
    trace = traces[0][1]
    loads = [
        (label, workload(t, args.time_scale, args.seed + i)) for i, (label, t) in enumerate(traces)
    ]
    reqs = [r for _, rs in loads for r in rs]
    logdir = Path(args.log_dir or tempfile.mkdtemp(prefix="disagg-bench-serve-"))
    logdir.mkdir(parents=True, exist_ok=True)
    shape = deploy.Shape(
        layers=args.layers,
        tokens_per_block=args.tokens_per_block,
        num_blocks=args.num_blocks,
        seed=args.seed,
        device=args.device,
        hidden_size=args.hidden_size,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        max_batch_size=args.max_batch_size,
        dtype=args.dtype,
    )
    deps: list[deploy.Deployment] = []
    for name in args.deployment_names:
        if name == "aggregated":
            places = [args.producer_device, args.consumer_device]  # one instance per device
            deps.append(deploy.aggregated(args.engines, shape, logdir, places))
        else:
            consumers = args.engines - args.producers
            deps.append(
                deploy.disaggregated(
                    args.producers,
                    consumers,
                    shape,
                    logdir,
                    args.transport,
                    args.store_size,
                    args.store_device,
                    args.producer_device,
                    args.consumer_device,
                )
            )
    deps += [deploy.target(u) for u in args.target]
    prompt = sum(len(r.tokens) for r in reqs)
    print(
        f"disagg bench serve: {len(reqs)} requests from {trace.source} ({prompt:,} prompt "
        f"tokens, {trace.block_tokens}-token blocks, time x{args.time_scale:g}, lengths "
        f"x{args.length_scale:g}); engines per deployment: {args.engines} "
        f"({args.model}, {args.dtype}, {args.device}); transport {args.transport}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    timelines: dict[str, list[Record]] = {}
    for dep in deps:
        for row, recs in run_deployment(dep, loads, args):
            rows.append(row)
            if recs:
                timelines[f"{dep.name} {row.get('workload', '')}".strip()] = recs
    print(table(rows, args.slo_ttft, args.slo_tbt), flush=True)
    failed = any(r.get("error") for r in rows)
    if failed:
        print(f"logs: {logdir}", file=sys.stderr)
    elif not args.log_dir:
        shutil.rmtree(logdir, ignore_errors=True)
    if args.plot:
        err = plot(timelines, args.plot, f"disagg bench serve: {os.path.basename(trace.source)}")
        print(err or f"plot: {args.plot}", file=sys.stderr if err else sys.stdout)
    if args.json:
        report = {
            "results": rows,
            "workload": {
                "source": trace.source,
                "requests": len(reqs),
                "prompt_tokens": prompt,
                "block_tokens": trace.block_tokens,
                "time_scale": args.time_scale,
                "length_scale": args.length_scale,
                "seed": args.seed,
                "rates": args.rates,
            },
            "engines": args.engines,
            "producers": args.producers,
            "layers": args.layers,
            "model": args.model,
            "dtype": args.dtype,
            "device": args.device,
            "producer_device": args.producer_device,
            "consumer_device": args.consumer_device,
            "num_blocks": args.num_blocks,
            "transport": args.transport,
            "store": {"size": args.store_size, "device": args.store_device},
            "slo": {"ttft_s": args.slo_ttft, "tbt_s": args.slo_tbt},
            "cpus": os.cpu_count(),
        }
        print(json.dumps(report))
    return 1 if failed else 0
