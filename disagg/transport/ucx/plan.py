"""How a push is cut into messages, on the caller's thread (``plan_push``): what the sender
posts later, in order, without a Python step per page.

Contract: the plan is a list of (buffer, tag) in send order, ending with the TransferDone
frame. A buffer is one of

- a header frame (``wire.frame``) under the batch's header tag (``wire.Cut``);
- a contiguous payload: a view of the source when a segment's pages are one range of it
  (numpy for host rows, a CUDA tensor for device rows);
- ``iov.IovBuf``: a segment of scattered host store rows sent from where they lie
  (``iov_sends``: shm, or tcp under large segments);
- ``hostcopy.GatherSeg``: a segment of scattered host rows gathered into a send buffer
  by the progress thread right before it is posted;
- ``RmaBatch``: a batch the receiver reads itself (``rma``): framed with the slab's
  registration when posted (send.py); no payload follows.

Host rows: batches of runs (``batches``: at most ``wire.RUNS_PER_BATCH`` runs and
``wire.BATCH_BYTES`` per batch), each cut into segments exactly as the receiver will cut
its header (``wire.segments``). CUDA rows: whole batches (header under ``HDR_WHOLE_TAG``)
whose payload is ONE message, gathered with one batched ``index_select`` (or a view of
one range), one stream sync per push. RMA: the pages in batches that start small
(``RMA_FIRST_PAGES``) and grow ``RMA_RAMP``-fold up to ``RMA_MAX_PAGES``, so the consumer
starts reading the first while it checks the next.

Source rows are checked here (shapes, slab bounds, slots >= -1): a bad push raises
ValueError before anything is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...pages import gather_rows
from ...protocol import messages as m
from ..dataplane import RowsSource, StoreRows, check_store_rows
from . import iov, wire
from .hostcopy import GatherSeg
from .wire import Cut, segments

# pages per RMA batch (16 bytes each in the header: 64 KiB), the push's first batch,
# and the growth from one to the next (what a batch costs the consumer to check grows
# with its pages: a small first batch lets reading start early)
RMA_MAX_PAGES = 4096
RMA_FIRST_PAGES = 64
RMA_RAMP = 16


@dataclass
class RmaBatch:
    """One batch the consumer reads from ``slab`` (a host store, registered on first use
    by the progress thread, which frames the header then): page ``i`` lands in slot
    ``slots[i]`` from slab row ``rows[i]``."""

    transfer_id: int
    lease_id: int
    token: bytes
    group: int
    page_bytes: int
    slab: np.ndarray
    owner: torch.Tensor
    slots: np.ndarray
    rows: np.ndarray
    cols: tuple[tuple[int, int], ...]
    batch: int
    ack_tag: int
    nbytes: int


@dataclass
class Plan:
    """A planned push: ``msgs`` in send order, its page count, what must stay alive
    until it is sent, and whether the receiver reads some of it itself (``rma``)."""

    msgs: list[tuple[Any, int]]
    pages: int
    keep: list[object]
    rma: bool


def plan_push(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    pages: Sequence[RowsSource],
    cut: Cut,
    iov_sends: bool,
    rma: bool,
    cuda: bool,
) -> Plan:
    """The messages of a push (module docstring). ``iov_sends``: scattered host store rows
    go as iov messages (the caller checked ``iov.available()``); ``rma``: host StoreRows
    go as RMA batches; ``cuda``: the plane takes CUDA source rows."""
    srcs: list[tuple[int, torch.Tensor | StoreRows, Sequence[int]]] = []
    for group, src, dst_slots in pages:
        if isinstance(src, StoreRows) and src.slab.device.type != "cpu":
            src = src.materialize()  # device slab: whole mode, one batched gather
        srcs.append((group, src, dst_slots))
    devices = {
        src.device
        for _, src, _ in srcs
        if isinstance(src, torch.Tensor) and src.device.type == "cuda"
    }
    if devices and not cuda:
        raise ValueError("CUDA source rows need a plane made with cuda=True")
    msgs: list[tuple[Any, int]] = []
    keep: list[object] = []
    npages = seq = batch = 0
    for group, rows, dst_slots in srcs:
        if rma and isinstance(rows, StoreRows):
            got, n, batch = plan_rma(
                transfer_id, lease_id, token, group, rows, dst_slots, batch, keep
            )
        else:
            got, n, seq = plan_group(
                transfer_id, lease_id, token, group, rows, dst_slots, seq, keep,
                cut.direct_min, cut.hdr_tag, iov_sends, cut.seg_bytes,
            )  # fmt: skip
        msgs.extend(got)
        npages += n
    for dev in devices:  # the rows' producers and our gathers end before UCX reads
        torch.cuda.current_stream(dev).synchronize()
    done = m.TransferDone(transfer_id=transfer_id, lease_id=lease_id, token=token)
    msgs.append((wire.frame(done), wire.HDR_TAG))
    return Plan(msgs, npages, keep, batch > 0)


def batches(
    dst: np.ndarray, idx: np.ndarray, pb: int, max_pages: int | None = None
) -> list[tuple[list[tuple[int, int]], np.ndarray]]:
    """Cut a group's pages (destination slots ``dst``, source rows ``idx``, both in page
    order, ``idx`` increasing) into batches: runs where slots and rows are both adjacent,
    up to ``RUNS_PER_BATCH`` runs and ``BATCH_BYTES`` per batch (a run splits at the
    byte limit; and at ``max_pages`` pages when given). Vectorised: a Python step per
    batch, none per run or page. Returns (runs, source row of each page) per batch."""
    brk = np.flatnonzero((np.diff(dst) != 1) | (np.diff(idx) != 1)) + 1
    starts = np.concatenate(([0], brk))
    counts = np.diff(np.concatenate((starts, [idx.size])))
    ends = np.cumsum(counts)  # page index just past each run
    run_dst = dst[starts]
    per_batch = max(1, wire.BATCH_BYTES // pb)
    if max_pages is not None:
        per_batch = min(per_batch, max_pages)
    total = int(idx.size)
    out = []
    page = r = off = 0  # next page; its run; pages of that run already sent
    while page < total:
        end = min(page + per_batch, total)
        r_end = int(np.searchsorted(ends, end, side="left"))  # run holding page end-1
        r_last = min(r_end, r + wire.RUNS_PER_BATCH - 1)
        if r_last < r_end:
            end = int(ends[r_last])  # the run limit ends the batch first
        b_dst = run_dst[r : r_last + 1].copy()
        b_cnt = counts[r : r_last + 1].copy()
        b_dst[0] += off
        b_cnt[0] -= off
        b_cnt[-1] -= int(ends[r_last]) - end
        # tuples, not ``tolist()``'s [dst, count] lists: the collector untracks a tuple of
        # ints the first time it sees it, a list it tracks for good. A push of scattered
        # pages has ~one run per page alive through planning, and lists were promoted
        # into the old generation by the thousand: a full collection of the whole
        # process (~60 ms) every ~65536 pages, inside ``post_push``
        runs = list(zip(b_dst.tolist(), b_cnt.tolist(), strict=True))
        out.append((runs, idx[page:end]))
        if int(ends[r_last]) == end:
            r, off = r_last + 1, 0
        else:
            r, off = r_last, end - (int(ends[r_last]) - int(counts[r_last]))
        page = end
    return out


def headed_batches(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    slots: np.ndarray,
    pb: int,
    max_pages: int | None = None,
) -> tuple[int, list[tuple[m.PageBatch, list[tuple[int, int]], np.ndarray]]]:
    """The pages to send (slots >= 0, -1 skipped) cut into ``batches``, each with its
    PageBatch header: (pages, [(header, runs, source page index of each page)])."""
    idx = np.flatnonzero(slots >= 0)
    if idx.size == 0:
        return 0, []
    out = []
    for runs, page_src in batches(slots[idx], idx, pb, max_pages):
        header = m.PageBatch(
            transfer_id=transfer_id,
            lease_id=lease_id,
            token=token,
            group=group,
            runs=runs,
            page_bytes=pb,
        )
        out.append((header, runs, page_src))
    return int(idx.size), out


def plan_group(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    rows: torch.Tensor | StoreRows,
    dst_slots: Sequence[int],
    seq: int,
    keep: list[object],
    direct_min: int = wire.DIRECT_MIN,
    hdr_tag: int = wire.HDR_TAG,
    iov_sends: bool = False,
    seg_bytes: int | None = None,
) -> tuple[list[tuple[Any, int]], int, int]:
    """One group's tag-path messages (module docstring), from payload segment ``seq`` on.
    Returns (messages, pages, next seq)."""
    key = wire.tag_key(token)
    slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    if isinstance(rows, StoreRows):
        return _plan_store_rows(
            transfer_id, lease_id, token, group, rows, slots, seq, keep, direct_min,
            hdr_tag, iov_sends, seg_bytes,
        )  # fmt: skip
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[0] != slots.shape[0]:
        raise ValueError(
            f"group {group}: rows must be uint8 [len(dst_slots)={slots.shape[0]}, page_bytes], "
            f"got {rows.dtype} {tuple(rows.shape)}"
        )
    if (slots < -1).any():
        raise ValueError(f"group {group}: destination slots must be >= -1")
    arr: Any
    whole = rows.device.type == "cuda"
    if whole:
        arr = rows.contiguous()  # stays on the device; sent from there
    else:
        arr = rows.cpu().contiguous().numpy()
    keep.append(arr)
    pb = int(arr.shape[1])
    if pb < 1:
        raise ValueError(f"group {group}: page_bytes must be >= 1")
    pages, batched = headed_batches(transfer_id, lease_id, token, group, slots, pb)
    if not pages:
        return [], 0, seq
    msgs: list[tuple[Any, int]] = []
    for header, runs, page_src in batched:
        if whole:
            msgs.append((wire.frame(header), wire.HDR_WHOLE_TAG))
            r0, n = int(page_src[0]), int(page_src.size)
            if int(page_src[-1]) - r0 + 1 == n:  # one source range: zero copy
                buf = arr[r0 : r0 + n].reshape(-1)
            else:
                ridx = torch.from_numpy(page_src).to(arr.device)
                buf = gather_rows(arr, ridx).reshape(-1)
                keep.append(buf)
            msgs.append((buf, wire.data_tag(key, transfer_id, seq)))
            seq += 1
            continue
        msgs.append((wire.frame(header), hdr_tag))
        for seg in segments(runs, pb, direct_min, seg_bytes):
            rows_of = page_src[seg.first : seg.first + seg.pages]
            r0 = int(rows_of[0])
            if int(rows_of[-1]) - r0 + 1 == seg.pages:  # one source range: zero copy
                buf = arr[r0 : r0 + seg.pages].reshape(-1)
            else:  # gathered into a send buffer right before it is posted
                buf = GatherSeg(arr, rows_of, ((0, pb),), seg.pages * pb)
            msgs.append((buf, wire.data_tag(key, transfer_id, seq)))
            seq += 1
    return msgs, pages, seq


def _store_source(
    group: int, src: StoreRows, slots: np.ndarray, keep: list[object]
) -> tuple[np.ndarray, np.ndarray, tuple[tuple[int, int], ...], int]:
    """``(slab as numpy, rows, cols, page_bytes)`` of a host StoreRows push source,
    checked: a 2-D uint8 slab with contiguous rows, one row per slot inside it, columns
    inside a row, slots >= -1. Keeps the slab alive until the push's messages are sent."""
    slab = src.slab
    if slab.dtype != torch.uint8 or slab.dim() != 2 or slab.device.type != "cpu":
        raise ValueError(
            f"group {group}: the source slab must be a 2-D uint8 host tensor, got "
            f"{slab.dtype} {tuple(slab.shape)} on {slab.device}"
        )
    if slab.shape[1] > 1 and slab.stride(1) != 1:
        raise ValueError(f"group {group}: the source slab's rows must be contiguous")
    rows, cols = check_store_rows(group, src, int(slots.shape[0]), int(slab.shape[1]))
    if (slots < -1).any():
        raise ValueError(f"group {group}: destination slots must be >= -1")
    arr = slab.numpy()
    keep.append(arr)
    return arr, rows, cols, sum(c for _, c in cols)


def _plan_store_rows(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    src: StoreRows,
    slots: np.ndarray,
    seq: int,
    keep: list[object],
    direct_min: int,
    hdr_tag: int,
    iov_sends: bool,
    seg_bytes: int | None,
) -> tuple[list[tuple[Any, int]], int, int]:
    """``plan_group`` for StoreRows of a host slab: the same batches, headers and
    segments as for the gathered pages (the receiver cannot tell), each segment sent
    from the slab: a view when its pages are one span of it, else an iov of the spans
    (``iov.iov_entries``: adjacent rows merged), or a ``GatherSeg``."""
    slab, srows, cols, pb = _store_source(group, src, slots, keep)
    pages, batched = headed_batches(transfer_id, lease_id, token, group, slots, pb)
    if not pages:
        return [], 0, seq
    key = wire.tag_key(token)
    base, stride = int(slab.ctypes.data), int(slab.strides[0])
    flat = slab.reshape(-1) if slab.flags.c_contiguous else None
    msgs: list[tuple[Any, int]] = []
    for header, runs, page_src in batched:
        msgs.append((wire.frame(header), hdr_tag))
        for seg in segments(runs, pb, direct_min, seg_bytes):
            rows_of = srows[page_src[seg.first : seg.first + seg.pages]]
            entries = iov.iov_entries(base, stride, rows_of, cols)
            buf: Any
            if entries.shape[0] == 1 and flat is not None:  # one span of the slab: a view
                start = int(entries[0, 0]) - base
                buf = flat[start : start + int(entries[0, 1])]
            elif iov_sends:
                buf = iov.IovBuf(entries, seg.pages * pb, slab)
            else:  # gathered into a send buffer right before it is posted
                buf = GatherSeg(slab, rows_of, cols, seg.pages * pb)
            msgs.append((buf, wire.data_tag(key, transfer_id, seq)))
            seq += 1
    return msgs, pages, seq


def rma_cuts(pages: int, page_bytes: int, first: bool) -> list[int]:
    """Where a group's ``pages`` pages are cut into RMA batches (the end of each): at
    most ``RMA_MAX_PAGES`` pages and ``BATCH_BYTES`` per batch (at least a page); the
    push's ``first`` batch ``RMA_FIRST_PAGES`` pages, each next one ``RMA_RAMP`` times
    the one before."""
    cap = max(1, min(RMA_MAX_PAGES, wire.BATCH_BYTES // page_bytes))
    size = min(cap, RMA_FIRST_PAGES) if first else cap
    ends = []
    at = 0
    while at < pages:
        at = min(pages, at + size)
        ends.append(at)
        size = min(cap, size * RMA_RAMP)
    return ends


def plan_rma(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    src: StoreRows,
    dst_slots: Sequence[int],
    batch: int,
    keep: list[object],
) -> tuple[list[tuple[Any, int]], int, int]:
    """One group's RMA batches: the pages to send (slots >= 0) in page order, cut by
    ``rma_cuts``, each an ``RmaBatch`` naming the destination slot and slab row of every
    page. ``batch`` numbers the push's RMA batches (their acknowledgement tags; 0: this
    is the push's first, a small one). Returns (messages, pages, next batch number)."""
    slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    slab, srows, cols, pb = _store_source(group, src, slots, keep)
    idx = np.flatnonzero(slots >= 0)
    if idx.size == 0:
        return [], 0, batch
    key = wire.tag_key(token)
    dst, rows = slots[idx], srows[idx]
    msgs: list[tuple[Any, int]] = []
    start = 0
    for end in rma_cuts(int(idx.size), pb, batch == 0):
        rb = RmaBatch(
            transfer_id, lease_id, token, group, pb, slab, src.slab, dst[start:end],
            rows[start:end], cols, batch, wire.ack_tag(key, transfer_id, batch),
            (end - start) * pb,
        )  # fmt: skip
        msgs.append((rb, wire.HDR_RMA_TAG))
        batch += 1
        start = end
    return msgs, int(idx.size), batch
