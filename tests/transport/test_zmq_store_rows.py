"""ZmqDataPlane sender paths: StoreRows sent zero-copy or gathered into staging buffers
(never reused while libzmq holds them), and the optional payload checksum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from disagg.protocol import PageBatch, TransferDone, encode
from disagg.transport import ZmqDataPlane, zmq_plane
from disagg.transport.dataplane import StoreRows, push_source
from disagg.transport.factory import make_data_plane


@pytest.fixture
def planes():
    rx, tx = ZmqDataPlane(), ZmqDataPlane()
    yield rx, tx
    rx.close()
    tx.close()


def slab_of(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=g)


def expected_pages(slab, rows, cols):
    return torch.cat([slab[torch.as_tensor(rows), o : o + n] for o, n in cols], dim=1)


@pytest.mark.parametrize("mode", ["zero_copy", "gather"])
@pytest.mark.parametrize(
    "cols",
    [((0, 96),), ((16, 48),), ((0, 16), (40, 24), (80, 16))],
    ids=["whole_row", "one_column", "three_columns"],
)
def test_store_rows_land_in_their_slots(planes, monkeypatch, mode, cols):
    """Random (partly consecutive) store rows into random slots, with -1 skips, through
    several messages: every page is its rows' columns, nothing else is written."""
    rx, tx = planes
    monkeypatch.setattr(zmq_plane, "ZERO_COPY_MIN", 1 if mode == "zero_copy" else 1 << 30)
    monkeypatch.setattr(zmq_plane, "MSG_BYTES", 5 * 64)  # several messages per push
    monkeypatch.setattr(zmq_plane, "STAGE_BUFFERS", 2)  # the ring wraps: reuse waits
    slab = slab_of(40, 96)
    pb = sum(n for _, n in cols)
    rows = np.array([3, 4, 5, 17, 0, 39, 38, 6, 7, 8, 9, 21, 22, 30], dtype=np.int64)
    dst = np.array([9, 10, -1, 2, 31, 0, 5, 6, 7, 8, 1, -1, 20, 11], dtype=np.int64)
    pool = torch.zeros(32, pb, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [int((dst >= 0).sum())], 10.0)
    pages, slots = push_source(tx, slab, rows, cols, dst)
    assert isinstance(pages, StoreRows)  # the plane takes the rows where they lie
    h = tx.post_push(rx.endpoint, 1, 1, b"t", [(0, pages, slots)], 10.0)
    assert tx.wait_push(h, 10.0).done
    st = rx.wait(1, 10.0)
    assert st.done, st
    keep = dst >= 0
    want = expected_pages(slab, rows[keep], cols)
    assert torch.equal(pool[torch.as_tensor(dst[keep])], want)
    untouched = np.setdiff1d(np.arange(32), dst[keep])
    assert int(pool[torch.as_tensor(untouched)].sum()) == 0


def test_small_scattered_pages_are_gathered_into_frames():
    """Scattered pages below ZERO_COPY_MIN travel gathered (few frames per message);
    consecutive rows of a whole-row slab, or big pages, go zero-copy."""
    slab = slab_of(64, 1024)
    scattered = StoreRows(slab, np.arange(0, 64, 2, dtype=np.int64), ((0, 1024),))
    msgs, n, _ = zmq_plane._plan_group(1, 1, b"t", 0, scattered, list(range(32)))
    assert n == 32 and all(mm.gather is not None and mm.frames is None for mm in msgs)
    run = StoreRows(slab, np.arange(32, dtype=np.int64), ((0, 1024),))
    msgs, _, _ = zmq_plane._plan_group(1, 1, b"t", 0, run, list(range(32)))
    assert len(msgs) == 1 and msgs[0].frames is not None and len(msgs[0].frames) == 1
    assert msgs[0].frames[0].obj is not None  # a view of the slab, not a copy
    assert np.shares_memory(np.asarray(msgs[0].frames[0]), slab.numpy())


@pytest.mark.parametrize(
    "src, why",
    [
        (StoreRows(slab_of(4, 8), np.array([0, 4]), ((0, 8),)), "outside the slab"),
        (StoreRows(slab_of(4, 8), np.array([0, 1]), ((4, 8),)), "inside rows"),
        (StoreRows(slab_of(4, 8), np.array([0]), ((0, 8),)), "source rows for 2"),
        (torch.zeros(2, 8, dtype=torch.int32), "uint8"),
    ],
)
def test_bad_sources_are_refused_by_name(planes, src, why):
    _, tx = planes
    with pytest.raises(ValueError, match=why):
        tx.post_push("tcp://127.0.0.1:1", 1, 1, b"t", [(0, src, [0, 1])], 1.0)


def test_gathered_push_to_absent_peer_fails_by_deadline(monkeypatch):
    monkeypatch.setattr(zmq_plane, "ZERO_COPY_MIN", 1 << 30)
    tx = ZmqDataPlane()
    try:
        slab = slab_of(16, 64)
        src = StoreRows(slab, np.arange(0, 16, 2, dtype=np.int64), ((0, 64),))
        h = tx.post_push("tcp://127.0.0.1:1", 1, 1, b"t", [(0, src, list(range(8)))], 0.3)
        st = tx.wait_push(h, 5.0)
        assert st.failed and "deadline" in st.error
    finally:
        tx.close()


def test_checksum_is_off_by_default_and_checked_when_on():
    assert not ZmqDataPlane.__init__.__kwdefaults__["checksum"]
    rx, tx = ZmqDataPlane(checksum=True), ZmqDataPlane(checksum=True)
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    try:
        pool = torch.zeros(8, 16, dtype=torch.uint8)
        rx.register_regions([[pool]])
        src = slab_of(3, 16)
        rx.expect(1, 1, b"t", [3], 5.0)
        h = tx.post_push(rx.endpoint, 1, 1, b"t", [(0, src, [5, 1, 2])], 5.0)
        assert tx.wait_push(h, 5.0).done and rx.wait(1, 5.0).done
        # a payload that does not match the sender's checksum fails the transfer
        s.connect(rx.endpoint)
        rx.expect(2, 1, b"t", [1], 5.0)
        hdr = PageBatch(
            transfer_id=2, lease_id=1, token=b"t", group=0, runs=[(0, 1)], page_bytes=16
        )
        s.send_multipart([encode(hdr), b"x" * 16])
        s.send(encode(TransferDone(transfer_id=2, lease_id=1, token=b"t", checksum=12345)))
        st = rx.wait(2, 3.0)
        assert st.failed and "checksum" in st.error
    finally:
        s.close()
        rx.close()
        tx.close()


def test_factory_passes_checksum():
    plane = make_data_plane("zmq", checksum=True)
    try:
        assert plane.checksum is True  # type: ignore[attr-defined]
    finally:
        plane.close()
    plane = make_data_plane("zmq")
    try:
        assert plane.checksum is False  # type: ignore[attr-defined]
    finally:
        plane.close()
    with pytest.raises(ValueError, match="only the zmq"):
        make_data_plane("ipc", checksum=True)
