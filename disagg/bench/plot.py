"""PNG of GB/s against page size, one line per transport/channel, ceilings dashed."""

from __future__ import annotations

from typing import Any

from .units import fmt_size

_PEERS = ("nixl", "mooncake")


def plot_transfer(report: dict[str, Any], path: str) -> str | None:
    """Write the plot; returns an error string instead of raising when matplotlib is
    missing (``pip install disagg[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as exc:
        return f"no plot: matplotlib is not installed ({exc}); pip install disagg[bench]"
    fig, ax = plt.subplots(figsize=(9, 5.5))
    lines: dict[str, list[tuple[int, float]]] = {}
    failed: dict[str, list[str]] = {}
    for r in report["results"]:
        name = f"{r['transport']}-{r['channel']}"
        if r["gbps"] is not None:
            lines.setdefault(name, []).append((r["page_bytes"], r["gbps"]))
        else:
            failed.setdefault(name, []).append(fmt_size(r["page_bytes"]))
    sizes = sorted({r["page_bytes"] for r in report["results"]})
    for name, pts in lines.items():
        pts.sort()
        style = ":" if name.split("-", 1)[0] in _PEERS else "-"
        ax.plot([p for p, _ in pts], [g for _, g in pts], style, marker="o", label=name)
    ceilings = report.get("ceilings_gbps", {})
    colors = plt.get_cmap("Greys")
    for i, (name, g) in enumerate(sorted(ceilings.items(), key=lambda kv: -kv[1])):
        ax.axhline(
            g,
            linestyle="--",
            linewidth=1.0,
            color=colors(0.8 - 0.5 * i / max(1, len(ceilings))),
            label=f"ceiling: {name} {g:.1f}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if sizes:
        ax.set_xticks(sizes, [fmt_size(s) for s in sizes])
        ax.minorticks_off()
    ax.set_xlabel("page size")
    ax.set_ylabel("GB/s (log)")
    ys = [g for pts in lines.values() for _, g in pts] + list(ceilings.values())
    if ys:
        lo, hi = min(ys), max(ys)
        ticks = [t for t in (2.0**k for k in range(-8, 14)) if lo / 2 <= t <= hi * 2]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    title = (
        f"disagg bench transfer: {fmt_size(report['total_bytes'])} of scattered pages per "
        f"transfer, median of {report['repeats']}, {report.get('cpus', '?')} CPUs"
    )
    if failed:
        what = "; ".join(f"{name} at {', '.join(at)}" for name, at in failed.items())
        title += f"\nno result: {what} (see the table's errors)"
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
