"""TP=2: a load that fails on one consumer rank only must fail its request the same way on
every rank (no rank left running the layer into an all-reduce the failed rank never joins:
the reference engine raises ``RankDivergenceError`` for that), while the other requests of
the run keep matching a monolithic run and every producer rank gets its leases back.

Also the ranks' outcome bus on its own (``disagg.consumer.rank_bus``): the decision rule,
a rank that joins late, and a message without the secret.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from harness import (
    SHAPE,
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

from disagg.consumer.rank_bus import RankBus, RankState, decide
from disagg.engine.reference import Engine, EngineConfig, RankDivergenceError

TP2 = dict(SHAPE, tp=2)


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


@pytest.mark.parametrize("how", ["transfer", "push"])
@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_one_rank_failure_fails_the_request_on_every_rank_others_match(load_mode, how):
    cfg = EngineConfig(**TP2, kv_manager="v2", capture_pages=True)  # auto -> fail_request
    ps = prompts(n=3)
    mono = Engine(cfg).generate(ps, max_tokens=5)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)], load_mode=load_mode)
    c0, c1 = rank_services(csvc)
    assert c0.stop_on_failure is False  # V2: the request fails, the engine keeps serving

    # one request at a time: a failed request fails its whole batch (TensorRT-LLM too)
    a = run(cons, [ps[0]], max_tokens=5)[0]
    rid = cons.add_request(ps[1], 5)
    hit = fail_on_rank1(c1, rid, how)
    t0 = time.monotonic()
    while cons.has_work():
        cons.step()  # a divergence would raise RankDivergenceError here
    took = time.monotonic() - t0
    b = cons.results[rid]
    c = run(cons, [ps[2]], max_tokens=5)[0]

    assert hit, "the failure was not injected"
    assert b.error is not None and f"request {rid}" in b.error
    assert "TP rank 1" in b.error and "injected" in b.error  # rank 0 names the failed rank
    assert b.tokens == []
    assert took < 5.0  # decided from rank 1's report, not a timeout
    for res, want, p in ((a, mono[0], produced[0]), (c, mono[2], produced[2])):
        assert res.error is None and res.tokens == want
        assert res.connector_matched_tokens > 0 and res.loaded_pages
        for where, data in res.loaded_pages.items():
            assert data == p.computed_pages[where], f"page {where} differs"
    assert c1.metrics["loads_failed"] >= 1
    assert c0.metrics["loads_failed_on_other_rank"] == 1
    assert c0.metrics["rank_outcome_timeouts"] == c1.metrics["rank_outcome_timeouts"] == 0
    for svc in rank_services(psvc):  # every producer rank got every lease back
        assert wait_for(lambda s=svc: s.leases.active() == 0), f"rank {svc.tp_rank} leases"
        assert wait_for(lambda s=svc: s.store.pinned_blocks() == 0), f"rank {svc.tp_rank} pins"


def test_one_rank_failure_stops_every_rank_under_stop_instance():
    """V1 with block reuse (default policy stop_instance): every rank stops alike."""
    cfg = EngineConfig(**TP2, kv_manager="v1")
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)])
    c0, c1 = rank_services(csvc)
    assert c0.stop_on_failure and c1.stop_on_failure
    rid = cons.add_request(ps[0], 4)
    fail_on_rank1(c1, rid)
    with pytest.raises(RuntimeError, match="unrecoverable") as exc:
        while cons.has_work():
            cons.step()
    assert not isinstance(exc.value, RankDivergenceError)
    assert f"request {rid}" in str(exc.value)


def test_a_silent_rank_counts_as_failed_after_the_deadline(caplog):
    """Rank 1 never reports (its bus is gone): rank 0 waits until its deadline plus the
    grace, then fails the request and names the silent rank; rank 1, whose own load
    timed out, fails it too: no divergence."""
    cfg = EngineConfig(**TP2, kv_manager="v2")
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, max_tokens=1)
    rank_services(psvc)[1].data.close()  # producer rank 1 never pushes
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)], load_timeout_s=0.5)
    c0, c1 = rank_services(csvc)
    c1.bus.close()  # and consumer rank 1 never tells anyone
    rid = cons.add_request(ps[0], 4)
    while cons.has_work():
        cons.step()
    res = cons.results[rid]
    assert res.error is not None and f"request {rid}" in res.error
    assert "rank(s) [1] reported no outcome" in res.error
    assert c0.metrics["rank_outcome_timeouts"] == 1
    assert "counted as failed on rank 0" in caplog.text


# -- the bus on its own ------------------------------------------------------------------
def test_decision_rule():
    s = RankState
    # async (need None): every rank landed whole, or the first failed rank
    assert decide({0: s(0, ""), 1: s(0, "")}, 2, None) == ("", -1)
    assert decide({0: s(0, ""), 1: s(0, None)}, 2, None) is None
    assert decide({0: s(0, None), 1: s(0, "boom")}, 2, None) == ("boom", 1)
    assert decide({0: s(0, "")}, 2, None) is None  # rank 1 silent so far
    # layer-wise: rank 1 landed 2 layers, then failed: fine before layer 1, not layer 2
    st = {0: s(3, None), 1: s(2, "checksum")}
    assert decide(st, 2, 2) == ("", -1)
    assert decide(st, 2, 3) == ("checksum", 1)
    # a state only grows, and final is set once
    x = s()
    assert x.merge(2, None) and not x.merge(1, None) and x.progress == 2
    assert x.merge(2, "late failure") and not x.merge(5, "") and x == s(2, "late failure")


def _bus_pair(ticks: list[int]) -> tuple[RankBus, RankBus]:
    def tick() -> bool:
        ticks.append(1)
        return False

    b0 = RankBus(0, 2, tick)
    b1 = RankBus(1, 2, tick)
    return b0, b1


def test_bus_late_joiner_gets_earlier_states_and_forwarding_works():
    ticks: list[int] = []
    b0, b1 = _bus_pair(ticks)
    try:
        b0.record(7, 0, "")  # before rank 1 is connected
        b1.record(7, 0, "rank 1 failed")  # before rank 1 knows the hub: queued
        assert b0.address and len(b0.secret) == 16
        b1.connect(b0.address, b0.secret)
        end = time.monotonic() + 5
        assert b0.wait(7, None, end) == ("rank 1 failed", 1)
        assert b1.wait(7, None, end) == ("rank 1 failed", 1)
        b0.record(8, 1, None)
        b1.record(8, 1, None)
        assert b1.wait(8, 1, end) == ("", -1) and b0.wait(8, 1, end) == ("", -1)
        assert b0.decision(8, None) is None and b0.missing(8, None) == [0, 1]
        assert ticks  # the service's tick runs on the bus thread
    finally:
        b0.close()
        b1.close()


def test_bus_drops_a_message_without_the_secret(caplog):
    b0 = RankBus(0, 2, lambda: False)
    try:
        ctx = zmq.Context.instance()
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(b0.address)
        enc = msgspec.msgpack.encode
        rogue.send(enc([b"x" * 16, "s", 9, 1, 0, ""]))  # fake "rank 1 landed"
        assert wait_for(lambda: "dropped a bad rank-bus message" in caplog.text)
        assert b0.decision(9, None) is None
        rogue.close(0)
    finally:
        b0.close()
