"""PNG of GB/s against page size, one line per transport/channel, ceilings dashed."""

from __future__ import annotations

from typing import Any


def plot_transfer(report: dict[str, Any], path: str) -> str | None:
    """Write the plot; returns an error string instead of raising when matplotlib is
    missing (``pip install disagg[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is not installed ({exc}); pip install disagg[bench]"
    fig, ax = plt.subplots(figsize=(8, 5))
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in report["results"]:
        if r["gbps"] is not None:
            lines.setdefault(f"{r['transport']}-{r['channel']}", []).append(
                (r["page_bytes"], r["gbps"])
            )
    for name, pts in lines.items():
        pts.sort()
        ax.plot([p / 1024 for p, _ in pts], [g for _, g in pts], marker="o", label=name)
    for name, g in report.get("ceilings_gbps", {}).items():
        ax.axhline(g, linestyle="--", linewidth=0.8, color="grey")
        ax.annotate(f"{name} {g:.1f}", (0.01, g), xycoords=("axes fraction", "data"), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("page size (KiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(
        f"disagg bench transfer: {report['total_bytes'] >> 20} MiB per transfer, median of {report['repeats']}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
