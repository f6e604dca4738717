"""``disagg bench engine`` in CI's quick form: every row measured on the CPU, the steps that
carry a prompt chunk timed apart, bad arguments refused in one line."""

from __future__ import annotations

import json

import pytest

from disagg.bench import main


def test_engine_bench_quick_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine", "--quick", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    rep = json.loads(out[-1])
    assert "decode 4 x 64" in "\n".join(out[:-1])  # the table precedes the JSON
    decode = [r for r in rep["results"] if r["kind"] == "decode"]
    assert [r["streams"] for r in decode] == [1, 4]
    for r in decode:
        assert r["step_ms"] > 0 and r["roofline"] > 0
        assert r["tokens_s"] == pytest.approx(r["streams"] * 1e3 / r["step_ms"], rel=1.0)
    prefill = [r for r in rep["results"] if r["kind"] == "prefill"]
    assert [(r["tokens"], r["forwards"]) for r in prefill] == [(128, 1), (256, 1)]
    (mixed,) = [r for r in rep["results"] if r["kind"] == "mixed"]
    assert mixed["chunk_steps"] == 1 and mixed["plain_step_ms"] > 0
    assert rep["ceilings"]["copy_gbps"] > 0 and rep["ceilings"]["matmul_tflops"] > 0
    assert rep["attention"] == "per-request" and rep["batch_invariant"] is True
    assert all(r["target"] == "" for r in rep["results"])  # targets: the 1B shape on CUDA


def test_engine_bench_budget_cuts_a_prefill_into_forwards(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["engine", "--quick", "--streams", "2", "--prefill-lens", "200", "--json"]
    assert main([*argv, "--max-num-tokens", "64", "--tokens-per-block", "16"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (prefill,) = [r for r in rep["results"] if r["kind"] == "prefill"]
    assert prefill["forwards"] == 4 and rep["max_num_tokens"] == 64  # 64 + 64 + 64 + 8


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--streams", "0"], "--streams '0'"),
        (["--context", "0"], "--context 0"),
        (["--max-num-tokens", "8", "--tokens-per-block", "16"], "--max-num-tokens"),
    ],
)
def test_engine_bench_bad_arguments_are_one_line(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["engine", "--quick", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert names in err and len(err.splitlines()) == 1
