"""Producer and consumer connectors driven the way TensorRT-LLM drives them.

With a TensorRT-LLM connector package loaded (``DISAGG_TRTLLM_SRC``), the reference engine
calls the connectors through that line's own ``KvCacheConnectorManager``
(``connector_manager="trtllm"``), in ``py_executor.py``'s order, with the line's own
``RequestData``/``SchedulerOutput``/layout classes; without one, through our bookkeeping and
fallback classes, as each line's executor behaves (``runtime``). Every case checks tokens
against a monolithic run, loaded pages byte for byte against the producer's, and that no
lease is left behind.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from harness import (
    SHAPE,
    check_against_monolithic,
    close_all_services,
    make_consumer,
    make_producer,
    prompts,
    rank_endpoints,
    run,
    wait_for,
)

from disagg.config import ConfigError
from disagg.consumer.connector import KvLoadFailedError
from disagg.engine import FEATURES, USING_TRTLLM
from disagg.engine.reference import Engine, EngineConfig
from disagg.engine.reference.config import RUNTIMES
from disagg.transport import tcp

MANAGER = "trtllm" if USING_TRTLLM else "reference"
# the fallback copies stand for every line, each as its executor behaves
LINES = [None] if USING_TRTLLM else ["main", "cancel", "groups", "flat"]


@pytest.fixture(autouse=True)
def _cleanup():
    yield
    close_all_services()


@pytest.fixture(params=LINES, ids=lambda x: x or "loaded")
def line(request: pytest.FixtureRequest) -> str | None:
    return request.param


def features(line: str | None) -> Any:
    if line is None:
        return FEATURES
    from disagg.engine.runtime import RuntimeFeatures

    return RuntimeFeatures(line=line, **RUNTIMES[line])


def cfg_for(line: str | None, **kw: Any) -> EngineConfig:
    if kw.get("kv_manager") == "v2" and features(line).grouped is None:
        pytest.skip(f"the {features(line).line} line has no KV cache manager V2 path")
    return EngineConfig(
        **{**SHAPE, **kw}, capture_pages=True, connector_manager=MANAGER, runtime=line
    )


def no_lease_left(psvc: Any) -> None:
    assert wait_for(lambda: psvc.leases.active() == 0, 10), "a lease outlived its request"
    assert psvc.store.pinned_blocks() == 0


SHAPES = {
    "v1": dict(kv_manager="v1"),
    "v1-chunked": dict(kv_manager="v1", chunk_size=48),
    "v2": dict(kv_manager="v2"),
    "v2-vswa": dict(kv_manager="v2", windows=(32, None)),
    "v2-vswa-chunked": dict(kv_manager="v2", windows=(32, None), chunk_size=64),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tokens_and_pages_match_monolithic(line, shape):
    """Default load mode (``auto``): async on every line over the tcp plane (its abort
    proves no byte lands afterwards)."""
    cfg = cfg_for(line, **SHAPES[shape])
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=5)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], load_mode="auto")
    # the line's own manager drives the connector when a line is loaded
    assert type(cons.driver).__name__ == ("TrtllmDriver" if USING_TRTLLM else "Driver")
    consumed = run(cons, ps, max_tokens=5)
    check_against_monolithic(produced, consumed, mono)
    assert wait_for(lambda: psvc.metrics["pushes_done"] >= len(ps))
    assert psvc.metrics["pushes_layerwise"] == 0
    no_lease_left(psvc)


def test_sync_loads_match_monolithic(line):
    cfg = cfg_for(line, kv_manager="v1", chunk_size=64)
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, _ = make_consumer(cfg, [psvc.endpoint], load_mode="sync")
    check_against_monolithic(produced, run(cons, ps, max_tokens=4), mono)
    no_lease_left(psvc)


def test_async_loads_refused_where_an_abort_can_leave_writes(line):
    """Async loads are fenced by aborting them, so a plane whose abort may leave writes
    landing (UCX over shared memory) loads layer by layer under ``auto`` and refuses
    ``async`` naming the fix; the config is checked before any plane is built."""
    from disagg.config import DisaggConfig
    from disagg.consumer.metadata import loads_async

    base = {"role": "consumer", "consumer": {"producers": ["tcp://127.0.0.1:5557"]}}
    shm = {**base, "transport": "ucx", "ucx_channel": "shm"}
    assert loads_async(DisaggConfig.from_dict(base)) is True
    assert loads_async(DisaggConfig.from_dict(shm)) is False
    forced = {**shm, "consumer": {**base["consumer"], "load_mode": "async"}}
    with pytest.raises(
        ConfigError, match="load_mode: async loads need a data plane.*ucx_channel: tcp"
    ):
        loads_async(DisaggConfig.from_dict(forced))


def test_salted_requests_through_the_bound_request(line):
    """V1 queries carry the C++-bound request (``cache_salt_id`` only); the producer saw
    the Python one (``cache_salt``): both must key the same blocks, and other salts none."""
    cfg = cfg_for(line, kv_manager="v1")
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1, salt="tenant-a")
    cons, _ = make_consumer(cfg, [psvc.endpoint])
    (other,) = run(cons, ps, 4, salt="tenant-b")
    assert other.connector_matched_tokens == 0, "tenant b was offered tenant a's blocks"
    (plain,) = run(cons, [ps[0][:-1] + [5]], 4)
    assert plain.connector_matched_tokens == 0
    (same,) = run(cons, [ps[0][:-1] + [7]], 4, salt="tenant-a")
    assert same.connector_matched_tokens > 0
    assert same.tokens == Engine(cfg).generate([ps[0][:-1] + [7]], 4, cache_salt="tenant-a")[0]
    no_lease_left(psvc)


@pytest.mark.parametrize("cap", [16, 0])
def test_short_honour_loads_only_what_is_honoured(line, cap):
    """V2 may consume less than offered (``commit_new_matched_tokens``; one line also calls
    ``cancel_load`` for the rest): only honoured pages are pushed, the rest of the lease
    goes back, the tail is computed here."""
    cfg = cfg_for(line, kv_manager="v2", chunk_size=32, honour_cap_tokens=cap)
    ps = prompts(n=2)
    mono = Engine(cfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, _ = make_consumer(cfg, [psvc.endpoint], load_mode="auto")
    consumed = run(cons, ps, max_tokens=4)
    assert [r.tokens for r in consumed] == mono
    assert [r.connector_matched_tokens for r in consumed] == [cap] * len(ps)
    for p, c in zip(produced, consumed, strict=True):
        assert sorted(c.loaded_pages) == [(0, b) for b in range(cap // 16)]
        for where, data in c.loaded_pages.items():
            assert data == p.computed_pages[where]
    # bytes, not pages: a layer-wise push counts a page once per layer
    pushed = sum(r.connector_matched_tokens // 16 for r in consumed) * psvc.pool.block_bytes
    assert wait_for(lambda: psvc.metrics["bytes_pushed"] == pushed)
    time.sleep(0.2)
    assert psvc.metrics["bytes_pushed"] == pushed, "pages past the honoured part were pushed"
    no_lease_left(psvc)


def test_cancelled_request_pages_are_never_written_after_reuse(line, monkeypatch):
    """A request parked on an async load is cancelled and the executor frees its pages at
    once, asking no ``has_pending_transfers`` and calling no connector hook, as every
    stored ``py_executor.py`` does; the next request takes those pages and runs while the
    push is stalled mid-way. The consumer fences the load before that request's forward:
    no byte of it lands afterwards, its lease goes back, and the next request's tokens and
    pages are its own."""
    from chaos_role import slow_pushes

    monkeypatch.setattr(tcp.plan, "MSG_BYTES", tcp.plan.MSG_BYTES)  # slow_pushes sets it
    cfg = cfg_for(line, kv_manager="v1", num_blocks=24)
    assert not cfg.cancel_waits_for_transfers
    ps = prompts(n=1, length=300)
    fresh = prompts(n=1, length=300, seed=99)  # no producer holds it
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    started, go = threading.Event(), threading.Event()
    slow_pushes(psvc, 0.0, on_start=lambda tid: (started.set(), go.wait(30)))
    cons, csvc = make_consumer(cfg, [psvc.endpoint], load_mode="auto", load_timeout_s=10.0)
    rid = cons.add_request(ps[0], 4)
    cons.step()  # claimed, allocated, parked, push asked for
    load = csvc.loads[rid]
    b_slots = {s for g in cons.request_pages(rid) for s in g if s >= 0}
    assert started.wait(10), "the push never started"
    cons.cancel(rid)
    # the next request arrives at once and gets the freed pages (the pool is too small
    # otherwise); it runs to the end while the push is still stalled
    c_id = cons.add_request(fresh[0], 4)
    cons.step()
    c_slots = cons.request_pages(c_id)
    assert b_slots & {s for g in c_slots for s in g}, "the next request reused no freed page"
    assert cons.results[rid].error == "cancelled"
    assert csvc.metrics["loads_fenced"] == 1
    assert load.state.name == "ABANDONED" and "handed to request" in (load.error or "")
    while cons.has_work():
        cons.step()
    go.set()  # the producer sends the rest of the push now: the receiver must drop it
    assert wait_for(lambda: psvc.metrics["pushes_failed"] + psvc.metrics["pushes_done"] >= 1, 15)
    time.sleep(0.3)  # a stray frame would have landed by now
    res = cons.results[c_id]
    assert res.error is None and res.tokens == Engine(cfg).generate(fresh, 4)[0]
    checked = 0
    for (g, b), data in res.computed_pages.items():
        assert cons.page_bytes(g, c_slots[g][b]) == data, f"page {(g, b)} was overwritten"
        checked += 1
    assert checked >= len(b_slots) // 2
    no_lease_left(psvc)
    assert csvc.health() == (True, "")


def test_failed_load_fails_as_few_requests_as_the_line_allows(line):
    """The producer's data plane dies after it granted the claim. Lines that take
    failed-load reports restart just that request (it then recomputes: right tokens); on
    the V2 lines without them the forward's error fails it by name; on V1 with block reuse
    the engine would publish the unfilled pages, so the instance stops. Never a wrong
    token."""
    v2 = features(line).grouped is not None
    cfg = cfg_for(line, kv_manager="v2" if v2 else "v1")
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    psvc.data.close()
    cons, csvc = make_consumer(cfg, [psvc.endpoint], load_timeout_s=1.0, load_mode="sync")
    if not v2:
        with pytest.raises(KvLoadFailedError, match="unrecoverable"):
            run(cons, ps, 4)
        return
    (res,) = run(cons, ps, 4)
    if features(line).failed_load_reports:
        assert res.error is None and res.tokens == Engine(cfg).generate(ps, 4)[0]
        assert cons.stats.load_restarts == 1
    else:
        assert res.error is not None and "KV cache load failed" in res.error
        assert res.tokens == []
    assert csvc.metrics["loads_failed"] == 1


def test_tp2_ranks_from_the_runtime(line):
    """One llm_args for both ranks (as TensorRT-LLM has): each rank's connector takes its
    rank from the runtime, binds its own port and moves its own shard."""
    cfg = cfg_for(line, kv_manager="v1", tp=2)
    ps = prompts(n=2)
    mono = Engine(cfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    eps = rank_endpoints(psvc)
    assert len(set(eps)) == 2
    cons, _ = make_consumer(cfg, [eps], load_mode="sync")
    check_against_monolithic(produced, run(cons, ps, max_tokens=4), mono)
    no_lease_left(psvc)


def test_unequal_tp_moves_each_rank_its_heads(line):
    """Producer and consumer TP sizes that differ through the line's connector manager
    (merge with sync loads, or split with async ones, alternating over the lines to keep
    CI short): tokens equal a monolithic run, every loaded page the produced one head for
    head."""
    from disagg.engine.reference.kv_cache import page_by_head

    p, d, load_mode = (2, 1, "sync") if LINES.index(line) % 2 == 0 else (1, 2, "async")
    pcfg, ccfg = cfg_for(line, kv_manager="v1", tp=p), cfg_for(line, kv_manager="v1", tp=d)
    ps = prompts(n=2)
    mono = Engine(ccfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(pcfg)
    produced = run(prod, ps, max_tokens=1)
    cons, _ = make_consumer(ccfg, [rank_endpoints(psvc)], load_mode=load_mode)
    consumed = run(cons, ps, max_tokens=4)
    assert [r.tokens for r in consumed] == mono
    for pr, cr in zip(produced, consumed, strict=True):
        assert cr.connector_matched_tokens > 0 and cr.loaded_pages
        for (g, b), data in cr.loaded_pages.items():
            want = page_by_head(pcfg, g, pr.computed_pages[(g, b)])
            assert page_by_head(ccfg, g, data) == want, f"page {(g, b)} differs by head"
    no_lease_left(psvc)


def test_a_hub_named_model_pairs_unequal_tp_through_num_kv_heads(line):
    """A model TensorRT-LLM loads by hub name: its ``llm_args`` carry the name and no model
    config, so the connector cannot derive the KV head count. With ``num_kv_heads`` in both
    roles' disagg config, producer TP 2 moves each consumer rank its heads (TP 1: merged
    from both producer ranks); without it, a consumer listing a TP=2 producer refuses to
    start, naming the key and the fix."""
    from disagg.engine.reference.kv_cache import page_by_head

    kw = dict(kv_manager="v1", hub_model="Qwen/Qwen2.5-0.5B-Instruct")
    pcfg, ccfg = cfg_for(line, tp=2, **kw), cfg_for(line, tp=1, **kw)
    heads = {"num_kv_heads": SHAPE["num_kv_heads"]}
    ps = prompts(n=1)
    prod, psvc = make_producer(pcfg, top=heads)
    assert psvc.num_kv_heads == SHAPE["num_kv_heads"] and psvc.fingerprint.num_kv_heads
    produced = run(prod, ps, max_tokens=1)
    with pytest.raises(ValueError, match=r"^num_kv_heads: consumer.producers\[0\] lists 2 "):
        make_consumer(ccfg, [rank_endpoints(psvc)])
    cons, _ = make_consumer(ccfg, [rank_endpoints(psvc)], top=heads, load_mode="sync")
    consumed = run(cons, ps, max_tokens=4)
    assert [r.tokens for r in consumed] == Engine(ccfg).generate(ps, max_tokens=4)
    for pr, cr in zip(produced, consumed, strict=True):
        assert cr.connector_matched_tokens > 0 and cr.loaded_pages
        for (g, b), data in cr.loaded_pages.items():
            want = page_by_head(pcfg, g, pr.computed_pages[(g, b)])
            assert page_by_head(ccfg, g, data) == want, f"page {(g, b)} differs by head"
    no_lease_left(psvc)


def test_replicated_regions_are_moved(line):
    """A layout whose groups list replicated regions apart (one line): those bytes are part
    of every page moved, or the model runs on missing KV."""
    from disagg.engine import KvCacheLayerGroupLayout

    if "replicated_regions" not in getattr(KvCacheLayerGroupLayout, "__dataclass_fields__", {}):
        pytest.skip("this line's layout has no replicated regions")
    cfg = cfg_for(line, kv_manager="v2", replicated_regions=True)
    ps = prompts(n=2)
    mono = Engine(cfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, _ = make_consumer(cfg, [psvc.endpoint])
    check_against_monolithic(produced, run(cons, ps, max_tokens=4), mono)
    no_lease_left(psvc)


def test_prefix_reservations_where_the_line_has_them(line):
    """The line with prefix reservations (``reserve_prefix`` on its scheduler ABC, or our
    fallback copies): admission reserves, the accepted range loads through
    ``SchedulerOutput.prefix_loads`` (the engine's own reservation bookkeeping: the
    line's manager is not driven for it), and every reservation is given back."""
    from disagg.engine import KvCacheConnectorScheduler

    if not hasattr(KvCacheConnectorScheduler, "reserve_prefix"):
        pytest.skip("this line has no prefix reservations")
    cfg = cfg_for(line, kv_manager="v2", prefix_aware_scheduling=True)
    cfg = EngineConfig(**{**cfg.__dict__, "connector_manager": "reference"})
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, _ = make_consumer(cfg, [psvc.endpoint])
    assert cons.prefix_reservations
    check_against_monolithic(produced, run(cons, ps, max_tokens=4), mono)
    assert cons.stats.calls["reserve_prefix"] == len(ps)
    no_lease_left(psvc)


def test_reset_and_replay(line):
    """V2 preemption: a running request's allocation is dropped and it runs again from
    scratch (``reset_request_state``; one line also calls ``request_reset``). It is asked
    again, loads again, leaks no lease, and its tokens are the monolithic run's."""
    cfg = cfg_for(line, kv_manager="v2", chunk_size=64)
    ps = prompts(n=1, length=300)
    mono = Engine(cfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(cfg)
    run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], load_mode="auto")
    rid = cons.add_request(ps[0], 4)
    for _ in range(500):
        if cons.requests[rid].forwarded or cons.results[rid].finished:
            break
        cons.step()
        time.sleep(0.002)
    assert cons.requests[rid].forwarded, cons.results[rid]
    cons.replay(rid)
    for _ in range(2000):
        if not cons.has_work():
            break
        cons.step()
        time.sleep(0.002)
    assert not cons.has_work(), f"the replayed request is stuck: {cons.requests[rid]}"
    res = cons.results[rid]
    assert cons.stats.replays == 1
    assert res.error is None and res.tokens == mono[0]
    assert cons.stats.calls["get_num_new_matched_tokens"] == 2  # asked again
    assert res.connector_matched_tokens > 0
    no_lease_left(psvc)
