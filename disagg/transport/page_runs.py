"""A page's several runs moved in one pass: ``dst run k of slot dst_idx[i] = src run k of
row src_idx[i]`` for every page ``i`` and run ``k``.

A TP slice (docs/design/unequal-tp.md) is one run per (layer, role) buffer: a split reads
``2 * layers`` runs out of each producer page into one consumer page, a merge writes one
producer page into ``2 * layers`` runs of the consumer's slice regions. ``page_copy``
moves one run per call (one C call, or one kernel launch, over every page): a slice moved
that way costs ``2 * layers`` passes over the pages where a whole page costs one. Here a
batch's runs are one table and one pass:

- **Host**: one C call (``_rowcopy.copy_runs``): for each page, its runs one after the
  other (the next run's first lines requested before each copy), pages spread over
  threads, non-temporal stores as ``copy_rows`` decides for a page of the runs' total
  size. False without the C extension (the caller copies run by run).
- **CUDA with Triton**: one kernel launch (``prepare_runs`` once per pair of views, then
  ``launch_runs``); a program copies a tile of ``RUNS x BLOCK`` elements of one page,
  ``RUNS`` runs (or chunks of a long run) at once, about the 4096 elements a program of
  ``page_copy``'s kernel copies. Offsets, destination row strides and lengths travel in a
  small device table, in units of 16 bytes where every run allows (then the compiler knows
  each row of the tile is 16-byte aligned and issues 16-byte loads and stores; else in
  elements). The destination runs may lie in different regions (tensors); their addresses
  are offsets from the first. None where Triton is missing (the caller copies run by run).

Runs that continue one another in the source row and in destination memory (regions
that are neighbouring columns of one pool, say) are joined into one table row first
(``coalesce``): fewer, longer rows.

Bounds: the caller has checked every index, that every run lies inside its source row,
and that every destination run lies inside its region; the C call checks the indices
again.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from . import page_copy

TILE = 4096  # elements a program copies (page_copy's block)
NUM_WARPS = 8


class Run(NamedTuple):
    """One run of a page: ``length`` bytes at ``src_col`` of the source row, landing at
    ``dst_col`` of ``dst`` (a ``[slots, bytes]`` uint8 region view)."""

    src_col: int
    dst: torch.Tensor
    dst_col: int
    length: int


class HostRuns(NamedTuple):
    """A host copy of a page's runs into fixed regions, prepared once (``prepare_host``):
    the C call's table, so a push of a layout seen before builds nothing per run."""

    table: np.ndarray  # int64 [runs, 4]: source column, destination address, stride, length
    rows: int  # destination rows that every run's region has (a joined run spans regions)
    page_bytes: int  # bytes of one page's runs together


def prepare_host(runs: Sequence[Run]) -> HostRuns | None:
    """The table of ``runs`` for ``copy_host``; None where the C extension is missing
    (copy run by run)."""
    rc = page_copy._rowcopy
    if rc is None or not hasattr(rc, "copy_runs") or not runs:
        return None
    table = np.array(
        coalesce(
            [(r.src_col, r.dst.data_ptr() + r.dst_col, r.dst.stride(0), r.length) for r in runs]
        ),
        dtype=np.int64,
    ).reshape(-1, 4)
    rows = min(int(r.dst.shape[0]) for r in runs)
    return HostRuns(table, rows, int(table[:, 3].sum()))


def copy_host(
    h: HostRuns,
    src: torch.Tensor,
    src_rows: int,
    src_stride: int,
    dst_idx: np.ndarray,
    src_idx: np.ndarray,
) -> None:
    """The host copy of every page's runs in one C call. ``src``: the uint8 export
    (runs' ``src_col`` from its first byte), ``src_stride`` bytes between rows; the C
    call checks every index against ``src_rows`` and ``h.rows`` before a byte moves."""
    si = np.ascontiguousarray(src_idx, dtype=np.int64)
    di = np.ascontiguousarray(dst_idx, dtype=np.int64)
    if not h.table.size:  # every run empty: nothing to copy
        return
    nbytes = si.size * h.page_bytes
    threads = min(page_copy.HOST_THREADS, os.cpu_count() or 1) if nbytes >= 8 << 20 else 1
    page_copy._rowcopy.copy_runs(
        src.data_ptr(), src_rows, src_stride, h.table, h.rows, si, di, threads
    )


def copy_runs_host(
    src: torch.Tensor,
    src_rows: int,
    src_stride: int,
    runs: Sequence[Run],
    dst_idx: np.ndarray,
    src_idx: np.ndarray,
) -> bool:
    """``prepare_host`` and ``copy_host`` at once. False, copying nothing, where the C
    extension is missing (copy run by run)."""
    h = prepare_host(runs)
    if h is None:
        return False
    copy_host(h, src, src_rows, src_stride, dst_idx, src_idx)
    return True


def coalesce(table: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Runs ``(source column, destination address, destination row stride, length)``
    with each run that continues the one before it in the source row and in destination
    memory (same row stride) joined to it: one table row, one longer copy. Every slot's
    bytes are the same either way (row ``i`` of both lies at ``address + i * stride``);
    the caller bounds slots by every region's row count before joining."""
    out: list[tuple[int, int, int, int]] = []
    for s_col, d_at, stride, n in table:
        if n <= 0:
            continue
        if out:
            ps, pd, pstride, pn = out[-1]
            if ps + pn == s_col and pd + pn == d_at and pstride == stride:
                out[-1] = (ps, pd, pstride, pn + n)
                continue
        out.append((s_col, d_at, stride, n))
    return out


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, or None where Triton is missing or unusable."""
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit  # type: ignore[misc]
    def copy_runs(
        src,
        dst,
        src_idx,
        dst_idx,
        table,
        n_chunks,
        src_stride,
        RUNS: tl.constexpr,
        BLOCK: tl.constexpr,
        VEC: tl.constexpr,
    ):  # type: ignore[no-untyped-def]  # noqa: N803
        page = tl.program_id(0)
        k = tl.program_id(1) * RUNS + tl.arange(0, RUNS)
        live = k < n_chunks
        # table rows: (source column, destination offset, destination row stride, length)
        # in units of VEC elements: the compiler then knows each is a multiple of VEC
        s_col = tl.load(table + 4 * k, mask=live, other=0) * VEC
        d_col = tl.load(table + 4 * k + 1, mask=live, other=0) * VEC
        d_stride = tl.load(table + 4 * k + 2, mask=live, other=0) * VEC
        n = tl.load(table + 4 * k + 3, mask=live, other=0) * VEC
        s = tl.load(src_idx + page).to(tl.int64) * src_stride
        d = tl.load(dst_idx + page).to(tl.int64) * d_stride + d_col
        col = tl.arange(0, BLOCK)
        mask = col[None, :] < n[:, None]
        x = tl.load(src + s + s_col[:, None] + col[None, :], mask=mask)
        tl.store(dst + d[:, None] + col[None, :], x, mask=mask)

    return copy_runs, triton.cdiv


class RunsCopy(NamedTuple):
    """A same-device copy of a page's runs between fixed views, prepared once."""

    src: torch.Tensor  # the source as its element, 1-D from its first byte
    dst: torch.Tensor  # the first destination region as its element (offsets from it)
    table: torch.Tensor  # int64 [chunks, 4] on the device, in units of VEC elements
    chunks: int
    src_stride: int  # elements
    runs: int  # RUNS: table rows per program
    block: int
    vec: int
    compiled: dict[torch.dtype, Any]  # as page_copy.DeviceCopy's


def prepare_runs(src: torch.Tensor, src_stride: int, runs: Sequence[Run]) -> RunsCopy | None:
    """For repeated copies of ``runs`` from rows of ``src`` (a uint8 1-D tensor, rows
    every ``src_stride`` bytes from its first byte) on CUDA: the table and launch shape.
    None where the kernel cannot do it: no Triton, host memory, ``src`` not readable from
    the destination's GPU."""
    kernel = _kernel()
    if kernel is None or not runs:
        return None
    dev = runs[0].dst.device
    if dev.type != "cuda" or any(r.dst.device != dev for r in runs):
        return None
    if not page_copy.peer_reachable(dev, src.device):
        return None
    return plan_runs(src, src_stride, runs)


def plan_runs(src: torch.Tensor, src_stride: int, runs: Sequence[Run]) -> RunsCopy | None:
    """``prepare_runs`` without its device checks (tests run it under Triton's
    interpreter on host tensors). None where a destination's rows are not contiguous."""
    dev = runs[0].dst.device
    if any(r.dst.stride(1) != 1 and r.dst.shape[1] > 1 for r in runs):
        return None
    base = runs[0].dst.data_ptr()
    offs = coalesce(
        [(r.src_col, r.dst.data_ptr() + r.dst_col - base, r.dst.stride(0), r.length) for r in runs]
    )
    if not offs:
        return None
    values = [v for o in offs for v in o] + [src.data_ptr(), base, src_stride]
    esz = next(e for e in (8, 4, 2, 1) if all(v % e == 0 for v in values))
    vec = 16 // esz if all(v % 16 == 0 for v in values) else 1
    unit = esz * vec
    longest = max(n for *_, n in offs) // esz
    block = min(TILE, 1 << max(0, (longest - 1).bit_length()))
    table = []
    for s_col, d_off, stride, n in offs:  # runs longer than a block: one row per block
        for at in range(0, n, block * esz):
            step = min(block * esz, n - at)
            table.append(((s_col + at) // unit, (d_off + at) // unit, stride // unit, step // unit))
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[esz]
    try:
        src_el = src[: src.numel() // esz * esz].view(dtype)
        dst_el = runs[0].dst.view(dtype) if esz > 1 else runs[0].dst
    except RuntimeError:  # a view torch cannot reinterpret: run by run instead
        return None
    rows = max(1, min(TILE // block, 1 << (len(table) - 1).bit_length()))
    return RunsCopy(
        src_el, dst_el, torch.tensor(table, dtype=torch.int64, device=dev), len(table),
        src_stride // esz, rows, block, vec, {},
    )  # fmt: skip


def launch_runs(c: RunsCopy, dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
    """Queue the copy of every page's runs on the current stream: int32 or int64 indices
    on the device, bounds checked by the caller."""
    n = dst_idx.numel()
    if n != src_idx.numel():
        raise ValueError(f"{n} destination rows for {src_idx.numel()} sources")
    if n == 0:
        return
    kernel, cdiv = _kernel()
    ck = kernel[(n, cdiv(c.chunks, c.runs))](
        c.src, c.dst, src_idx, dst_idx, c.table, c.chunks, c.src_stride,
        RUNS=c.runs, BLOCK=c.block, VEC=c.vec, num_warps=NUM_WARPS,
    )  # fmt: skip
    page_copy.keep_compiled(c.compiled, ck, src_idx, dst_idx)


def launch_runs_raw(
    c: RunsCopy, n: int, dst_ptr: int, src_ptr: int, dtype: torch.dtype, stream: int
) -> bool:
    """``launch_runs`` with raw 16-byte aligned index addresses, as
    ``page_copy.launch_raw``: False, launching nothing, where no compiled kernel is known."""
    ck = c.compiled.get(dtype)
    if ck is None or (dst_ptr | src_ptr) % 16:
        return False
    if n <= 0:
        return True
    try:
        ck[(n, -(-c.chunks // c.runs), 1)](
            c.src.data_ptr(), c.dst.data_ptr(), src_ptr, dst_ptr, c.table.data_ptr(),
            c.chunks, c.src_stride, c.runs, c.block, c.vec, stream=stream,
        )  # fmt: skip
    except TypeError:
        c.compiled[dtype] = None
        return False
    return True
