"""ZMQ implementation of the DataPlane (the fallback when UCX is not available).

Wire: each data message is one multipart zmq message ``[PageBatch header, payload...]``
on a PUSH -> PULL connection. The payload is the batch's pages in run order, split
into frames of at most FRAME_BYTES that start on a page boundary and hold whole pages
(a page larger than FRAME_BYTES is split over several frames, none spanning two
pages); a frame does span runs. Frames are read zero-copy (``recv(copy=False)``) and
written with one numpy row assignment each, straight into the page slots of a directly
registered region; other groups gather into a scratch buffer and are scattered with
one copy per region per message. Receivers accept any framing within the batch's
bytes (checked before each write). A transfer ends with a ``TransferDone`` message.

Sender: the plane takes ``StoreRows`` (``accepts_store_rows``), so a push never
gathers its pages up front. Pieces of the source (runs of consecutive store rows, or
one column of a row) of FRAME_BYTES or more on average go out zero-copy from the
store; smaller scattered pages are gathered per message (MSG_BYTES) into one of
STAGE_BUFFERS staging buffers of the peer's lane, on the sender thread, while libzmq
sends the messages before it (a buffer is reused only once libzmq released it).

Checksum: off by default, like the UCX plane. TCP and AF_UNIX already deliver the
bytes intact and in order, and the receiver checks the framing itself (each batch's
slots before writing, its byte count, the per-group page counts at TransferDone).
``checksum=True`` (config ``transport_checksum: true``) adds xxh3-64 over the payload
on both sides, verified at TransferDone; a transfer's checksum is used only when both
planes have it on. Over tcp it costs 10-45% of the throughput on the 2-core box (below);
over ipc the difference is inside the noise.

Threads: one receiver thread owns the PULL socket; one sender thread per peer owns its
PUSH socket. Sender sockets use IMMEDIATE so a dead or absent peer shows up as "cannot
send" and the push fails at its deadline.

Measured (2-core AMD EPYC box, loopback, 256 MiB of randomly scattered store rows into
random slots of a 2N-slot pool, median of 5, ratio against raw TCP / AF_UNIX measured
right before each row: ``disagg bench transfer --transports zmq-tcp,zmq-ipc
--page-sizes 64KiB,256KiB,1MiB,4MiB --total 256MiB --repeats 5``, plus interleaved A/B
runs of the same ``measure``; ranges over 4-6 runs; raw TCP 1.9-4.5 GB/s, AF_UNIX
5.0-6.4 GB/s between runs). "before": pages gathered by the producer before the push,
checksum on; "now": StoreRows sent in place or gathered per message, checksum off.

    ======== ========== ========== ========================
    page     before     now        now, checksum on (A/B)
    ======== ========== ========== ========================
    tcp 64K  0.30-0.43  0.55-0.66  0.55-0.61
    tcp 256K -          0.53-0.76  0.57-0.58
    tcp 1M   0.35-0.37  0.50-1.27  0.70-0.83
    tcp 4M   0.33-0.46  0.76-1.80  0.42-0.64
    ipc 64K  0.22-0.24  0.40-0.52  0.40-0.41
    ipc 256K -          0.34-0.49  0.49
    ipc 1M   0.23-0.26  0.32-0.66  0.46-0.51
    ipc 4M   0.20-0.25  0.43-0.60  0.56-0.66
    ======== ========== ========== ========================

What still limits it (perf, zmq-ipc 1 MiB, steady state): the box has 2 cores and the
plane keeps 3 busy threads (sender io thread: the kernel copy in; receiver io thread:
the kernel copy out into libzmq's buffer; receiver Python thread: the copy into the
slots, ~0.09 s/GB), against the ceiling's 2 (one copy each side). The receiver's
second copy is inherent to libzmq (it owns receive buffers); small pages add the
sender's gather copy. SNDBUF/RCVBUF of 1-4 MiB made no measurable difference.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
import zmq

from ..protocol import messages as m
from ..protocol.errors import ProtocolError
from .dataplane import (
    FRAME_BYTES,
    DataPlane,
    RowsSource,
    StoreRows,
    TransferState,
    TransferStatus,
    check_store_rows,
    gather_pages,
)
from .receiver import BookedReceiver, ReceiverBook, Rx, runs_slots

log = logging.getLogger(__name__)

MSG_BYTES = 8 << 20  # payload per zmq message: bounds what libzmq buffers per message
# Source pieces (runs of consecutive store rows, or one column of a row) at least this
# long on average go out zero-copy; shorter ones are gathered per message into a staging
# buffer: a 64 KiB frame costs more (pyzmq's free callback through its gc thread on the
# sender, a Frame and a numpy copy call on the receiver) than copying its bytes once.
ZERO_COPY_MIN = FRAME_BYTES
STAGE_BUFFERS = 4  # staging buffers per peer lane (each MSG_BYTES, allocated on first use)
_HWM = 64  # messages queued per socket (each <= MSG_BYTES)
_POLL_MS = 20


# glibc malloc for libzmq's receive buffers (one malloc per frame, freed by the reader):
# with the defaults each 1 MiB frame is a fresh mmap or a re-grown heap top, so every
# received page faults in and is zeroed (~11k faults per 128 MiB, a third more CPU).
# Frames up to MALLOC_MMAP_BYTES come from the heap, and up to MALLOC_TRIM_BYTES of free
# heap top is kept for the next ones. Skipped when MALLOC_*_ environment knobs are set,
# or with DISAGG_ZMQ_MALLOC_TUNING=0 (for hosts whose allocator must stay untouched).
MALLOC_MMAP_BYTES = 4 << 20
MALLOC_TRIM_BYTES = 64 << 20
_malloc_tuned = False


def _tune_malloc() -> None:
    global _malloc_tuned
    if _malloc_tuned:
        return
    _malloc_tuned = True
    if any(k.startswith("MALLOC_") for k in os.environ):
        return
    if os.environ.get("DISAGG_ZMQ_MALLOC_TUNING", "1") == "0":
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return  # not glibc
    # M_MMAP_THRESHOLD = -3, M_TRIM_THRESHOLD = -1
    if not (mallopt(-3, MALLOC_MMAP_BYTES) and mallopt(-1, MALLOC_TRIM_BYTES)):
        log.debug("mallopt refused the data plane's malloc thresholds")


# Sender lanes: at most this many peers at once; a lane idle this long is retired.
MAX_LANES = 256
LANE_IDLE_S = 30.0


@dataclass
class _Lane:
    """Pushes to one peer endpoint, in order, on their own thread and socket."""

    endpoint: str
    jobs: queue.Queue[PushHandle | None] = field(default_factory=queue.Queue)
    inflight: list[PushHandle] = field(default_factory=list)
    sock: zmq.Socket | None = None
    thread: threading.Thread = field(default=None)  # type: ignore[assignment]
    closing: bool = False
    # staging ring for gathered messages: (buffer, tracker of its last send or None)
    stage: list[list[Any]] = field(default_factory=list)
    stage_next: int = 0


@dataclass
class _Msg:
    """One planned data message: its encoded PageBatch header and its payload, either
    zero-copy ``frames`` over the source or ``gather`` (a ``[n, row_bytes]`` numpy view
    of the slab, the n source rows, the (offset, length) columns of a page) to copy into
    a staging buffer when it is sent."""

    header: bytes
    nbytes: int
    page_bytes: int
    frames: list[memoryview] | None = None
    gather: tuple[np.ndarray, np.ndarray, tuple[tuple[int, int], ...]] | None = None


@dataclass
class PushHandle:
    """Sender-side handle returned by ``post_push``."""

    transfer_id: int
    endpoint: str
    deadline: float
    plan: list[_Msg]
    pages: int
    lease_id: int
    token: bytes
    keep: list[object]  # source arrays: alive until sent
    state: TransferState = TransferState.PENDING
    error: str | None = None
    tracker: zmq.MessageTracker | None = None
    nbytes: int = 0

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.error, self.pages, self.nbytes)


class ZmqDataPlane(BookedReceiver, DataPlane):
    """Both DataPlane sides over ZMQ. ``bind`` is the receiver endpoint
    (``tcp://host:0`` picks a port, ``ipc://path``); ``advertise`` replaces the bound
    address in ``endpoint`` when peers must use another name (e.g. bound on 0.0.0.0).
    ``checksum``: hash payloads with xxh3-64 and verify at the receiver (default off:
    see the module docstring; verified only when both planes have it on)."""

    accepts_store_rows = True  # producers hand StoreRows: no gather before a push

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        advertise: str | None = None,
        context: zmq.Context | None = None,
        checksum: bool = False,
    ) -> None:
        _tune_malloc()
        self._ctx = context or zmq.Context.instance()
        self.checksum = checksum
        self.stats: Counter[str] = Counter()
        # receiver state; its lock is held while a message is written
        self._book = ReceiverBook(self.stats, checksum=checksum)
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._stop = threading.Event()

        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, _HWM)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MSG_BYTES + FRAME_BYTES)  # per frame
        self._pull.bind(bind)
        self._endpoint = advertise or self._pull.getsockopt_string(zmq.LAST_ENDPOINT)

        # One sender lane (queue, thread, socket) per peer endpoint: a dead or slow peer
        # holds up only its own pushes, never another consumer's.
        self._lanes: dict[str, _Lane] = {}
        self._lanes_lock = threading.Lock()
        self._rx_thread = threading.Thread(target=self._rx_run, name="disagg-dp-rx", daemon=True)
        self._rx_thread.start()

    def health(self) -> tuple[bool, str]:
        if self._stop.is_set():
            return False, "data plane closed"
        if not self._rx_thread.is_alive():
            return False, "data plane receiver thread died"
        with self._lanes_lock:
            dead = [ep for ep, lane in self._lanes.items() if not lane.thread.is_alive()]
        if dead:
            return False, f"data plane sender for {dead[0]} died"
        return True, ""

    # ================================ receiver ==========================================
    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _rx_run(self) -> None:
        sock = self._pull
        last_sweep = 0.0
        try:
            while not self._stop.is_set():
                if sock.poll(_POLL_MS, zmq.POLLIN):
                    try:
                        self._rx_message(sock)
                    except Exception:  # never let one message kill the receiver
                        log.exception("data plane receiver error")
                        self.stats["internal_error"] += 1
                        self._drain(sock)
                last_sweep = self._sweep_if_due(last_sweep)
        finally:
            sock.close(linger=0)
            self._fail_all_closed()

    @staticmethod
    def _drain(sock: zmq.Socket) -> None:
        while sock.get(zmq.RCVMORE):
            sock.recv_into(bytearray())

    def _rx_message(self, sock: zmq.Socket) -> None:
        head = sock.recv()
        try:
            msg = m.decode(head)
        except ProtocolError as e:
            self.stats["rejected_" + e.code.name] += 1
            self._drain(sock)
            return
        book = self._book
        with book.lock:
            rx = book.authenticate(msg)
            if rx is not None and isinstance(msg, m.TransferDone):
                book.on_done(rx, msg)
            elif rx is not None and isinstance(msg, m.PageBatch):
                if book.accept_batch(rx, msg) is None:
                    error = self._receive(sock, rx, msg)
                    if error is not None:
                        self.stats["rejected_batch"] += 1
                        book.fail(rx, error)
            if rx is not None and rx.state.final:
                book.cond.notify_all()  # wake wait()
            self._drain(sock)

    def _receive(self, sock: zmq.Socket, rx: Rx, h: m.PageBatch) -> str | None:
        grp = self._book.groups[h.group]
        pb = h.page_bytes
        slots = runs_slots(h.runs)  # bounds and promises were checked by accept_batch
        total = int(slots.size) * pb
        direct = grp.direct
        scratch = None
        if direct is None:
            if self._scratch.numel() < total:
                pin = torch.cuda.is_available()  # pinned host memory copies to a GPU faster
                self._scratch = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
            scratch = self._scratch.numpy()
        hasher = rx.hasher
        off = 0
        more = sock.get(zmq.RCVMORE)
        while more:
            if off >= total:
                return "batch has more payload frames than its runs"
            frame = sock.recv(copy=False)
            more = frame.more
            buf = frame.buffer
            n = len(buf)
            if n > total - off:
                return f"a payload frame of {n} bytes overruns its runs ({total - off} left)"
            if hasher is not None:
                hasher.update(buf)
            src = np.frombuffer(buf, dtype=np.uint8)
            if scratch is not None:
                scratch[off : off + n] = src
            elif direct is not None and n:
                _place(direct, slots, pb, off, src)
            off += n
        if off < total:
            return f"batch for group {h.group} ended {total - off} bytes short"
        if scratch is not None:
            grp.scatter(slots, self._scratch[:total].view(-1, pb))
        self._book.landed(rx, h.group, int(slots.size), total)
        return None

    # ================================= sender ===========================================
    def post_push(
        self,
        endpoint: str,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        pages: Sequence[RowsSource],
        deadline_s: float = 30.0,
    ) -> PushHandle:
        """Queue ``pages`` for the peer at ``endpoint``; returns at once. Each source is
        a uint8 ``[n, page_bytes]`` tensor or ``StoreRows`` of a host slab (left in place:
        sent zero-copy or gathered per message on the sender thread). The rows must not
        change until ``poll_push`` is final. Malformed sources raise ValueError."""
        plan: list[_Msg] = []
        keep: list[object] = []
        npages = 0
        for group, rows, dst_slots in pages:
            msgs, n, arr = _plan_group(transfer_id, lease_id, bytes(token), group, rows, dst_slots)
            plan.extend(msgs)
            keep.append(arr)
            npages += n
        handle = PushHandle(
            transfer_id,
            endpoint,
            time.monotonic() + deadline_s,
            plan,
            npages,
            lease_id,
            bytes(token),
            keep,
        )
        if self._stop.is_set():
            handle.state, handle.error = TransferState.FAILED, "data plane closed"
            return handle
        with self._lanes_lock:
            lane = self._lanes.get(endpoint)
            if lane is None or lane.closing:
                if len(self._lanes) >= MAX_LANES:
                    handle.state = TransferState.FAILED
                    handle.error = f"too many peers ({MAX_LANES}) with pushes in flight"
                    return handle
                lane = self._lanes[endpoint] = _Lane(endpoint)
                lane.thread = threading.Thread(
                    target=self._tx_run, args=(lane,), name="disagg-dp-tx", daemon=True
                )
                lane.thread.start()
            lane.jobs.put(handle)
        return handle

    def poll_push(self, handle: PushHandle) -> TransferStatus:
        return handle.status()

    def _tx_socket(self, lane: _Lane) -> zmq.Socket:
        if lane.sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that isn't there
            sock.setsockopt(zmq.SNDHWM, _HWM)
            # pyzmq copies small "zero-copy" frames and reports them sent at once; with no
            # threshold every tracker really means "libzmq has written and released it".
            sock.copy_threshold = 0
            try:
                sock.connect(lane.endpoint)
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
            lane.sock = sock
        return lane.sock

    def _tx_drop_socket(self, lane: _Lane) -> None:
        sock, lane.sock = lane.sock, None
        if sock is not None:
            sock.close(linger=0)  # drops anything still queued for this peer

    def _tx_run(self, lane: _Lane) -> None:
        idle_since = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    h = lane.jobs.get(timeout=_POLL_MS / 1000)
                except queue.Empty:
                    h = None
                if h is not None:
                    self._tx_send(lane, h)
                self._tx_reap(lane)
                if h is not None or lane.inflight:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > LANE_IDLE_S:
                    with self._lanes_lock:  # retire: a later push to this peer starts anew
                        if lane.jobs.empty():
                            lane.closing = True
                            self._lanes.pop(lane.endpoint, None)
                            return
        finally:
            for h in lane.inflight:
                if not h.state.final:
                    h.state, h.error = TransferState.FAILED, "data plane closed"
            while not lane.jobs.empty():
                h = lane.jobs.get_nowait()
                if h is not None:
                    h.state, h.error = TransferState.FAILED, "data plane closed"
            self._tx_drop_socket(lane)

    def _tx_send(self, lane: _Lane, h: PushHandle) -> None:
        hasher = xxhash.xxh3_64() if self.checksum else None
        h.state = TransferState.RECEIVING
        try:
            # inside the try: a peer-supplied endpoint that zmq refuses (a hostile Push)
            # fails this push, never the sender thread
            sock = self._tx_socket(lane)
            for msg in h.plan:
                frames = msg.frames
                slot = None
                if frames is None:  # gather into a staging buffer libzmq has released
                    slot = self._stage_take(lane, msg, h)
                    if slot is None:
                        self._tx_drop_socket(lane)
                        return
                    frames = _frames_of(slot[0], msg.nbytes, msg.page_bytes)
                if not self._wait_writable(sock, h):
                    self._tx_drop_socket(lane)
                    return
                if hasher is not None:
                    for f in frames:
                        hasher.update(f)
                sock.send(msg.header, zmq.SNDMORE)
                last = len(frames) - 1
                for i, f in enumerate(frames):
                    if i < last:
                        sock.send(f, zmq.SNDMORE, copy=False)
                    elif slot is not None:  # the buffer is free again once this is released
                        slot[1] = sock.send(f, 0, copy=False, track=True)
                    else:
                        sock.send(f, 0, copy=False)
                h.nbytes += msg.nbytes
            done = m.TransferDone(
                transfer_id=h.transfer_id,
                lease_id=h.lease_id,
                token=h.token,
                checksum=hasher.intdigest() if hasher is not None else 0,
            )
            if not self._wait_writable(sock, h):
                self._tx_drop_socket(lane)
                return
            # The done message is last on the wire: once libzmq releases it, it has
            # released every payload frame before it too.
            h.tracker = sock.send(m.encode(done), copy=False, track=True)
            lane.inflight.append(h)
        except zmq.ZMQError as e:
            self._tx_fail(h, f"send to {h.endpoint} failed: {e}")
            self._tx_drop_socket(lane)

    def _stage_take(self, lane: _Lane, msg: _Msg, h: PushHandle) -> list[Any] | None:
        """The lane's next staging buffer, once libzmq no longer holds its last message
        (never overwritten while queued), filled with ``msg``'s gathered pages; None when
        the push failed waiting (deadline or close). A ring of STAGE_BUFFERS lets the
        gather of one message overlap the sending of the ones before it."""
        if len(lane.stage) < STAGE_BUFFERS:
            lane.stage.append([np.empty(0, dtype=np.uint8), None])
        slot = lane.stage[lane.stage_next % len(lane.stage)]
        lane.stage_next += 1
        tracker = slot[1]
        while tracker is not None and not tracker.done:
            if self._stop.is_set():
                self._tx_fail(h, "data plane closed")
                return None
            left = h.deadline - time.monotonic()
            if left <= 0:
                self._tx_fail(h, f"peer {h.endpoint} did not take the data before the deadline")
                return None
            try:
                tracker.wait(min(left, 0.1))
            except zmq.NotDone:
                pass
        slot[1] = None
        if slot[0].size < msg.nbytes:
            slot[0] = np.empty(max(msg.nbytes, MSG_BYTES), dtype=np.uint8)
        assert msg.gather is not None
        gather_pages(slot[0][: msg.nbytes], *msg.gather)
        return slot

    def _wait_writable(self, sock: zmq.Socket, h: PushHandle) -> bool:
        while not self._stop.is_set():
            left = h.deadline - time.monotonic()
            if left <= 0:
                self._tx_fail(h, f"peer {h.endpoint} did not take the data before the deadline")
                return False
            if sock.poll(min(int(left * 1000) + 1, 100), zmq.POLLOUT):
                return True
        self._tx_fail(h, "data plane closed")
        return False

    def _tx_fail(self, h: PushHandle, why: str) -> None:
        h.state, h.error = TransferState.FAILED, why
        h.plan, h.keep = [], []
        self.stats["push_failed"] += 1

    def _tx_reap(self, lane: _Lane) -> None:
        now = time.monotonic()
        still = []
        for h in lane.inflight:
            if h.tracker is not None and h.tracker.done:
                h.state = TransferState.DONE
                h.plan, h.keep = [], []
                self.stats["push_done"] += 1
            elif now > h.deadline:
                self._tx_fail(h, f"peer {h.endpoint} did not drain the data before the deadline")
                self._tx_drop_socket(lane)
            else:
                still.append(h)
        lane.inflight = still

    # ================================= common ===========================================
    def close(self) -> None:
        self._stop.set()
        with self._lanes_lock:
            lanes = list(self._lanes.values())
        for t in [self._rx_thread, *(lane.thread for lane in lanes)]:
            t.join(5.0)


def _source(
    group: int, src: torch.Tensor | StoreRows, n: int
) -> tuple[torch.Tensor, np.ndarray, tuple[tuple[int, int], ...]]:
    """``(slab, rows, cols)`` of a push source, checked: a host uint8 ``[R, W]`` slab with
    contiguous rows, ``n`` rows inside it and columns inside a row. A device source is
    copied to the host first (the zmq path moves host memory only)."""
    if isinstance(src, StoreRows):
        slab = src.slab
        if slab.device.type != "cpu":
            return _source(group, src.materialize().cpu(), n)
        if slab.dtype != torch.uint8 or slab.dim() != 2:
            raise ValueError(
                f"group {group}: the source slab must be 2-D uint8, got {slab.dtype} "
                f"{tuple(slab.shape)}"
            )
        if slab.shape[1] > 1 and slab.stride(1) != 1:
            slab = slab.contiguous()
        rows, cols = check_store_rows(group, src, n, int(slab.shape[1]))
        return slab, rows, cols
    if src.dtype != torch.uint8 or src.dim() != 2 or src.shape[0] != n:
        raise ValueError(
            f"group {group}: rows must be uint8 [len(dst_slots)={n}, page_bytes], "
            f"got {src.dtype} {tuple(src.shape)}"
        )
    if src.shape[1] < 1:
        raise ValueError(f"group {group}: page_bytes must be >= 1")
    if src.device.type != "cpu":
        src = src.cpu()
    src = src.contiguous()
    return src, np.arange(n, dtype=np.int64), ((0, int(src.shape[1])),)


def _plan_group(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    src: torch.Tensor | StoreRows,
    dst_slots: Sequence[int],
) -> tuple[list[_Msg], int, torch.Tensor]:
    """Split one group's pages into messages of at most MSG_BYTES: each names its pages'
    destination runs (consecutive slots coalesced) and carries them in that order.

    A message whose source pieces (a run of consecutive whole rows, or one column of a
    row) average at least ZERO_COPY_MIN bytes, or are no more than the frames the
    gathered message would take, is sent zero-copy as frames over them (page-aligned, at
    most FRAME_BYTES, a page larger than that split over several); smaller pieces are
    gathered into a staging buffer when the message is sent (one copy
    on the sender thread, overlapping libzmq's sending of the messages before it), so
    small scattered pages still travel in FRAME_BYTES frames and the receiver's
    per-frame cost stays small. Vectorised; loops only over runs and frames."""
    slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    slab, rows, cols = _source(group, src, int(slots.shape[0]))
    if (slots < -1).any():
        raise ValueError(f"group {group}: destination slots must be >= -1")
    pb = sum(c for _, c in cols)
    idx = np.flatnonzero(slots >= 0)
    if idx.size == 0:
        return [], 0, slab
    dst = slots[idx]
    rows = rows[idx]
    arr = slab.numpy()  # [R, W] view, rows contiguous
    row_stride = int(arr.strides[0])
    # one flat byte view from the first row: piece addresses are offsets into it
    span = (int(arr.shape[0]) - 1) * row_stride + int(arr.shape[1])
    flat = np.lib.stride_tricks.as_strided(arr, shape=(span,), strides=(1,))
    whole_row = len(cols) == 1 and cols[0][0] == 0 and cols[0][1] == row_stride
    per_msg = max(1, MSG_BYTES // pb)  # pages per message
    dst_brk = np.flatnonzero(np.diff(dst) != 1) + 1  # where destination runs break
    src_brk = np.flatnonzero(np.diff(rows) != 1) + 1  # where source rows stop being consecutive
    msgs: list[_Msg] = []
    for m0 in range(0, int(idx.size), per_msg):
        m1 = min(m0 + per_msg, int(idx.size))
        k = m1 - m0
        cuts = dst_brk[(dst_brk > m0) & (dst_brk < m1)]
        starts = np.concatenate(([m0], cuts))
        counts = np.diff(np.concatenate((starts, [m1])))
        runs = list(zip(dst[starts].tolist(), counts.tolist(), strict=True))
        header = m.encode(
            m.PageBatch(
                transfer_id=transfer_id,
                lease_id=lease_id,
                token=token,
                group=group,
                runs=runs,
                page_bytes=pb,
            )
        )
        if whole_row:
            edges = np.concatenate(([m0], src_brk[(src_brk > m0) & (src_brk < m1)], [m1]))
            pieces = edges.size - 1
        else:
            pieces = k * len(cols)
        nbytes = k * pb
        if pb > FRAME_BYTES:  # the frames this message would take gathered
            gathered_frames = k * -(-pb // FRAME_BYTES)
        else:
            gathered_frames = -(-nbytes // ((FRAME_BYTES // pb) * pb))
        if nbytes < ZERO_COPY_MIN * pieces and pieces > gathered_frames:
            msgs.append(_Msg(header, nbytes, pb, gather=(arr, rows[m0:m1], cols)))
            continue
        frames: list[memoryview] = []
        mv = memoryview(flat)  # type: ignore[arg-type]
        if whole_row:
            for a, b in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
                lo = int(rows[a]) * row_stride
                frames.extend(_split(mv[lo : lo + (b - a) * pb], pb))
        else:
            for r in rows[m0:m1].tolist():
                for off, length in cols:
                    lo = r * row_stride + off
                    frames.extend(_split(mv[lo : lo + length], length))
        msgs.append(_Msg(header, nbytes, pb, frames=frames))
    return msgs, int(idx.size), slab


def _split(mv: memoryview, unit: int) -> list[memoryview]:
    """``mv`` (whole units of ``unit`` bytes) as frames of whole units of at most
    FRAME_BYTES, or, for units above FRAME_BYTES, each unit in FRAME_BYTES pieces (a frame
    never spans two pages)."""
    if unit > FRAME_BYTES:
        return [
            mv[p + o : p + min(o + FRAME_BYTES, unit)]
            for p in range(0, len(mv), unit)
            for o in range(0, unit, FRAME_BYTES)
        ]
    step = (FRAME_BYTES // unit) * unit
    return [mv[o : o + step] for o in range(0, len(mv), step)]


def _frames_of(buf: np.ndarray, nbytes: int, pb: int) -> list[memoryview]:
    """A staging buffer's first ``nbytes`` (whole pages) as frames."""
    return _split(memoryview(buf[:nbytes]), pb)  # type: ignore[arg-type]


def _place(direct: np.ndarray, slots: np.ndarray, pb: int, off: int, src: np.ndarray) -> None:
    """Write ``src``, the batch payload's bytes from ``off``, into the rows of ``direct``
    (``[num_slots, pb]``) that the batch's pages ``slots`` (in payload order) name."""
    p0, r0 = divmod(off, pb)
    n = src.size
    if r0 == 0 and n % pb == 0:  # whole pages: the sender's framing
        k = n // pb
        s = slots[p0 : p0 + k]
        rows = src.reshape(k, pb)
        first = int(s[0])
        if k == 1 or (int(s[-1]) - first == k - 1 and bool((np.diff(s) == 1).all())):
            direct[first : first + k] = rows
        else:
            direct[s] = rows
        return
    i = 0  # part of one page (pages > FRAME_BYTES), or any other framing a peer chose
    while i < n:
        p, r = divmod(off + i, pb)
        take = min(pb - r, n - i)
        direct[int(slots[p]), r : r + take] = src[i : i + take]
        i += take
