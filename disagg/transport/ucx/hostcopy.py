"""The tag path's host row copies: a scattered segment gathered into a send buffer
(``GatherSeg``, sender) and a packed segment scattered out of scratch into its slots
(``scatter_host``, receiver).

Both use the C row copy (``page_copy._rowcopy``: one memcpy per row, GIL released, every
row index checked against its side's rows again, non-temporal stores for full 16 MiB
segments) where it is built and the layout allows, else numpy (``gather_pages`` /
``Group.scatter``). One thread each: two measured worse (2.66 against 2.85 GB/s over tcp).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import page_copy
from ..dataplane import gather_pages
from ..receiver import Group, runs_slots
from . import wire


def arange(n: int) -> np.ndarray:
    """``0 .. n-1`` as int64 (the packed side of a row copy), read-only and shared."""
    if n > _ARANGE.shape[0]:
        return np.arange(n, dtype=np.int64)
    return _ARANGE[:n]


_ARANGE = np.arange(wire.SEG_BYTES // 4096 + 1, dtype=np.int64)
_ARANGE.flags.writeable = False


@dataclass(frozen=True)
class GatherSeg:
    """A payload message whose pages are scattered rows of a host array (``slab``:
    2-D uint8, rows checked to lie inside it), each page the concatenation of column
    spans ``cols``: gathered by the progress thread into a send buffer of the ring just
    before it is posted (send.py), so the bytes are read from the slab then, not when
    the push is planned."""

    slab: np.ndarray
    rows: np.ndarray
    cols: tuple[tuple[int, int], ...]
    nbytes: int

    def gather_into(self, out: np.ndarray) -> None:
        """Write the packed pages into ``out`` (uint8, ``nbytes`` long, contiguous)."""
        rc = page_copy._rowcopy
        slab = self.slab
        pb = int(slab.shape[1])
        if rc is not None and self.cols == ((0, pb),) and slab.strides[1] == 1:
            n = int(self.rows.shape[0])
            if out.shape[0] != n * pb:
                raise ValueError(f"send buffer of {out.shape[0]} bytes for {n} pages of {pb}")
            rows = np.ascontiguousarray(self.rows, dtype=np.int64)
            rc.copy_rows(
                out.ctypes.data, n, pb, slab.ctypes.data, int(slab.shape[0]),
                int(slab.strides[0]), pb, rows, arange(n), 1,
            )  # fmt: skip
            return
        gather_pages(out, slab, self.rows, self.cols)


def scatter_host(grp: Group, seg: wire.Segment, packed: np.ndarray) -> None:
    """Land a segment received into host scratch (``packed``: its pages back to back) in
    its slots: the C row copy for a group of one contiguous host region, else
    ``Group.scatter``."""
    pb = grp.page_bytes
    src = packed.reshape(seg.pages, pb)
    slots = runs_slots(seg.runs)
    rc = page_copy._rowcopy
    d = grp.direct
    if rc is not None and d is not None:
        d2 = d.reshape(d.shape[0], -1)
        if d2.shape[1] == pb and d2.strides[1] == 1:
            rc.copy_rows(
                d2.ctypes.data, int(d2.shape[0]), int(d2.strides[0]), src.ctypes.data,
                seg.pages, pb, pb, arange(seg.pages), slots.astype(np.int64, copy=False), 1,
            )  # fmt: skip
            return
    grp.scatter(slots, src)
