"""Requests that end while their KV is still moving (peer bugs: a load landing in pages the
engine already freed and handed to another request; a failed forward leaving its saves
counted forever, so the prefill instance's pages are never given back)."""

from __future__ import annotations

import threading
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

from disagg.engine.reference import Engine, EngineConfig
from disagg.producer.store import BlockState
from disagg.transport import tcp
from disagg.transport.dataplane import TransferState

CFG = EngineConfig(**SHAPE, capture_pages=True)


@pytest.fixture(autouse=True)
def _cleanup():
    yield
    close_all_services()


def drain(eng: Engine, steps: int = 500) -> None:
    """Step until the engine is idle (bounded: a request stuck parked fails the test)."""
    for _ in range(steps):
        if not eng.has_work():
            break
        eng.step()
        time.sleep(0.01)
    assert not eng.has_work()


def _slots_bytes(eng: Engine, slots: list[list[int]]) -> dict[tuple[int, int], bytes]:
    return {(g, s): eng.page_bytes(g, s) for g, group in enumerate(slots) for s in group if s >= 0}


@pytest.mark.parametrize("kv_manager", ["v1", "v2"])
def test_cancel_while_its_load_is_landing_never_writes_into_freed_pages(monkeypatch, kv_manager):
    """TensorRT-LLM cancels without a connector call; a line that keeps a cancelled
    request's pages while its load is pending (``has_pending_transfers``) frees them once
    the load is reported: the load never writes into freed pages, its lease goes back
    then, and the next request on those pages gets the monolithic tokens (V1 stores the
    cancelled request's blocks for reuse: they hold the loaded bytes)."""
    from chaos_role import slow_pushes

    monkeypatch.setattr(tcp.plan, "MSG_BYTES", tcp.plan.MSG_BYTES)  # slow_pushes changes it
    cfg = EngineConfig(**SHAPE, capture_pages=True, kv_manager=kv_manager, runtime="main")
    ps = prompts(n=2, length=300)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, 1)
    started, go = threading.Event(), threading.Event()
    plain = psvc.data._wait_writable
    # the push stalls mid-way until the cancel has been handled (not for a fixed time,
    # which a loaded box can outlast)
    slow_pushes(psvc, 0.0, on_start=lambda tid: (started.set(), go.wait(30)))
    cons, csvc = make_consumer(cfg, [psvc.endpoint], load_timeout_s=10.0)
    rid = cons.add_request(ps[0], 4)
    cons.step()  # claim, allocate, park, ask for the push
    load = csvc.loads[rid]
    slots = [list(g) for g in load.dst_slots]
    assert load.started and started.wait(10), "the push never started"

    cons.cancel(rid)
    cons.step()
    assert cons.results[rid].error == "cancelled"
    assert cons.requests[rid].state == "cancelled", "pages freed while the load still lands"
    go.set()
    drain(cons)
    assert csvc.data.poll(load.transfer_id).state is TransferState.DONE
    before = _slots_bytes(cons, slots)
    time.sleep(0.5)  # nothing of the transfer may land after the pages were freed
    assert _slots_bytes(cons, slots) == before, "bytes landed after the pages were freed"
    assert csvc.health() == (True, "")
    assert wait_for(lambda: psvc.leases.active() == 0), "the lease was not released"

    psvc.data._wait_writable = plain
    mono = Engine(cfg).generate([ps[1]], 4)
    check_against_monolithic(produced[1:], run(cons, [ps[1]], 4), mono)
    if kv_manager == "v1":  # the cancelled request's blocks were stored for reuse
        psvc.close()
        again = run(cons, [ps[0]], 4)[0]
        assert again.device_matched_tokens > 0
        assert again.tokens == Engine(cfg).generate([ps[0]], 4)[0]


def test_failed_forward_on_the_producer_gives_its_pages_back():
    ps = prompts(n=1, length=300)
    prod, psvc = make_producer(CFG, save_timeout_s=60.0)  # no help from SAVE_TIMEOUT
    worker = prod.driver.workers[0]
    save = worker.save_kv_layer
    calls = {"n": 0}

    def failing(layer: int, stream: object) -> None:
        calls["n"] += 1
        save(layer, stream)
        if calls["n"] == 2:
            raise RuntimeError("injected forward failure")

    worker.save_kv_layer = failing
    rid = prod.add_request(ps[0], 2)
    for _ in range(10):
        if not prod.has_work():
            break
        prod.step()
    assert "injected forward failure" in (prod.results[rid].error or "")
    assert not prod.has_work(), f"request stuck in {prod.requests[rid].state!r}"
    assert not psvc.saves_in_flight(rid)
    assert psvc.metrics["passes_abandoned"] == 1
    assert all(e.state is BlockState.STORED for e in psvc.store._entries.values())

    # the producer keeps saving whole blocks, and a consumer loads them correctly (another
    # prompt: V1 itself publishes the failed request's unfilled pages on the producer's
    # device, TensorRT-LLM's own hazard, see docs/design/reliability.md)
    worker.save_kv_layer = save
    fresh = prompts(n=1, length=300, seed=9)
    produced = run(prod, fresh, 1)
    cons, _ = make_consumer(CFG, [psvc.endpoint])
    check_against_monolithic(produced, run(cons, fresh, 4), Engine(CFG).generate(fresh, 4))


def test_tp_cancel_keeps_the_pages_until_every_rank_reported(monkeypatch):
    """TP=2, V2: a request cancelled while both ranks' loads stall keeps its pages until
    every rank reported its load (the manager intersects the ranks' reports), then frees
    them; every rank's lease goes back; the next request on those pages is right."""
    from chaos_role import slow_pushes
    from harness import rank_endpoints, rank_services

    monkeypatch.setattr(tcp.plan, "MSG_BYTES", tcp.plan.MSG_BYTES)
    cfg = EngineConfig(**dict(SHAPE, tp=2), kv_manager="v2", runtime="main", capture_pages=True)
    ps = prompts(n=2, length=300)
    prod, psvc = make_producer(cfg)
    produced = run(prod, ps, 1)
    started = [threading.Event(), threading.Event()]
    go = threading.Event()

    def stall(tid: int, ev: threading.Event) -> None:
        ev.set()
        go.wait(30)

    plain = []
    for r, svc in enumerate(rank_services(psvc)):
        plain.append(svc.data._wait_writable)
        slow_pushes(svc, 0.0, on_start=lambda tid, ev=started[r]: stall(tid, ev))
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)], load_timeout_s=10.0)
    rid = cons.add_request(ps[0], 4)
    cons.step()
    assert all(ev.wait(10) for ev in started), "a rank's push never started"
    cons.cancel(rid)
    cons.step()
    assert cons.requests[rid].state == "cancelled"
    go.set()
    drain(cons)
    for r, svc in enumerate(rank_services(psvc)):
        svc.data._wait_writable = plain[r]
    assert wait_for(lambda: all(s.leases.active() == 0 for s in rank_services(psvc)))
    got = run(cons, [ps[1]], 4)
    check_against_monolithic(produced[1:], got, Engine(cfg).generate([ps[1]], 4))
