"""Mapped stores: on one host, a consumer copies pages straight out of the producer's store
instead of reading them with one-sided gets.

UCX maps a peer's memory into this process where its memory domain can (sysv/posix:
``ucp_rkey_ptr``), but only for memory UCX allocated itself. So:

- producer (``place``, from ``UcxDataPlane.register_source``): a contiguous, unpinned host
  store slab is copied into memory from ``ucp_mem_map(ALLOCATE)`` and a tensor of the same
  shape and dtype over it is returned. That registration is found for every push from
  the slab (``covering``: rkey packed once, never evicted) and freed only once the plane
  closed AND no tensor over it is left (``native_rma.release_when_unused``), so the
  tensor never dangles.
- consumer (``local``): after the batch's usual checks (the book's slots, rma.py's source
  checks), ``ucp_rkey_ptr`` gives the slab's local address (per key: a failure, e.g. a
  store UCX did not allocate, is remembered and the batch read with gets). UCX only adds
  an offset and checks no bounds: the shared mapping holding the address is found once
  per key in /proc/self/maps, and every batch's whole slab ``[base, base + (nrows - 1) *
  stride + width)`` must lie inside it, else the transfer fails naming the range
  (``MappedRangeError``) and nothing is read. ``copy`` then moves the pages with the C
  row copy (one memcpy per row and column piece, ``page_copy.HOST_THREADS`` threads from
  ``_THREADS_MIN`` bytes, GIL released) on the progress thread; the batch lands and is
  acknowledged right after, exactly like a finished read.
- A fresh mapping costs a page fault per 4 KiB page on first touch (~1.7 us each here:
  a copy through a cold 512 MiB mapping ran at 2.3 GB/s against 13-14 populated), so when
  a key is first mapped a background thread (``_Populator``) maps its pages ahead with
  ``madvise(MADV_POPULATE_READ)``, 32 MiB a call; the copies never wait for it.

Trust: UCX attaches the segment read-write, so a consumer holding the key could write
the producer's store (this code only reads it): the same trust as cma, whose reads reach
any of the producer's memory. ``tuning.ucx_mapped`` False turns the path off on both sides.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from collections import Counter, OrderedDict
from typing import Any

import numpy as np
import torch

from ... import tuning
from .. import page_copy, page_runs
from ..receiver import Group
from . import native_rma
from .link import Link
from .wire import RmaHeader

log = logging.getLogger(__name__)

_THREADS_MIN = 8 << 20  # a mapped copy this big uses HOST_THREADS threads
_POPULATE_CHUNK = 32 << 20  # a mapped segment's pages are mapped ahead this much a call
_MAX_LAYOUTS = 256  # copy_runs tables kept (per group and pieces)


class MappedRangeError(ValueError):
    """An RMA batch whose slab lies (partly) outside the producer's mapped segment."""


class MappedStores:
    """Both sides of mapped stores for one plane (module docstring)."""

    def __init__(self, link: Link, stats: Counter[str]) -> None:
        self.link, self.stats = link, stats
        self.enabled = tuning.current().ucx_mapped is not False
        self.ctx_handle = 0  # the UCX context's (set when the plane opens)
        # producer: UCX-allocated store slabs, each with a weak reference to the byte
        # array the returned tensor lives on
        self._alloc: list[tuple[native_rma.Registration, Any]] = []
        # consumer: the local mapping of each unpacked key (shared mapping [start, end),
        # None where ``rkey_ptr`` failed: read with gets), dropped with the key
        self._maps: dict[tuple[str, bytes], tuple[int, int] | None] = {}
        self._populator = _Populator()
        # consumer: copy_runs tables per (group, pieces) (``_host_runs``; progress thread)
        self._runs: OrderedDict[tuple[Any, ...], tuple[Group, page_runs.HostRuns | None]] = (
            OrderedDict()
        )

    # --------------------------------------------------------------- producer
    def place(self, tensor: torch.Tensor, why: str | None) -> torch.Tensor:
        """``register_source``: ``tensor`` copied into UCX-allocated memory (a tensor over
        it returned), or ``tensor`` itself, with the reason logged at info, when the path
        is off, ``why`` says the plane cannot (not shm, no RMA), or the tensor does not
        qualify (CUDA, pinned, not contiguous, a failed allocation)."""
        if not self.enabled:
            why = "turned off by DISAGG_UCX_MAPPED=0 (tuning.ucx_mapped)"
        elif why is not None:
            pass
        elif tensor.device.type != "cpu":
            why = f"a {tensor.device.type} tensor"
        elif tensor.dim() == 0 or tensor.numel() == 0 or not tensor.is_contiguous():
            why = "not a contiguous, non-empty tensor"
        elif tensor.is_pinned():
            why = "a pinned tensor (the copy would lose the pinning)"
        if why is None:
            try:
                return self._copy_in(tensor)
            except Exception as exc:
                why = f"allocation failed: {type(exc).__name__}: {exc}"
        log.info("UCX register_source: store kept where it is: %s", why)
        return tensor

    def _copy_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """The allocation (on the progress thread) and the copy."""
        nbytes = tensor.numel() * tensor.element_size()
        done = threading.Event()
        got: dict[str, Any] = {}

        def job() -> None:
            try:
                reg, buf = native_rma.allocate(self.ctx_handle, nbytes)
                # kept from here on: freed at close once the array is gone
                self._alloc.append((reg, weakref.ref(buf)))
                self.stats["rma_mem_alloc"] += 1
                got["buf"] = buf
            except BaseException as exc:
                got["error"] = exc
            finally:
                done.set()

        if self.link.stop.is_set():
            raise RuntimeError("data plane closed")
        self.link.submit(job)
        thread = self.link.thread
        while not done.wait(0.05):
            if thread is None or not thread.is_alive():
                raise RuntimeError("data plane closed")
        if "error" in got:
            raise got["error"]
        flat = torch.from_numpy(np.ctypeslib.as_array(got.pop("buf")))
        out = flat.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    def covering(self, base: int, length: int) -> native_rma.Registration | None:
        """The registration of the mapped store that holds ``[base, base + length)``."""
        for reg, _ in self._alloc:
            if reg.address <= base and base + length <= reg.address + reg.length:
                return reg
        return None

    def release(self, ctx: Any) -> None:
        """At close (progress thread): free each mapped store now where no tensor over it
        is left, else once the last one is collected (``ctx``, the UCX context, is kept
        alive for that unmap)."""
        kept = 0
        for reg, ref in self._alloc:
            if native_rma.release_when_unused(reg, ref, ctx):
                self.stats["rma_mem_free"] += 1
            else:
                kept += 1
        if kept:
            log.info("UCX plane closed: %d mapped store(s) freed once their tensors go", kept)
        self._alloc.clear()

    # --------------------------------------------------------------- consumer
    def local(self, hdr: RmaHeader, rkey: int) -> int | None:
        """The local address of the producer's slab (``hdr.base``) where its memory is
        mapped here through ``rkey``, else None (read with gets). ``MappedRangeError``
        when the batch's slab is not inside the mapping."""
        key = (hdr.endpoint, hdr.rkey)
        span = self._maps.get(key)
        if span is None and key in self._maps:
            return None
        st, ptr = native_rma.rkey_ptr(rkey, hdr.base)
        if st != 0 or not ptr:
            self._maps[key] = None
            self.stats["rma_unmapped_keys"] += 1
            log.info("UCX: %s's store is not mapped here (ucs_status %d): gets", hdr.endpoint, st)
            return None
        end = ptr + (hdr.nrows - 1) * hdr.stride + hdr.width
        found = span if span is not None else native_rma.shared_mapping(ptr)
        if found is None or not (found[0] <= ptr and end <= found[1]):
            where = "no shared mapping" if found is None else f"[{found[0]:#x}, {found[1]:#x})"
            raise MappedRangeError(
                f"RMA batch describes {hdr.nrows} rows of {hdr.width} bytes {hdr.stride} "
                f"apart at {hdr.base:#x} (here [{ptr:#x}, {end:#x})), outside the "
                f"producer's mapped segment ({where})"
            )
        if span is None:
            self._maps[key] = found
            self._populator.start(key, *found)  # only from a batch that fit it
        return ptr

    def forget(self, key: tuple[str, bytes]) -> None:
        """The key ``(endpoint, packed rkey)`` is about to be destroyed: its mapping goes
        (no populate call on it is under way once this returns)."""
        if self._maps.pop(key, None) is not None:
            self._populator.cancel(key)

    def copy(
        self, grp: Group, hdr: RmaHeader, ptr: int, pieces: list[tuple[int, int, int, int]]
    ) -> None:
        """Copy a batch's pages from the producer's slab mapped at ``ptr`` into its slots
        of ``grp``: per piece (a column span of the row into one region,
        ``native_rma.page_pieces``) one C row copy (which checks every index against its
        side's rows again; a batch of several pieces, a TP slice's runs, is one ``copy_runs``
        call over the pages, its table built once per layout: ``_host_runs``), else
        ``page_copy.copy_indexed`` on views."""
        rows, slots = hdr.rows, hdr.slots
        nbytes = int(slots.size) * hdr.page_bytes
        rc = page_copy._rowcopy
        threads = 1
        if nbytes >= _THREADS_MIN:
            threads = min(page_copy.HOST_THREADS, len(os.sched_getaffinity(0)))
        one_pass = self._host_runs(grp, pieces) if len(pieces) > 1 else None
        if one_pass is not None:  # a TP slice's runs: one pass over the pages
            if one_pass.table.size:
                assert rc is not None  # prepare_host found it
                rc.copy_runs(
                    ptr, hdr.nrows, hdr.stride, one_pass.table, one_pass.rows, rows, slots, threads
                )
            return
        for soff, reg, doff, plen in pieces:
            dst = grp.regions[reg].tensor
            if rc is not None:
                rc.copy_rows(
                    dst.data_ptr() + doff, dst.shape[0], dst.stride(0),
                    ptr + soff, hdr.nrows, hdr.stride, plen, rows, slots, threads,
                )  # fmt: skip
                continue
            span = (hdr.nrows - 1) * hdr.stride + plen
            flat = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(ptr + soff))
            src = np.lib.stride_tricks.as_strided(flat, (hdr.nrows, plen), (hdr.stride, 1))
            page_copy.copy_indexed(
                dst[:, doff : doff + plen],
                torch.from_numpy(slots.copy()),
                torch.from_numpy(src),
                torch.from_numpy(rows.copy()),
            )

    def _host_runs(
        self, grp: Group, pieces: list[tuple[int, int, int, int]]
    ) -> page_runs.HostRuns | None:
        """The ``copy_runs`` table of a group's pieces (runs that continue one another on
        both sides joined: ``page_runs.coalesce``), kept per (group, pieces): a slice
        layout's table is ``2 * layers`` rows, the same for every batch of the layout.
        None without the C extension."""
        key = (id(grp), tuple(pieces))
        hit = self._runs.get(key)
        if hit is not None and hit[0] is grp:
            self._runs.move_to_end(key)
            return hit[1]
        runs = [
            page_runs.Run(soff, grp.regions[reg].tensor, doff, plen)
            for soff, reg, doff, plen in pieces
        ]
        one_pass = page_runs.prepare_host(runs)
        self._runs[key] = (grp, one_pass)  # holds the group: its id is not reused meanwhile
        while len(self._runs) > _MAX_LAYOUTS:
            self._runs.popitem(last=False)
        return one_pass


class _Populator:
    """Maps the pages of producers' mapped segments into this process ahead of the
    copies, on a background thread, ``_POPULATE_CHUNK`` bytes per ``madvise`` call
    (``native_rma.populate``: ~0.7 us a page against ~1.7 us for a first-touch fault).
    Copies do not wait for it: a page they reach first simply faults. ``cancel``
    (before the key that holds the mapping is destroyed) returns only once no call on
    that range is under way."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held during each madvise call
        self._jobs: dict[Any, list[int]] = {}  # key -> [next address, end]
        self._thread: threading.Thread | None = None
        self.populated = 0  # bytes

    def start(self, key: Any, start: int, end: int) -> None:
        with self._lock:
            self._jobs[key] = [start, end]
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="disagg-ucx-populate", daemon=True
                )
                self._thread.start()

    def cancel(self, key: Any) -> None:
        with self._lock:
            self._jobs.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                key, job = next(iter(self._jobs.items()))
                at, end = job
                stop = min(end, at + _POPULATE_CHUNK)
                err = native_rma.populate(at, stop)
                if err or stop >= end:
                    del self._jobs[key]
                    if err:
                        log.debug("populating a mapped store: errno %d (left to faults)", err)
                else:
                    job[0] = stop
                self.populated += stop - at
            time.sleep(0)  # let the copies' thread take the GIL between chunks
