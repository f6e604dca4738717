"""``disagg bench serve``: the quick form on a small generated trace (real deployments,
real HTTP), a deployment that cannot start, bad arguments, and the row's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.bench import main
from disagg.bench.serve_report import Record, parse_metrics, summarize
from disagg.bench.traces import synthetic_trace

LATENCY = ("ttft", "tbt", "e2e")


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(240)
def test_quick_serve_on_a_small_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    trace = synthetic_trace(16, rate=8.0, mean_input=6000, mean_output=300, groups=2, seed=4)
    trace.to_jsonl(path)
    argv = ["serve", "--trace", str(path), "--quick", "--length-scale", "0.0625"]
    assert main([*argv, "--time-scale", "0.25", "--json"]) == 0
    out = capsys.readouterr().out
    rep = _last_json(out)
    rows = {r["deployment"]: r for r in rep["results"]}
    assert set(rows) == {"aggregated", "disaggregated"}
    assert rows["aggregated"]["layout"] == "2 instances"
    assert rows["disaggregated"]["layout"] == "1P+1D"
    prompt = rep["workload"]["prompt_tokens"]
    assert rep["workload"]["block_tokens"] == 32 and prompt > 16 * 32
    for name, r in rows.items():
        assert r["requests"] == r["ok"] == 16 and r["failed"] == 0, r
        for k in LATENCY:
            p50, p90, p99 = (r[f"{k}_{q}_ms"] for q in ("p50", "p90", "p99"))
            assert 0 < p50 <= p90 <= p99, (name, k, r)
        assert r["ttft_p50_ms"] < r["e2e_p50_ms"]
        assert r["prompt_tokens"] == prompt
        assert 0 < r["output_tokens"] and r["output_tps"] > 0
        assert 0 <= r["slo_attainment"] <= 1 and r["goodput_rps"] >= 0
        assert r["prefill_computed"] > 0 and r["wall_s"] > 0
    agg, dis = rows["aggregated"], rows["disaggregated"]
    assert agg["output_tokens"] == dis["output_tokens"]  # the same requests, max_tokens each
    assert agg["remote_share"] == 0 and agg["bytes_moved"] == 0
    # every prompt is prefilled on the producer and loaded by the consumer but its last
    # block: most prompt tokens are remote, and pages moved
    assert 0.5 < dis["remote_share"] <= 1, dis
    assert dis["bytes_moved"] > 0 and dis["moved_gbps"] > 0
    assert dis["claims_hit"] > 0 and agg["claims_hit"] == 0
    # two groups of shared documents: the aggregated instances' device caches reuse some
    assert agg["device_hit_tokens"] > 0 and agg["prefill_saved"] == agg["device_hit_tokens"]
    assert "aggregated" in out and "disaggregated" in out and "goodput" in out


@pytest.mark.timeout(120)
def test_a_deployment_that_cannot_start_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--rate", "5", "--requests", "2", "--deployments", "disaggregated"]
    assert main([*argv, "--store-size", "4GB", "--quick", "--json"]) == 1
    cap = capsys.readouterr()
    (row,) = _last_json(cap.out)["results"]
    assert row["deployment"] == "disaggregated" and "producer-0" in row["error"]
    assert "exited rc=2" in row["error"] and "ambiguous" in row["error"], row
    lines = [ln for ln in cap.err.splitlines() if ln.startswith("disagg bench serve:")]
    assert len(lines) == 1 and "producer-0" in lines[0]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--rate", "0"], "--rate '0'"),
        (["--rate", "1,x"], "--rate '1,x'"),
        (["--rate", "1", "--slo-ttft", "fast"], "--slo-ttft 'fast'"),
        (["--rate", "1", "--engines", "1"], "--engines 1"),
        (["--rate", "1", "--producers", "2"], "--producers 2"),
        (["--rate", "1", "--deployments", "mono"], "--deployments 'mono'"),
        (["--rate", "1", "--target", "localhost:8000"], "--target 'localhost:8000'"),
        (["--trace", "/nonexistent.jsonl"], "cannot read trace"),
        ([], "give --trace FILE"),
    ],
)
def test_bad_arguments_are_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_summarize_arithmetic() -> None:
    a = Record(0, 100, 3, 0.0, sent=1.0, chunks=[(1.2, 1), (1.3, 2)], done=1.35, output_tokens=3)
    b = Record(1, 50, 1, 0.0, sent=2.0, chunks=[(4.0, 1)], done=4.0, output_tokens=1)
    c = Record(2, 70, 2, 0.0, sent=2.0, done=2.1, error="HTTP 500")
    counters = {
        "computed": 140.0,
        "device_matched": 10.0,
        "connector_matched": 75.0,
        "bytes_pushed": 2e9,
        "pages_loaded": 3.0,
    }
    r = summarize("x", "1P+1D", [a, b, c], 2.0, counters, slo_ttft_s=1.0, slo_tbt_s=0.1)
    assert (r["requests"], r["ok"], r["failed"], r["first_error"]) == (3, 2, 1, "HTTP 500")
    assert a.gaps() == pytest.approx([0.05, 0.05])
    assert r["ttft_p50_ms"] == pytest.approx(1100)  # 200 ms and 2000 ms
    assert r["output_tokens"] == 4 and r["output_tps"] == pytest.approx(2.0)
    assert r["slo_attainment"] == pytest.approx(1 / 3)  # a only: b's TTFT is 2 s
    # the counters cover every request sent, the failed one too (220 prompt tokens)
    assert r["prompt_tokens"] == 220
    assert r["prefill_computed"] == 140 - 2 and r["prefill_saved"] == 220 - 138
    assert r["remote_share"] == pytest.approx(75 / 220) and r["moved_gbps"] == pytest.approx(1.0)
    assert summarize("t", "external", [a], 1.0, None, 1.0, 0.1)["remote_share"] is None


def test_parse_metrics_sums_labels() -> None:
    text = (
        "# HELP disagg_engine_computed_tokens_total x\n"
        "disagg_engine_computed_tokens_total 12.0\n"
        'disagg_producer_bytes_pushed_total{instance="a"} 100.0\n'
        'disagg_producer_bytes_pushed_total{instance="b"} 50.0\n'
        "disagg_engine_computed_tokens_created 1.7e9\n"
    )
    got = parse_metrics(text)
    assert got["computed"] == 12 and got["bytes_pushed"] == 150 and got["pages_loaded"] == 0


@pytest.mark.timeout(180)
def test_target_measures_a_running_deployment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--target URL``: nothing started or stopped; no server counters, so those are None.
    Two rates: two workloads served in turn, a row each."""
    from disagg.bench import deploy

    dep = deploy.aggregated(1, deploy.Shape(layers=2), tmp_path)
    dep.start(120)
    try:
        url = dep.client_urls[0]
        argv = ["serve", "--rate", "20,40", "--requests", "6", "--input-len", "200"]
        assert main([*argv, "--output-len", "4", "--target", url, "--json"]) == 0
        rep = _last_json(capsys.readouterr().out)
        assert [r["workload"] for r in rep["results"]] == ["20/s", "40/s"]  # one per rate
        assert rep["workload"]["requests"] == 12 and rep["workload"]["rates"] == [20, 40]
        for row in rep["results"]:
            assert row["deployment"] == f"target {url}" and row["layout"] == "external"
            assert row["ok"] == 6 and row["ttft_p50_ms"] > 0 and row["output_tokens"] >= 6
            assert row["remote_share"] is None and row["bytes_moved"] is None
        assert dep.procs[0].proc is not None and dep.procs[0].proc.poll() is None  # still up
    finally:
        dep.stop()


@pytest.mark.timeout(240)
def test_engine_shape_reaches_every_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Non-default shape flags reach the aggregated instances and both disaggregated roles:
    each engine's ``/disagg/info`` names that model (checked by the bench on start)."""
    from disagg.engine.reference import EngineConfig

    shape = ["--layers", "2", "--hidden-size", "64", "--heads", "4", "--kv-heads", "1"]
    shape += ["--head-dim", "16", "--intermediate-size", "96", "--dtype", "bfloat16"]
    shape += ["--num-blocks", "128", "--max-seq-len", "2048"]
    argv = ["serve", "--rate", "50", "--requests", "2", "--input-len", "64", "--output-len", "2"]
    assert main([*argv, *shape, "--warmup", "0", "--json"]) == 0
    rep = _last_json(capsys.readouterr().out)
    want = EngineConfig(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=16,
        intermediate_size=96,
    ).model_name  # fmt: skip
    assert "-h64-l2-a4-kv1-d16-i96-" in want and rep["model"] == want
    assert rep["dtype"] == "bfloat16" and rep["num_blocks"] == 128
    rows = {r["deployment"]: r for r in rep["results"]}
    assert set(rows) == {"aggregated", "disaggregated"}
    for r in rows.values():
        assert r["engine"] == f"{want} bfloat16 cpu" and r["ok"] == 2, r


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--heads", "6", "--kv-heads", "4"], "argument --heads: num_heads must be a multiple"),
        (["--head-dim", "33"], "argument --head-dim: head_dim must be even"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["--hidden-size", "0"], "argument --hidden-size: 0 is below 1"),
        (["--device", "gpu"], "argument --device"),
        (["--max-seq-len", "64"], "--max-seq-len 64"),
    ],
)
def test_bad_engine_shape_is_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["serve", "--rate", "1", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
