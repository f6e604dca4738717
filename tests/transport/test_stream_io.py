"""The zmq plane's payload stream: the iovec loops (C ``_streamio`` and the Python
fallback) against numpy references, and the plane's behaviour at the edges of the wire
(truncated payloads, refused preambles, stalled peers, abort mid-payload)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from disagg.protocol import PageBatch, TransferDone, encode
from disagg.transport import ZmqDataPlane, zmq_plane

PATHS = ["native", "python"]


@pytest.fixture
def path(request, monkeypatch):
    """Run the test on the C extension or on the pure-Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(zmq_plane, "_native", None)
    elif zmq_plane._streamio is None:
        pytest.skip("the _streamio extension is not built")
    return request.param


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)  # like the plane's sockets (and Python sockets with a timeout)
    b.setblocking(False)
    return a, b


def _drain(sock: socket.socket, n: int, out: list[bytes]) -> threading.Thread:
    def run() -> None:
        sock.settimeout(10)
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                break
            buf += chunk
        out.append(bytes(buf))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _feed(sock: socket.socket, data: bytes, close: bool = False) -> threading.Thread:
    def run() -> None:
        sock.settimeout(10)
        sock.sendall(data)
        if close:
            sock.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _cols(spans):
    return np.array(spans, dtype=np.int64).reshape(-1, 2)


def _ref_pages(arr, rows, spans):
    return np.concatenate([arr[rows, o : o + n] for o, n in spans], axis=1)


# Page sizes; the 64-byte case with 3000 scattered rows spans three IOV_MAX chunks of
# iovecs (no two of them adjacent), the 2-span case twice that many pieces.
CASES = [
    (64, 3000, ((0, 64),)),
    (4096, 300, ((0, 4096),)),
    (96, 2500, ((0, 16), (40, 24))),  # two column spans per row
    (256 << 10, 12, ((0, 256 << 10),)),
]


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("width, n, spans", CASES)
def test_recv_rows_into_random_slots_is_byte_exact(path, width, n, spans):
    rng = np.random.default_rng(width + n)
    slots = rng.permutation(2 * n)[:n].astype(np.int64)
    per_row = sum(c for _, c in spans)
    payload = rng.integers(0, 256, n * per_row, dtype=np.uint8)
    dst = np.zeros((2 * n, width), dtype=np.uint8)
    a, b = pair()
    try:
        feeder = _feed(b, payload.tobytes())
        got = zmq_plane.recv_rows(a, dst, slots, _cols(spans), time.monotonic() + 10)
        feeder.join(10)
        assert got == payload.size
        want = np.zeros_like(dst)
        pages = payload.reshape(n, per_row)
        col = 0
        for o, c in spans:
            want[slots, o : o + c] = pages[:, col : col + c]
            col += c
        assert np.array_equal(dst, want)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("width, n, spans", CASES)
def test_send_rows_from_random_rows_is_byte_exact(path, width, n, spans):
    rng = np.random.default_rng(width * 3 + n)
    src = rng.integers(0, 256, (2 * n, width), dtype=np.uint8)
    rows = rng.permutation(2 * n)[:n].astype(np.int64)
    head = b"HEAD" * 3
    want = head + _ref_pages(src, rows, spans).tobytes()
    a, b = pair()
    out: list[bytes] = []
    try:
        t = _drain(b, len(want), out)
        sent = zmq_plane.send_rows(a, head, src, rows, _cols(spans), time.monotonic() + 10)
        t.join(10)
        assert sent == len(want) and out[0] == want
    finally:
        a.close()
        b.close()


def test_native_and_python_paths_agree(monkeypatch):
    """The same scattered send and receive through both implementations, on a strided
    view (row stride above the row width) with three spans: identical bytes."""
    if zmq_plane._streamio is None:
        pytest.skip("the _streamio extension is not built")
    rng = np.random.default_rng(7)
    backing = rng.integers(0, 256, (600, 200), dtype=np.uint8)
    src = backing[:, 10:170]  # rows of 160 bytes, stride 200
    spans = ((0, 32), (64, 8), (100, 60))
    rows = rng.integers(0, 600, 1500).astype(np.int64)  # repeats allowed when sending
    slots = rng.permutation(600)[:500].astype(np.int64)
    results = []
    for native in (True, False):
        monkeypatch.setattr(zmq_plane, "_native", zmq_plane._streamio if native else None)
        a, b = pair()
        out: list[bytes] = []
        try:
            wire_len = rows.size * 100
            t = _drain(b, wire_len, out)
            zmq_plane.send_rows(a, None, src, rows, _cols(spans), time.monotonic() + 10)
            t.join(10)
            dst_backing = np.zeros((600, 200), dtype=np.uint8)
            dst = dst_backing[:, 20:180]
            feeder = _feed(b, out[0][: slots.size * 100])
            zmq_plane.recv_rows(a, dst, slots, _cols(spans), time.monotonic() + 10)
            feeder.join(10)
            results.append((out[0], dst_backing.copy()))
        finally:
            a.close()
            b.close()
    assert results[0][0] == results[1][0]
    assert np.array_equal(results[0][1], results[1][1])
    assert results[0][0] == _ref_pages(src, rows, spans).tobytes()


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_bad_rows_and_spans_are_refused_before_a_byte_moves(path):
    dst = np.zeros((8, 16), dtype=np.uint8)
    a, b = pair()
    try:
        b.sendall(b"x" * 64)
        with pytest.raises(IndexError, match=r"row 8 \(index 2\) outside 8 rows"):
            zmq_plane.recv_rows(a, dst, np.array([0, 1, 8, 2]), _cols([(0, 16)]), 0)
        with pytest.raises(IndexError, match=r"row -1 \(index 0\)"):
            zmq_plane.recv_rows(a, dst, np.array([-1]), _cols([(0, 16)]), 0)
        with pytest.raises(IndexError, match="column span 1"):
            zmq_plane.recv_rows(a, dst, np.array([0]), _cols([(0, 8), (10, 7)]), 0)
        assert int(dst.sum()) == 0
        assert len(a.recv(64)) == 64  # nothing was consumed from the socket
        with pytest.raises(IndexError, match=r"row 9 \(index 1\)"):
            zmq_plane.send_rows(a, b"head", dst, np.array([0, 9]), _cols([(0, 16)]), 0)
        with pytest.raises(BlockingIOError):
            b.recv(64)  # not even the head went out
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_eof_and_deadline_mid_payload_raise_clear_errors(path):
    dst = np.zeros((4, 1024), dtype=np.uint8)
    a, b = pair()
    try:
        _feed(b, b"y" * 1500, close=True).join(10)
        with pytest.raises(ConnectionError, match="1500 of 4096 payload bytes received"):
            zmq_plane.recv_rows(a, dst, np.arange(4), _cols([(0, 1024)]), time.monotonic() + 5)
    finally:
        a.close()
    a, b = pair()
    try:
        b.sendall(b"z" * 100)
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="100 of 4096 payload bytes received"):
            zmq_plane.recv_rows(a, dst, np.arange(4), _cols([(0, 1024)]), time.monotonic() + 0.2)
        assert time.monotonic() - t < 2.0
        big = np.zeros((64, 1 << 20), dtype=np.uint8)  # more than the socket buffers hold
        with pytest.raises(TimeoutError, match="payload bytes sent"):
            zmq_plane.send_rows(
                a, None, big, np.arange(64), _cols([(0, 1 << 20)]), time.monotonic() + 0.2
            )
    finally:
        a.close()
        b.close()


def test_missing_extension_raises_when_native_is_required():
    code = (
        "import sys; sys.modules['disagg.transport._streamio'] = None\n"
        "try:\n"
        "    import disagg.transport.zmq_plane\n"
        "except ImportError:\n"
        "    sys.exit(3)\n"
        "sys.exit(0)\n"
    )
    env = dict(os.environ, DISAGG_REQUIRE_NATIVE="1")
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 3
    env["DISAGG_REQUIRE_NATIVE"] = "0"
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0


# ------------------------------------------------------------------------------- plane
@pytest.fixture
def planes():
    rx, tx = ZmqDataPlane(), ZmqDataPlane()
    yield rx, tx
    rx.close()
    tx.close()


def _push_ok(rx, tx, tid, pool, n=4):
    src = torch.randint(0, 256, (n, pool.shape[1]), dtype=torch.uint8)
    rx.expect(tid, 1, b"t", [n], 5.0)
    h = tx.post_push(rx.endpoint, tid, 1, b"t", [(0, src, list(range(n)))], 5.0)
    assert tx.wait_push(h, 5.0).done
    st = rx.wait(tid, 5.0)
    assert st.done, st
    assert torch.equal(pool[:n], src)


def test_peer_closing_mid_payload_fails_the_transfer_and_the_receiver_serves_on(planes):
    rx, tx = planes
    pool = torch.zeros(16, 4096, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [4], 5.0)
    s = zmq_plane.StreamPush(rx.endpoint)
    h = PageBatch(transfer_id=1, lease_id=1, token=b"t", group=0, runs=[(8, 4)], page_bytes=4096)
    s.sock.sendall(zmq_plane.frame(encode(h), 4 * 4096) + b"q" * 5000)
    s.close()  # 5000 of 16384 payload bytes, then the connection ends
    st = rx.wait(1, 5.0)
    assert st.failed and "broke off" in st.error and "5000 of 16384" in st.error, st
    assert rx.stats["payload_broken"] == 1
    _push_ok(rx, tx, 2, pool)  # the receiver keeps serving other transfers
    assert rx.health() == (True, "")


@pytest.mark.parametrize(
    "preamble, needle",
    [
        (b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f", "ZMTP"),
        (zmq_plane.STREAM_MAGIC + b"\x07", "stream protocol version 7"),
        (b"GET / HTTP/1.1\r\n", "not a disagg data stream"),
    ],
    ids=["zmq_peer", "other_version", "garbage"],
)
def test_bad_preamble_is_refused_by_name_and_the_receiver_serves_on(
    planes, caplog, preamble, needle
):
    rx, tx = planes
    pool = torch.zeros(8, 256, dtype=torch.uint8)
    rx.register_regions([[pool]])
    s = zmq_plane.StreamPush(rx.endpoint, preamble=preamble)
    try:
        s.sock.settimeout(5)
        assert s.sock.recv(16) == zmq_plane.PREAMBLE  # it says which version it speaks
        try:  # and closes that connection (a reset when our extra bytes went unread)
            assert s.sock.recv(16) == b""
        except ConnectionResetError:
            pass
    finally:
        s.close()
    assert rx.stats["rejected_BAD_VERSION"] == 1
    assert any(needle in r.getMessage() for r in caplog.records), caplog.text
    _push_ok(rx, tx, 1, pool)


def test_sender_names_the_version_a_receiver_refused_it_for():
    """A receiver of another stream version refuses our preamble and says its own: the
    push fails naming it (not a bare connection reset)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def fake_receiver() -> None:
        c, _ = srv.accept()
        c.recv(8)
        c.sendall(zmq_plane.STREAM_MAGIC + b"\x02")
        time.sleep(0.2)
        c.close()

    t = threading.Thread(target=fake_receiver, daemon=True)
    t.start()
    tx = ZmqDataPlane()
    try:
        src = torch.zeros(64, 1 << 20, dtype=torch.uint8)
        h = tx.post_push(f"tcp://127.0.0.1:{port}", 1, 1, b"t", [(0, src, list(range(64)))], 5)
        st = tx.wait_push(h, 10)
        assert st.failed and "stream version 2" in st.error, st
    finally:
        tx.close()
        srv.close()


def test_out_of_range_batch_is_skipped_before_a_byte_lands(planes):
    rx, tx = planes
    pool = torch.zeros(16, 64, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [3], 5.0)
    s = zmq_plane.StreamPush(rx.endpoint)
    try:
        h = PageBatch(transfer_id=1, lease_id=1, token=b"t", group=0, runs=[(14, 3)], page_bytes=64)
        s.send_multipart([encode(h), b"w" * 192])
        st = rx.wait(1, 5.0)
        assert st.failed and "outside [0, 16)" in st.error
        assert int(pool.sum()) == 0
        rx.expect(2, 1, b"t", [1], 5.0)  # the same connection, still in step
        h = PageBatch(transfer_id=2, lease_id=1, token=b"t", group=0, runs=[(3, 1)], page_bytes=64)
        s.send_multipart([encode(h), b"v" * 64])
        s.send(encode(TransferDone(transfer_id=2, lease_id=1, token=b"t")))
        assert rx.wait(2, 5.0).done and bytes(pool[3].numpy()) == b"v" * 64
    finally:
        s.close()


def test_abort_cuts_off_a_payload_that_stalled_mid_way(planes):
    """A sender that stops mid-payload: abort ends the write at once (no write left
    in flight), nothing more of it lands, and the receiver serves on."""
    rx, tx = planes
    pool = torch.zeros(16, 4096, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [4], 30.0)
    s = zmq_plane.StreamPush(rx.endpoint)
    try:
        h = PageBatch(
            transfer_id=1, lease_id=1, token=b"t", group=0, runs=[(8, 4)], page_bytes=4096
        )
        s.sock.sendall(zmq_plane.frame(encode(h), 4 * 4096) + b"q" * 100)
        end = time.monotonic() + 5
        while rx.poll(1).state.value != "receiving" and time.monotonic() < end:
            time.sleep(0.01)
        t = time.monotonic()
        assert rx.abort(1, "cancelled") == 0
        assert time.monotonic() - t < 1.0
        assert rx.poll(1).error == "cancelled"
        with pytest.raises(OSError):  # the connection was shut down under the sender
            for _ in range(100):
                s.sock.sendall(b"q" * 65536)
                time.sleep(0.01)
    finally:
        s.close()
    assert int(pool[8:12].sum()) == 100 * ord("q")  # what had arrived, nothing after
    _push_ok(rx, tx, 2, pool)


def test_stalled_consumer_does_not_hold_back_another(planes):
    """A consumer that accepts the connection but never reads: pushes to it stall at
    their deadline, while a push to a live consumer completes meanwhile."""
    rx, tx = planes
    pool = torch.zeros(8, 4096, dtype=torch.uint8)
    rx.register_regions([[pool]])
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        big = torch.zeros(128, 1 << 20, dtype=torch.uint8)  # far more than socket buffers
        stuck = tx.post_push(
            f"tcp://127.0.0.1:{srv.getsockname()[1]}", 9, 1, b"t", [(0, big, range(128))], 2.0
        )
        time.sleep(0.3)  # the stuck lane is blocked in its send now
        t = time.monotonic()
        _push_ok(rx, tx, 1, pool)
        assert time.monotonic() - t < 1.5
        st = tx.wait_push(stuck, 5.0)
        assert st.failed and "deadline" in st.error, st
    finally:
        srv.close()


def test_close_fails_a_push_blocked_on_a_stalled_peer_promptly():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    tx = ZmqDataPlane()
    try:
        big = torch.zeros(128, 1 << 20, dtype=torch.uint8)
        h = tx.post_push(
            f"tcp://127.0.0.1:{srv.getsockname()[1]}", 1, 1, b"t", [(0, big, range(128))], 60.0
        )
        time.sleep(0.3)
        t = time.monotonic()
        tx.close()
        assert time.monotonic() - t < 2.0
        st = tx.poll_push(h)
        assert st.failed and st.error == "data plane closed", st
    finally:
        srv.close()
