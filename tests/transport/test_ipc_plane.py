"""The same-host (ipc) data plane: the receiver copies pages out of the sender's store.

Host memory (/dev/shm) here, so CI covers every check and state; the CUDA IPC path is the
same code with another mapping (GPU runs: DISAGG_TEST_DEVICE=cuda, and ``disagg bench
gpu``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import time

import numpy as np
import pytest
import torch
from harness import spawn_context

from disagg.protocol import ipc as wire
from disagg.protocol.errors import ProtocolError
from disagg.protocol.version import PROTOCOL_VERSION
from disagg.transport import framed, page_copy
from disagg.transport.dataplane import StoreRows, TransferState
from disagg.transport.ipc import IpcDataPlane
from disagg.transport.ipc.host import HOST
from disagg.transport.ipc.staging import pieces
from disagg.transport.page_copy import copy_indexed

pytestmark = pytest.mark.timeout(60)
DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cpu")


@pytest.fixture
def planes():
    made: list[IpcDataPlane] = []

    def make() -> IpcDataPlane:
        made.append(IpcDataPlane())
        return made[-1]

    yield make
    for p in made:
        p.close()


def _store(rows: int = 64, width: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=g).to(DEVICE)


def _regions(slots: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.zeros((slots, n), dtype=torch.uint8, device=DEVICE) for n in sizes]


def _landed(regions: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
    return torch.cat(regions, dim=1)[torch.tensor(slots, device=regions[0].device)]


def test_scattered_rows_land_in_split_regions(planes):
    """Source spans (the layer's K and V columns) and destination regions (K and V
    pools) cut pages at different places; every byte lands where it belongs."""
    rx, tx = planes(), planes()
    slab = tx.register_source(_store())
    regions = _regions(40, (24, 40))
    rx.register_regions([regions])
    rows = np.array([9, 3, 4, 5, 60, 0])
    slots = [7, 8, 9, 2, 39, 0]
    cols = ((10, 30), (50, 34))  # 64 bytes per page, in two spans
    rx.expect(1, 5, b"t", [6], 10.0, [slots])
    h = tx.post_push(rx.endpoint, 1, 5, b"t", [(0, StoreRows(slab, rows, cols), slots)])
    assert rx.wait(1, 10).state is TransferState.DONE
    assert tx.wait_push(h, 10).done
    want = torch.cat([slab[:, 10:40], slab[:, 50:84]], dim=1)[torch.from_numpy(rows).to(DEVICE)]
    assert torch.equal(_landed(regions, slots), want)
    untouched = [s for s in range(40) if s not in slots]
    assert not _landed(regions, untouched).any(), "a slot outside the transfer was written"
    assert rx.stats["pages"] == 6 and tx.poll_push(h).nbytes == 6 * 64


def test_plain_tensor_sources_and_minus_one_slots(planes):
    rx, tx = planes(), planes()
    slab = tx.register_source(_store())
    regions = _regions(16, (96,))
    rx.register_regions([regions, _regions(16, (96,))])
    rx.expect(2, 1, b"k", [2, 1], 10.0)
    pages = [(0, slab[4:7], [3, -1, 5]), (1, slab[10:11], [0])]  # a view of the source
    h = tx.post_push(rx.endpoint, 2, 1, b"k", pages)
    assert rx.wait(2, 10).done, rx.poll(2)
    assert tx.wait_push(h, 10).done
    assert torch.equal(regions[0][3], slab[4]) and torch.equal(regions[0][5], slab[6])
    assert not regions[0][4].any()


def test_unregistered_host_memory_is_refused_at_once(planes):
    tx = planes()
    with pytest.raises(ValueError, match="register_source"):
        tx.post_push(
            "tcp://127.0.0.1:1", 1, 1, b"", [(0, torch.zeros((2, 8), dtype=torch.uint8), [0, 1])]
        )
    with pytest.raises(ValueError, match=">= -1"):
        tx.post_push(
            "tcp://127.0.0.1:1", 1, 1, b"", [(0, torch.zeros((1, 8), dtype=torch.uint8), [-2])]
        )


@pytest.mark.parametrize(
    "change, why",
    [
        (dict(token=b"wrong"), "not expected here"),
        (dict(lease_id=99), "not expected here"),
        (dict(slots=[1, 2, 3]), "not given"),
        (dict(rows=np.array([0, 1, 1000])), "reads up to byte"),
    ],
)
def test_refused_pushes_write_nothing(planes, change, why):
    rx, tx = planes(), planes()
    slab = tx.register_source(_store())
    regions = _regions(8, (96,))
    rx.register_regions([regions])
    rx.expect(3, 7, b"tok", [3], 10.0, [[0, 1, 2]])
    rows = change.get("rows", np.array([0, 1, 2]))
    h = tx.post_push(
        rx.endpoint,
        3,
        change.get("lease_id", 7),
        change.get("token", b"tok"),
        [(0, StoreRows(slab, rows, ((0, 96),)), change.get("slots", [0, 1, 2]))],
    )
    st = tx.wait_push(h, 10)
    assert st.failed and why in st.error, st
    assert not regions[0].any(), "a refused push wrote bytes"
    if "token" not in change and "lease_id" not in change:
        assert rx.poll(3).failed and why in rx.poll(3).error


def _dial(endpoint: str, magic: bytes = framed.MAGIC) -> socket.socket:
    """A plain blocking connection to a receiver, its preamble sent."""
    family, addr = framed.sockaddr(endpoint)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(addr)
    sock.sendall(magic)
    return sock


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def _read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            assert chunk, "connection closed"
            out += chunk
        return out

    (n,) = struct.unpack("<I", exactly(4))
    return exactly(n)


def _raw_push(rx: IpcDataPlane, **kw) -> wire.IpcAck:
    """Send one hand-made frame to ``rx`` and return its answer."""
    sock = _dial(rx.endpoint)
    try:
        sock.sendall(_frame(kw.pop("frame") if "frame" in kw else wire.encode(_push(**kw))))
        ack = wire.decode(_read_frame(sock))
        assert isinstance(ack, wire.IpcAck)
        return ack
    finally:
        sock.close()


def _push(
    export: wire.Export, rows: list[int] | bytes, slots: list[int] | bytes, width=8, **over
) -> wire.IpcPush:
    def blob(x):
        return x if isinstance(x, bytes) else np.asarray(x, dtype=f"<i{width}").tobytes()

    batch = wire.IpcBatch(
        group=0,
        export_id=export.export_id,
        base=0,
        row_stride=96,
        rows=blob(rows),
        slots=blob(slots),
        spans=[(0, 96)],
        page_bytes=96,
        index_bytes=width,
    )
    fields = dict(
        transfer_id=4,
        lease_id=1,
        token=b"t",
        exports=[export],
        batches=[batch],
        not_after=time.monotonic() + 10,
    )
    fields.update(over)
    return wire.IpcPush(**fields)


def _shm_export(**over) -> wire.Export:
    fields = dict(
        export_id=1, kind="shm", host=HOST, pid=os.getpid(), nbytes=96 * 4, name="disagg-ipc-1-1"
    )
    fields.update(over)
    return wire.Export(**fields)


@pytest.mark.parametrize(
    "export, why",
    [
        (dict(host="another-boot-id"), "another host"),
        (dict(name="../../etc/passwd"), "not a disagg shm file"),
        (dict(name="disagg-ipc-1-999999"), "cannot open shared memory"),
        (dict(kind="cuda", pid=1, device_uuid="GPU-none", handle=b"x" * 64), "GPU|no GPU"),
    ],
)
def test_hostile_exports_are_refused_by_name(planes, export, why):
    rx = planes()
    regions = _regions(8, (96,))
    rx.register_regions([regions])
    rx.expect(4, 1, b"t", [1], 10.0)
    ack = _raw_push(rx, export=_shm_export(**export), rows=[0], slots=[0])
    assert not ack.ok
    import re

    assert re.search(why, ack.message), ack.message
    assert rx.poll(4).failed and not regions[0].any()


def test_late_push_is_refused(planes):
    """Past the sender's deadline the sender may reuse its rows: no copy starts."""
    rx, tx = planes(), planes()
    slab = tx.register_source(_store())
    rx.register_regions([_regions(8, (96,))])
    rx.expect(4, 1, b"t", [1], 10.0)
    export = tx._sources[0].export
    ack = _raw_push(rx, export=export, rows=[0], slots=[0], not_after=time.monotonic() - 1)
    assert not ack.ok and "deadline" in ack.message
    assert slab.numel()


def test_a_copy_that_ends_after_the_senders_deadline_never_lands(planes, monkeypatch):
    """The sender may reuse its rows once its deadline passed: a copy still running then
    fails the transfer, whatever bytes it wrote."""
    from disagg.transport.ipc import receiver

    rx, tx = planes(), planes()
    slab = tx.register_source(_store())
    rx.register_regions([_regions(8, (96,))])
    copy = receiver.copy_batch

    def slow_copy(*args):
        time.sleep(1.0)  # past the push's deadline (0.5 s + the start margin)
        return copy(*args)

    monkeypatch.setattr(receiver, "copy_batch", slow_copy)
    rx.expect(11, 1, b"t", [1], 10.0)
    h = tx.post_push(rx.endpoint, 11, 1, b"t", [(0, slab[:1], [0])], deadline_s=0.5)
    st = rx.wait(11, 5)
    assert st.failed and "after the sender's deadline" in st.error, st
    assert tx.wait_push(h, 5).failed


def test_malformed_frames_are_counted_and_the_plane_keeps_serving(planes):
    rx, tx = planes(), planes()
    slab = tx.register_source(_store())
    regions = _regions(8, (96,))
    rx.register_regions([regions])
    sock = _dial(rx.endpoint)
    bad_version = wire.encode(_push(_shm_export(), [0], [0])).replace(
        bytes([0xA1, ord("v"), PROTOCOL_VERSION]), bytes([0xA1, ord("v"), 0x7F])
    )
    nested = b"\x81\xa4kind" + b"\x91" * 100_000 + b"\x00"  # deeper than any stack
    frames = (b"", b"\xff\x00garbage", nested, bad_version, wire.encode(wire.IpcAck(transfer_id=1)))
    for frame in frames:
        sock.sendall(_frame(frame))
    # the same connection still serves: a frame split across writes is put back together
    whole = _frame(wire.encode(_push(_shm_export(), [0], [0], transfer_id=77)))
    sock.sendall(whole[:3])
    time.sleep(0.05)
    sock.sendall(whole[3:])
    ack = wire.decode(_read_frame(sock))
    assert isinstance(ack, wire.IpcAck) and ack.transfer_id == 77 and "not expected" in ack.message
    sock.close()
    # framing errors close that connection only: a stranger's preamble, a frame over the
    # limit
    for payload in (b"GET / HTTP/1.1\r\n\r\n", framed.MAGIC + struct.pack("<I", 1 << 31)):
        s2 = _dial(rx.endpoint, magic=b"")
        s2.sendall(payload)
        assert s2.recv(1) == b"", "the receiver kept a connection that broke the framing"
        s2.close()
    assert rx.stats["rejected_BAD_FRAME"] >= 3 and rx.stats["rejected_BAD_VERSION"] == 2
    assert rx.stats["rejected_TOO_LARGE"] == 1
    assert rx.stats["rejected_kind"] == 1
    rx.expect(5, 1, b"t", [1], 10.0)
    h = tx.post_push(rx.endpoint, 5, 1, b"t", [(0, slab[2:3], [6])])
    assert tx.wait_push(h, 10).done and torch.equal(regions[0][6], slab[2])
    assert rx.health() == (True, "")


def test_absent_receiver_fails_the_push_at_its_deadline(planes):
    tx = planes()
    slab = tx.register_source(_store())
    t0 = time.monotonic()
    h = tx.post_push("tcp://127.0.0.1:9", 6, 1, b"t", [(0, slab[:2], [0, 1])], deadline_s=0.5)
    st = tx.wait_push(h, 5)
    assert st.failed and "deadline" in st.error
    assert time.monotonic() - t0 < 3


def test_abort_then_push_writes_nothing_and_failure_reports_reach_the_receiver(planes):
    rx, tx = planes(), planes()
    slab = tx.register_source(_store())
    regions = _regions(8, (96,))
    rx.register_regions([regions])
    rx.expect(7, 1, b"t", [1], 10.0)
    rx.abort(7, "request cancelled")
    h = tx.post_push(rx.endpoint, 7, 1, b"t", [(0, slab[:1], [0])])
    st = tx.wait_push(h, 10)
    assert st.failed and "failed" in st.error and not regions[0].any()
    rx.expect(8, 1, b"t", [1], 10.0)
    tx.post_failure(rx.endpoint, 8, b"t", "store row evicted")
    st = rx.wait(8, 5)
    assert st.failed and "store row evicted" in st.error


def _child_sender(endpoint: str, q: mp.Queue) -> None:
    """Another process: registers its store in /dev/shm and pushes from it."""
    tx = IpcDataPlane()
    slab = tx.register_source(_store(seed=3).cpu())
    h = tx.post_push(
        endpoint, 9, 2, b"x", [(0, StoreRows(slab, np.array([5, 1, 2]), ((0, 96),)), [4, 0, 1])]
    )
    q.put((tx.wait_push(h, 60).state.value, slab[[5, 1, 2]].numpy().tobytes()))
    tx.close()


def test_pages_cross_processes_through_shared_memory(planes):
    rx = planes()
    regions = [torch.zeros((8, 96), dtype=torch.uint8)]
    rx.register_regions([regions])
    rx.expect(9, 2, b"x", [3], 120.0, [[4, 0, 1]])  # the child imports torch first
    ctx = spawn_context()
    q = ctx.Queue()
    child = ctx.Process(target=_child_sender, args=(rx.endpoint, q))
    child.start()
    state, want = q.get(timeout=60)
    child.join(30)
    assert (state, rx.poll(9).state.value) == ("done", "done"), rx.poll(9)
    assert regions[0][[4, 0, 1]].numpy().tobytes() == want
    assert not any(n.startswith(f"disagg-ipc-{child.pid}-") for n in os.listdir("/dev/shm"))


def test_pieces_cut_spans_at_region_borders():
    assert pieces([(10, 30), (50, 34)], [24, 40]) == [
        (10, 0, 0, 24),
        (34, 1, 0, 6),
        (50, 1, 6, 34),
    ]
    assert pieces([(0, 8)], [8]) == [(0, 0, 0, 8)]


@pytest.mark.parametrize("offset", [0, 3])  # aligned: 8/4-byte elements; else bytes
@pytest.mark.parametrize("width", [8, 12, 96, 4099])
def test_copy_indexed_matches_fancy_indexing(width, offset):
    g = torch.Generator().manual_seed(width)
    src = torch.randint(0, 256, (50, width + 8), dtype=torch.uint8, generator=g).to(DEVICE)[
        :, offset : offset + width
    ]
    dst = torch.zeros((30, width), dtype=torch.uint8, device=DEVICE)
    si = torch.tensor([4, 9, 0, 49, 10, 11])
    di = torch.tensor([29, 0, 5, 6, 7, 1])
    copy_indexed(dst, di, src, si)
    want = torch.zeros_like(dst)
    want[di.to(DEVICE)] = src[si.to(DEVICE)]
    assert torch.equal(dst, want)
    copy_indexed(dst, torch.arange(10, 14), src, torch.arange(20, 24))  # runs: one slice copy
    assert torch.equal(dst[10:14], src[20:24])
    copy_indexed(dst, torch.tensor([2, 25, 3]), src, torch.arange(30, 33))  # source run
    assert torch.equal(dst[[2, 25, 3]], src[30:33])
    copy_indexed(dst, torch.arange(15, 18), src, torch.tensor([7, 1, 44]))  # destination run
    assert torch.equal(dst[15:18], src[[7, 1, 44]])
    with pytest.raises(ValueError, match="destination rows"):
        copy_indexed(dst, di[:2], src, si)


def test_pushes_carry_four_byte_indices_and_land_them(planes):
    """Indices that fit travel as int32 (half the bytes to send and stage); the receiver
    lands 4- and 8-byte index blobs alike."""
    rx, tx = planes(), planes()
    slab = tx.register_source(_store())
    regions = _regions(8, (96,))
    rx.register_regions([regions])
    rx.expect(21, 1, b"t", [2], 10.0, [[5, 2]])
    h = tx.post_push(rx.endpoint, 21, 1, b"t", [(0, StoreRows(slab, [7, 3], ((0, 96),)), [5, 2])])
    assert h.msg.batches[0].index_bytes == 4 and len(h.msg.batches[0].rows) == 8
    assert tx.wait_push(h, 10).done and rx.poll(21).done
    assert torch.equal(_landed(regions, [5, 2]), slab[[7, 3]])
    export = tx._sources[0].export
    for tid, width, row, slot in ((22, 8, 1, 6), (23, 4, 2, 7)):
        rx.expect(tid, 1, b"t", [1], 10.0)
        ack = _raw_push(rx, export=export, rows=[row], slots=[slot], width=width, transfer_id=tid)
        assert ack.ok, ack.message
        assert torch.equal(regions[0][slot], slab[row])


@pytest.mark.parametrize(
    "rows, slots, width, why",
    [
        ([0, 1], [0], 8, "2 source rows for 1 slots"),
        ([0], [0, 1], 4, "1 source rows for 2 slots"),
        (b"\x00" * 12, [0], 8, "rows blob of 12 bytes is not 8-byte integers"),
        ([0], b"\x00" * 6, 4, "slots blob of 6 bytes is not 4-byte integers"),
        ([-1], [0], 4, "negative source row -1"),
        ([1 << 40], [0], 8, "reads up to byte"),
        ([0], [-5], 4, "outside"),
        ([0], [1 << 33], 8, "outside"),
    ],
)
def test_malformed_index_blobs_are_refused_by_name(planes, rows, slots, width, why):
    rx, tx = planes(), planes()
    tx.register_source(_store())
    regions = _regions(8, (96,))
    rx.register_regions([regions])
    rx.expect(4, 1, b"t", [1], 10.0)
    ack = _raw_push(rx, export=tx._sources[0].export, rows=rows, slots=slots, width=width)
    assert not ack.ok and why in ack.message, ack.message
    assert rx.poll(4).failed and not regions[0].any()


def test_index_width_other_than_4_or_8_is_a_bad_field(planes):
    rx, tx = planes(), planes()
    tx.register_source(_store())
    rx.register_regions([_regions(8, (96,))])
    frame = wire.encode(_push(tx._sources[0].export, [0], [0])).replace(
        b"\xabindex_bytes\x08", b"\xabindex_bytes\x02"
    )
    with pytest.raises(ProtocolError, match="index_bytes"):
        wire.decode(frame)
    sock = _dial(rx.endpoint)
    sock.sendall(_frame(frame))
    deadline = time.monotonic() + 5
    while rx.stats["rejected_BAD_FIELD"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    sock.close()
    assert rx.stats["rejected_BAD_FIELD"] == 1


def test_a_receiver_started_late_still_gets_the_push(planes):
    """Nobody listens at first: the sender retries the connection until its deadline
    (never failing sooner), and the push lands once the receiver is up."""
    tx = planes()
    slab = tx.register_source(_store())
    path = f"/tmp/disagg-test-ipc-{os.getpid()}.sock"
    h = tx.post_push(f"ipc://{path}", 31, 1, b"t", [(0, slab[3:4], [2])], deadline_s=10)
    time.sleep(0.3)
    assert not tx.poll_push(h).final
    rx = IpcDataPlane(f"ipc://{path}.new")  # ready before the sender can reach it
    try:
        regions = _regions(4, (96,))
        rx.register_regions([regions])
        rx.expect(31, 1, b"t", [1], 10.0)
        os.rename(f"{path}.new", path)
        assert tx.wait_push(h, 10).done and rx.poll(31).done
        assert torch.equal(regions[0][2], slab[3])
    finally:
        rx.close()
        os.unlink(path)


def test_repeated_pushes_of_one_layout_land_exactly(planes):
    """Later pushes of the same layout reuse the copy worked out for the first (on a
    GPU: prepared copies over every row of the export; on the host: the one-pass table of
    its three pieces); each lands only its own rows."""
    rx, tx = planes(), planes()
    slab = tx.register_source(_store(rows=64))
    regions = _regions(40, (24, 40))
    rx.register_regions([regions])
    cols = ((10, 30), (50, 34))
    g = np.random.default_rng(5)
    for tid in (41, 42, 43):
        rows = g.permutation(64)[:5]
        slots = g.permutation(40)[:5].tolist()
        for r in regions:
            r.zero_()
        rx.expect(tid, 5, b"t", [5], 10.0, [slots])
        h = tx.post_push(rx.endpoint, tid, 5, b"t", [(0, StoreRows(slab, rows, cols), slots)])
        assert tx.wait_push(h, 10).done and rx.wait(tid, 10).done
        want = torch.cat([slab[:, 10:40], slab[:, 50:84]], dim=1)[torch.from_numpy(rows).to(DEVICE)]
        assert torch.equal(_landed(regions, slots), want)
        untouched = [s for s in range(40) if s not in slots]
        assert not _landed(regions, untouched).any()
    if DEVICE == "cuda" or page_copy._rowcopy is not None:
        assert len(rx._prepared) == 1, "the layout's copies were prepared more than once"


def test_many_pushes_in_flight_reuse_the_index_staging(planes):
    """More pushes in flight than the receiver's staging buffers, of odd page counts (the
    rows' part of a staged buffer is padded to 16 bytes) and two layer groups per push
    (two batches staged per push): every page lands where it belongs, also once the
    receiver launches the compiled kernel directly (on a GPU)."""
    rx, tx = planes(), planes()
    slab = tx.register_source(_store(rows=64, width=96))
    groups = [_regions(400, (96,)), _regions(400, (40, 56))]
    rx.register_regions(groups)
    g = np.random.default_rng(11)
    free = [g.permutation(400).tolist(), g.permutation(400).tolist()]  # disjoint per push
    handles, sent = [], []
    for tid in range(100, 120):  # 20 pushes > _Staging.RING buffers, all in flight
        n = int(g.integers(1, 9)) | 1  # odd counts
        batches, promised = [], []
        for grp in range(2):
            rows = g.permutation(64)[:n]
            slots = [free[grp].pop() for _ in range(n)]
            batches.append((grp, StoreRows(slab, rows, ((0, 96),)), slots))
            promised.append(slots)
        rx.expect(tid, 1, b"t", [n, n], 10.0, promised)
        handles.append(tx.post_push(rx.endpoint, tid, 1, b"t", batches))
        sent += batches
    for h in handles:
        assert tx.wait_push(h, 20).done, h.error
    assert all(rx.poll(t).done for t in range(100, 120))
    for grp, src, slots in sent:
        want = slab[torch.from_numpy(np.asarray(src.rows)).to(DEVICE)]
        assert torch.equal(_landed(groups[grp], slots), want)
    for grp, regions in enumerate(groups):  # random rows: a written row is never all zero
        n_sent = sum(len(slots) for g_, _, slots in sent if g_ == grp)
        assert int(torch.cat(regions, dim=1).any(dim=1).sum()) == n_sent, "stray writes"


def test_a_push_of_more_batches_than_staging_buffers_lands_exactly(planes):
    """One push of 11 batches (more than _Staging.RING: on a GPU the check stages every
    batch before the first upload, so the ring must grow rather than hand a buffer out
    twice), then a push whose last batch is refused (it writes nothing, and the buffers
    its good batches took are free for the next push, which lands exactly)."""
    rx, tx = planes(), planes()
    slab = tx.register_source(_store(rows=64, width=96))
    regions = _regions(200, (96,))
    rx.register_regions([regions])
    g = np.random.default_rng(12)
    free = g.permutation(200).tolist()
    batches, promised = [], []
    for _ in range(11):
        rows = g.permutation(64)[: int(g.integers(1, 6))]
        slots = [free.pop() for _ in rows]
        batches.append((0, StoreRows(slab, rows, ((0, 96),)), slots))
        promised += slots
    rx.expect(1, 1, b"t", [len(promised)], 10.0, [promised])
    assert tx.wait_push(tx.post_push(rx.endpoint, 1, 1, b"t", batches), 20).done
    for _, src, slots in batches:
        want = slab[torch.from_numpy(np.asarray(src.rows)).to(DEVICE)]
        assert torch.equal(_landed([regions[0]], slots), want)
    before = regions[0].clone()
    good = [free.pop() for _ in range(3)]
    bad = [(0, StoreRows(slab, np.array([1, 2, 3]), ((0, 96),)), good)] * 2  # repeats slots
    rx.expect(2, 1, b"t", [6], 10.0, [good + [free.pop() for _ in range(3)]])
    st = tx.wait_push(tx.post_push(rx.endpoint, 2, 1, b"t", bad), 20)
    assert st.failed and "writes a slot twice" in st.error, st
    assert torch.equal(regions[0], before), "a refused push wrote bytes"
    for tid in (3, 4):  # the next pushes reuse the staging buffers
        rows = g.permutation(64)[:4]
        slots = [free.pop() for _ in rows]
        rx.expect(tid, 1, b"t", [4], 10.0, [slots])
        h = tx.post_push(rx.endpoint, tid, 1, b"t", [(0, StoreRows(slab, rows, ((0, 96),)), slots)])
        assert tx.wait_push(h, 20).done, h.error
        assert torch.equal(_landed([regions[0]], slots), slab[torch.from_numpy(rows).to(DEVICE)])
