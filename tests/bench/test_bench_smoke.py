"""Smoke runs of ``disagg bench`` with tiny sizes: they run and report (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from disagg.bench import main

pytestmark = pytest.mark.timeout(120)


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_transfer_quick_json(capsys):
    argv = ["transfer", "--quick", "--page-sizes", "64KiB", "--transports", "tcp-tcp", "--tp"]
    assert main([*argv, "--json"]) == 0
    rep = _last_json(capsys.readouterr().out)
    (row,) = rep["results"]
    assert {"transport", "channel", "page_bytes", "gbps", "ceiling_gbps", "ratio"} <= set(row)
    assert row["transport"] == "tcp" and row["page_bytes"] == 65536
    assert row["gbps"] > 0 and row["ratio"] == pytest.approx(row["gbps"] / row["ceiling_gbps"])
    assert row["ceiling_paired"] is True and row["ratio_paired_median"] > 0
    (tp,) = rep["tp"]  # TP-split and TP-merge beside the same-TP transfer, verified pages
    assert tp["transport"] == "tcp" and "error" not in tp, tp
    assert all(tp[f"{k}_gbps"] > 0 for k in ("same", "split", "split1", "merge"))
    assert tp["split_ratio"] > 0 and tp["merge_ratio"] > 0


@pytest.mark.parametrize("name", ["tcp-tcp", "ucx-tcp", "ipc-shm", "nixl"])
def test_bench_transfer_ceiling_is_paired_per_row(name):
    """Each repetition times one ceiling run (raw TCP from the producer process / memcpy /
    raw NIXL reading through the producer's own agent) and one push in the row's own
    processes: as many ceiling times as pushes."""
    if name.startswith("ucx"):
        pytest.importorskip("ucxx", reason="ucxx not installed")
    if name.startswith("nixl"):
        pytest.importorskip("disagg.transport.nixl.plane", reason="NIXL not installed")
    from disagg.bench.transfer import measure

    r = measure(name, 64 << 10, 16, 3, timeout_s=60)
    assert r.error is None, r.error
    assert len(r.push_s) == len(r.ceiling_s) == 3
    assert min(r.push_s) > 0 and min(r.ceiling_s) > 0
    assert r.ceiling_gbps is not None and r.ratio_paired_median is not None
    assert r.ceiling_gbps > 0 and r.ratio_paired_median > 0


def test_bench_transfer_paired_ratio_is_per_repetition():
    """ratio_paired_median: the median of per-repetition push/ceiling ratios, not the ratio
    of the medians."""
    from disagg.bench.transfer import Row

    r = Row(nbytes=10**9, push_s=[1.0, 2.0, 8.0], ceiling_s=[0.5, 4.0, 4.0])
    assert r.gbps == pytest.approx(0.5) and r.ceiling_gbps == pytest.approx(0.25)
    assert r.ratio_paired_median == pytest.approx(0.5)  # ratios 0.5, 2, 0.5
    assert Row(nbytes=1, error="x").ratio_paired_median is None


def test_bench_transfer_ucx_quick_json(capsys):
    pytest.importorskip("ucxx", reason="ucxx not installed")
    assert (
        main(["transfer", "--quick", "--page-sizes", "64KiB", "--transports", "ucx-shm", "--json"])
        == 0
    )
    (row,) = _last_json(capsys.readouterr().out)["results"]
    assert row["transport"] == "ucx" and row["channel"] == "shm" and row["gbps"] > 0


def test_bench_transfer_peers_report_a_rate_or_why_not(capsys):
    """Raw NIXL and Mooncake move the same pages, or are listed once, apart, with the
    reason and what to install (a package, or the system library Mooncake loads)."""
    from disagg.bench.transfer import unavailable

    argv = ["transfer", "--quick", "--page-sizes", "64KiB", "--transports", "nixl-raw,mooncake"]
    assert main([*argv, "--timeout", "60", "--json"]) == 0
    out = capsys.readouterr().out
    rep = _last_json(out)
    rows, skipped = rep["results"], rep["skipped"]
    assert sorted([r["transport"] for r in rows] + [s["transport"] for s in skipped]) == [
        "mooncake",
        "nixl-raw",
    ]
    for s in skipped:
        assert s["reason"] and s["fix"], s
        assert unavailable(s["transport"], cuda=False) == (s["reason"], s["fix"])
        assert f"fix: {s['fix']}" in out  # the table lists it apart, once
    for r in rows:
        assert (r["gbps"] is not None and r["gbps"] > 0) or r["error"], r
        assert r["gbps"] is None or (r["ceiling_gbps"] > 0 and r["ratio_paired_median"] > 0), r
    for r in rows:
        if r["gbps"] is None:
            continue
        assert unavailable(r["transport"], cuda=False) is None


def test_bench_transfer_rows_without_cuda_are_listed_apart(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the rows run")
    argv = ["transfer", "--quick", "--page-sizes", "64KiB", "--transports", "tcp-tcp,ucx-cuda"]
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    rep = _last_json(out)
    assert [r["transport"] for r in rep["results"]] == ["tcp"]
    (s,) = rep["skipped"]
    assert s["transport"] == "ucx-cuda" and s["reason"] == "no CUDA device"
    table = out.strip().rsplit("\n", 1)[0]
    assert table.count("ucx-cuda") == 1  # once, apart from the table's rows


def test_bench_transfer_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (disagg[bench])")
    from disagg.bench.plot import plot_transfer

    rows = [
        {"transport": t, "channel": c, "page_bytes": pb, "gbps": g, "ceiling_gbps": 2 * g}
        for t, c, g in (("tcp", "tcp", 0.5), ("nixl", "ucx", 1.0))
        for pb in (16384, 1 << 20)
    ] + [{"transport": "ucx", "channel": "tcp", "page_bytes": 16384, "gbps": None}]
    report = {
        "results": rows,
        "ceilings_gbps": {"memcpy": 20.0, "raw_tcp": 4.0},
        "total_bytes": 8 << 20,
        "repeats": 1,
    }
    out = tmp_path / "t.png"
    assert plot_transfer(report, str(out)) is None
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_bench_plot_draws_each_rows_paired_ceiling(tmp_path, monkeypatch):
    """The PNG's ceilings are the rows' own (paired) ones, as the table's ratios use, not
    the run-wide figures measured at the start."""
    pytest.importorskip("matplotlib", reason="matplotlib not installed (disagg[bench])")
    import matplotlib.axes

    from disagg.bench.plot import plot_transfer

    drawn: list[list[float]] = []
    orig = matplotlib.axes.Axes.plot

    def spy(self, xs, ys, *a, **kw):
        drawn.append(list(ys))
        return orig(self, xs, ys, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    rows = [
        {"transport": "tcp", "channel": "tcp", "page_bytes": pb, "gbps": g, "ceiling_gbps": c}
        for pb, g, c in ((16384, 0.5, 1.5), (1 << 20, 1.0, 2.5))
    ]
    report = {"results": rows, "ceilings_gbps": {"raw_tcp": 9.0}, "total_bytes": 1 << 20}
    assert plot_transfer({**report, "repeats": 1}, str(tmp_path / "p.png")) is None
    assert drawn == [[0.5, 1.0], [1.5, 2.5]]


def test_bench_query_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (disagg[bench])")
    from disagg.bench.plot import plot_query

    rows = [
        {"prompt_tokens": n, "p50_ms": 0.1 * i, "p99_ms": 0.2 * i, "claim_p50_ms": 0.05 * i,
         "floor_p50_ms": 0.03}
        for i, n in enumerate((1024, 8192), 1)
    ]  # fmt: skip
    out = tmp_path / "q.png"
    rep = {"results": rows, "tokens_per_block": 16, "iters": 5}
    assert plot_query(rep, str(out)) is None
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_hint_names_the_package(monkeypatch):
    import builtins

    from disagg.bench import plot

    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    msg = plot.plot_query({"results": []}, "x.png")
    assert msg is not None and "pip install matplotlib" in msg and '-e ".[bench]"' in msg


def test_bench_query_json(capsys):
    argv = ["query", "--prompt-lens", "256,1024", "--iters", "5", "--warmup", "2", "--json"]
    assert main(argv) == 0
    rep = _last_json(capsys.readouterr().out)
    assert [r["prompt_tokens"] for r in rep["results"]] == [256, 1024]
    for r in rep["results"]:
        assert r["p99_ms"] >= r["p50_ms"] > 0 and r["iters"] == 5
        assert r["floor_p99_ms"] >= r["floor_p50_ms"] > 0 and r["claim_bytes"] > 0
        assert {"keys_p50_ms", "claim_p50_ms", "codec_p50_ms", "pin_p50_ms"} <= set(r)


def test_bench_usage():
    assert main(["nope"]) == 2
