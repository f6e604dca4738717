"""A producer that dies or stalls while a consumer reads its store over ``transport:
nixl``, under both values of ``nixl_error_handling``, with the producer in a process of
its own (the contract test's style: zeroed pools, random sources, ``check_landed``).

- Killed between two reads of one transfer (host memory; device memory where CUDA is
  present): the reads that meet the dead process fail, so the transfer ends FAILED by
  name long before its deadline; what landed is a prefix of the transfer, byte for byte;
  nothing lands after ``abort``; the plane stays healthy and reads a whole transfer from
  the next producer. Under ``none`` too: NIXL's UCX reports the failed cma copy (or the
  closed socket) as a disconnect instead of aborting the process.
- Stalled (SIGSTOP, over UCX's tcp: a silent peer, as a dead host without error
  handling looks): its transfer ends FAILED at its deadline, ``abort`` returns the reads
  still under way (the plane's ``abort_complete = False``), and another producer's
  transfer lands meanwhile: a stalled producer holds its own read window, never
  another's. Its reads end once its connection does.

Skipped without NIXL."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch
from test_transport_dataplane import check_landed, rand

from disagg.transport.dataplane import push_source

pytest.importorskip("disagg.transport.nixl.plane", reason="NIXL is not installed (disagg[nixl])")
from disagg.transport.nixl import reads  # noqa: E402
from disagg.transport.nixl.plane import NixlDataPlane  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(90)]
W = 64 << 10  # bytes per page
ROWS = 64  # pages per producer's store: 4 MiB, read in 1 MiB chunks below
DEVICES = [
    pytest.param("cpu", id="host"),
    pytest.param(
        "cuda",
        id="device",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]


def _producer(mode: str, tls: str | None, device: str, seed: int, q_in: Any, q_out: Any) -> None:
    """A producer's plane over a store of ROWS random pages: push what the test asks for
    (rows, slots, transfer id), then wait there to be killed or stopped."""
    tx = NixlDataPlane(error_handling=mode, transports=tls)
    slab = tx.register_source(rand(ROWS, W, seed).to(device))
    q_out.put(tx.source_caps)
    endpoint, caps, tid, rows, slots = q_in.get(timeout=60)
    pages, dst = push_source(tx, slab, rows, ((0, W),), slots)
    tx.post_push(endpoint, tid, 7, b"tok", [(0, pages, dst)], 30.0, caps=caps)
    time.sleep(120)


@pytest.fixture(scope="module")
def children() -> Any:
    """Producer processes forked from one server that has imported torch and the plane."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "disagg.transport.nixl.plane", __name__])
    return ctx


class Producer:
    def __init__(self, ctx: Any, mode: str, tls: str | None, device: str, seed: int) -> None:
        self.seed = seed
        self.q_in, self.q_out = ctx.Queue(), ctx.Queue()
        args = (mode, tls, device, seed, self.q_in, self.q_out)
        self.proc = ctx.Process(target=_producer, args=args, daemon=True)
        self.proc.start()
        self.caps = self.q_out.get(timeout=60)

    def push(self, rx: NixlDataPlane, tid: int, rows: list[int], slots: list[int]) -> None:
        rx.add_source(self.caps)  # the handshake (the producer's HelloOk)
        self.q_in.put((rx.endpoint, rx.capabilities, tid, rows, slots))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def source(self, rows: list[int]) -> torch.Tensor:
        return rand(ROWS, W, self.seed)[torch.tensor(rows)]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 MiB chunks: a producer's store is read as four, so a kill can fall between."""
    monkeypatch.setattr(reads, "HOST_CHUNK", 1 << 20)
    monkeypatch.setattr(reads, "DEVICE_CHUNK", 1 << 20)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["peer", "none"])
def test_a_producer_killed_between_two_reads_fails_the_transfer_by_name(
    children, small_chunks, mode, device
):
    rx = NixlDataPlane(error_handling=mode)
    a = b = None
    try:
        pool = torch.zeros((2 * ROWS, W), dtype=torch.uint8, device=device)
        rx.register_regions([[pool]])
        a = Producer(children, mode, None, device, seed=1)
        post, posts = rx._reader._post, []

        def kill_after_the_first_read(ch):
            if posts:  # the first chunk is read; the others meet a dead process
                a.kill()
            posts.append(ch)
            post(ch)

        rx._reader._post = kill_after_the_first_read
        deadline_s = 20.0
        rows, slots = list(range(ROWS)), list(range(ROWS))
        rx.expect(1, 7, b"tok", [ROWS], deadline_s, [slots])
        t0 = time.monotonic()
        a.push(rx, 1, rows, slots)
        st = rx.wait(1, deadline_s + 5.0)
        took = time.monotonic() - t0
        assert st.failed and "NIXL read from" in (st.error or ""), st
        assert took < deadline_s / 2, f"the transfer ended after {took:.1f} s"
        assert a.proc.exitcode == -signal.SIGKILL and len(posts) > 1
        assert st.pages < ROWS
        landed = pool.cpu()
        check_landed(landed, a.source(rows[: st.pages]), slots[: st.pages])  # a prefix
        assert rx.abort(1, "producer gone") == 0
        time.sleep(0.3)
        assert torch.equal(pool.cpu(), landed), "bytes landed after abort"
        assert rx.health() == (True, "")
        # the plane goes on: the next producer's transfer lands whole
        rx._reader._post = post
        b = Producer(children, mode, None, device, seed=2)
        more = list(range(ROWS, 2 * ROWS))
        rx.expect(2, 7, b"tok", [ROWS], deadline_s, [more])
        b.push(rx, 2, rows, more)
        assert rx.wait(2, deadline_s).done, rx.poll(2)
        check_landed(pool.cpu()[ROWS:], b.source(rows), rows)
    finally:
        for p in (a, b):
            if p is not None:
                p.kill()
        rx.close()


def test_a_stalled_producer_holds_only_its_own_reads(children, small_chunks):
    """Over UCX's tcp a read needs the producer's progress: stopped, it answers nothing,
    like a host gone without a word when UCX runs without error handling."""
    rx = NixlDataPlane(error_handling="none", transports="tcp,self")
    rx.abort_wait_s = 0.5
    a = b = None
    try:
        pool = torch.zeros((2 * ROWS, W), dtype=torch.uint8)
        rx.register_regions([[pool]])
        a = Producer(children, "none", "tcp,self", "cpu", seed=3)
        b = Producer(children, "none", "tcp,self", "cpu", seed=4)
        post = rx._reader._post

        def stop_at_the_first_read(ch):
            if a.proc.pid is not None and ch.rx.transfer_id == 1:
                os.kill(a.proc.pid, signal.SIGSTOP)
            post(ch)

        rx._reader._post = stop_at_the_first_read
        rows = list(range(ROWS))
        rx.expect(1, 7, b"tok", [ROWS], 1.0, [rows])
        t0 = time.monotonic()
        a.push(rx, 1, rows, rows)
        st = rx.wait(1, 10.0)
        assert st.failed and "deadline" in (st.error or ""), st
        assert time.monotonic() - t0 < 1.0 + 2.0
        assert st.pages == 0 and rx.abort(1, "cancelled") > 0  # its reads are under way
        more = list(range(ROWS, 2 * ROWS))
        rx.expect(2, 7, b"tok", [ROWS], 20.0, [more])
        b.push(rx, 2, rows, more)
        assert rx.wait(2, 20.0).done, rx.poll(2)
        check_landed(pool[ROWS:], b.source(rows), rows)
        a.kill()  # its connection closes: the reads under way end, nothing of them lands
        t1 = time.monotonic()
        while rx.abort(1, "cancelled") and time.monotonic() - t1 < 10.0:
            pass
        assert rx.abort(1, "cancelled") == 0
        assert not pool[:ROWS].any()
        assert rx.health() == (True, "")
    finally:
        for p in (a, b):
            if p is not None:
                p.kill()
        rx.close()
