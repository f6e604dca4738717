"""The host row copy of the same-host plane (page_copy.copy_indexed on the CPU): the C
one-pass copy (_rowcopy.c) against numpy's fancy indexing, its index checks, and the
torch/numpy fallback used when the extension was not built."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg.transport import page_copy


def _case(rows: int, width: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    src = torch.from_numpy(rng.integers(0, 255, (2 * rows, width), dtype=np.uint8))
    dst = torch.zeros(2 * rows, width, dtype=torch.uint8)
    si = rng.permutation(2 * rows)[:n]
    di = rng.permutation(2 * rows)[:n]
    return dst, src, si, di


@pytest.mark.parametrize("native", [True, False], ids=["c", "fallback"])
@pytest.mark.parametrize("width,n", [(4096, 300), (65536, 200)], ids=["small", "threads"])
def test_scattered_rows_land_byte_exact(monkeypatch, native, width, n):
    if native and page_copy._rowcopy is None:
        pytest.skip("C row copy not built")
    if not native:
        monkeypatch.setattr(page_copy, "_rowcopy", None)
    dst, src, si, di = _case(n, width, n, 1)
    page_copy.copy_indexed(dst, torch.from_numpy(di), src, torch.from_numpy(si))
    want = np.zeros_like(dst.numpy())
    want[di] = src.numpy()[si]
    np.testing.assert_array_equal(dst.numpy(), want)  # 200 x 64 KiB: 12.5 MiB, 4 threads


def test_column_views_keep_the_rest_of_each_row():
    """Strided views (one column span of wider rows) copy only their span."""
    if page_copy._rowcopy is None:
        pytest.skip("C row copy not built")
    dst, src, si, di = _case(64, 96, 64, 2)
    before = dst.clone()
    page_copy.copy_indexed(dst[:, 16:48], torch.from_numpy(di), src[:, 40:72], torch.from_numpy(si))
    want = before.numpy().copy()
    want[di, 16:48] = src.numpy()[si, 40:72]
    np.testing.assert_array_equal(dst.numpy(), want)


def test_bad_indices_are_refused_before_any_byte_moves():
    if page_copy._rowcopy is None:
        pytest.skip("C row copy not built")
    dst, src, si, di = _case(16, 64, 16, 3)
    di[-1] = dst.shape[0]  # one past the end
    with pytest.raises(IndexError, match="destination row 32 .* outside 32 rows"):
        page_copy.copy_indexed(dst, torch.from_numpy(di), src, torch.from_numpy(si))
    assert not dst.any()  # checked first: nothing was written
    si[0] = -1
    with pytest.raises(IndexError, match="source row -1"):
        page_copy._rowcopy.copy_rows(dst.data_ptr(), 32, 64, src.data_ptr(), 32, 64, 64, si, di, 1)
    with pytest.raises(ValueError, match="3 source rows for 2"):
        page_copy._rowcopy.copy_rows(
            dst.data_ptr(), 32, 64, src.data_ptr(), 32, 64, 64, si[:3], di[:2], 1
        )
    with pytest.raises(ValueError, match="row_bytes 65 must fit"):
        page_copy._rowcopy.copy_rows(dst.data_ptr(), 32, 64, src.data_ptr(), 32, 64, 65, si, di, 1)
    with pytest.raises(TypeError, match="int64"):
        page_copy._rowcopy.copy_rows(
            dst.data_ptr(), 32, 64, src.data_ptr(), 32, 64, 64, si.astype(np.int32), di, 1
        )


@pytest.mark.parametrize("threads", [1, 2])
def test_large_copies_with_streaming_stores_land_byte_exact(threads):
    """Copies of 16 MiB or more of rows >= 4 KiB take the non-temporal store path
    (x86-64): destination rows misaligned (odd stride and offset) and a row length that
    is not a multiple of 64 exercise its head and tail; neighbours stay untouched."""
    if page_copy._rowcopy is None:
        pytest.skip("C row copy not built")
    width, stride, n = 65536 + 7, 65536 + 21, 300  # 300 x 64 KiB: 19 MiB
    rng = np.random.default_rng(5)
    src = rng.integers(0, 255, (2 * n, width), dtype=np.uint8)
    buf = np.full(5 + 2 * n * stride, 0xAB, dtype=np.uint8)
    dst = np.lib.stride_tricks.as_strided(buf[5:], (2 * n, width), (stride, 1))
    si = rng.permutation(2 * n)[:n].astype(np.int64)
    di = rng.permutation(2 * n)[:n].astype(np.int64)
    page_copy._rowcopy.copy_rows(
        dst.ctypes.data, 2 * n, stride, src.ctypes.data, 2 * n, width, width, si, di, threads
    )
    want = np.full_like(buf, 0xAB)
    wdst = np.lib.stride_tricks.as_strided(want[5:], (2 * n, width), (stride, 1))
    wdst[di] = src[si]
    np.testing.assert_array_equal(buf, want)
