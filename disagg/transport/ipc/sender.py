"""The ipc plane's sending side: announce pages as rows of an export; the receiver
copies them and answers.

``post_push`` (any thread) describes each batch as rows of an export (``host``) and
the destination slots, as raw little-endian index arrays (4 bytes each when every value
fits; ``wire_indices``), cut into parts where the receiver takes them (``parts``), and
sends it from the posting thread when the receiver's connection is up and idle
(``_send_now``); otherwise the sender thread sends it. The sender thread owns one
framed connection per receiver (``framed.Conn``): it connects (retrying a refused
connection until the pushes' deadlines), reads the acks (``IpcAck``) and fails pushes
at their deadline.

Contract: a push is DONE only on the receiver's ok ack, when its copy is over; until
then the push holds its source tensors and the rows must not change. FAILED (a refusal,
the deadline, close) means no copy will start any more: every push carries its
deadline on CLOCK_MONOTONIC (``not_after``; one clock per host) and the receiver starts
no copy after it. A push whose frames fully left before its connection dropped may
still be copied, so it is failed no sooner than its deadline; one that never left whole
is sent again on a new connection.

``wait_push`` wakes at the ack: the sender thread spins for ``spin_us`` after work
before it sleeps, and publishes finished pushes' flags only once it released the GIL
(``spin.wait_readable``), so a spinning waiter sees them at once.
"""

from __future__ import annotations

import queue
import selectors
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...native import load
from ...protocol import ipc as wire
from ...protocol import messages as m
from ...protocol.errors import ProtocolError
from .. import framed, spin
from ..dataplane import RowsSource, StoreRows, TransferState, TransferStatus
from . import host
from .parts import PARTS_MIN_PAGE_BYTES, cut, part_sizes

# one pass packs a push's index arrays (the shared receiver requires it under CI)
_slotcheck = load("disagg.transport._slotcheck", strict=False)

POLL_MS = 20
IDLE_SOCKET_S = 30.0  # a connection idle this long (nothing in flight) is closed
MAX_ACK_FRAME = 1 << 20  # an ack is a few hundred bytes
RETRY_S = 0.05  # pause between connection attempts to an absent receiver
_RW = selectors.EVENT_READ | selectors.EVENT_WRITE
_I32 = 1 << 31


@dataclass
class PushHandle:
    """Sender-side handle returned by ``post_push``."""

    transfer_id: int
    endpoint: str
    deadline: float
    msg: wire.IpcPush | wire.IpcFail
    keep: list[Any]  # source tensors: referenced until the receiver's ack
    pages: int = 0
    nbytes: int = 0
    state: TransferState = TransferState.PENDING
    error: str | None = None
    more: list[wire.IpcPush] = field(default_factory=list)  # parts after ``msg`` (if cut)
    frames: list[bytes] = field(default_factory=list)  # encoded by the posting thread
    first_end: int = 0  # where its first frame ends in its connection's stream
    ended: threading.Event = field(default_factory=threading.Event)
    # set after ``ended``: a waiter spins on it without the GIL (spin.wait_flag)
    flag: bytearray = field(default_factory=lambda: bytearray(1))

    def finish(
        self, state: TransferState, error: str | None = None, publish: list[bytearray] | None = None
    ) -> None:
        """Final state; wakes a waiter blocked on ``ended`` at once. The flag a spinning
        waiter watches is set here, or, given ``publish``, appended to it: the sender
        thread sets those flags once it has released the GIL (``spin.wait_readable``),
        so the waiter never wakes into a GIL that is still held."""
        self.state, self.error, self.keep = state, error, []
        self.ended.set()
        if publish is None:
            self.flag[0] = 1
        else:
            publish.append(self.flag)

    def status(self) -> TransferStatus:
        n = self.nbytes if self.state is TransferState.DONE else 0
        return TransferStatus(self.state, self.error, self.pages, n)

    def encode(self) -> None:
        self.frames = [wire.encode(self.msg), *(wire.encode(p) for p in self.more)]

    def send_on(self, conn: framed.Conn) -> bool:
        """Hand every frame to ``conn`` (in order); True while bytes wait for room."""
        pending = False
        for i, frame in enumerate(self.frames):
            pending = conn.send(frame)
            if i == 0:
                self.first_end = conn.queued
        self.frames = []
        return pending


@dataclass
class _Peer:
    """The sender's connection to one receiver (the sender thread's alone)."""

    endpoint: str
    conn: framed.Conn | None = None
    connected: bool = False
    waiting: deque[PushHandle] = field(default_factory=deque)  # not yet on a connection
    inflight: dict[int, PushHandle] = field(default_factory=dict)  # sent: awaiting acks
    last_used: float = field(default_factory=time.monotonic)
    retry_at: float = 0.0
    flush_wanted: bool = False  # a posting thread left bytes queued: watch for writability


class IpcSender:
    """The sender half of ``IpcDataPlane`` (mixed in; ``_tx_start`` in ``__init__``)."""

    stats: Counter[str]
    _stop: threading.Event
    _spin_ns: int

    def _tx_start(self, push_parts: tuple[int, ...] | None) -> None:
        # leading part sizes (pages) of a device push sent in parts (``parts``); ()
        # never; None: the default (first half, at most PARTS_FIRST_MAX)
        self._push_parts = push_parts
        self._parts_host = False  # tests: cut host pushes too
        self._parts_min_bytes = PARTS_MIN_PAGE_BYTES  # tests: 0 cuts pushes of small pages
        self._sources: list[host.Source] = []
        self._jobs: queue.Queue[PushHandle] = queue.Queue()
        # the sender thread's connections; posting threads send on an idle one themselves
        # (_send_now). The lock is held by whoever works on them, never across a wait.
        self._peers: dict[str, _Peer] = {}
        self._tx_lock = threading.Lock()
        self._publish: list[bytearray] = []  # flags of pushes it finished (the sender thread's)
        self._wake_r, self._wake_w = host.wake_pipe()
        self._tx_scratch = bytearray(framed.RECV_CHUNK)  # the sender thread's
        self._tx_thread = threading.Thread(target=self._tx_run, name="disagg-ipc-tx", daemon=True)
        self._tx_thread.start()

    def register_source(self, tensor: torch.Tensor) -> torch.Tensor:
        """Make ``tensor`` (a store slab) readable by receivers on this host; returns the
        tensor to use from now on. A device tensor is shared as it is (CUDA IPC); a host
        tensor is copied into a new /dev/shm file (and pinned if it was), and the copy is
        returned: keep using the returned tensor. Call once per slab, at start-up."""
        return host.register(self._sources, tensor)

    def post_push(  # type: ignore[override]
        self,
        endpoint: str,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        pages: Sequence[RowsSource],
        deadline_s: float = 30.0,
        caps: m.DataCaps | None = None,
    ) -> PushHandle:
        """Announce ``pages`` to the receiver at ``endpoint``; it copies them itself.
        Called from the producer's push pool (any thread); returns at once (the sender
        thread sends). Each source is ``StoreRows`` of a registered slab, or a 2-D uint8
        tensor inside one (a device tensor outside every source is shared on the spot);
        host memory outside a registered source raises ValueError, as do malformed
        shapes and slots < -1. The rows must not change until ``poll_push`` is final:
        DONE means the receiver's copy is over; FAILED (refusal, deadline, closed) means
        no copy will start any more (the receiver starts none after ``deadline_s``).
        ``caps``: the receiver's ``capabilities``; a push is cut into parts only where
        they say ``parts``."""
        specs: list[tuple[dict[str, Any], np.ndarray, np.ndarray]] = []
        exports, keep = {}, []
        count = nbytes = 0
        device_only = True  # every batch reads device memory (where parts pay off)
        small = False  # a batch of pages below PARTS_MIN_PAGE_BYTES
        for group, src, dst_slots in pages:
            if isinstance(dst_slots, list):  # a third faster than asarray for long lists
                dst = np.fromiter(dst_slots, dtype=np.int64, count=len(dst_slots))
            else:
                dst = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
            if group < 0:
                raise ValueError(f"layer group must be >= 0, got {group}")
            sr = src if isinstance(src, StoreRows) else rows_of(src)
            if len(sr.rows) != dst.size:
                raise ValueError(f"{len(sr.rows)} source rows for {dst.size} destination slots")
            rows, dst = wire_indices(np.asarray(sr.rows, dtype=np.int64).reshape(-1), dst)
            if not dst.size:
                continue
            export, base = host.locate(self._sources, sr.slab)
            exports[export.export_id] = export
            device_only = device_only and export.kind == "cuda"
            small = small or sr.page_bytes < self._parts_min_bytes
            keep.append(sr.slab)
            fields = {
                "group": group,
                "export_id": export.export_id,
                "base": base,
                "row_stride": max(1, sr.slab.stride(0)),
                "spans": [(int(o), int(n)) for o, n in sr.cols],
                "page_bytes": sr.page_bytes,
                "index_bytes": 4 if rows.itemsize == 4 else 8,
            }
            specs.append((fields, rows, dst))
            count += rows.size
            nbytes += rows.size * sr.page_bytes
        deadline = time.monotonic() + deadline_s
        leading: tuple[int, ...] | None = ()  # () never cuts; None: the default (part_sizes)
        if (device_only or self._parts_host) and not small:
            leading = self._push_parts
        peer = self._peers.get(endpoint)  # read without the lock: a hint only
        if caps is None or not caps.parts or (peer is not None and (peer.inflight or peer.waiting)):
            # a receiver that takes no parts; or one busy with earlier pushes, whose
            # copies this push's checks overlap anyway (parts would only add work)
            leading = ()
        pieces = cut([rows.size for _, rows, _ in specs], part_sizes(count, leading))
        msgs = [
            wire.IpcPush(
                transfer_id=transfer_id,
                lease_id=lease_id,
                token=bytes(token),
                exports=list(exports.values()),
                batches=[
                    wire.IpcBatch(
                        **specs[b][0],
                        # the arrays' own buffers: msgspec encodes them without tobytes()
                        rows=memoryview(specs[b][1][lo:hi]).cast("B"),  # type: ignore[arg-type]
                        slots=memoryview(specs[b][2][lo:hi]).cast("B"),  # type: ignore[arg-type]
                    )
                    for b, lo, hi in piece
                ],
                not_after=deadline,
                part=k,
                last=k == len(pieces) - 1,
            )
            for k, piece in enumerate(pieces)
        ]
        self.stats["push_parts_sent"] += len(msgs) - 1
        h = PushHandle(transfer_id, endpoint, deadline, msgs[0], keep, count, nbytes, more=msgs[1:])
        self._submit(h)
        return h

    def poll_push(self, handle: PushHandle) -> TransferStatus:
        return handle.status()

    def wait_push(self, handle: PushHandle, timeout_s: float) -> TransferStatus:
        """Woken by the ack the moment it arrives (no sleep-poll latency); spins first for
        up to the plane's spin window (a push that ends within it is seen at once)."""
        if self._spin_ns and timeout_s > 0:
            spin.wait_flag(handle.flag, min(self._spin_ns, int(timeout_s * 1e9)))
            if handle.ended.is_set():
                return handle.status()
        handle.ended.wait(timeout_s)
        return handle.status()

    def post_failure(self, endpoint: str, transfer_id: int, token: bytes, why: str) -> None:
        """Tell a receiver that a transfer it expects will not come (best effort)."""
        msg = wire.IpcFail(transfer_id=transfer_id, token=bytes(token), message=why[:60000])
        self._submit(PushHandle(transfer_id, endpoint, time.monotonic() + 1.0, msg, []))

    def _submit(self, h: PushHandle) -> None:
        # encoded on the posting thread: the sender thread only sends
        if isinstance(h.msg, wire.IpcPush) and h.more:
            # the first part leaves before the rest are encoded: the receiver starts on it
            h.frames = [wire.encode(h.msg)]
            conn = self._send_now(h)
            rest = [wire.encode(p) for p in h.more]
            if conn is not None:
                self._send_rest(h, conn, rest)
                return
            h.frames += rest  # the first part's frame is already there
        else:
            h.encode()
            if isinstance(h.msg, wire.IpcPush) and self._send_now(h) is not None:
                return
        self._jobs.put(h)
        host.poke(self._wake_w)  # wake the sender thread out of its select

    def _send_rest(self, h: PushHandle, conn: framed.Conn, frames: list[bytes]) -> None:
        """The parts after the first, on the connection the first left on. If that
        connection dropped meanwhile they are not sent: the push was either sent again
        whole (its first part had not left) or waits for its deadline (see _tx_drop)."""
        with self._tx_lock:
            peer = self._peers.get(h.endpoint)
            if peer is None or peer.conn is not conn or conn.closed or h.state.final:
                return
            pending = False
            for frame in frames:
                pending = conn.send(frame)
            if pending:
                peer.flush_wanted = True
        if pending:  # the sender thread watches for room and writes the rest
            host.poke(self._wake_w)

    def _send_now(self, h: PushHandle) -> framed.Conn | None:
        """Send a push from the posting thread when its receiver's connection is up and
        nothing waits ahead of it (the common case): returns that connection; None:
        queue it for the sender thread. Saves the sender thread's wake-up and GIL
        hand-off (60 us of a 64 KiB x 16384 push on the H200's VM). The sender thread
        still reads the ack."""
        with self._tx_lock:
            peer = self._peers.get(h.endpoint)
            conn = peer.conn if peer is not None else None
            if (
                peer is None
                or conn is None
                or conn.closed
                or not peer.connected
                or peer.waiting
                or not self._jobs.empty()  # frames posted earlier go first
                or self._stop.is_set()
            ):
                return None
            peer.last_used = time.monotonic()
            h.state = TransferState.RECEIVING
            peer.inflight[h.transfer_id] = h  # before the send: the ack may come at once
            pending = h.send_on(conn)
            self.stats["push_sent_direct"] += 1
            if pending:
                peer.flush_wanted = True
        if pending:  # the sender thread watches for room and writes the rest
            host.poke(self._wake_w)
        return conn

    def _tx_run(self) -> None:
        """Sender thread: owns every connection to receivers; sends queued pushes, reads
        acks, fails pushes at their deadline, retries connections refused so far."""
        peers, publish = self._peers, self._publish
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        busy = False  # the last wait found work: spin before blocking again
        try:
            while not self._stop.is_set():
                with self._tx_lock:
                    self._tx_take_jobs(peers, sel)
                window = self._spin_ns if busy else 0
                ready = (window or publish) and spin.wait_readable(sel.fileno(), window, publish)
                publish.clear()
                found = sel.select(0 if ready else POLL_MS / 1000)
                busy = bool(found)
                with self._tx_lock:
                    for key, events in found:
                        peer = key.data
                        if peer is None:
                            host.drain(self._wake_r)
                        elif not peer.connected:
                            self._tx_connected(peer, sel)
                        else:
                            if events & selectors.EVENT_WRITE and peer.conn is not None:
                                self._tx_watch(peer, sel, peer.conn.flush())
                            if events & selectors.EVENT_READ:
                                self._tx_read_acks(peer, sel)
                    self._tx_expire(peers, sel)
        finally:
            with self._tx_lock:  # _send_now sends nothing after _stop: none is missed here
                for peer in peers.values():
                    for h in [*peer.inflight.values(), *peer.waiting]:
                        self._tx_fail(h, "data plane closed")
                    if peer.conn is not None:
                        peer.conn.close()
                while not self._jobs.empty():
                    self._tx_fail(self._jobs.get_nowait(), "data plane closed")
            for flag in publish:
                flag[0] = 1
            sel.close()

    def _tx_take_jobs(self, peers: dict[str, _Peer], sel: selectors.BaseSelector) -> None:
        for p in peers.values():
            if p.flush_wanted:  # a posting thread's frame did not fit the socket
                p.flush_wanted = False
                self._tx_watch(p, sel, True)
        touched = set()
        while True:
            try:
                h = self._jobs.get_nowait()
            except queue.Empty:
                break
            peer = peers.get(h.endpoint)
            if peer is None:
                peer = peers[h.endpoint] = _Peer(h.endpoint)
            peer.last_used = time.monotonic()
            if isinstance(h.msg, wire.IpcPush):
                h.state = TransferState.RECEIVING
            peer.waiting.append(h)
            touched.add(h.endpoint)
        for ep in touched:
            self._tx_pump(peers[ep], sel)

    def _tx_pump(self, peer: _Peer, sel: selectors.BaseSelector) -> None:
        """Connect if needed, then hand waiting frames to the connection in order."""
        if peer.conn is None:
            if time.monotonic() < peer.retry_at:
                return
            try:
                sock, now_up = framed.connect(peer.endpoint)
            except ValueError as e:  # a hostile or mistyped endpoint: fail its pushes
                for h in peer.waiting:
                    self._tx_fail(h, f"send to {peer.endpoint} failed: {e}")
                peer.waiting.clear()
                return
            except OSError:  # nobody listening (yet): retried until the deadlines
                peer.retry_at = time.monotonic() + RETRY_S
                return
            peer.conn = framed.Conn(sock, greet=True, max_frame=MAX_ACK_FRAME)
            peer.connected = now_up
            sel.register(peer.conn, selectors.EVENT_WRITE if not now_up else _RW, peer)
        if not peer.connected:
            return
        conn = peer.conn
        while peer.waiting:
            h = peer.waiting.popleft()
            pending = h.send_on(conn)
            if isinstance(h.msg, wire.IpcPush):
                peer.inflight[h.transfer_id] = h
            self._tx_watch(peer, sel, pending)

    def _tx_watch(self, peer: _Peer, sel: selectors.BaseSelector, pending: bool) -> None:
        """Watch the connection for acks, and for room to write while bytes wait."""
        if peer.conn is not None and not peer.conn.closed:
            want = _RW if pending else selectors.EVENT_READ
            if sel.get_key(peer.conn).events != want:
                sel.modify(peer.conn, want, peer)

    def _tx_connected(self, peer: _Peer, sel: selectors.BaseSelector) -> None:
        assert peer.conn is not None
        try:
            framed.finish_connect(peer.conn.sock)
        except OSError:
            self._tx_drop(peer, sel)
            return
        peer.connected = True
        sel.modify(peer.conn, _RW, peer)  # the preamble may still wait to be written
        self._tx_pump(peer, sel)
        self._tx_watch(peer, sel, peer.conn.flush())

    def _tx_drop(self, peer: _Peer, sel: selectors.BaseSelector) -> None:
        """The connection failed or the receiver closed it. Pushes whose frames fully left
        this process may still be copied by the receiver: they keep their rows until
        their deadline (never failed sooner), also a push in parts of which only the
        first parts left; the rest never arrived whole and cannot be copied: they are
        sent again on a new connection."""
        conn = peer.conn
        if conn is None:
            return
        sel.unregister(conn)
        conn.close()
        for tid, h in list(peer.inflight.items()):
            if h.first_end > conn.accepted:
                del peer.inflight[tid]
                h.encode()
                peer.waiting.appendleft(h)
        peer.conn, peer.connected = None, False
        peer.retry_at = time.monotonic() + RETRY_S

    def _tx_read_acks(self, peer: _Peer, sel: selectors.BaseSelector) -> None:
        assert peer.conn is not None
        try:
            frames = peer.conn.read_frames(self._tx_scratch)
        except framed.FrameError as e:
            self.stats["rejected_" + e.code] += 1
            frames = None
        if frames is None:
            self._tx_drop(peer, sel)
            return
        for frame in frames:
            try:
                ack = wire.decode(frame)
            except ProtocolError as e:
                self.stats["rejected_" + e.code.name] += 1
                continue
            if not isinstance(ack, wire.IpcAck):
                self.stats["rejected_kind"] += 1
                continue
            h = peer.inflight.pop(ack.transfer_id, None)
            if h is None:
                self.stats["rejected_unknown"] += 1
                continue
            if ack.ok:
                h.finish(TransferState.DONE, publish=self._publish)
                self.stats["push_done"] += 1
            else:
                self._tx_fail(h, f"receiver refused the transfer: {ack.message}")

    def _tx_expire(self, peers: dict[str, _Peer], sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        for ep, peer in list(peers.items()):
            for tid, h in list(peer.inflight.items()):
                if now > h.deadline:
                    del peer.inflight[tid]
                    self._tx_fail(h, f"peer {ep} did not answer before the deadline")
            if any(now > h.deadline for h in peer.waiting):
                for h in peer.waiting:
                    if now > h.deadline:
                        self._tx_fail(h, f"peer {ep} did not answer before the deadline")
                peer.waiting = deque(h for h in peer.waiting if not h.state.final)
            if peer.waiting:
                self._tx_pump(peer, sel)  # a connection refused so far: try again
            elif not peer.inflight and now - peer.last_used > IDLE_SOCKET_S:
                if peer.conn is not None:
                    sel.unregister(peer.conn)
                    peer.conn.close()
                del peers[ep]

    def _tx_fail(self, h: PushHandle, why: str) -> None:
        if not h.state.final:
            h.finish(TransferState.FAILED, why, self._publish)
            if isinstance(h.msg, wire.IpcPush):
                self.stats["push_failed"] += 1


def wire_indices(rows: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A batch's source rows and destination slots as they travel: new little-endian
    arrays (the message is encoded again after a reconnect: the caller's arrays may have
    changed by then), 4 bytes each whenever every value fits (half the bytes to send,
    decode and stage), 8 otherwise; -1 slots and their rows dropped (nothing to copy).
    Raises ValueError for a slot below -1. One C pass where ``_slotcheck`` is built."""
    fast = (
        _slotcheck is not None
        and rows.dtype == np.int64
        and dst.dtype == np.int64
        and rows.flags.c_contiguous
        and dst.flags.c_contiguous
    )
    if fast:
        r32, s32 = np.empty(rows.size, "<i4"), np.empty(dst.size, "<i4")
        narrow, low = _slotcheck.pack_pair(rows, dst, r32, s32)
    else:
        low, narrow = int(dst.min(initial=0)), None
    if low < -1:
        raise ValueError(f"destination slots must be >= -1, got {low}")
    if low < 0:  # drop -1 slots (rarely any: skip the copy)
        keep = dst >= 0
        return wire_indices(rows[keep], dst[keep])
    if narrow is None:
        narrow = (
            int(rows.max(initial=0)) < _I32
            and int(rows.min(initial=0)) >= -_I32
            and int(dst.max(initial=0)) < _I32
        )
    elif narrow:
        return r32, s32
    dt = "<i4" if narrow else "<i8"
    return rows.astype(dt), dst.astype(dt)


def _indices(blob: bytes, width: int) -> np.ndarray:
    """The batch's ``width``-byte little-endian index array (a read-only view of the
    message, length already checked; copied for a host copy)."""
    return np.frombuffer(blob, dtype=f"<i{width}")


def rows_of(t: torch.Tensor) -> StoreRows:
    """A plain ``[n, page_bytes]`` source as StoreRows of itself."""
    if t.dim() != 2 or t.dtype != torch.uint8:
        raise ValueError(f"source rows must be a 2-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError("source rows must be contiguous (stride(1) == 1)")
    return StoreRows(t, np.arange(t.shape[0], dtype=np.int64), ((0, int(t.shape[1])),))
