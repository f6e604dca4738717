"""``disagg demo`` end to end: the deployment shapes it is there to show each match the
monolithic run token for token and page for page, with pages really moved."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(300)

SHAPES = {
    "mxn": ["--producers", "2", "--consumers", "2"],
    # producer TP 4, consumer TP 2: each consumer page assembled from two producer ranks
    "tp-sync": ["--tp-producer", "4", "--tp-consumer", "2", "--kv-heads", "4", "--sync"],
    "vswa-chunked": ["--windows", "64,64,full", "--kv-manager", "v2", "--chunk-size", "48"],
    "v1-small-blocks": [
        "--layers", "3", "--tokens-per-block", "16", "--kv-manager", "v1", "--num-prompts", "3",
    ],
    "nixl-tp-sync": ["--transport", "nixl", "--tp", "2", "--sync"],
}  # fmt: skip
_NO_NIXL = all(importlib.util.find_spec(m) is None for m in ("nixl_cu12", "nixl_cu13", "nixl"))
MARKS = {  # the nixl shape: a minute more; CI's nixl coverage is the plane's own tests
    "nixl-tp-sync": [
        pytest.mark.slow,
        pytest.mark.skipif(_NO_NIXL, reason="NIXL is not installed (disagg[nixl])"),
    ],
}


def run_demo(args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "disagg", "demo", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    return r, time.monotonic() - t


@pytest.mark.parametrize("shape", [pytest.param(s, marks=MARKS.get(s, ())) for s in SHAPES])
def test_demo_shape_matches_monolithic(shape: str) -> None:
    r, _ = run_demo(SHAPES[shape])
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["match"] is True and rep["ok"] is True
    assert rep["remote_tokens"] > 0 and rep["bytes_moved"] > 0
    assert rep["transfer_seconds"] > 0 and rep["ttft_disagg_s"] > 0 and rep["ttft_local_s"] > 0
    reqs = rep["requests"]
    assert len(reqs) == rep["config"]["prompts"]
    assert all(q["tokens_match"] and not q["pages_mismatched"] for q in reqs)
    assert sum(q["remote_tokens"] for q in reqs) == rep["remote_tokens"]
    # pages are counted once; what they weigh is what the producers pushed
    assert sum(q["bytes"] for q in reqs) == rep["bytes_moved"]
    if shape == "mxn":  # every consumer loaded from every producer
        assert {(q["consumer"], q["served_by"]) for q in reqs} == {(0, 0), (0, 1), (1, 0), (1, 1)}
        assert rep["pairs_missing"] == []
    if shape in ("tp-sync", "nixl-tp-sync"):
        assert rep["layer_slices_pushed"] > rep["pages_moved"]
    assert rep["leases_left"] == 0 and rep["pinned_blocks_left"] == 0
    assert "match" in r.stderr  # the table went to stderr, the JSON alone to stdout
    assert len(r.stdout.strip().splitlines()) == 1
