"""Pushes in parts on the ipc plane: a large device push leaves as several messages so
the receiver starts copying the first while the rest arrive (``disagg.transport.ipc.parts``).

CI has no GPU, so these cut host pushes too (``_parts_host``); the CUDA path is the same
code with device copies landing on the landing thread (GPU runs: DISAGG_TEST_DEVICE=cuda).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
import torch
from test_ipc_plane import _dial, _frame, _read_frame

from disagg.bench.ports import free_port
from disagg.protocol import ipc as wire
from disagg.protocol.messages import DataCaps
from disagg.transport.dataplane import StoreRows, TransferState
from disagg.transport.ipc import IpcDataPlane, sender
from disagg.transport.ipc.parts import (
    PARTS_FIRST_MAX,
    PARTS_MIN_PAGE_BYTES,
    PARTS_MIN_PAGES,
    cut,
    part_sizes,
    parts_setting,
)
from disagg.transport.ipc.receiver import Landing

pytestmark = pytest.mark.timeout(60)
DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cpu")
WIDTH = 64


@pytest.fixture
def planes():
    made: list[IpcDataPlane] = []

    def make(**kw) -> IpcDataPlane:
        made.append(IpcDataPlane(**kw))
        made[-1]._parts_host = DEVICE == "cpu"  # host pushes are never cut otherwise
        made[-1]._parts_min_bytes = 0  # nor pushes of pages as small as these
        return made[-1]

    yield make
    for p in made:
        p.close()


def _store(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, WIDTH), dtype=torch.uint8, generator=g).to(DEVICE)


def test_part_sizes_cut_while_twice_as_much_remains():
    assert part_sizes(16384, (2048, 4096)) == [2048, 4096, 10240]
    assert part_sizes(12288, (2048, 4096)) == [2048, 10240]  # 10240 < 3 * 4096
    assert part_sizes(6143, (2048, 4096)) == [6143]
    assert part_sizes(100, ()) == [100]
    assert part_sizes(0, (2, 4)) == [0]


def test_default_parts_are_halves_from_the_minimum_with_a_capped_first():
    assert part_sizes(16384, None) == [8192, 8192]
    assert part_sizes(PARTS_MIN_PAGES + 1, None) == [6145, 6144]
    assert part_sizes(32768, None) == [PARTS_FIRST_MAX, 32768 - PARTS_FIRST_MAX]
    assert part_sizes(PARTS_MIN_PAGES - 1, None) == [PARTS_MIN_PAGES - 1]
    assert part_sizes(0, None) == [0]


def test_cut_spans_batches_in_order_with_no_empty_piece():
    assert cut([3, 5], [2, 4, 2]) == [[(0, 0, 2)], [(0, 2, 3), (1, 0, 3)], [(1, 3, 5)]]
    assert cut([4], [4]) == [[(0, 0, 4)]]
    assert cut([], [0]) == [[]]


def test_parts_setting_from_argument_and_environment(monkeypatch):
    monkeypatch.delenv("DISAGG_IPC_PARTS", raising=False)
    assert parts_setting(None) is None  # the default: a capped first half
    assert parts_setting([0]) == () and parts_setting([]) == ()
    monkeypatch.setenv("DISAGG_IPC_PARTS", "512, 1024")
    assert parts_setting(None) == (512, 1024)
    monkeypatch.setenv("DISAGG_IPC_PARTS", "0")
    assert parts_setting(None) == ()
    monkeypatch.setenv("DISAGG_IPC_PARTS", "lots")
    with pytest.raises(ValueError, match="DISAGG_IPC_PARTS='lots'"):
        parts_setting(None)
    with pytest.raises(ValueError, match=">= 0"):
        parts_setting([-1])


@pytest.mark.parametrize("parts", [(2, 4), (1,), ()])
def test_a_push_in_parts_lands_exactly_across_groups(planes, parts):
    """Two layer groups of 9 and 11 pages cut into parts of 2, 4 and 14 pages (a part
    spans both groups): every page lands in its slot, nothing else is written, and only
    the last part finishes the transfer."""
    rx, tx = planes(), planes(push_parts=parts)
    slab = tx.register_source(_store(64))
    regions = [[torch.zeros((32, WIDTH), dtype=torch.uint8, device=DEVICE)] for _ in range(2)]
    rx.register_regions(regions)
    rng = np.random.default_rng(1)
    rows = [rng.choice(64, 9, replace=False), rng.choice(64, 11, replace=False)]
    slots = [rng.choice(32, 9, replace=False), rng.choice(32, 11, replace=False)]
    rx.expect(1, 5, b"t", [9, 11], 10.0, [s.tolist() for s in slots])
    pages = [(g, StoreRows(slab, rows[g], ((0, WIDTH),)), slots[g].tolist()) for g in (0, 1)]
    h = tx.post_push(rx.endpoint, 1, 5, b"t", pages, caps=rx.capabilities)
    assert tx.wait_push(h, 10).done, tx.poll_push(h)
    assert rx.wait(1, 10).done, rx.poll(1)
    for g in (0, 1):
        got = regions[g][0][torch.from_numpy(slots[g]).to(DEVICE)]
        assert torch.equal(got, slab[torch.from_numpy(rows[g]).to(DEVICE)])
        untouched = sorted(set(range(32)) - set(slots[g].tolist()))
        assert not regions[g][0][untouched].any()
    assert tx.stats["push_parts_sent"] == {(2, 4): 2, (1,): 1, (): 0}[parts]
    assert rx.stats["pages"] == 20 and tx.poll_push(h).nbytes == 20 * WIDTH


@pytest.mark.parametrize("caps", [None, DataCaps()], ids=["no_caps", "caps_without_parts"])
def test_a_receiver_whose_caps_do_not_say_parts_gets_one_message(planes, caps):
    """Parts go only where the receiver's capabilities say ``parts`` (a receiver that
    takes none would finish the transfer on the first); the endpoint is the bare
    address."""
    rx, tx = planes(), planes(push_parts=(1,))
    assert rx.capabilities.parts and "?" not in rx.endpoint
    slab = tx.register_source(_store(8))
    regions = [torch.zeros((8, WIDTH), dtype=torch.uint8, device=DEVICE)]
    rx.register_regions([regions])
    rx.expect(2, 1, b"t", [4], 10.0)
    h = tx.post_push(rx.endpoint, 2, 1, b"t", [(0, slab[:4], [0, 1, 2, 3])], caps=caps)
    assert tx.wait_push(h, 10).done and rx.wait(2, 10).done
    assert tx.stats["push_parts_sent"] == 0
    assert torch.equal(regions[0][:4], slab[:4])


def test_a_bad_later_part_fails_the_transfer_by_name(planes):
    """Part 0 is fine; a later part reads beyond the sender's export: the transfer
    fails (never DONE with part of its pages) and the sender is told why."""
    rx, tx = planes(), planes(push_parts=(2,))
    slab = tx.register_source(_store(16))
    regions = [torch.zeros((16, WIDTH), dtype=torch.uint8, device=DEVICE)]
    rx.register_regions([regions])
    rx.expect(3, 1, b"t", [8], 10.0)
    rows = np.array([0, 1, 2, 3, 4, 5, 6, 999])  # the last part's last row is beyond
    h = tx.post_push(
        rx.endpoint,
        3,
        1,
        b"t",
        [(0, StoreRows(slab, rows, ((0, WIDTH),)), list(range(8)))],
        caps=rx.capabilities,
    )
    st = tx.wait_push(h, 10)
    assert st.failed and "reads up to byte" in st.error, st
    assert rx.wait(3, 10).failed and "reads up to byte" in rx.poll(3).error
    assert tx.stats["push_parts_sent"] == 1
    assert not regions[0][2:].any(), "the refused part wrote bytes"


def _read_ack(sock: socket.socket) -> wire.IpcAck:
    ack = wire.decode(_read_frame(sock))
    assert isinstance(ack, wire.IpcAck)
    return ack


def _part(transfer_id: int, part: int, last: bool) -> bytes:
    push = wire.IpcPush(
        transfer_id=transfer_id,
        lease_id=1,
        token=b"t",
        exports=[],
        batches=[],
        not_after=time.monotonic() + 10,
        part=part,
        last=last,
    )
    return _frame(wire.encode(push))


def test_a_part_out_of_order_is_refused_by_name(planes):
    rx = planes()
    rx.register_regions([[torch.zeros((4, WIDTH), dtype=torch.uint8, device=DEVICE)]])
    rx.expect(7, 1, b"t", [1], 10.0)
    sock = _dial(rx.endpoint)
    try:
        sock.sendall(_part(7, 1, True))
        ack = _read_ack(sock)
    finally:
        sock.close()
    assert not ack.ok and "part 1 of transfer 7 arrived where part 0 was due" in ack.message
    assert rx.poll(7).failed


def test_a_refused_part_is_answered_only_after_earlier_copies_end(planes, monkeypatch):
    """The sender reuses its rows once answered: a refusal of part k must not overtake
    the copy of an earlier part still under way (a device copy, landing later). A
    landing whose copy blocks stands in for that copy here."""
    rx = planes()
    rx.register_regions([[torch.zeros((4, WIDTH), dtype=torch.uint8, device=DEVICE)]])
    rx.expect(8, 1, b"t", [1], 10.0)
    gate = threading.Event()

    class SlowCopy:  # a CUDA event of a copy still running
        def synchronize(self) -> None:
            gate.wait(10)

    sock = _dial(rx.endpoint)
    try:
        blocker = Landing(None, None, 0.0, 8, last=False, events=[SlowCopy()])  # type: ignore[arg-type]
        real_land = rx._land
        monkeypatch.setattr(rx, "_land", lambda lnd: None if lnd is blocker else real_land(lnd))
        blocker.rx = object()  # type: ignore[assignment]  # not a refusal: waits on its events
        rx._landings.put(blocker)
        sock.sendall(_part(8, 3, True))  # refused (out of order): queued behind the copy
        sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            sock.recv(1)
        gate.set()
        sock.settimeout(5)
        ack = _read_ack(sock)
    finally:
        gate.set()
        sock.close()
    assert not ack.ok and "part 3 of transfer 8" in ack.message
    assert rx.poll(8).state is TransferState.FAILED


def test_module_default_cuts_only_device_pushes(planes):
    """Without ``_parts_host`` a host push travels whole (parts pay off only where the
    receiver's copy runs apart from its checks: on a GPU)."""
    if DEVICE != "cpu":
        pytest.skip("host pushes only")
    rx, tx = planes(), planes(push_parts=(1,))
    tx._parts_host = False
    slab = tx.register_source(_store(8))
    regions = [torch.zeros((8, WIDTH), dtype=torch.uint8)]
    rx.register_regions([regions])
    rx.expect(9, 1, b"t", [4], 10.0)
    h = tx.post_push(rx.endpoint, 9, 1, b"t", [(0, slab[:4], [0, 1, 2, 3])], caps=rx.capabilities)
    assert tx.wait_push(h, 10).done and rx.wait(9, 10).done
    assert tx.stats["push_parts_sent"] == 0


def test_default_cut_is_two_halves_that_land_exactly(planes, monkeypatch):
    """With no part sizes given, a push of PARTS_MIN_PAGES pages leaves as two halves
    (the first half's copy outlasts the checks of the second); one page fewer travels
    whole. Every page lands in its slot either way."""
    monkeypatch.delenv("DISAGG_IPC_PARTS", raising=False)
    seen: list[tuple[int, int, int]] = []  # (transfer, part, pages) as the receiver got them
    rx_push = IpcDataPlane._rx_push

    def record(self, msg, conn):
        pages = sum(len(b.slots) // b.index_bytes for b in msg.batches)
        seen.append((msg.transfer_id, msg.part, pages))
        return rx_push(self, msg, conn)

    monkeypatch.setattr(IpcDataPlane, "_rx_push", record)
    rx, tx = planes(), planes()
    n = PARTS_MIN_PAGES
    slab = tx.register_source(_store(2 * n))
    pool = torch.zeros((2 * n, WIDTH), dtype=torch.uint8, device=DEVICE)
    rx.register_regions([[pool]])
    rng = np.random.default_rng(3)
    sent = []
    for tid, count in ((1, n), (2, n - 1)):
        rows, slots = (
            rng.choice(2 * n, count, replace=False),
            rng.choice(2 * n, count, replace=False),
        )
        rx.expect(tid, 1, b"t", [count], 30.0, [slots.tolist()])
        h = tx.post_push(
            rx.endpoint,
            tid,
            1,
            b"t",
            [(0, StoreRows(slab, rows, ((0, WIDTH),)), slots)],
            caps=rx.capabilities,
        )
        assert tx.wait_push(h, 30).done, tx.poll_push(h)
        assert rx.wait(tid, 30).done, rx.poll(tid)
        got = pool[torch.from_numpy(slots).to(DEVICE)]
        assert torch.equal(got, slab[torch.from_numpy(rows).to(DEVICE)])
        sent.append(tx.stats["push_parts_sent"])
    assert sent == [1, 1]  # the first push: one part beyond the first; the second: none
    assert seen == [(1, 0, n // 2), (1, 1, n // 2), (2, 0, n - 1)]


@pytest.mark.parametrize("end", ["abort", "deadline"])
def test_a_push_whose_later_parts_never_come_fails_and_releases(planes, end, monkeypatch):
    """The sender sends part 0 and nothing more (it died, or its connection dropped).
    The receiver holds part 0's copies until the transfer ends: an abort returns at
    once (the copies are waited for, nothing stays in flight) and, without one, the
    sender's deadline closes them; the sender's push fails at its deadline."""
    rx, tx = planes(), planes(push_parts=(2,))
    send_on = sender.PushHandle.send_on

    def first_only(h, conn):  # the parts after the first never leave
        h.frames = h.frames[:1]
        return send_on(h, conn)

    monkeypatch.setattr(sender.PushHandle, "send_on", first_only)
    tx._send_rest = lambda *a: None
    slab = tx.register_source(_store(16))
    regions = [torch.zeros((16, WIDTH), dtype=torch.uint8, device=DEVICE)]
    rx.register_regions([regions])
    rx.expect(11, 1, b"t", [8], 30.0)
    h = tx.post_push(
        rx.endpoint,
        11,
        1,
        b"t",
        [(0, slab[:8], list(range(8)))],
        deadline_s=1.5,
        caps=rx.capabilities,
    )
    deadline = time.monotonic() + 5
    while rx.stats["pages"] < 2 and not rx._parted and time.monotonic() < deadline:
        time.sleep(0.01)  # part 0 arrived (landed, or its device copy is held)
    assert rx.poll(11).state is TransferState.RECEIVING
    if end == "abort":
        t0 = time.monotonic()
        rx.abort(11, "consumer gave up")
        assert time.monotonic() - t0 < 1.0
        assert rx.poll(11).failed and "consumer gave up" in rx.poll(11).error
    st = tx.wait_push(h, 10)
    assert st.failed, st
    deadline = time.monotonic() + 5
    while (rx._parted or rx._book.rx[11].inflight) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not rx._parted and rx._book.rx[11].inflight == 0
    assert not regions[0][2:].any()


def test_a_push_behind_others_to_the_same_receiver_is_notcut(planes):
    """Parts help a push that finds the receiver idle; behind pushes still in flight
    the receiver's checks already overlap the copies, and parts would only add work."""
    tx = planes(push_parts=(1,))
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nobody listens there: pushes wait
    caps = DataCaps(parts=True)
    slab = tx.register_source(_store(8))
    pages = [(0, slab[:4], [0, 1, 2, 3])]
    first = tx.post_push(endpoint, 1, 1, b"t", pages, deadline_s=0.5, caps=caps)
    deadline = time.monotonic() + 5
    while endpoint not in tx._peers and time.monotonic() < deadline:
        time.sleep(0.005)  # the sender thread took the first push
    second = tx.post_push(endpoint, 2, 1, b"t", pages, deadline_s=0.5, caps=caps)
    assert tx.stats["push_parts_sent"] == 1
    assert first.more and not second.more
    assert tx.wait_push(first, 5).failed and tx.wait_push(second, 5).failed


def test_pushes_of_small_pages_are_notcut(planes):
    """Below PARTS_MIN_PAGE_BYTES the GPU copies a page in about the time the receiver
    checks one: cutting would not start the copy any sooner than the rest is checked."""
    rx, tx = planes(), planes(push_parts=(1,))
    tx._parts_min_bytes = PARTS_MIN_PAGE_BYTES
    assert WIDTH < tx._parts_min_bytes
    slab = tx.register_source(_store(8))
    regions = [torch.zeros((8, WIDTH), dtype=torch.uint8, device=DEVICE)]
    rx.register_regions([regions])
    rx.expect(12, 1, b"t", [4], 10.0)
    h = tx.post_push(rx.endpoint, 12, 1, b"t", [(0, slab[:4], [0, 1, 2, 3])], caps=rx.capabilities)
    assert tx.wait_push(h, 10).done and rx.wait(12, 10).done
    assert tx.stats["push_parts_sent"] == 0
