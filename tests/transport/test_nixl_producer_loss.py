"""A producer that dies or stalls while a consumer reads its store over ``transport:
nixl``, under both values of ``nixl_error_handling``, with the producer in a process of
its own (the contract test's style: zeroed pools, random sources, ``check_landed``).

- Killed between two reads of one transfer (host memory over what UCX picks, cma here,
  and over tcp; device memory where CUDA is present): the reads that meet the dead
  process fail, so the transfer ends FAILED by name long before its deadline; what
  landed is a prefix of the transfer, byte for byte; nothing lands after ``abort``; the
  plane stays healthy and reads a whole transfer from the next producer. Under ``none``
  too: NIXL's UCX reports the failed cma copy as a disconnect instead of aborting the
  process.
- Disconnected with reads in flight that NIXL never completes (what UCX without error
  handling does with some reads to a producer killed over tcp; NIXL's agent made to
  report it so): the plane's probe drops the producer's agent, which ends them.
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
_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
# (nixl_error_handling, UCX's transports: None lets UCX pick (cma here), memory); peer on
# host memory: the contract test's sender kill and tests/chaos/test_nixl_peer_death.py
CASES = [
    pytest.param("none", None, "cpu", id="none-host"),
    pytest.param("none", "tcp,self", "cpu", id="none-tcp-host"),
    pytest.param("peer", None, "cuda", id="peer-device", marks=_no_cuda),
    pytest.param("none", None, "cuda", id="none-device", marks=_no_cuda),
]


def _producer(
    mode: str, tls: str | None, device: str, seed: int, rows: int, q_in: Any, q_out: Any
) -> None:
    """A producer's plane over a store of ``rows`` random pages: push what the test asks
    for (rows, slots, transfer id), then wait there to be killed or stopped."""
    tx = NixlDataPlane(error_handling=mode, transports=tls)
    slab = tx.register_source(rand(rows, W, seed).to(device))
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
    def __init__(
        self, ctx: Any, mode: str, tls: str | None, device: str, seed: int, rows: int = ROWS
    ) -> None:
        self.seed, self.rows = seed, rows
        self.q_in, self.q_out = ctx.Queue(), ctx.Queue()
        args = (mode, tls, device, seed, rows, self.q_in, self.q_out)
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
        return rand(self.rows, W, self.seed)[torch.tensor(rows)]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 MiB chunks: a producer's store is read as four, so a kill can fall between."""
    monkeypatch.setattr(reads, "HOST_CHUNK", 1 << 20)
    monkeypatch.setattr(reads, "DEVICE_CHUNK", 1 << 20)


@pytest.mark.parametrize(("mode", "tls", "device"), CASES)
def test_a_producer_killed_between_two_reads_fails_the_transfer_by_name(
    children, small_chunks, mode, tls, device
):
    rx = NixlDataPlane(error_handling=mode, transports=tls)
    a = b = None
    try:
        pool = torch.zeros((2 * ROWS, W), dtype=torch.uint8, device=device)
        rx.register_regions([[pool]])
        a = Producer(children, mode, tls, device, seed=1)
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
        # a read cut short leaves part of a page: every byte is its page's or still zero
        want = a.source(rows)
        assert bool(((landed[:ROWS] == want) | (landed[:ROWS] == 0)).all())
        assert not landed[ROWS:].any()
        if st.pages:  # the pages counted are a prefix of the transfer, whole
            check_landed(landed[: st.pages], a.source(rows[: st.pages]), slots[: st.pages])
        assert rx.abort(1, "producer gone") == 0
        time.sleep(0.3)
        assert torch.equal(pool.cpu(), landed), "bytes landed after abort"
        assert rx.health() == (True, "")
        # the plane goes on: the next producer's transfer lands whole
        rx._reader._post = post
        b = Producer(children, mode, tls, device, seed=2)
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


class SilentAfterDisconnect:
    """NIXL's agent as UCX without peer error handling leaves it after a producer died
    over tcp (measured: 6 of 8 kills at random points of a 256 MiB read, with reads
    never completed): reads stay in flight, a notification to the producer fails as
    disconnected, and only dropping the producer's agent ends its reads."""

    def __init__(self, agent: Any, producer: str) -> None:
        self.agent, self.producer, self.removed = agent, producer, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)

    def transfer(self, xfer: Any) -> str:
        self.agent.transfer(xfer)
        return "PROC"

    def check_xfer_state(self, xfer: Any) -> str:
        if self.removed:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT: remote agent invalidated")
        return "PROC"

    def send_notif(self, name: str, data: bytes) -> None:
        if name == self.producer:
            raise RuntimeError("nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT")
        self.agent.send_notif(name, data)

    def remove_remote_agent(self, name: str) -> None:
        self.removed = name == self.producer
        self.agent.remove_remote_agent(name)


def test_a_disconnected_producer_is_dropped_and_its_reads_end():
    """The plane probes a producer whose reads stopped moving; NIXL saying it is
    disconnected drops its agent, which ends the reads: the transfer fails by name,
    ``abort`` returns 0, a plan from it fails until it greets again."""
    rx, tx = NixlDataPlane(), NixlDataPlane()
    try:
        pool = torch.zeros((ROWS, W), dtype=torch.uint8)
        rx.register_regions([[pool]])
        slab = tx.register_source(rand(ROWS, W, 5))
        rx.add_source(tx.source_caps)
        real = rx._reader.agent
        rx._reader.agent = SilentAfterDisconnect(real, tx.name)
        rows = list(range(8))
        rx.expect(1, 7, b"tok", [8], 20.0, [rows])
        pages, dst = push_source(tx, slab, rows, ((0, W),), rows)
        tx.post_push(rx.endpoint, 1, 7, b"tok", [(0, pages, dst)], 20.0, rx.capabilities)
        t0 = time.monotonic()
        st = rx.wait(1, 20.0)
        assert st.failed and "NIXL read from" in (st.error or ""), st
        assert time.monotonic() - t0 < 5.0
        assert rx.abort(1, "gone") == 0
        assert rx.stats["nixl_sources_dropped"] == 1 and tx.name not in rx._reader.sources
        rx._reader.agent = real
        rx.expect(2, 7, b"tok", [8], 20.0, [rows])
        tx.post_push(rx.endpoint, 2, 7, b"tok", [(0, pages, dst)], 2.0, rx.capabilities)
        st = rx.wait(2, 20.0)
        assert st.failed and "sent no NIXL metadata" in (st.error or ""), st
        rx.add_source(tx.source_caps)  # it greets again
        pool.zero_()
        rx.expect(3, 7, b"tok", [8], 20.0, [rows])
        tx.post_push(rx.endpoint, 3, 7, b"tok", [(0, pages, dst)], 20.0, rx.capabilities)
        assert rx.wait(3, 20.0).done, rx.poll(3)
        check_landed(pool, slab[:8], rows)
    finally:
        rx.close()
        tx.close()


def _until_stopped(pid: int, timeout: float = 2.0) -> None:
    """Wait until ``pid`` is stopped (state T in /proc), so it serves no read after."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")


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
                _until_stopped(a.proc.pid)  # the signal lands asynchronously
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
