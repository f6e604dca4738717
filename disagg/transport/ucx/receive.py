"""How pages are received over UCX tag messages: headers, payload segments, scratch,
iov receives straight into the slots, and device scatters. (Pages a consumer reads
itself from a producer's store are rma.py's; the wire is wire.py's.)

Contract, all on the plane's progress thread (``Receiver``):

- ``rx_headers`` takes arrived headers with one masked probe over tags 0-7 (so a
  transfer's headers and its TransferDone stay in order) and hands RMA headers to the
  plane's reader. A PageBatch is authenticated (transfer, lease, token) and its runs
  checked by the ``ReceiverBook`` (bounds, promised slots, each once, pages still due)
  *before* it is cut into segments (``wire.segments``, with the cut its header tag
  names): every announced segment waits in ``pending`` under its keyed data tag.
- ``rx_segments`` takes arrived data messages with one masked probe each (never a probe
  per pending segment) and posts a receive only for a message that has arrived under an
  announced tag with exactly the announced length (ucxx cannot cancel a posted receive,
  so none is posted ahead). Anything else (a refused batch's payload, a stranger's
  message) is received into a throw-away buffer.
- Where a segment lands: a direct run of one contiguous region in place; over tcp with
  iov receives on, a packed segment for host slots as ONE iov receive into the slots
  (``iov.tag_recv_exact``, entries from ``iov.page_iov`` of the checked slots); else
  into one of ``_SCRATCH_BUFS`` huge-page scratch buffers, then ``hostcopy.scatter_host``
  (host) or one batched ``index_copy_`` per region on the plane's CUDA stream (device:
  pages count as landed once its event passed). A freed host scratch goes to the next
  arrived segment before the next scatter, so the peer's copy into it overlaps ours.
- Every posted receive counts in ``rx.inflight`` until UCX completes it: ``abort`` waits
  for it, and a transfer ends DONE only after every segment it announced completed and
  the page counts agree with its TransferDone.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ucxx._lib.arr import Array

from ... import hostmem
from ...pages import scatter_rows
from ...protocol import messages as m
from ...protocol.errors import ProtocolError
from ..dataplane import RegionSpec
from ..receiver import Group, ReceiverBook, Rx, runs_slots
from . import iov, wire
from .hostcopy import scatter_host
from .link import Link, ucx_api
from .wire import Segment, segments

log = logging.getLogger(__name__)

_SCRATCH_BUFS = 4  # scratch segments in flight at once (each SEG_BYTES)
_BIG_BUFS = 2  # whole-batch device scratch buffers per device (receive k+1, scatter k)
_BIG_ALIGN = 2 << 20


@dataclass
class UcxRx(Rx):
    seq: int = 0  # next segment sequence number
    queued: int = 0  # segments announced, receive not yet posted


@dataclass
class PendingSeg:
    """A segment announced by an accepted header, waiting for its message to arrive;
    ``whole``: the batch's entire payload in one message (any size, CUDA senders)."""

    rx: UcxRx
    group: int
    tag: int
    seg: Segment
    nbytes: int
    whole: bool = False
    slots: np.ndarray | None = None  # destination slot of each page (whole batches)
    # its pages' (address, length) entries in the slots, when it is to be received as
    # an iov straight into them (``rx_iov``), and the group whose memory they name
    iov: np.ndarray | None = None
    owner: Any = None


@dataclass
class _Scatter:
    """A device scatter launched from scratch on the plane's stream, not yet finished:
    its pages count as landed (and the scratch is reused) once ``event`` has passed."""

    event: Any
    p: PendingSeg
    scratch: torch.Tensor
    pool: list[torch.Tensor]


class Receiver:
    """The tag-path receiver (module docstring). ``iov_recvs``: post packed segments for
    host slots as iov receives; ``on_rma``: takes the body of an RMA header."""

    def __init__(
        self,
        link: Link,
        book: ReceiverBook,
        stats: Counter[str],
        channel: str,
        iov_recvs: bool,
        on_rma: Callable[[bytes], None],
    ) -> None:
        self.link, self.book, self.stats = link, book, stats
        self.direct_min = wire.SHM_DIRECT_MIN if channel == "shm" else wire.DIRECT_MIN
        self.iov_recvs = iov_recvs
        self.on_rma = on_rma
        # per registered group (set with book.groups, under book.lock): its CUDA device
        # (None: host) and, for one contiguous CUDA region, that region (runs land in it)
        self.gdev: list[torch.device | None] = []
        self.gdirect: list[torch.Tensor | None] = []
        self.scratch_free: list[np.ndarray] = []
        self._dscratch: dict[torch.device, list[torch.Tensor]] = {}  # free device scratch
        self._big_free: dict[torch.device, list[torch.Tensor]] = {}  # whole-batch scratch
        self._big_count: Counter[torch.device] = Counter()  # allocated, free or in use
        self.scatters: deque[_Scatter] = deque()  # launched device scatters, in order
        self._streams: dict[torch.device, Any] = {}  # device scatter streams
        self.pending: dict[int, PendingSeg] = {}  # by data tag
        self._held: deque[tuple[Any, PendingSeg]] = deque()  # arrived, awaiting scratch
        # (request, segment, scratch: np / torch / None, the free list it goes back to)
        self.reqs: list[tuple[Any, PendingSeg, Any, Any]] = []

    def open(self) -> None:
        """Allocate the host scratch (progress thread, at start): 2 MiB-aligned huge
        pages, into which cma writes at memcpy speed and whose rows agree modulo 64 with
        torch's pools, prefaulted once rather than per transfer."""
        self.scratch_free = [hostmem.empty(wire.SEG_BYTES).numpy() for _ in range(_SCRATCH_BUFS)]
        for b in self.scratch_free:
            b.fill(0)

    def layout(
        self, specs: Sequence[Sequence[RegionSpec]], cuda: bool
    ) -> tuple[list[torch.device | None], list[torch.Tensor | None]]:
        """Each group's device (None: host) and, for one contiguous CUDA region, that
        region; checks the groups and makes device scratch for new devices. The caller
        sets ``gdev``/``gdirect`` with the book's groups, under ``book.lock``."""
        gdev: list[torch.device | None] = []
        gdirect: list[torch.Tensor | None] = []
        for g, regs in enumerate(specs):
            devs = {r.tensor.device for r in regs}
            if len(devs) > 1:
                raise ValueError(f"layer group {g} has regions on several devices: {devs}")
            dev = next(iter(devs), None)
            if dev is None or dev.type == "cpu":
                gdev.append(None)
                gdirect.append(None)
                continue
            if dev.type != "cuda":
                raise ValueError(f"layer group {g}: regions on {dev} (host or CUDA only)")
            if not cuda:
                raise ValueError("CUDA regions need a plane made with cuda=True")
            gdev.append(dev)
            one = len(regs) == 1 and regs[0].contiguous
            gdirect.append(regs[0].tensor if one else None)
            if dev not in self._dscratch:
                self._dscratch[dev] = [
                    torch.empty(wire.SEG_BYTES, dtype=torch.uint8, device=dev)
                    for _ in range(_SCRATCH_BUFS)
                ]
                self._streams[dev] = torch.cuda.Stream(dev)
        return gdev, gdirect

    @property
    def busy(self) -> bool:
        """Receives posted, or segments announced or arrived and not yet posted."""
        return bool(self.reqs or self.pending or self._held)

    # ---------------------------------------------------------------- headers
    def rx_headers(self) -> None:
        worker = self.link.worker
        any_hdr = ucx_api.UCXXTag(0)
        mask = ucx_api.UCXXTagMask(wire.U64 ^ wire.HDR_MASK_TAGS)
        while True:
            probe = worker.tag_probe(any_hdr, mask, remove=True)
            if not probe.matched:
                return
            hdr_tag = int(probe.sender_tag.value)
            n = int(probe.length)
            buf = np.empty(max(n, 1), dtype=np.uint8)
            req = self.link.receive_small(probe, buf, "header")
            if req is None:  # its transfer, if any, ends at its deadline
                continue
            try:
                req.check_error()
            except Exception as exc:
                self.stats["rejected_header"] += 1
                log.debug("header receive failed: %s", exc)
                continue
            if n < 4 or n > wire.HDR_MAX or struct.unpack_from("<I", buf.data)[0] != n - 4:
                self.stats["rejected_BAD_FRAME"] += 1
                continue
            if hdr_tag == wire.HDR_RMA_TAG:
                self.on_rma(buf[4:n].tobytes())
                continue
            try:
                msg = m.decode(buf[4:n].tobytes())
            except ProtocolError as e:
                self.stats["rejected_" + e.code.name] += 1
                continue
            direct_min, seg_bytes = wire.recv_cut(hdr_tag, self.direct_min)
            self.rx_header(msg, hdr_tag == wire.HDR_WHOLE_TAG, direct_min, seg_bytes)

    def rx_header(
        self,
        msg: m.Message,
        whole: bool = False,
        direct_min: int | None = None,
        seg_bytes: int | None = None,
    ) -> None:
        """One decoded header: a TransferDone, or a PageBatch whose segments are then
        announced (``pending``); a whole batch's receive starts at once."""
        book = self.book
        with book.lock:
            rx = book.authenticate(msg)
            if rx is None:
                return  # its payload, if any, arrives under unknown tags: discarded
            assert isinstance(rx, UcxRx)
            if isinstance(msg, m.TransferDone):
                book.on_done(rx, msg, rx.queued)
                book.cond.notify_all()
                return
            assert isinstance(msg, m.PageBatch)
            # Checked before it is cut into segments: the runs are bounded by the group
            # and by the pages still due, so a forged count cannot make it expand forever.
            why, slots, _ = book.accept_runs(rx, msg)
            if why is not None:
                # refused (the transfer is over): its segments arrive under unknown
                # tags and are discarded
                book.cond.notify_all()
                return
            assert slots is not None
            if whole:  # the whole batch in one message (the sender's rows are on a GPU)
                pages = int(slots.size)
                segs = [Segment(tuple(msg.runs[:1]), 0, pages, len(msg.runs) == 1)]
                if pages > 1 and pages * msg.page_bytes > wire.BATCH_BYTES:
                    rx.seq += 1
                    book.fail(rx, f"batch of {pages * msg.page_bytes} bytes in one message")
                    book.cond.notify_all()
                    return
            else:
                dmin = self.direct_min if direct_min is None else direct_min
                segs = segments(msg.runs, msg.page_bytes, dmin, seg_bytes)
            seq0 = rx.seq
            rx.seq += len(segs)
            rx.queued += len(segs)
            key = wire.tag_key(rx.token)
            grp = book.groups[msg.group]
            entries = self._batch_iov(grp, msg, slots) if self.iov_recvs and not whole else None
            if not whole or len(msg.runs) == 1:
                slots = None  # the pending segment keeps slots only for a scattered whole batch
            for i, seg in enumerate(segs):
                tag = wire.data_tag(key, rx.transfer_id, seq0 + i)
                p = PendingSeg(rx, msg.group, tag, seg, seg.pages * msg.page_bytes, whole, slots)
                if entries is not None and not (seg.direct and grp.direct is not None):
                    # (one run into one region lands in place through ucxx: contiguous)
                    p.iov = entries[seg.first : seg.first + seg.pages].reshape(-1, 2)
                    p.owner = grp
                self.pending[tag] = p
        if whole:  # start its receive now, not after every queued header is decoded
            self._rx_one(tag)

    def _batch_iov(self, grp: Group, msg: m.PageBatch, slots: np.ndarray) -> np.ndarray | None:
        """The iov entries (``iov.page_iov``: [pages, regions, 2]) of an accepted batch's
        slots, in page order, when its group is host memory (else None: device slots keep
        the scratch path). One vectorised call per batch (per segment in Python ate the
        whole gain); each packed segment takes a view of its pages. ``slots`` were just
        checked against the group by the book: addresses come from checked slots only."""
        if any(r.tensor.device.type != "cpu" for r in grp.regions):
            return None
        if grp.page_bytes != msg.page_bytes:
            return None
        regions = [(r.tensor.data_ptr(), r.tensor.stride(0), r.size) for r in grp.regions]
        return iov.page_iov(regions, slots)

    # --------------------------------------------------------------- segments
    def rx_segments(self) -> None:
        """Post receives for announced segments whose messages have arrived: one masked
        probe per arrived message, after the headers (so a segment's header is always
        known when the segment is)."""
        while self._held and self.post(*self._held[0]):
            self._held.popleft()
        worker = self.link.worker
        any_data = ucx_api.UCXXTag(wire.DATA_BIT)
        mask = ucx_api.UCXXTagMask(wire.DATA_BIT)
        while True:
            if self.iov_recvs:
                # look first (libucp, the message stays in UCX): a packed segment for
                # host slots is taken and received by rx_iov; anything else by ucxx
                # below, through an exact-tag probe that takes this very message (the
                # first under its tag, as it is the first data message that arrived)
                seen = iov.probe_length(worker.handle, wire.DATA_BIT, wire.DATA_BIT)
                if seen is None:
                    return
                if self.rx_iov(*seen):
                    continue
                probe = worker.tag_probe(ucx_api.UCXXTag(seen[0]), remove=True)
            else:
                probe = worker.tag_probe(any_data, mask, remove=True)
            if not probe.matched:
                return
            pend = self.pending.pop(int(probe.sender_tag.value), None)
            if pend is None:  # a refused batch's payload, a stale or a foreign message
                self.link.discard(probe)
                continue
            if self._held or not self.post(probe, pend):
                self._held.append((probe, pend))  # the message waits in UCX for a buffer

    def rx_iov(self, tag: int, length: int) -> bool:
        """Receive an arrived data message (seen, not yet taken) straight into its slots
        when it is a segment with iov entries of a live transfer, with exactly the
        announced length: one iov receive, UCX unpacking each fragment into the rows.
        False (nothing taken) for anything else, which the ucxx path then handles.

        Once posted, UCX cannot take it back (``ucp_request_cancel`` only reaches
        receives still waiting for a match), so it counts in ``rx.inflight`` like any
        write into the regions: ``abort`` waits for it, or severs (plane.py)."""
        p = self.pending.get(tag)
        if p is None or p.iov is None or length != p.nbytes:
            return False
        book = self.book
        with book.cond:
            rx = p.rx
            if rx.state.final:
                return False  # discarded by the ucxx path
            buf = iov.IovBuf(p.iov, p.nbytes, p.owner)
            try:
                req = iov.tag_recv_exact(self.link.worker.handle, tag, buf)
            except Exception as exc:  # the message was taken: the transfer cannot end
                self.pending.pop(tag)
                rx.queued -= 1
                book.fail(rx, f"receive failed: {exc}")
                book.cond.notify_all()
                return True
            if req is None:  # not there after all (cannot happen on this thread)
                return False
            self.pending.pop(tag)
            rx.queued -= 1
            rx.inflight += 1
            self.stats["iov_recvs"] += 1
        self.reqs.append((req, p, None, None))
        return True

    def _rx_one(self, tag: int) -> None:
        """Post the receive of one announced segment if its message has arrived (an
        exact-tag probe: nothing else is taken), so its transfer overlaps the decoding
        of the headers behind it."""
        if self._held:
            return
        probe = self.link.worker.tag_probe(ucx_api.UCXXTag(tag), remove=True)
        if not probe.matched:
            return
        pend = self.pending.pop(tag)
        if not self.post(probe, pend):
            self._held.append((probe, pend))

    def post(self, probe: Any, p: PendingSeg) -> bool:
        """Post the receive of an arrived segment (or discard it); False when it needs a
        scratch buffer and none is free."""
        book = self.book
        with book.cond:
            rx = p.rx
            live = not rx.state.final
            if live and int(probe.length) != p.nbytes:
                book.fail(
                    rx, f"segment of {probe.length} bytes where the batch announced {p.nbytes}"
                )
                live = False
            dst: Any = None
            pool: list[Any] | None = None
            if live:
                grp, dev = book.groups[p.group], self.gdev[p.group]
                start, count = p.seg.runs[0]
                if p.seg.direct and grp.direct is not None:  # host rows, in place
                    dst = grp.direct[start : start + count].reshape(-1)
                elif p.seg.direct and (ddst := self.gdirect[p.group]) is not None:
                    dst = ddst[start : start + count].reshape(-1)  # device rows, in place
                elif p.whole:
                    if dev is None:  # CUDA rows into host pages (staged by UCX): one-off
                        pool = []
                    else:
                        pool = self._big_pool(dev, p.nbytes)
                        if pool is None:
                            return False
                else:
                    pool = self.scratch_free if dev is None else self._dscratch[dev]
                    if not pool:
                        return False
            rx.queued -= 1
            if not live:
                self.link.discard(probe)
                book.cond.notify_all()
                return True
            scratch = None
            if pool is not None:
                scratch = pool.pop() if pool else np.empty(p.nbytes, dtype=np.uint8)
                dst = scratch[: p.nbytes]
            req = self.link.worker.tag_recv_with_handle(Array(dst), probe)
            rx.inflight += 1
        self.reqs.append((req, p, scratch, pool))
        return True

    def _big_pool(self, dev: torch.device, nbytes: int) -> list[torch.Tensor] | None:
        """The free list of whole-batch device scratch with a buffer of at least
        ``nbytes`` at its end (allocated, or grown, while fewer than ``_BIG_BUFS`` exist
        or a free one is too small), or None when all are in use."""
        free = self._big_free.setdefault(dev, [])
        for i, b in enumerate(free):
            if b.numel() >= nbytes:
                free.append(free.pop(i))
                return free
        if free:  # too small: replace it with a bigger one
            free.pop(0)
            self._big_count[dev] -= 1
        if self._big_count[dev] >= _BIG_BUFS:
            return None
        size = -(-nbytes // _BIG_ALIGN) * _BIG_ALIGN
        free.append(torch.empty(size, dtype=torch.uint8, device=dev))
        self._big_count[dev] += 1
        return free

    def sweep(self, now: float) -> None:
        """Deadlines; forget announced segments of transfers that ended (should their
        messages still come, they are discarded as unknown)."""
        book = self.book
        with book.cond:
            book.sweep(now)
            gone = [t for t, q in self.pending.items() if q.rx.state.final]
            for t in gone:
                self.pending.pop(t).rx.queued -= 1
            if gone:
                book.cond.notify_all()

    # ------------------------------------------------------------- completion
    def reap(self) -> None:
        """Land completed receives (scatter from scratch, or launch a device scatter),
        fail transfers whose receives failed, and recycle scratch."""
        self.link.reap_discards()
        if not self.reqs:
            return
        reqs, self.reqs = self.reqs, []
        still = self.reqs  # receives posted below (into a freed scratch) join it
        for req, p, scratch, pool in reqs:
            if not req.completed:
                still.append((req, p, scratch, pool))
                continue
            try:
                req.check_error()
                err = None
            except Exception as exc:
                err = f"receive failed: {type(exc).__name__}: {exc}"
            book = self.book
            with book.cond:
                rx = p.rx
                if err is not None:
                    book.fail(rx, err)
                elif not rx.state.final:
                    if isinstance(scratch, torch.Tensor):  # lands when the scatter has
                        ev = self._scatter_dev(book.groups[p.group], p, scratch)
                        self.scatters.append(_Scatter(ev, p, scratch, pool))
                        continue
                    if scratch is not None:
                        scatter_host(book.groups[p.group], p.seg, scratch[: p.nbytes])
                    book.landed(rx, p.group, p.seg.pages, p.nbytes)
                rx.inflight -= 1
                if pool is not None and scratch is not None:
                    pool.append(scratch)
                book.maybe_finish(rx, rx.queued)
                book.cond.notify_all()
            if self._held and isinstance(scratch, np.ndarray):
                # Hand the freed scratch to the next arrived segment (and let UCX send
                # its rendezvous reply) before scattering another one: the peer's copy
                # into it then runs while this thread scatters, instead of after.
                while self._held and self.post(*self._held[0]):
                    self._held.popleft()
                self.link.worker.progress()

    def scatter_reap(self, block: bool) -> None:
        """Finish device scatters whose events have passed (all of them when ``block``:
        the thread is about to sleep, and a scatter does not wake it): their pages
        land, their scratch is free again."""
        book = self.book
        while self.scatters:
            s = self.scatters[0]
            if block:
                s.event.synchronize()
            elif not s.event.query():
                return
            self.scatters.popleft()
            with book.cond:
                rx = s.p.rx
                if not rx.state.final:
                    book.landed(rx, s.p.group, s.p.seg.pages, s.p.nbytes)
                rx.inflight -= 1
                s.pool.append(s.scratch)
                book.maybe_finish(rx, rx.queued)
                book.cond.notify_all()

    def _scatter_dev(self, grp: Group, p: PendingSeg, scratch: torch.Tensor) -> Any:
        """Launch the scatter of a segment received into device scratch: one batched
        ``index_copy_`` over 8-byte elements per region (``scatter_rows``; a slice copy
        for a single run) on this plane's stream, the slot indices copied to the device
        once. Returns an event recorded after it (never a stream sync per segment)."""
        dev = scratch.device
        stream = self._streams[dev]
        src = scratch[: p.nbytes].view(p.seg.pages, grp.page_bytes)
        runs = p.seg.runs
        with torch.cuda.stream(stream):
            slots: torch.Tensor
            if p.seg.direct:  # one run: a slice copy
                slots = torch.arange(runs[0][0], runs[0][0] + runs[0][1])
            else:
                host = p.slots if p.slots is not None else runs_slots(runs)
                slots = torch.from_numpy(host).to(dev, non_blocking=True)
            col = 0
            for region in grp.regions:
                scatter_rows(region.tensor, slots, src[:, col : col + region.size])
                col += region.size
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev
