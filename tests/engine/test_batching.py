"""In-flight batching: the scheduler's limits and order, and batch-invariant numerics (a
request's KV bytes and tokens do not depend on what else shares its forwards)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import engine_recording_connector as rc  # noqa: E402

from disagg.engine.reference import ConnectorSpec, Engine, EngineConfig  # noqa: E402

FLAT = ConnectorSpec("engine_recording_connector", "RecScheduler", "RecWorker")
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)


def prompt(n: int, seed: int = 1) -> list[int]:
    return [(i * 37 + seed * 11) % 500 for i in range(n)]


def alone_and_batched(cfg: EngineConfig, target: list[int], steps: int = 30):
    """``target``'s result run alone, and run among others arriving around it: its rows
    sit at other offsets, share forwards with prefill chunks and 5-7 decode rows, and its
    decode steps complete pages (run alone, a decode step is a single row)."""
    solo = Engine(cfg)
    rid = solo.add_request(target, steps)
    while solo.has_work():
        solo.step()
    eng = Engine(cfg)
    eng.add_request(prompt(150, seed=7), 40)
    for s in range(5):
        eng.add_request(prompt(5 + s, seed=8 + s), 30 + s)
    eng.step()
    mid = eng.add_request(target, steps)
    eng.step()
    eng.add_request(prompt(61, seed=9), 9)
    while eng.has_work():
        eng.step()
    return solo.results[rid], eng.results[mid]


@pytest.mark.parametrize(
    "shape",
    [dict(), dict(chunk_size=24), dict(kv_manager="v2", windows=(32, None), chunk_size=40)],
    ids=["whole", "chunked", "vswa-chunked"],
)
def test_a_request_is_the_same_bits_alone_or_batched(shape) -> None:
    cfg = EngineConfig(**SMALL, tokens_per_block=16, capture_pages=True, **shape)
    assert cfg.exact_batching  # the CPU's default
    alone, batched = alone_and_batched(cfg, prompt(83, seed=3))
    assert batched.error is None and batched.tokens == alone.tokens
    assert alone.computed_pages and batched.computed_pages.keys() == alone.computed_pages.keys()
    for where, data in alone.computed_pages.items():
        assert batched.computed_pages[where] == data, f"page {where} differs when batched"


def test_one_call_per_step_path_gives_the_exact_paths_tokens() -> None:
    """The batched path (CUDA's default: every row in one call) on the CPU: same tokens as
    the batch-invariant path, for a batch mixing chunks, decode steps and a sliding window."""
    ps = [prompt(150), prompt(77, seed=5), prompt(9, seed=6)]
    shape = dict(**SMALL, kv_manager="v2", windows=(32, None), chunk_size=48)
    exact = Engine(EngineConfig(**shape)).generate(ps, [10, 14, 6])
    fast = Engine(EngineConfig(**shape, batch_invariant=False))
    assert not fast.model.exact and fast.model.attention.name == "per-request"
    assert fast.generate(ps, [10, 14, 6]) == exact


def scheduled(out) -> list[tuple[int, int]]:
    return [(r.request_id, r.num_scheduled_tokens) for r in out.new_requests + out.cached_requests]


def test_generation_first_then_chunks_within_the_token_budget() -> None:
    rc.reset()
    cfg = EngineConfig(**SMALL, tokens_per_block=16, max_num_tokens=64, overlap=False)
    eng = Engine(cfg, FLAT)
    a = eng.add_request(prompt(40), 8)
    eng.step()  # a's prompt: 40 tokens
    b = eng.add_request(prompt(200, seed=2), 3)
    c = eng.add_request(prompt(30, seed=3), 3)
    while eng.has_work():
        eng.step()
    steps = [scheduled(o) for o in rc.REC["outputs"]]
    assert steps[0] == [(a, 40)]
    # a decodes (1 token), b takes what is left in whole blocks (63 -> 48), c waits
    assert steps[1] == [(b, 48), (a, 1)]
    for step in steps:
        assert sum(n for _, n in step) <= 64
    for step in steps[1:8]:
        assert (a, 1) in step  # a decode step in every forward while a runs
    b_chunks = [n for step in steps for rid, n in step if rid == b]
    assert sum(b_chunks) == 200 + 2 and b_chunks[-2:] == [1, 1]  # its prompt, 2 decode steps
    assert all(n % 16 == 0 for n in b_chunks[:-3])  # chunks cut to the budget: whole blocks
    # the same tokens as with an unlimited budget
    rc.reset()
    ref = Engine(EngineConfig(**SMALL, tokens_per_block=16, overlap=False), FLAT)
    ref_ids = [ref.add_request(p, m) for p, m in ((prompt(40), 8),)]
    ref.step()
    ref_ids += [ref.add_request(prompt(200, seed=2), 3), ref.add_request(prompt(30, seed=3), 3)]
    while ref.has_work():
        ref.step()
    assert [eng.results[i].tokens for i in (a, b, c)] == [ref.results[i].tokens for i in ref_ids]


def test_batch_limit_holds_requests_back_in_arrival_order() -> None:
    rc.reset()
    eng = Engine(EngineConfig(**SMALL, max_batch_size=2, overlap=False), FLAT)
    ids = [eng.add_request(prompt(20, seed=s), 4) for s in range(4)]
    while eng.has_work():
        eng.step()
    steps = [scheduled(o) for o in rc.REC["outputs"]]
    assert all(len(s) <= 2 for s in steps)
    firsts = [next(i for i, s in enumerate(steps) if any(r == rid for r, _ in s)) for rid in ids]
    assert firsts == sorted(firsts) and firsts[2] > firsts[1]
    assert all(eng.results[i].error is None and len(eng.results[i].tokens) == 4 for i in ids)


def test_requests_that_can_never_run_are_refused_naming_the_limit() -> None:
    eng = Engine(EngineConfig(**SMALL, num_blocks=4, tokens_per_block=16, max_seq_len=256))
    with pytest.raises(ValueError, match="max_seq_len 256"):
        eng.add_request(prompt(250), 10)
    with pytest.raises(ValueError, match="5 KV blocks .* num_blocks 4"):
        eng.add_request(prompt(70), 5)
    assert not eng.has_work()
    with pytest.raises(ValueError, match="max_num_tokens 8 must be at least tokens_per_block"):
        EngineConfig(tokens_per_block=16, max_num_tokens=8)
