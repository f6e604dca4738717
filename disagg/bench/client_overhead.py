"""``disagg bench overhead --http``: what disaggregation costs one request at the client.

Two deployments of the same shape on this machine, started by :mod:`disagg.bench.deploy`
and up together, each given the same fresh random prompts one request at a time (no
queueing, no cache hits), the two taking turns prompt by prompt with the order alternating
(a paired comparison: both meet the same device clocks), every request streamed
(``max_tokens`` = ``--http-tokens``) over HTTP:

- **local**: one aggregated instance (the server ``disagg bench serve`` uses for the
  aggregated deployment);
- **disaggregated**: one producer, one consumer and the proxy; the client's first token is
  the producer's and the consumer continues after it (:mod:`disagg.proxy.first_token`).

Per prompt length, medians over ``--repeats`` prompts after a warm-up prompt: **TTFT**
(send to the first token's chunk), **gap** (the first token's chunk to the second's) and
**TBT** (the median time between later chunks, the consumer's decode step as the client
sees it). Ratios: ``ttft_ratio`` = disaggregated TTFT / local TTFT; ``gap_ratio`` =
disaggregated gap / disaggregated TBT (the hand-over's cost in decode steps).

**Where the gap goes** (``gap_split``, medians, ms): every request carries an
``X-Request-Id``; the proxy and the consumer log their moments under it
(:mod:`disagg.proxy.timeline`, the consumer's ``completion done`` line), on the machine's
monotonic clock, which the client reads too. From the proxy writing the first token to the
client's second token: ``handover`` (the proxy posts the continuation), ``hop`` (it reaches
the consumer's handler), ``parse`` (body and prompt read), ``admit`` (queued, added to the
engine, scheduled), ``claim`` (keys and the claim, or the prefetched lease taken),
``transfer`` (dispatch to the load seen landed), ``tail`` (the forward of the tail and the
first token, sampling), ``back`` (the consumer's chunk through the proxy to the client).
``ttft_split`` and ``local_split`` do the same for the first token (the proxy, the
producer's or the local server's ``completion done`` moments: ``prefill`` is from the
request added to the engine to its first token reported). ``prefetch_taken`` counts the requests whose claim was a prefetched lease; with
``--landing-zone``, ``zone_loads`` those whose pages came from the consumer's landing zone
(``transfer`` is then the wait for the zone's fill and the copy into the engine's pages).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from .deploy import Deployment, Shape, aggregated, disaggregated, wait_routing
from .serve import Request, _one
from .serve_report import Record


def _prompts(lens: list[int], repeats: int, vocab: int, seed: int) -> dict[int, list[list[int]]]:
    rng = np.random.default_rng(seed)
    return {n: [rng.integers(0, vocab, n).tolist() for _ in range(repeats + 1)] for n in lens}


async def _paired(
    urls: list[str], prompts: list[list[int]], tokens: int, tags: list[str]
) -> list[list[Record]]:
    """Each prompt sent to every deployment in turn, one request at a time, the order
    alternating from prompt to prompt: the deployments meet the same device conditions
    (clocks, other tenants) within a pair, so their ratio is paired. Per deployment, its
    records in prompt order."""
    import aiohttp

    out: list[list[Record]] = [[] for _ in urls]
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(aiohttp.ClientSession(timeout=timeout)) for _ in urls
        ]
        for i, p in enumerate(prompts):
            order = range(len(urls)) if i % 2 == 0 else reversed(range(len(urls)))
            for k in order:
                rec = Record(i, len(p), tokens, 0.0)
                await _one(clients[k], urls[k], Request(0.0, p, tokens), rec, f"{tags[k]}-{i}")
                if rec.error:
                    raise RuntimeError(rec.error)
                out[k].append(rec)
    return out


def _marks(log: Path, msg: str) -> dict[str, dict[str, float]]:
    """request id -> the moments its ``msg`` line of ``log`` carries (JSON lines)."""
    out: dict[str, dict[str, float]] = {}
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        if msg not in line or '"marks"' not in line:
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("msg") == msg and isinstance(d.get("marks"), dict):
            out[str(d.get("request_id"))] = d["marks"]
    return out


LOG_WAIT_S = 30.0
SPLIT = (  # (segment, from, to): proxy "p.", consumer "c." moments; the client's 2nd chunk
    ("handover", "p.client_token", "p.consumer_sent"),
    ("hop", "p.consumer_sent", "c.arrived"),
    ("parse", "c.arrived", "c.parsed"),
    ("admit", "c.parsed", "c.claim0"),
    ("claim", "c.claim0", "c.claim1"),
    ("transfer", "c.claim1", "c.landed"),
    ("tail", "c.landed", "c.first_token"),
    ("back", "c.first_token", "client.second"),
)


TTFT_SPLIT = (  # the same for the first token: the proxy "p.", the producer "r."
    ("to_proxy", "client.sent", "p.received"),
    ("route", "p.received", "p.prefill_sent"),
    ("hop", "p.prefill_sent", "r.arrived"),
    ("parse", "r.arrived", "r.parsed"),
    ("admit", "r.parsed", "r.added"),
    ("prefill", "r.added", "r.first_token"),
    ("out", "r.first_token", "p.producer_token"),
    ("relay", "p.producer_token", "p.client_token"),
    ("to_client", "p.client_token", "client.first"),
)
LOCAL_SPLIT = (  # one local instance "l."
    ("hop", "client.sent", "l.arrived"),
    ("parse", "l.arrived", "l.parsed"),
    ("admit", "l.parsed", "l.added"),
    ("prefill", "l.added", "l.first_token"),
    ("to_client", "l.first_token", "client.first"),
)


DONE = "completion done"  # a server's line with a request's moments


def _moments(
    recs: list[Record], tag: str, logs: dict[str, tuple[Path, str]]
) -> list[dict[str, float]]:
    """Each record's moments but the warm-up's, named ``prefix.moment``; ``logs``: prefix
    -> (log, message) whose moments the prefix names, each log read once per look; the
    client's own are ``client.sent``, ``client.first`` and ``client.second``. Servers log
    a request's moments once they have sent its last byte, possibly after the client read
    it: their lines are waited for (at most ``LOG_WAIT_S``)."""
    want = {f"{tag}-{r.index}" for r in recs[1:]}
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        got = {k: _marks(path, msg) for k, (path, msg) in logs.items()}
        if all(want <= g.keys() for g in got.values()):
            break
        if time.monotonic() > deadline:
            for k, g in got.items():
                if not want <= g.keys():
                    print(
                        f"bench overhead --http: no {logs[k][1]!r} moments in {logs[k][0].name} "
                        f"for {sorted(want - g.keys())} after {LOG_WAIT_S:.0f} s: their "
                        "segments are left out",
                        file=sys.stderr,
                    )
            break
        time.sleep(0.05)
    out = []
    for r in recs[1:]:
        rid = f"{tag}-{r.index}"
        # perf_counter and monotonic: the same clock on Linux
        at = {"client.sent": r.sent}
        for k, g in got.items():
            at.update({f"{k}.{name}": v for name, v in g.get(rid, {}).items()})
        if r.chunks:
            at["client.first"] = r.chunks[0][0]
        if len(r.chunks) > 1:
            at["client.second"] = r.chunks[1][0]
        out.append(at)
    return out


def _medians(moments: list[dict[str, float]], segments: Any) -> dict[str, float]:
    """Medians (ms) of ``segments`` over the records whose moments hold both ends."""
    seg: dict[str, list[float]] = {name: [] for name, _, _ in segments}
    for at in moments:
        for name, a, b in segments:
            if a in at and b in at:
                seg[name].append((at[b] - at[a]) * 1000.0)
    return {k: median(v) for k, v in seg.items() if v}


def _figures(recs: list[Record]) -> dict[str, float]:
    """Medians over the records but the first (the warm-up), in ms."""
    recs = recs[1:]
    ttft = [r.chunks[0][0] - r.sent for r in recs]
    gap = [r.chunks[1][0] - r.chunks[0][0] for r in recs if len(r.chunks) > 1]
    tbt = [
        median(b[0] - a[0] for a, b in zip(r.chunks[1:], r.chunks[2:], strict=False))
        for r in recs
        if len(r.chunks) > 2
    ]
    ms = 1000.0
    return {
        "ttft_ms": median(ttft) * ms,
        "gap_ms": median(gap) * ms if gap else float("nan"),
        "tbt_ms": median(tbt) * ms if tbt else float("nan"),
    }


def run(args: Any) -> dict[str, Any]:
    """Both deployments, every length: ``{"results": [...]}`` (one row per length)."""
    shape = Shape(
        layers=args.layers,
        hidden_size=args.hidden_size,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        num_blocks=args.num_blocks,
        max_seq_len=max(8192, max(args.lens) + args.http_tokens + 64),
    )
    prompts = _prompts(args.lens, args.repeats, 512, args.seed)
    with tempfile.TemporaryDirectory(prefix="disagg-overhead-") as tmp:
        logdir = Path(tmp)
        got: dict[str, dict[int, dict[str, float]]] = {"aggregated": {}, "disaggregated": {}}
        deployments: list[Deployment] = [
            aggregated(1, shape, logdir, [args.producer_device]),
            disaggregated(
                1,
                1,
                shape,
                logdir,
                transport=args.transport,
                store_size=args.store_size,
                store_device=args.store_device,
                producer_device=args.producer_device,
                consumer_device=args.consumer_device,
                proxy_args=("--no-prefetch",) if args.no_prefetch else (),
                consumer_section=(
                    f"  landing_zone_size: {args.landing_zone}\n" if args.landing_zone else ""
                ),
            ),
        ]
        split: dict[int, dict[str, float]] = {}
        ttft_split: dict[int, dict[str, float]] = {}
        local_split: dict[int, dict[str, float]] = {}
        prefetch: dict[str, float] = {}
        started: list[Deployment] = []
        try:
            for d in deployments:
                started.append(d)
                d.start()
            for d in deployments:
                wait_routing(d, 1)
            urls = [d.client_urls[0] for d in deployments]
            for n, ps in prompts.items():
                tags = [f"{d.kind[:3]}{n}" for d in deployments]
                local, disagg = asyncio.run(_paired(urls, ps, args.http_tokens, tags))
                got["aggregated"][n] = _figures(local)
                got["disaggregated"][n] = _figures(disagg)
                at = _moments(disagg, tags[1], {
                    "p": (logdir / "proxy.log", "done"),
                    "c": (logdir / "consumer-0.log", DONE),
                    "r": (logdir / "producer-0.log", DONE),
                })  # fmt: skip
                split[n] = _medians(at, SPLIT)
                ttft_split[n] = _medians(at, TTFT_SPLIT)
                at = _moments(local, tags[0], {"l": (logdir / "instance-0.log", DONE)})
                local_split[n] = _medians(at, LOCAL_SPLIT)
            prefetch = _metric(deployments[1].engine_urls[-1])  # the consumer's
        finally:
            for d in reversed(started):
                d.stop()
    rows = []
    for n in args.lens:
        loc, dis = got["aggregated"][n], got["disaggregated"][n]
        rows.append(
            {
                "prompt_tokens": n,
                "local": loc,
                "disaggregated": dis,
                "ttft_ratio": dis["ttft_ms"] / loc["ttft_ms"],
                "gap_ratio": dis["gap_ms"] / dis["tbt_ms"],
                "gap_split": split.get(n, {}),
                "ttft_split": ttft_split.get(n, {}),
                "local_split": local_split.get(n, {}),
            }
        )
    return {
        "mode": "http",
        "prefetch": not args.no_prefetch,
        "landing_zone": args.landing_zone or None,
        "results": rows,
        "consumer_prefetch": prefetch,
    }


def _metric(url: str) -> dict[str, float]:
    """The consumer's prefetch and landing-zone counters (``/metrics``), by outcome."""
    import urllib.request

    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith(("disagg_consumer_prefetch_", "disagg_consumer_zone_")):
            name, _, value = line.rpartition(" ")
            name = name.partition("{")[0].removeprefix("disagg_consumer_")
            try:
                out[name.removesuffix("_total")] = float(value)
            except ValueError:
                pass
    return out


def table(rep: dict[str, Any]) -> str:
    head = "prompt  local TTFT  disagg TTFT  ratio   local gap  disagg gap  disagg TBT  gap/TBT\n"
    lines = [head.rstrip()]
    for r in rep["results"]:
        loc, dis = r["local"], r["disaggregated"]
        lines.append(
            f"{r['prompt_tokens']:>6}  {loc['ttft_ms']:>8.1f}ms  {dis['ttft_ms']:>9.1f}ms  "
            f"{r['ttft_ratio']:>5.2f}x  {loc['gap_ms']:>7.1f}ms  {dis['gap_ms']:>8.1f}ms  "
            f"{dis['tbt_ms']:>8.1f}ms  {r['gap_ratio']:>6.2f}x"
        )
    for what, key, segments in (
        ("the local TTFT", "local_split", LOCAL_SPLIT),
        ("the disaggregated TTFT", "ttft_split", TTFT_SPLIT),
        ("the disaggregated gap", "gap_split", SPLIT),
    ):
        lines.append(f"where {what} goes (medians, ms):")
        lines.append("prompt  " + "  ".join(f"{name:>9}" for name, _, _ in segments))
        for r in rep["results"]:
            sp = r.get(key, {})
            cells = [f"{sp[n]:>9.2f}" if n in sp else f"{'-':>9}" for n, _, _ in segments]
            lines.append(f"{r['prompt_tokens']:>6}  " + "  ".join(cells))
    return "\n".join(lines)
