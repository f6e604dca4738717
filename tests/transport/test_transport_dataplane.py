import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from disagg.protocol import PageBatch, TransferDone, encode
from disagg.transport import RegionSpec, TcpDataPlane, TransferState, tcp


@pytest.fixture
def planes():
    rx, tx = TcpDataPlane(), TcpDataPlane()
    yield rx, tx
    rx.close()
    tx.close()


def rand(n, pb, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, pb), dtype=torch.uint8, generator=g)


def check_landed(dst, src, slots):
    """dst[slot] == src[i] for every slot >= 0; all other rows still zero."""
    touched = set()
    for i, s in enumerate(slots):
        if s >= 0:
            assert torch.equal(dst[s], src[i]), (i, s)
            touched.add(s)
    for s in range(dst.shape[0]):
        if s not in touched:
            assert int(dst[s].sum()) == 0, s


def test_contiguous_scattered_multiregion(planes):
    rx, tx = planes
    pool0 = torch.zeros(64, 4096, dtype=torch.uint8)  # single contiguous region: direct path
    backing = torch.zeros(64, 3000, dtype=torch.uint8)  # two strided regions: scatter path
    r1, r2 = backing[:, :1000], backing[:, 1000:1500]
    rx.register_regions([[RegionSpec(pool0)], [r1, r2]])
    src0, src1 = rand(10, 4096, 1), rand(10, 1500, 2)
    s0 = [3, 4, 5, -1, 9, 10, 20, 21, 22, 0]
    s1 = [1, 2, -1, -1, 7, 8, 9, 40, 41, 63]
    rx.expect(1, 7, b"tok", [9, 8], 5.0)
    assert rx.poll(1).state is TransferState.PENDING
    h = tx.post_push(rx.endpoint, 1, 7, b"tok", [(0, src0, s0), (1, src1, s1)])
    st = rx.wait(1, 5.0)
    assert st.done, st
    assert st.pages == 17 and st.nbytes == 9 * 4096 + 8 * 1500
    assert tx.wait_push(h, 5.0).done
    check_landed(pool0, src0, s0)
    page1 = torch.cat([r1, r2], dim=1)
    check_landed(page1, src1, s1)
    assert int(backing[:, 1500:].sum()) == 0  # bytes between region rows never touched


def test_large_runs_split_into_frames_and_messages(planes):
    rx, tx = planes
    pb = 300 * 1024  # > 1 MiB runs, > 8 MiB messages
    pool = torch.zeros(80, pb, dtype=torch.uint8)
    backing = torch.zeros(80, 2 * pb + 64, dtype=torch.uint8)
    ra, rb = backing[:, :pb], backing[:, pb + 64 : 2 * pb + 64]
    rx.register_regions([[pool], [ra, rb]])
    src0 = rand(64, pb, 3)
    src1 = rand(40, 2 * pb, 4)
    s0 = list(range(10, 74))
    s1 = list(range(79, 39, -1))  # descending: runs of one page each
    rx.expect(2, 1, b"t", [64, 40], 20.0)
    tx.post_push(rx.endpoint, 2, 1, b"t", [(0, src0, s0), (1, src1, s1)])
    st = rx.wait(2, 20.0)
    assert st.done, st
    check_landed(pool, src0, s0)
    check_landed(torch.cat([ra, rb], dim=1), src1, s1)
    assert int(backing[:, pb : pb + 64].sum()) == 0


def test_out_of_range_slot_refused_without_writing(planes):
    rx, tx = planes
    pool = torch.zeros(16, 64, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(3, 1, b"t", [3], 5.0)
    tx.post_push(rx.endpoint, 3, 1, b"t", [(0, rand(3, 64), [0, 1, 16])])
    st = rx.wait(3, 5.0)
    assert st.failed and "outside [0, 16)" in st.error
    assert int(pool.sum()) == 0
    with pytest.raises(ValueError):
        tx.post_push(rx.endpoint, 4, 1, b"t", [(0, rand(1, 64), [-2])])
    with pytest.raises(ValueError):
        tx.post_push(rx.endpoint, 4, 1, b"t", [(0, rand(2, 64), [1])])


def test_unknown_transfer_and_wrong_token_refused(planes):
    rx, tx = planes
    pool = torch.zeros(8, 64, dtype=torch.uint8)
    rx.register_regions([[pool]])
    tx.post_push(rx.endpoint, 99, 1, b"t", [(0, rand(2, 64), [0, 1])])
    rx.expect(5, 1, b"right", [2], 5.0)
    tx.post_push(rx.endpoint, 5, 1, b"wrong", [(0, rand(2, 64), [0, 1])])
    tx.post_push(rx.endpoint, 5, 2, b"right", [(0, rand(2, 64), [0, 1])])  # wrong lease
    deadline = time.monotonic() + 5
    while rx.stats["rejected_unknown"] < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.stats["rejected_unknown"] == 6  # 3 forged pushes: batch + done each
    assert int(pool.sum()) == 0
    assert rx.poll(5).state is TransferState.PENDING  # forgeries do not fail the real one
    with pytest.raises(KeyError):
        rx.poll(99)


def test_deadline_and_abort(planes):
    rx, tx = planes
    pool = torch.zeros(8, 64, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(6, 1, b"t", [1], 0.2)
    st = rx.wait(6, 3.0)
    assert st.failed and "deadline" in st.error
    rx.expect(7, 1, b"t", [1], 5.0)
    rx.abort(7, "request cancelled")
    assert rx.poll(7).error == "request cancelled"
    tx.post_push(rx.endpoint, 7, 1, b"t", [(0, rand(1, 64), [2])])
    end = time.monotonic() + 5
    while rx.stats["rejected_late"] < 1 and time.monotonic() < end:
        time.sleep(0.01)
    assert rx.stats["rejected_late"] >= 1 and int(pool.sum()) == 0


def test_push_to_dead_peer_fails_by_deadline():
    tx = TcpDataPlane()
    try:
        t = time.monotonic()
        h = tx.post_push("tcp://127.0.0.1:1", 1, 1, b"t", [(0, rand(2, 64), [0, 1])], 0.3)
        st = tx.wait_push(h, 3.0)
        assert st.failed and "deadline" in st.error
        assert time.monotonic() - t < 2.0
    finally:
        tx.close()


def test_dead_peer_does_not_hold_up_a_healthy_one(planes):
    rx, tx = planes
    dst = torch.zeros(4, 64, dtype=torch.uint8)
    rx.register_regions([[dst]])
    rx.expect(7, 1, b"tok", [2], 5.0)
    stuck = tx.post_push("tcp://127.0.0.1:1", 1, 1, b"t", [(0, rand(2, 64), [0, 1])], 3.0)
    t = time.monotonic()
    src = rand(2, 64, seed=3)
    tx.post_push(rx.endpoint, 7, 1, b"tok", [(0, src, [1, 3])], 5.0)
    assert rx.wait(7, 2.5).done, "a push to a live peer waited behind a dead one"
    assert time.monotonic() - t < 2.5
    check_landed(dst, src, [1, 3])
    assert tx.wait_push(stuck, 5.0).failed


def test_transfer_writes_only_its_own_slots(planes):
    rx, tx = planes
    dst = torch.zeros(8, 64, dtype=torch.uint8)
    rx.register_regions([[dst]])
    # promised slots 1 and 2; a sender holding the token aims at 5 (another request's page)
    rx.expect(9, 1, b"tok", [2], 2.0, slots_by_group=[[1, 2]])
    tx.post_push(rx.endpoint, 9, 1, b"tok", [(0, rand(2, 64), [1, 5])], 2.0)
    st = rx.wait(9, 3.0)
    assert st.failed and "not given" in st.error
    assert int(dst[5].sum()) == 0
    rx.expect(10, 1, b"tok", [3], 2.0, slots_by_group=[[0, 3, 4]])
    src = rand(3, 64, seed=4)
    tx.post_push(rx.endpoint, 10, 1, b"tok", [(0, src, [4, 0, 3])], 2.0)
    assert rx.wait(10, 3.0).done
    assert torch.equal(dst[4], src[0]) and torch.equal(dst[0], src[1])


def test_hostile_frames():
    """Hand-made messages on the stream: each refusal fails its transfer by name, and the
    connection keeps serving the messages after it (explicit lengths keep it in step)."""
    rx = TcpDataPlane(checksum=True)  # tid 13 checks the optional payload checksum
    pool = torch.zeros(8, 16, dtype=torch.uint8)
    rx.register_regions([[pool]])
    s = tcp.wire.StreamPush(rx.endpoint)

    def batch(tid, runs, frames, pb=16):
        h = PageBatch(transfer_id=tid, lease_id=1, token=b"t", group=0, runs=runs, page_bytes=pb)
        s.send_multipart([encode(h), *frames])

    try:
        s.send_multipart([b"\xc1garbage", b"x" * 16])
        rx.expect(10, 1, b"t", [1], 5.0)
        batch(10, [(0, 1)], [b"a" * 32])  # payload longer than its runs
        rx.expect(11, 1, b"t", [1], 5.0)
        batch(11, [(0, 1)], [b"a" * 8])  # short payload
        rx.expect(12, 1, b"t", [1], 5.0)
        batch(12, [(1, 1)], [b"b" * 16], pb=8)  # wrong page size
        rx.expect(13, 1, b"t", [1], 5.0)
        batch(13, [(2, 1)], [b"c" * 16])
        s.send(encode(TransferDone(transfer_id=13, lease_id=1, token=b"t", checksum=12345)))
        rx.expect(14, 1, b"t", [2], 5.0)
        batch(14, [(3, 1)], [b"d" * 16])
        s.send(encode(TransferDone(transfer_id=14, lease_id=1, token=b"t")))  # too few pages
        for tid, needle in [
            (10, "carries 32 payload bytes, its 1 pages take 16"),
            (11, "carries 8 payload bytes"),
            (12, "bytes"),
            (13, "checksum"),
            (14, "of"),
        ]:
            st = rx.wait(tid, 3.0)
            assert st.failed and needle in st.error, (tid, st)
        assert rx.stats["rejected_BAD_FRAME"] == 1
        assert int(pool[:2].sum()) == 0  # refused batches wrote nothing
        assert bytes(pool[2].numpy()) == b"c" * 16  # (its checksum failed after landing)
    finally:
        s.close()
        rx.close()


CHILD = textwrap.dedent(
    """
    import sys, torch
    from disagg.transport import TcpDataPlane
    ep, n, pb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    g = torch.Generator().manual_seed(42)
    src = torch.randint(0, 256, (n, pb), dtype=torch.uint8, generator=g)
    tx = TcpDataPlane()
    h = tx.post_push(ep, 20, 1, b"tok", [(0, src, list(range(n)))], 30.0)
    st = tx.wait_push(h, 30.0)
    tx.close()
    sys.exit(0 if st.done else 1)
    """
)


def test_across_processes(tmp_path):
    n, pb = 32, 256 * 1024
    rx = TcpDataPlane(f"ipc://{tmp_path}/dp.sock")
    try:
        pool = torch.zeros(n, pb, dtype=torch.uint8)
        rx.register_regions([[pool]])
        rx.expect(20, 1, b"tok", [n], 60.0)
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, rx.endpoint, str(n), str(pb)], timeout=60
        )
        assert proc.returncode == 0
        st = rx.wait(20, 10.0)
        assert st.done, st
        g = torch.Generator().manual_seed(42)
        expect = torch.randint(0, 256, (n, pb), dtype=torch.uint8, generator=g)
        assert torch.equal(pool, expect)
    finally:
        rx.close()


def test_payload_in_pieces_lands_and_a_refused_batch_is_skipped(planes):
    """The payload may arrive in any pieces (partial reads); a refused batch's payload is
    read and dropped, and the same connection goes on serving the next transfer."""
    import xxhash

    rx, _ = planes
    pool = torch.zeros(8, 16, dtype=torch.uint8)
    rx.register_regions([[pool]])
    s = tcp.wire.StreamPush(rx.endpoint)
    try:
        payload = bytes(range(48))  # pages for slots 6, 1, 2 (runs (6, 1), (1, 2))
        h = PageBatch(
            transfer_id=30, lease_id=1, token=b"t", group=0, runs=[(6, 1), (1, 2)], page_bytes=16
        )
        rx.expect(30, 1, b"t", [3], 5.0, slots_by_group=[[6, 1, 2]])
        wire = tcp.wire.frame(encode(h), len(payload)) + payload
        for cut in (0, 5, 19, 30, 47):  # a prefix, a header and a payload in pieces
            s.sock.sendall(wire[cut : {0: 5, 5: 19, 19: 30, 30: 47, 47: len(wire)}[cut]])
            time.sleep(0.02)
        done = TransferDone(
            transfer_id=30, lease_id=1, token=b"t", checksum=xxhash.xxh3_64_intdigest(payload)
        )
        s.send(encode(done))
        assert rx.wait(30, 3.0).done
        want = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(3, 16)
        assert torch.equal(pool[6], want[0]) and torch.equal(pool[1:3], want[1:])
        assert int(pool[[0, 3, 4, 5, 7]].sum()) == 0

        h = PageBatch(transfer_id=31, lease_id=1, token=b"t", group=0, runs=[(4, 1)], page_bytes=16)
        rx.expect(31, 1, b"t", [1], 5.0)
        s.send_multipart([encode(h), b"e" * 16, b"f" * 16])
        st = rx.wait(31, 3.0)
        assert st.failed and "carries 32 payload bytes" in st.error
        assert int(pool[4].sum()) == 0
        # the next message on the same connection is read in step
        h = PageBatch(transfer_id=32, lease_id=1, token=b"t", group=0, runs=[(5, 1)], page_bytes=16)
        rx.expect(32, 1, b"t", [1], 5.0)
        s.send_multipart([encode(h), b"g" * 16])
        s.send(encode(TransferDone(transfer_id=32, lease_id=1, token=b"t")))
        assert rx.wait(32, 3.0).done
        assert bytes(pool[5].numpy()) == b"g" * 16
    finally:
        s.close()


def test_store_rows_materialize_gathers_on_the_slab_device():
    """Scattered StoreRows of a slab gather where the slab lives (on the H200 run,
    DISAGG_TEST_DEVICE=cuda: a device store; the index used to stay on the host and the
    gather raised, so tcp/ucx pushes from a CUDA store failed)."""
    from harness import DEVICE

    from disagg.transport.dataplane import StoreRows

    slab = torch.arange(64 * 32, dtype=torch.int64, device=DEVICE).view(torch.uint8).view(64, -1)
    rows = np.array([5, 1, 63, 2])
    got = StoreRows(slab, rows, ((8, 16), (0, 8))).materialize()
    want = torch.cat([slab[rows.tolist(), 8:24], slab[rows.tolist(), 0:8]], dim=1)
    assert got.device == slab.device and torch.equal(got, want)
    run = StoreRows(slab, np.arange(3, 9), ((0, slab.shape[1]),)).materialize()
    assert run.data_ptr() == slab[3].data_ptr()  # one run of rows: a view, no copy
