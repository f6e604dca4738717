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


def test_bench_transfer_ucx_quick_json(capsys):
    pytest.importorskip("ucxx", reason="ucxx not installed")
    assert (
        main(["transfer", "--quick", "--page-sizes", "64KiB", "--transports", "ucx-shm", "--json"])
        == 0
    )
    (row,) = _last_json(capsys.readouterr().out)["results"]
    assert row["transport"] == "ucx" and row["channel"] == "shm" and row["gbps"] > 0


def test_bench_query_json(capsys):
    assert main(["query", "--prompt-lens", "256,1024", "--iters", "5", "--json"]) == 0
    rep = _last_json(capsys.readouterr().out)
    assert [r["prompt_tokens"] for r in rep["results"]] == [256, 1024]
    assert all(r["p99_ms"] >= r["p50_ms"] > 0 for r in rep["results"])


def test_bench_usage():
    assert main(["nope"]) == 2
