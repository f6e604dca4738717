"""A page's several runs in one pass (``page_runs``): a TP split (every buffer's half of a
source page into one destination page) and a merge (a source page into one run of each of
several destination regions), byte for byte against numpy, on the host (the C call) and
through the Triton kernel (on a GPU, or under ``TRITON_INTERPRET=1`` on host tensors);
bytes outside the runs stay untouched."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from disagg.transport import page_copy, page_runs
from disagg.transport.dataplane import StoreRows
from disagg.transport.page_runs import Run

BUFFERS = 8


def _split(pool: torch.Tensor, page: int) -> list[Run]:
    """Run b: the first half of source buffer b, into one destination region of half
    pages."""
    run = page // BUFFERS
    return [Run(b * run, pool, b * run // 2, run // 2) for b in range(BUFFERS)]


def _merge(pool: torch.Tensor, page: int) -> list[Run]:
    """A source row of half a page (a producer rank's heads) into the second half of every
    buffer of whole destination pages: one region view per buffer, as a slice pool."""
    run = page // BUFFERS
    regions = [pool[:, b * run + run // 2 : (b + 1) * run] for b in range(BUFFERS)]
    return [Run(b * run // 2, r, 0, run // 2) for b, r in enumerate(regions)]


def _regions(pool: torch.Tensor, page: int) -> list[Run]:
    """Two destination regions of different row strides (a pool's first quarters, and the
    second halves of its odd rows), each taking a quarter of the source row."""
    odd = pool[1::2, page // 2 :]
    return [Run(0, pool[:, : page // 4], 0, page // 4), Run(page // 2, odd, 0, page // 4)]


# kind -> (its runs, destination page bytes / page, source row bytes / page)
CASES = {"split": (_split, 2, 1), "merge": (_merge, 1, 2), "regions": (_regions, 1, 1)}


def _case(kind: str, page: int, rows: int, slots: int, n: int, seed: int):
    """Random source rows and pool, random rows into random slots, and the pool numpy
    makes of them."""
    make, dst_div, src_div = CASES[kind]
    rng = np.random.default_rng(seed)
    stride = page // src_div
    src = torch.from_numpy(rng.integers(0, 255, rows * stride, dtype=np.uint8))
    pool = torch.from_numpy(rng.integers(0, 255, (slots, page // dst_div), dtype=np.uint8))
    want = pool.clone()
    runs = make(want, page)
    limit = min(int(r.dst.shape[0]) for r in runs)  # every run's region has these slots
    si, di = rng.permutation(rows)[:n], rng.permutation(limit)[:n]
    flat = src.numpy()
    for r in runs:
        d = r.dst.numpy()
        for s, t in zip(si, di, strict=True):
            at = s * stride + r.src_col
            d[t, r.dst_col : r.dst_col + r.length] = flat[at : at + r.length]
    return src, pool, stride, si, di, want


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("page", [4096, 65536])
def test_host_runs_land_byte_exact(kind, page):
    if page_copy._rowcopy is None:
        pytest.skip("C row copy not built")
    rows, slots = 40, 48
    src, pool, stride, si, di, want = _case(kind, page, rows, slots, 20, 3)
    runs = CASES[kind][0](pool, page)
    assert page_runs.copy_runs_host(src, rows, stride, runs, di, si)
    assert pool.equal(want)


def test_host_runs_check_indices_first():
    if page_copy._rowcopy is None:
        pytest.skip("C row copy not built")
    src, pool, stride, _, _, _ = _case("split", 4096, 4, 4, 2, 5)
    before = pool.clone()
    runs = _split(pool, 4096)
    with pytest.raises(IndexError, match="destination row 9"):
        page_runs.copy_runs_host(src, 4, stride, runs, np.array([0, 9]), np.array([1, 2]))
    with pytest.raises(IndexError, match="source row 4"):
        page_runs.copy_runs_host(src, 4, stride, runs, np.array([0, 1]), np.array([4, 2]))
    assert pool.equal(before)


def test_runs_that_continue_each_other_are_joined():
    """Joined only where both the source column and the destination address continue
    the run before, at the same row stride; empty runs dropped."""
    table = [
        (0, 1000, 64, 8),
        (8, 1008, 64, 8),  # continues both: joined
        (16, 1016, 128, 8),  # another row stride: kept
        (24, 1024, 128, 0),  # empty: dropped
        (24, 1030, 128, 8),  # a gap in the destination: kept
        (40, 1038, 128, 8),  # a gap in the source: kept
    ]
    assert page_runs.coalesce(table) == [
        (0, 1000, 64, 16),
        (16, 1016, 128, 8),
        (24, 1030, 128, 8),
        (40, 1038, 128, 8),
    ]


def _neighbours(pool: torch.Tensor, page: int) -> list[Run]:
    """Four regions that are neighbouring column ranges of one pool (a layer's K and V
    registered apart), fed by neighbouring source columns: one run once joined."""
    q = page // 4
    return [Run(b * q, pool[:, b * q : (b + 1) * q], 0, q) for b in range(4)]


def test_neighbouring_regions_copy_as_one_run():
    """Regions that are neighbouring columns of one pool, from neighbouring source
    columns: one table row for the kernel and the C call, bytes as numpy's, indices
    still bounded by every region's rows."""
    page, rows, slots = 4096, 12, 16
    rng = np.random.default_rng(4)
    src = torch.from_numpy(rng.integers(0, 255, rows * page, dtype=np.uint8))
    pool = torch.from_numpy(rng.integers(0, 255, (slots, page), dtype=np.uint8))
    runs = _neighbours(pool, page)
    c = page_runs.plan_runs(src, page, runs)
    assert c is not None
    assert c.chunks == 1, "neighbouring runs were not joined"  # four apart
    if page_copy._rowcopy is None:
        return
    h = page_runs.prepare_host(runs)
    assert h is not None and h.table.shape == (1, 4) and h.rows == slots
    si, di = rng.permutation(rows)[:7], rng.permutation(slots)[:7]
    want = pool.clone()
    want[torch.from_numpy(di)] = src.view(rows, page)[torch.from_numpy(si)]
    page_runs.copy_host(h, src, rows, page, di, si)
    assert pool.equal(want)
    short = [Run(0, pool[:4, :1024], 0, 1024), Run(1024, pool[:, 1024:2048], 0, 1024)]
    h = page_runs.prepare_host(short)
    assert h is not None and h.table.shape == (1, 4) and h.rows == 4
    with pytest.raises(IndexError, match="destination row 9"):
        page_runs.copy_host(h, src, rows, page, np.array([9]), np.array([0]))


def _device() -> str | None:
    if page_runs._kernel() is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize(
    "page,dtype,offset",
    [(4096, torch.int64, 0), (1 << 15, torch.int32, 0), (4096, torch.int64, 8)],
    ids=["4KiB", "32KiB-int32", "unaligned"],
)
def test_kernel_runs_land_byte_exact(kind, page, dtype, offset):
    """``offset``: the source starts 8 bytes into its buffer, so runs are 8-byte aligned
    only: the kernel runs without 16-byte units."""
    dev = _device()
    if dev is None:
        pytest.skip("needs Triton on a GPU, or TRITON_INTERPRET=1")
    rows, slots = 12, 16
    src, pool, stride, si, di, want = _case(kind, page, rows, slots, 7, 6)
    held = torch.zeros(src.numel() + 16, dtype=torch.uint8, device=dev)
    src_dev = held[offset : offset + src.numel()]
    src_dev.copy_(src.to(dev))
    pool_dev = pool.to(dev)
    c = page_runs.plan_runs(src_dev, stride, CASES[kind][0](pool_dev, page))
    assert c is not None and (c.vec > 1) == (offset == 0)
    page_runs.launch_runs(
        c,
        torch.as_tensor(di, dtype=dtype, device=dev),
        torch.as_tensor(si, dtype=dtype, device=dev),
    )
    assert pool_dev.cpu().equal(want)
    if dev == "cuda":  # the direct launch of the kernel the JIT compiled, again
        pool_dev.copy_(pool)
        idx = torch.zeros(64, dtype=dtype, device=dev)
        idx[: len(di)] = torch.as_tensor(di)
        idx[32 : 32 + len(si)] = torch.as_tensor(si)
        stream = torch.cuda.current_stream().cuda_stream
        base = idx.data_ptr()
        launched = page_runs.launch_runs_raw(
            c, len(di), base, base + 32 * idx.element_size(), dtype, stream
        )
        if launched:
            torch.cuda.synchronize()
            assert pool_dev.cpu().equal(want)


def test_store_rows_of_several_spans_gather_in_one_pass():
    """A push's pages of several column spans (a TP slice), gathered for a plane that
    takes bytes: equal to the spans' rows concatenated; a row outside the slab is
    refused by the gather, not read."""
    rng = np.random.default_rng(8)
    slab = torch.from_numpy(rng.integers(0, 255, (32, 4096), dtype=np.uint8))
    cols = tuple((b * 512, 256) for b in range(8))
    rows = np.array([5, 0, 31, 7, 6])
    got = StoreRows(slab, rows, cols).materialize()
    want = torch.cat([slab[torch.from_numpy(rows), o : o + n] for o, n in cols], dim=1)
    assert got.equal(want)
    with pytest.raises(IndexError):
        StoreRows(slab, np.array([1, 32]), cols).materialize()
