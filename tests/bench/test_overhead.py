"""``disagg bench overhead``: one small prompt through a local engine, a producer process
and a timed consumer; the split adds up and every part is positive."""

from __future__ import annotations

import json

import pytest

from disagg.bench import main


@pytest.mark.timeout(180)
def test_overhead_split_adds_up(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["overhead", "--prompt-lens", "256", "--repeats", "1", "--layers", "2", "--json"]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = rep["results"]
    assert row["prompt_tokens"] == 256
    parts = [row[f"{k}_ms"] for k in ("claim", "transfer", "first_step", "other")]
    assert sum(parts) == pytest.approx(row["consumer_ms"], rel=1e-6)
    assert row["claim_ms"] > 0 and row["transfer_ms"] > 0 and row["first_step_ms"] > 0
    assert row["local_ms"] > 0 and row["producer_ms"] >= row["producer_first_token_ms"] > 0
    assert 0 < row["commit_lag_max_ms"] < row["producer_ms"]  # a pass was committed
    assert 0 < row["producer_hooks_ms"] < row["producer_ms"]
    # 256 tokens, the last never offered: 7 blocks of 32 tokens loaded
    assert row["loaded_bytes"] == 7 * rep["page_bytes"]
    assert rep["plane_gbps"] > 0 and row["wire_ms"] > 0
    assert row["overhead_ms"] == pytest.approx(
        row["producer_ms"] + row["consumer_ms"] - row["local_ms"]
    )


def test_overhead_bad_lengths_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["overhead", "--prompt-lens", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--prompt-lens '10'" in err and len(err.splitlines()) == 1


@pytest.mark.timeout(240)
def test_overhead_at_the_client_over_http(capsys: pytest.CaptureFixture[str]) -> None:
    """The quick form of the client-side comparison: one local server against producer +
    consumer + proxy, the same prompt lengths; every figure measured and positive. The
    consumer has a landing zone: every prefetched lease taken loaded from it."""
    argv = ["overhead", "--http", "--prompt-lens", "128", "--repeats", "1", "--layers", "2"]
    assert main([*argv, "--http-tokens", "4", "--landing-zone", "64MiB", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = rep["results"]
    assert row["prompt_tokens"] == 128
    for side in ("local", "disaggregated"):
        assert row[side]["ttft_ms"] > 0 and row[side]["gap_ms"] > 0 and row[side]["tbt_ms"] > 0
    assert row["ttft_ratio"] > 0 and row["gap_ratio"] > 0
    # where the gap goes: every segment found in the proxy's and the consumer's logs; the
    # consumer was told of every prompt, and each continuation took its prefetched lease
    # or came before it was granted (one that came late claimed as usual)
    split = row["gap_split"]
    assert set(split) == {"handover", "hop", "parse", "admit", "claim", "transfer", "tail", "back"}
    assert all(v >= 0 for v in split.values()), split
    assert split["transfer"] > 0 and split["tail"] > 0
    # where the first token's time goes: the proxy's and the producer's moments, and the
    # local server's, each segment found and in order
    ttft = row["ttft_split"]
    names = {"to_proxy", "route", "hop", "parse", "admit", "prefill", "out", "relay", "to_client"}
    assert set(ttft) == names, ttft
    local = row["local_split"]
    assert set(local) == {"hop", "parse", "admit", "prefill", "to_client"}, local
    for segments in (ttft, local):
        assert all(v >= 0 for v in segments.values()) and segments["prefill"] > 0, segments
    pre = rep["consumer_prefetch"]
    assert pre.get("prefetch_started") == 2, pre  # the warm-up prompt and the measured one
    assert pre.get("prefetch_taken", 0) + pre.get("prefetch_late", 0) == 2, pre
    assert pre.get("zone_loads", 0) == pre.get("prefetch_taken", 0), pre
