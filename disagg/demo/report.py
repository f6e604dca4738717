"""The demo's verdict and summary: per prompt and in total, from what the instances and
the monolithic run reported (:mod:`disagg.demo.parent`).

Pages are counted once each: a page holds every layer of its layer group, whether it
moved whole (async loads) or streamed layer by layer (sync loads; the producers' count
of layer slices pushed is reported apart, as ``layer_slices_pushed``). Transfer time is
each load's span on the producer's data plane, from posting the push to its completion
(every TP rank's); the total adds up, per consumer, the time during which any of its
loads was in flight. TTFT is each request's time to
its first token with all the prompts of an instance submitted at once: disaggregated,
its prefill on the producer plus its first token on the consumer (claim, load, the rest
of the prompt); local, the same prompts on one engine without a connector.
"""

from __future__ import annotations

import argparse
import math
from typing import Any


class DemoFailed(RuntimeError):
    def __init__(self, message: str, logs: list[str]) -> None:
        super().__init__(message)
        self.logs = logs


def _union(spans: list[list[float]]) -> float:
    total, end = 0.0, -math.inf
    for lo, hi in sorted(spans):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _gbps(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 else None


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def build(
    a: argparse.Namespace,
    prompts: list[list[int]],
    routes: list[tuple[int, int]],
    mine: dict[str, list[list[int]]],
    produced: list[dict[str, Any]],
    consumed: list[dict[str, Any]],
    finals: list[dict[str, Any]],
    local: list[dict[str, Any]],
) -> dict[str, Any]:
    where = {
        role: {k: (i, j) for i, ks in enumerate(mine[role]) for j, k in enumerate(ks)}
        for role in mine
    }
    requests = []
    spans: dict[int, list[list[float]]] = {}
    pushes = {k: v for f in finals for k, v in f["push_spans"].items()}
    for k, prompt in enumerate(prompts):
        (pi, pj), (ci, cj) = where["producer"][k], where["consumer"][k]
        got = consumed[ci]["requests"][cj]
        computed = produced[pi]["computed_pages"][pj]
        mono = local[k]["computed_pages"]
        loaded = got["loaded_pages"]
        # a loaded page must equal the producer's page and the one computed locally
        bad = sorted(
            key
            for key, (d, _) in loaded.items()
            if computed.get(key, [None])[0] != d or mono.get(key, [None])[0] != d
        )
        nbytes = sum(n for _, n in loaded.values())
        spans_k = [pushes[t] for t in got["transfers"] if t in pushes]
        window = [min(w[0] for w in spans_k), max(w[1] for w in spans_k)] if spans_k else None
        transfer = window[1] - window[0] if window else 0.0
        if window:
            spans.setdefault(ci, []).append(window)
        tokens_match = got["tokens"] == local[k]["tokens"]
        requests.append(
            {
                "prompt": k,
                "producer": routes[k][0],
                "consumer": ci,
                "served_by": got["producer"],
                "prompt_tokens": len(prompt),
                "remote_tokens": got["remote_tokens"],
                "device_matched_tokens": got["device_matched_tokens"],
                "pages": len(loaded),
                "bytes": nbytes,
                "transfer_s": transfer,
                "gbps": _gbps(nbytes, transfer),
                "ttft_disagg_s": produced[pi]["ttft_s"][pj] + got["ttft_s"],
                "ttft_prefill_s": produced[pi]["ttft_s"][pj],
                "ttft_local_s": local[k]["ttft_s"],
                "tokens_match": tokens_match,
                "pages_mismatched": bad,
                "match": tokens_match and not bad,
            }
        )
    metrics = [f["metrics"] for f in finals]
    bytes_moved = sum(m.get("bytes_pushed", 0) for m in metrics)
    transfer_s = sum(_union(s) for s in spans.values())
    pairs = {(r["consumer"], r["served_by"]) for r in requests if r["remote_tokens"] > 0}
    missing = [
        [c, p] for c in range(a.consumers) for p in range(a.producers) if (c, p) not in pairs
    ]
    match = all(r["match"] for r in requests)
    remote = sum(r["remote_tokens"] for r in requests)
    return {
        "match": match,
        "ok": match and remote > 0 and bytes_moved > 0 and not missing,
        "prompt_tokens": sum(r["prompt_tokens"] for r in requests),
        "remote_tokens": remote,
        "pages_moved": sum(r["pages"] for r in requests),
        "layers": a.layers,
        "layer_slices_pushed": sum(m.get("pages_pushed", 0) for m in metrics)
        if a.load_mode == "sync"
        else None,
        "bytes_moved": bytes_moved,
        "transfer_seconds": transfer_s,
        "transfer_gbps": _gbps(bytes_moved, transfer_s),
        "ttft_disagg_s": _mean([r["ttft_disagg_s"] for r in requests]),
        "ttft_local_s": _mean([r["ttft_local_s"] for r in requests]),
        "pairs_missing": missing,
        "leases_left": sum(f["leases_active"] for f in finals),
        "pinned_blocks_left": sum(f["pinned_blocks"] for f in finals),
        "config": {
            k: getattr(a, k)
            for k in (
                "producers consumers tp tp_producer tp_consumer kv_heads transport load_mode prompts prompt_len max_tokens "
                "layers tokens_per_block kv_manager windows chunk_size cache_salt seed"
            ).split()
        },
        "requests": requests,
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(rep: dict[str, Any]) -> str:
    head = (
        f"{'prompt':>6} {'P->C':>5} {'tokens':>7} {'remote':>7} {'pages':>6} {'MB':>8} "
        f"{'xfer ms':>8} {'GB/s':>6} {'TTFT disagg ms':>15} {'local ms':>9}  match"
    )
    lines = [head]
    for r in rep["requests"]:
        lines.append(
            f"{r['prompt']:>6} {r['served_by'] if r['served_by'] is not None else '-':>3}->"
            f"{r['consumer']:<1} {r['prompt_tokens']:>7} {r['remote_tokens']:>7} "
            f"{r['pages']:>6} {r['bytes'] / 1e6:>8.2f} {_f(r['transfer_s'] * 1e3, '.1f'):>8} "
            f"{_f(r['gbps'], '.2f'):>6} {_f(r['ttft_disagg_s'] * 1e3, '.1f'):>15} "
            f"{_f(r['ttft_local_s'] * 1e3, '.1f'):>9}  "
            + ("yes" if r["match"] else "NO" + (" (pages)" if r["pages_mismatched"] else ""))
        )
    lines.append(
        f"{'total':>6} {'':>5} {rep['prompt_tokens']:>7} {rep['remote_tokens']:>7} "
        f"{rep['pages_moved']:>6} {rep['bytes_moved'] / 1e6:>8.2f} "
        f"{_f(rep['transfer_seconds'] * 1e3, '.1f'):>8} {_f(rep['transfer_gbps'], '.2f'):>6} "
        f"{_f(rep['ttft_disagg_s'] * 1e3, '.1f'):>15} {_f(rep['ttft_local_s'] * 1e3, '.1f'):>9}  "
        + ("yes" if rep["match"] else "NO")
    )
    slices = rep["layer_slices_pushed"]
    lines.append(
        f"pages: each holds all {rep['layers']} layers of its layer group, counted once"
        + (
            f"; sync loads stream them layer by layer ({slices} layer slices pushed)"
            if slices is not None
            else ""
        )
        + ". MB: the consumer's loaded pages (total: bytes the producers pushed)."
    )
    lines.append(
        "TTFT (mean in total): all prompts of an instance submitted at once; disaggregated "
        "= prefill on the producer + first token on the consumer; local = one engine."
    )
    lines.append(
        f"leases left {rep['leases_left']}, pinned blocks left {rep['pinned_blocks_left']}"
    )
    if rep["pairs_missing"]:
        lines.append(f"consumer/producer pairs that moved nothing: {rep['pairs_missing']}")
    lines.append(
        f"tokens and pages match the monolithic run: {rep['match']}; "
        f"remote tokens {rep['remote_tokens']}, bytes moved {rep['bytes_moved']}"
    )
    return "\n".join(lines)
