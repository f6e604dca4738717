"""The receiver's one-pass batch check (``_slotcheck.check_stage``) and the book method
built on it (``ReceiverBook.accept_rows``): every check against a numpy reference, all or
nothing on an error, and the numpy fallback giving the same answers."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from disagg.transport import receiver
from disagg.transport.receiver import ReceiverBook

_slotcheck = pytest.importorskip("disagg.transport._slotcheck")


def _arrays(n: int, num_slots: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    slots = rng.permutation(num_slots)[:n].astype(f"<i{width}")
    rows = rng.integers(0, 1000, n).astype(f"<i{width}")
    return slots, rows


def _unaligned(a: np.ndarray) -> memoryview:
    """``a``'s bytes at an odd address inside a bigger buffer (as in a message)."""
    buf = bytearray(a.nbytes + 3)
    buf[3:] = a.tobytes()
    return memoryview(buf)[3:]


@pytest.mark.parametrize("width", [4, 8])
def test_good_batch_is_marked_and_staged(width):
    slots, rows = _arrays(5000, 8192, width, 1)
    ok = np.zeros(8192, bool)
    ok[slots] = True
    written = np.zeros(8192, bool)
    rows_at = -(-slots.nbytes // 16) * 16
    out = np.zeros(rows_at + rows.nbytes, np.uint8)
    code, i, high = _slotcheck.check_stage(
        _unaligned(slots), _unaligned(rows), width, 8192, 1000, ok, written, out, rows_at
    )
    assert (code, i, high) == (0, -1, int(rows.max()))
    np.testing.assert_array_equal(written, ok)  # exactly the batch's slots marked
    np.testing.assert_array_equal(out[: slots.nbytes].view(f"<i{width}"), slots)
    np.testing.assert_array_equal(out[rows_at:].view(f"<i{width}"), rows)


@pytest.mark.parametrize(
    "where, bad, code",
    [
        ("slots", 8192, 1),  # one past the pool
        ("slots", -1, 1),
        ("slots", "unpromised", 2),
        ("slots", "repeat", 3),
        ("rows", -5, 4),
        ("rows", 1000, 5),  # row_limit
    ],
)
def test_each_bad_entry_is_named_and_nothing_stays_marked(where, bad, code):
    slots, rows = _arrays(300, 8192, 4, 2)
    ok = np.zeros(8192, bool)
    ok[slots] = True
    written = np.zeros(8192, bool)
    written[slots[-1]] = False
    at = 200
    if bad == "unpromised":
        free = np.setdiff1d(np.arange(8192), slots)[0]
        slots[at], bad = free, free
    elif bad == "repeat":
        slots[at] = bad = slots[10]
    elif where == "slots":
        slots[at] = bad
    else:
        rows[at] = bad
    got = _slotcheck.check_stage(slots, rows, 4, 8192, 1000, ok, written, None, 0)
    assert got == (code, at, bad)
    assert not written.any(), "a refused batch left marks behind"


def test_a_slot_written_by_an_earlier_batch_is_refused():
    slots, rows = _arrays(100, 1000, 8, 3)
    written = np.zeros(1000, bool)
    written[slots[50]] = True  # an earlier batch of the transfer wrote it
    before = written.copy()
    got = _slotcheck.check_stage(slots, rows, 8, 1000, 1000, None, written, None, 0)
    assert got == (3, 50, int(slots[50]))
    np.testing.assert_array_equal(written, before)  # its own mark stays; ours are undone


def test_without_masks_only_bounds_are_checked():
    slots = np.array([3, 3, 7], "<i4")  # a repeat is not visible without the written mask
    rows = np.array([0, 1, 2], "<i4")
    assert _slotcheck.check_stage(slots, rows, 4, 8, 3, None, None, None, 0) == (0, -1, 2)
    assert _slotcheck.check_stage(slots, rows, 4, 8, 2, None, None, None, 0) == (5, 2, 2)
    empty = np.zeros(0, "<i4")
    assert _slotcheck.check_stage(empty, empty, 4, 8, 0, None, None, None, 0) == (0, -1, -1)


def test_malformed_arguments_raise_by_name():
    a4 = np.zeros(4, "<i4")
    with pytest.raises(ValueError, match="width must be 4 or 8"):
        _slotcheck.check_stage(a4, a4, 2, 8, 8, None, None, None, 0)
    with pytest.raises(ValueError, match="equal arrays of 4-byte"):
        _slotcheck.check_stage(a4, a4[:3], 4, 8, 8, None, None, None, 0)
    with pytest.raises(ValueError, match="slot masks hold"):
        _slotcheck.check_stage(a4, a4, 4, 8, 8, np.zeros(4, bool), None, None, 0)
    with pytest.raises(ValueError, match="cannot hold"):
        _slotcheck.check_stage(a4, a4, 4, 8, 8, None, None, np.zeros(20, np.uint8), 16)
    with pytest.raises(TypeError, match="writable"):
        _slotcheck.check_stage(a4, a4, 4, 8, 8, None, b"\0" * 8, None, 0)


def _book(num_slots: int) -> tuple[ReceiverBook, receiver.Rx]:
    book = ReceiverBook(Counter())
    book.register([[torch.zeros((num_slots, 16), dtype=torch.uint8)]])
    return book, book.expect(1, 1, b"t", [num_slots // 2], 10.0, [list(range(0, num_slots, 2))])


def _beyond(row: int) -> str:
    return f"row {row} beyond"


@pytest.mark.parametrize("native", [True, False], ids=["c", "numpy"])
def test_book_accept_rows_agrees_with_the_numpy_fallback(monkeypatch, native):
    """Random batches, some with one bad entry: the C pass and the numpy fallback accept
    the same batches, refuse the others with the same kind of message, and leave the
    same marks."""
    if not native:
        monkeypatch.setattr(receiver, "_slotcheck", None)
    rng = np.random.default_rng(7)
    outcomes: list[bool] = []
    for trial in range(60):
        book, rx = _book(512)
        promised = np.arange(0, 512, 2)
        n = int(rng.integers(1, 200))
        slots = rng.permutation(promised)[:n].astype("<i4")
        rows = rng.integers(0, 64, n).astype("<i4")
        kind = trial % 6
        if kind == 1:
            slots[rng.integers(n)] = 1  # odd: not promised
        elif kind == 2 and n > 1:
            slots[-1] = slots[0]
        elif kind == 3:
            rows[rng.integers(n)] = 64
        elif kind == 4:
            rows[rng.integers(n)] = -1
        elif kind == 5:
            slots[rng.integers(n)] = 600
        out = np.zeros(2 * 16 + 2 * n * 4 + 16, np.uint8)
        rows_at = -(-n * 4 // 16) * 16
        why, high = book.accept_rows(rx, 0, 16, slots, rows, 4, 64, _beyond, out, rows_at)
        if why is None:
            assert high == int(rows.max())
            assert rx.allowed is not None and rx.allowed[0][1].sum() == n
            np.testing.assert_array_equal(out[: n * 4].view("<i4"), slots)
            np.testing.assert_array_equal(out[rows_at : rows_at + n * 4].view("<i4"), rows)
            assert rx.announced == [n]
        else:
            assert rx.state.final and rx.error == why
        want = {
            0: None,
            1: "not given",
            2: "twice",
            3: "row 64 beyond",
            4: "negative source row -1",
            5: "outside [0, 512)",
        }[kind]
        if kind == 2 and n == 1:
            want = None  # one page cannot repeat itself
        if want is None:
            assert why is None, (kind, why)
        else:
            assert why is not None and want in why, (kind, why)
            assert rx.announced == [0]
        outcomes.append(why is None)
    assert any(outcomes) and not all(outcomes)


def test_book_refuses_more_pages_than_expected_before_marking():
    book, rx = _book(8)  # 4 pages expected, slots 0, 2, 4, 6
    slots = np.array([0, 2, 4, 6, 0], "<i8")
    why, _ = book.accept_rows(rx, 0, 16, slots, np.zeros(5, "<i8"), 8, 1, _beyond)
    assert why == "group 0 would receive 5 pages, 4 expected"
    assert rx.state.final and rx.announced == [0]


# ---- the sender's side: pack_pair and the ipc sender's wire_indices over it ---------


@pytest.mark.parametrize("n", [0, 1, 7, 16384])
def test_pack_pair_narrows_like_numpy(n):
    rng = np.random.default_rng(n)
    rows, slots = rng.integers(0, 1 << 30, n), rng.integers(0, 1 << 20, n)
    r32, s32 = np.empty(n, "<i4"), np.empty(n, "<i4")
    assert _slotcheck.pack_pair(rows, slots, r32, s32) == (True, 0)
    assert (r32 == rows).all() and (s32 == slots).all()


@pytest.mark.parametrize(
    "row, slot, narrow, low",
    [
        (1 << 31, 5, False, 0),  # a row past int32
        (-(1 << 31), 5, True, 0),  # int32's lowest row still fits
        (-(1 << 31) - 1, 5, False, 0),
        (3, 1 << 31, False, 0),  # a slot past int32
        (3, -1, True, -1),  # -1: a slot to skip
        (3, -7, True, -7),  # below -1: post_push refuses it, naming the value
    ],
)
def test_pack_pair_reports_width_and_lowest_slot(row, slot, narrow, low):
    rows, slots = np.arange(100, dtype=np.int64), np.arange(100, dtype=np.int64)
    rows[37], slots[61] = row, slot
    got = _slotcheck.pack_pair(rows, slots, np.empty(100, "<i4"), np.empty(100, "<i4"))
    assert got == (narrow, low)


def test_pack_pair_refuses_mismatched_or_short_buffers():
    a = np.zeros(8, np.int64)
    with pytest.raises(ValueError, match="equal arrays"):
        _slotcheck.pack_pair(a, a[:7], np.empty(8, "<i4"), np.empty(8, "<i4"))
    with pytest.raises(ValueError, match="cannot hold"):
        _slotcheck.pack_pair(a, a, np.empty(7, "<i4"), np.empty(8, "<i4"))
    with pytest.raises(ValueError, match="aligned"):
        _slotcheck.pack_pair(
            np.frombuffer(_unaligned(a), np.int64), a, np.empty(8, "<i4"), np.empty(8, "<i4")
        )


def test_wire_indices_same_with_and_without_the_c_pass(monkeypatch):
    from disagg.transport.ipc import sender

    rng = np.random.default_rng(9)
    cases = [
        (rng.permutation(4096), rng.permutation(8192)[:4096]),
        (np.array([5, 1 << 40, 2]), np.array([0, 1, 2])),  # wide: 8-byte indices
        (np.array([5, 6, 7, 8]), np.array([3, -1, 9, -1])),  # -1 slots dropped
        (np.arange(4)[::-1].copy()[::2], np.array([1, 2])),  # a strided view
    ]
    for rows, dst in cases:
        fast = sender.wire_indices(rows, dst)
        monkeypatch.setattr(sender, "_slotcheck", None)
        slow = sender.wire_indices(rows, dst)
        monkeypatch.undo()
        for a, b in zip(fast, slow):
            assert a.dtype == b.dtype and a.dtype.byteorder in "<=" and (a == b).all()
        assert fast[0].base is not rows and not np.shares_memory(fast[0], rows)
    for patched in (False, True):
        if patched:
            monkeypatch.setattr(sender, "_slotcheck", None)
        with pytest.raises(ValueError, match="must be >= -1, got -4"):
            sender.wire_indices(np.arange(3), np.array([0, -4, 1]))
