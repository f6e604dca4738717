"""``disagg bench overhead``: what disaggregation itself adds to one request's TTFT.

    disagg bench overhead [--prompt-lens 1024,4096] [--repeats 3] [--transport tcp|ipc|ucx]
                          [--layers 4] [--hidden-size 128 --heads 4 --kv-heads 2
                          --head-dim 32 --intermediate-size 256] [--dtype float32]
                          [--device cpu|cuda] [--store-device cpu|pinned|cuda] [--json]
                          [--producer-device D --consumer-device D] (default: --device)

One prompt at a time (no queueing), each a fresh random prompt (no cache hits), on the
reference engine:

- **local**: an engine without a connector, from ``add_request`` to its first token;
- **producer**: a producer engine in another process (``disagg.producer`` connector, the
  real store and control server), from ``add_request`` until the request is finished
  (its first token, and its blocks saved): what the proxy waits for
  (``producer_first_token_ms``: to its first token only; ``producer_hooks_ms``: the wall
  time of its connector's hooks on the engine thread, timed by thin subclasses as the
  consumer's are; ``commit_lag_max_ms``: the longest lag from a pass's end to its blocks'
  commit on the committer thread);
- **consumer**: an engine with the ``disagg.consumer`` connector in this process, whose
  connector calls are timed by thin subclasses (:class:`TimedConsumerScheduler`,
  :class:`TimedConsumerWorker`; the contract methods, nothing else, are wrapped) until
  its first token, split into **claim** (``get_num_new_matched_tokens``: keys, Claim round
  trip, lease), **transfer** (the first ``start_load_kv`` after the claim to the
  ``get_finished`` that reports the load), **first step** (from there to the first token:
  the tail's forward and sampling) and **other** (engine scheduling in between).

``overhead`` = producer + consumer - local: the TTFT a disaggregated request pays over a
local one (the proxy's HTTP hops not included). ``wire_ms`` = the prompt's loaded bytes at
the data plane's GB/s, measured in the same run by :func:`disagg.bench.transfer.measure`
with the same page size. Medians over ``--repeats`` prompts per length, after a warm-up
prompt. Devices: the producer's engine (and a ``cuda`` store) on ``--producer-device``,
the consumer's and the local engine on ``--consumer-device``; the plane's figure is
measured between the same two. The producer process and this one get half the CPUs'
compute threads each (unless ``OMP_NUM_THREADS`` is set). ``--json``: ``{"results":
[...], "plane_gbps": ...}`` on the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from statistics import median
from typing import Any

import numpy as np

from ..cliargs import transport
from ..consumer import ConsumerScheduler, ConsumerWorker
from ..producer import ProducerScheduler, ProducerWorker
from . import devices
from .ports import free_port
from .reuse import OneLineParser

EVENTS: dict[str, list[float]] = {"claim": [], "load_start": [], "loaded": []}
PLANES = {"tcp": "tcp-tcp", "ipc": "ipc-shm", "ucx": "ucx-tcp"}


class TimedConsumerScheduler(ConsumerScheduler):
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        t0 = time.perf_counter()
        out = super().get_num_new_matched_tokens(request, num_computed_tokens)
        EVENTS["claim"] += [t0, time.perf_counter()]
        return out


class TimedConsumerWorker(ConsumerWorker):
    def start_load_kv(self, stream: Any) -> None:
        EVENTS["load_start"].append(time.perf_counter())
        super().start_load_kv(stream)

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        saved, loaded = super().get_finished(finished_gen_req_ids, started_loading_req_ids)
        if loaded:
            EVENTS["loaded"].append(time.perf_counter())
        return saved, loaded


HOOKS: dict[str, float] = {}  # the producer's engine-thread hooks: seconds by hook, summed


def _took(hook: str, t0: float) -> None:
    HOOKS[hook] = HOOKS.get(hook, 0.0) + time.perf_counter() - t0


class TimedProducerScheduler(ProducerScheduler):
    """Times ``build_connector_meta`` (engine thread) into ``HOOKS``."""

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        t0 = time.perf_counter()
        out = super().build_connector_meta(scheduler_output)
        _took("build_connector_meta", t0)
        return out


class TimedProducerWorker(ProducerWorker):
    """Times the worker's engine-thread hooks into ``HOOKS`` (a pass's first
    ``save_kv_layer``, which plans the pass's copies, apart from the others)."""

    def bind_connector_meta(self, metadata: object) -> None:
        t0 = time.perf_counter()
        super().bind_connector_meta(metadata)
        _took("bind_connector_meta", t0)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        t0 = time.perf_counter()
        super().save_kv_layer(layer_idx, stream)
        _took("save_kv_layer[0]" if layer_idx == 0 else "save_kv_layer[1:]", t0)

    def wait_for_save(self, stream: Any) -> None:
        t0 = time.perf_counter()
        super().wait_for_save(stream)
        _took("wait_for_save", t0)

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        t0 = time.perf_counter()
        out = super().get_finished(finished_gen_req_ids, started_loading_req_ids)
        _took("get_finished", t0)
        return out


def _engine(args: argparse.Namespace, role: str | None, endpoint: str = "") -> Any:
    from ..engine.reference import ConnectorSpec, Engine, EngineConfig

    cfg = EngineConfig(
        num_layers=args.layers,
        hidden_size=args.hidden_size,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        dtype=args.dtype,
        device=args.producer_device if role == "producer" else args.consumer_device,
        tokens_per_block=32,
        num_blocks=max(1024, 2 * max(args.lens) // 32 + 64),
        kv_manager="v2",
        max_seq_len=max(8192, max(args.lens) + 64),
        seed=0,
    )
    if role is None:
        return Engine(cfg)
    conf: dict[str, Any] = {"role": role, "instance_id": f"bench-{role}"}
    conf["transport"] = args.transport
    if role == "producer":
        conf["producer"] = {
            "control": endpoint,
            "store_size": args.store_size,
            "store_device": args.store_device,
        }
        names = ("disagg.bench.overhead", "TimedProducerScheduler", "TimedProducerWorker")
    else:
        # a claim slower than the default budget on a loaded machine would be a miss and
        # time a recompute: the bench times the claim as it comes instead
        conf["consumer"] = {"producers": [endpoint], "load_mode": "async", "claim_timeout_s": 10}
        names = (__name__, "TimedConsumerScheduler", "TimedConsumerWorker")
    return Engine(cfg, connector=ConnectorSpec(*names, extra={"config": conf}))


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    """A warm-up prompt, then ``repeats`` prompts per length (fresh random tokens)."""
    rng = np.random.default_rng(args.seed)
    lens: list[int] = [128] + [int(n) for n in args.lens for _ in range(args.repeats)]
    return [rng.integers(0, 512, size=n).tolist() for n in lens]


def _first_token_clock(eng: Any, res: Any, t0: float) -> list[float]:
    """Set ``eng.respond`` to note when ``res`` first has a token (seconds after ``t0``):
    where a server sends it, before the iteration's ``get_finished``."""
    first: list[float] = []

    def respond() -> None:
        if res.tokens and not first:
            first.append(time.perf_counter() - t0)

    eng.respond = respond
    return first


def _until(eng: Any, prompt: list[int], first_token: bool) -> float:
    """Seconds from ``add_request`` to the first token (or to the request's end)."""
    t0 = time.perf_counter()
    rid = eng.add_request(prompt, 1)
    res = eng.results[rid]
    first = _first_token_clock(eng, res, t0)
    while not (res.tokens if first_token else res.finished):
        eng.step()
    t = first[0] if first_token and first else time.perf_counter() - t0
    while eng.has_work():
        eng.step()
    eng.respond = None
    if res.error:
        raise RuntimeError(f"request failed: {res.error}")
    return t


def _until2(eng: Any, prompt: list[int]) -> tuple[float, float]:
    """Seconds from ``add_request`` to the first token and to the request's end."""
    t0 = time.perf_counter()
    rid = eng.add_request(prompt, 1)
    res = eng.results[rid]
    first = _first_token_clock(eng, res, t0)
    while not res.finished:
        eng.step()
    done = time.perf_counter() - t0
    while eng.has_work():
        eng.step()
    eng.respond = None
    if res.error:
        raise RuntimeError(f"request failed: {res.error}")
    return first[0] if first else done, done


def run_producer(args: argparse.Namespace) -> int:
    from ..producer.service import _services

    eng = _engine(args, "producer", args.endpoint)
    svc = next(iter(_services.values()))
    # the connector's classes come from this module as imported by name, which may not be
    # the module running this function (``python -m``)
    timings = sys.modules[type(eng.driver.workers[0]).__module__].HOOKS
    first, done, lag, hooks = [], [], [], []
    for p in _prompts(args):
        before = len(svc.commit_lags_s())
        timings.clear()
        f, d = _until2(eng, p)
        first.append(f)
        done.append(d)
        lag.append(max(svc.commit_lags_s()[before:], default=0.0))
        hooks.append(dict(timings))
    rep = {"prefill_s": done, "first_token_s": first, "commit_lag_s": lag, "hooks_s": hooks}
    print(json.dumps(rep), flush=True)
    sys.stdin.read()  # serve the store until the parent is done
    return 0


def _consumer_split(eng: Any, prompt: list[int]) -> dict[str, float]:
    for v in EVENTS.values():
        v.clear()
    t0 = time.perf_counter()
    total = _until(eng, prompt, first_token=True)
    t_end = t0 + total
    c0, c1 = EVENTS["claim"][:2]
    l0 = next((t for t in EVENTS["load_start"] if t >= c1), c1)
    l1 = next((t for t in EVENTS["loaded"] if t >= l0), l0)
    out = {"claim": c1 - c0, "transfer": l1 - l0, "first_step": t_end - l1}
    out["other"] = total - sum(out.values())
    out["consumer"] = total
    return out


SHAPE = {  # flag -> default (the reference engine's small default shape)
    "hidden-size": 128,
    "heads": 4,
    "kv-heads": 2,
    "head-dim": 32,
    "intermediate-size": 256,
}


def _shape_flags(args: argparse.Namespace) -> list[str]:
    out = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in SHAPE]
    out += ["--dtype", args.dtype, "--device", args.device]
    out += ["--producer-device", args.producer_device, "--consumer-device", args.consumer_device]
    return out + ["--store-size", args.store_size, "--store-device", args.store_device]


def run_parent(args: argparse.Namespace) -> dict[str, Any]:
    from ..consumer.service import _services
    from .transfer import Roles, measure

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "disagg.bench.overhead", "--role", "producer"]
    cmd += ["--endpoint", endpoint, "--prompt-lens", ",".join(map(str, args.lens))]
    cmd += ["--repeats", str(args.repeats), "--layers", str(args.layers)]
    cmd += ["--transport", args.transport, "--seed", str(args.seed)]
    cmd += _shape_flags(args)
    # one compute share each: the producer process and this one would otherwise
    # oversubscribe a small CPU, and torch's spinning threads slow every step of the other
    threads = max(1, (os.cpu_count() or 2) // 2)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", str(threads))
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(threads)
    prod = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert prod.stdout is not None
        line = prod.stdout.readline()
        if not line.startswith("{"):
            raise RuntimeError(f"the producer exited (rc={prod.wait()}) before reporting")
        report = json.loads(line)
        prefill, prefill_first = report["prefill_s"], report["first_token_s"]
        lags, hooks = report["commit_lag_s"], report["hooks_s"]
        prompts = _prompts(args)
        local_eng = _engine(args, None)
        local = [_until(local_eng, p, first_token=True) for p in prompts]
        cons = _engine(args, "consumer", endpoint)
        svc = next(iter(_services.values()))
        splits, loaded_bytes = [], []
        for p in prompts:
            before = svc.metrics["pages_loaded"]
            splits.append(_consumer_split(cons, p))
            block_bytes = svc.pool.block_bytes if svc.pool is not None else 0
            loaded_bytes.append((svc.metrics["pages_loaded"] - before) * block_bytes)
        page_bytes = svc.pool.block_bytes if svc.pool is not None else 65536
        svc.close()
    finally:
        if prod.stdin:
            prod.stdin.close()
        prod.wait(timeout=30)
    pages = max(1, max(loaded_bytes) // max(1, page_bytes))
    name = PLANES[args.transport]
    if args.store_device == "cuda" and args.transport in ("ipc", "ucx"):
        name = f"{args.transport}-cuda"  # device memory on both sides
    roles = Roles(args.producer_device, args.consumer_device)
    plane = measure(name, page_bytes, pages, 5, timeout_s=120, roles=roles)
    gbps = plane.gbps
    rows = []
    for n in args.lens:
        idx = [i for i, p in enumerate(prompts) if len(p) == n and i > 0]
        row: dict[str, Any] = {"prompt_tokens": n}
        row["local_ms"] = median(local[i] for i in idx) * 1e3
        row["producer_ms"] = median(prefill[i] for i in idx) * 1e3
        row["producer_first_token_ms"] = median(prefill_first[i] for i in idx) * 1e3
        row["commit_lag_max_ms"] = max(lags[i] for i in idx) * 1e3
        row["producer_hooks_ms"] = median(sum(hooks[i].values()) for i in idx) * 1e3
        names = sorted({k for i in idx for k in hooks[i]})
        row["producer_hook_split_ms"] = {
            k: median(hooks[i].get(k, 0.0) for i in idx) * 1e3 for k in names
        }
        for k in ("consumer", "claim", "transfer", "first_step", "other"):
            row[f"{k}_ms"] = median(splits[i][k] for i in idx) * 1e3
        row["overhead_ms"] = row["producer_ms"] + row["consumer_ms"] - row["local_ms"]
        row["loaded_bytes"] = int(median(loaded_bytes[i] for i in idx))
        row["wire_ms"] = row["loaded_bytes"] / (gbps * 1e9) * 1e3 if gbps else None
        rows.append(row)
    return {
        "results": rows,
        "transport": args.transport,
        "plane": name,
        "page_bytes": page_bytes,
        "plane_gbps": gbps,
        "plane_error": plane.error,
        "layers": args.layers,
        "devices": f"{args.producer_device} / {args.consumer_device}",
        "shape": " ".join(_shape_flags(args)[: len(SHAPE) + 4]),
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
    }


def table(rep: dict[str, Any]) -> str:
    g = rep["plane_gbps"]
    lines = [
        f"disagg bench overhead: reference engine ({rep['layers']} layers, {rep['shape']}), "
        f"{rep['plane']} plane {'n/a' if g is None else f'{g:.2f} GB/s'} "
        f"(devices {rep['devices']}) "
        f"({rep['page_bytes']} B pages), median of {rep['repeats']}",
        f"{'prompt':>7} {'local':>8} {'producer (1st tok)':>18} {'consumer':>9} {'= claim':>8} "
        f"{'+ transfer':>10} {'+ 1st step':>10} {'+ other':>8} {'overhead':>9} {'wire':>7}",
    ]
    for r in rep["results"]:
        wire = "-" if r["wire_ms"] is None else f"{r['wire_ms']:.2f}"
        lines.append(
            f"{r['prompt_tokens']:>7} {r['local_ms']:>8.1f} "
            f"{r['producer_ms']:>9.1f} ({r['producer_first_token_ms']:>6.1f}) "
            f"{r['consumer_ms']:>9.1f} {r['claim_ms']:>8.2f} {r['transfer_ms']:>10.2f} "
            f"{r['first_step_ms']:>10.2f} {r['other_ms']:>8.2f} {r['overhead_ms']:>9.1f} "
            f"{wire:>7}"
        )
    lines.append("ms; overhead = producer + consumer - local (TTFT added by disaggregation)")
    for r in rep["results"]:
        lines.append(
            f"{r['prompt_tokens']:>7} producer: connector hooks on the engine thread "
            f"{r['producer_hooks_ms']:.2f} ms until its answer; commit lag (end of forward "
            f"to blocks published) at most {r['commit_lag_max_ms']:.2f} ms ("
            + ", ".join(f"{k} {v:.2f}" for k, v in r["producer_hook_split_ms"].items())
            + ")"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    ap = OneLineParser(prog="disagg bench overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["producer"], help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-lens", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--transport", type=transport, default="tcp", help="tcp, ipc or ucx")
    for flag, default in SHAPE.items():
        ap.add_argument(f"--{flag}", type=int, default=default, help="reference engine shape")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--device", default="cpu", help="cpu | cuda[:N] (every engine)")
    ap.add_argument("--store-size", default="1GiB", help="the producer's block store")
    ap.add_argument("--store-device", choices=("cpu", "pinned", "cuda"), default="cpu")
    devices.add_role_devices(ap, None, cpu=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--http",
        action="store_true",
        help="at the client, over HTTP: a local server against producer + consumer + proxy "
        "(TTFT, first-to-second-token gap, TBT); see disagg.bench.client_overhead",
    )
    ap.add_argument("--http-tokens", type=int, default=8, help="--http: tokens per answer")
    ap.add_argument("--num-blocks", type=int, default=1024, help="--http: KV blocks per engine")
    ap.add_argument(
        "--no-prefetch",
        action="store_true",
        help="--http: the proxy does not tell the consumer about a prompt at its prefill",
    )
    ap.add_argument(
        "--landing-zone",
        default="",
        metavar="SIZE",
        help="--http: the consumer's landing zone (consumer.landing_zone_size, e.g. 1GiB): "
        "prefetched pages land there during the prefill; default off",
    )
    args = ap.parse_args(list(argv))
    try:
        args.lens = [int(x) for x in args.prompt_lens.split(",") if x.strip()]
    except ValueError:
        args.lens = []
    if not args.lens or min(args.lens) < 64 or max(args.lens) > 65536:
        print(
            f"disagg bench overhead: --prompt-lens {args.prompt_lens!r}: expected token "
            "counts from 64 to 65536, e.g. 1024,4096",
            file=sys.stderr,
        )
        return 2
    devices.resolve(args, args.device)
    why = devices.problem(args, cpu=True) if args.role is None else None
    if why is not None:
        print(f"disagg bench overhead: {why}", file=sys.stderr)
        return 2
    for name in ("producer_device", "consumer_device"):  # cuda: the GPU current now
        if getattr(args, name).startswith("cuda"):
            setattr(args, name, devices.explicit(getattr(args, name)))
    small = [f for f in ("repeats", "layers", *SHAPE) if getattr(args, f.replace("-", "_")) < 1]
    if small:
        print(f"disagg bench overhead: --{small[0]} must be >= 1", file=sys.stderr)
        return 2
    if args.role == "producer":
        return run_producer(args)
    if args.http:
        if args.http_tokens < 3:
            print("disagg bench overhead: --http-tokens must be >= 3", file=sys.stderr)
            return 2
        from . import client_overhead

        rep = client_overhead.run(args)
        print(client_overhead.table(rep), flush=True)
        if args.json:
            print(json.dumps(rep))
        return 0
    rep = run_parent(args)
    print(table(rep), flush=True)
    if args.json:
        print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
