"""``disagg bench query``: ``get_num_new_matched_tokens`` latency, end to end.

What is timed per call is what the consumer scheduler does (consumer/connector.py):
``block_keys`` over the prompt, then ``ConsumerService.claim`` (a Claim round trip over
the ZMQ control channel to a real ``ProducerService`` in another process on loopback,
whose BlockStore holds every block of the prompt). The lease is released after each
call, outside the timed section. Each prompt is a fresh random token sequence.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .units import percentile

_NS = "bench-model"


def _config(role: str, tpb: int, producers: str | None = None, store_blocks: int = 0) -> Any:
    from ..config import DisaggConfig

    d: dict[str, Any] = {"role": role, "instance_id": f"bench-{role}", "model_id": _NS}
    if role == "producer":
        d["producer"] = {"control": "tcp://127.0.0.1:0", "store_size": store_blocks * 64 * 2}
    else:
        d["consumer"] = {"producers": [producers], "claim_timeout_s": 5.0}
    return DisaggConfig.from_dict(d)


def _pool(tpb: int) -> Any:
    import torch

    from ..pages import PagePool

    # Tiny pages (64 B/block): the benchmark is about the control path, not bytes.
    kv = torch.zeros(64, 1, 2, 16, dtype=torch.float16)
    return PagePool.from_v1_tensor(kv, tpb)


def _producer(tpb: int, prompts: list[np.ndarray], conn: Any) -> None:
    from ..producer.service import ProducerService
    from ..protocol.keys import block_keys

    blocks = sum(len(p) // tpb for p in prompts)
    svc = ProducerService(_config("producer", tpb, store_blocks=blocks + 16), None)
    svc.attach(_pool(tpb))
    seed = svc.namespace_seed(None)
    for p in prompts:
        keys = block_keys(seed, p, tpb)
        rows = svc.store.plan(keys)
        assert (rows >= 0).all(), "store too small for the benchmark prompts"
        svc.store.mark_staging(keys)
        svc.store.commit(keys)
    conn.send(svc.endpoint)
    conn.recv()  # until told to stop
    svc.close()


def run(prompt_lens: Sequence[int], tpb: int, iters: int, log: Any = None) -> dict[str, Any]:
    from ..consumer.service import ConsumerService
    from ..protocol.keys import block_keys

    log = log or sys.stderr
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, n, dtype=np.int64) for n in prompt_lens]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    prod = ctx.Process(target=_producer, args=(tpb, prompts, b), daemon=True)
    prod.start()
    rows = []
    try:
        if not a.poll(120):
            raise RuntimeError("producer did not start")
        endpoint = a.recv()
        svc = ConsumerService(_config("consumer", tpb, producers=endpoint), None)
        svc.attach(_pool(tpb))
        seed = svc.namespace_seed(None)
        for n, prompt in zip(prompt_lens, prompts, strict=True):
            tot, keyt, claimt = [], [], []
            for i in range(iters + 5):
                t0 = time.perf_counter()
                keys = block_keys(seed, prompt, tpb)
                t1 = time.perf_counter()
                claimed = svc.claim(i, keys)
                t2 = time.perf_counter()
                if claimed is None or claimed.num_blocks != len(keys):
                    raise RuntimeError(
                        f"claim for {n} tokens matched {claimed and claimed.num_blocks} of {len(keys)} blocks"
                    )
                svc.release(claimed)
                if i >= 5:  # warm-up
                    tot.append((t2 - t0) * 1e3)
                    keyt.append((t1 - t0) * 1e3)
                    claimt.append((t2 - t1) * 1e3)
            row = {
                "prompt_tokens": n,
                "blocks": n // tpb,
                "p50_ms": percentile(tot, 50),
                "p99_ms": percentile(tot, 99),
                "keys_p50_ms": percentile(keyt, 50),
                "claim_p50_ms": percentile(claimt, 50),
                "claim_p99_ms": percentile(claimt, 99),
            }
            rows.append(row)
            print(
                f"  {n:7d} tokens: p50 {row['p50_ms']:.3f} ms, p99 {row['p99_ms']:.3f} ms "
                f"(keys {row['keys_p50_ms']:.3f}, claim {row['claim_p50_ms']:.3f} p50)",
                file=log,
                flush=True,
            )
        svc.close()
    finally:
        a.send("stop")
        prod.join(10)
        if prod.is_alive():
            prod.kill()
    return {"bench": "query", "tokens_per_block": tpb, "iters": iters, "results": rows}


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{'prompt':>8s} {'blocks':>7s} {'p50 ms':>8s} {'p99 ms':>8s} {'keys p50':>9s} {'claim p50':>10s} {'claim p99':>10s}"
    ]
    for r in report["results"]:
        lines.append(
            f"{r['prompt_tokens']:8d} {r['blocks']:7d} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} "
            f"{r['keys_p50_ms']:9.3f} {r['claim_p50_ms']:10.3f} {r['claim_p99_ms']:10.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="disagg bench query", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", default="1024,8192,32768,131072")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(list(argv))
    lens = [int(x) for x in a.prompt_lens.split(",") if x.strip()]
    report = run(lens, a.tokens_per_block, a.iters)
    print(table(report))
    if a.json:
        print(json.dumps(report))
    return 0
