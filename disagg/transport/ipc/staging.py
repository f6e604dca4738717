"""The ipc receiver's copies: one checked batch from the sender's export into the slots.

A batch (``Plan``) is cut where a source column span meets a destination region
(``pieces``). A batch of one piece is one ``page_copy`` call over every page of the
batch; one of several pieces (a TP slice's runs) is one ``page_runs`` pass over the
pages: one C call on the host (done on return), one Triton kernel on a GPU (queued on
the receiver thread's stream; the caller records a completion event and lands the
transfer once it fired). Either is worked out once per layout (export, group, spans)
and kept in the plane's ``Prepared`` cache, so a push of a known layout does nothing
per run in Python.

Device batches: the batch check (``ReceiverBook.accept_rows``) writes both index arrays
into a pinned staging buffer as it checks them (``Staging.take``); they go up in one
host-to-device copy (``Staging.upload``) and each piece is launched straight from the
views the first push of that layout worked out (``prepare_copies``; ``page_copy.launch_raw``
once Triton compiled the kernel). Reuse rules are ``Staging``'s. Measurements behind
this path: docs/design/ipc-plane.md.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ...protocol import ipc as wire
from .. import cuda_driver
from ..page_copy import DeviceCopy, copy_indexed, launch_device, launch_raw, prepare_device
from ..page_runs import (
    HostRuns,
    Run,
    RunsCopy,
    copy_host,
    launch_runs,
    launch_runs_raw,
    prepare_host,
    prepare_runs,
)
from ..receiver import Group

# A plane's cache of prepared copies: (export tensor, group, layout) -> the prepared
# device copy of each piece (``DeviceCopy`` / ``RunsCopy``), or, keyed with "host" first,
# a host batch's one-pass table (``HostRuns``; empty: piece by piece). The receiver
# thread's alone. Entries hold the tensor and the
# group themselves, so their ids (in the key) cannot be reused while cached.
Prepared = OrderedDict[tuple[Any, ...], tuple[Any, Any, list[Any]]]
MAX_PREPARED = 256
_TORCH_INT = {4: torch.int32, 8: torch.int64}


class Plan(NamedTuple):
    """One checked batch, ready to copy."""

    grp: Group
    batch: wire.IpcBatch
    slots: np.ndarray  # views of the message's arrays (int32 or int64)
    rows: np.ndarray
    n_rows: int  # one past the highest source row (checked inside the export)
    src: torch.Tensor  # the export, uint8 1-D
    cache: Prepared  # the plane's prepared device copies
    staged: Staged | None  # where the check copied both arrays (device slots only)
    device: torch.device | None  # the one CUDA device of every region of the group


class Staged(NamedTuple):
    """A batch's index arrays in a pinned staging buffer: slots from byte 0, rows from
    ``rows_at`` (16-byte aligned, as ``page_copy.launch_raw`` needs)."""

    staging: Staging
    ring_at: int  # which buffer of the ring
    nbytes: int  # bytes used: both arrays
    rows_at: int
    pages: int  # indices in each array
    dtype: torch.dtype


class Staging:
    """The receiver thread's index staging for one device: a ring of pinned host buffers
    and one device buffer, kept from push to push (a fresh pinned tensor, its numpy view
    and a fresh device tensor per push cost ~160 us of a just-woken CPU on the H200's VM;
    reused buffers ~40). The batch check writes both index arrays of a batch into a ring
    buffer as it checks them (``take``); they go up in one host-to-device copy
    (``upload``, a direct driver call where ``cuda_driver`` has one), each starting
    16-byte aligned.

    Reuse rules: a pinned buffer is rewritten only after the completion event of the
    push that last uploaded from it fired (``seal``; waited for, rarely, when more pushes
    than buffers are in flight); a buffer taken by the push being planned is never
    handed out twice (the ring grows instead: a push has at most a few batches). The
    device buffer is rewritten by copies queued on the same stream as the kernels that
    read it, so in stream order after them."""

    RING = 8
    MIN_BYTES = 256 << 10  # each ring buffer: both index arrays of 32768 pages

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.current_stream(device)  # the receiver thread's
        self.handle = int(self.stream.cuda_stream)
        self.host: list[torch.Tensor | None] = [None] * self.RING
        self.views: list[np.ndarray] = [np.empty(0, np.uint8)] * self.RING  # numpy of host
        self.busy: list[Any] = [None] * self.RING  # the event that frees each buffer
        self.unsealed: list[int] = []  # buffers taken since the last seal()
        self.next = 0
        self.dev: torch.Tensor | None = None

    def take(self, n: int, width: int) -> Staged:
        """A free pinned buffer for ``n`` indices of ``width`` bytes in each array."""
        off = -(-n // (16 // width)) * (16 // width)  # rows start 16-byte aligned
        nbytes = (off + n) * width
        i = self.next
        self.next = (i + 1) % len(self.host)
        if i in self.unsealed:  # this push took every buffer already: one more
            i = len(self.host)
            self.host.append(None)
            self.views.append(np.empty(0, np.uint8))
            self.busy.append(None)
        ev = self.busy[i]
        if ev is not None and not ev.query():
            ev.synchronize()  # more pushes in flight than buffers: wait for the oldest
        self.busy[i] = None
        buf = self.host[i]
        if buf is None or buf.numel() < nbytes:
            self._grow(i, nbytes)
        self.unsealed.append(i)
        return Staged(self, i, nbytes, off * width, n, _TORCH_INT[width])

    def _grow(self, i: int, nbytes: int) -> None:
        """A pinned buffer of at least ``nbytes`` at ``i``, and the same size at every
        other ring slot that is free now: pinning memory costs ~0.1 ms of the H200's VM
        per buffer, which the first pushes through a ring would each pay otherwise
        (a bench of five pushes after one warm-up saw nothing but cold buffers)."""
        cap = max(self.MIN_BYTES, 1 << (nbytes - 1).bit_length())
        for j, buf in enumerate(self.host):
            ev = self.busy[j]
            free = j not in self.unsealed and (ev is None or ev.query())
            if (j == i or free) and (buf is None or buf.numel() < cap):
                fresh = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
                self.host[j], self.views[j] = fresh, fresh.numpy()
                self.busy[j] = None

    def upload(self, staged: Staged) -> torch.Tensor:
        """Queue the staged arrays' copy to the device buffer (on ``stream``); returns
        the device buffer (uint8; slots from byte 0, rows from ``staged.rows_at``)."""
        nbytes = staged.nbytes
        dev = self.dev
        if dev is None or dev.numel() < nbytes:
            dev = self.dev = torch.empty(
                max(nbytes, 1 << 16), dtype=torch.uint8, device=self.device
            )
        host = self.host[staged.ring_at]
        assert host is not None
        if not cuda_driver.copy_htod_async(dev.data_ptr(), host.data_ptr(), nbytes, self.handle):
            dev[:nbytes].copy_(host[:nbytes], non_blocking=True)
        return dev

    def seal(self, event: Any) -> None:
        """The buffers taken since the last call are free once ``event`` fired."""
        for i in self.unsealed:
            self.busy[i] = event
        self.unsealed.clear()

    def drop_unsealed(self, keep: int = 0) -> None:
        """A refused push: the buffers it took (those after the first ``keep``, which
        earlier parts of pushes in parts uploaded from) were never uploaded from, so
        they are free."""
        del self.unsealed[keep:]


_current = threading.local()  # per thread: the CUDA device made current by use_device


def use_device(dev: torch.device) -> None:
    """Make ``dev`` the calling thread's current CUDA device (a call only when it
    changes): Triton launches on the current device, and the driver's copies need its
    context; a thread starts on cuda:0 whatever GPU the slots are on."""
    if getattr(_current, "device", None) != dev:
        torch.cuda.set_device(dev)
        _current.device = dev


def device_of(grp: Group | None) -> torch.device | None:
    """The CUDA device every region of ``grp`` lives on, or None (host, mixed, no group)."""
    return None if grp is None else grp.device


def copy_batch(plan: Plan) -> set[torch.device]:
    """Copy one batch: each piece where a source span meets a destination region is one
    ``copy_indexed`` over all pages of the batch. Host copies are done on return; device
    copies are queued on the current streams of the devices returned."""
    grp, b, slots, rows, n_rows, src, _, staged, dev = plan
    if dev is not None:
        use_device(dev)
    if staged is not None and dev is not None:
        # Both index arrays in one host-to-device copy, from pinned memory: a copy from
        # pageable memory would block this thread until the GPU finished the copies
        # queued before it, so the next push could not be checked meanwhile.
        both = staged.staging.upload(staged)
        n, dtype, off_bytes = staged.pages, staged.dtype, staged.rows_at
        prepared = prepare_copies(plan.cache, grp, b, src)
        if prepared is not None:  # the usual case: views worked out by an earlier push
            base, handle = both.data_ptr(), staged.staging.handle
            for c in prepared:  # straight launches once Triton compiled the kernel
                off = off_bytes // dtype.itemsize
                if isinstance(c, RunsCopy):
                    if not launch_runs_raw(c, n, base, base + off_bytes, dtype, handle):
                        launch_runs(c, both.view(dtype)[:n], both.view(dtype)[off : off + n])
                elif not launch_raw(c, n, base, base + off_bytes, dtype, handle):
                    launch_device(c, both.view(dtype)[:n], both.view(dtype)[off : off + n])
            return {dev}
        off = off_bytes // dtype.itemsize
        dst_idx, src_idx = both.view(dtype)[:n], both.view(dtype)[off : off + n]
    else:  # host index kernels take int64 (and a copy: the message's view is read-only)
        dst_idx = torch.from_numpy(slots.astype(np.int64))
        src_idx = torch.from_numpy(rows.astype(np.int64))
    if not src.is_cuda and not grp.cuda_devices:
        one_pass = prepare_host_runs(plan.cache, grp, b, src)
        if one_pass is not None:  # a slice's runs: one pass over the pages, not one per run
            copy_host(one_pass, src, n_rows, b.row_stride, dst_idx.numpy(), src_idx.numpy())
            return set()
    cut = pieces(b.spans, [r.size for r in grp.regions])
    devices = set()
    for src_col, region, dst_col, length in cut:
        view = src.as_strided(
            (n_rows, length), (b.row_stride, 1), src.storage_offset() + b.base + src_col
        )
        t = grp.regions[region].tensor
        copy_indexed(t[:, dst_col : dst_col + length], dst_idx, view, src_idx)
        if t.device.type == "cuda":
            devices.add(t.device)
    return devices


def prepare_host_runs(
    cache: Prepared, grp: Group, b: wire.IpcBatch, src: torch.Tensor
) -> HostRuns | None:
    """A host batch's one-pass copy where it has several pieces (a TP slice's runs): the
    C call's table, built once per layout (a slice pool has 2 * layers regions: building
    the pieces and the table again on every push is that much Python per push). None:
    one piece, or no C extension (``copy_indexed`` piece by piece)."""
    key = ("host", id(src), id(grp), b.base, b.row_stride, tuple(b.spans))
    hit = cache.get(key)
    if hit is not None and hit[0] is src and hit[1] is grp:
        cache.move_to_end(key)
        return hit[2][0] if hit[2] else None
    cut = pieces(b.spans, [r.size for r in grp.regions])
    one_pass = None
    if len(cut) > 1:
        one_pass = prepare_host(
            [Run(b.base + c, grp.regions[r].tensor, d, k) for c, r, d, k in cut]
        )
    cache[key] = (src, grp, [] if one_pass is None else [one_pass])
    while len(cache) > MAX_PREPARED:
        cache.popitem(last=False)
    return one_pass


def prepare_copies(
    cache: Prepared, grp: Group, b: wire.IpcBatch, src: torch.Tensor
) -> list[DeviceCopy | RunsCopy] | None:
    """The batch's device copies over views of every row the export holds (not just
    this push's: the views then serve every push of that layout; each push's rows were
    checked to lie inside the export, and ``as_strided`` checks the views against the
    storage). A batch of several pieces (a TP slice's runs) is one ``page_runs`` copy
    where it applies. None where the Triton kernel cannot do it (then ``copy_indexed``)."""
    key = (id(src), id(grp), b.base, b.row_stride, tuple(b.spans))
    hit = cache.get(key)
    if hit is not None and hit[0] is src and hit[1] is grp:
        cache.move_to_end(key)
        return hit[2]
    out: list[DeviceCopy | RunsCopy] = []
    cut = pieces(b.spans, [r.size for r in grp.regions])
    runs = None
    if len(cut) > 1:
        runs = prepare_runs(
            src, b.row_stride, [Run(b.base + c, grp.regions[r].tensor, d, k) for c, r, d, k in cut]
        )
    if runs is not None:
        out.append(runs)
        cut = []
    for src_col, region, dst_col, length in cut:
        first = b.base + src_col  # byte of row 0's piece; rows lie every row_stride bytes
        n_view = (src.numel() - first - length) // b.row_stride + 1
        view = src.as_strided((n_view, length), (b.row_stride, 1), src.storage_offset() + first)
        t = grp.regions[region].tensor
        c = prepare_device(t[:, dst_col : dst_col + length], view)
        if c is None:
            return None
        out.append(c)
    cache[key] = (src, grp, out)
    while len(cache) > MAX_PREPARED:
        cache.popitem(last=False)
    return out


def pieces(
    spans: Sequence[tuple[int, int]], sizes: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """Where source spans (column, length), laid end to end, meet destination regions of
    ``sizes`` laid end to end: (source column, region, region column, length) pieces."""
    out = []
    si, ri = 0, 0
    s_used = r_used = 0
    while si < len(spans) and ri < len(sizes):
        col, slen = spans[si]
        n = min(slen - s_used, sizes[ri] - r_used)
        if n > 0:
            out.append((col + s_used, ri, r_used, n))
        s_used += n
        r_used += n
        if s_used == slen:
            si, s_used = si + 1, 0
        if r_used == sizes[ri]:
            ri, r_used = ri + 1, 0
    return out


def indices(blob: bytes, width: int) -> np.ndarray:
    """The batch's ``width``-byte little-endian index array (a read-only view of the
    message, length already checked; copied for a host copy)."""
    return np.frombuffer(blob, dtype=f"<i{width}")
