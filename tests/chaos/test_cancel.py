"""Requests that end while their KV is still moving: a load landing in pages the engine
already freed and handed to another request (the consumer fences it, whatever the executor
does), and a failed forward leaving its saves counted forever, so the prefill instance's
pages are never given back."""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest
from harness import (
    SHAPE,
    check_against_monolithic,
    close_all_services,
    hold_pushes,
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
_no_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None,
    reason="NIXL is not installed (disagg[nixl])",
)
_no_ucx = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (disagg[ucx])"
)


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
    """An executor that asks ``has_pending_transfers`` before freeing a cancelled request's
    pages frees them once the load is reported: the load never writes into freed pages,
    its lease goes back then, and the next request on those pages gets the monolithic
    tokens (V1 stores the cancelled request's blocks for reuse: they hold the loaded
    bytes)."""
    from chaos_role import slow_pushes

    monkeypatch.setattr(tcp.plan, "MSG_BYTES", tcp.plan.MSG_BYTES)  # slow_pushes changes it
    cfg = EngineConfig(
        **SHAPE,
        capture_pages=True,
        kv_manager=kv_manager,
        runtime="main",
        cancel_waits_for_transfers=True,
    )
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


def test_a_forward_failing_before_its_first_layer_saved_gives_its_pages_back():
    """The pass is planned at its first layer's save: a forward failing before it (here
    in layer 0's load hook) reserved no row and leaves nothing in flight."""
    ps = prompts(n=1, length=300)
    prod, psvc = make_producer(CFG, save_timeout_s=60.0)
    worker = prod.driver.workers[0]
    load = worker.wait_for_layer_load

    def failing(layer: int, stream: object) -> None:
        raise RuntimeError("injected forward failure")

    worker.wait_for_layer_load = failing
    rid = prod.add_request(ps[0], 2)
    for _ in range(10):
        if not prod.has_work():
            break
        prod.step()
    assert "injected forward failure" in (prod.results[rid].error or "")
    assert not prod.has_work(), f"request stuck in {prod.requests[rid].state!r}"
    assert not psvc.saves_in_flight(rid)
    assert psvc.metrics["passes_abandoned"] == 1 and not psvc.store._entries
    worker.wait_for_layer_load = load  # saves go on (another prompt: see the test above)
    fresh = prompts(n=1, length=300, seed=9)
    produced = run(prod, fresh, 1)
    cons, _ = make_consumer(CFG, [psvc.endpoint])
    check_against_monolithic(produced, run(cons, fresh, 4), Engine(CFG).generate(fresh, 4))


def test_tp_cancel_fences_every_rank_before_the_next_forward(monkeypatch):
    """TP=2, V2, an executor that frees a cancelled request's pages at once: the next
    request takes them while both ranks' pushes stall; both ranks abort their part before
    its forward (the leader in ``build_connector_meta``, rank 1 from that pass's
    metadata), every rank's lease goes back, and its tokens and pages are its own."""
    from chaos_role import slow_pushes
    from harness import rank_endpoints, rank_services

    monkeypatch.setattr(tcp.plan, "MSG_BYTES", tcp.plan.MSG_BYTES)
    cfg = EngineConfig(
        **dict(SHAPE, tp=2, num_blocks=24), kv_manager="v2", runtime="main", capture_pages=True
    )
    ps = prompts(n=1, length=300)
    fresh = prompts(n=1, length=300, seed=99)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    started = [threading.Event(), threading.Event()]
    go = threading.Event()

    def stall(tid: int, ev: threading.Event) -> None:
        ev.set()
        go.wait(30)

    for r, svc in enumerate(rank_services(psvc)):
        slow_pushes(svc, 0.0, on_start=lambda tid, ev=started[r]: stall(tid, ev))
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)], load_timeout_s=10.0)
    rid = cons.add_request(ps[0], 4)
    cons.step()
    assert all(ev.wait(10) for ev in started), "a rank's push never started"
    rank_loads = [s.loads[rid] for s in rank_services(csvc)]
    cons.cancel(rid)
    c_id = cons.add_request(fresh[0], 4)
    pages: list[list[int]] = []
    while cons.has_work():
        cons.step()
        if not cons.results[c_id].finished:
            pages = cons.request_pages(c_id)
    assert [ld.state.name for ld in rank_loads] == ["ABANDONED", "ABANDONED"]
    go.set()
    assert wait_for(lambda: all(s.leases.active() == 0 for s in rank_services(psvc)), 15)
    time.sleep(0.3)  # a stray frame would have landed by now
    res = cons.results[c_id]
    assert res.error is None and res.tokens == Engine(cfg).generate(fresh, 4)[0]
    checked = 0
    for (g, b), data in res.computed_pages.items():
        if b < len(pages[g]) and pages[g][b] >= 0:
            assert cons.page_bytes(g, pages[g][b]) == data, f"page {(g, b)} was overwritten"
            checked += 1
    assert checked >= 4


PLANES = [
    pytest.param("tcp", None, id="tcp"),
    pytest.param("ucx", "tcp", id="ucx-tcp", marks=_no_ucx),
    pytest.param("ucx", "shm", id="ucx-shm", marks=_no_ucx),
    pytest.param("ipc", None, id="ipc"),
    pytest.param("nixl", None, id="nixl", marks=[_no_nixl, pytest.mark.nixl]),
]


@pytest.mark.parametrize("transport,channel", PLANES)
def test_cancel_then_reuse_on_every_plane(transport, channel):
    """The executor frees a cancelled request's pages at once and the next request takes
    them while the push is held: on every plane the consumer fences the load (or, where
    the plane's abort cannot prove it quiet, loads layer by layer, so no load outlives
    its forward), and the next request's tokens and pages are its own."""
    cfg = EngineConfig(**dict(SHAPE, num_blocks=24), capture_pages=True, kv_manager="v1")
    top = {"ucx_channel": channel} if channel else None
    ps = prompts(n=1, length=300)
    fresh = prompts(n=1, length=300, seed=99)
    prod, psvc = make_producer(cfg, transport=transport, top=top)
    run(prod, ps, 1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], transport=transport, top=top)
    layerwise = channel == "shm" or transport == "nixl"  # aborts that may leave writes
    started, go = hold_pushes(psvc)
    if layerwise:
        go.set()
    rid = cons.add_request(ps[0], 4)
    cons.step()
    assert started.wait(10), "the push never started"
    cons.cancel(rid)
    c_id = cons.add_request(fresh[0], 4)
    c_slots: list[list[int]] = []
    while cons.has_work():
        cons.step()
        if not cons.results[c_id].finished:
            c_slots = cons.request_pages(c_id)
    assert csvc.metrics["loads_fenced"] == (0 if layerwise else 1)
    go.set()
    assert wait_for(lambda: psvc.metrics["pushes_failed"] + psvc.metrics["pushes_done"] >= 1, 15)
    time.sleep(0.3)
    res = cons.results[c_id]
    assert res.error is None and res.tokens == Engine(cfg).generate(fresh, 4)[0]
    for (g, b), data in res.computed_pages.items():
        assert cons.page_bytes(g, c_slots[g][b]) == data, f"page {(g, b)} was overwritten"
    assert wait_for(lambda: psvc.leases.active() == 0, 10)
    assert csvc.health() == (True, "")


@pytest.mark.parametrize("fails", [False, True], ids=["lands", "fails"])
def test_a_cached_prefix_still_landing_is_awaited_never_served_half(monkeypatch, fails):
    """V1 with block reuse stores a cancelled request's blocks for reuse at once; the same
    prompt, sent again while the cancelled request's load is still held, reads those pages
    as its cached prefix. The consumer neither aborts the load (half a page would be
    served) nor lets the forward run before it lands: the pass waits for it, and the
    tokens are the monolithic ones. A load that fails there stops the instance (the page
    stays published for reuse), never a wrong token."""
    cfg = EngineConfig(**SHAPE, capture_pages=True, kv_manager="v1")
    ps = prompts(n=1, length=300)
    prod, psvc = make_producer(cfg)
    run(prod, ps, 1)
    # a push that fails on the producer ends the load at its timeout: 3 s there, 30x
    # what the pass takes to be waiting for the load
    load_timeout_s = 3.0 if fails else 10.0
    cons, csvc = make_consumer(cfg, [psvc.endpoint], load_timeout_s=load_timeout_s)
    started, go = hold_pushes(psvc)
    if fails:
        monkeypatch.setattr(psvc.data, "post_push", lambda *a, **k: (go.wait(30), 1 / 0))
    rid = cons.add_request(ps[0], 4)
    cons.step()
    assert fails or started.wait(10), "the push never started"
    cons.cancel(rid)
    again = cons.add_request(ps[0], 4)
    # the held push goes on only once the pass is waiting for it
    releaser = threading.Thread(
        target=lambda: (wait_for(lambda: csvc.metrics["loads_awaited"] >= 1, 15), go.set())
    )
    releaser.start()
    try:
        if fails:
            with pytest.raises(Exception, match="unrecoverable"):
                while cons.has_work():
                    cons.step()
            assert not cons.results[again].tokens
            return
        while cons.has_work():
            cons.step()
    finally:
        go.set()
        releaser.join()
    assert csvc.metrics["loads_awaited"] == 1 and csvc.metrics["loads_fenced"] == 0
    res = cons.results[again]
    assert res.device_matched_tokens > 0, "the cancelled request's blocks were not reused"
    assert res.error is None and res.tokens == Engine(cfg).generate(ps, 4)[0]
