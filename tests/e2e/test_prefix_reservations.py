"""TensorRT-LLM main's prefix reservations (opt-in: V2 manager, prefix-aware scheduling)
between a producer and a consumer reference engine over a real zmq transfer.

Judged as everything else: token for token against a monolithic run, loaded pages byte for
byte against the producer's; and on the producer, exactly which blocks stay leased.
"""

from __future__ import annotations

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

from disagg.engine.reference import Engine, EngineConfig
from disagg.protocol import messages as m
from disagg.protocol.errors import ErrorCode, ProtocolError

PREFIX = dict(**SHAPE, kv_manager="v2", prefix_aware_scheduling=True)
TPB = SHAPE["tokens_per_block"]


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


def _all_leases_back(psvc) -> None:
    assert wait_for(lambda: psvc.leases.active() == 0)
    assert psvc.store.pinned_blocks() == 0


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_tokens_and_pages_match_monolithic_with_reservations(load_mode):
    cfg = EngineConfig(**PREFIX, capture_pages=True)
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=6)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], load_mode=load_mode)
    assert cons.prefix_reservations
    consumed = run(cons, ps, max_tokens=6)
    check_against_monolithic(produced, consumed, mono)
    calls = cons.stats.calls
    assert calls["reserve_prefix"] == 3 and calls["get_num_new_matched_tokens"] == 0
    assert calls["release_prefix_reservation"] == 3  # the accepted ranges, after the loads
    assert (psvc.metrics["pushes_layerwise"] > 0) == (load_mode == "sync")
    _all_leases_back(psvc)


def test_clipped_range_loads_the_accepted_part_and_gives_the_tail_back_first():
    """The runtime accepts 2 of the 12 blocks offered: the 10 others are released on the
    producer before any push (the lease keeps exactly the accepted 2), only those 2 move,
    and the tokens are still the monolithic run's."""
    cfg = EngineConfig(**PREFIX, prefix_load_cap_tokens=2 * TPB + 5, capture_pages=True)
    ps = prompts(n=1)
    mono = Engine(cfg).generate(ps, max_tokens=5)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint])
    rid = cons.add_request(ps[0], 5)
    cons.step()  # admission: reserve 12 blocks, accept 2, release the tail, dispatch
    assert wait_for(lambda: psvc.leases.stats.extra.get("blocks_released_in_part") == 10)
    (lease,) = psvc.leases._leases.values()  # still leased: the accepted part
    assert lease.released is not None and lease.released.tolist() == [False] * 2 + [True] * 10
    while cons.has_work():
        cons.step()
    res = cons.results[rid]
    assert res.connector_matched_tokens == 2 * TPB
    check_against_monolithic(produced, [res], mono)
    assert csvc.metrics["pages_loaded"] == 2
    assert cons.stats.calls["release_prefix_reservation"] == 2  # tail first, then the rest
    _all_leases_back(psvc)


def test_rejected_reservation_and_miss_compute_locally():
    """A reservation the runtime rejects outright is released whole before any push;
    a miss is ``(0, False)`` and needs no release; both compute the right tokens."""
    cfg = EngineConfig(**PREFIX, prefix_load_cap_tokens=TPB - 1)  # less than a block
    ps = prompts(n=2)
    mono = Engine(cfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(cfg)
    run(prod, ps[:1], max_tokens=1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint])
    (held,) = run(cons, ps[:1], 4)
    assert held.connector_matched_tokens == 0 and held.tokens == mono[0]
    assert cons.stats.calls["release_prefix_reservation"] == 1
    assert psvc.metrics["pushes_done"] == 0
    # the shared 96 tokens are now on the device; block 6 on the producer is ps[0]'s
    (miss,) = run(cons, ps[1:], 4)
    assert miss.tokens == mono[1] and miss.device_matched_tokens == 96
    assert miss.connector_matched_tokens == 0
    assert cons.stats.calls["reserve_prefix"] == 2
    assert cons.stats.calls["release_prefix_reservation"] == 1  # a miss holds nothing
    _all_leases_back(psvc)


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_failed_prefix_load_fails_the_request_by_name_and_never_computes_on_it(load_mode):
    """No API reports a failed load: it is reported finished (so the reservation retires,
    and the allocation is freed only then) and its request raises at its first forward.
    The same prompt afterwards (nothing to claim) computes the monolithic tokens: V2
    published nothing the failed request did not compute."""
    cfg = EngineConfig(**PREFIX)
    ps = prompts(n=1)
    mono = Engine(cfg).generate(ps, 4)[0]
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    psvc.data.close()  # the producer's data plane dies after it accepted the claim
    cons, csvc = make_consumer(
        cfg, [psvc.endpoint], load_timeout_s=1.0, claim_timeout_s=0.5, load_mode=load_mode
    )
    rid = cons.add_request(ps[0], 4)
    while cons.has_work():
        cons.step()
    res = cons.results[rid]
    assert res.error is not None and f"request {rid}" in res.error, res.error
    assert res.tokens == []
    assert csvc.metrics["loads_failed"] == 1
    assert cons.stats.calls["release_prefix_reservation"] == 1
    psvc.close()
    (again,) = run(cons, ps, 4)
    assert again.error is None and again.tokens == mono


@pytest.mark.parametrize("older", ["announces_nothing", "refuses_the_kind"])
def test_producer_without_release_range_keeps_blocks_until_the_whole_release(older):
    """An older producer: its HelloOk announces no ``release_range`` (the consumer sends
    none), or it refuses the kind by name (the consumer stops sending it). Either way the
    clipped blocks stay leased until the reservation is released whole: protected longer,
    never less, and the tokens are right."""
    cfg = EngineConfig(**PREFIX, prefix_load_cap_tokens=2 * TPB, capture_pages=True)
    ps = prompts(n=2)
    mono = Engine(cfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, max_tokens=1)
    if older == "announces_nothing":
        psvc.features = ()
    else:
        handle = psvc._handle

        def old_handle(identity, msg):
            if isinstance(msg, m.ReleaseRange):
                raise ProtocolError(ErrorCode.UNKNOWN_KIND, "unknown message kind 'release_range'")
            return handle(identity, msg)

        psvc.server._handler = old_handle
    cons, csvc = make_consumer(cfg, [psvc.endpoint])
    consumed = run(cons, ps, max_tokens=4)
    check_against_monolithic(produced, consumed, mono)
    assert psvc.leases.stats.extra.get("blocks_released_in_part", 0) == 0
    assert csvc.metrics["release_range_unsupported"] >= 1
    if older == "announces_nothing":
        assert psvc.metrics["control_ReleaseRange"] == 0
    _all_leases_back(psvc)
