"""Prefix reservations (TensorRT-LLM main, opt-in) under tensor parallelism: a TP=2
producer and a TP=2 consumer (reference engines simulating both ranks in one process, as
test_tp.py), each rank moving its own KV-head shard.

Judged as everything else: tokens equal a monolithic run, loaded pages equal the
producer's byte for byte (a simulated page is every rank's shard in rank order, so a rank
loading the wrong shard, or none, differs), and on every producer rank exactly which
blocks stay leased. A load that fails on one rank fails its request on both, by name,
in bounded time, with no token computed on its pages (one rank raising alone in a forward
hook would be ``RankDivergenceError``: a hang in a real multi-process engine).
The same across real rank processes: test_tp_mpi.py (prefix cases).
"""

from __future__ import annotations

import time

import pytest
from harness import (
    SHAPE,
    check_against_monolithic,
    close_all_services,
    fail_on_rank1,
    make_consumer,
    make_producer,
    prompts,
    rank_endpoints,
    rank_services,
    run,
    wait_for,
)

from disagg.engine.reference import Engine, EngineConfig

TP2_PREFIX = dict(SHAPE, tp=2, kv_manager="v2", prefix_aware_scheduling=True)
TPB = SHAPE["tokens_per_block"]


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


def _drain(eng, limit_s: float = 20.0) -> float:
    """Step until idle; fail (rather than hang) if the engine is still busy after
    ``limit_s`` (a reservation no rank reports is never retired). Returns seconds taken."""
    t0 = time.monotonic()
    while eng.has_work():
        assert time.monotonic() - t0 < limit_s, "the engine never went idle (a load unretired)"
        eng.step()
    return time.monotonic() - t0


def _run(eng, ps, max_tokens: int) -> list:
    """``harness.run`` with ``_drain``'s bound."""
    ids = [eng.add_request(p, max_tokens) for p in ps]
    _drain(eng)
    return [eng.results[i] for i in ids]


def _all_returned(psvc) -> None:
    for svc in rank_services(psvc):
        assert wait_for(lambda s=svc: s.leases.active() == 0), f"rank {svc.tp_rank} leases"
        assert wait_for(lambda s=svc: s.store.pinned_blocks() == 0), f"rank {svc.tp_rank} pins"


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_tp2_reservations_tokens_and_each_ranks_pages_match(load_mode):
    cfg = EngineConfig(**TP2_PREFIX, capture_pages=True)
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=6)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)], load_mode=load_mode)
    assert cons.prefix_reservations
    consumed = _run(cons, ps, max_tokens=6)

    check_against_monolithic(produced, consumed, mono)  # every rank's shard, byte for byte
    page = next(iter(consumed[0].loaded_pages.values()))
    half = len(page) // 2
    assert page[:half] != page[half:]  # the shards differ: a rank loading the other's fails
    calls = cons.stats.calls
    assert calls["reserve_prefix"] == 3 and calls["get_num_new_matched_tokens"] == 0
    assert calls["release_prefix_reservation"] == 3  # the accepted ranges, once retired
    c0, c1 = rank_services(csvc)
    assert c0.metrics["prefix_reserved"] == 3 and "prefix_declined_tp" not in c0.metrics
    for c in (c0, c1):  # every consumer rank loaded its own shard, and reported it
        assert c.metrics["pages_loaded"] == 3 * 12 and not c.prefix_loads
    p0, p1 = rank_services(psvc)
    for svc in (p0, p1):  # every producer rank pushed its own (counted once drained)
        assert wait_for(lambda s=svc: s.metrics["pushes_done"] == 3)
        assert (svc.metrics["pushes_layerwise"] > 0) == (load_mode == "sync")
    assert p0.metrics["pages_pushed"] == p1.metrics["pages_pushed"] > 0
    assert not c0.reservations
    _all_returned(psvc)


def test_tp2_clipped_range_is_released_on_every_ranks_lease():
    """The runtime accepts 2 of the 12 blocks: the 10 others are released on both
    producer ranks' leases before any push; each rank moves exactly the 2."""
    cfg = EngineConfig(**TP2_PREFIX, prefix_load_cap_tokens=2 * TPB + 5, capture_pages=True)
    ps = prompts(n=1)
    mono = Engine(cfg).generate(ps, max_tokens=5)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)])
    rid = cons.add_request(ps[0], 5)
    cons.step()  # admission: reserve 12 blocks on both ranks, accept 2, release the tail
    for svc in rank_services(psvc):
        stats = svc.leases.stats.extra
        assert wait_for(lambda s=stats: s.get("blocks_released_in_part") == 10), svc.tp_rank
        (lease,) = svc.leases._leases.values()  # still leased: the accepted part
        assert lease.released is not None
        assert lease.released.tolist() == [False] * 2 + [True] * 10, svc.tp_rank
    _drain(cons)
    res = cons.results[rid]
    assert res.connector_matched_tokens == 2 * TPB
    check_against_monolithic(produced, [res], mono)
    for c in rank_services(csvc):
        assert c.metrics["pages_loaded"] == 2
    assert cons.stats.calls["release_prefix_reservation"] == 2  # tail first, then the rest
    _all_returned(psvc)


@pytest.mark.parametrize(
    ("load_mode", "how"), [("async", "transfer"), ("sync", "transfer"), ("async", "push")]
)
def test_tp2_one_rank_failure_fails_the_request_on_both_ranks(load_mode, how):
    """Consumer rank 1's load of the second request fails (its transfer aborted, as when
    producer rank 1 dies mid-push; or producer rank 1 refuses the push); rank 0's lands.
    Both ranks fail the request at the same point (no divergence), by name, from rank 1's
    report (not a timeout), with no token; the requests around it match."""
    cfg = EngineConfig(**TP2_PREFIX, capture_pages=True)
    ps = prompts(n=3)
    mono = Engine(cfg).generate(ps, max_tokens=5)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)], load_mode=load_mode)
    c0, c1 = rank_services(csvc)

    a = _run(cons, [ps[0]], max_tokens=5)[0]  # one at a time: a failure fails its batch
    rid = cons.add_request(ps[1], 5)
    hit = fail_on_rank1(c1, rid, how)
    took = _drain(cons)  # a divergence would raise RankDivergenceError here
    b = cons.results[rid]
    c = _run(cons, [ps[2]], max_tokens=5)[0]

    assert hit, "the failure was not injected"
    assert b.error is not None and f"request {rid}" in b.error, b.error
    assert "TP rank 1" in b.error and "injected" in b.error  # rank 0 names the failed rank
    assert b.tokens == []
    assert took < 5.0  # decided from rank 1's report, not a timeout
    check_against_monolithic([produced[0], produced[2]], [a, c], [mono[0], mono[2]])
    assert c1.metrics["loads_failed"] == 1
    assert c0.metrics["loads_failed_on_other_rank"] == 1
    assert c0.metrics["rank_outcome_timeouts"] == c1.metrics["rank_outcome_timeouts"] == 0
    assert cons.stats.calls["release_prefix_reservation"] == 3  # each retired once
    assert not c0.prefix_loads and not c1.prefix_loads and not c0.reservations
    _all_returned(psvc)


def test_tp2_producer_rank_plane_closed_fails_the_request_on_both_ranks():
    """Producer rank 1 offered its blocks, then can never push (its data plane closed):
    consumer rank 1's load times out, both ranks fail the request (sync: at the same
    layer), bounded by load_timeout_s, no token; then the producer is gone and the same
    prompt computes the monolithic tokens."""
    cfg = EngineConfig(**TP2_PREFIX)
    ps = prompts(n=1)
    mono = Engine(cfg).generate(ps, 4)[0]
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    rank_services(psvc)[1].data.close()
    cons, csvc = make_consumer(
        cfg, [rank_endpoints(psvc)], load_timeout_s=1.0, claim_timeout_s=0.5, load_mode="sync"
    )
    c0, c1 = rank_services(csvc)
    rid = cons.add_request(ps[0], 4)
    took = _drain(cons)
    res = cons.results[rid]
    assert res.error is not None and f"request {rid}" in res.error, res.error
    assert "TP rank 1" in res.error
    assert res.tokens == [] and res.connector_matched_tokens > 0  # it was offered
    assert took < 1.0 + 4.0
    assert c1.metrics["loads_failed"] == 1 and c0.metrics["loads_failed_on_other_rank"] == 1
    assert cons.stats.calls["release_prefix_reservation"] == 1
    for svc in rank_services(psvc):
        svc.close()
    (again,) = _run(cons, ps, 4)
    assert again.error is None and again.tokens == mono


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_tp2_a_load_the_leader_refuses_fails_on_every_rank(load_mode):
    """Rank 0's scheduler refuses an authorised load (e.g. a reservation it never made):
    no rank pushes it, every rank records the refusal from the metadata and raises at the
    request's first forward (no divergence), and every rank's lease goes back."""
    cfg = EngineConfig(**TP2_PREFIX)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)], load_mode=load_mode)
    sched = cons.driver.scheduler
    sched._plan_prefix_load = lambda pl: f"injected: reservation {pl.reservation_id} refused"
    rid = cons.add_request(ps[0], 4)
    _drain(cons)
    res = cons.results[rid]
    assert res.error is not None and "injected: reservation 1 refused" in res.error, res.error
    assert f"request {rid}" in res.error and res.tokens == []
    c0, c1 = rank_services(csvc)
    assert c0.metrics["loads_started"] == c1.metrics["loads_started"] == 0
    assert cons.stats.calls["release_prefix_reservation"] == 1
    _all_returned(psvc)


def test_tp2_cancel_while_loading_keeps_pages_until_both_ranks_reported():
    """A client cancels while the async load is in flight: the request ends "cancelled"
    at once, but its pages and ``request_finished`` wait until both ranks reported the
    load; then every rank's lease goes back and nothing is left loading."""
    cfg = EngineConfig(**TP2_PREFIX)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)], load_mode="async")
    w1 = cons.driver.workers[1]
    report, held = w1.get_finished_prefix_loads, [True]
    w1.get_finished_prefix_loads = lambda: [] if held[0] else report()  # rank 1 is late
    free0 = cons.kv.groups[0].available()
    rid = cons.add_request(ps[0], 4)
    cons.step()  # reserved on both ranks, dispatched on both
    cons.cancel(rid)
    for _ in range(5):
        cons.step()
    assert cons.results[rid].error == "cancelled"  # answered at once
    assert cons.kv.groups[0].available() < free0  # the pages wait for rank 1's report
    assert cons.stats.calls["request_finished_by_layer_group"] == 0
    assert cons.stats.calls["release_prefix_reservation"] == 0
    held[0] = False
    _drain(cons)
    res = cons.results[rid]
    assert res.error == "cancelled" and res.tokens == []
    assert cons.stats.calls["release_prefix_reservation"] == 1
    assert cons.stats.calls["request_finished_by_layer_group"] == 1
    assert cons.kv.groups[0].available() == free0
    c0, c1 = rank_services(csvc)
    assert not c0.prefix_loads and not c1.prefix_loads and not c0.reservations
    _all_returned(psvc)
