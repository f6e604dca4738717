"""The sender: posting a planned push (plan.py) on the progress thread, its send ring,
RMA registrations and acknowledgements, and when a push is DONE or FAILED.

Contract:

- ``start`` (caller's thread) makes the ``PushHandle`` and queues the push; every UCX
  call happens on the progress thread (``begin``, ``pump``, ``reap``).
- A push's messages go out in plan order on one endpoint, back to back. A ``GatherSeg``
  is gathered into one of ``SEND_BUFS`` ring buffers right before it is posted, one per
  loop turn (so UCX moves segment k while k+1 is gathered); a buffer is reused only once
  its send completed. A push that finds the ring taken waits while it has sends of its
  own in flight, else gets a one-off buffer: a peer that stopped reading cannot stall
  pushes to other peers.
- ``RmaBatch``: the slab is registered on first use (``ucp_mem_map``, remote read; kept,
  the least recently used of more than ``_RMA_REGS`` unmapped when no active push reads
  it; a mapped store's own registration is used as is), the header framed with its rkey
  and this plane's address, and the batch's acknowledgement awaited (``rx_acks``). The
  TransferDone is held back until every batch was acknowledged, so a receiver ends DONE
  only after all its reads completed while this side still held the rows.
- DONE: every message was posted and every request completed. FAILED: a send failed
  (its error text names the peer, and the latest cma failure here when there was one),
  a receiver failed an RMA batch, or the deadline passed. On failure the endpoint to
  that peer is closed (cancelling what is queued), and buffers UCX may still read
  (ring buffers, iov sends) are kept until their requests complete: only then may the
  caller reuse the rows.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ucxx._lib.arr import Array

from ... import hostmem
from ..dataplane import TransferState, TransferStatus
from . import cma_guard, iov, native_rma, wire
from .hostcopy import GatherSeg
from .link import Link, ucx_api
from .mapped import MappedStores
from .plan import Plan, RmaBatch

# Gathered segments in flight at once, per plane (each SEG_BYTES, huge pages, prefaulted
# once): bounded memory (64 MiB) whatever the fan-out, and 4 in flight cover more than a
# link's bandwidth-delay (the receiver takes 4 at a time too).
SEND_BUFS = 4
_RMA_REGS = 8  # store slabs kept registered (least recently used ones unmapped)


@dataclass
class PushHandle:
    """Sender-side handle returned by ``post_push``."""

    transfer_id: int
    endpoint: str
    deadline: float
    # (buffer: numpy, torch on a device, iov.IovBuf, GatherSeg or RmaBatch; tag) in order
    plan: list[tuple[Any, int]]
    pages: int
    keep: list[object]
    state: TransferState = TransferState.PENDING
    error: str | None = None
    nbytes: int = 0
    requests: list[Any] = field(default_factory=list)
    ep: Any = None  # the endpoint every message of this push goes to
    next: int = 0  # index in ``plan`` of the next message to post
    # (request, send buffer, from the ring?) of gathered segments not yet seen complete
    ring: list[tuple[Any, np.ndarray, bool]] = field(default_factory=list)
    # RMA batches: acknowledgement tags not yet received (the TransferDone, last in
    # ``plan``, is held back until none is left: the consumer may still be reading)
    acks: set[int] = field(default_factory=set)
    rma: bool = False
    cma_seen: int = 0  # cma failures taken in this process when the push started

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.error, self.pages, self.nbytes)


class Sender:
    """The pushes of one plane (module docstring)."""

    def __init__(self, link: Link, stats: Counter[str], mapped: MappedStores) -> None:
        self.link, self.stats, self.mapped = link, stats, mapped
        self.ctx_handle = 0  # the UCX context's (set when the plane opens)
        self.active: list[PushHandle] = []
        self._raw_zombies: list[iov.RawRequest] = []  # failed pushes' iov sends
        # the ring (``_ring_take``): free buffers, how many exist (free or in flight), and
        # failed pushes' buffers UCX may still read (request, buffer, from the ring?)
        self._ring_free: list[np.ndarray] = []
        self._ring_count = 0
        self._ring_zombies: list[tuple[Any, np.ndarray, bool]] = []
        # registered store slabs by (address, length), least recently used first
        self._regs: dict[tuple[int, int], native_rma.Registration] = {}
        self.ack_wait: dict[int, PushHandle] = {}  # acknowledgement tags awaited

    def start(self, endpoint: str, transfer_id: int, plan: Plan, deadline_s: float) -> PushHandle:
        """Queue a planned push (any thread); returns its handle."""
        h = PushHandle(
            transfer_id, endpoint, time.monotonic() + deadline_s, plan.msgs, plan.pages, plan.keep
        )
        h.rma = plan.rma
        if self.link.stop.is_set():
            h.state, h.error = TransferState.FAILED, "data plane closed"
        else:
            self.link.submit(lambda: self.begin(h))
        return h

    def begin(self, h: PushHandle) -> None:
        """Connect and start posting ``h`` (progress thread)."""
        if self.link.stop.is_set():
            h.state, h.error = TransferState.FAILED, "data plane closed"
            return
        h.state = TransferState.RECEIVING
        h.cma_seen = cma_guard.cma_failures()[0]
        try:
            h.ep = self.link.connect(h.endpoint)
        except Exception as exc:
            self.fail(h, f"send to {h.endpoint} failed: {type(exc).__name__}: {exc}")
            return
        self.active.append(h)
        self.pump(h)

    def _ring_take(self, nbytes: int, h: PushHandle) -> tuple[np.ndarray, bool] | None:
        """A send buffer for a gathered segment of ``h``: a free ring buffer, a new one
        while the ring has fewer than ``SEND_BUFS``, else None while ``h`` has sends of
        its own in flight (it resumes when one completes); a one-off buffer for a push
        holding none, and for a segment bigger than ``SEG_BYTES`` (one page over 16 MiB)."""
        if nbytes > wire.SEG_BYTES:
            return np.empty(nbytes, dtype=np.uint8), False
        if self._ring_free:
            return self._ring_free.pop(), True
        if self._ring_count < SEND_BUFS:
            buf = hostmem.empty(wire.SEG_BYTES).numpy()
            buf.fill(0)  # fault it in now, not while gathering into it
            self._ring_count += 1
            self.stats["ucx_send_bufs"] += 1
            return buf, True
        if not h.ring:
            self.stats["ucx_send_bufs_one_off"] += 1
            return np.empty(nbytes, dtype=np.uint8), False
        return None

    def _ring_ready(self) -> bool:
        return bool(self._ring_free) or self._ring_count < SEND_BUFS

    def pump(self, h: PushHandle) -> bool:
        """Post ``h``'s messages in plan order from ``h.next``, stopping after one
        gathered segment (so the loop runs between gathers) or when the ring is empty
        (the push resumes once a send completes, ``reap``). Returns whether the push has
        more to post now."""
        if h.state.final:
            return False
        plan = h.plan
        try:
            ep = h.ep
            while h.next < len(plan):
                if h.rma and h.acks and h.next == len(plan) - 1:
                    return False  # TransferDone waits until every RMA batch was read
                buf, tag = plan[h.next]
                if isinstance(buf, RmaBatch):
                    frame = self._rma_frame(buf)
                    h.keep.append(frame)
                    h.requests.append(ep.tag_send(Array(frame), ucx_api.UCXXTag(tag)))
                    h.acks.add(buf.ack_tag)
                    self.ack_wait[buf.ack_tag] = h
                    h.nbytes += buf.nbytes
                    h.next += 1
                    continue
                if isinstance(buf, GatherSeg):
                    got = self._ring_take(buf.nbytes, h)
                    if got is None:
                        return False
                    out, pooled = got
                    msg = out[: buf.nbytes]
                    try:
                        buf.gather_into(msg)
                        req = ep.tag_send(Array(msg), ucx_api.UCXXTag(tag))
                    except BaseException:
                        if pooled:
                            self._ring_free.append(out)  # never handed to UCX
                        raise
                    h.ring.append((req, out, pooled))
                    h.requests.append(req)
                    h.nbytes += buf.nbytes
                    h.next += 1
                    return h.next < len(plan) and self._ring_ready()
                if isinstance(buf, iov.IovBuf):  # scattered store rows, sent in place
                    h.requests.append(iov.tag_send(ep.handle, buf, tag))
                    self.stats["iov_sends"] += 1
                else:
                    h.requests.append(ep.tag_send(Array(buf), ucx_api.UCXXTag(tag)))
                if tag & wire.DATA_BIT:
                    h.nbytes += buf.nbytes
                h.next += 1
        except Exception as exc:
            self.fail(h, f"send to {h.endpoint} failed: {type(exc).__name__}: {exc}")
        return False

    def fail(self, h: PushHandle, why: str) -> None:
        if h.state.final:
            return
        h.state, h.error = TransferState.FAILED, why
        self.stats["push_failed"] += 1
        for tag in h.acks:  # acknowledgements still to come are discarded as unknown
            self.ack_wait.pop(tag, None)
        h.acks = set()
        self.link.drop(h.endpoint)  # cancels what is still queued for this peer
        # Send buffers UCX may still read (their requests not seen complete) leave the
        # ring: never reused, kept alive until they complete (``reap``); the ring may
        # allocate replacements meanwhile.
        for req, buf, pooled in h.ring:
            if req.completed:
                if pooled:
                    self._ring_free.append(buf)
            else:
                self._ring_zombies.append((req, buf, pooled))
                if pooled:
                    self._ring_count -= 1
        h.ring = []
        # Scatter-gather sends are ours to free, and UCX reads their iov arrays until they
        # complete (cancelled with the ep): keep them until then.
        self._raw_zombies.extend(
            r for r in h.requests if isinstance(r, iov.RawRequest) and not r.completed
        )
        # Only now may the caller reuse the rows: requests were cancelled with the ep.
        h.plan, h.keep, h.requests = [], [], []

    def fail_all(self, why: str) -> None:
        for h in self.active:
            self.fail(h, why)

    def reap(self) -> bool:
        """Reap completed sends, recycle send buffers, finish or fail pushes, and post
        what waited for a send buffer. Returns whether a push can post more right away
        (the loop must not sleep then)."""
        if self._raw_zombies:
            self._raw_zombies = [r for r in self._raw_zombies if not r.completed]
        if self._ring_zombies:
            left = []
            for item in self._ring_zombies:
                req, buf, pooled = item
                if not req.completed:
                    left.append(item)
                elif pooled and self._ring_count < SEND_BUFS:  # UCX is done with it
                    self._ring_free.append(buf)
                    self._ring_count += 1
            self._ring_zombies = left
        if not self.active:
            return False
        for h in self.active:
            if h.ring:
                still_ring = []
                for item in h.ring:
                    if not item[0].completed:
                        still_ring.append(item)
                    elif item[2]:
                        self._ring_free.append(item[1])
                h.ring = still_ring
        more = False
        for h in self.active:
            if h.next < len(h.plan) and (self._ring_ready() or not h.ring):
                more = self.pump(h) or more
        now = time.monotonic()
        still = []
        for h in self.active:
            if h.state.final:  # failed while posting
                continue
            err = None
            pending = []
            for r in h.requests:
                if r.completed:
                    try:
                        r.check_error()
                    except Exception as exc:
                        err = f"send to {h.endpoint} failed: {type(exc).__name__}: {exc}"
                        err += cma_guard.note(h.cma_seen)
                        break
                else:
                    pending.append(r)
            if err is not None:
                self.fail(h, err)
            elif not pending and h.next >= len(h.plan):
                h.state = TransferState.DONE
                h.plan, h.keep, h.requests = [], [], []
                self.stats["push_done"] += 1
            elif now > h.deadline:
                self.fail(h, f"peer {h.endpoint} did not take the data before the deadline")
            else:
                h.requests = pending
                still.append(h)
        self.active = still
        return more

    # ------------------------------------------------------------------- RMA
    def _rma_frame(self, b: RmaBatch) -> np.ndarray:
        """The header of an RMA batch, its slab registered (``_rma_reg``)."""
        reg = self._rma_reg(b.slab, b.owner)
        frame = wire.rma_frame(
            b.transfer_id, b.lease_id, b.token, b.group, b.page_bytes, b.batch,
            int(b.slab.ctypes.data),  # inside reg (a mapped store may hold it)
            int(b.slab.shape[0]), int(b.slab.strides[0]), int(b.slab.shape[1]),
            reg.rkey, self.link.endpoint, b.cols, b.slots, b.rows,
        )  # fmt: skip
        if frame.size - 4 > wire.HDR_MAX:
            raise ValueError(f"RMA header of {frame.size} bytes")
        return frame

    def _rma_reg(self, slab: np.ndarray, owner: Any) -> native_rma.Registration:
        """The registration of a store slab (mapped on first use, kept: registered once;
        beyond ``_RMA_REGS`` slabs, the least recently used one no active push reads is
        unmapped)."""
        rows, stride = int(slab.shape[0]), int(slab.strides[0])
        base, length = int(slab.ctypes.data), (rows - 1) * stride + int(slab.shape[1])
        got = self.mapped.covering(base, length)
        if got is not None:  # a mapped store (register_source): kept, not LRU
            return got
        key = (base, length)
        reg = self._regs.pop(key, None)
        if reg is None:
            if len(self._regs) >= _RMA_REGS:
                busy = {
                    int(e.slab.ctypes.data)
                    for h in self.active
                    for e, _ in h.plan
                    if isinstance(e, RmaBatch)
                }
                for k in list(self._regs):
                    if len(self._regs) < _RMA_REGS:
                        break
                    if k[0] not in busy:
                        self._regs.pop(k).close()
                        self.stats["rma_mem_unmap"] += 1
            reg = native_rma.register(self.ctx_handle, base, length, owner)
            self.stats["rma_mem_map"] += 1
        self._regs[key] = reg  # most recently used last
        return reg

    def rx_acks(self) -> None:
        """Take arrived RMA acknowledgements (one masked probe each); an unknown one
        (forged, or for a push that already ended) is discarded."""
        worker = self.link.worker
        tag = ucx_api.UCXXTag(wire.ACK_BIT)
        mask = ucx_api.UCXXTagMask(wire.DATA_BIT | wire.ACK_BIT)
        while True:
            probe = worker.tag_probe(tag, mask, remove=True)
            if not probe.matched:
                return
            h = self.ack_wait.pop(int(probe.sender_tag.value), None)
            n = int(probe.length)
            if h is None or n < 1 or n > 4096:
                self.link.discard(probe)
                continue
            buf = np.empty(n, dtype=np.uint8)
            req = self.link.receive_small(probe, buf, "ack")
            if req is None:
                self.fail(h, f"acknowledgement from {h.endpoint} never completed")
                continue
            try:
                req.check_error()
            except Exception as exc:
                self.fail(h, f"acknowledgement from {h.endpoint} failed: {exc}")
                continue
            h.acks.discard(int(probe.sender_tag.value))
            if buf[0] != 0:
                why = bytes(buf[1:]).decode(errors="replace")
                self.fail(h, f"receiver {h.endpoint} failed the RMA batch: {why}")

    def close(self) -> None:
        """Unmap the registered slabs (progress thread, at teardown)."""
        for reg in self._regs.values():
            reg.close()
            self.stats["rma_mem_unmap"] += 1
        self._regs.clear()
        self.ack_wait.clear()
