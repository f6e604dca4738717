"""One-pass scattered row copy: ``dst[dst_idx[i]] = src[src_idx[i]]`` for 2-D byte views.

This is the same-host data plane's whole data path (the receiver reads the sender's store
rows and writes its own page slots), so it is the one place where bytes move:

- **CUDA with Triton**: one kernel launch per call; each program copies a chunk of one
  page with wide loads, reading the source row and writing the destination slot directly.
  Measured on an H200 (1 GiB of random pages of 16 KiB to 4 MiB from a pool twice that
  size into random slots): 1.83-1.87 TB/s for block sizes 2048-8192 and 8-16 warps,
  against about 0.87 TB/s for ``index_select`` + ``index_copy_`` (two passes, and
  ``index_copy_`` scatters at about 0.4 TB/s) and 2.06 TB/s for one contiguous
  device-to-device copy. Re-measured side by side (a micro benchmark, cuda
  events, median of 7; d2d 2.05-2.07 TB/s): 16 KiB pages 1.82-1.86 TB/s (0.89-0.90 of
  d2d) with int32 or int64 indices; torch ``index_select`` alone 1.81 (0.88),
  ``index_copy_`` alone 0.37 (0.18), both 0.30 (0.15); hints (``tl.multiple_of`` /
  ``max_contiguous``), unmasked blocks, ``.cg``/``.cs`` cache modifiers, blocks of
  1024-2048 and 4-16 warps all landed within 0.81-0.88: the kernel already issues 16-byte
  loads (Triton specialises strides divisible by 16) and is at the gather's own rate.
  Indices may be int32 or int64 (the kernel widens each one it loads). A caller that repeats copies between the same two views (the ipc plane, push
  after push) prepares them once (``prepare_device``) and then only launches
  (``launch_device``): on the H200's VM each Python step before a launch costs tens of
  microseconds on a CPU just woken. Once the JIT compiled the kernel for a prepared copy
  and 16-byte aligned index arrays, ``launch_raw`` launches that compiled kernel with raw
  addresses (H200, CPU time of one launch hot / after a 2 ms sleep: JIT 44 /
  79 us, direct with int pointers and a cached stream handle 12 / 26; in the ipc plane's
  receiver 63 -> 35-49 us).
- **Between two GPUs** (the consumer's slots on one, the producer's store on another):
  the same kernel, launched on the destination GPU, reads the source across NVLink/PCIe
  once peer access is enabled (``cuda_driver.enable_peer_access``); where the GPUs have
  no peer path, torch's gather, cross-device copy and scatter.
- **CUDA without Triton**: ``index_select`` then ``index_copy_`` on 8-byte elements.
- **Host**: one memcpy per row, straight from the source row to its slot, on up to
  HOST_THREADS threads without the GIL (``_rowcopy.c``, built at install; indices checked
  there before a byte moves). Without it: one pass when either side is a run of rows
  (scatter from the source slice, or gather into the destination slice); otherwise a
  gather into a cache-sized buffer and a scatter out of it, chunk by chunk, so the second
  pass reads from cache. torch's index
  kernels on 4- or 8-byte elements (they use every core: 15 GB/s scattering 64 KiB rows
  on the 2-core CI box, against 13 GB/s for one memcpy thread and 12 for numpy); numpy
  for rows that only byte or 2-byte elements fit.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import numpy as np
import torch

from ..native import load
from ..pages import copy_rows, gather_rows, scatter_rows
from . import cuda_driver

# Host path: rows gathered per chunk; about the size of a core's share of L2/L3.
HOST_CHUNK_BYTES = 2 << 20
HOST_THREADS = 4  # threads of the C row copy for copies of 8 MiB or more

# the C row copy (_rowcopy.c; without a compiler at install time, the torch/numpy two-pass
# copy below)
_rowcopy = load("disagg.transport._rowcopy")


@functools.cache
def _triton_kernel() -> Any:
    """The Triton kernel, or None where Triton is missing or unusable (CPU-only hosts)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # ImportError, or a broken install: fall back to torch ops
        return None

    # Triton reads the signature itself: no annotations (it resolves them as globals).
    @triton.jit  # type: ignore[misc]
    def copy_pages(
        src, dst, src_idx, dst_idx, src_stride, dst_stride, n_elems, BLOCK: tl.constexpr
    ):  # type: ignore[no-untyped-def]  # noqa: N803
        page = tl.program_id(0)
        chunk = tl.program_id(1)
        s = tl.load(src_idx + page).to(tl.int64) * src_stride
        d = tl.load(dst_idx + page).to(tl.int64) * dst_stride
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elems
        tl.store(dst + d + offs, tl.load(src + s + offs, mask=mask), mask=mask)

    return copy_pages, triton.cdiv


def one_pass(device: torch.device) -> bool:
    """Whether ``copy_indexed`` on ``device`` reads each source row and writes its
    destination row directly (the host's row copy; the Triton kernel on CUDA), rather than
    through torch's gather and scatter."""
    return device.type == "cpu" or (device.type == "cuda" and _triton_kernel() is not None)


_INDEX_DTYPES = (torch.int32, torch.int64)
_WIDTHS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))


def _as_elems(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` viewed as the widest element (8, 4, 2 or 1 bytes) that both row
    lengths, row strides and addresses allow: wide elements give wide loads."""
    for dtype, size in _WIDTHS:
        if all(
            t.shape[1] % size == 0 and t.stride(0) % size == 0 and t.data_ptr() % size == 0
            for t in (a, b)
        ):
            try:
                return a.view(dtype), b.view(dtype)
            except RuntimeError:  # a layout view() cannot reinterpret
                continue
    return a, b


def copy_indexed(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> None:
    """``dst[dst_idx] = src[src_idx]`` for uint8 ``[rows, n]`` views with contiguous rows
    (row strides may differ). Indices are int64 (or, on a device, int32) host or device
    tensors; the caller has checked their bounds. On CUDA the copy is queued on the current stream (the caller
    synchronises); on the host it is done when this returns."""
    if dst_idx.numel() != src_idx.numel():
        raise ValueError(f"{dst_idx.numel()} destination rows for {src_idx.numel()} sources")
    if dst.shape[1] != src.shape[1]:
        raise ValueError(f"rows of {src.shape[1]} bytes cannot land in rows of {dst.shape[1]}")
    n = dst_idx.numel()
    if n == 0 or dst.shape[1] == 0:
        return
    if dst.device.type == "cpu" and src.device.type == "cpu":
        _copy_host(dst, dst_idx, src, src_idx)
    elif dst.device == src.device:
        _copy_device(dst, dst_idx, src, src_idx)
    elif peer_reachable(dst.device, src.device):  # the kernel on dst's GPU reads src's
        with torch.cuda.device(dst.device):
            _copy_device(dst, dst_idx, src, src_idx)
    else:  # across devices (a host store into device slots): gather, move, scatter
        rows = gather_rows(src, src_idx.to(src.device, torch.int64))
        scatter_rows(dst, dst_idx.to("cpu", torch.int64), rows.to(dst.device, non_blocking=True))


class DeviceCopy(NamedTuple):
    """A same-device copy between two fixed views, prepared once (``prepare_device``)."""

    ws: torch.Tensor  # the source view as its widest element
    wd: torch.Tensor  # the destination view likewise
    src_stride: int
    dst_stride: int
    n_elems: int  # elements per row
    block: int
    chunks: int  # programs per row
    # index dtype -> the kernel Triton compiled for this copy with 16-byte aligned index
    # arrays of that dtype (None: direct launches failed once; use the JIT path)
    compiled: dict[torch.dtype, Any]


def prepare_device(dst: torch.Tensor, src: torch.Tensor) -> DeviceCopy | None:
    """For repeated copies between the same two views on CUDA devices: the element
    views and launch shape, worked out once (each push of the ipc plane then launches
    with no per-call Python beyond the launch itself). The kernel runs on ``dst``'s GPU
    (the caller makes it current), indices there too; ``src`` on that GPU or on one it
    has peer access to. None where the Triton kernel is unavailable or ``src`` cannot
    be read from ``dst``'s GPU: use ``copy_indexed``."""
    kernel = _triton_kernel()
    if kernel is None or dst.device.type != "cuda" or not peer_reachable(dst.device, src.device):
        return None
    if dst.shape[1] != src.shape[1]:
        raise ValueError(f"rows of {src.shape[1]} bytes cannot land in rows of {dst.shape[1]}")
    ws, wd = _as_elems(src, dst)
    n_elems = ws.shape[1]
    block = min(4096, 1 << max(6, (n_elems - 1).bit_length()))
    chunks = kernel[1](n_elems, block)
    return DeviceCopy(ws, wd, ws.stride(0), wd.stride(0), n_elems, block, chunks, {})


def peer_reachable(dst: torch.device, src: torch.device) -> bool:
    """Whether a kernel on CUDA device ``dst`` can read ``src`` (the same GPU, or one it
    has peer access to, enabled here on first use)."""
    if src == dst:
        return True
    if src.type != "cuda" or dst.type != "cuda":
        return False
    return cuda_driver.enable_peer_access(dst.index or 0, src.index or 0) is None


def launch_device(c: DeviceCopy, dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
    """``copy_indexed`` for a prepared copy: int32 or int64 indices already on the
    device, bounds checked by the caller; queued on the current stream."""
    n = dst_idx.numel()
    if n != src_idx.numel():
        raise ValueError(f"{n} destination rows for {src_idx.numel()} sources")
    if n == 0 or c.n_elems == 0:
        return
    copy_pages = _triton_kernel()[0]
    ck = copy_pages[(n, c.chunks)](
        c.ws, c.wd, src_idx, dst_idx, c.src_stride, c.dst_stride, c.n_elems,
        BLOCK=c.block, num_warps=8,
    )  # fmt: skip
    keep_compiled(c.compiled, ck, src_idx, dst_idx)


def keep_compiled(
    compiled: dict[torch.dtype, Any], ck: Any, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """Keep what Triton compiled for aligned index arrays of this dtype, so that a raw
    launch (``launch_raw``) runs it again without the JIT's per-call argument binding."""
    dtype = dst_idx.dtype
    if (
        dtype == src_idx.dtype
        and dtype not in compiled
        and (dst_idx.data_ptr() | src_idx.data_ptr()) % 16 == 0
    ):
        compiled[dtype] = ck


def launch_raw(
    c: DeviceCopy, n: int, dst_ptr: int, src_ptr: int, dtype: torch.dtype, stream: int
) -> bool:
    """``launch_device`` with raw device addresses of ``n`` indices each (both 16-byte
    aligned; bounds checked by the caller) on the CUDA stream handle ``stream``: the
    kernel compiled by an earlier ``launch_device`` of this copy with aligned indices of
    ``dtype`` is launched straight away (the JIT's argument binding and specialisation
    cost ~40 us of a just-woken CPU on the H200's VM; a direct launch ~15). Returns False,
    launching nothing, where no such kernel is known (the caller then uses
    ``launch_device`` with tensors). The kernel was specialised for exactly this copy's
    views and strides, and for 16-byte aligned index arrays: hence the alignment rule."""
    ck = c.compiled.get(dtype)
    if ck is None or (dst_ptr | src_ptr) % 16:
        return False
    if n <= 0 or c.n_elems == 0:
        return True
    try:
        ck[(n, c.chunks, 1)](
            c.ws.data_ptr(), c.wd.data_ptr(), src_ptr, dst_ptr, c.src_stride, c.dst_stride,
            c.n_elems, c.block, stream=stream,
        )  # fmt: skip
    except TypeError:  # another Triton's calling convention: the JIT path from now on
        c.compiled[dtype] = None
        return False
    return True


def _copy_device(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> None:
    prepared = prepare_device(dst, src)
    if prepared is None:  # torch's index kernels want int64 indices
        rows = gather_rows(src, src_idx.to(src.device, torch.int64, non_blocking=True))
        rows = rows.to(dst.device, non_blocking=True)  # a no-op on one GPU
        scatter_rows(dst, dst_idx.to(dst.device, torch.int64, non_blocking=True), rows)
        return
    si, di = src_idx, dst_idx  # int32 or int64: the kernel widens each index it loads
    if si.device != dst.device or si.dtype not in _INDEX_DTYPES:  # the kernel's GPU
        si = si.to(dst.device, dtype=torch.int64, non_blocking=True)
    if di.device != dst.device or di.dtype not in _INDEX_DTYPES:
        di = di.to(dst.device, dtype=torch.int64, non_blocking=True)
    launch_device(prepared, di, si)


def _copy_host(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> None:
    si, di = src_idx.cpu().numpy(), dst_idx.cpu().numpy()
    s_run, d_run = _is_run(si), _is_run(di)
    if s_run and d_run:
        s0, d0, n = int(si[0]), int(di[0]), si.size
        copy_rows(dst[d0 : d0 + n], src[s0 : s0 + n])
        return
    if _rowcopy is not None and _native_ok(dst, src):
        nbytes = si.size * src.shape[1] * src.element_size()
        threads = min(HOST_THREADS, os.cpu_count() or 1) if nbytes >= 8 << 20 else 1
        esz = src.element_size()
        _rowcopy.copy_rows(
            dst.data_ptr(), dst.shape[0], dst.stride(0) * esz,
            src.data_ptr(), src.shape[0], src.stride(0) * esz,
            src.shape[1] * esz, np.ascontiguousarray(si, dtype=np.int64),
            np.ascontiguousarray(di, dtype=np.int64), threads,
        )  # fmt: skip
        return
    ws, wd = _as_elems(src, dst)
    if ws.element_size() >= 4:  # torch's index kernels run on every core
        _copy_host_torch(wd, di, ws, si, s_run, d_run)
        return
    s_np, d_np = ws.numpy(), wd.numpy()
    if s_run:  # one pass: scatter straight from the source rows
        d_np[di] = s_np[int(si[0]) : int(si[0]) + si.size]
        return
    if d_run and d_np[int(di[0]) : int(di[0]) + di.size].flags.c_contiguous:
        # one pass: gather straight into the destination rows
        np.take(s_np, si, axis=0, out=d_np[int(di[0]) : int(di[0]) + di.size])
        return
    per = max(1, HOST_CHUNK_BYTES // max(1, src.shape[1]))
    buf = np.empty((min(per, si.size), s_np.shape[1]), dtype=s_np.dtype)
    for start in range(0, si.size, per):  # per cache-sized chunk, not per row
        rows = si[start : start + per]
        out = buf[: rows.size]
        np.take(s_np, rows, axis=0, out=out)
        d_np[di[start : start + per]] = out


def _copy_host_torch(
    wd: torch.Tensor, di: np.ndarray, ws: torch.Tensor, si: np.ndarray, s_run: bool, d_run: bool
) -> None:
    """The host copy with torch's index kernels on wide elements (parallel over rows)."""
    dt, st = torch.from_numpy(di), torch.from_numpy(si)
    if s_run:  # one pass: scatter straight from the source rows
        wd.index_copy_(0, dt, ws[int(si[0]) : int(si[0]) + si.size])
        return
    if d_run and wd[int(di[0]) : int(di[0]) + di.size].is_contiguous():
        # one pass: gather straight into the destination rows
        torch.index_select(ws, 0, st, out=wd[int(di[0]) : int(di[0]) + di.size])
        return
    per = max(1, HOST_CHUNK_BYTES // max(1, ws.shape[1] * ws.element_size()))
    buf = torch.empty((min(per, si.size), ws.shape[1]), dtype=ws.dtype)
    for start in range(0, si.size, per):  # per cache-sized chunk, not per row
        k = min(per, si.size - start)
        torch.index_select(ws, 0, st[start : start + k], out=buf[:k])
        wd.index_copy_(0, dt[start : start + k], buf[:k])


def _native_ok(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the C row copy applies: two 2-D host views of one dtype whose rows are
    contiguous (any row stride) and of one width."""
    return (
        dst.dim() == 2
        and src.dim() == 2
        and dst.dtype == src.dtype
        and dst.shape[1] == src.shape[1]
        and (dst.shape[1] <= 1 or (dst.stride(1) == 1 and src.stride(1) == 1))
    )


def _is_run(idx: np.ndarray) -> bool:
    return idx.size < 2 or bool((np.diff(idx) == 1).all())
