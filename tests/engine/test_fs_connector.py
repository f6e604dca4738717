"""Cold run, then warm run in a fresh process, through the file-system example connector.

Honest byte check: the warm run dumps the page bytes right after the connector loaded them
(``--dump-pages``); an in-process *monolithic* engine of the same configuration captures the
pages it computed itself. Every loaded page must equal the monolithic page byte for byte,
and the warm tokens must equal the cold (and monolithic) tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from disagg.engine.reference import ConnectorSpec, Engine, EngineConfig, parse_windows

MOD = "disagg.engine.examples.fs_connector"
PROMPT_LEN = 200


def cli(tmp: Path, classes: tuple[str, str], args: list[str], dump: Path | None = None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "disagg.engine.reference",
        "--connector-module",
        MOD,
        "--connector-scheduler-class",
        classes[0],
        "--connector-worker-class",
        classes[1],
        "--json",
        *args,
    ]
    if dump is not None:
        cmd += ["--dump-pages", str(dump)]
    env = dict(os.environ, DISAGG_FS_CONNECTOR_DIR=str(tmp / "store"))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr + p.stdout
    return json.loads(p.stdout.strip().splitlines()[-1])


CASES = {
    "v1": (("FsConnectorScheduler", "FsConnectorWorker"), ["--kv-manager", "v1"]),
    "v1-chunked": (
        ("FsConnectorScheduler", "FsConnectorWorker"),
        ["--kv-manager", "v1", "--chunk-size", "48"],
    ),
    "v2-vswa": (
        ("FsGroupedConnectorScheduler", "FsGroupedConnectorWorker"),
        ["--kv-manager", "v2", "--windows", "64,full"],
    ),
    "v2-vswa-chunked": (
        ("FsGroupedConnectorScheduler", "FsGroupedConnectorWorker"),
        ["--kv-manager", "v2", "--windows", "64,full", "--chunk-size", "40"],
    ),
    "v2-tp2-flat": (
        ("FsConnectorScheduler", "FsConnectorWorker"),
        ["--kv-manager", "v2", "--tp", "2"],
    ),
}


# The chunked variants repeat their unchunked case with another chunk size (~10 s each):
# they run with -m slow.
_CHUNKED = {"v1-chunked", "v2-vswa-chunked"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c in _CHUNKED else c for c in sorted(CASES)],
)
def test_cold_then_warm_fresh_process(tmp_path: Path, case: str) -> None:
    classes, extra = CASES[case]
    args = [
        "--prompt-len",
        str(PROMPT_LEN),
        "--max-tokens",
        "8",
        "--tokens-per-block",
        "16",
        "--num-prompts",
        "2",
        "--seed",
        "3",
        *extra,
    ]
    cold = cli(tmp_path, classes, args + ["--cache-salt", "s1"], tmp_path / "cold.pt")
    warm = cli(tmp_path, classes, args + ["--cache-salt", "s1"], tmp_path / "warm.pt")
    assert cold["connector_matched_tokens"] == 0
    assert warm["outputs"] == cold["outputs"]
    # prompts of 200 tokens, blocks of 16: 12 whole blocks offered, never the last token
    assert warm["per_request_connector_matched"] == [192, 192]
    # monolithic reference with the same configuration
    kw = dict(tokens_per_block=16, kv_manager="v1", chunk_size=None, tp=1, windows=(None,))
    it = iter(extra)
    for flag in it:
        val = next(it)
        key = {
            "--kv-manager": "kv_manager",
            "--chunk-size": "chunk_size",
            "--tp": "tp",
            "--windows": "windows",
        }[flag]
        kw[key] = (
            parse_windows(val) if key == "windows" else (val if key == "kv_manager" else int(val))
        )
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(PROMPT_LEN)] for _ in range(2)]
    mono = Engine(EngineConfig(seed=3, capture_pages=True, enable_block_reuse=False, **kw))
    ids = [mono.add_request(p, 8, "s1") for p in prompts]
    while mono.has_work():
        mono.step()
    assert [mono.results[i].tokens for i in ids] == cold["outputs"]
    warm_pages = torch.load(tmp_path / "warm.pt")
    cold_pages = torch.load(tmp_path / "cold.pt")
    n_groups = len(EngineConfig(**kw).layer_groups)
    for k, rid in enumerate(ids):
        ref = {f"{g}:{o}": b for (g, o), b in mono.results[rid].computed_pages.items()}
        loaded = warm_pages[k]["loaded"]
        assert len(loaded) >= 12  # full group: all 12 blocks; sliding group: its window
        for key, t in loaded.items():
            assert bytes(t.numpy()) == ref[key], f"prompt {k} page {key} differs"
        for key, t in cold_pages[k]["computed"].items():
            assert bytes(t.numpy()) == ref[key]
        if n_groups == 2:  # sliding group (0): only the blocks the window reaches were loaded
            assert {key for key in loaded if key.startswith("1:")} == {f"1:{o}" for o in range(12)}
            assert 0 < len([key for key in loaded if key.startswith("0:")]) < 12
    # a different salt misses
    other = cli(tmp_path, classes, args + ["--cache-salt", "s2"])
    assert other["connector_matched_tokens"] == 0 and other["outputs"] == cold["outputs"]


def test_fs_connector_async_load_and_prefix_chaining(tmp_path: Path) -> None:
    spec = ConnectorSpec(
        MOD, "FsConnectorScheduler", "FsConnectorWorker", {"fs_connector_dir": str(tmp_path / "s")}
    )
    p = [(i * 7) % 500 for i in range(100)]
    cold = Engine(EngineConfig(tokens_per_block=16), spec).generate([p], 6)
    aspec = ConnectorSpec(
        spec.module, spec.scheduler_class, spec.worker_class, {**spec.extra, "fs_async_load": True}
    )
    eng = Engine(EngineConfig(tokens_per_block=16), aspec)
    assert eng.generate([p], 6) == cold
    assert (
        eng.stats.connector_matched_tokens == 96 and eng.stats.calls["get_finished"] == 6 + 2
    )  # parked once; +1 overlap
    # chaining: same second block after a different first block must not be served
    q = [499 - t for t in p[:16]] + p[16:]
    eng2 = Engine(EngineConfig(tokens_per_block=16), spec)
    eng2.generate([q], 2)
    assert eng2.stats.connector_matched_tokens == 0


def test_speed_2000_token_prompt() -> None:
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(num_layers=4))
    out = eng.generate([[(i * 13) % 512 for i in range(2000)]], 32)
    elapsed = time.perf_counter() - t0
    assert len(out[0]) == 32
    assert elapsed < 60, elapsed
