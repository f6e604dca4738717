"""The ipc plane's receiving side: check a push against the shared rules, copy it out
of the sender's export, answer once the copy is over.

Threads: the receiver thread accepts framed connections (at most ``MAX_CONNS``; a frame
over ``MAX_IPC_FRAME``, a bad preamble or a sender that reads no acks closes that
connection, counted), reads every push and checks it before a byte moves; the landing
thread waits for device copies and writes their acks itself.

Checks, with numpy or one C pass over whole index arrays (``ReceiverBook.accept_rows``,
the shared rules): the transfer's token and lease, the slots (bounds, promises, each
once, page counts), that every source row lies inside the export, that the export is
from this host (boot id) and, for CUDA, that its GPU is visible here, its sender alive,
and, when the slots are on another GPU, that peer access to it can be enabled (the copy
kernel runs on the slots' GPU and reads the store over NVLink/PCIe). A push that fails a
check fails the transfer and is answered with the reason.

Copies (``staging``): host copies are over on return and answered at once; device
copies are queued on the receiver thread's stream, and the landing thread lands the
transfer and answers when their completion event fired, so the receiver thread checks
the next push meanwhile. ``IpcAck(ok)`` goes only after the copy ended, also after an
error: the sender reuses its rows once answered.

Deadlines: a push carries the sender's deadline on CLOCK_MONOTONIC (``not_after``). The
receiver starts no copy within ``COPY_MARGIN_S`` of it, and a copy seen to end after it
fails the transfer instead of landing (the rows may have been reused meanwhile). Pushes
in parts follow ``parts``' rules. ``abort`` fails the transfer and waits (bounded) for
copies under way (``Rx.inflight``).
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import queue
import selectors
import threading
import time
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ...protocol import ipc as wire
from ...protocol import messages as m
from ...protocol.errors import ProtocolError
from .. import cuda_driver, framed, spin
from ..dataplane import TransferState
from ..receiver import BookedReceiver, ReceiverBook, Rx
from . import host
from .staging import Plan, Prepared, Staging, copy_batch, device_of, indices, use_device

log = logging.getLogger(__name__)

POLL_MS = 20
MAX_OPEN_EXPORTS = 256  # mapped exports kept open
# A push describes up to a few million pages (16 bytes each per layer batch): more than a
# control frame, still bounded.
MAX_IPC_FRAME = 64 << 20
MAX_CONNS = 1024  # connections beyond this are closed at once (counted)
MAX_PENDING_ACK_BYTES = 16 << 20  # acks queued for a sender that reads none
# The receiver refuses to *start* a copy this close to the sender's deadline: the copy
# must end before the sender (and then the producer, after its grace) reuses the rows.
COPY_MARGIN_S = 0.25
_RW = selectors.EVENT_READ | selectors.EVENT_WRITE
_WAKE = object()  # selector tag of the receiver's wake-up pipe


@dataclass
class Landing:
    """A push (or part) whose copies were started: finished (and acked) once they end.
    With ``rx`` None: a refused part, whose refusal is sent once the copies queued
    before it ended."""

    rx: Rx | None
    conn: framed.Conn  # where the ack goes
    not_after: float  # the sender's deadline: a copy must be seen over before it
    transfer_id: int
    error: str | None = None
    last: bool = True  # the whole push, or its last part: finishes the transfer
    parts: int = 0  # parts whose copies it holds (each counted in ``rx.inflight``)
    devices: set[Any] = field(default_factory=set)  # where its copies were queued
    events: list[Any] = field(default_factory=list)  # torch.cuda.Event per device
    batches: list[tuple[int, int, int]] = field(default_factory=list)  # group, pages, bytes


QUEUED = "queued"  # _rx_push: the landing thread answers


class Refused(Exception):
    """A push that fails its checks: the transfer fails, the sender is told why."""


class IpcReceiver(BookedReceiver):
    """The receiver half of ``IpcDataPlane`` (mixed in; ``_rx_start`` in ``__init__``)."""

    stats: Counter[str]
    _stop: threading.Event
    _spin_ns: int

    def _rx_start(self, bind: str) -> str:
        """Listen at ``bind``, start the receiver and landing threads; returns the bound
        endpoint."""
        self._book = ReceiverBook(self.stats)
        self._mapped: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()
        self._prepared: Prepared = OrderedDict()
        self._staging: dict[torch.device, Staging] = {}  # the receiver thread's
        # pushes in parts whose device copies wait for a later part (the receiver thread's)
        self._parted: dict[int, Landing] = {}
        self._listener, bound = framed.listen(bind)
        self._unix_path = bound[len("ipc://") :] if bound.startswith("ipc://") else None
        # the landing thread writes acks itself; it pokes the receiver thread only when a
        # connection's buffer is full (the receiver then flushes it when writable)
        self._ack_r, self._ack_w = host.wake_pipe()
        self._blocked: queue.Queue[framed.Conn] = queue.Queue()
        self._rx_scratch = bytearray(framed.RECV_CHUNK)  # the receiver thread's
        self._rx_thread = threading.Thread(target=self._rx_run, name="disagg-ipc-rx", daemon=True)
        # device copies land on their own thread, so the receiver checks the next push
        # while the GPU copies this one
        self._landings: queue.Queue[Landing] = queue.Queue()
        self._land_thread = threading.Thread(
            target=self._land_run, name="disagg-ipc-land", daemon=True
        )
        self._rx_thread.start()
        self._land_thread.start()
        return bound

    def _rx_run(self) -> None:
        """Receiver thread: accepts connections, reads pushes and checks them, starts
        their copies; flushes acks the landing thread could not write at once."""
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        sel.register(self._ack_r, selectors.EVENT_READ, _WAKE)
        conns: set[framed.Conn] = set()
        last_sweep = 0.0
        busy = False  # the last wait found work: spin before blocking again
        try:
            while not self._stop.is_set():
                ready = busy and spin.wait_readable(sel.fileno(), self._spin_ns)
                found = sel.select(0 if ready else POLL_MS / 1000)
                busy = bool(found)
                for key, events in found:
                    conn = key.data
                    if conn is None:
                        self._rx_accept(sel, conns)
                    elif conn is _WAKE:
                        host.drain(self._ack_r)
                        self._rx_blocked(sel, conns)
                    else:
                        try:
                            keep = self._rx_ready(conn, events, sel)
                        except Exception:  # never let one message kill the receiver
                            log.exception("ipc data plane receiver error")
                            self.stats["internal_error"] += 1
                            keep = True
                        if not keep or conn.closed:
                            self._rx_close(conn, sel, conns)
                swept = self._sweep_if_due(last_sweep)
                if swept != last_sweep and self._parted:
                    self._sweep_open()
                last_sweep = swept
        finally:
            for tid in list(self._parted):
                self._close_open(tid, "data plane closed")
            for conn in conns:
                conn.close()
            self._listener.close()
            sel.close()
            self._fail_all_closed()

    def _rx_accept(self, sel: selectors.BaseSelector, conns: set[framed.Conn]) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors: counted, the listener stays
                self.stats["rejected_connection"] += 1
                return
            if len(conns) >= MAX_CONNS:
                self.stats["rejected_connection"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = framed.Conn(sock, greet=False, max_frame=MAX_IPC_FRAME)
            conns.add(conn)
            sel.register(conn, selectors.EVENT_READ, conn)

    def _rx_blocked(self, sel: selectors.BaseSelector, conns: set[framed.Conn]) -> None:
        """Connections whose acks wait for room: watch them for writability."""
        while True:
            try:
                conn = self._blocked.get_nowait()
            except queue.Empty:
                return
            if conn not in conns or conn.closed:
                continue
            if len(conn.out) > MAX_PENDING_ACK_BYTES:
                self.stats["rejected_slow_reader"] += 1  # a sender that reads no acks
                self._rx_close(conn, sel, conns)
            else:
                sel.modify(conn, _RW, conn)

    def _rx_close(
        self, conn: framed.Conn, sel: selectors.BaseSelector, conns: set[framed.Conn]
    ) -> None:
        if conn in conns:
            conns.discard(conn)
            sel.unregister(conn)  # before the close: its descriptor may be reused at once
        conn.close()

    def _rx_ready(self, conn: framed.Conn, events: int, sel: selectors.BaseSelector) -> bool:
        """Serve one connection's events; False: close it (peer gone, framing broken)."""
        if events & selectors.EVENT_WRITE and not conn.flush() and not conn.closed:
            sel.modify(conn, selectors.EVENT_READ, conn)
        if not events & selectors.EVENT_READ:
            return True
        try:
            frames = conn.read_frames(self._rx_scratch)
        except framed.FrameError as e:
            self.stats["rejected_" + e.code] += 1
            return False
        if frames is None:
            return False
        for frame in frames:
            self._rx_message(conn, frame)
        return True

    def _rx_message(self, conn: framed.Conn, frame: bytes) -> None:
        try:
            msg = wire.decode(frame, MAX_IPC_FRAME)
        except ProtocolError as e:
            self.stats["rejected_" + e.code.name] += 1
            return
        if isinstance(msg, wire.IpcFail):
            self._rx_fail(msg)
        elif isinstance(msg, wire.IpcPush):
            error = self._rx_push(msg, conn)
            if error is QUEUED or (error is None and not msg.last):
                return  # answered by the landing thread, or a part that went well
            if error is not None and (msg.part > 0 or msg.transfer_id in self._parted):
                # copies of earlier parts may still read the sender's rows: the refusal
                # goes out behind them (the sender reuses its rows once it is answered)
                if not self._close_open(msg.transfer_id, error):
                    self._landings.put(Landing(None, conn, msg.not_after, msg.transfer_id, error))
                return
            ack = wire.IpcAck(transfer_id=msg.transfer_id, ok=error is None, message=error or "")
            self._ack(conn, wire.encode(ack))
        else:
            self.stats["rejected_kind"] += 1

    def _ack(self, conn: framed.Conn, frame: bytes) -> None:
        """Send an ack from any thread; a full connection is flushed by the receiver
        thread once writable. (A sender that never reads its acks fills its buffer up to
        MAX_PENDING_ACK_BYTES, then its connection is closed.)"""
        if conn.send(frame):
            self._blocked.put(conn)
            host.poke(self._ack_w)

    def _rx_fail(self, msg: wire.IpcFail) -> None:
        book = self._book
        with book.lock:
            rx = book.rx.get(msg.transfer_id)
            if rx is None or not hmac.compare_digest(rx.token, msg.token):
                self.stats["rejected_unknown"] += 1
                return
            book.fail(rx, f"sender failed the transfer: {msg.message}")
            book.cond.notify_all()

    def _rx_push(self, msg: wire.IpcPush, conn: framed.Conn) -> str | None:
        """Check one push and copy it: returns None (done) or why it was refused, or
        QUEUED when device copies are under way (the landing thread acks it)."""
        book = self._book
        with book.lock:
            rx = book.rx.get(msg.transfer_id)
            if (
                rx is None
                or not hmac.compare_digest(rx.token, msg.token)
                or rx.lease_id != msg.lease_id
            ):
                self.stats["rejected_unknown"] += 1
                return f"transfer {msg.transfer_id} is not expected here (or token/lease differ)"
            if rx.state.final:
                self.stats["rejected_late"] += 1
                return f"transfer {msg.transfer_id} is already {rx.state.value}"
        # staging buffers taken before this push (earlier parts' uploads among them)
        marks = {d: len(ring.unsealed) for d, ring in self._staging.items()}
        try:  # outside the lock: staging may wait for a buffer (the book's checks take it)
            if msg.part != rx.next_part:
                raise Refused(
                    f"part {msg.part} of transfer {msg.transfer_id} arrived where part "
                    f"{rx.next_part} was due"
                )
            plans = self._plan(rx, msg)
            with book.lock:
                if time.monotonic() > msg.not_after - COPY_MARGIN_S:
                    raise Refused("push arrived after the sender's deadline")
                if rx.state.final:  # aborted (or expired) while it was checked
                    raise Refused(rx.error or f"transfer {rx.transfer_id} is {rx.state.value}")
                rx.inflight += 1  # abort() waits for this; poll/expect stay free meanwhile
                rx.next_part = msg.part + 1
        except Refused as e:
            for d, ring in self._staging.items():
                ring.drop_unsealed(marks.get(d, 0))  # this push uploaded nothing
            with book.lock:
                if not rx.state.final:
                    self.stats["rejected_batch"] += 1
                book.fail(rx, str(e))
                book.cond.notify_all()
            return str(e)
        # earlier parts' device copies, not waited for yet: this part joins them
        landing = self._parted.pop(rx.transfer_id, None)
        if landing is None:
            landing = Landing(rx, conn, msg.not_after, rx.transfer_id)
        landing.parts += 1
        landing.last = msg.last
        devices = landing.devices  # where copies were (or may have been) queued
        try:
            for plan in plans:
                if rx.state.final:  # aborted (or expired) between batches
                    break
                # before the copy: one that fails halfway may have queued some launches
                devices |= plan.grp.cuda_devices
                copy_batch(plan)
                b = plan.batch
                landing.batches.append((b.group, int(plan.slots.size), b.page_bytes))
        except Exception as exc:  # a CUDA error, a mapping gone: the transfer fails
            log.exception("ipc copy of transfer %d failed", rx.transfer_id)
            landing.error = f"copy failed: {type(exc).__name__}: {exc}"
        if not msg.last and landing.error is None and devices:
            # Device copies of a part are waited for with the last part's (one stream:
            # its event fires after all of them), so the landing thread does not wake
            # (and take the GIL) while this thread checks the next part.
            self._parted[rx.transfer_id] = landing
            return None
        return self._queue_landing(landing)

    def _queue_landing(self, landing: Landing) -> str | None:
        """Hand a landing whose copies were started to the landing thread (device copies:
        after their completion events), or finish it now (host copies are over)."""
        rx, devices = landing.rx, landing.devices
        assert rx is not None
        try:
            for d in devices:  # device copies are queued: they land when these fire
                ev = torch.cuda.Event()
                staging = self._staging.get(d)
                if staging is None:
                    ev.record(torch.cuda.current_stream(d))
                else:  # the stream its copies went to; its buffers are free once ev fired
                    ev.record(staging.stream)
                    staging.seal(ev)
                landing.events.append(ev)
        except Exception as exc:  # cannot tell when they end: fail, and ack only after
            log.exception("ipc copy of transfer %d: no completion event", rx.transfer_id)
            landing.error = landing.error or f"copy failed: {type(exc).__name__}: {exc}"
            for d in devices:
                torch.cuda.synchronize(d)
        # Also after an error, the ack waits until no queued copy reads the sender's rows
        # or writes the slots: both sides reuse them as soon as the transfer is final.
        if landing.events:
            self._landings.put(landing)  # the landing thread finishes and acks it
            return QUEUED
        return self._land(landing)

    def _close_open(self, transfer_id: int, why: str) -> bool:
        """Fail the earlier parts of a push in parts whose copies are under way: they are
        answered (with ``why``) once those copies ended. False: none are open."""
        landing = self._parted.pop(transfer_id, None)
        if landing is None:
            return False
        landing.error, landing.last = why, True
        error = self._queue_landing(landing)
        if error is not QUEUED:  # landed at once (no completion event): answer here
            ack = wire.IpcAck(transfer_id=transfer_id, ok=False, message=error or why)
            self._ack(landing.conn, wire.encode(ack))
        return True

    def _sweep_open(self) -> None:
        """Close pushes in parts whose last part will not come: the transfer ended (abort,
        expiry) or the sender's deadline passed (it died or gave up mid-push)."""
        now = time.monotonic()
        for tid, landing in list(self._parted.items()):
            rx = landing.rx
            assert rx is not None
            if rx.state.final or now > landing.not_after:
                why = rx.error or "the push's last part did not come before its deadline"
                self._close_open(tid, why)

    def _land(self, landing: Landing) -> str | None:
        """Finish a push (or part) whose copies are over (or failed); returns the ack's
        error. Only the last part finishes the transfer."""
        book, rx = self._book, landing.rx
        assert rx is not None
        if landing.error is None and time.monotonic() > landing.not_after:
            # The sender gave up at not_after and may have reused its rows since: a copy
            # seen to end later may hold them half rewritten, so it never counts.
            landing.error = "the copy ended after the sender's deadline (its rows may be reused)"
        with book.lock:
            rx.inflight -= landing.parts
            if landing.error is not None:
                book.fail(rx, landing.error)
            elif not rx.state.final:
                for group, pages, page_bytes in landing.batches:
                    book.landed(rx, group, pages, pages * page_bytes)
                if landing.last:
                    done = m.TransferDone(
                        transfer_id=rx.transfer_id, lease_id=rx.lease_id, token=rx.token
                    )
                    book.on_done(rx, done)
            book.cond.notify_all()
            if not landing.last and not rx.state.final:
                return None  # a part that landed: the last part answers
            if rx.state is not TransferState.DONE:
                return rx.error or "transfer did not complete"
            return None

    def _land_run(self) -> None:
        """Landing thread: waits for queued device copies in order, then finishes their
        transfers and writes their acks itself (no hop through the receiver thread)."""
        while not (self._stop.is_set() and self._landings.empty()):
            try:
                landing = self._landings.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                continue
            if landing.rx is None:  # a refused part, answered behind the copies before it
                ack = wire.IpcAck(
                    transfer_id=landing.transfer_id, ok=False, message=landing.error or ""
                )
                self._ack(landing.conn, wire.encode(ack))
                continue
            try:
                for ev in landing.events:
                    ev.synchronize()  # releases the GIL while the GPU copies
            except Exception as exc:
                landing.error = f"copy failed: {type(exc).__name__}: {exc}"
            error = self._land(landing)
            if error is None and not landing.last:
                continue  # a part that landed: the last part answers
            ack = wire.IpcAck(
                transfer_id=landing.transfer_id, ok=error is None, message=error or ""
            )
            self._ack(landing.conn, wire.encode(ack))

    def _plan(self, rx: Rx, msg: wire.IpcPush) -> list[Plan]:
        """Validate every batch (and open its export) before any byte moves. A batch for
        device slots has its index arrays copied into a pinned staging buffer by the
        same pass that checks them (``ReceiverBook.accept_rows``)."""
        exports = {e.export_id: e for e in msg.exports}
        groups = self._book.groups
        plans = []
        for batch in msg.batches:
            export = exports.get(batch.export_id)
            if export is None:
                raise Refused(
                    f"batch for group {batch.group} names export {batch.export_id}, which the push does not describe"
                )
            if sum(n for _, n in batch.spans) != batch.page_bytes:
                raise Refused(
                    f"batch for group {batch.group}: spans add up to {sum(n for _, n in batch.spans)} bytes, pages are {batch.page_bytes}"
                )
            width = batch.index_bytes
            for what, blob in (("rows", batch.rows), ("slots", batch.slots)):
                if len(blob) % width:
                    raise Refused(
                        f"batch for group {batch.group}: {what} blob of {len(blob)} bytes "
                        f"is not {width}-byte integers"
                    )
            n = len(batch.slots) // width
            if len(batch.rows) != len(batch.slots):
                raise Refused(
                    f"batch for group {batch.group}: {len(batch.rows) // width} source rows for {n} slots"
                )
            # row r is read up to byte base + r * row_stride + end of the export
            end = max(c + k for c, k in batch.spans)
            room = export.nbytes - batch.base - end
            row_limit = room // batch.row_stride + 1 if room >= 0 else 0
            src = self._open(export)
            grp = groups[batch.group] if batch.group < len(groups) else None
            dev = device_of(grp)
            staged = None
            out: Any = None
            rows_at = 0
            if dev is not None and src.is_cuda and src.device != dev:
                why = cuda_driver.enable_peer_access(dev.index or 0, src.device.index or 0)
                if why is not None:
                    raise Refused(
                        f"export {export.export_id} is on {src.device} and group {batch.group}'s page slots on {dev}, which cannot read it: {why}; put both roles on one GPU or use transport ucx or tcp"
                    )
            if dev is not None:  # the check copies the arrays into a pinned buffer
                use_device(dev)
                staging = self._staging.get(dev)
                if staging is None:
                    staging = self._staging[dev] = Staging(dev)
                staged = staging.take(n, width)
                out, rows_at = staging.views[staged.ring_at], staged.rows_at

            def beyond(row: int, b: wire.IpcBatch = batch, e: wire.Export = export) -> str:
                last = b.base + row * b.row_stride + max(c + k for c, k in b.spans)
                return (
                    f"batch for group {b.group} reads up to byte {last} of export "
                    f"{e.export_id}, which has {e.nbytes}"
                )

            with self._book.lock:
                why, high = self._book.accept_rows(
                    rx, batch.group, batch.page_bytes, batch.slots, batch.rows, width,
                    row_limit, beyond, out, rows_at,
                )  # fmt: skip
            if why is not None:
                raise Refused(why)
            assert grp is not None  # accepted: the group exists
            slots = indices(batch.slots, width)
            rows = indices(batch.rows, width)
            plans.append(Plan(grp, batch, slots, rows, high + 1, src, self._prepared, staged, dev))
        return plans

    def _open(self, e: wire.Export) -> torch.Tensor:
        """The export as a uint8 1-D tensor of ``e.nbytes`` (opened once, then cached)."""
        if e.host != host.HOST:
            raise Refused(
                f"export {e.export_id} is from another host ({e.host}); the ipc transport needs producer and consumer on one host (use tcp or ucx across hosts)"
            )
        key = (e.pid, e.kind, e.export_id if e.kind == "shm" else e.handle, e.offset)
        t = self._mapped.get(key)
        if t is None:
            t = self._map(e)
            self._mapped[key] = t
            while len(self._mapped) > MAX_OPEN_EXPORTS:
                self._mapped.popitem(last=False)
        else:
            self._mapped.move_to_end(key)
        if e.kind == "cuda" and e.pid != os.getpid() and not host.alive(e.pid):
            raise Refused(f"the sender process {e.pid} of export {e.export_id} is gone")
        return t

    def _map(self, e: wire.Export) -> torch.Tensor:
        if e.pid == os.getpid():  # CUDA cannot open its own handle: use the tensor
            local = host.local.get(e.export_id)
            if local is None:
                local = host.local_auto.get(e.export_id)
            if local is not None:
                return local
        if e.kind == "shm":
            if not host.SHM_NAME.match(e.name):
                raise Refused(f"export {e.export_id} names {e.name!r}, not a disagg shm file")
            try:
                fd = os.open(os.path.join(host.SHM_DIR, e.name), os.O_RDONLY)
            except OSError as exc:
                raise Refused(f"cannot open shared memory {e.name}: {exc}") from None
            try:
                size = os.fstat(fd).st_size
                if size < e.nbytes:
                    raise Refused(
                        f"shared memory {e.name} holds {size} bytes, export says {e.nbytes}"
                    )
                mm = mmap.mmap(fd, max(1, e.nbytes), prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            with warnings.catch_warnings():  # read-only buffer: we never write it
                warnings.simplefilter("ignore")
                return torch.frombuffer(mm, dtype=torch.uint8)[: e.nbytes]
        if not torch.cuda.is_available():
            raise Refused(f"export {e.export_id} is CUDA memory, and this process has no GPU")
        dev = next(
            (i for i in range(torch.cuda.device_count()) if host.uuid_of(i) == e.device_uuid), None
        )
        if dev is None:
            raise Refused(
                f"export {e.export_id} lives on GPU {e.device_uuid}, which this process cannot see (CUDA_VISIBLE_DEVICES)"
            )
        try:
            storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
                dev,
                e.handle,
                e.nbytes,
                e.offset,
                e.ref_handle,
                e.ref_offset,
                e.event_handle,
                e.event_sync,
            )
        except RuntimeError as exc:
            raise Refused(f"cannot open CUDA IPC export {e.export_id}: {exc}") from None
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage)
