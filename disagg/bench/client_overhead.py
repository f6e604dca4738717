"""``disagg bench overhead --http``: what disaggregation costs one request at the client.

Two deployments of the same shape on this machine, started by :mod:`disagg.bench.deploy`,
each given the same fresh random prompts one at a time (no queueing, no cache hits), every
request streamed (``max_tokens`` = ``--http-tokens``) over HTTP:

- **local**: one aggregated instance (the server ``disagg bench serve`` uses for the
  aggregated deployment);
- **disaggregated**: one producer, one consumer and the proxy; the client's first token is
  the producer's and the consumer continues after it (:mod:`disagg.proxy.first_token`).

Per prompt length, medians over ``--repeats`` prompts after a warm-up prompt: **TTFT**
(send to the first token's chunk), **gap** (the first token's chunk to the second's) and
**TBT** (the median time between later chunks, the consumer's decode step as the client
sees it). Ratios: ``ttft_ratio`` = disaggregated TTFT / local TTFT; ``gap_ratio`` =
disaggregated gap / disaggregated TBT (the hand-over's cost in decode steps).
"""

from __future__ import annotations

import asyncio
import tempfile
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


async def _series(url: str, prompts: list[list[int]], tokens: int) -> list[Record]:
    import aiohttp

    out = []
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for i, p in enumerate(prompts):
            rec = Record(i, len(p), tokens, 0.0)
            await _one(http, url, Request(0.0, p, tokens), rec)
            if rec.error:
                raise RuntimeError(rec.error)
            out.append(rec)
    return out


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
        got: dict[str, dict[int, dict[str, float]]] = {}
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
            ),
        ]
        for d in deployments:
            d.start()
            try:
                wait_routing(d, 1)
                url = d.client_urls[0]
                got[d.kind] = {
                    n: _figures(asyncio.run(_series(url, ps, args.http_tokens)))
                    for n, ps in prompts.items()
                }
            finally:
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
            }
        )
    return {"mode": "http", "results": rows}


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
    return "\n".join(lines)
