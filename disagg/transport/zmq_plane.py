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

Threads: one receiver thread owns the PULL socket; one sender thread per peer owns its
PUSH socket. Sender sockets use IMMEDIATE so a dead or absent peer shows up as "cannot
send" and the push fails at its deadline.
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

import numpy as np
import torch
import xxhash
import zmq

from ..protocol import messages as m
from ..protocol.errors import ProtocolError
from .dataplane import FRAME_BYTES, DataPlane, PageSource, TransferState, TransferStatus
from .receiver import BookedReceiver, ReceiverBook, Rx, runs_slots

log = logging.getLogger(__name__)

MSG_BYTES = 8 << 20  # payload per zmq message: bounds what libzmq buffers per message
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


@dataclass
class PushHandle:
    """Sender-side handle returned by ``post_push``."""

    transfer_id: int
    endpoint: str
    deadline: float
    plan: list[tuple[bytes, list[memoryview]]]  # (header, payload frames) per message
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
    ``checksum``: hash payloads with xxh3-64 and verify at the receiver."""

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        advertise: str | None = None,
        context: zmq.Context | None = None,
        checksum: bool = True,
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
        pages: Sequence[PageSource],
        deadline_s: float = 30.0,
    ) -> PushHandle:
        plan: list[tuple[bytes, list[memoryview]]] = []
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
            for header, frames in h.plan:
                if not self._wait_writable(sock, h):
                    self._tx_drop_socket(lane)
                    return
                if hasher is not None:
                    for f in frames:
                        hasher.update(f)
                sock.send(header, zmq.SNDMORE)
                for i, f in enumerate(frames):
                    sock.send(f, zmq.SNDMORE if i + 1 < len(frames) else 0, copy=False)
                    h.nbytes += len(f)
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


def _plan_group(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    rows: torch.Tensor,
    dst_slots: Sequence[int],
) -> tuple[list[tuple[bytes, list[memoryview]]], int, np.ndarray]:
    """Split one group's pages into messages of at most MSG_BYTES: each names its pages'
    destination runs (consecutive slots coalesced) and carries them, in that order, as
    page-aligned frames over the contiguous spans of source rows. Vectorised; loops only
    over runs, spans and frames."""
    slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[0] != slots.shape[0]:
        raise ValueError(
            f"group {group}: rows must be uint8 [len(dst_slots)={slots.shape[0]}, page_bytes], "
            f"got {rows.dtype} {tuple(rows.shape)}"
        )
    if (slots < -1).any():
        raise ValueError(f"group {group}: destination slots must be >= -1")
    if rows.device.type != "cpu":
        rows = rows.cpu()  # the zmq path moves host memory only
    arr = rows.contiguous().numpy()
    pb = int(arr.shape[1])
    if pb < 1:
        raise ValueError(f"group {group}: page_bytes must be >= 1")
    idx = np.flatnonzero(slots >= 0)
    if idx.size == 0:
        return [], 0, arr
    dst = slots[idx]
    per_msg = max(1, MSG_BYTES // pb)  # pages per message
    # whole pages per frame, or one page in several frames when pages exceed FRAME_BYTES
    step = (FRAME_BYTES // pb) * pb or FRAME_BYTES
    flat = arr.reshape(-1)
    msgs: list[tuple[bytes, list[memoryview]]] = []
    # destination runs: where the slots stop being consecutive
    dst_brk = np.flatnonzero(np.diff(dst) != 1) + 1
    # contiguous source spans: where the chosen rows stop being consecutive (-1 gaps)
    src_brk = np.flatnonzero(np.diff(idx) != 1) + 1
    for m0 in range(0, int(idx.size), per_msg):
        m1 = min(m0 + per_msg, int(idx.size))
        cuts = dst_brk[(dst_brk > m0) & (dst_brk < m1)]
        starts = np.concatenate(([m0], cuts))
        counts = np.diff(np.concatenate((starts, [m1])))
        runs = list(zip(dst[starts].tolist(), counts.tolist(), strict=True))
        frames: list[memoryview] = []
        edges = np.concatenate(([m0], src_brk[(src_brk > m0) & (src_brk < m1)], [m1]))
        for a, b in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
            lo = int(idx[a]) * pb
            mv = memoryview(flat[lo : lo + (b - a) * pb])  # type: ignore[arg-type]
            if pb > FRAME_BYTES:  # never let a frame span two pages
                frames.extend(
                    mv[p + o : p + min(o + FRAME_BYTES, pb)]
                    for p in range(0, len(mv), pb)
                    for o in range(0, pb, FRAME_BYTES)
                )
            else:
                frames.extend(mv[o : o + step] for o in range(0, len(mv), step))
        header = m.PageBatch(
            transfer_id=transfer_id,
            lease_id=lease_id,
            token=token,
            group=group,
            runs=runs,
            page_bytes=pb,
        )
        msgs.append((m.encode(header), frames))
    return msgs, int(idx.size), arr


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
