"""Producer and consumer connectors moving pages between two reference engines.

Correctness is judged token for token against a monolithic run, and page for page: the
pages the consumer loaded must equal, byte for byte, the pages the producer computed.
"""

from __future__ import annotations

import time

import pytest
from harness import (
    SHAPE,
    check_against_monolithic,
    close_all_services,
    make_consumer,
    make_producer,
    prompts,
    run,
    wait_for,
)

from disagg.consumer import ConsumerScheduler
from disagg.consumer.connector import KvLoadFailedError
from disagg.engine.reference import Engine, EngineConfig


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


CASES = {
    "v1": dict(kv_manager="v1"),
    "v1-chunked": dict(kv_manager="v1", chunk_size=48),
    "v2": dict(kv_manager="v2"),
    "v2-vswa": dict(kv_manager="v2", windows=(32, None)),
    "v2-vswa-chunked": dict(kv_manager="v2", windows=(32, None), chunk_size=64),
}


@pytest.mark.parametrize("load_mode", ["async", "sync"])
@pytest.mark.parametrize("case", list(CASES))
def test_tokens_and_pages_match_monolithic(case, load_mode):
    cfg = EngineConfig(**SHAPE, **CASES[case], capture_pages=True)
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=6)

    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], load_mode=load_mode)
    consumed = run(cons, ps, max_tokens=6)

    check_against_monolithic(produced, consumed, mono)
    # the producer counts a push once libzmq released its frames, which can trail the
    # consumer's completion by a moment
    assert csvc.metrics["pages_loaded"] > 0
    assert wait_for(lambda: psvc.metrics["pages_pushed"] > 0)
    # synchronous loads stream layer by layer, asynchronous ones as whole pages
    assert (psvc.metrics["pushes_layerwise"] > 0) == (load_mode == "sync")
    # every lease comes back once the requests finished
    assert wait_for(lambda: psvc.leases.active() == 0)
    assert psvc.store.pinned_blocks() == 0


def _prefill_then_decode_match_monolithic(cfg: EngineConfig) -> None:
    """One token from a producer, six from a consumer loading its pages: tokens and
    pages equal to the monolithic run's."""
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=6)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, _ = make_consumer(cfg, [psvc.endpoint])
    check_against_monolithic(produced, run(cons, ps, max_tokens=6), mono)


@pytest.mark.parametrize("plan_layers", [0, 1, 3, 9])
def test_a_pass_planned_at_a_layers_save_saves_them_all(monkeypatch, plan_layers):
    """``tuning.save_plan_layers``: each layer copied as it is saved from the plan on
    (at the 1st or the 3rd of 4 layers, the layers before copied after the plan), or all
    of them at ``wait_for_save`` (0, or more than it has)."""
    monkeypatch.setenv("DISAGG_SAVE_PLAN_LAYERS", str(plan_layers))
    shape = {**SHAPE, "num_layers": 4}
    cfg = EngineConfig(**shape, **CASES["v2-vswa-chunked"], capture_pages=True)
    _prefill_then_decode_match_monolithic(cfg)


@pytest.mark.parametrize("whole", ["1", "0"], ids=["whole", "layerwise"])
@pytest.mark.parametrize("after", ["0", "1"], ids=["in-wait-for-save", "after-responses"])
def test_a_pass_is_copied_after_the_iterations_responses(monkeypatch, after, whole):
    """``tuning.save_after_responses``: the pass's copies are enqueued in ``get_finished``,
    after the engine's responses (its first token out), or in ``wait_for_save`` before
    sampling; the whole pass at once, or a layer at a time (``tuning.save_whole_pass``
    off); tokens and pages are the monolithic run's either way."""
    import disagg.producer.saving as pc

    monkeypatch.setenv("DISAGG_SAVE_AFTER_RESPONSES", after)
    monkeypatch.setenv("DISAGG_SAVE_WHOLE_PASS", whole)
    copies = ["pass"] if whole == "1" else ["layer"] * 4
    order: list[str] = []
    cfg = EngineConfig(**{**SHAPE, "num_layers": 4})
    prod, psvc = make_producer(cfg)  # its bring-up copies a page (warm_pass_copy) unspied
    for name, tag in (("copy_layer_to_store", "layer"), ("copy_pass_to_store", "pass")):

        def spy(*a, _copy=getattr(pc, name), _tag=tag, **k):
            order.append(_tag)
            return _copy(*a, **k)

        monkeypatch.setattr(pc, name, spy)
    rid = prod.add_request(prompts(n=1)[0], 1)
    prod.respond = lambda: order.append("respond")
    while not prod.results[rid].finished or prod.has_work():
        prod.step()
    first = order.index("respond")
    if after == "1":
        assert order[:first] == [] and order[first + 1 :] == copies
    else:
        assert order[:first] == copies
    assert psvc.drain_commits() and psvc.store.stats.saves_committed > 0
    shape = {**SHAPE, "num_layers": 4}
    _prefill_then_decode_match_monolithic(
        EngineConfig(**shape, **CASES["v2-vswa-chunked"], capture_pages=True)
    )


@pytest.mark.parametrize("plan_layers", [0, 2])
def test_a_pass_with_two_regions_per_group_saves_them_all(monkeypatch, plan_layers):
    """A group of two regions (a replicated one) saved at the pass's end or from its
    second layer on, layer groups of two windows."""
    monkeypatch.setenv("DISAGG_SAVE_PLAN_LAYERS", str(plan_layers))
    cfg = EngineConfig(
        **SHAPE, **CASES["v2-vswa-chunked"], capture_pages=True, replicated_regions=True
    )
    _prefill_then_decode_match_monolithic(cfg)


@pytest.mark.parametrize(("reserve", "plan"), [(1, 0), (1, 3), (3, 0), (3, 2), (0, 0), (0, 2)])
def test_a_pass_reserves_its_store_rows_at_the_chosen_layers_save(monkeypatch, reserve, plan):
    """``tuning.save_reserve_layers``: the save of that many layers reserves the pass's
    blocks in the store (a prefetch's lease is granted on held blocks), none before and
    whatever ``save_plan_layers`` says (a plan asked for earlier waits for the rows); 0
    reserves them after the last layer. Tokens and pages stay the monolithic run's."""
    from disagg.producer.connector import ProducerWorker

    monkeypatch.setenv("DISAGG_SAVE_PLAN_LAYERS", str(plan))
    monkeypatch.setenv("DISAGG_SAVE_RESERVE_LAYERS", str(reserve))
    held: list[int] = []  # the first pass: blocks held after each layer's save
    save = ProducerWorker.save_kv_layer

    def spy(self, layer_idx, stream):
        save(self, layer_idx, stream)
        if len(held) < 4:
            held.append(self.service.store.stats.saves_planned)

    monkeypatch.setattr(ProducerWorker, "save_kv_layer", spy)
    cfg = EngineConfig(**{**SHAPE, "num_layers": 4})
    prod, psvc = make_producer(cfg)
    run(prod, prompts(n=1), max_tokens=1)
    assert len(held) == 4
    first = reserve - 1 if reserve else 4
    assert held[:first] == [0] * first and all(n > 0 for n in held[first:])
    assert psvc.drain_commits()
    assert psvc.store.stats.saves_committed == psvc.store.stats.saves_planned > 0
    shape = {**SHAPE, "num_layers": 4}
    _prefill_then_decode_match_monolithic(
        EngineConfig(**shape, **CASES["v2-vswa-chunked"], capture_pages=True)
    )


def test_cache_salt_isolates_prefixes():
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1, salt="tenant-a")
    cons, _ = make_consumer(cfg, [psvc.endpoint])
    (other,) = run(cons, ps, 4, salt="tenant-b")
    assert other.connector_matched_tokens == 0
    (same,) = run(cons, [ps[0][:-1] + [7]], 4, salt="tenant-a")  # new request id, same prefix
    assert same.connector_matched_tokens > 0


def test_incompatible_peer_is_a_miss_and_is_counted():
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], model_id="some-other-model")
    (res,) = run(cons, ps, 4)
    assert res.error is None and res.connector_matched_tokens == 0
    assert res.tokens == Engine(cfg).generate(ps, 4)[0]
    assert psvc.metrics["handshake_refused"] >= 1 and csvc.metrics["handshake_refused"] >= 1
    # refused for a field of the configuration: skipped from then on, without a call
    refusal = csvc.links[0].refusal
    assert refusal.reason == "incompatible" and "model" in refusal.message
    hellos = psvc.metrics["control_Hello"]
    (again,) = run(cons, ps, 4, salt="not in the device cache")
    assert again.tokens == res.tokens and csvc.metrics["claims_no_producer"] == 1
    assert psvc.metrics["control_Hello"] == hellos


def test_another_transport_is_refused_at_hello_and_is_a_miss(caplog):
    """A consumer on ``ipc`` against a ``tcp`` producer: refused by name at Hello (never
    a push to a plane that cannot read it), recomputed, right tokens."""
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], transport="ipc")
    with caplog.at_level("WARNING"):
        (res,) = run(cons, ps, 4)
    assert res.error is None and res.connector_matched_tokens == 0
    assert res.tokens == Engine(cfg).generate(ps, 4)[0]
    assert psvc.metrics["handshake_refused"] >= 1 and csvc.metrics["handshake_refused"] >= 1
    assert psvc.metrics["pushes_done"] == 0
    assert "set the same `transport:` on both sides" in caplog.text


def test_producer_down_before_claim_is_a_miss():
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=2)
    cons, csvc = make_consumer(cfg, ["tcp://127.0.0.1:9"], claim_timeout_s=0.5)  # nobody there
    t0 = time.monotonic()
    results = run(cons, ps, 4)
    assert time.monotonic() - t0 < 10
    assert [r.tokens for r in results] == Engine(cfg).generate(ps, 4)
    assert all(r.connector_matched_tokens == 0 for r in results)


@pytest.mark.parametrize("policy", ["v2-auto", "v1-fail_request"])
def test_failed_load_fails_the_request_by_name_and_never_computes_on_it(policy):
    """V2 publishes only what a forward committed (auto: the request fails, by name); on
    V1 ``fail_request`` is the operator's explicit choice."""
    kv_manager, choice = policy.split("-")
    cfg = EngineConfig(**SHAPE, kv_manager=kv_manager)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    psvc.data.close()  # the producer's data plane dies after it accepted the claim
    cons, csvc = make_consumer(cfg, [psvc.endpoint], load_timeout_s=1.0, on_load_failure=choice)
    rid = cons.add_request(ps[0], 4)
    t0 = time.monotonic()
    while cons.has_work():
        cons.step()
    res = cons.results[rid]
    assert time.monotonic() - t0 < 15
    assert res.error is not None and f"request {rid}" in res.error
    assert res.tokens == []
    assert csvc.metrics["loads_failed"] == 1
    assert cons.driver.workers[0].service.stop_on_failure is False


def test_failed_load_stops_a_v1_engine_that_would_publish_its_pages():
    """V1 with block reuse stores a released request's blocks for reuse whatever it
    computed: failing only the request would leave its unfilled pages for the next
    request with that prefix. The default (auto) stops the engine, naming the request."""
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    psvc.data.close()
    cons, csvc = make_consumer(cfg, [psvc.endpoint], load_timeout_s=1.0)
    rid = cons.add_request(ps[0], 4)
    end = time.monotonic() + 15
    with pytest.raises(KvLoadFailedError, match=rf"request {rid}.*unrecoverable"):
        while time.monotonic() < end:  # the load fails at its deadline (1 s)
            cons.step()
            time.sleep(0.005)
    with pytest.raises(RuntimeError, match="engine is dead"):
        cons.step()
    assert cons.results[rid].tokens == []


def test_failing_only_the_request_on_v1_would_serve_unfilled_pages():
    """Why the default stops a V1 engine: with ``fail_request`` forced, the failed
    request's pages are published, and the same prompt computed afterwards (no producer
    left: a miss) reuses them and gives wrong tokens. The reference engine mirrors
    TensorRT-LLM's releaseBlocks here; this test pins that behaviour."""
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    psvc.data.close()
    cons, csvc = make_consumer(
        cfg,
        [psvc.endpoint],
        load_timeout_s=1.0,
        claim_timeout_s=0.5,
        on_load_failure="fail_request",
    )
    rid = cons.add_request(ps[0], 4)
    while cons.has_work():
        cons.step()
    assert f"request {rid}" in (cons.results[rid].error or "")
    psvc.close()
    again = run(cons, ps, 4)[0]
    assert again.device_matched_tokens > 0  # the failed request's pages, published
    assert again.tokens != Engine(cfg).generate(ps, 4)[0]


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_producer_closed_after_claim_fails_within_deadline(load_mode):
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    cons, csvc = make_consumer(
        cfg,
        [psvc.endpoint],
        load_timeout_s=1.0,
        load_mode=load_mode,
        on_load_failure="fail_request",
    )
    rid = cons.add_request(ps[0], 4)
    cons.step()  # the claim is answered in this iteration's scheduling
    psvc.close()
    while cons.has_work():
        cons.step()
    res = cons.results[rid]
    # either the push raced ahead of the close (tokens are then right) or the request fails
    if res.error is None:
        assert res.tokens == Engine(cfg).generate(ps, 4)[0]
    else:
        assert f"request {rid}" in res.error and res.tokens == []


def test_two_producers_each_serve_what_they_hold():
    cfg = EngineConfig(**SHAPE)
    a, b = prompts(n=1, seed=2)[0], prompts(n=1, seed=3)[0]
    pa, sa = make_producer(cfg)
    pb, sb = make_producer(cfg)
    run(pa, [a], 1)
    run(pb, [b], 1)
    cons, _ = make_consumer(cfg, [sa.endpoint, sb.endpoint])
    results = run(cons, [a, b], 5)
    assert [r.tokens for r in results] == Engine(cfg).generate([a, b], 5)
    assert all(r.connector_matched_tokens > 0 for r in results)
    assert wait_for(lambda: sa.metrics["pages_pushed"] > 0 and sb.metrics["pages_pushed"] > 0)


class _Req:
    def __init__(self, rid, tokens, salt=None):
        self.request_id, self._t, self.prompt_len, self.cache_salt = rid, tokens, len(tokens), salt

    def get_tokens(self, beam=0):
        return self._t


def test_scheduler_rules_unaligned_last_token_and_replay_without_leak():
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1, length=64)  # exactly 4 blocks of 16
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    cons, _ = make_consumer(cfg, [psvc.endpoint])
    sched = cons.driver.scheduler
    assert isinstance(sched, ConsumerScheduler)
    req = _Req(10_001, ps[0])
    assert sched.get_num_new_matched_tokens(req, 5) == (0, False)  # not block-aligned
    n, is_async = sched.get_num_new_matched_tokens(req, 0)
    assert n == 48 and is_async  # never the last block's last token: 3 of 4 blocks
    assert psvc.leases.active() == 1
    n2, _ = sched.get_num_new_matched_tokens(req, 16)  # replayed: asks again
    assert n2 == 32
    assert wait_for(lambda: psvc.leases.active() == 1)  # the first lease was given back
    sched.request_finished(req, [])
    assert wait_for(lambda: psvc.leases.active() == 0)


def test_health_turns_unhealthy_when_a_guarding_part_stops():
    cfg = EngineConfig(**SHAPE)
    prod, psvc = make_producer(cfg)
    cons, csvc = make_consumer(cfg, [psvc.endpoint])
    assert psvc.health() == (True, "") and csvc.health() == (True, "")
    psvc.data.close()  # its worker threads end: pushes can no longer be accounted for
    assert wait_for(lambda: not psvc.health()[0])
    assert "data plane" in psvc.health()[1]
    csvc.close()
    assert csvc.health() == (False, "the consumer service is closed")


def test_layerwise_load_releases_each_layer_as_its_pages_land():
    """Layer 0 may compute once its pages landed, while layer 1's are still missing; a
    layer that never lands fails the load at the deadline (never a silent completion)."""
    import secrets

    import torch

    from disagg.consumer.loads import Claimed, Load, LoadState
    from disagg.protocol import PageBatch, encode
    from disagg.transport.tcp import StreamPush

    cfg = EngineConfig(**SHAPE)  # 2 layers, one group
    cons, csvc = make_consumer(cfg, ["tcp://127.0.0.1:9"], load_timeout_s=5.0)
    pool = csvc.pool
    slots = [5, 6, 7]
    load = Load(1, Claimed(csvc.links[0], 1, 3), first_block=0, dst_slots=[slots])
    load.transfer_id, load.token = 77, secrets.token_bytes(16)
    load.transition(LoadState.DISPATCHED)
    load.deadline = time.monotonic() + 5.0
    load.layer_marks = {0: 3, 1: 6}
    csvc.data.expect(77, 1, load.token, [0, 3, 3], 5.0, slots_by_group=[[], slots, slots])
    width = sum(r.shape[1] for r in pool.layer_regions(0))
    layer0 = torch.randint(0, 256, (3, width), dtype=torch.uint8)
    # what a layer-wise push puts on the wire first: layer 0's pages (group G + 0), and
    # nothing more yet (the sender is still copying later layers)
    tx = StreamPush(csvc.data.endpoint)
    try:
        head = PageBatch(
            transfer_id=77, lease_id=1, token=load.token, group=1, runs=[(5, 3)], page_bytes=width
        )
        tx.send_multipart([encode(head), layer0.numpy().tobytes()])
        csvc.wait_layer(load, 0)
        assert load.state is LoadState.DISPATCHED and load.error is None
        landed = torch.cat([r[slots].cpu() for r in pool.layer_regions(0)], dim=1)
        assert torch.equal(landed, layer0)
        load.deadline = time.monotonic() + 0.3
        csvc.wait_layer(load, 1)  # layer 1 never comes
        assert load.state is LoadState.FAILED
        assert load.error is not None and "load_timeout_s" in load.error
    finally:
        tx.close()


def test_failed_load_fails_over_to_another_producer_holding_the_blocks(monkeypatch):
    """Two producers hold the same prefix; the one claimed from dies in the middle of its
    push: the load is quieted, its lease given back, and the same blocks are claimed from
    the other producer and pushed into the same slots, within the load's deadline. The
    request never fails; its tokens and pages are right."""
    import sys
    import threading
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "chaos"))
    from chaos_role import slow_pushes

    from disagg.transport import tcp

    monkeypatch.setattr(tcp.plan, "MSG_BYTES", tcp.plan.MSG_BYTES)  # slow_pushes sets it
    cfg = EngineConfig(**SHAPE, kv_manager="v2", capture_pages=True)
    ps = prompts(n=1, length=300)
    p0, psvc0 = make_producer(cfg)
    p1, psvc1 = make_producer(cfg)
    run(p0, ps, 1)
    produced = run(p1, ps, 1)
    started, go = threading.Event(), threading.Event()
    slow_pushes(psvc0, 0.0, on_start=lambda tid: (started.set(), go.wait(30)))
    cons, csvc = make_consumer(
        cfg,
        [psvc0.endpoint, psvc1.endpoint],
        load_timeout_s=10.0,
        load_mode="async",
        heartbeat_s=0.3,  # the keepalive finds the dead producer fast ...
        claim_timeout_s=1.0,  # ... once a call to it times out (a live one answers in ms)
    )
    rid = cons.add_request(ps[0], 4)
    cons.step()  # claimed from producer 0 (configured first on a tie), push stalls
    assert started.wait(10)
    psvc0.close()  # producer 0 dies with its push half sent
    go.set()
    while cons.has_work():
        cons.step()
    check_against_monolithic(produced, [cons.results[rid]], Engine(cfg).generate(ps, 4))
    assert csvc.metrics["loads_failed_over"] == 1 and csvc.metrics["loads_failed"] == 0
    assert wait_for(lambda: psvc1.leases.active() == 0)


def test_claim_of_a_request_dropped_before_allocation_is_given_back():
    """A request asked about and then dropped by the engine with no call (cancelled
    between query and allocation): its claim is given back once the metadata of two more
    iterations went by without its allocation, not renewed forever."""
    cfg = EngineConfig(**SHAPE, kv_manager="v2")
    ps = prompts(n=2)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint])
    ghost = cons.add_request(ps[0], 4)
    req = cons.requests[ghost]
    n, _ = cons.driver.scheduler.get_num_new_matched_tokens(req, 0)
    assert n > 0 and psvc.leases.active() == 1  # claimed, never allocated
    cons._waiting.remove(req)  # the engine drops it without a connector call
    run(cons, ps[1:], 4)
    assert csvc.metrics["claims_orphaned"] == 1
    assert wait_for(lambda: psvc.leases.active() == 0)
