"""The receiving side's book of record, shared by every DataPlane implementation.

A ``ReceiverBook`` holds the registered layer groups and the expected transfers, and is
the only place that decides whether bytes may land: it authenticates a message (kind,
token, lease), checks a whole batch before any byte of it is written (group, page size,
slot bounds, the slots the transfer was promised, each written once, page counts), and
runs each transfer's state machine (PENDING -> RECEIVING -> DONE | FAILED) with its
deadline. The planes only move bytes: they call ``accept_batch`` before writing,
``landed`` after, ``on_done`` for the sender's TransferDone, and keep ``Rx.inflight``
up to date while a write they cannot interrupt is under way (``abort`` waits for it).

All methods that touch a transfer expect ``book.lock`` held, except ``register``,
``expect``, ``poll`` and ``abort``, which take it themselves.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ..native import load
from ..protocol import messages as m
from . import page_copy
from .dataplane import RegionSpec, TransferState, TransferStatus

# the one-pass batch check (_slotcheck.c); numpy below when it was not built
_slotcheck = load("disagg.transport._slotcheck")

# what a batch check found wrong: _slotcheck's codes, which the numpy fallback uses too
SLOT_OUTSIDE, SLOT_NOT_GIVEN, SLOT_TWICE, ROW_NEGATIVE, ROW_BEYOND = 1, 2, 3, 4, 5
if _slotcheck is not None:
    assert (SLOT_OUTSIDE, SLOT_NOT_GIVEN, SLOT_TWICE, ROW_NEGATIVE, ROW_BEYOND) == (
        _slotcheck.SLOT_OUTSIDE,
        _slotcheck.SLOT_NOT_GIVEN,
        _slotcheck.SLOT_TWICE,
        _slotcheck.ROW_NEGATIVE,
        _slotcheck.ROW_BEYOND,
    )

log = logging.getLogger(__name__)

KEEP_FINISHED = 4096  # final receiver states kept for poll()


@dataclass
class Group:
    """One registered layer group."""

    regions: list[RegionSpec]
    page_bytes: int
    num_slots: int
    direct: np.ndarray | None  # [num_slots, page_bytes] view when runs can land in place
    # Where the regions live, worked out once here: a push's checks and copies read these
    # per batch, and a TP slice pool has one region per (layer, role) buffer, so a scan of
    # the regions would be 2 * layers tensor attribute reads on every push.
    cuda_devices: frozenset[torch.device] = field(init=False)
    device: torch.device | None = field(init=False)  # the one CUDA device of every region

    def __post_init__(self) -> None:
        devs = {r.tensor.device for r in self.regions}
        self.cuda_devices = frozenset(d for d in devs if d.type == "cuda")
        self.device = next(iter(devs)) if len(devs) == 1 and self.cuda_devices else None

    def scatter(self, slots: np.ndarray, src: np.ndarray | torch.Tensor) -> None:
        """Write ``src`` (``[len(slots), page_bytes]`` uint8, host) into ``slots``.

        Host regions use numpy fancy assignment (~8 GB/s here); torch's CPU
        ``index_copy_`` on uint8 rows manages ~0.6 GB/s. Device regions get one
        synchronous batched ``index_copy_`` each (the source is reused afterwards)."""
        src_t = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
        rc = page_copy._rowcopy
        if (
            rc is not None
            and len(self.regions) > 1
            and src_t.device.type == "cpu"
            and src_t.is_contiguous()
            and all(r.tensor.device.type == "cpu" for r in self.regions)
        ):  # several host regions (a TP slice's runs): one C pass, each page's in turn
            at = np.cumsum([0] + [r.size for r in self.regions[:-1]])
            table = np.array(
                [
                    (int(a), r.tensor.data_ptr(), r.tensor.stride(0), r.size)
                    for r, a in zip(self.regions, at, strict=True)
                ],
                dtype=np.int64,
            )
            n = int(src_t.shape[0])
            rc.copy_runs(
                src_t.data_ptr(), n, self.page_bytes, table, self.num_slots, np.arange(n),
                np.ascontiguousarray(slots, dtype=np.int64), 1,
            )  # fmt: skip
            return
        col = 0
        for region in self.regions:
            part = src_t[:, col : col + region.size]
            t = region.tensor
            if t.device.type == "cpu":
                t.numpy()[slots] = part.numpy()
            else:
                idx = torch.from_numpy(slots).to(t.device)
                t.index_copy_(0, idx, part.to(t.device))
            col += region.size


def build_groups(
    group_regions: Sequence[Sequence[RegionSpec | torch.Tensor]], host_only: bool = False
) -> list[Group]:
    groups = []
    for g, regions in enumerate(group_regions):
        specs = [r if isinstance(r, RegionSpec) else RegionSpec(r) for r in regions]
        if not specs:
            raise ValueError(f"layer group {g} has no regions")
        on_host = all(s.tensor.device.type == "cpu" for s in specs)
        if host_only and not on_host:
            raise ValueError("this data plane receives into host memory only (for now)")
        direct = None
        if on_host and len(specs) == 1 and specs[0].contiguous:
            direct = specs[0].tensor.numpy()  # shares memory: receives land in place
        groups.append(
            Group(specs, sum(s.size for s in specs), min(s.num_slots for s in specs), direct)
        )
    return groups


def runs_slots(runs: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
    """Every destination slot of ``runs`` ((start, count) pairs), in page order."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    if r.shape[0] == 1:
        return np.arange(r[0, 0], r[0, 0] + r[0, 1], dtype=np.int64)
    count = int(r[:, 1].sum())
    within = np.arange(count) - np.repeat(np.cumsum(r[:, 1]) - r[:, 1], r[:, 1])
    return np.repeat(r[:, 0], r[:, 1]) + within


def runs_array(runs: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray | None:
    """(start, count) pairs as an int64 ``[n, 2]`` array; None when a number does not
    fit in int64 (the wire's integers go up to 2**64 - 1)."""
    try:
        return np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    except (OverflowError, ValueError):
        return None


@dataclass
class Rx:
    """One expected transfer."""

    transfer_id: int
    lease_id: int
    token: bytes
    expected: list[int]
    deadline: float
    announced: list[int] = field(default_factory=list)  # pages of accepted batches
    received: list[int] = field(default_factory=list)  # pages landed
    state: TransferState = TransferState.PENDING
    error: str | None = None
    nbytes: int = 0
    # per group: the sorted destination slots this transfer may write, and which it has
    allowed: list[tuple[np.ndarray, np.ndarray]] | None = None
    inflight: int = 0  # writes into the regions under way (abort waits for them)
    done_msg: m.TransferDone | None = None
    hasher: Any = None  # xxh3_64 over the payload in wire order, when checksummed
    next_part: int = 0  # the ipc plane: which part of a push in parts it accepts next

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.error, sum(self.received), self.nbytes)


def allowed_slots(
    slots_by_group: Sequence[Sequence[int]] | None,
    expected: list[int],
    num_slots: Sequence[int],
) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """The destination slots a transfer was promised (``-1`` dropped) as a mask over
    each group's slots, with a written mask; their counts must agree with ``expected``.
    Dense masks make a batch's check a few vector gathers (no sort or search), so
    thousands of pages are checked in microseconds; ``ReceiverBook`` drops them once the
    transfer is final."""
    if slots_by_group is None:
        return None
    out = []
    for g, slots in enumerate(slots_by_group):
        arr = np.asarray(slots, dtype=np.int64).reshape(-1)
        arr = arr[arr >= 0]
        n = num_slots[g] if g < len(num_slots) else 0
        if arr.size and int(arr.max()) >= n:
            raise ValueError(f"group {g}: promised slot {int(arr.max())} outside [0, {n})")
        ok = np.zeros(n, dtype=bool)
        ok[arr] = True
        if g < len(expected) and int(np.count_nonzero(ok)) != expected[g]:
            raise ValueError(
                f"group {g}: {int(np.count_nonzero(ok))} distinct slots for {expected[g]} pages"
            )
        out.append((ok, np.zeros(n, dtype=bool)))
    return out


def check_allowed(allowed: tuple[np.ndarray, np.ndarray], slots: np.ndarray) -> str | None:
    """Every slot (already checked to lie in the group) is one this transfer may write,
    and not written before; marks them."""
    ok, written = allowed
    if not ok[slots].all():
        return "addresses slots this transfer was not given"
    if written[slots].any():
        return "writes a slot twice"
    before = int(np.count_nonzero(written))
    written[slots] = True  # counting new marks finds repeats in O(n), without a sort
    if int(np.count_nonzero(written)) - before != slots.size:
        return "writes a slot twice"
    return None


class ReceiverBook:
    """Registered groups and expected transfers (see the module docstring).

    ``stats`` is the plane's counter; ``checksum``: give each transfer an xxh3-64 hasher
    the plane feeds, checked against the sender's TransferDone; ``host_only``: refuse
    device regions; ``rx_factory`` makes the per-transfer record (a subclass of ``Rx``
    for planes that track more)."""

    def __init__(
        self,
        stats: Counter[str],
        *,
        checksum: bool = False,
        host_only: bool = False,
        rx_factory: Callable[..., Rx] = Rx,
    ) -> None:
        self.stats = stats
        self.checksum = checksum
        self.host_only = host_only
        self.rx_factory = rx_factory
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.groups: list[Group] = []
        self.rx: OrderedDict[int, Rx] = OrderedDict()

    # --------------------------------- caller side --------------------------------------
    def register(self, group_regions: Sequence[Sequence[RegionSpec | torch.Tensor]]) -> None:
        groups = build_groups(group_regions, self.host_only)
        with self.lock:
            self.groups = groups

    def expect(
        self,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        total_pages_by_group: Sequence[int],
        deadline_s: float,
        slots_by_group: Sequence[Sequence[int]] | None = None,
    ) -> Rx:
        expected = [int(n) for n in total_pages_by_group]
        with self.lock:
            allowed = allowed_slots(slots_by_group, expected, [g.num_slots for g in self.groups])
            if len(expected) > len(self.groups):
                raise ValueError(
                    f"{len(expected)} groups expected but {len(self.groups)} registered"
                )
            if any(n < 0 for n in expected):
                raise ValueError(f"negative page count in {expected}")
            old = self.rx.get(transfer_id)
            if old is not None and not old.state.final:
                raise ValueError(f"transfer {transfer_id} is already expected")
            self.rx.pop(transfer_id, None)
            rx = self.rx[transfer_id] = self.rx_factory(
                transfer_id,
                lease_id,
                bytes(token),
                expected,
                time.monotonic() + deadline_s,
                announced=[0] * len(expected),
                received=[0] * len(expected),
                allowed=allowed,
                hasher=xxhash.xxh3_64() if self.checksum else None,
            )
            self._prune()
            return rx

    def poll(self, transfer_id: int) -> TransferStatus:
        rx = self.rx[transfer_id]  # KeyError for an unknown transfer
        if not rx.state.final and time.monotonic() > rx.deadline:
            with self.lock:
                self.expire(rx, time.monotonic())
        return rx.status()

    def abort(self, transfer_id: int, reason: str, wait_s: float = 5.0) -> int:
        """Fail the transfer and wait (up to ``wait_s``) for writes under way to end;
        returns how many are still under way (0 unless the plane is stuck)."""
        with self.cond:
            rx = self.rx.get(transfer_id)
            if rx is None:
                return 0
            self.fail(rx, reason)
            self.cond.notify_all()  # its waiters: the transfer is final
            end = time.monotonic() + wait_s
            while rx.inflight and time.monotonic() < end:
                self.cond.wait(0.05)
            return rx.inflight

    # --------------------------------- plane side ---------------------------------------
    def fail(self, rx: Rx, why: str) -> None:
        if not rx.state.final:
            rx.state, rx.error = TransferState.FAILED, why
            rx.allowed = None  # final: its masks are no longer needed
            self.stats["failed"] += 1

    def expire(self, rx: Rx, now: float) -> None:
        if not rx.state.final and now > rx.deadline:
            self.fail(
                rx,
                f"transfer {rx.transfer_id} missed its deadline with "
                f"{sum(rx.received)} of {sum(rx.expected)} pages received",
            )

    def sweep(self, now: float) -> None:
        for rx in self.rx.values():
            self.expire(rx, now)

    def fail_all(self, why: str) -> None:
        for rx in self.rx.values():
            self.fail(rx, why)
        self.cond.notify_all()

    def _prune(self) -> None:
        excess = len(self.rx) - KEEP_FINISHED
        if excess > 0:
            for tid in [t for t, r in self.rx.items() if r.state.final][:excess]:
                del self.rx[tid]

    def authenticate(self, msg: m.Message) -> Rx | None:
        """The expected transfer a PageBatch / TransferDone belongs to, or None (counted)
        for another kind, an unknown transfer, a wrong token or lease id."""
        if not isinstance(msg, m.PageBatch | m.TransferDone):
            self.stats["rejected_kind"] += 1
            return None
        rx = self.rx.get(msg.transfer_id)
        if (
            rx is None
            or not hmac.compare_digest(rx.token, msg.token)
            or msg.lease_id != rx.lease_id
        ):
            self.stats["rejected_unknown"] += 1
            return None
        return rx

    def accept_batch(self, rx: Rx, h: m.PageBatch) -> str | None:
        """Check every slot of the batch before a byte of it is written; on success the
        batch's pages count as announced (and its slots as written). On refusal the
        transfer fails (a late batch for a final transfer only counts)."""
        return self.accept_runs(rx, h)[0]

    def accept_runs(self, rx: Rx, h: m.PageBatch) -> tuple[str | None, np.ndarray | None, int]:
        """``accept_batch`` that also hands back, once accepted, the batch's slots (int64,
        page order) and one past the highest: ``(None, slots, end)``, or ``(why, None,
        0)``. The runs are checked as numbers before they are expanded into slots (each
        inside the group, no more pages than the transfer still expects): a header that
        names billions of pages is refused by name, never expanded (nor cut into
        segments by a plane that asks first)."""
        if rx.state.final:
            self.stats["rejected_late"] += 1
            return "late", None, 0
        error, r, end = self._check_runs(rx, h.group, h.page_bytes, h.runs)
        if error is not None:
            self.stats["rejected_batch"] += 1
            self.fail(rx, error)
            return error, None, 0
        slots = runs_slots(r)  # runs checked above: expanded once
        error = self.accept_slots(rx, h.group, h.page_bytes, slots, end)
        return (error, None, 0) if error is not None else (None, slots, end)

    def accept_slots(
        self,
        rx: Rx,
        group: int,
        page_bytes: int,
        slots: np.ndarray | None,
        end: int | None = None,
    ) -> str | None:
        """``accept_batch`` for a batch given as its destination slots (int64, page
        order); ``None`` slots: the batch's description was malformed. ``end``: one past
        the highest slot, when the caller knows it."""
        if rx.state.final:
            self.stats["rejected_late"] += 1
            return "late"
        error = self._check(rx, group, page_bytes, slots, end)
        if error is not None:
            self.stats["rejected_batch"] += 1
            self.fail(rx, error)
            return error
        assert slots is not None
        self._accepted(rx, group, int(slots.size))
        return None

    def accept_rows(
        self,
        rx: Rx,
        group: int,
        page_bytes: int,
        slots: Any,
        rows: Any,
        width: int,
        row_limit: int,
        beyond: Callable[[int], str],
        out: Any = None,
        rows_at: int = 0,
    ) -> tuple[str | None, int]:
        """``accept_slots`` for a batch given as raw arrays (buffers of ``width``-byte
        little-endian integers, as they arrived): destination ``slots`` and the source
        ``rows`` they come from, each row checked to lie in ``[0, row_limit)`` in the
        same pass (``beyond(row)`` words the error for a row past it). With ``out`` (a
        writable buffer), both arrays are also copied there as they are checked: slots
        at byte 0, rows at byte ``rows_at`` (the caller stages them for a device copy).
        Returns (error, highest row); on an error nothing is marked, the transfer
        fails, and ``out`` may hold part of the arrays.

        One C pass (``_slotcheck``) where it was built: numpy takes about eight passes
        over the arrays for the same checks (see _slotcheck.c for what that costs)."""
        n = len(memoryview(slots).cast("B")) // width
        if rx.state.final:
            self.stats["rejected_late"] += 1
            return "late", -1
        error = self._check_header(rx, group, page_bytes, n)
        if error is None and _slotcheck is not None:
            ok, written = rx.allowed[group] if rx.allowed is not None else (None, None)
            code, i, value = _slotcheck.check_stage(
                slots, rows, width, self.groups[group].num_slots, row_limit,
                ok, written, out, rows_at,
            )  # fmt: skip
            if code == 0:
                self._accepted(rx, group, n)
                return None, value
            error = self._row_or_slot_error(group, code, value, row_limit, beyond)
        elif error is None:
            s = np.frombuffer(slots, dtype=f"<i{width}")
            r = np.frombuffer(rows, dtype=f"<i{width}")
            if s.size != r.size:
                raise ValueError(f"{s.size} slots for {r.size} source rows")
            low, high = (int(r.min()), int(r.max())) if r.size else (0, -1)
            if low < 0:
                error = self._row_or_slot_error(group, ROW_NEGATIVE, low, row_limit, beyond)
            elif high >= row_limit:
                error = self._row_or_slot_error(group, ROW_BEYOND, high, row_limit, beyond)
            else:
                error = self._check_slots(rx, group, s.astype(np.intp))
            if error is None:
                if out is not None:
                    o = np.frombuffer(out, dtype=f"<i{width}")
                    o[:n] = s
                    o[rows_at // width : rows_at // width + n] = r
                self._accepted(rx, group, n)
                return None, high
        self.stats["rejected_batch"] += 1
        self.fail(rx, error)
        return error, -1

    def _row_or_slot_error(
        self, group: int, code: int, value: int, row_limit: int, beyond: Callable[[int], str]
    ) -> str:
        """The message for a ``_slotcheck`` code (the same words as ``_check``'s)."""
        if code == SLOT_OUTSIDE:
            return f"batch for group {group} addresses slots outside [0, {self.groups[group].num_slots})"
        if code == SLOT_NOT_GIVEN:
            return f"batch for group {group} addresses slots this transfer was not given"
        if code == SLOT_TWICE:
            return f"batch for group {group} writes a slot twice"
        if code == ROW_NEGATIVE:
            return f"batch for group {group}: negative source row {value}"
        return beyond(value)

    def _accepted(self, rx: Rx, group: int, pages: int) -> None:
        rx.state = TransferState.RECEIVING
        rx.announced[group] += pages

    def _check(
        self, rx: Rx, group: int, page_bytes: int, slots: np.ndarray | None, end: int | None
    ) -> str | None:
        error = self._check_header(rx, group, page_bytes, 0 if slots is None else int(slots.size))
        if error is not None:
            return error
        if slots is None:
            return f"batch for group {group} addresses slots outside [0, {self.groups[group].num_slots})"
        return self._check_slots(rx, group, slots, end)

    def _check_runs(
        self, rx: Rx, group: int, page_bytes: int, runs: Sequence[tuple[int, int]]
    ) -> tuple[str | None, np.ndarray, int]:
        """What a batch's runs decide without expanding them: group and page size, each
        run a start and a count inside the group's slots, and the pages in all against
        what the transfer still expects. Returns the error (or None), the runs as an int64
        ``[n, 2]`` array and one past the highest slot (a handful of reductions: this
        runs for every header)."""
        none = np.empty((0, 2), np.int64)
        error = self._check_header(rx, group, page_bytes, 0)
        if error is not None:
            return error, none, 0
        num_slots = self.groups[group].num_slots
        r = runs_array(runs)
        if r is None or not r.size:
            why = f"batch for group {group} has malformed runs (start, count pairs in int64)"
            return why, none, 0
        (start_lo, count_lo), (start_hi, count_hi) = r.min(axis=0), r.max(axis=0)
        if count_lo < 1:
            return f"batch for group {group} has a run of {int(count_lo)} pages", r, 0
        # starts and counts bounded first, so the sum of a start and a count cannot overflow
        if start_lo < 0 or start_hi >= num_slots or count_hi > num_slots:
            end = num_slots + 1
        else:
            end = int((r[:, 0] + r[:, 1]).max())
        if end > num_slots:
            return f"batch for group {group} addresses slots outside [0, {num_slots})", r, 0
        return self._check_header(rx, group, page_bytes, int(r[:, 1].sum())), r, end

    def _check_header(self, rx: Rx, group: int, page_bytes: int, count: int) -> str | None:
        """What a batch's header alone decides: its group, page size and page count."""
        if group >= len(rx.expected) or group >= len(self.groups):
            return f"batch for layer group {group}, but only {len(rx.expected)} expected"
        grp = self.groups[group]
        if page_bytes != grp.page_bytes:
            return f"group {group} pages are {grp.page_bytes} bytes, batch says {page_bytes}"
        if rx.announced[group] + count > rx.expected[group]:
            return (
                f"group {group} would receive {rx.announced[group] + count} pages, "
                f"{rx.expected[group]} expected"
            )
        return None

    def _check_slots(
        self, rx: Rx, group: int, slots: np.ndarray, end: int | None = None
    ) -> str | None:
        """Slots inside the group (``end``: one past the highest, when the caller knows
        it), each one promised and not written yet (then marked)."""
        num_slots = self.groups[group].num_slots
        if slots.size:
            hi = int(slots.max()) + 1 if end is None else end
            if int(slots.min()) < 0 or hi > num_slots:
                return f"batch for group {group} addresses slots outside [0, {num_slots})"
        if rx.allowed is not None:
            why = check_allowed(rx.allowed[group], slots)
            if why is not None:
                return f"batch for group {group} {why}"
        return None

    def landed(self, rx: Rx, group: int, pages: int, nbytes: int) -> None:
        rx.received[group] += pages
        rx.nbytes += nbytes
        self.stats["pages"] += pages

    def on_done(self, rx: Rx, msg: m.TransferDone, pending: int = 0) -> None:
        """The sender's TransferDone: a failure report fails at once; otherwise the
        transfer finishes once nothing of it is still under way (``maybe_finish``)."""
        if rx.state.final:
            self.stats["rejected_late"] += 1
            return
        if not msg.ok:
            self.fail(rx, f"sender failed the transfer: {msg.message}")
            return
        rx.done_msg = msg
        self.maybe_finish(rx, pending)

    def maybe_finish(self, rx: Rx, pending: int = 0) -> None:
        """DONE when the sender said done, nothing is in flight (``pending``: work the
        plane still holds for it) and the counts (and checksum) agree; else FAILED."""
        done = rx.done_msg
        if rx.state.final or done is None or rx.inflight or pending:
            return
        if rx.received != rx.expected:
            self.fail(rx, f"sender finished with {rx.received} of {rx.expected} pages per group")
        elif rx.hasher is not None and done.checksum and rx.hasher.intdigest() != done.checksum:
            self.fail(rx, "payload checksum mismatch")
        else:
            rx.state = TransferState.DONE
            rx.allowed = None
            self.stats["done"] += 1


class BookedReceiver:
    """The receiver half of the DataPlane contract, served from ``self._book``: mix in
    ahead of ``DataPlane`` and create ``self._book`` in ``__init__``."""

    _book: ReceiverBook
    abort_wait_s = 5.0
    wait_slice_s = 0.05  # longest sleep in wait() between checks when nobody notifies

    def register_regions(
        self, group_regions: Sequence[Sequence[RegionSpec | torch.Tensor]]
    ) -> None:
        self._book.register(group_regions)

    def expect(
        self,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        total_pages_by_group: Sequence[int],
        deadline_s: float,
        slots_by_group: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self._book.expect(
            transfer_id, lease_id, token, total_pages_by_group, deadline_s, slots_by_group
        )

    def poll(self, transfer_id: int) -> TransferStatus:
        return self._book.poll(transfer_id)

    def _sweep_if_due(self, last: float, every_s: float = 0.05) -> float:
        """Receiver thread: expire transfers past their deadline, at most every
        ``every_s`` (``poll`` checks its own transfer anyway); returns the last sweep."""
        now = time.monotonic()
        if now - last <= every_s:
            return last
        with self._book.lock:
            self._book.sweep(now)
        return now

    def _fail_all_closed(self) -> None:
        """Receiver thread, on the way out: every transfer not yet final fails."""
        with self._book.lock:
            self._book.fail_all("data plane closed")

    def wait(self, transfer_id: int, timeout_s: float) -> TransferStatus:
        """Like ``DataPlane.wait``, but woken the moment the plane ends the transfer
        (planes notify ``book.cond``): no sleep-poll backoff added to a transfer."""
        end = time.monotonic() + timeout_s
        book = self._book
        while True:
            st = self.poll(transfer_id)  # also expires a transfer past its deadline
            left = end - time.monotonic()
            if st.final or left <= 0:
                return st
            with book.cond:
                rx = book.rx.get(transfer_id)
                if rx is not None and not rx.state.final:
                    book.cond.wait(min(left, self.wait_slice_s))

    def abort(self, transfer_id: int, reason: str = "aborted") -> int:
        left = self._book.abort(transfer_id, reason, self.abort_wait_s)
        if left:
            log.warning("transfer %d: %d writes still in flight after abort", transfer_id, left)
        return left
