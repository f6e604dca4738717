"""PNGs of the benchmarks: ``bench transfer`` (GB/s against page size, one line per
transport/channel, each with its own paired ceiling dashed in the same colour: the
ceilings the table's ratios use) and ``bench query`` (latency against prompt length)."""

from __future__ import annotations

from typing import Any

from .units import fmt_size

_PEERS = ("nixl-raw-", "mooncake-")  # rows of peers, not planes: dotted
HINT = 'pip install matplotlib (in a checkout: pip install -e ".[bench]")'


def _pyplot() -> tuple[Any, Any, str | None]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401  (the attribute _log_ticks uses)
    except ImportError as exc:
        return None, None, f"no plot: matplotlib is not installed ({exc}); {HINT}"
    return matplotlib, plt, None


def _log_ticks(ax: Any, matplotlib: Any, ys: list[float]) -> None:
    if not ys:
        return
    lo, hi = min(ys), max(ys)
    ticks = [t for t in (2.0**k for k in range(-12, 14)) if lo / 2 <= t <= hi * 2]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def plot_transfer(report: dict[str, Any], path: str) -> str | None:
    """Write the plot; returns an error string instead of raising when matplotlib is
    missing."""
    matplotlib, plt, err = _pyplot()
    if err:
        return err
    fig, ax = plt.subplots(figsize=(9, 5.5))
    lines: dict[str, list[tuple[int, float, float | None]]] = {}
    failed: dict[str, list[str]] = {}
    for r in report["results"]:
        name = f"{r['transport']}-{r['channel']}"
        if r["gbps"] is not None:
            lines.setdefault(name, []).append((r["page_bytes"], r["gbps"], r.get("ceiling_gbps")))
        else:
            failed.setdefault(name, []).append(fmt_size(r["page_bytes"]))
    sizes = sorted({r["page_bytes"] for r in report["results"]})
    ys: list[float] = []
    for name, pts in lines.items():
        pts.sort()
        style = ":" if name.startswith(_PEERS) else "-"
        (line,) = ax.plot(
            [p for p, _, _ in pts], [g for _, g, _ in pts], style, marker="o", label=name
        )
        ceil = [(p, c) for p, _, c in pts if c]
        if ceil:  # the row's own paired ceiling, as the table's ratio uses it
            ax.plot(
                [p for p, _ in ceil],
                [c for _, c in ceil],
                "--",
                linewidth=1.0,
                color=line.get_color(),
                alpha=0.6,
                label=f"{name} ceiling (paired)",
            )
        ys += [g for _, g, _ in pts] + [c for _, c in ceil]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if sizes:
        ax.set_xticks(sizes, [fmt_size(s) for s in sizes])
        ax.minorticks_off()
    ax.set_xlabel("page size")
    ax.set_ylabel("GB/s (log)")
    _log_ticks(ax, matplotlib, ys)
    title = (
        f"disagg bench transfer: {fmt_size(report['total_bytes'])} of scattered pages per "
        f"transfer, median of {report['repeats']}, {report.get('cpus', '?')} CPUs"
    )
    if failed:
        what = "; ".join(f"{name} at {', '.join(at)}" for name, at in failed.items())
        title += f"\nno result: {what} (see the table's errors)"
    if report.get("skipped"):
        title += f"\nnot run here: {', '.join(s['transport'] for s in report['skipped'])}"
    _save(fig, plt, ax, title, path)
    return None


def plot_query(report: dict[str, Any], path: str) -> str | None:
    """p50/p99 of the timed call and of the raw round-trip floor against prompt length."""
    matplotlib, plt, err = _pyplot()
    if err:
        return err
    rows = sorted(report["results"], key=lambda r: r["prompt_tokens"])
    xs = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ys: list[float] = []
    for key, style, label in (
        ("p50_ms", "-", "query p50"),
        ("p99_ms", "-", "query p99"),
        ("claim_p50_ms", ":", "claim round trip p50"),
        ("floor_p50_ms", "--", "floor: raw ZMQ round trip p50"),
    ):
        vals = [r[key] for r in rows]
        ax.plot(xs, vals, style, marker="o", label=label)
        ys += vals
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms (log)")
    _log_ticks(ax, matplotlib, [y for y in ys if y > 0])
    title = (
        f"disagg bench query: get_num_new_matched_tokens, {report['tokens_per_block']} tokens "
        f"per block, {report['iters']} calls per prompt, {report.get('cpus', '?')} CPUs"
    )
    _save(fig, plt, ax, title, path)
    return None


def _save(fig: Any, plt: Any, ax: Any, title: str, path: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
