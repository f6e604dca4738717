"""The landing zone (disagg/consumer/zone.py): a prefetched lease's pages are pushed into
consumer-owned memory while the producer prefills, and the continuation's load completes
by a local copy into the engine's pages. In-process producer and consumer engines: pages
equal the producer's byte for byte, tokens the monolithic run's; a full zone falls back to
the push at the continuation; a producer that dies while the zone fills costs a miss and a
recompute; every zone slot is free again once its lease is gone."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from harness import (
    SHAPE,
    close_all_services,
    continue_after,
    hold_pushes,
    make_consumer,
    make_producer,
    random_prompt,
    run_one,
    wait_for,
)

from disagg.config import ConfigError, DisaggConfig
from disagg.engine.reference import Engine, EngineConfig
from disagg.metrics import DisaggCollector
from disagg.serve.app import start_prefetch

CFG = EngineConfig(**{**SHAPE, "num_blocks": 128, "capture_pages": True, "kv_manager": "v2"})
TPB = CFG.tokens_per_block
ZONE = "4MiB"
_needs_ucx = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"
)


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


@pytest.mark.parametrize(
    ("length", "landed", "transport"),
    [
        (96, True, None),
        (100, True, None),
        (96, False, None),
        (96, True, "ipc"),
        (96, False, "sync"),
        pytest.param(96, True, "ucx", marks=_needs_ucx),
    ],
    ids=["whole-blocks", "partial-block", "taken-at-once", "ipc", "sync-load", "ucx"],
)
def test_the_continuation_loads_from_the_zone(length: int, landed: bool, transport: str | None):
    mode = "sync" if transport == "sync" else "auto"  # sync: layer by layer, whole at layer 0
    transport = None if transport == "sync" else transport
    _round_trip(CFG, length, landed, transport, {}, {"load_mode": mode})


_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@_cuda
@pytest.mark.parametrize("zone_device", [None, "pinned"], ids=["device-zone", "pinned-zone"])
@pytest.mark.parametrize("transport", [None, "ipc"], ids=["tcp", "ipc"])
def test_cuda_pages_come_from_the_zone(zone_device: str | None, transport: str | None):
    """On a GPU (the lent device): a zone on the engine's GPU or in pinned host memory, a
    device store, the same checks."""
    cfg = EngineConfig(**{**CFG.__dict__, "device": "cuda"})
    placed = {} if zone_device is None else {"landing_zone_device": zone_device}
    _round_trip(cfg, 100, True, transport, {"store_device": "cuda"}, placed)


def _round_trip(
    cfg: EngineConfig,
    length: int,
    landed: bool,
    transport: str | None,
    producer: dict,
    consumer: dict,
) -> None:
    """Prefetch, prefill, continuation: the load comes from the zone (no push at the
    continuation), page for page the producer's bytes, the monolithic tokens."""
    prompt = random_prompt(11, length)
    mono = Engine(cfg).generate([prompt], max_tokens=6)[0]
    prod, psvc = make_producer(cfg, transport=transport, **producer)
    cons, csvc = make_consumer(
        cfg, [psvc.endpoint], transport=transport, landing_zone_size=ZONE, **consumer
    )
    zone = csvc.zone
    assert zone is not None and zone.free_slots == zone.capacity
    assert start_prefetch(csvc, prompt, None) is None  # told before the prefill ran
    produced = run_one(prod, prompt, 1)
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    assert csvc.metrics["zone_fills"] == 1
    (held,) = csvc.prefetches.leases()
    if landed:  # else taken while the push may still be under way
        assert wait_for(lambda: zone.state(held).done)
    got = continue_after(cons, prompt, produced.tokens[0], 6)
    assert got.error is None and [produced.tokens[0], *got.tokens] == mono
    assert csvc.metrics["prefetch_taken"] == 1 and csvc.metrics["zone_loads"] == 1
    assert csvc.metrics["claims_hit"] == 0, "the engine thread claimed despite the prefetch"
    assert wait_for(lambda: psvc.metrics["pushes_done"] == 1), "pushed again at the load"
    assert got.connector_matched_tokens == length // TPB * TPB
    assert got.loaded_pages, "no page loaded"
    for where, data in got.loaded_pages.items():  # page for page the producer's bytes
        assert data == produced.computed_pages[where], f"page {where} differs"
    assert csvc.metrics["zone_pages_copied"] == len(got.loaded_pages)
    assert wait_for(lambda: psvc.leases.active() == 0 and psvc.store.pinned_blocks() == 0)
    assert zone.free_slots == zone.capacity


def test_a_full_zone_falls_back_to_the_push_at_the_continuation():
    prompt = random_prompt(12)
    mono = Engine(CFG).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(CFG)
    block = psvc.pool.block_bytes  # the same shape on both sides
    cons, csvc = make_consumer(CFG, [psvc.endpoint], landing_zone_size=2 * block)
    assert csvc.zone.capacity == 2
    produced = run_one(prod, prompt, 1)
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    assert csvc.metrics["zone_full"] == 1 and csvc.metrics["zone_fills"] == 0
    got = continue_after(cons, prompt, produced.tokens[0], 4)
    assert got.error is None and [produced.tokens[0], *got.tokens] == mono
    assert csvc.metrics["prefetch_taken"] == 1 and csvc.metrics["zone_loads"] == 0
    for where, data in got.loaded_pages.items():
        assert data == produced.computed_pages[where], f"page {where} differs"


def test_a_producer_dying_while_the_zone_fills_costs_a_recompute(monkeypatch):
    """The lease is granted and the fill expected, but the producer dies before it sends a
    byte: taking the lease finds the fill unfinished and the producer gone, the fill is
    aborted and its slots freed, the fresh claim misses and the prompt is computed here."""
    prompt = random_prompt(13)
    mono = Engine(CFG).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(CFG)
    prod.generate([prompt], max_tokens=1)
    monkeypatch.setattr(psvc, "_start_push", lambda job, rows: None)  # never sends
    cons, csvc = make_consumer(
        CFG, [psvc.endpoint], claim_timeout_s=0.5, load_timeout_s=2.0, landing_zone_size=ZONE
    )
    zone = csvc.zone
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    assert csvc.metrics["zone_fills"] == 1 and zone.free_slots == zone.capacity - 6
    psvc.close()
    got = continue_after(cons, prompt, mono[0], 4)
    assert got.error is None and [mono[0], *got.tokens] == mono
    assert csvc.metrics["prefetch_dropped_down"] == 1 and csvc.metrics["zone_loads"] == 0
    assert got.connector_matched_tokens == 0  # computed here
    assert zone.free_slots == zone.capacity


def test_a_fill_that_landed_outlives_its_producer():
    """The pages are in the zone when the producer dies: the continuation needs nothing of
    it (no confirmation), and loads them: the monolithic tokens, the producer's bytes."""
    prompt = random_prompt(14)
    mono = Engine(CFG).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(CFG)
    produced = run_one(prod, prompt, 1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint], landing_zone_size=ZONE)
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    (held,) = csvc.prefetches.leases()
    assert wait_for(lambda: csvc.zone.state(held).done)
    psvc.close()
    got = continue_after(cons, prompt, produced.tokens[0], 4)
    assert got.error is None and [produced.tokens[0], *got.tokens] == mono
    assert csvc.metrics["zone_loads"] == 1 and got.connector_matched_tokens == 96
    for where, data in got.loaded_pages.items():
        assert data == produced.computed_pages[where], f"page {where} differs"


def test_a_cancelled_load_whose_pages_are_reused_never_copies():
    """The continuation's load waits for a fill held on the producer; the request is
    cancelled and its pages (freed at once) go to a fresh request: the load is fenced
    (ABANDONED, its fill aborted) before that request runs, the fill's push released
    afterwards lands nothing, nothing is copied, and the fresh request's tokens and pages
    are its own. Every zone slot is free again."""
    cfg = EngineConfig(**{**SHAPE, "num_blocks": 24, "capture_pages": True, "kv_manager": "v1"})
    prompt, fresh = (
        random_prompt(16, 300),
        random_prompt(17, 300),
    )  # 24 blocks: the pages are reused
    mono = Engine(cfg).generate([fresh], max_tokens=4)[0]
    prod, psvc = make_producer(cfg)
    first = prod.generate([prompt], max_tokens=1)[0][0]
    cons, csvc = make_consumer(cfg, [psvc.endpoint], landing_zone_size=ZONE)
    zone = csvc.zone
    started, go = hold_pushes(psvc)
    try:
        assert start_prefetch(csvc, prompt, None) is None
        assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1) and started.wait(10)
        rid = cons.add_request(prompt + [first], 3)
        cons.step()  # the lease taken, pages allocated, parked on the fill
        load = csvc.loads[rid]
        assert load.claimed.zone is not None and load.state.name == "DISPATCHED"
        cons.cancel(rid)
        f_id = cons.add_request(fresh, 4)
        f_slots: list[list[int]] = []
        while cons.has_work():
            cons.step()
            if not cons.results[f_id].finished:
                f_slots = cons.request_pages(f_id)
        assert csvc.metrics["loads_fenced"] == 1 and load.state.name == "ABANDONED"
    finally:
        go.set()
    assert wait_for(lambda: psvc.metrics["pushes_failed"] + psvc.metrics["pushes_done"] >= 1, 15)
    res = cons.results[f_id]
    assert res.error is None and res.tokens == mono
    for (g, b), data in res.computed_pages.items():
        assert cons.page_bytes(g, f_slots[g][b]) == data, f"page {(g, b)} was overwritten"
    assert csvc.metrics["zone_loads"] == 0 and csvc.metrics["zone_pages_copied"] == 0
    assert zone.free_slots == zone.capacity
    assert wait_for(lambda: psvc.leases.active() == 0, 10)
    assert csvc.health() == (True, "")
    scraped = {
        (s.labels["instance"], s.labels["of"]): s.value
        for fam in DisaggCollector().collect()
        if fam.name == "disagg_consumer_zone_free_slots"
        for s in fam.samples
    }
    inst = str(csvc.config.instance_id)
    assert scraped[(inst, str(zone.capacity))] == zone.capacity


def test_a_fill_no_continuation_takes_is_aborted_and_freed(monkeypatch):
    from disagg.consumer import prefetch

    monkeypatch.setattr(prefetch, "PREFETCH_HOLD_S", 0.3)
    prompt = random_prompt(15)
    prod, psvc = make_producer(CFG)
    monkeypatch.setattr(psvc, "_start_push", lambda job, rows: None)  # the fill never lands
    prod.generate([prompt], max_tokens=1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint], heartbeat_s=0.1, landing_zone_size=ZONE)
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["zone_fills"] == 1)
    assert csvc.zone.free_slots == csvc.zone.capacity - 6
    assert wait_for(lambda: csvc.metrics["prefetch_expired"] == 1, timeout=5)
    assert csvc.zone.free_slots == csvc.zone.capacity


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"landing_zone_device": "cpu"}, "consumer.landing_zone_device"),
        ({"landing_zone_size": "lots"}, "consumer.landing_zone_size"),
        ({"landing_zone_size": 0}, "consumer.landing_zone_size"),
        ({"landing_zone_size": "1GiB", "landing_zone_device": "gpu"}, "landing_zone_device"),
    ],
)
def test_bad_zone_settings_name_the_field(section: dict, field: str):
    conf = {"role": "consumer", "consumer": {"producers": ["tcp://127.0.0.1:5557"], **section}}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        DisaggConfig.from_dict(conf)


def test_a_zone_smaller_than_a_block_is_refused_naming_the_field():
    prod, psvc = make_producer(CFG)
    with pytest.raises(ConfigError, match=r"consumer\.landing_zone_size"):
        make_consumer(CFG, [psvc.endpoint], landing_zone_size=1024)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_a_zone_on_a_gpu_that_is_not_there_is_refused_naming_the_field():
    prod, psvc = make_producer(CFG)
    with pytest.raises(ConfigError, match=r"consumer\.landing_zone_device"):
        make_consumer(CFG, [psvc.endpoint], landing_zone_size=ZONE, landing_zone_device="cuda")
