"""What the nixl plane adds to the DataPlane contract (test_plane_contract.py runs that
on it): producer and consumer reference engines over ``transport: nixl`` (tokens equal a
monolithic run, pages equal byte for byte), descriptor lists prepared once and runs
posted as one descriptor, the handshake's metadata, the plan's checks, a producer's
failure report, and an abort that waits for the reads in flight. Skipped without NIXL."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import torch
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
from disagg.transport.dataplane import push_source

pytest.importorskip("disagg.transport.nixl.plane", reason="NIXL is not installed (disagg[nixl])")
from disagg.transport.nixl import reads, wire  # noqa: E402
from disagg.transport.nixl.plane import NixlDataPlane  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]
W = 4096


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


@pytest.fixture
def pair():
    rx, tx = NixlDataPlane(telemetry=True), NixlDataPlane()
    yield rx, tx
    rx.close()
    tx.close()


def _setup(rx, tx, slots=64, rows=64, seed=0):
    pool = torch.zeros((slots, W), dtype=torch.uint8)
    rx.register_regions([[pool]])
    g = torch.Generator().manual_seed(seed)
    slab = tx.register_source(torch.randint(0, 256, (rows, W), dtype=torch.uint8, generator=g))
    rx.add_source(tx.source_caps)
    return pool, slab


def _push(tx, rx, tid, slab, rows, slots, token=b"tok", deadline_s=20.0):
    pages, dst = push_source(tx, slab, rows, ((0, W),), slots)
    return tx.post_push(rx.endpoint, tid, 7, token, [(0, pages, dst)], deadline_s, rx.capabilities)


def test_nixl_tokens_and_pages_match_monolithic():
    cfg = EngineConfig(**SHAPE, capture_pages=True)
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=6)
    prod, psvc = make_producer(cfg, transport="nixl")
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], transport="nixl")
    consumed = run(cons, ps, max_tokens=6)
    assert type(psvc.data).__name__ == type(csvc.data).__name__ == "NixlDataPlane"
    assert csvc.data.endpoint.startswith("nixl://")
    check_against_monolithic(produced, consumed, mono)
    assert csvc.metrics["pages_loaded"] > 0
    # the producer's metadata came in its HelloOk; pages were read, never pushed
    assert csvc.data.stats["nixl_sources"] == 1 and csvc.data.stats["nixl_reads"] > 0
    assert wait_for(lambda: psvc.metrics["pages_pushed"] > 0)
    assert wait_for(lambda: psvc.leases.active() == 0)


def test_lists_are_prepared_once_and_a_run_is_one_descriptor(pair):
    rx, tx = pair
    pool, slab = _setup(rx, tx)
    rx.expect(1, 7, b"tok", [16], 20.0, [list(range(8, 24))])
    h = _push(tx, rx, 1, slab, list(range(30, 46)), list(range(8, 24)))
    assert rx.wait(1, 20.0).done and tx.wait_push(h, 20.0).done
    assert rx.stats["nixl_descs"] == 1  # 16 consecutive rows into 16 consecutive slots
    rx.expect(2, 7, b"tok", [3], 20.0, [[0, 2, 4]])
    h = _push(tx, rx, 2, slab, [1, 2, 3], [0, 2, 4])
    assert rx.wait(2, 20.0).done and tx.wait_push(h, 20.0).done
    assert rx.stats["nixl_descs"] == 1 + 3
    assert rx.stats["nixl_local_lists"] == rx.stats["nixl_remote_lists"] == 1
    assert torch.equal(pool[8:24], slab[30:46])
    assert torch.equal(pool[[0, 2, 4]], slab[[1, 2, 3]])
    # closing releases them explicitly (before its memory is deregistered), not the collector
    prepared = [h for h, _ in rx._reader._local.values()] + list(rx._reader._remote.values())
    rx.close()
    assert len(prepared) == 2 and all(h._released for h in prepared)
    assert not rx._reader._local and not rx._reader._remote


def test_a_waiter_is_woken_when_the_transfer_ends_not_at_each_chunk(pair, monkeypatch):
    """``wait`` and ``abort`` wait for a transfer's end: a wake-up per chunk landed would be
    a thread woken beside the copies all through a transfer."""
    rx, tx = pair
    monkeypatch.setattr(reads, "HOST_CHUNK", 2 * W)  # 2 pages a chunk: 16 chunks
    pool, slab = _setup(rx, tx)
    book = rx._book
    wakes = []
    notify = book.cond.notify_all

    def counted() -> None:
        rx1 = book.rx.get(1)
        if rx1 is not None and not rx1.state.final:
            wakes.append(sys._getframe(1).f_code.co_name)
        notify()

    monkeypatch.setattr(book.cond, "notify_all", counted)
    rx.expect(1, 7, b"tok", [32], 20.0, [list(range(0, 64, 2))])
    h = _push(tx, rx, 1, slab, list(range(32)), list(range(0, 64, 2)))
    assert rx.wait(1, 20.0).done and tx.wait_push(h, 20.0).done
    assert rx.stats["nixl_reads"] == 16
    assert torch.equal(pool[0:64:2], slab[0:32])
    # the plan's arrival and the deadline sweeps notify; a chunk read or landed does not
    assert not {"_reap", "_land"} & set(wakes), wakes


def test_without_peer_error_handling_pages_still_land_byte_for_byte():
    """``nixl_error_handling: none`` lets UCX pick shared memory (and cuda_ipc on a GPU)."""
    rx, tx = NixlDataPlane(error_handling="none"), NixlDataPlane(error_handling="none")
    try:
        pool, slab = _setup(rx, tx, seed=3)
        rx.expect(1, 7, b"tok", [5], 20.0, [[9, 3, 40, 41, 42]])
        h = _push(tx, rx, 1, slab, [0, 17, 5, 6, 7], [9, 3, 40, 41, 42])
        assert rx.wait(1, 20.0).done and tx.wait_push(h, 20.0).done
        assert torch.equal(pool[[9, 3, 40, 41, 42]], slab[[0, 17, 5, 6, 7]])
    finally:
        rx.close()
        tx.close()
    with pytest.raises(ValueError, match="peer or none"):
        NixlDataPlane(error_handling="off")


def test_the_handshake_metadata_exposes_no_consumer_memory(pair):
    """The consumer's metadata (Hello, Push) is connection information only: a producer
    loading it can reach no byte of the consumer. The producer's carries its store."""
    rx, tx = pair
    _setup(rx, tx)
    assert len(rx.capabilities.nixl) < len(tx.source_caps.nixl)
    assert rx.capabilities.nixl == rx.capabilities.nixl  # stable
    ok = m.HelloOk(instance_id="p", fingerprint=_fp(), data_caps=tx.source_caps)
    assert m.decode(m.encode(ok)).data_caps.nixl == tx.source_caps.nixl
    with pytest.raises(ValueError, match="no NIXL metadata"):
        rx.add_source(m.DataCaps())


def _fp():
    from disagg.protocol.fingerprint import Fingerprint

    return Fingerprint(model="m", dtype="bf16", tokens_per_block=4, groups=[])


def test_a_plan_from_a_producer_never_greeted_fails_the_transfer():
    rx, tx = NixlDataPlane(), NixlDataPlane()
    try:
        pool = torch.zeros((8, W), dtype=torch.uint8)
        rx.register_regions([[pool]])
        slab = tx.register_source(torch.ones((8, W), dtype=torch.uint8))
        rx.expect(1, 7, b"tok", [2], 20.0, [[0, 1]])  # no add_source: no HelloOk seen
        h = _push(tx, rx, 1, slab, [0, 1], [0, 1], deadline_s=2.0)
        st = rx.wait(1, 20.0)
        assert st.failed and "sent no NIXL metadata" in st.error, st
        assert not pool.any()
        # the consumer cannot answer an agent it never loaded: the push ends at its deadline
        assert tx.wait_push(h, 5.0).failed
    finally:
        rx.close()
        tx.close()


def test_a_producer_that_gives_up_fails_the_transfer_at_once(pair):
    rx, tx = pair
    pool, slab = _setup(rx, tx)
    tx.post_push(rx.endpoint, 9, 7, b"tok", [], 20.0, rx.capabilities)  # say hello
    rx.expect(3, 7, b"tok", [2], 30.0, [[0, 1]])
    t0 = time.monotonic()
    tx.post_failure(rx.endpoint, 3, b"tok", "store row went bad")
    st = rx.wait(3, 10.0)
    assert st.failed and "store row went bad" in st.error, st
    assert time.monotonic() - t0 < 5.0
    tx.post_failure(rx.endpoint, 3, b"forged", "x")  # a wrong token is ignored


def test_plans_are_checked_before_any_read(pair):
    """Source rows past the producer's slab fail the transfer by name; nothing lands."""
    rx, tx = pair
    pool, slab = _setup(rx, tx, rows=8)
    plan = wire.ReadPlan(
        transfer_id=5, lease_id=7, token=b"tok", part=0, last=True, deadline_ms=10_000,
        slab=wire.Slab(slab.data_ptr(), W, W, 8, "DRAM", 0),
        batches=[wire.Batch(0, W, [(0, W)], wire.int64_bytes(np.array([7, 8])),
                            wire.int64_bytes(np.array([2, 3])))],
    )  # fmt: skip
    rx.expect(5, 7, b"tok", [2], 20.0, [[2, 3]])
    rx._reader.on_plan(tx.name, plan)
    st = rx.poll(5)
    assert st.failed and "outside the producer's 8" in st.error, st
    assert not pool[2:4].any()


def test_the_plan_deadline_bounds_the_consumer(pair):
    """The producer reuses its rows after its deadline: the consumer counts no read that
    ends later (its transfer's deadline becomes the plan's, less a margin)."""
    rx, tx = pair
    pool, slab = _setup(rx, tx)
    rx.expect(6, 7, b"tok", [2], 60.0, [[0, 1]])
    plan = wire.ReadPlan(
        transfer_id=6, lease_id=7, token=b"tok", part=0, last=False, deadline_ms=1000,
        slab=wire.Slab(slab.data_ptr(), W, W, 64, "DRAM", 0), batches=[],
    )  # fmt: skip
    t0 = time.monotonic()
    rx._reader.on_plan(tx.name, plan)
    st = rx.wait(6, 10.0)
    assert st.failed and "deadline" in st.error, st
    assert time.monotonic() - t0 < 1.0 + 0.5


def test_abort_waits_for_the_reads_in_flight():
    """An abort while chunks are read returns 0 once they ended, and no byte lands
    afterwards; the producer hears the transfer ended (its push FAILED, rows free)."""
    n, width = 4096, 64 << 10  # 256 MiB: 32 chunks
    rx, tx = NixlDataPlane(transports="tcp,self"), NixlDataPlane(transports="tcp,self")
    try:
        pool = torch.zeros((n, width), dtype=torch.uint8)
        rx.register_regions([[pool]])
        slab = tx.register_source(torch.full((n, width), 3, dtype=torch.uint8))
        rx.add_source(tx.source_caps)
        slots = list(range(n))
        rx.expect(7, 7, b"tok", [n], 60.0, [slots])
        pages, dst = push_source(tx, slab, slots, ((0, width),), slots)
        h = tx.post_push(rx.endpoint, 7, 7, b"tok", [(0, pages, dst)], 60.0, rx.capabilities)
        assert wait_for(lambda: rx.poll(7).pages > 0, 30.0), rx.poll(7)
        assert rx.abort(7, "request cancelled") == 0
        after = pool.clone()
        time.sleep(0.3)
        assert torch.equal(pool, after), "bytes landed after abort"
        assert rx.poll(7).pages < n
        st = tx.wait_push(h, 10.0)
        assert st.failed and "request cancelled" in st.error, st
    finally:
        rx.close()
        tx.close()


def test_abort_cannot_be_promised():
    assert NixlDataPlane.abort_complete is False
    from disagg.transport.tcp import TcpDataPlane

    assert TcpDataPlane.abort_complete is True


def test_a_push_leaves_in_post_push_not_at_the_plane_threads_wake(pair, monkeypatch):
    """post_push sends its plan itself: waiting for the plane's thread to wake would add
    a wake-up to every transfer's start. The thread still ends the push on its answer."""
    rx, tx = pair
    pool, slab = _setup(rx, tx)
    rx.expect(1, 7, b"tok", [4], 20.0, [[3, 4, 5, 6]])
    monkeypatch.setattr(tx._wake, "set", lambda: None)  # the thread stays asleep
    sent = tx.stats["nixl_plans"]
    h = _push(tx, rx, 1, slab, [9, 10, 11, 12], [3, 4, 5, 6])
    assert tx.stats["nixl_plans"] == sent + 1
    assert rx.wait(1, 20.0).done
    assert torch.equal(pool[3:7], slab[9:13])
    assert tx.wait_push(h, 20.0).done  # the thread's own naps notice the answer


def test_pieces_split_a_page_where_either_side_breaks():
    # two regions of 3 and 5 bytes; the source row's columns (10, 4) and (20, 4)
    assert reads.pieces((3, 5), ((10, 4), (20, 4))) == (
        (0, 0, 10, 3),
        (1, 0, 13, 1),
        (1, 1, 20, 4),
    )
    assert reads.pieces((8,), ((0, 8),)) == ((0, 0, 0, 8),)


def test_a_layer_wise_push_lands_layer_by_layer(pair):
    """Groups of one push land in the order they were sent (a layer-wise load waits for
    layer i alone): the landed page count never covers a later group first."""
    rx, tx = pair
    width = 64 << 10
    pools = [torch.zeros((64, width), dtype=torch.uint8) for _ in range(4)]
    rx.register_regions([[p] for p in pools])
    slab = tx.register_source(torch.full((64, 4 * width), 1, dtype=torch.uint8))
    rx.add_source(tx.source_caps)
    slots = list(range(64))
    rx.expect(8, 7, b"tok", [64] * 4, 20.0, [slots] * 4)
    pages = [(g, *push_source(tx, slab, slots, ((g * width, width),), slots)) for g in range(4)]
    wrong = []
    stop = threading.Event()

    def watch():  # every group the count covers has all its bytes
        while not stop.is_set():
            landed = rx.poll(8).pages
            if not all(bool((pools[g] == 1).all()) for g in range(landed // 64)):
                wrong.append(landed)

    t = threading.Thread(target=watch)
    t.start()
    h = tx.post_push(rx.endpoint, 8, 7, b"tok", pages, 20.0, rx.capabilities)
    assert rx.wait(8, 20.0).done and tx.wait_push(h, 20.0).done
    stop.set()
    t.join()
    assert not wrong, f"page counts {wrong} covered groups still being read"
    for p in pools:
        assert bool((p == 1).all())
