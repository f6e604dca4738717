"""What ``disagg bench serve`` reports per deployment: one row from the requests' timings
and the servers' counters, the table, and the plot.

Per request (client side, streaming): TTFT = send to the first chunk with tokens; time
between tokens = the gap between token chunks, split evenly over a chunk's tokens; end to
end = send to the last byte. ``goodput_rps`` = requests that met both SLOs (TTFT <=
``slo_ttft_s``, mean time between tokens <= ``slo_tbt_s``) per second of the run;
``slo_attainment`` their share. ``output_tps`` = output tokens / run wall time.

From the deployment's ``/metrics`` (deltas over the measured run, summed over its engine
servers): ``remote_share`` = prompt tokens loaded through the connector (remote blocks) /
prompt tokens sent (every request's, failed ones too); ``prefill_computed`` = engine
tokens computed minus decode steps (output tokens received - 1 per request); ``prefill_saved`` = prompt tokens - ``prefill_computed``
(negative when a deployment computes more prefill than one pass over every prompt);
``bytes_moved`` = bytes the producers pushed; ``moved_gbps`` = those bytes / run wall time
(an average over the run, not the transfer speed); ``claims_hit``/``_miss``/``_failed``
and ``loads_failed``: the consumers' counters (why a prompt was not served remotely). A
target without those counters gets ``None`` there. ``engine`` (set by the caller) = what
the started engines report in ``/disagg/info``: model name (the shape), dtype, device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

ENGINE_METRICS = {
    "computed": "disagg_engine_computed_tokens_total",
    "device_matched": "disagg_engine_device_matched_tokens_total",
    "connector_matched": "disagg_engine_connector_matched_tokens_total",
    "bytes_pushed": "disagg_producer_bytes_pushed_total",
    "pages_loaded": "disagg_consumer_pages_loaded_total",
    "claims_hit": "disagg_consumer_claims_hit_total",
    "claims_miss": "disagg_consumer_claims_miss_total",
    "claims_failed": "disagg_consumer_claims_failed_total",
    "loads_failed": "disagg_consumer_loads_failed_total",
}
CLAIMS = ("claims_hit", "claims_miss", "claims_failed", "loads_failed")


@dataclass
class Record:
    """One request's timeline (``time.perf_counter`` seconds)."""

    index: int
    prompt_tokens: int
    max_tokens: int
    arrival: float  # scheduled, relative to the run's start
    sent: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    done: float = 0.0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.sent if self.chunks else None

    def gaps(self) -> list[float]:
        out: list[float] = []
        for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:]):
            out += [(t1 - t0) / n] * n
        return out


def parse_metrics(text: str) -> dict[str, float]:
    """Sums of every sample of the families in ``ENGINE_METRICS`` (any labels)."""
    out = {k: 0.0 for k in ENGINE_METRICS}
    names = {v: k for k, v in ENGINE_METRICS.items()}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = names.get(name)
        if key is not None:
            try:
                out[key] += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def _pcts(xs: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(np.asarray(xs), [50, 90, 99]) * scale
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


def summarize(
    name: str,
    layout: str,
    records: list[Record],
    wall_s: float,
    counters: dict[str, float] | None,
    slo_ttft_s: float,
    slo_tbt_s: float,
) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps()]
    e2e = [r.done - r.sent for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    # the servers' counters cover every request sent, failed ones too (their prefill
    # ran, their blocks moved, their decode steps ran until they broke)
    prompt = sum(r.prompt_tokens for r in records)
    good = 0
    for r in ok:
        g = r.gaps()
        tbt = sum(g) / len(g) if g else 0.0
        if r.ttft is not None and r.ttft <= slo_ttft_s and tbt <= slo_tbt_s:
            good += 1
    row: dict[str, Any] = {"deployment": name, "layout": layout, "requests": len(records)}
    row["ok"] = len(ok)
    row["failed"] = len(records) - len(ok)
    errors = [r.error for r in records if r.error]
    row["first_error"] = errors[0] if errors else None
    for key, xs in (("ttft", ttfts), ("tbt", gaps), ("e2e", e2e)):
        for q, v in _pcts(xs).items():
            row[f"{key}_{q}_ms"] = v
    row["output_tokens"] = out_tokens
    row["output_tps"] = out_tokens / wall_s if wall_s > 0 else None
    row["goodput_rps"] = good / wall_s if wall_s > 0 else None
    row["slo_attainment"] = good / len(records) if records else None
    row["prompt_tokens"] = prompt
    row["wall_s"] = wall_s
    if counters is None:
        row.update(remote_share=None, prefill_computed=None, prefill_saved=None)
        row.update(device_hit_tokens=None, bytes_moved=None, moved_gbps=None)
        row.update({k: None for k in CLAIMS})
        return row
    decode_steps = sum(max(0, r.output_tokens - 1) for r in records)
    computed = int(counters["computed"]) - decode_steps
    row["remote_share"] = counters["connector_matched"] / prompt if prompt else None
    row["remote_tokens"] = int(counters["connector_matched"])
    row["device_hit_tokens"] = int(counters["device_matched"])
    row["prefill_computed"] = computed
    row["prefill_saved"] = prompt - computed
    row["bytes_moved"] = int(counters["bytes_pushed"])
    row["moved_gbps"] = counters["bytes_pushed"] / wall_s / 1e9 if wall_s > 0 else None
    row.update({k: int(counters.get(k, 0)) for k in CLAIMS})
    return row


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict[str, Any]], slo_ttft_s: float, slo_tbt_s: float) -> str:
    loads = any(r.get("workload") for r in rows)
    head = (
        ("{:<10} ".format("load") if loads else "")
        + f"{'deployment':<14} {'layout':>9} {'ok':>5} {'TTFT p50/p90/p99 ms':>21} "
        f"{'TBT p50/p90/p99 ms':>19} {'E2E p50/p99 ms':>15} {'out tok/s':>9} "
        f"{'goodput':>7} {'remote':>6} {'prefill saved':>13} {'moved MB':>8} {'GB/s':>6}"
    )
    lines = [head]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['deployment']:<14} could not start: {r['error']}")
            continue
        ttft = "/".join(_f(r[f"ttft_{q}_ms"], ".0f") for q in ("p50", "p90", "p99"))
        tbt = "/".join(_f(r[f"tbt_{q}_ms"], ".1f") for q in ("p50", "p90", "p99"))
        e2e = "/".join(_f(r[f"e2e_{q}_ms"], ".0f") for q in ("p50", "p99"))
        saved = r.get("prefill_saved")
        share = saved / r["prompt_tokens"] if saved is not None and r["prompt_tokens"] else None
        moved = r.get("bytes_moved")
        lines.append(
            ("{:<10} ".format(r.get("workload") or "") if loads else "")
            + f"{r['deployment'][:14]:<14} {r['layout']:>9} {r['ok']:>2}/{r['requests']:<2} "
            f"{ttft:>21} {tbt:>19} {e2e:>15} {_f(r['output_tps'], '.0f'):>9} "
            f"{_f(r['slo_attainment'], '.0%'):>7} {_f(r.get('remote_share'), '.0%'):>6} "
            f"{_f(share, '.0%'):>13} {_f(None if moved is None else moved / 1e6, '.1f'):>8} "
            f"{_f(r.get('moved_gbps'), '.3f'):>6}"
        )
        if r.get("first_error"):
            lines.append(f"{'':<14} {r['failed']} failed, first: {r['first_error']}")
        if any(r.get(k) for k in CLAIMS):
            lines.append(
                f"{'':<14} consumer claims: {r['claims_hit']} hit, {r['claims_miss']} miss, "
                f"{r['claims_failed']} failed; loads failed: {r['loads_failed']}"
            )
    lines.append(
        f"goodput = share of requests with TTFT <= {slo_ttft_s * 1000:g} ms and mean time "
        f"between tokens <= {slo_tbt_s * 1000:g} ms; remote = prompt tokens loaded from "
        "producers' stores; GB/s = bytes moved / run wall time"
    )
    return "\n".join(lines)


def plot(timelines: dict[str, list[Record]], path: str, title: str) -> str | None:
    """Latency CDFs (TTFT, time between tokens, end to end) and the per-request timeline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is not installed ({exc}); pip install matplotlib"
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    cdfs = (("TTFT (ms)", "ttft"), ("time between tokens (ms)", "tbt"), ("end to end (ms)", "e2e"))
    for ax, (label, what) in zip(axes.flat[:3], cdfs):
        for name, recs in timelines.items():
            ok = [r for r in recs if r.error is None]
            if what == "ttft":
                xs = [r.ttft for r in ok if r.ttft is not None]
            elif what == "tbt":
                xs = [g for r in ok for g in r.gaps()]
            else:
                xs = [r.done - r.sent for r in ok]
            if xs:
                v = np.sort(np.asarray(xs)) * 1000
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
        ax.set_xscale("log")
        ax.set_xlabel(label + ", log")
        ax.set_ylabel("share of requests" if what != "tbt" else "share of tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    for k, (name, recs) in enumerate(timelines.items()):
        t0 = min((r.sent for r in recs if r.sent), default=0.0)
        for r in recs:
            if r.error is not None or not r.chunks:
                continue
            y = r.index + 0.3 * k
            ax.plot([r.sent - t0, r.chunks[0][0] - t0], [y, y], color=f"C{k}", lw=1, alpha=0.5)
            ax.plot([r.chunks[0][0] - t0, r.done - t0], [y, y], color=f"C{k}", lw=2)
        ax.plot([], [], color=f"C{k}", label=f"{name}: wait (thin), decode (thick)")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("request")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
