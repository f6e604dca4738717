"""The tcp plane's payload stream: the iovec loops (C ``_streamio`` and the Python
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
from disagg.transport import TcpDataPlane, tcp

PATHS = ["native", "python"]


@pytest.fixture
def path(request, monkeypatch):
    """Run the test on the C extension or on the pure-Python fallback."""
    if request.param == "python":
        monkeypatch.setattr(tcp.rowio, "_native", None)
    elif tcp.rowio._streamio is None:
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
        got = tcp.rowio.recv_rows(a, dst, slots, _cols(spans), time.monotonic() + 10)
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
        sent = tcp.rowio.send_rows(a, head, src, rows, _cols(spans), time.monotonic() + 10)
        t.join(10)
        assert sent == len(want) and out[0] == want
    finally:
        a.close()
        b.close()


def test_native_and_python_paths_agree(monkeypatch):
    """The same scattered send and receive through both implementations, on a strided
    view (row stride above the row width) with three spans: identical bytes."""
    if tcp.rowio._streamio is None:
        pytest.skip("the _streamio extension is not built")
    rng = np.random.default_rng(7)
    backing = rng.integers(0, 256, (600, 200), dtype=np.uint8)
    src = backing[:, 10:170]  # rows of 160 bytes, stride 200
    spans = ((0, 32), (64, 8), (100, 60))
    rows = rng.integers(0, 600, 1500).astype(np.int64)  # repeats allowed when sending
    slots = rng.permutation(600)[:500].astype(np.int64)
    results = []
    for native in (True, False):
        monkeypatch.setattr(tcp.rowio, "_native", tcp.rowio._streamio if native else None)
        a, b = pair()
        out: list[bytes] = []
        try:
            wire_len = rows.size * 100
            t = _drain(b, wire_len, out)
            tcp.rowio.send_rows(a, None, src, rows, _cols(spans), time.monotonic() + 10)
            t.join(10)
            dst_backing = np.zeros((600, 200), dtype=np.uint8)
            dst = dst_backing[:, 20:180]
            feeder = _feed(b, out[0][: slots.size * 100])
            tcp.rowio.recv_rows(a, dst, slots, _cols(spans), time.monotonic() + 10)
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
            tcp.rowio.recv_rows(a, dst, np.array([0, 1, 8, 2]), _cols([(0, 16)]), 0)
        with pytest.raises(IndexError, match=r"row -1 \(index 0\)"):
            tcp.rowio.recv_rows(a, dst, np.array([-1]), _cols([(0, 16)]), 0)
        with pytest.raises(IndexError, match="column span 1"):
            tcp.rowio.recv_rows(a, dst, np.array([0]), _cols([(0, 8), (10, 7)]), 0)
        assert int(dst.sum()) == 0
        assert len(a.recv(64)) == 64  # nothing was consumed from the socket
        with pytest.raises(IndexError, match=r"row 9 \(index 1\)"):
            tcp.rowio.send_rows(a, b"head", dst, np.array([0, 9]), _cols([(0, 16)]), 0)
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
            tcp.rowio.recv_rows(a, dst, np.arange(4), _cols([(0, 1024)]), time.monotonic() + 5)
    finally:
        a.close()
    a, b = pair()
    try:
        b.sendall(b"z" * 100)
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="100 of 4096 payload bytes received"):
            tcp.rowio.recv_rows(a, dst, np.arange(4), _cols([(0, 1024)]), time.monotonic() + 0.2)
        assert time.monotonic() - t < 2.0
        big = np.zeros((64, 1 << 20), dtype=np.uint8)  # more than the socket buffers hold
        with pytest.raises(TimeoutError, match="payload bytes sent"):
            tcp.rowio.send_rows(
                a, None, big, np.arange(64), _cols([(0, 1 << 20)]), time.monotonic() + 0.2
            )
    finally:
        a.close()
        b.close()


def test_missing_extension_raises_when_native_is_required():
    code = (
        "import sys; sys.modules['disagg.transport._streamio'] = None\n"
        "try:\n"
        "    import disagg.transport.tcp\n"
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
    rx, tx = TcpDataPlane(), TcpDataPlane()
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
    s = tcp.wire.StreamPush(rx.endpoint)
    h = PageBatch(transfer_id=1, lease_id=1, token=b"t", group=0, runs=[(8, 4)], page_bytes=4096)
    s.sock.sendall(tcp.wire.frame(encode(h), 4 * 4096) + b"q" * 5000)
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
        (tcp.wire.STREAM_MAGIC + b"\x07", "stream protocol version 7"),
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
    s = tcp.wire.StreamPush(rx.endpoint, preamble=preamble)
    try:
        s.sock.settimeout(5)
        assert s.sock.recv(16) == tcp.wire.PREAMBLE  # it says which version it speaks
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
        c.sendall(tcp.wire.STREAM_MAGIC + b"\x01")
        time.sleep(0.2)
        c.close()

    t = threading.Thread(target=fake_receiver, daemon=True)
    t.start()
    tx = TcpDataPlane()
    try:
        src = torch.zeros(64, 1 << 20, dtype=torch.uint8)
        h = tx.post_push(f"tcp://127.0.0.1:{port}", 1, 1, b"t", [(0, src, list(range(64)))], 5)
        st = tx.wait_push(h, 10)
        assert st.failed and "stream version 1" in st.error, st
    finally:
        tx.close()
        srv.close()


def test_out_of_range_batch_is_skipped_before_a_byte_lands(planes):
    rx, tx = planes
    pool = torch.zeros(16, 64, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [3], 5.0)
    s = tcp.wire.StreamPush(rx.endpoint)
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
    s = tcp.wire.StreamPush(rx.endpoint)
    try:
        h = PageBatch(
            transfer_id=1, lease_id=1, token=b"t", group=0, runs=[(8, 4)], page_bytes=4096
        )
        s.sock.sendall(tcp.wire.frame(encode(h), 4 * 4096) + b"q" * 100)
        end = time.monotonic() + 5  # the bytes themselves landed, not only the header
        while int(pool[8:12].sum()) != 100 * ord("q") and time.monotonic() < end:
            time.sleep(0.01)
        assert rx.poll(1).state.value == "receiving"
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
    tx = TcpDataPlane()
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


# ------------------------------------------------------------------------- the pipe path
needs_native = pytest.mark.skipif(
    tcp.rowio._streamio is None, reason="the _streamio extension is not built"
)


def _pipe(size: int = 1 << 20) -> tuple[int, int]:
    got = tcp.rowio.open_pipe()
    assert got is not None, "no pipe of MIN_PIPE_BYTES on this box"
    return got


@pytest.fixture
def piped():
    """(pipe read end, pipe write end, sender socket, receiver socket), closed after."""
    r, w = _pipe()
    a, b = pair()
    yield r, w, a, b
    for fd in (r, w):
        os.close(fd)
    a.close()
    b.close()


@needs_native
@pytest.mark.parametrize("width, n, spans", CASES)
def test_splice_then_readv_between_random_rows_is_byte_exact(width, n, spans, piped):
    """vmsplice from random rows into the pipe, readv out of it into random slots (two
    threads: the pipe holds 1 MiB at a time): the slots hold exactly the rows' columns."""
    rng = np.random.default_rng(width * 5 + n)
    src = rng.integers(0, 256, (2 * n, width), dtype=np.uint8)
    rows = rng.permutation(2 * n)[:n].astype(np.int64)
    slots = rng.permutation(2 * n)[:n].astype(np.int64)
    dst = np.zeros_like(src)
    r, w, a, b = piped
    sent: list[int] = []
    t = threading.Thread(
        target=lambda: sent.append(
            tcp.rowio.splice_rows(w, a, src, rows, _cols(spans), time.monotonic() + 10)
        )
    )
    t.start()
    got = tcp.rowio.recv_pipe_rows(r, b, dst, slots, _cols(spans), time.monotonic() + 10)
    t.join(10)
    tcp.rowio.drain_pipe(w, a, time.monotonic() + 1)  # empty: returns at once
    per_row = sum(c for _, c in spans)
    assert sent == [n * per_row] and got == n * per_row
    want = np.zeros_like(src)
    pages = _ref_pages(src, rows, spans)
    col = 0
    for o, c in spans:
        want[slots, o : o + c] = pages[:, col : col + c]
        col += c
    assert np.array_equal(dst, want)


@needs_native
def test_spliced_pages_are_referenced_until_read(piped):
    """Why the sender drains the pipe before TransferDone: a row changed after vmsplice
    and before the reader's readv reaches the reader changed."""
    src = np.full((4, 4096), 1, dtype=np.uint8)
    dst = np.zeros_like(src)
    r, w, a, b = piped
    tcp.rowio.splice_rows(w, a, src, np.arange(4), _cols([(0, 4096)]), time.monotonic() + 5)
    with pytest.raises(TimeoutError, match="16384 payload bytes still unread"):
        tcp.rowio.drain_pipe(w, a, time.monotonic() + 0.05)
    src[2] = 7  # the "reused" row
    tcp.rowio.recv_pipe_rows(r, b, dst, np.arange(4), _cols([(0, 4096)]), 0)
    assert int(dst[2, 0]) == 7 and int(dst[1, 0]) == 1
    tcp.rowio.drain_pipe(w, a, time.monotonic() + 1)


@needs_native
def test_pipe_eof_cut_and_deadline_mid_payload_raise_clear_errors():
    dst = np.zeros((4, 1024), dtype=np.uint8)
    cols = _cols([(0, 1024)])
    r, w = _pipe()
    a, b = pair()
    try:  # the sender wrote part of the payload and went away: EOF
        os.write(w, b"y" * 1500)
        os.close(w)
        w = -1
        with pytest.raises(ConnectionError, match="1500 of 4096 payload bytes received"):
            tcp.rowio.recv_pipe_rows(r, b, dst, np.arange(4), cols, time.monotonic() + 5)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    r, w = _pipe()
    try:
        os.write(w, b"z" * 100)
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="100 of 4096 payload bytes received"):
            tcp.rowio.recv_pipe_rows(r, b, dst, np.arange(4), cols, time.monotonic() + 0.2)
        assert time.monotonic() - t < 2.0
        # a stalled read ends at once when its stream socket is shut down (abort)
        threading.Timer(0.2, lambda: b.shutdown(socket.SHUT_RDWR)).start()
        t = time.monotonic()
        with pytest.raises(ConnectionError, match="shut down with 0 of 4096"):
            tcp.rowio.recv_pipe_rows(r, b, dst, np.arange(4), cols, time.monotonic() + 10)
        assert time.monotonic() - t < 2.0
        # and a full pipe's writer when the peer's end of the socket is shut down
        big = np.zeros((64, 1 << 20), dtype=np.uint8)
        with pytest.raises(ConnectionError, match="shut down with"):
            tcp.rowio.splice_rows(w, a, big, np.arange(64), _cols([(0, 1 << 20)]), 0)
        with pytest.raises(ConnectionError, match="still unread in its pipe"):
            tcp.rowio.drain_pipe(w, a, 0)
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


@needs_native
def test_splice_into_a_pipe_without_reader_fails_without_killing_the_process():
    """EPIPE, not SIGPIPE, even where the program left SIGPIPE at its default action."""
    code = (
        "import os, signal, socket, time, numpy as np\n"
        "from disagg.transport import tcp\n"
        "signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
        "r, w = tcp.rowio.open_pipe(); os.close(r)\n"
        "a, b = socket.socketpair()\n"
        "src = np.ones((4, 4096), dtype=np.uint8)\n"
        "try:\n"
        "    tcp.rowio.splice_rows(w, a, src, np.arange(4), np.array([[0, 4096]]), 0)\n"
        "except BrokenPipeError as e:\n"
        "    print('EPIPE', e)\n"
        "    raise SystemExit(5)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 5, (p.returncode, p.stdout, p.stderr)
    assert "0 of 16384 payload bytes sent" in p.stdout


class PipeClient:
    """A hand-made MODE_PIPE sender: headers on the AF_UNIX stream, payloads written
    into the pipe whose read end went with the hello."""

    def __init__(self, endpoint: str, mode: int = tcp.wire.MODE_PIPE, fds=None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(endpoint[len("ipc://") :])
        self.r, self.w = os.pipe()
        hello = tcp.wire.PREAMBLE + bytes([mode])
        socket.send_fds(self.sock, [hello], [self.r] if fds is None else fds)
        self.answer = self.sock.recv(16)

    def batch(self, header: bytes, payload: bytes, declared: int | None = None) -> None:
        n = len(payload) if declared is None else declared
        self.sock.sendall(tcp.wire.frame(header, n, piped=True))
        os.write(self.w, payload)

    def close(self) -> None:
        self.sock.close()
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass


@pytest.fixture
def unix_planes(tmp_path):
    rx = TcpDataPlane(f"ipc://{tmp_path}/rx.sock")
    tx = TcpDataPlane(f"ipc://{tmp_path}/tx.sock")
    yield rx, tx
    rx.close()
    tx.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@needs_native
@pytest.mark.parametrize("rx_pipe, tx_pipe", [(True, True), (False, True), (True, False)])
def test_ipc_push_negotiates_the_pipe_and_lands_byte_exact(monkeypatch, tmp_path, rx_pipe, tx_pipe):
    """Store rows to random slots over ipc: the pipe when both ends allow it
    (DISAGG_STREAM_PIPE=0 on either end keeps the plain stream), the same bytes."""
    monkeypatch.setenv("DISAGG_STREAM_PIPE", "1" if rx_pipe else "0")
    rx = TcpDataPlane(f"ipc://{tmp_path}/rx.sock")
    monkeypatch.setenv("DISAGG_STREAM_PIPE", "1" if tx_pipe else "0")
    tx = TcpDataPlane(f"ipc://{tmp_path}/tx.sock")
    try:
        from disagg.transport.dataplane import StoreRows

        rng = np.random.default_rng(3)
        # group 0: pages of two column spans of 8 KiB rows (below PIPE_MIN_PAGE: on the
        # stream); group 1: 64 KiB pages (in the pipe, when there is one)
        store0 = torch.from_numpy(rng.integers(0, 256, (600, 8192), dtype=np.uint8))
        store1 = torch.from_numpy(rng.integers(0, 256, (64, 65536), dtype=np.uint8))
        cols = ((0, 3000), (5000, 3192))
        pool0 = torch.zeros(600, 6192, dtype=torch.uint8)
        pool1 = torch.zeros(64, 65536, dtype=torch.uint8)
        want0 = torch.cat([store0[:, 0:3000], store0[:, 5000:8192]], dim=1)
        rx.register_regions([[pool0], [pool1]])
        rows0, slots0 = rng.permutation(600)[:300], rng.permutation(600)[:300]
        rows1, slots1 = rng.permutation(64)[:40], rng.permutation(64)[:40]
        for tid in (1, 2):  # the second push reuses the lane's connection (and pipe)
            rx.expect(
                tid, 1, b"t", [300, 40], 10.0, slots_by_group=[slots0.tolist(), slots1.tolist()]
            )
            srcs = [
                (0, StoreRows(store0, rows0, cols), slots0.tolist()),
                (1, StoreRows(store1, rows1, ((0, 65536),)), slots1.tolist()),
            ]
            h = tx.post_push(rx.endpoint, tid, 1, b"t", srcs, 10.0)
            assert tx.wait_push(h, 10).done
            assert rx.wait(tid, 10).done
            assert torch.equal(pool0[slots0], want0[rows0])
            assert torch.equal(pool1[slots1], store1[rows1])
            pool0.zero_()
            pool1.zero_()
        lane = next(iter(tx._lanes.values()))
        assert (lane.pipe is not None) == (rx_pipe and tx_pipe)
        with rx._conns_lock:
            assert [c.pipe is not None for c in rx._conns] == [rx_pipe and tx_pipe]
    finally:
        rx.close()
        tx.close()


@needs_native
@pytest.mark.parametrize(
    "case, needle",
    [
        ("no_fd", "needs one file descriptor, 0 came"),
        ("two_fds", "needs one file descriptor, 2 came"),
        ("write_end", "not the read end of a pipe"),
        ("regular_file", "not the read end of a pipe"),
        ("unknown_mode", "unknown payload mode 7"),
        ("inline_with_fd", "came with an inline stream's hello"),
    ],
)
def test_bad_pipe_hello_is_refused_by_name_and_the_receiver_serves_on(
    unix_planes, caplog, tmp_path, case, needle
):
    rx, tx = unix_planes
    pool = torch.zeros(8, 256, dtype=torch.uint8)
    rx.register_regions([[pool]])
    before = _open_fds()
    r, w = os.pipe()
    f = os.open(tmp_path / "file", os.O_CREAT | os.O_RDONLY)
    fds, mode = {
        "no_fd": ([], tcp.wire.MODE_PIPE),
        "two_fds": ([r, r], tcp.wire.MODE_PIPE),
        "write_end": ([w], tcp.wire.MODE_PIPE),
        "regular_file": ([f], tcp.wire.MODE_PIPE),
        "unknown_mode": ([], 7),
        "inline_with_fd": ([r], tcp.wire.MODE_INLINE),
    }[case]
    c = PipeClient(rx.endpoint, mode, fds)
    try:
        assert c.answer == tcp.wire.PREAMBLE  # refused: its preamble alone, then closed
        assert c.sock.recv(16) == b""
    finally:
        c.close()
        for fd in (r, w, f):
            os.close(fd)
    assert rx.stats["rejected_BAD_HELLO"] == 1
    assert any(needle in rec.getMessage() for rec in caplog.records), caplog.text
    end = time.monotonic() + 5  # the receiver closed the connection and what came with it
    while _open_fds() > before and time.monotonic() < end:
        time.sleep(0.02)
    assert _open_fds() == before
    _push_ok(rx, tx, 1, pool)


@needs_native
def test_pipe_stream_refuses_a_bad_batch_before_a_byte_lands_and_keeps_in_step(unix_planes):
    """Over the pipe: a batch outside the pool is refused from its header (its payload
    is read out of the pipe and dropped, nothing lands); the next one lands."""
    rx, _ = unix_planes
    pool = torch.zeros(16, 64, dtype=torch.uint8)
    rx.register_regions([[pool]])
    c = PipeClient(rx.endpoint)
    try:
        assert c.answer == tcp.wire.PREAMBLE + bytes([tcp.wire.MODE_PIPE])
        rx.expect(1, 1, b"t", [3], 5.0)
        h = PageBatch(transfer_id=1, lease_id=1, token=b"t", group=0, runs=[(14, 3)], page_bytes=64)
        c.batch(encode(h), b"w" * 192)
        st = rx.wait(1, 5.0)
        assert st.failed and "outside [0, 16)" in st.error
        rx.expect(2, 1, b"u", [1], 5.0)  # a wrong token: refused, payload skipped
        h = PageBatch(transfer_id=2, lease_id=1, token=b"x", group=0, runs=[(3, 1)], page_bytes=64)
        c.batch(encode(h), b"x" * 64)
        h = PageBatch(transfer_id=2, lease_id=1, token=b"u", group=0, runs=[(3, 1)], page_bytes=64)
        c.batch(encode(h), b"v" * 64)
        c.sock.sendall(
            tcp.wire.frame(encode(TransferDone(transfer_id=2, lease_id=1, token=b"u")), 0)
        )
        assert rx.wait(2, 5.0).done
        assert bytes(pool[3].numpy()) == b"v" * 64
        assert int(pool.sum()) == 64 * ord("v")
    finally:
        c.close()


@needs_native
def test_pipe_stream_short_payload_fails_the_transfer_and_the_receiver_serves_on(unix_planes):
    rx, tx = unix_planes
    pool = torch.zeros(16, 4096, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [4], 5.0)
    c = PipeClient(rx.endpoint)
    h = PageBatch(transfer_id=1, lease_id=1, token=b"t", group=0, runs=[(8, 4)], page_bytes=4096)
    c.batch(encode(h), b"q" * 5000, declared=4 * 4096)
    c.close()  # 5000 of 16384 payload bytes, then the sender is gone
    st = rx.wait(1, 5.0)
    assert st.failed and "broke off" in st.error and "5000 of 16384" in st.error, st
    _push_ok(rx, tx, 2, pool)
    assert rx.health() == (True, "")


@needs_native
def test_pipe_stream_abort_cuts_off_a_stalled_payload(unix_planes):
    rx, tx = unix_planes
    pool = torch.zeros(16, 4096, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [4], 30.0)
    c = PipeClient(rx.endpoint)
    try:
        h = PageBatch(
            transfer_id=1, lease_id=1, token=b"t", group=0, runs=[(8, 4)], page_bytes=4096
        )
        c.batch(encode(h), b"q" * 100, declared=4 * 4096)
        # wait for the 100 bytes themselves, not only the accepted header: on a loaded
        # box the abort could otherwise come before the receiver read them from the pipe
        end = time.monotonic() + 5
        while int(pool[8:12].sum()) != 100 * ord("q") and time.monotonic() < end:
            time.sleep(0.01)
        assert rx.poll(1).state.value == "receiving"
        t = time.monotonic()
        assert rx.abort(1, "cancelled") == 0  # no write left in flight
        assert time.monotonic() - t < 1.0
        assert rx.poll(1).error == "cancelled"
        assert c.sock.recv(16) == b""  # the connection was shut down under the sender
        os.write(c.w, b"q" * 1000)  # nothing more of it lands
        time.sleep(0.1)
    finally:
        c.close()
    assert int(pool[8:12].sum()) == 100 * ord("q")
    _push_ok(rx, tx, 2, pool)


@needs_native
def test_pipe_push_is_done_only_after_the_receiver_read_the_pipe(tmp_path):
    """The sender's rows stay referenced by the pipe until the receiver reads them: the
    push is not DONE (and no TransferDone is sent) before that. A fake receiver reads
    the headers but holds the last payload back."""
    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    seen: list[str] = []
    release = threading.Event()

    def fake_receiver() -> None:
        c, _ = srv.accept()
        c.settimeout(10)
        hello, fds, _, _ = socket.recv_fds(c, 9, 4)
        assert hello == tcp.wire.PREAMBLE + bytes([tcp.wire.MODE_PIPE]) and len(fds) == 1
        c.sendall(tcp.wire.PREAMBLE + bytes([tcp.wire.MODE_PIPE]))
        prefix = c.recv(12, socket.MSG_WAITALL)
        hlen, plen = tcp.wire.PREFIX.unpack(prefix)
        c.recv(hlen, socket.MSG_WAITALL)
        seen.append(f"batch {plen & ~tcp.wire.PIPED} piped={bool(plen & tcp.wire.PIPED)}")
        plen &= ~tcp.wire.PIPED
        release.wait(10)
        with os.fdopen(fds[0], "rb") as pipe:
            got = 0
            while got < plen:
                got += len(pipe.read(plen - got))
        seen.append("payload read")
        prefix = c.recv(12, socket.MSG_WAITALL)
        hlen, _ = tcp.wire.PREFIX.unpack(prefix)
        c.recv(hlen, socket.MSG_WAITALL)
        seen.append("done")
        time.sleep(0.5)
        c.close()

    t = threading.Thread(target=fake_receiver, daemon=True)
    t.start()
    tx = TcpDataPlane(f"ipc://{tmp_path}/tx.sock")
    try:
        src = torch.ones(4, 65536, dtype=torch.uint8)  # pages of PIPE_MIN_PAGE: piped
        h = tx.post_push(f"ipc://{path}", 1, 1, b"t", [(0, src, list(range(4)))], 10)
        end = time.monotonic() + 5
        while not seen and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.3)  # the whole payload sits in the pipe by now, unread
        assert seen == ["batch 262144 piped=True"]
        assert tx.poll_push(h).state.value == "receiving"
        release.set()
        assert tx.wait_push(h, 10).done
        t.join(5)
        assert seen[1:] == ["payload read", "done"]
    finally:
        tx.close()
        srv.close()


@needs_native
def test_a_piped_payload_on_a_stream_without_pipe_closes_that_connection(unix_planes):
    """The prefix says the payload is in a pipe the connection does not have: where the
    payload is cannot be known, so that connection closes (counted), nothing lands, and
    the receiver serves on."""
    rx, tx = unix_planes
    pool = torch.zeros(16, 64, dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [1], 5.0)
    s = tcp.wire.StreamPush(rx.endpoint)
    try:
        s.sock.settimeout(5)
        h = PageBatch(transfer_id=1, lease_id=1, token=b"t", group=0, runs=[(2, 1)], page_bytes=64)
        s.sock.sendall(tcp.wire.frame(encode(h), 64, piped=True) + b"p" * 64)
        assert s.sock.recv(16) == tcp.wire.PREAMBLE + bytes([tcp.wire.MODE_INLINE])
        try:  # closed (a reset: our payload bytes went unread)
            assert s.sock.recv(16) == b""
        except ConnectionResetError:
            pass
    finally:
        s.close()
    assert rx.stats["rejected_framing"] == 1
    assert int(pool.sum()) == 0
    _push_ok(rx, tx, 2, pool)
