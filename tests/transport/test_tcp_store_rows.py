"""TcpDataPlane sender paths: StoreRows sent from the store rows where they lie (the C
iovec path and the Python fallback), and the optional payload checksum."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg.protocol import PageBatch, TransferDone, encode
from disagg.transport import TcpDataPlane, tcp
from disagg.transport.dataplane import StoreRows, push_source
from disagg.transport.factory import make_data_plane


@pytest.fixture
def planes():
    rx, tx = TcpDataPlane(), TcpDataPlane()
    yield rx, tx
    rx.close()
    tx.close()


def slab_of(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=g)


def expected_pages(slab, rows, cols):
    return torch.cat([slab[torch.as_tensor(rows), o : o + n] for o, n in cols], dim=1)


@pytest.mark.parametrize("mode", ["native", "python"])
@pytest.mark.parametrize(
    "cols",
    [((0, 96),), ((16, 48),), ((0, 16), (40, 24), (80, 16))],
    ids=["whole_row", "one_column", "three_columns"],
)
def test_store_rows_land_in_their_slots(planes, monkeypatch, mode, cols):
    """Random (partly consecutive) store rows into random slots, with -1 skips, through
    several messages: every page is its rows' columns, nothing else is written."""
    rx, tx = planes
    if mode == "python":
        monkeypatch.setattr(tcp.rowio, "_native", None)
    elif tcp.rowio._streamio is None:
        pytest.skip("the _streamio extension is not built")
    monkeypatch.setattr(tcp.plan, "MSG_BYTES", 5 * 64)  # several messages per push
    monkeypatch.setattr(tcp.rowio, "PY_CHUNK", 3 * 64)  # several chunks per message
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


def test_plan_sends_from_the_store_rows_in_place(monkeypatch):
    """A push plans batches of MSG_BYTES over the slab itself: no gather, no copy (the
    kernel reads each page from its row); destination runs are coalesced."""
    monkeypatch.setattr(tcp.plan, "MSG_BYTES", 8 * 1024)
    slab = slab_of(64, 1024)
    rows = np.arange(0, 64, 2, dtype=np.int64)
    src, n = tcp.plan.plan_group(1, 1, b"t", 0, StoreRows(slab, rows, ((0, 1024),)), range(32))
    assert n == 32 and len(src.batches) == 4
    assert np.shares_memory(src.arr, slab.numpy())
    assert np.array_equal(np.concatenate([b.rows for b in src.batches]), rows)
    assert all(b.nbytes == 8 * 1024 for b in src.batches)


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


def test_scattered_push_to_absent_peer_fails_by_deadline():
    tx = TcpDataPlane()
    try:
        slab = slab_of(16, 64)
        src = StoreRows(slab, np.arange(0, 16, 2, dtype=np.int64), ((0, 64),))
        h = tx.post_push("tcp://127.0.0.1:1", 1, 1, b"t", [(0, src, list(range(8)))], 0.3)
        st = tx.wait_push(h, 5.0)
        assert st.failed and "deadline" in st.error
    finally:
        tx.close()


def test_checksum_is_off_by_default_and_checked_when_on():
    assert not TcpDataPlane.__init__.__kwdefaults__["checksum"]
    rx, tx = TcpDataPlane(checksum=True), TcpDataPlane(checksum=True)
    s = None
    try:
        pool = torch.zeros(8, 16, dtype=torch.uint8)
        rx.register_regions([[pool]])
        src = slab_of(3, 16)
        rx.expect(1, 1, b"t", [3], 5.0)
        h = tx.post_push(rx.endpoint, 1, 1, b"t", [(0, src, [5, 1, 2])], 5.0)
        assert tx.wait_push(h, 5.0).done and rx.wait(1, 5.0).done
        # a payload that does not match the sender's checksum fails the transfer
        s = tcp.wire.StreamPush(rx.endpoint)
        rx.expect(2, 1, b"t", [1], 5.0)
        hdr = PageBatch(
            transfer_id=2, lease_id=1, token=b"t", group=0, runs=[(0, 1)], page_bytes=16
        )
        s.send_multipart([encode(hdr), b"x" * 16])
        s.send(encode(TransferDone(transfer_id=2, lease_id=1, token=b"t", checksum=12345)))
        st = rx.wait(2, 3.0)
        assert st.failed and "checksum" in st.error
    finally:
        if s is not None:
            s.close()
        rx.close()
        tx.close()


def test_factory_passes_checksum():
    plane = make_data_plane("tcp", checksum=True)
    try:
        assert plane.checksum is True  # type: ignore[attr-defined]
    finally:
        plane.close()
    plane = make_data_plane("tcp")
    try:
        assert plane.checksum is False  # type: ignore[attr-defined]
    finally:
        plane.close()
    with pytest.raises(ValueError, match="only the tcp"):
        make_data_plane("ipc", checksum=True)


def test_tcp_batches_are_cut_smaller(monkeypatch):
    """Over TCP a push is cut into batches of TCP_MSG_BYTES (2 MiB: the faster cut
    against raw TCP, see the module docstring), over AF_UNIX into MSG_BYTES; the env
    switch sets TCP's, never above MSG_BYTES, and a bad value names the switch."""
    monkeypatch.delenv("DISAGG_STREAM_TCP_MSG_BYTES", raising=False)
    assert tcp.plan.msg_bytes("tcp://127.0.0.1:5555") == 2 << 20
    assert tcp.plan.msg_bytes("ipc:///tmp/x.sock") == 8 << 20
    monkeypatch.setenv("DISAGG_STREAM_TCP_MSG_BYTES", str(4 << 20))
    assert tcp.plan.msg_bytes("tcp://127.0.0.1:5555") == 4 << 20
    assert tcp.plan.msg_bytes("ipc:///tmp/x.sock") == 8 << 20
    monkeypatch.setenv("DISAGG_STREAM_TCP_MSG_BYTES", str(64 << 20))
    assert tcp.plan.msg_bytes("tcp://127.0.0.1:5555") == 8 << 20
    for bad in ("2MiB", "0", "-1"):
        monkeypatch.setenv("DISAGG_STREAM_TCP_MSG_BYTES", bad)
        with pytest.raises(ValueError, match="DISAGG_STREAM_TCP_MSG_BYTES"):
            tcp.plan.msg_bytes("tcp://127.0.0.1:5555")


@pytest.mark.parametrize("cut_pages", [3, 7])
def test_a_tcp_push_lands_in_tcp_sized_batches(planes, monkeypatch, cut_pages):
    """A push over TCP goes out in batches of TCP_MSG_BYTES (here a few pages) and every
    page lands in its slot: the receiver took one message per batch."""
    rx, tx = planes
    assert rx.endpoint.startswith("tcp://")
    monkeypatch.delenv("DISAGG_STREAM_TCP_MSG_BYTES", raising=False)
    monkeypatch.setattr(tcp.plan, "TCP_MSG_BYTES", cut_pages * 256)
    landed = []
    real_land = tcp.plane.TcpDataPlane._land

    def land(self, conn, piped, rx_, h, grp, slots):
        landed.append(int(slots.size))
        return real_land(self, conn, piped, rx_, h, grp, slots)

    monkeypatch.setattr(tcp.plane.TcpDataPlane, "_land", land)
    slab = slab_of(50, 256, seed=3)
    rows = np.random.default_rng(4).permutation(50)[:20].astype(np.int64)
    dst = np.random.default_rng(5).permutation(40)[:20].astype(np.int64)
    pool = torch.zeros(40, 256, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [20], 10.0)
    pages, slots = push_source(tx, slab, rows, ((0, 256),), dst)
    h = tx.post_push(rx.endpoint, 1, 1, b"t", [(0, pages, slots)], 10.0)
    assert tx.wait_push(h, 10.0).done
    assert rx.wait(1, 10.0).done
    assert landed == [cut_pages] * (20 // cut_pages) + ([20 % cut_pages] if 20 % cut_pages else [])
    assert torch.equal(pool[torch.as_tensor(dst)], slab[torch.as_tensor(rows)])


def test_tcp_sender_asks_for_its_send_buffer_only_where_granted(monkeypatch):
    """A TCP sender's socket gets TCP_SNDBUF (doubled by the kernel) when wmem_max grants
    all of it; with a smaller wmem_max, or the switch at 0, the kernel's autotuning stays
    (a capped ask would shrink the buffer)."""
    import socket

    monkeypatch.setattr(tcp.sender, "TCP_SNDBUF", 128 << 10)  # under any default wmem_max
    monkeypatch.delenv("DISAGG_STREAM_TCP_SNDBUF", raising=False)

    def fresh() -> socket.socket:
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)

    with fresh() as s:
        untouched = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    monkeypatch.setattr(tcp.sender, "_wmem_max", lambda: 1 << 20)
    with fresh() as s:
        tcp.sender._ask_tcp_sndbuf(s)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * (128 << 10)
    monkeypatch.setattr(tcp.sender, "_wmem_max", lambda: 64 << 10)
    with fresh() as s:
        tcp.sender._ask_tcp_sndbuf(s)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == untouched
    monkeypatch.setattr(tcp.sender, "_wmem_max", lambda: 1 << 20)
    monkeypatch.setenv("DISAGG_STREAM_TCP_SNDBUF", "0")
    with fresh() as s:
        tcp.sender._ask_tcp_sndbuf(s)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == untouched


def test_a_tcp_lane_socket_has_the_send_buffer(planes, monkeypatch):
    """The sender's connection to a TCP peer carries the asked send buffer."""
    import socket

    rx, tx = planes
    monkeypatch.setattr(tcp.sender, "TCP_SNDBUF", 96 << 10)
    monkeypatch.setattr(tcp.sender, "_wmem_max", lambda: 1 << 20)
    monkeypatch.delenv("DISAGG_STREAM_TCP_SNDBUF", raising=False)
    pool = torch.zeros(4, 64, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [2], 10.0)
    slab = slab_of(4, 64)
    h = tx.post_push(rx.endpoint, 1, 1, b"t", [(0, slab[:2].clone(), [1, 3])], 10.0)
    assert tx.wait_push(h, 10.0).done
    assert rx.wait(1, 10.0).done
    sock = tx._lanes[rx.endpoint].sock
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * (96 << 10)
    assert torch.equal(pool[[1, 3]], slab[:2])


def test_a_malformed_tcp_batch_switch_fails_the_plane_at_start(monkeypatch):
    """A bad DISAGG_STREAM_TCP_MSG_BYTES is refused when the plane starts, by name, not
    at every push."""
    monkeypatch.setenv("DISAGG_STREAM_TCP_MSG_BYTES", "two megabytes")
    with pytest.raises(ValueError, match="DISAGG_STREAM_TCP_MSG_BYTES='two megabytes'"):
        TcpDataPlane()
