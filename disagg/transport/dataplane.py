"""The data plane: move batches of KV pages into registered page slots of a peer.

Receiver (consumer) side::

    plane.register_regions(group_regions)   # per layer group, its regions' uint8 views
    plane.expect(tid, lease_id, token, total_pages_by_group, deadline_s)
    ... tell the producer (control Push) to send to plane.endpoint ...
    plane.poll(tid).state in (PENDING, RECEIVING, DONE, FAILED)

Sender (producer) side::

    h = plane.post_push(endpoint, tid, lease_id, token, [(group, rows, dst_slots), ...])
    plane.poll_push(h).state

Contracts every implementation keeps:
- A *group page* is the concatenation, in region order, of one slot's bytes of each of
  the group's regions; ``page_bytes`` of a group is the sum of its regions' sizes.
- The receiver writes only into registered regions, only slots ``0 <= slot < num_slots``
  (``-1`` is never a slot), only for an expected transfer whose lease id and token match,
  and checks a whole batch's slots before writing any of its bytes. Frames that fail
  these checks are dropped and counted in ``stats``.
- A receiver transfer ends DONE only when every expected page arrived and the sender's
  TransferDone agreed (and, where computed, the checksum matched); otherwise FAILED with
  ``error`` saying why (deadline, peer report, bad slot, short payload, checksum).
  After ``abort`` returns, no byte of that transfer is written any more.
- Sender-side DONE means the source rows are no longer referenced (the caller may reuse
  them); delivery is confirmed only by the receiver's state. The source rows must not
  change until ``poll_push`` reports DONE or FAILED.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..protocol.messages import DataCaps
from . import page_copy
from .page_runs import Run, copy_runs_host, launch_runs, prepare_runs


class TransferState(enum.Enum):
    """PENDING -> RECEIVING -> DONE | FAILED (PENDING -> FAILED on deadline/abort)."""

    PENDING = "pending"
    RECEIVING = "receiving"  # on the sender side: sending
    DONE = "done"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


@dataclass(frozen=True)
class TransferStatus:
    """A snapshot of one transfer: ``state``, ``error`` (set when FAILED), and progress."""

    state: TransferState
    error: str | None = None
    pages: int = 0
    nbytes: int = 0

    @property
    def done(self) -> bool:
        return self.state is TransferState.DONE

    @property
    def failed(self) -> bool:
        return self.state is TransferState.FAILED

    @property
    def final(self) -> bool:
        return self.state.final


@dataclass(frozen=True)
class RegionSpec:
    """One region of a layer group: a uint8 ``[num_slots, size]`` view whose rows are
    contiguous (``stride(1) == 1``); the row stride may exceed ``size``. Build it from
    ``KvCacheRegion.as_tensor()`` (or any such view of a pool)."""

    tensor: torch.Tensor

    def __post_init__(self) -> None:
        t = self.tensor
        if t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(f"region must be a 2-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError("region rows must be contiguous (stride(1) == 1)")

    @property
    def num_slots(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def size(self) -> int:
        return int(self.tensor.shape[1])

    @property
    def contiguous(self) -> bool:
        """Rows back to back, so a run of slots is one contiguous byte range."""
        return self.tensor.is_contiguous()


@dataclass(frozen=True)
class StoreRows:
    """Pages as rows of a registered source slab, not yet gathered: page ``i`` is the
    concatenation of columns ``cols`` ((offset, length) pairs) of ``slab[rows[i]]``.

    Producers hand this to planes that set ``accepts_store_rows`` (the same-host plane
    reads the rows where they lie); every other plane gets ``materialize()``'s bytes."""

    slab: torch.Tensor  # uint8 [capacity, row_bytes]
    rows: Any  # int64 numpy array, one store row per page
    cols: tuple[tuple[int, int], ...]

    @property
    def page_bytes(self) -> int:
        return sum(length for _, length in self.cols)

    def __len__(self) -> int:
        return len(self.rows)

    def materialize(self) -> torch.Tensor:
        """The pages as one uint8 ``[len(rows), page_bytes]`` tensor: a view of the slab
        when the rows are one run and the columns one span (zero copy), else a gather."""
        from ..pages import gather_rows

        rows = np.asarray(self.rows, dtype=np.int64)
        r0 = int(rows[0]) if rows.size else 0
        run = bool(rows.size) and np.array_equal(rows, np.arange(r0, r0 + rows.size))
        if len(self.cols) > 1 and rows.size:  # a TP slice's runs: one pass, no concatenation
            out = self._gather_runs(rows)
            if out is not None:
                return out
        # the index must live where the slab does (a device store gathers on its device)
        idx = None if run else torch.from_numpy(rows).to(self.slab.device)
        parts = []
        for off, length in self.cols:
            view = self.slab[:, off : off + length]
            parts.append(view[r0 : r0 + rows.size] if idx is None else gather_rows(view, idx))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _gather_runs(self, rows: np.ndarray) -> torch.Tensor | None:
        """The pages of several column spans gathered in one pass (``page_runs``: one C
        call on the host, one kernel on a GPU); None where neither applies."""
        slab = self.slab
        if slab.dim() != 2 or (slab.shape[1] > 1 and slab.stride(1) != 1):
            return None
        if int(rows.min()) < 0 or int(rows.max()) >= slab.shape[0]:
            return None  # the gather below names the bad row
        n, width = int(rows.size), sum(c for _, c in self.cols)
        out = torch.empty((n, width), dtype=torch.uint8, device=slab.device)
        at = np.cumsum([0] + [c for _, c in self.cols[:-1]])
        runs = [Run(o, out, int(a), c) for (o, c), a in zip(self.cols, at, strict=True)]
        span = (slab.shape[0] - 1) * slab.stride(0) + slab.shape[1]  # from the first byte
        flat = slab.as_strided((span,), (1,))
        if slab.device.type == "cpu":
            ok = copy_runs_host(flat, slab.shape[0], slab.stride(0), runs, np.arange(n), rows)
            return out if ok else None
        c = prepare_runs(flat, slab.stride(0), runs)
        if c is None:
            return None
        dev = slab.device
        with torch.cuda.device(dev):
            launch_runs(c, torch.arange(n, device=dev), torch.from_numpy(rows).to(dev))
        return out


# (layer group, source rows uint8 [n, page_bytes], destination slot per row (-1: skip))
PageSource = tuple[int, torch.Tensor, Sequence[int]]
# What a plane with ``accepts_store_rows`` takes instead: the rows may still be in the slab.
RowsSource = tuple[int, "torch.Tensor | StoreRows", Sequence[int]]


def check_store_rows(
    group: int, src: StoreRows, n: int, width: int
) -> tuple[np.ndarray, tuple[tuple[int, int], ...]]:
    """The rows (int64) and columns of a StoreRows push source whose slab rows are
    ``width`` bytes, checked: ``n`` rows, all inside the slab, and non-empty column spans
    inside a row. ValueError naming the group and what is wrong. (Planes check the slab's
    dtype and memory themselves: what they accept differs.)"""
    rows = np.asarray(src.rows, dtype=np.int64).reshape(-1)
    if rows.size != n:
        raise ValueError(f"group {group}: {rows.size} source rows for {n} destination slots")
    capacity = int(src.slab.shape[0])
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= capacity):
        raise ValueError(f"group {group}: source rows outside the slab's {capacity}")
    cols = tuple((int(o), int(c)) for o, c in src.cols)
    if not cols or any(o < 0 or c < 1 or o + c > width for o, c in cols):
        raise ValueError(f"group {group}: columns {cols} must lie inside rows of {width} bytes")
    return rows, cols


def gather_pages(
    out: np.ndarray, slab: np.ndarray, rows: np.ndarray, cols: tuple[tuple[int, int], ...]
) -> None:
    """``out`` (contiguous uint8, ``len(rows) * page_bytes``) = the pages: columns ``cols``
    of rows ``rows`` of ``slab`` (2-D uint8), concatenated per page. The rows must have
    been checked (``check_store_rows``): they are not checked again here."""
    pages = out.reshape(rows.size, -1)
    if len(cols) == 1 and cols[0] == (0, slab.shape[1]):
        # whole rows: one take at memcpy speed. mode="clip" skips numpy's bounds check,
        # which buffers ``out`` (a copy more: 4.3 against 11-12 GB/s on the 2-core box)
        np.take(slab, rows, axis=0, out=pages, mode="clip")
        return
    rc = page_copy._rowcopy
    if rc is not None and slab.strides[1] == 1 and pages.flags.c_contiguous:
        # column spans (a TP slice's runs): one C pass, each page's spans in turn
        at = np.cumsum([0] + [c for _, c in cols[:-1]])
        table = np.array(
            [(o, pages.ctypes.data + int(a), pages.shape[1], c) for (o, c), a in zip(cols, at)],
            dtype=np.int64,
        )
        rows64 = np.ascontiguousarray(rows, dtype=np.int64)
        n = rows64.size
        rc.copy_runs(
            slab.ctypes.data, slab.shape[0], slab.strides[0], table, n, rows64, np.arange(n), 1
        )
        return
    # without it, a fancy-index copy per span (~8 GB/s; a take into the strided span of
    # ``out`` falls back to a byte loop at ~0.5 GB/s)
    col = 0
    for o, c in cols:
        pages[:, col : col + c] = slab[rows, o : o + c]
        col += c


def push_source(
    plane: object, slab: torch.Tensor, rows: Any, cols: tuple[tuple[int, int], ...], dst: Any
) -> tuple[Any, Any]:
    """``(pages, slots)`` of one group's push as ``plane`` takes them fastest: for a plane
    with ``accepts_store_rows``, the rows left in ``slab`` (``StoreRows``) and the slots as
    an int64 array; for any other, the pages' bytes (``materialize()``: a view when the
    rows are one run, else one batched gather) and the slots as a list. The producer and
    ``disagg bench transfer`` both push through this, so the bench pays what a push pays."""
    rows = np.asarray(rows, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    pages = StoreRows(slab, rows, cols)
    if getattr(plane, "accepts_store_rows", False):
        return pages, dst
    return pages.materialize(), dst.tolist()


class DataPlane(abc.ABC):
    """Both sides of page transfer. Implementations: TcpDataPlane (``tcp/``),
    UcxDataPlane (``ucx/``), IpcDataPlane (``ipc/``, one host only), NixlDataPlane
    (``nixl/``)."""

    # True: ``abort`` returns 0 within its bounded wait whatever the peer does (alive,
    # dead or stalled), so once it returns the transfer's slots may be reused: async
    # loads, whose pages the engine reuses right after a cancel, are safe on this plane.
    # False: a stalled peer can hold writes past the wait (``abort`` then returns them,
    # and the caller must not reuse the slots): the plane cannot promise it.
    abort_complete: bool = True

    # --- receiver ----------------------------------------------------------------------
    @abc.abstractmethod
    def register_regions(
        self, group_regions: Sequence[Sequence[RegionSpec | torch.Tensor]]
    ) -> None:
        """Declare where pages may land: ``group_regions[g]`` lists group g's regions in
        page order. Call before any ``expect``; re-registering replaces the set."""

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where senders push to: an address only (pass it in the control Push message)."""

    @property
    def capabilities(self) -> DataCaps:
        """What this receiver takes beyond the plane's base behaviour (pass it in the
        control Push message with ``endpoint``; the sender's ``post_push(caps=...)``)."""
        return DataCaps()

    @property
    def source_caps(self) -> DataCaps:
        """What a sender tells the receivers it serves at the handshake (the producer's
        ``HelloOk``): what they need to reach its pages. Nothing for most planes."""
        return DataCaps()

    def add_source(self, caps: DataCaps) -> None:
        """Receiver: a sender's ``source_caps``, from its ``HelloOk`` (each handshake;
        the same caps again are a no-op). Raises ValueError when this plane cannot read
        from that sender."""

    @abc.abstractmethod
    def expect(
        self,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        total_pages_by_group: Sequence[int],
        deadline_s: float,
        slots_by_group: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Accept transfer ``transfer_id``: ``total_pages_by_group[g]`` pages (slots
        other than -1) of group g, within ``deadline_s`` seconds from now. With
        ``slots_by_group`` the transfer may write only those slots, each once (so even a
        sender holding the token cannot touch another request's pages)."""

    @abc.abstractmethod
    def poll(self, transfer_id: int) -> TransferStatus:
        """Current status of an expected transfer (KeyError if never expected or long
        forgotten)."""

    @abc.abstractmethod
    def abort(self, transfer_id: int, reason: str = "aborted") -> int:
        """Fail the transfer unless already final, and wait (bounded) for writes of it
        already under way: no byte of it is written afterwards. Returns how many writes
        were still under way when the wait ended (0 unless the plane is stuck: then the
        caller cannot reuse the transfer's slots safely)."""

    # --- sender ------------------------------------------------------------------------
    @abc.abstractmethod
    def post_push(
        self,
        endpoint: str,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        pages: Sequence[PageSource],
        deadline_s: float = 30.0,
        caps: DataCaps | None = None,
    ) -> Any:
        """Start sending ``pages`` to a receiver; returns a handle for ``poll_push``.
        ``caps``: the receiver's ``capabilities`` (None: only the plane's base behaviour).
        Raises ValueError at once for malformed input (shapes, slots < -1)."""

    @abc.abstractmethod
    def poll_push(self, handle: Any) -> TransferStatus:
        """Sender-side status of a push (see the module docstring for what DONE means)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop threads and close sockets; pending transfers end FAILED."""

    def health(self) -> tuple[bool, str]:
        """``(True, "")`` while the plane can move and account for bytes; ``(False, why)``
        once it cannot prove that (a worker thread died, a transfer may still be writing
        into memory the engine believes free). Health endpoints report it."""
        return True, ""

    # --- conveniences ------------------------------------------------------------------
    def wait(self, transfer_id: int, timeout_s: float) -> TransferStatus:
        """Poll until final or ``timeout_s`` passes; returns the last status."""
        return _wait(lambda: self.poll(transfer_id), timeout_s)

    def wait_push(self, handle: Any, timeout_s: float) -> TransferStatus:
        return _wait(lambda: self.poll_push(handle), timeout_s)

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait(poll: Any, timeout_s: float) -> TransferStatus:
    end = time.monotonic() + timeout_s
    delay = 0.0002
    while True:
        st = poll()
        if st.final or time.monotonic() >= end:
            return st
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
