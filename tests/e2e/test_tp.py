"""Homogeneous tensor parallelism: a TP=2 producer and a TP=2 consumer (reference engines
simulating both ranks in one process), each rank moving its own KV-head shard.

Judged as in test_disaggregated: tokens equal a monolithic run, and the pages the consumer
loaded (every rank's shard, concatenated) equal the producer's computed pages byte for byte.
"""

from __future__ import annotations

import logging

import pytest
from harness import (
    SHAPE,
    close_all_services,
    make_consumer,
    make_producer,
    prompts,
    rank_endpoints,
    rank_services,
    run,
    wait_for,
)

from disagg.bench.ports import free_port
from disagg.engine.reference import Engine, EngineConfig
from disagg.protocol.keys import block_keys
from disagg.service_base import rank_endpoint

TP2 = dict(SHAPE, tp=2)  # num_kv_heads=2: one KV head per rank


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


def _assert_pages_match(produced, consumed):
    for p, c in zip(produced, consumed):
        assert c.loaded_pages, "the consumer loaded no page"
        for where, data in c.loaded_pages.items():
            assert data == p.computed_pages[where], f"page {where} differs from the producer's"


def _assert_all_returned(psvc):
    for svc in rank_services(psvc):
        assert wait_for(lambda s=svc: s.leases.active() == 0), f"rank {svc.tp_rank} leases"
        assert wait_for(lambda s=svc: s.store.pinned_blocks() == 0), f"rank {svc.tp_rank} pins"


@pytest.mark.parametrize("load_mode", ["async", "sync"])
@pytest.mark.parametrize("kv_manager", ["v1", "v2"])
def test_tp2_tokens_and_pages_match_monolithic(kv_manager, load_mode):
    cfg = EngineConfig(**TP2, kv_manager=kv_manager, capture_pages=True)
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=6)

    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    pranks = rank_services(psvc)
    assert [s.tp_rank for s in pranks] == [0, 1]
    assert len({s.endpoint for s in pranks}) == 2  # one control server per rank
    # the same blocks, under the same keys (keys do not depend on the TP shard)
    assert pranks[0].store.used_blocks() == pranks[1].store.used_blocks() > 0
    assert set(pranks[0].store.keys()) == set(pranks[1].store.keys())

    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)], load_mode=load_mode)
    consumed = run(cons, ps, max_tokens=6)

    assert [r.error for r in consumed] == [None] * len(ps)
    assert [r.tokens for r in consumed] == mono
    assert all(r.connector_matched_tokens > 0 for r in consumed)
    _assert_pages_match(produced, consumed)
    for svc in pranks:  # every producer rank pushed its shard (counted once drained)
        assert wait_for(lambda s=svc: s.metrics["pages_pushed"] > 0)
        assert (svc.metrics["pushes_layerwise"] > 0) == (load_mode == "sync")
    for svc in rank_services(csvc):  # every consumer rank loaded its shard
        assert svc.metrics["pages_loaded"] > 0
        assert wait_for(lambda s=svc: not s.loads) or svc.tp_rank != 0
    _assert_all_returned(psvc)


def test_rank_endpoints_follow_port_plus_rank():
    assert rank_endpoint("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert rank_endpoint("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert rank_endpoint("tcp://127.0.0.1:0", 1) == "tcp://127.0.0.1:0"
    assert rank_endpoint("ipc:///tmp/p", 2) == "ipc:///tmp/p.2"

    cfg = EngineConfig(**TP2)
    ps = prompts(n=1)
    base = free_port(2)
    ep = f"tcp://127.0.0.1:{base}"
    prod, psvc = make_producer(cfg, control=ep)
    assert rank_endpoints(psvc) == [ep, f"tcp://127.0.0.1:{base + 1}"]
    run(prod, ps, 1)
    cons, _ = make_consumer(cfg, [ep])  # one endpoint: rank r at port + r
    (res,) = run(cons, ps, 4)
    assert res.error is None and res.connector_matched_tokens > 0
    assert res.tokens == Engine(cfg).generate(ps, 4)[0]


def test_head_blind_consumer_is_refused_as_a_miss(caplog, monkeypatch):
    ps = prompts(n=1)
    prod, psvc = make_producer(EngineConfig(**TP2))
    run(prod, ps, 1)
    cfg1 = EngineConfig(**SHAPE)  # TP=1, and the KV head count unknown to it
    with monkeypatch.context() as patch:
        patch.setattr("disagg.service_base.num_kv_heads_of", lambda llm_args: None)
        cons, csvc = make_consumer(cfg1, [psvc.endpoint])
    with caplog.at_level(logging.WARNING, logger="disagg.consumer"):
        (res,) = run(cons, ps, 4)
    assert res.error is None and res.connector_matched_tokens == 0
    assert res.tokens == Engine(cfg1).generate(ps, 4)[0]
    assert psvc.metrics["handshake_refused"] >= 1 and csvc.metrics["handshake_refused"] >= 1
    assert "num_kv_heads is 0 but ours is 2" in caplog.text


def test_consumer_rank_paired_with_another_producer_rank_is_refused(caplog):
    cfg = EngineConfig(**TP2)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    swapped = list(reversed(rank_endpoints(psvc)))  # rank 0 -> producer rank 1, and back
    cons, csvc = make_consumer(cfg, [swapped])
    with caplog.at_level(logging.WARNING, logger="disagg.consumer"):
        (res,) = run(cons, ps, 4)
    assert res.error is None and res.connector_matched_tokens == 0
    assert res.tokens == Engine(cfg).generate(ps, 4)[0]
    assert csvc.metrics["handshake_refused"] >= 1
    assert "is rank 1 of a TP=2 producer, but consumer.producers lists it as rank 0" in caplog.text
    _assert_all_returned(psvc)


@pytest.mark.parametrize("kv_manager", ["v1", "v2"])
def test_block_missing_on_one_producer_rank_is_not_offered(kv_manager):
    cfg = EngineConfig(**TP2, kv_manager=kv_manager, capture_pages=True)
    ps = prompts(n=1)  # 200 tokens: 12 offerable blocks of 16
    tpb = cfg.tokens_per_block
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, 1)
    rank1 = rank_services(psvc)[1]
    keys = block_keys(rank1.namespace_seed(None), ps[0][: 12 * tpb], tpb)
    store = rank1.store
    with store._changed:  # rank 1 lost block 5 (evicted, say); rank 0 still holds it
        store._drop(keys[5], store._entries[keys[5]])

    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)])
    consumed = run(cons, ps, 6)
    (res,) = consumed
    assert res.error is None
    assert res.connector_matched_tokens == 5 * tpb  # blocks 0..4: what every rank holds
    assert res.tokens == Engine(cfg).generate(ps, 6)[0]
    _assert_pages_match(produced, consumed)
    assert csvc.metrics["claims_rank_short"] == 1
    _assert_all_returned(psvc)


def test_a_producer_rank_down_is_a_miss():
    cfg = EngineConfig(**TP2)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    rank_services(psvc)[1].server.close()  # rank 1 stops answering
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)], claim_timeout_s=0.5)
    (res,) = run(cons, ps, 4)
    assert res.error is None and res.connector_matched_tokens == 0
    assert res.tokens == Engine(cfg).generate(ps, 4)[0]
    # rank 0's grant was given back
    assert wait_for(lambda: rank_services(psvc)[0].leases.active() == 0)


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_failed_load_on_one_rank_fails_the_request_by_name(load_mode):
    cfg = EngineConfig(**TP2)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    rank_services(psvc)[1].data.close()  # rank 1 accepts the claim but can never push
    cons, csvc = make_consumer(
        cfg,
        [rank_endpoints(psvc)],
        load_timeout_s=1.0,
        load_mode=load_mode,
        on_load_failure="fail_request",  # the default stops a V1 engine (test_disaggregated)
    )
    rid = cons.add_request(ps[0], 4)
    while cons.has_work():
        cons.step()
    res = cons.results[rid]
    assert res.error is not None and f"request {rid}" in res.error
    assert res.tokens == []
    c0, c1 = rank_services(csvc)
    assert c1.metrics["loads_failed"] == 1 and c0.metrics["loads_failed"] == 0
    assert wait_for(lambda: rank_services(psvc)[0].leases.active() == 0)
