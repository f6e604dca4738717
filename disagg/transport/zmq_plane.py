"""ZMQ implementation of the DataPlane (the fallback when UCX is not available).

Wire: each data message is one multipart zmq message ``[PageBatch header, payload...]``
on a PUSH -> PULL connection; the payload holds each run's ``count * page_bytes`` bytes
split into frames of at most FRAME_BYTES, and a frame never spans two runs, so a run
bound for a contiguous region is received with ``recv_into`` straight into the page
slots. Other runs land in a scratch buffer and are scattered with one ``index_copy_``
per region per message. A transfer ends with a ``TransferDone`` message.

Threads: one receiver thread owns the PULL socket; one sender thread owns all PUSH
sockets (cached per endpoint). Sender sockets use IMMEDIATE so a dead or absent peer
shows up as "cannot send" and the push fails at its deadline.
"""

from __future__ import annotations

import logging
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
from .receiver import BookedReceiver, ReceiverBook, Rx

log = logging.getLogger(__name__)

MSG_BYTES = 8 << 20  # payload per zmq message: bounds what libzmq buffers per message
_HWM = 64  # messages queued per socket (each <= MSG_BYTES)
_POLL_MS = 20


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
                now = time.monotonic()
                if now - last_sweep > 0.05:  # poll() also checks its own deadline
                    last_sweep = now
                    with self._book.lock:
                        self._book.sweep(now)
        finally:
            sock.close(linger=0)
            with self._book.lock:
                self._book.fail_all("data plane closed")

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
            self._drain(sock)

    def _receive(self, sock: zmq.Socket, rx: Rx, h: m.PageBatch) -> str | None:
        grp = self._book.groups[h.group]
        pb = h.page_bytes
        total = sum(c for _, c in h.runs)
        scatter_idx: list[np.ndarray] = []
        scratch_mv = None
        if grp.direct is None:
            if self._scratch.numel() < total * pb:
                pin = torch.cuda.is_available()  # pinned host memory copies to a GPU faster
                self._scratch = torch.empty(total * pb, dtype=torch.uint8, pin_memory=pin)
            scratch_mv = memoryview(self._scratch.numpy())  # type: ignore[arg-type]
        soff = 0
        more = sock.get(zmq.RCVMORE)
        for start, count in h.runs:
            nbytes = count * pb
            if grp.direct is not None:
                buf = memoryview(grp.direct[start : start + count].reshape(-1))  # type: ignore[arg-type]
            else:
                assert scratch_mv is not None
                buf = scratch_mv[soff : soff + nbytes]
                soff += nbytes
                scatter_idx.append(np.arange(start, start + count))
            off = 0
            while off < nbytes:
                if not more:
                    return f"batch for group {h.group} ended {nbytes - off} bytes short"
                n = sock.recv_into(buf[off:])
                more = sock.get(zmq.RCVMORE)
                if n > nbytes - off:
                    return f"a payload frame of {n} bytes overruns its run"
                if rx.hasher is not None:
                    rx.hasher.update(buf[off : off + n])
                off += n
        if more:
            return "batch has more payload frames than its runs"
        if scatter_idx:
            src = self._scratch[: total * pb].view(total, pb)
            grp.scatter(np.concatenate(scatter_idx), src)
        self._book.landed(rx, h.group, total, total * pb)
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
    """Split one group's pages into messages: coalesce rows whose destination slots (and
    source rows) are adjacent into runs, vectorised; loop only over runs and frames."""
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
    brk = np.flatnonzero((np.diff(dst) != 1) | (np.diff(idx) != 1)) + 1
    starts = np.concatenate(([0], brk))
    counts = np.diff(np.concatenate((starts, [idx.size])))
    src_rows, dst_starts = idx[starts], dst[starts]

    per_msg = max(1, MSG_BYTES // pb)  # pages per message
    flat = arr.reshape(-1)
    msgs: list[tuple[bytes, list[memoryview]]] = []
    runs: list[tuple[int, int]] = []
    frames: list[memoryview] = []
    in_msg = 0

    def flush() -> None:
        nonlocal runs, frames, in_msg
        header = m.PageBatch(
            transfer_id=transfer_id,
            lease_id=lease_id,
            token=token,
            group=group,
            runs=runs,
            page_bytes=pb,
        )
        msgs.append((m.encode(header), frames))
        runs, frames, in_msg = [], [], 0

    for src, dst0, cnt in zip(src_rows.tolist(), dst_starts.tolist(), counts.tolist(), strict=True):
        while cnt:
            take = min(cnt, per_msg - in_msg)
            mv = memoryview(flat[src * pb : (src + take) * pb])  # type: ignore[arg-type]
            frames.extend(mv[o : o + FRAME_BYTES] for o in range(0, len(mv), FRAME_BYTES))
            runs.append((dst0, take))
            in_msg += take
            src, dst0, cnt = src + take, dst0 + take, cnt - take
            if in_msg >= per_msg:
                flush()
    if runs:
        flush()
    return msgs, int(idx.size), arr
