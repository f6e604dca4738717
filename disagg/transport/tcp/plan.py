"""Planning a push on the stream plane: one group's pages into batch messages.

A batch is one ``PageBatch`` header (its pages' destination runs, consecutive slots
coalesced) and the source rows whose bytes follow it, in run order. A batch carries at
most ``msg_bytes(endpoint)`` payload bytes and ``MAX_BATCH_PAGES`` pages: ``MSG_BYTES``
(8 MiB) over AF_UNIX, ``TCP_MSG_BYTES`` (2 MiB) over TCP, where a batch that fits the
socket's send buffer lets the sender queue the next one while the receiver checks a
header (docs/design/tcp-plane.md); ``tuning.stream_tcp_msg_bytes``
(``DISAGG_STREAM_TCP_MSG_BYTES``) sets the TCP cut, never above ``MSG_BYTES``.

Sources: a uint8 ``[n, page_bytes]`` tensor, or ``StoreRows`` of a host slab, left in
place (the kernel reads the pages from the rows). A device source is copied to the host
first: this plane moves host memory only. Malformed sources raise ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ... import tuning
from ...protocol import messages as m
from ..dataplane import StoreRows, check_store_rows, gather_pages
from .wire import frame

MSG_BYTES = 8 << 20  # payload per batch message on AF_UNIX (one header check per this many)
TCP_MSG_BYTES = 2 << 20  # ... over TCP (see the module docstring)
MAX_BATCH_PAGES = 1 << 16  # pages per batch (bounds a header's runs for tiny pages)


@dataclass
class Batch:
    """One planned message: its prefix and PageBatch header, and its source rows."""

    head: bytes
    rows: np.ndarray  # int64, contiguous: rows of the source's ``arr``
    nbytes: int


@dataclass
class Source:
    """One group's pages of a push: ``arr`` (a 2-D uint8 view of the slab or tensor,
    kept alive by ``keep``), the column spans of a page, and its batches."""

    arr: np.ndarray
    cols: np.ndarray  # int64 [k, 2]
    keep: torch.Tensor
    batches: list[Batch]

    @property
    def page_bytes(self) -> int:
        return int(self.cols[:, 1].sum())


def msg_bytes(endpoint: str) -> int:
    """Payload bytes per batch message for a push to ``endpoint`` (module docstring)."""
    if not endpoint.startswith("tcp://"):
        return MSG_BYTES
    value = tuning.current().stream_tcp_msg_bytes
    return min(MSG_BYTES, TCP_MSG_BYTES if value is None else value)


def gathered(src: Source, b: Batch) -> np.ndarray:
    """A batch's payload as one buffer (to hash it; only with the checksum on)."""
    per_row = int(src.cols[:, 1].sum())
    out = np.empty(b.rows.size * per_row, dtype=np.uint8)
    gather_pages(out, src.arr, b.rows, tuple((int(o), int(n)) for o, n in src.cols))
    return out


def source_of(
    group: int, src: torch.Tensor | StoreRows, n: int
) -> tuple[torch.Tensor, np.ndarray, tuple[tuple[int, int], ...]]:
    """``(slab, rows, cols)`` of a push source, checked: a host uint8 ``[R, W]`` slab with
    contiguous rows, ``n`` rows inside it and columns inside a row. A device source is
    copied to the host first (this plane moves host memory only)."""
    if isinstance(src, StoreRows):
        slab = src.slab
        if slab.device.type != "cpu":
            return source_of(group, src.materialize().cpu(), n)
        if slab.dtype != torch.uint8 or slab.dim() != 2:
            raise ValueError(
                f"group {group}: the source slab must be 2-D uint8, got {slab.dtype} "
                f"{tuple(slab.shape)}"
            )
        if slab.shape[1] > 1 and slab.stride(1) != 1:
            slab = slab.contiguous()
        rows, cols = check_store_rows(group, src, n, int(slab.shape[1]))
        return slab, rows, cols
    if src.dtype != torch.uint8 or src.dim() != 2 or src.shape[0] != n:
        raise ValueError(
            f"group {group}: rows must be uint8 [len(dst_slots)={n}, page_bytes], "
            f"got {src.dtype} {tuple(src.shape)}"
        )
    if src.shape[1] < 1:
        raise ValueError(f"group {group}: page_bytes must be >= 1")
    if src.device.type != "cpu":
        src = src.cpu()
    if src.shape[1] > 1 and src.stride(1) != 1:
        src = src.contiguous()
    return src, np.arange(n, dtype=np.int64), ((0, int(src.shape[1])),)


def plan_group(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    src: torch.Tensor | StoreRows,
    dst_slots: Sequence[int],
    batch_bytes: int | None = None,
) -> tuple[Source, int]:
    """Split one group's pages into batches of at most ``batch_bytes`` payload bytes
    (default MSG_BYTES) and MAX_BATCH_PAGES pages: each names its pages' destination
    runs (consecutive slots coalesced) and the source rows to send, in that order.
    Vectorised: loops over batches only. Returns the source and its page count."""
    slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    slab, rows, cols = source_of(group, src, int(slots.shape[0]))
    if (slots < -1).any():
        raise ValueError(f"group {group}: destination slots must be >= -1")
    pb = sum(c for _, c in cols)
    arr = slab.numpy()  # [R, W] view, rows contiguous
    cols_arr = np.array(cols, dtype=np.int64).reshape(-1, 2)
    out = Source(arr, cols_arr, slab, [])
    idx = np.flatnonzero(slots >= 0)
    if idx.size == 0:
        return out, 0
    dst = slots[idx]
    rows = np.ascontiguousarray(rows[idx], dtype=np.int64)
    per_msg = max(1, min((batch_bytes or MSG_BYTES) // pb, MAX_BATCH_PAGES))
    brk = np.flatnonzero(np.diff(dst) != 1) + 1  # where destination runs break
    for m0 in range(0, int(idx.size), per_msg):
        m1 = min(m0 + per_msg, int(idx.size))
        cuts = brk[(brk > m0) & (brk < m1)]
        starts = np.concatenate(([m0], cuts))
        counts = np.diff(np.concatenate((starts, [m1])))
        runs = list(zip(dst[starts].tolist(), counts.tolist(), strict=True))
        header = m.encode(
            m.PageBatch(
                transfer_id=transfer_id,
                lease_id=lease_id,
                token=token,
                group=group,
                runs=runs,
                page_bytes=pb,
            )
        )
        nbytes = (m1 - m0) * pb
        out.batches.append(Batch(frame(header, nbytes), rows[m0:m1], nbytes))
    return out, int(idx.size)
