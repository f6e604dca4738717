"""The executor drives a connector as TensorRT-LLM's does (``py_executor.py``'s order)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import engine_recording_connector as rc  # noqa: E402

from disagg.engine import valid_page_slots  # noqa: E402
from disagg.engine.reference import (  # noqa: E402
    ConnectorSpec,
    Engine,
    EngineConfig,
    RankDivergenceError,
)

MOD = "engine_recording_connector"
FLAT = ConnectorSpec(MOD, "RecScheduler", "RecWorker")
GROUPED = ConnectorSpec(MOD, "RecGroupedScheduler", "RecLayoutWorker")
L = 4


def names() -> list[str]:
    return [c[0] for c in rc.REC["calls"]]


WORKER = {"start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"}


def count(name: str, rank: int | None = 0) -> int:
    """Calls of ``name``; worker calls on ``rank`` only (``None``: every rank)."""
    return sum(
        1
        for c in rc.REC["calls"]
        if c[0] == name and (rank is None or name not in WORKER or c[1] == rank)
    )


def prompt(n: int, seed: int = 1) -> list[int]:
    return [(i * 37 + seed * 11) % 500 for i in range(n)]


def run(
    cfg: EngineConfig, spec: ConnectorSpec, prompts: list[list[int]], max_tokens: int, **control
):
    rc.reset(**control)
    eng = Engine(cfg, spec)
    out = eng.generate(prompts, max_tokens)
    return eng, out


@pytest.mark.parametrize("kv_manager", ["v1", "v2"])
def test_call_counts_one_request(kv_manager: str) -> None:
    T = 5
    eng, _ = run(EngineConfig(kv_manager=kv_manager, overlap=False), FLAT, [prompt(40)], T)
    assert count("build") == T and count("start_load_kv") == T and count("wait_for_save") == T
    assert count("wait_for_layer_load") == L * T and count("save_kv_layer") == L * T
    layers = [c[2] for c in rc.REC["calls"] if c[0] == "wait_for_layer_load"]
    assert layers == list(range(L)) * T
    assert count("query") == 1 and count("alloc") == 1 and count("finished") == 1
    assert len(rc.REC["gf"]) == T
    assert (
        eng.stats.calls["get_finished"] == T
        and eng.stats.calls["register_forward_pass_callable"] == 1
    )
    # order inside an iteration: build -> start_load_kv -> (pre, post)*L -> wait_for_save
    first = names()[names().index("build") : names().index("wait_for_save") + 1]
    assert first == ["build", "start_load_kv"] + ["wait_for_layer_load", "save_kv_layer"] * L + [
        "wait_for_save"
    ]
    # registration: V1 -> register_kv_caches; V2 single group folds back to it by default
    assert len(rc.REC["tensor"]) == 1
    reg = "register_kv_caches" if kv_manager == "v1" else "register_kv_cache_layout"
    assert eng.stats.calls[reg] == 1
    # metadata was pickled: every rank got an equal but distinct object each iteration
    outs = rc.REC["outputs"]
    assert [len(o.new_requests) for o in outs] == [1] + [0] * (T - 1)
    nr = outs[0].new_requests[0]
    assert nr.computed_position == 0 and nr.num_scheduled_tokens == 40 and len(nr.new_tokens) == 40
    for k, o in enumerate(outs[1:], start=1):
        cr = o.cached_requests[0]
        assert cr.num_scheduled_tokens == 1 and cr.computed_position == 40 + k - 1
        assert len(cr.new_tokens) == 1


def test_call_counts_overlap() -> None:
    T = 5
    eng, _ = run(EngineConfig(overlap=True), FLAT, [prompt(40)], T)
    assert count("build") == T and count("wait_for_save") == T
    assert len(rc.REC["gf"]) == T + 1
    second = rc.REC["outputs"][1].cached_requests[0]
    assert len(second.new_tokens) == 0 and second.num_scheduled_tokens == 1
    # tokens reach the connector one iteration late: the last two never do
    total = sum(
        len(r.new_tokens) for o in rc.REC["outputs"] for r in o.new_requests + o.cached_requests
    )
    assert total == 40 + T - 2


def test_async_load_parks_then_unparks() -> None:
    T = 4
    rc.reset(match=(32, True))
    eng = Engine(EngineConfig(overlap=False), FLAT)
    rid = eng.add_request(prompt(48), T)
    eng.step()  # queried, parked: absent from the output, handed in as started loading
    out0 = rc.REC["outputs"][0]
    assert out0.new_requests == [] and out0.cached_requests == []
    assert rc.REC["gf"][0] == (0, [], [rid])
    assert count("wait_for_save") == 0 and count("wait_for_layer_load") == 0
    while eng.has_work():
        eng.step()
    assert count("query") == 1  # not re-queried after resuming
    first = rc.REC["outputs"][1].new_requests[0]
    assert first.computed_position == 32 and first.num_scheduled_tokens == 16
    assert len(rc.REC["gf"]) == T + 1 and count("build") == T + 1
    assert count("wait_for_save") == T and count("wait_for_layer_load") == L * T
    assert eng.results[rid].connector_matched_tokens == 32


def test_async_load_stays_parked_until_reported() -> None:
    held = {"release": False}

    def finish(rank, saving, loading, worker):
        if not held["release"]:
            return [], []
        out = list(loading)
        loading.clear()
        return [], out

    rc.reset(match=(32, True), finish=finish)
    eng = Engine(EngineConfig(), FLAT)
    rid = eng.add_request(prompt(48), 2)
    for _ in range(3):
        eng.step()
    assert all(not o.new_requests for o in rc.REC["outputs"]) and count("wait_for_save") == 0
    assert [g[2] for g in rc.REC["gf"]] == [[rid], [], []]  # handed in exactly once
    held["release"] = True
    eng.step()  # reported now; scheduled next iteration
    eng.step()
    assert rc.REC["outputs"][-1].new_requests[0].request_id == rid


def test_sync_first_report_excludes_matched_tokens() -> None:
    rc.reset(match=(32, False))
    eng = Engine(EngineConfig(), FLAT)
    eng.generate([prompt(48)], 2)
    nr = rc.REC["outputs"][0].new_requests[0]
    assert nr.computed_position == 0 and nr.num_scheduled_tokens == 16 and len(nr.new_tokens) == 48


def test_chunked_prefill_v1_exact() -> None:
    eng, _ = run(
        EngineConfig(chunk_size=128, tokens_per_block=32, overlap=False), FLAT, [prompt(256)], 3
    )
    outs = rc.REC["outputs"]
    a = outs[0].new_requests[0]
    assert (
        a.computed_position,
        len(a.new_tokens),
        len(a.new_block_ids),
        a.num_scheduled_tokens,
    ) == (0, 256, 8, 128)
    b = outs[1].cached_requests[0]
    assert (
        b.computed_position,
        len(b.new_tokens),
        len(b.new_block_ids),
        b.num_scheduled_tokens,
    ) == (128, 0, 0, 128)
    c = outs[2].cached_requests[0]
    assert (c.computed_position, len(c.new_tokens), c.num_scheduled_tokens) == (256, 1, 1)
    assert rc.REC["allocs"] == [("flat", a.new_block_ids)] and len(a.new_block_ids) == 8


def test_chunked_prefill_v2_deltas() -> None:
    eng, _ = run(
        EngineConfig(kv_manager="v2", chunk_size=128, tokens_per_block=32),
        GROUPED,
        [prompt(256)],
        3,
    )
    outs = rc.REC["outputs"]
    kind, alloc = rc.REC["allocs"][0]
    assert kind == "grouped" and len(alloc) == 1 and len(alloc[0]) == 4  # first chunk only
    a = outs[0].new_requests[0]
    assert a.new_block_ids_by_layer_group == alloc and a.new_block_ids == alloc[0]
    b = outs[1].cached_requests[0]
    assert len(b.new_block_ids_by_layer_group[0]) == 4 and b.computed_position == 128
    assert b.block_hashes == [] and a.priorities is None
    assert len(set(alloc[0] + b.new_block_ids_by_layer_group[0])) == 8


def test_sliding_window_pages_are_minus_one_in_place() -> None:
    # VSWA: group 0 = window 32 (first appearance), group 1 = full.
    cfg = EngineConfig(kv_manager="v2", windows=(32, None), tokens_per_block=16, chunk_size=32)
    eng, _ = run(cfg, GROUPED, [prompt(100)], 4)
    kind, fin = rc.REC["finished"][0]
    assert kind == "grouped" and len(fin) == 2
    sliding, full = fin
    assert len(sliding) == len(full) == 7
    assert sliding[:4] == [-1] * 4 and all(s >= 0 for s in sliding[5:])
    assert all(s >= 0 for s in full)
    assert [o for o, _ in valid_page_slots(sliding)] == [b for b, s in enumerate(sliding) if s >= 0]
    # deltas were reported in place, and every group page reported was a real slot then
    reported = [
        r.new_block_ids_by_layer_group
        for o in rc.REC["outputs"]
        for r in o.new_requests + o.cached_requests
    ]
    assert sum(len(d[0]) for d in reported) == 7 and all(r[0] == [] or True for r in reported)
    assert all(r and len(r) == 2 for r in reported) and all(
        o.new_requests[0].new_block_ids == [] for o in rc.REC["outputs"] if o.new_requests
    )


def test_sliding_window_minus_one_in_alloc_after_connector_match() -> None:
    cfg = EngineConfig(kv_manager="v2", windows=(32, None), tokens_per_block=16)
    run(cfg, GROUPED, [prompt(100)], 2, match=(80, False))
    _, alloc = rc.REC["allocs"][0]
    # computing starts at 80: the window (32) needs positions >= 49, i.e. blocks >= 3
    assert alloc[0][:3] == [-1, -1, -1] and all(s >= 0 for s in alloc[0][3:])
    assert all(s >= 0 for s in alloc[1])


def test_single_sliding_window_v1_flat_lists() -> None:
    eng, _ = run(EngineConfig(windows=(32,), tokens_per_block=16), FLAT, [prompt(100)], 2)
    kind, fin = rc.REC["finished"][0]
    assert kind == "flat" and fin[0] == -1 and fin[-1] >= 0


def test_grouped_fold_back_single_group() -> None:
    # V2, one group, flat-only scheduler: the manager calls the grouped form, whose base
    # implementation folds back to the flat one.
    run(EngineConfig(kv_manager="v2"), FLAT, [prompt(40)], 2)
    assert rc.REC["allocs"][0][0] == "flat" and rc.REC["finished"][0][0] == "flat"
    run(EngineConfig(kv_manager="v2"), GROUPED, [prompt(40)], 2)
    assert rc.REC["allocs"][0][0] == "grouped" and rc.REC["finished"][0][0] == "grouped"


def test_bring_up_rejections() -> None:
    vswa = dict(windows=(32, None), tokens_per_block=16)
    rc.reset()
    with pytest.raises(NotImplementedError, match="layer groups"):
        Engine(
            EngineConfig(kv_manager="v2", **vswa),
            ConnectorSpec(MOD, "RecScheduler", "RecLayoutWorker"),
        )
    with pytest.raises(NotImplementedError, match="V1"):
        Engine(EngineConfig(kv_manager="v1", **vswa), GROUPED)
    with pytest.raises(NotImplementedError, match="register_kv_cache_layout"):
        Engine(
            EngineConfig(kv_manager="v2", **vswa),
            ConnectorSpec(MOD, "RecGroupedScheduler", "RecWorker"),
        )
    with pytest.raises(RuntimeError, match="load_kv_async"):
        run(EngineConfig(), FLAT, [prompt(40)], 2, match=(0, True))
    with pytest.raises(RuntimeError, match="at least one uncomputed token"):
        run(EngineConfig(), FLAT, [prompt(40)], 2, match=(40, False))


def test_tp2_get_finished_intersection() -> None:
    state = {"rank1_ready": False}

    def finish(rank, saving, loading, worker):
        if rank == 1 and not state["rank1_ready"]:
            return [], []
        out = list(saving)
        saving.clear()
        return out, []

    rc.reset(keep=True, finish=finish)
    cfg = EngineConfig(tp=2, num_blocks=16, overlap=False)
    eng = Engine(cfg, FLAT)
    free0 = eng.kv.groups[0].available()
    rid = eng.add_request(prompt(40), 2)
    eng.step()
    eng.step()  # finishes; request_finished -> True; rank 0 reports, rank 1 does not
    assert rc.REC["finished"] and eng.results[rid].finished
    for _ in range(3):
        eng.step()
        assert eng.has_work() and eng.kv.groups[0].available() < free0
    assert [g for g in rc.REC["gf"] if g[1]] == [
        (0, [rid], []),
        (1, [rid], []),
    ]  # handed once per rank
    state["rank1_ready"] = True
    eng.step()
    assert not eng.has_work() and eng.kv.groups[0].available() == free0
    # each rank registered its own kv-head shard; same metadata every rank, distinct objects
    shapes = [t.shape for _, t in rc.REC["tensor"]]
    assert shapes == [(16, 4, 2, 32 * 1 * 32)] * 2
    m = rc.REC["metas"]
    assert m[0][1] == m[1][1] and m[0][1] is not m[1][1]
    assert count("query", None) == 1 and count("start_load_kv", None) == 2 * 2


def test_start_load_kv_failure_is_fatal() -> None:
    rc.reset(fail="start_load_kv")
    eng = Engine(EngineConfig(), FLAT)
    eng.add_request(prompt(40), 2)
    with pytest.raises(RuntimeError, match="boom in start_load_kv"):
        eng.step()
    with pytest.raises(RuntimeError, match="dead"):
        eng.step()


@pytest.mark.parametrize("hook", ["wait_for_layer_load", "save_kv_layer", "wait_for_save"])
def test_hook_failure_fails_batch_only(hook: str) -> None:
    rc.reset(fail_once=hook)
    eng = Engine(EngineConfig(), FLAT)
    a = eng.add_request(prompt(40), 3)
    b = eng.add_request(prompt(40, seed=2), 3)
    eng.step()
    assert eng.results[a].error and f"boom in {hook}" in eng.results[a].error
    assert eng.results[b].error == eng.results[a].error  # same batch
    c = eng.add_request(prompt(40, seed=3), 3)
    while eng.has_work():
        eng.step()
    assert eng.results[c].error is None and len(eng.results[c].tokens) == 3
    assert count("finished") == 3  # failed requests still end through request_finished
    with pytest.raises(RuntimeError, match=f"boom in {hook}"):
        rc.reset(fail_once=hook)
        Engine(EngineConfig(), FLAT).generate([prompt(8)], 1)


@pytest.mark.parametrize("hook", ["wait_for_layer_load", "save_kv_layer", "wait_for_save"])
def test_tp_hook_failure_on_one_rank_only_is_a_divergence(hook: str) -> None:
    """TP ranks are separate processes in TensorRT-LLM: a hook that raises on rank 1 alone
    fails only rank 1's batch, while rank 0 runs the layer and waits forever in its
    all-reduce. The engine must say so (fatal), not fail the request for every rank."""
    rc.reset(fail=hook, fail_ranks={1})
    eng = Engine(EngineConfig(tp=2), FLAT)
    a = eng.add_request(prompt(40), 3)
    b = eng.add_request(prompt(40, seed=2), 3)
    with pytest.raises(RankDivergenceError) as exc:
        eng.step()
    err = exc.value
    assert sorted(err.raised) == [1] and err.clean == [0]
    assert err.request_ids == [a, b]
    assert hook in err.hook and f"boom in {hook}" in str(err)
    assert f"[{a}, {b}]" in str(err) and "rank(s) [1] raised" in str(err)
    # every rank's hook ran (each rank is its own process): rank 0's too
    assert count(hook, 0) >= 1 and count(hook, 1) >= 1
    with pytest.raises(RuntimeError, match="dead"):
        eng.step()


def test_tp_hook_failure_on_every_rank_fails_the_batch_only() -> None:
    """All ranks raising in the same hook is consistent: every rank fails the batch."""
    rc.reset(fail="wait_for_layer_load", fail_ranks={0, 1})
    eng = Engine(EngineConfig(tp=2), FLAT)
    a = eng.add_request(prompt(40), 3)
    eng.step()
    assert eng.results[a].error and "boom in wait_for_layer_load" in eng.results[a].error
    rc.CONTROL.pop("fail")
    b = eng.add_request(prompt(40, seed=3), 3)
    while eng.has_work():
        eng.step()
    assert eng.results[b].error is None and len(eng.results[b].tokens) == 3


def test_tp_fatal_error_on_one_rank_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose hook error is fatal by TensorRT-LLM's classification stops (and the
    MPI job with it): that error is raised, not a divergence."""
    orig = rc._maybe_fail

    def fatal(name: str, rank: int = 0) -> None:
        try:
            orig(name, rank)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: unrecoverable") from e

    monkeypatch.setattr(rc, "_maybe_fail", fatal)
    rc.reset(fail="wait_for_layer_load", fail_ranks={1})
    eng = Engine(EngineConfig(tp=2), FLAT)
    eng.add_request(prompt(40), 3)
    with pytest.raises(RuntimeError, match="boom in wait_for_layer_load: unrecoverable") as exc:
        eng.step()
    assert not isinstance(exc.value, RankDivergenceError)


@pytest.mark.parametrize("bogus", ["unknown", "repeat"])
def test_get_finished_unknown_or_repeated_id_raises(bogus: str) -> None:
    def finish(rank, saving, loading, worker):
        if bogus == "unknown":
            return [12345], []
        out = list(saving)  # returned every time: the second time is a repeat
        return out, []

    rc.reset(keep=True, finish=finish)
    eng = Engine(EngineConfig(), FLAT)
    eng.add_request(prompt(40), 1)
    with pytest.raises(KeyError):
        for _ in range(4):
            eng.step()


def test_monolithic_determinism_and_chunking() -> None:
    p = [prompt(150), prompt(77, seed=5)]
    base = Engine(EngineConfig()).generate(p, 12)
    assert Engine(EngineConfig()).generate(p, 12) == base
    assert Engine(EngineConfig(chunk_size=40)).generate(p, 12) == base
    assert Engine(EngineConfig(tp=2)).generate(p, 12) == base
    assert (
        Engine(EngineConfig(kv_manager="v2", chunk_size=33, overlap=True)).generate(p, 12) == base
    )
    e = Engine(EngineConfig())
    e.generate(p, 12)
    assert e.generate(p, 12) == base and e.stats.device_matched_tokens > 0  # device reuse
    v = [
        Engine(
            EngineConfig(kv_manager="v2", windows=(48, None), tokens_per_block=16, chunk_size=c)
        ).generate(p, 12)
        for c in (None, 20)
    ]
    assert v[0] == v[1] and v[0] != base


def test_pool_layout_v2_matches_interfaces() -> None:
    rc.reset()
    eng = Engine(
        EngineConfig(kv_manager="v2", windows=(32, None, None), num_layers=4, tokens_per_block=16),
        GROUPED,
    )
    ((_, lay),) = rc.REC["layout"]
    assert [g.window_size for g in lay.groups] == [32, None]
    assert [g.layer_ids for g in lay.groups] == [(0, 3), (1, 2)]
    g0 = lay.groups[0]
    (region,) = g0.regions
    assert [(b.layer_id, b.role) for b in region.buffers] == [
        (0, "key"),
        (0, "value"),
        (3, "key"),
        (3, "value"),
    ]
    pool = eng.kv_pools[0][0]
    assert tuple(pool.shape) == (512, 2, 2, 16 * 2 * 32)
    assert (
        region.base == pool.data_ptr()
        and region.size == pool[0].numel() * 4
        and region.device == "cpu"
    )
    pool[5].fill_(1.5)
    assert bytes(region.slot_tensor(5).numpy()) == eng.page_bytes(0, 5)
