"""A batch header's runs are checked as numbers before they are expanded into slots
(``ReceiverBook.accept_runs``). A peer holding a transfer's token (a buggy producer) once
could name ``2**40`` pages in one run: the tcp plane's connection thread died in a 8 TiB
allocation (the transfer waited for its deadline), and smaller forged counts would have
allocated gigabytes or, on the UCX plane, cut billions of segments in a Python loop.
Now each such header fails its transfer by name and the plane keeps serving."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
import torch

from disagg.protocol.messages import PageBatch, TransferDone, encode
from disagg.transport import TcpDataPlane, receiver, tcp
from disagg.transport.receiver import ReceiverBook

pytestmark = pytest.mark.timeout(60)


def _book(
    num_slots: int = 8, expected: int = 4, promised: list[int] | None = None
) -> tuple[ReceiverBook, receiver.Rx]:
    book = ReceiverBook(Counter())
    book.register([[torch.zeros((num_slots, 16), dtype=torch.uint8)]])
    slots = None if promised is None else [promised]
    return book, book.expect(1, 1, b"t", [expected], 10.0, slots)


def _batch(runs: list[tuple[int, int]], page_bytes: int = 16, tid: int = 1) -> PageBatch:
    return PageBatch(
        transfer_id=tid, lease_id=1, token=b"t", group=0, runs=runs, page_bytes=page_bytes
    )


@pytest.mark.parametrize(
    "runs, why",
    [
        ([(0, 2**40)], "addresses slots outside [0, 8)"),
        ([(2**62, 1)], "addresses slots outside [0, 8)"),
        ([(2**64 - 1, 1)], "malformed runs"),
        ([(0, 2**64 - 1)], "malformed runs"),
        ([(7, 2)], "addresses slots outside [0, 8)"),
        ([(0, 3), (4, 2)], "would receive 5 pages, 4 expected"),
        ([(0, 8)] * 1000, "would receive 8000 pages, 4 expected"),
    ],
)
def test_runs_refused_by_name_before_any_slot_is_expanded(monkeypatch, runs, why):
    def never(*a, **k):
        raise AssertionError("runs expanded before they were checked")

    monkeypatch.setattr(receiver, "runs_slots", never)
    book, rx = _book()
    got, slots, end = book.accept_runs(rx, _batch(runs))
    assert got is not None and why in got, got
    assert slots is None and end == 0
    assert rx.state.final and rx.error == got and rx.announced == [0]
    assert book.stats["rejected_batch"] == 1


def test_a_good_batch_hands_back_its_slots_once_checked():
    book, rx = _book(promised=[5, 6, 0, 1])
    why, slots, end = book.accept_runs(rx, _batch([(5, 2), (0, 1)]))
    assert why is None and end == 7
    assert slots is not None and slots.tolist() == [5, 6, 0]
    assert rx.announced == [3] and not rx.state.final
    why, slots, _ = book.accept_runs(rx, _batch([(5, 1)]))  # written already
    assert why is not None and slots is None and rx.state.final
    assert book.accept_runs(rx, _batch([(1, 1)]))[0] == "late"  # the transfer is over
    assert book.stats["rejected_late"] == 1


def test_a_wrong_page_size_or_group_is_named_first():
    book, rx = _book()
    why, _, _ = book.accept_runs(rx, _batch([(0, 2**40)], page_bytes=8))
    assert why == "group 0 pages are 16 bytes, batch says 8"
    book, rx = _book()
    forged = PageBatch(transfer_id=1, lease_id=1, token=b"t", group=3, runs=[(0, 1)], page_bytes=16)
    assert book.accept_batch(rx, forged) == "batch for layer group 3, but only 1 expected"


def test_tcp_plane_fails_a_forged_count_and_keeps_the_connection():
    """Before: the connection thread died in ``np.arange`` (8 TiB), the transfer stayed
    PENDING until its deadline and the stream was dropped."""
    rx = TcpDataPlane()
    pool = torch.zeros(8, 16, dtype=torch.uint8)
    rx.register_regions([[pool]])
    s = tcp.wire.StreamPush(rx.endpoint)
    try:
        rx.expect(40, 1, b"t", [1], 30.0)
        s.send_multipart([encode(_batch([(0, 2**40)], tid=40))])
        t0 = time.monotonic()
        st = rx.wait(40, 5.0)
        assert st.failed and "addresses slots outside [0, 8)" in st.error, st
        assert time.monotonic() - t0 < 2.0  # by name, not by its deadline
        rx.expect(41, 1, b"t", [1], 5.0)  # the same connection serves the next transfer
        s.send_multipart([encode(_batch([(1, 1)], tid=41)), b"z" * 16])
        s.send(encode(TransferDone(transfer_id=41, lease_id=1, token=b"t")))
        assert rx.wait(41, 5.0).done
        assert bytes(pool[1].numpy()) == b"z" * 16 and int(pool[0].sum()) == 0
    finally:
        s.close()
        rx.close()


def test_ucx_header_with_a_forged_count_fails_by_name_without_cutting_segments(monkeypatch):
    """The UCX plane checks a header's runs before it cuts them into segments (a
    2 MiB-page run of 2**40 pages was 2**40 iterations of ``segments``)."""
    pytest.importorskip("ucxx")
    from disagg.transport.ucx import receive
    from disagg.transport.ucx.plane import UcxDataPlane

    def never(*a, **k):
        raise AssertionError("segments cut before the runs were checked")

    plane = UcxDataPlane(channel="tcp")
    rx = plane._receiver
    try:
        plane.register_regions([[torch.zeros(8, 2 << 20, dtype=torch.uint8)]])
        plane.expect(50, 1, b"t", [2], 30.0)
        monkeypatch.setattr(receive, "segments", never)
        rx.rx_header(_batch([(0, 2**40)], page_bytes=2 << 20, tid=50))
        st = plane.poll(50)
        assert st.failed and "addresses slots outside [0, 8)" in st.error, st
        assert not rx.pending
        monkeypatch.undo()
        plane.expect(51, 1, b"t", [2], 30.0)  # a good header still queues its segments
        rx.rx_header(_batch([(3, 2)], page_bytes=2 << 20, tid=51))
        assert not plane.poll(51).final and rx.pending
        runs = [run for p in rx.pending.values() for run in p.seg.runs]
        assert sorted(runs) in ([(3, 1), (4, 1)], [(3, 2)])
    finally:
        plane.close()


def test_a_scattered_batch_of_one_page_runs_comes_back_in_page_order():
    """16384 one-page runs (scattered 64 KiB pages): accepted, slots in page order."""
    book, rx = _book(num_slots=32768, expected=16384)
    slots = np.random.default_rng(0).permutation(32768)[:16384]
    why, got, end = book.accept_runs(rx, _batch([(int(s), 1) for s in slots]))
    assert why is None and got is not None and np.array_equal(got, slots)
    assert end == int(slots.max()) + 1
