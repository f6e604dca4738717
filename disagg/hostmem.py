"""Host page memory backed by transparent huge pages (THP) where the kernel allows it.

Why: moving pages between processes over shared memory, UCX copies with CMA
(``process_vm_writev``), and the kernel pins the *destination* process's pages one 4 KiB
page at a time. Measured on the 2-core box (256 MiB, ``process_vm_writev`` via ctypes,
16 MiB per call): into 4 KiB pages 5.9-6.6 GB/s, into huge pages 11.3-12.6 GB/s (plain
memcpy 11.9-13.3 on either kind). The source side does not matter; the *relative*
alignment of source and destination does: ``rep movsb`` in the kernel's copy runs at
6.8-9 GB/s when the two addresses differ modulo 64 (numpy's big arrays start 16 bytes
into a page, torch's 64 bytes), 11.3-12.2 GB/s when they agree. Memory from here starts
on a 2 MiB boundary, so every page row of it agrees with every other such row and with
torch's 64-byte-aligned allocations. A numpy scatter of 64 KiB pages into huge-page
memory also runs 1.1-1.3x faster than into 4 KiB pages (fewer TLB misses).

How: an anonymous ``mmap`` rounded up to whole 2 MiB pages (plus one for alignment),
``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned part *before first touch* (a page
touched first is a 4 KiB page until khugepaged collapses it, maybe much later), then a
torch tensor over it (``torch.frombuffer``; the mapping lives as long as the tensor).
With THP ``enabled`` = ``madvise`` (a common default) only madvised memory gets huge
pages; ``always`` gives them to every large allocation anyway, and ``never`` to none.

It never fails because of THP: when the kernel has THP off (``never``), has no
``MADV_HUGEPAGE`` (not Linux), refuses the madvise, or the buffer is under 2 MiB, it
returns an ordinary ``torch.empty`` (pinned if asked). Pinned memory (``pin=True``, with
CUDA) is the huge-page mapping registered with ``cudaHostRegister`` (unregistered when
the tensor is freed), or ``torch.empty(pin_memory=True)`` if registration fails.

Used where disagg itself allocates host page memory: the producer's host store, the UCX
plane's receive scratch, and ``disagg bench transfer``'s store, pool and memcpy ceiling.
The consumer's page pool belongs to the engine: an operator running a CPU pool (a CPU
offload tier, say) and receiving over UCX shared memory gets the same gain by allocating
it with :func:`empty` (that also lets the UCX plane land runs of 1 MiB or more in place).
"""

from __future__ import annotations

import logging
import math
import mmap
import sys
import threading
import weakref
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) PMD size
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)

# [start, end) of the live huge-page-advised allocations, for is_huge()
_huge_ranges: dict[int, int] = {}
_ranges_lock = threading.Lock()


def thp_mode() -> str:
    """The kernel's THP mode: ``always``, ``madvise``, ``never``, or ``unavailable``
    (no such setting: not Linux, or a kernel without THP)."""
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unavailable"


def anon_huge_bytes(pid: int | str = "self") -> int:
    """Bytes of anonymous memory of a process now backed by huge pages
    (``AnonHugePages`` in ``/proc/<pid>/smaps_rollup``); 0 where that cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def is_huge(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie in a live allocation of :func:`empty` that was advised
    to use huge pages (the kernel may still have backed some of it with 4 KiB pages, if
    it found no free 2 MiB page at first touch)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    with _ranges_lock:
        return any(s <= start and end <= e for s, e in _huge_ranges.items())


def empty(
    shape: int | Sequence[int], dtype: torch.dtype = torch.uint8, *, pin: bool = False
) -> torch.Tensor:
    """An uninitialised contiguous host tensor, backed by huge pages where the kernel
    allows it (see the module docstring), else an ordinary ``torch.empty``. ``pin``:
    page-locked for CUDA copies (ignored without CUDA, like ``pin_memory``)."""
    dims = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
    nbytes = math.prod(dims) * dtype.itemsize
    pin = pin and torch.cuda.is_available()
    if nbytes >= HUGE_PAGE and thp_mode() in ("always", "madvise"):
        try:
            t = _huge(nbytes, pin)
        except (OSError, ValueError, RuntimeError) as exc:
            log.debug("no huge pages for %d bytes (%s): plain allocation", nbytes, exc)
        else:
            return t.view(dtype).view(dims)
    return torch.empty(dims, dtype=dtype, pin_memory=pin)


class _Mapping(mmap.mmap):
    """An anonymous mapping that can carry a finaliser (plain mmap objects cannot)."""


def _madvise(mm: mmap.mmap, start: int, length: int) -> None:
    """``madvise(MADV_HUGEPAGE)`` on part of ``mm`` (a separate function for tests)."""
    if _MADV_HUGEPAGE is None:
        raise OSError(f"MADV_HUGEPAGE is not available on {sys.platform}")
    mm.madvise(_MADV_HUGEPAGE, start, length)


def _huge(nbytes: int, pin: bool) -> torch.Tensor:
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mm = _Mapping(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(mm, dtype=torch.uint8)  # keeps mm alive; touches nothing
    base = flat.data_ptr()
    off = -base % HUGE_PAGE
    _madvise(mm, off, size)  # on failure flat and mm are simply dropped (unmapped)
    if pin:
        rc = int(torch.cuda.cudart().cudaHostRegister(base + off, size, 0))
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister failed ({rc})")
        # finalisers run when the tensor's storage lets go of mm, before it is unmapped
        weakref.finalize(mm, _unregister, base + off).atexit = False
    with _ranges_lock:
        _huge_ranges[base + off] = base + off + size
    weakref.finalize(mm, _forget, base + off).atexit = False
    return flat[off : off + nbytes]


def _forget(start: int) -> None:
    with _ranges_lock:
        _huge_ranges.pop(start, None)


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown, CUDA torn down
        pass
