"""Smoke runs of ``disagg bench`` with tiny sizes: they run and report (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from disagg.bench import main

pytestmark = pytest.mark.timeout(120)


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_transfer_quick_json(capsys):
    assert (
        main(["transfer", "--quick", "--page-sizes", "64KiB", "--transports", "zmq-tcp", "--json"])
        == 0
    )
    rep = _last_json(capsys.readouterr().out)
    (row,) = rep["results"]
    assert {"transport", "channel", "page_bytes", "gbps", "ceiling_gbps", "ratio"} <= set(row)
    assert row["transport"] == "zmq" and row["page_bytes"] == 65536
    assert row["gbps"] > 0 and row["ratio"] == pytest.approx(row["gbps"] / row["ceiling_gbps"])
    assert row["ceiling_paired"] is True and row["ratio_paired_median"] > 0


@pytest.mark.parametrize("name", ["zmq-tcp", "ucx-tcp", "ipc-shm"])
def test_bench_transfer_ceiling_is_paired_per_row(name):
    """Each repetition times one ceiling run (raw TCP from the producer process / memcpy)
    and one push in the row's own processes: as many ceiling times as pushes."""
    if name.startswith("ucx"):
        pytest.importorskip("ucxx", reason="ucxx not installed")
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


def test_bench_transfer_peers_report_a_rate_or_their_error(capsys):
    """NIXL and Mooncake move the same pages (or their rows carry why they could not)."""
    argv = ["transfer", "--quick", "--page-sizes", "64KiB", "--transports", "nixl,mooncake"]
    assert main([*argv, "--timeout", "60", "--json"]) == 0
    rows = _last_json(capsys.readouterr().out)["results"]
    assert [(r["transport"], r["channel"]) for r in rows] == [("nixl", "ucx"), ("mooncake", "tcp")]
    for r in rows:
        assert (r["gbps"] is not None and r["gbps"] > 0) or r["error"], r
        assert r["gbps"] is None or (r["ceiling_gbps"] > 0 and r["ratio_paired_median"] > 0), r
    for r, mod in zip(rows, ("nixl_cu12", "mooncake.engine"), strict=True):
        try:
            __import__(mod)
        except ImportError:
            continue
        assert r["gbps"] is not None and r["gbps"] > 0, r  # installed: it must run


def test_bench_transfer_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (disagg[bench])")
    from disagg.bench.plot import plot_transfer

    rows = [
        {"transport": t, "channel": c, "page_bytes": pb, "gbps": g, "ceiling_gbps": 5.0}
        for t, c, g in (("zmq", "tcp", 0.5), ("nixl", "ucx", 1.0))
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
