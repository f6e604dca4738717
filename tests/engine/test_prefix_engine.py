"""The reference engine's prefix-reservation path, driven by a scripted connector: the
runtime rules TensorRT-LLM main's unit tests pin (UT-RES, UT-EXEC; see
docs/design/prefix-reservations.md)."""

from __future__ import annotations

import prefix_recording_connector as pc
import pytest

from disagg.engine.reference import ConnectorSpec, Engine, EngineConfig

CFG = dict(
    num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, tokens_per_block=16, num_blocks=64, kv_manager="v2",
    prefix_aware_scheduling=True,
)  # fmt: skip
PROMPT = list(range(1, 101))  # 100 tokens: 6 whole blocks, the last token in block 6


def engine(worker: str = "PrefixWorker", **cfg) -> Engine:
    spec = ConnectorSpec("prefix_recording_connector", "PrefixScheduler", worker)
    return Engine(EngineConfig(**{**CFG, **cfg}), spec)


def kinds(*names):
    return [c for c in pc.CALLS if c[0] in names]


def test_partial_capability_is_refused_at_bring_up():
    pc.reset()
    with pytest.raises(ValueError, match="prefix reservations require"):
        engine("NoWorkerHook")


def test_order_clip_release_and_resume():
    """reserve -> tail released (clipped at the last prompt token's block and the cap)
    -> metadata with the load (parked: the request is absent) -> start -> completion ->
    the accepted range released -> the request computes."""
    pc.reset(answer=lambda req, P: (200, True))  # promises past the prompt
    eng = engine(prefix_load_cap_tokens=70)
    rid = eng.add_request(PROMPT, 2)
    eng.step()
    assert kinds("reserve", "release", "meta", "start") == [
        ("reserve", rid, 0, 1),
        ("release", 1, 64, 200),  # 70 -> 64, block-aligned
        ("meta", [(1, 0, 64, True)]),
        ("start", 1),
    ]
    assert eng.results[rid].tokens == [] and eng.stats.forward_passes == 0
    while eng.has_work():
        eng.step()
    assert kinds("release")[-1] == ("release", 1, 0, 64)
    assert eng.results[rid].error is None and eng.results[rid].connector_matched_tokens == 64
    assert not kinds("query")  # the legacy query is not used


@pytest.mark.parametrize("answer", [(-1, False), (True, False), (0, True), (32, 1)])
def test_invalid_answer_fails_the_request_by_name(answer):
    pc.reset(answer=answer)
    eng = engine()
    rid = eng.add_request(PROMPT, 2)
    while eng.has_work():
        eng.step()
    assert "reserve_prefix" in (eng.results[rid].error or "")
    assert eng.results[rid].tokens == []


def test_cancel_keeps_the_allocation_until_the_load_drains_and_stale_ids_are_ignored():
    pc.reset(answer=(64, True), hold=True, extra_ids=[999, 7])
    eng = engine()
    free0 = eng.kv.groups[0].available()
    rid = eng.add_request(PROMPT, 2)
    eng.step()
    held = eng.kv.groups[0].available()
    assert held < free0
    eng.cancel(rid)
    for _ in range(5):  # the load never reports: no timeout frees the pages
        eng.step()
    assert eng.kv.groups[0].available() == held and eng.has_work()
    assert kinds("release") == [] and kinds("finished") == []
    pc.CONTROL["hold"] = False
    eng.step()  # reported
    eng.step()  # retired: released, then handed back and freed
    assert kinds("release") == [("release", 1, 0, 64)]
    assert kinds("finished") == [("finished", rid)]
    assert eng.kv.groups[0].available() == free0 and not eng.has_work()
    assert eng.results[rid].error == "cancelled" and eng.results[rid].tokens == []


@pytest.mark.parametrize("is_async", [True, False])
def test_tp2_a_load_retires_only_once_every_rank_reported(is_async):
    """TP=2 (thread ranks): rank 0 reports the load, rank 1 withholds it: the load is not
    retired (no release; an async request stays parked) until rank 1 reports too, as
    TensorRT-LLM's PrefixLoadCompletionTracker completes an id at ``len(workers) == size``."""
    pc.reset(answer=(64, is_async), hold_ranks={1})
    eng = engine(tp=2)
    rid = eng.add_request(PROMPT, 2)
    for _ in range(4):
        eng.step()
    assert kinds("start") == [("start", 1), ("start", 1)]  # each rank started it
    assert kinds("release") == []
    if is_async:
        assert eng.stats.forward_passes == 0 and eng.results[rid].tokens == []
    pc.CONTROL["hold_ranks"] = set()
    while eng.has_work():
        eng.step()
    assert kinds("release") == [("release", 1, 0, 64)]
    assert eng.results[rid].error is None and len(eng.results[rid].tokens) == 2
