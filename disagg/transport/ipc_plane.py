"""Same-host data plane (``transport: ipc``): the receiver copies pages straight out of
the sender's store.

Why: a push over a socket moves each page at least three times (gather, wire, scatter);
between processes of one host the receiver can map the sender's store instead and move
each page once, source row to destination slot, with ``page_copy.copy_indexed`` (one
Triton kernel on a GPU, torch's index kernels on the host). On an H200, 1 GiB of scattered
64 KiB pages moves between two processes at 0.61-0.75 of the device-to-device copy rate
with 4-8 pushes in flight, 0.22 for one push alone (its Python control path, ~1.1 ms,
outweighs the 0.62 ms copy); UCX's cuda_ipc path reached 0.02-0.13 (``disagg bench gpu``).

How:
- The sender registers its store once (``register_source``): a device store is shared
  through CUDA IPC (torch's storage share), a host store is moved into a /dev/shm file
  (pinned again if it was pinned). Each push describes its pages as rows of an export
  (``protocol.ipc.IpcBatch``) and carries the export descriptions; the receiver opens an
  export once and keeps it.
- The receiver checks everything before it copies a byte: the transfer's token and lease,
  the ReceiverBook's slot checks and promises, that every source row lies inside the
  export, that the export is from this host (boot id) and, for CUDA, that its GPU is
  visible here. Then it copies and answers ``IpcAck`` once the copy is over: host copies
  at once, device copies from the landing thread when their CUDA event fires (so the
  receiver thread checks the next push while the GPU copies). The sender's push is DONE
  only on that answer, so the sender never reuses rows a copy may still read.
- Zombie reads: a push carries the sender's deadline on CLOCK_MONOTONIC (one clock per
  host). The sender keeps its rows until the push is final, and fails it no earlier than
  that deadline; the receiver starts no copy after it, and a copy it sees end after it
  fails the transfer instead of landing (the rows may have been reused meanwhile).
- Limits: one host only (a peer on another host is refused with a message naming the
  fix). A CUDA export is only as alive as the sender process: CUDA leaves reads of a dead
  exporter's memory undefined; the receiver checks the sender's pid before each device
  copy, which narrows but cannot close that window. (A /dev/shm export stays readable:
  the mapping outlives the sender.)

Control messages travel on ZMQ: the receiver binds a ROUTER at ``endpoint`` (its thread
owns the socket; the landing thread hands it acks through a pipe); the sender keeps one
DEALER per receiver, on one thread that also collects the acks.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import mmap
import os
import queue
import re
import threading
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import zmq

from ..protocol import ipc as wire
from ..protocol import messages as m
from ..protocol.errors import ProtocolError
from .dataplane import DataPlane, RowsSource, StoreRows, TransferState, TransferStatus
from .page_copy import copy_indexed
from .receiver import BookedReceiver, Group, ReceiverBook, Rx

log = logging.getLogger(__name__)

_POLL_MS = 20
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^disagg-ipc-(\d+)-(\d+)$")
MAX_OPEN_EXPORTS = 256
# A push describes up to a few million pages (16 bytes each per layer batch): more than a
# control frame, still bounded.
MAX_IPC_FRAME = 64 << 20  # receiver-side cache of mapped exports
IDLE_SOCKET_S = 30.0
# The receiver refuses to *start* a copy this close to the sender's deadline: the copy
# must end before the sender (and then the producer, after its grace) reuses the rows.
COPY_MARGIN_S = 0.25

_ids = itertools.count(1)
# Exports of this process, by id: a receiver in the same process uses the tensor itself
# (CUDA cannot open an IPC handle in the process that made it).
_local: dict[int, torch.Tensor] = {}  # registered sources, until their plane closes
_local_auto: OrderedDict[int, torch.Tensor] = OrderedDict()  # shared on the spot
MAX_LOCAL_EXPORTS = 64  # shared-on-the-spot device tensors remembered for local readers


def host_id() -> str:
    """This host's boot id: equal for every process (and container) on one kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename


HOST = host_id()


def _uuid(device: int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass
class _Source:
    export: wire.Export
    tensor: torch.Tensor  # uint8, 1-D, the whole export
    path: str | None = None  # shm file to unlink on close
    keep: Any = None  # the mmap


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
    unsent: bytes | None = None  # the encoded push until the socket took it
    ended: threading.Event = field(default_factory=threading.Event)

    def finish(self, state: TransferState, error: str | None = None) -> None:
        self.state, self.error, self.keep = state, error, []
        self.ended.set()

    def status(self) -> TransferStatus:
        n = self.nbytes if self.state is TransferState.DONE else 0
        return TransferStatus(self.state, self.error, self.pages, n)


@dataclass
class _Peer:
    sock: zmq.Socket
    inflight: dict[int, PushHandle] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)


class IpcDataPlane(BookedReceiver, DataPlane):
    """Both DataPlane sides for processes on one host (see the module docstring).
    ``bind``: the ROUTER endpoint (``tcp://127.0.0.1:0`` or ``ipc://path``)."""

    accepts_store_rows = True  # producers hand StoreRows: no gather before a push

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        advertise: str | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self.stats: Counter[str] = Counter()
        self._book = ReceiverBook(self.stats)
        self._stop = threading.Event()
        self._sources: list[_Source] = []
        self._mapped: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_IPC_FRAME)
        self._router.bind(bind)
        self._endpoint = advertise or self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._jobs: queue.Queue[PushHandle] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._rx_thread = threading.Thread(target=self._rx_run, name="disagg-ipc-rx", daemon=True)
        self._tx_thread = threading.Thread(target=self._tx_run, name="disagg-ipc-tx", daemon=True)
        # device copies land on their own thread, so the receiver checks the next push
        # while the GPU copies this one; acks come back to the receiver through a pipe
        self._landings: queue.Queue[_Landing] = queue.Queue()
        self._acks: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self._ack_r, self._ack_w = os.pipe()
        for fd in (self._ack_r, self._ack_w):
            os.set_blocking(fd, False)
        self._land_thread = threading.Thread(
            target=self._land_run, name="disagg-ipc-land", daemon=True
        )
        self._rx_thread.start()
        self._tx_thread.start()
        self._land_thread.start()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def health(self) -> tuple[bool, str]:
        if self._stop.is_set():
            return False, "data plane closed"
        if not self._rx_thread.is_alive():
            return False, "ipc data plane receiver thread died"
        if not self._tx_thread.is_alive():
            return False, "ipc data plane sender thread died"
        if not self._land_thread.is_alive():
            return False, "ipc data plane landing thread died"
        return True, ""

    # ================================ sources ===========================================
    def register_source(self, tensor: torch.Tensor) -> torch.Tensor:
        """Make ``tensor`` (a store slab) readable by receivers on this host; returns the
        tensor to use from now on. A device tensor is shared as it is (CUDA IPC); a host
        tensor is copied into a new /dev/shm file (and pinned if it was), and the copy is
        returned: keep using the returned tensor. Call once per slab, at start-up."""
        if tensor.device.type == "cuda":
            export = self._cuda_export(tensor)
            _local[export.export_id] = flat = _flat(tensor)
            self._sources.append(_Source(export, flat))
            return tensor
        if tensor.device.type != "cpu":
            raise ValueError(f"ipc plane cannot share {tensor.device.type} memory")
        src = self._shm_source(tensor.nbytes)
        out = src.tensor.view(tensor.shape) if tensor.dim() else src.tensor
        if tensor.dim() and tensor.is_contiguous():
            out.copy_(tensor)
        else:
            raise ValueError("register_source needs a contiguous tensor")
        if tensor.is_pinned() and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(out.data_ptr(), max(1, out.nbytes), 0)
            if rc != 0:
                log.warning("cudaHostRegister of the shared store failed (%s): unpinned", rc)
        self._sources.append(src)
        return out

    def _shm_source(self, nbytes: int) -> _Source:
        _sweep_stale_shm()
        eid = next(_ids)
        name = f"disagg-ipc-{os.getpid()}-{eid}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(1, nbytes))
            mm = mmap.mmap(fd, max(1, nbytes))
        finally:
            os.close(fd)
        t = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
        export = wire.Export(
            export_id=eid, kind="shm", host=HOST, pid=os.getpid(), nbytes=nbytes, name=name
        )
        _local[eid] = t
        return _Source(export, t, path, mm)

    def _cuda_export(self, tensor: torch.Tensor) -> wire.Export:
        storage = tensor.untyped_storage()
        dev, handle, size, offset, ref_h, ref_off, ev_h, ev_sync = storage._share_cuda_()
        eid = next(_ids)
        return wire.Export(
            export_id=eid,
            kind="cuda",
            host=HOST,
            pid=os.getpid(),
            nbytes=int(size),
            device_uuid=_uuid(int(dev)),
            handle=bytes(handle),
            offset=int(offset),
            ref_handle=bytes(ref_h),
            ref_offset=int(ref_off),
            event_handle=bytes(ev_h or b""),
            event_sync=bool(ev_sync),
        )

    def _locate(self, t: torch.Tensor) -> tuple[wire.Export, int]:
        """The export holding ``t``'s first byte and that byte's offset in it. A device
        tensor outside every registered source is shared on the spot (its storage)."""
        ptr = t.data_ptr()
        for src in self._sources:
            base = src.tensor.data_ptr()
            if base <= ptr < base + src.export.nbytes and src.tensor.device == t.device:
                return src.export, ptr - base
        if t.device.type == "cuda":
            export = self._cuda_export(t)
            _local_auto[export.export_id] = _flat(t)
            while len(_local_auto) > MAX_LOCAL_EXPORTS:
                _local_auto.popitem(last=False)
            return export, ptr - t.untyped_storage().data_ptr()
        raise ValueError(
            "the ipc plane sends host memory only from a registered source: pass the store "
            "slab through register_source() first"
        )

    # ================================= sender ===========================================
    def post_push(  # type: ignore[override]
        self,
        endpoint: str,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        pages: Sequence[RowsSource],
        deadline_s: float = 30.0,
    ) -> PushHandle:
        """Announce ``pages`` to the receiver at ``endpoint``; it copies them itself.
        Called from the producer's push pool (any thread); returns at once (the sender
        thread sends). Each source is ``StoreRows`` of a registered slab, or a 2-D uint8
        tensor inside one (a device tensor outside every source is shared on the spot);
        host memory outside a registered source raises ValueError, as do malformed
        shapes and slots < -1. The rows must not change until ``poll_push`` is final:
        DONE means the receiver's copy is over; FAILED (refusal, deadline, closed) means
        no copy will start any more (the receiver starts none after ``deadline_s``)."""
        batches, exports, keep = [], {}, []
        count = nbytes = 0
        for group, src, dst_slots in pages:
            dst = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
            if group < 0:
                raise ValueError(f"layer group must be >= 0, got {group}")
            if dst.size and int(dst.min()) < -1:
                raise ValueError(f"destination slots must be >= -1, got {int(dst.min())}")
            sr = src if isinstance(src, StoreRows) else _rows_of(src)
            if len(sr.rows) != dst.size:
                raise ValueError(f"{len(sr.rows)} source rows for {dst.size} destination slots")
            rows = np.asarray(sr.rows, dtype=np.int64).reshape(-1)
            if int(dst.min(initial=0)) < 0:  # drop -1 slots (rarely any: skip the copy)
                rows, dst = rows[dst >= 0], dst[dst >= 0]
            if not dst.size:
                continue
            export, base = self._locate(sr.slab)
            exports[export.export_id] = export
            keep.append(sr.slab)
            batches.append(
                wire.IpcBatch(
                    group=group,
                    export_id=export.export_id,
                    base=base,
                    row_stride=max(1, sr.slab.stride(0)),
                    rows=rows.astype("<i8").tobytes(),
                    slots=dst.astype("<i8").tobytes(),
                    spans=[(int(o), int(n)) for o, n in sr.cols],
                    page_bytes=sr.page_bytes,
                )
            )
            count += rows.size
            nbytes += rows.size * sr.page_bytes
        deadline = time.monotonic() + deadline_s
        msg = wire.IpcPush(
            transfer_id=transfer_id,
            lease_id=lease_id,
            token=bytes(token),
            exports=list(exports.values()),
            batches=batches,
            not_after=deadline,
        )
        h = PushHandle(transfer_id, endpoint, deadline, msg, keep, count, nbytes)
        self._submit(h)
        return h

    def poll_push(self, handle: PushHandle) -> TransferStatus:
        return handle.status()

    def wait_push(self, handle: PushHandle, timeout_s: float) -> TransferStatus:
        """Woken by the ack the moment it arrives (no sleep-poll latency)."""
        handle.ended.wait(timeout_s)
        return handle.status()

    def post_failure(self, endpoint: str, transfer_id: int, token: bytes, why: str) -> None:
        """Tell a receiver that a transfer it expects will not come (best effort)."""
        msg = wire.IpcFail(transfer_id=transfer_id, token=bytes(token), message=why[:60000])
        self._submit(PushHandle(transfer_id, endpoint, time.monotonic() + 1.0, msg, []))

    def _submit(self, h: PushHandle) -> None:
        self._jobs.put(h)
        _poke(self._wake_w)  # wake the sender thread out of its poll

    def _tx_run(self) -> None:
        peers: dict[str, _Peer] = {}
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._tx_take_jobs(peers, poller)
                for sock, _ in poller.poll(_POLL_MS):
                    if sock == self._wake_r:
                        _drain_pipe(self._wake_r)
                    else:
                        self._tx_read_acks(sock, peers)
                self._tx_expire(peers, poller)
        finally:
            for peer in peers.values():
                for h in peer.inflight.values():
                    self._tx_fail(h, "data plane closed")
                peer.sock.close(linger=0)
            while not self._jobs.empty():
                self._tx_fail(self._jobs.get_nowait(), "data plane closed")

    def _tx_take_jobs(self, peers: dict[str, _Peer], poller: zmq.Poller) -> None:
        while True:
            try:
                h = self._jobs.get_nowait()
            except queue.Empty:
                return
            try:
                peer = peers.get(h.endpoint)
                if peer is None:
                    sock = self._ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for an absent peer
                    try:
                        sock.connect(h.endpoint)
                    except zmq.ZMQError:
                        sock.close(linger=0)
                        raise
                    peer = peers[h.endpoint] = _Peer(sock)
                    poller.register(sock, zmq.POLLIN)
                peer.last_used = time.monotonic()
                if isinstance(h.msg, wire.IpcFail):
                    peer.sock.send(wire.encode(h.msg), zmq.NOBLOCK)
                    continue
                h.state = TransferState.RECEIVING
                peer.inflight[h.transfer_id] = h
                h.unsent = wire.encode(h.msg)
                self._tx_try_send(peer, h)
            except zmq.ZMQError as e:  # e.g. a hostile endpoint string: fail this push only
                self._tx_fail(h, f"send to {h.endpoint} failed: {e}")

    def _tx_try_send(self, peer: _Peer, h: PushHandle) -> None:
        if h.unsent is None:
            return
        try:
            peer.sock.send(h.unsent, zmq.NOBLOCK)
            h.unsent = None
        except zmq.Again:  # not connected yet: retried until the deadline
            pass

    def _tx_read_acks(self, sock: zmq.Socket, peers: dict[str, _Peer]) -> None:
        peer = next((p for p in peers.values() if p.sock is sock), None)
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ack = wire.decode(frame)
            except ProtocolError as e:
                self.stats["rejected_" + e.code.name] += 1
                continue
            if not isinstance(ack, wire.IpcAck) or peer is None:
                self.stats["rejected_kind"] += 1
                continue
            h = peer.inflight.pop(ack.transfer_id, None)
            if h is None:
                self.stats["rejected_unknown"] += 1
                continue
            if ack.ok:
                h.finish(TransferState.DONE)
                self.stats["push_done"] += 1
            else:
                self._tx_fail(h, f"receiver refused the transfer: {ack.message}")

    def _tx_expire(self, peers: dict[str, _Peer], poller: zmq.Poller) -> None:
        now = time.monotonic()
        for ep, peer in list(peers.items()):
            for tid, h in list(peer.inflight.items()):
                if now > h.deadline:
                    del peer.inflight[tid]
                    self._tx_fail(h, f"peer {ep} did not answer before the deadline")
                else:
                    self._tx_try_send(peer, h)
            if not peer.inflight and now - peer.last_used > IDLE_SOCKET_S:
                poller.unregister(peer.sock)
                peer.sock.close(linger=0)
                del peers[ep]

    def _tx_fail(self, h: PushHandle, why: str) -> None:
        if not h.state.final:
            h.finish(TransferState.FAILED, why)
            self.stats["push_failed"] += 1

    # ================================ receiver ==========================================
    def _rx_run(self) -> None:
        sock = self._router
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._ack_r, zmq.POLLIN)
        last_sweep = 0.0
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if self._ack_r in ready:
                    _drain_pipe(self._ack_r)
                while not self._acks.empty():  # answers of finished device copies
                    sock.send_multipart(list(self._acks.get_nowait()))
                if sock in ready:
                    try:
                        self._rx_message(sock)
                    except Exception:  # never let one message kill the receiver
                        log.exception("ipc data plane receiver error")
                        self.stats["internal_error"] += 1
                last_sweep = self._sweep_if_due(last_sweep)
        finally:
            sock.close(linger=0)
            self._fail_all_closed()

    def _rx_message(self, sock: zmq.Socket) -> None:
        parts = sock.recv_multipart()
        if len(parts) != 2:
            self.stats["rejected_BAD_FRAME"] += 1
            return
        ident, frame = parts
        try:
            msg = wire.decode(frame, MAX_IPC_FRAME)
        except ProtocolError as e:
            self.stats["rejected_" + e.code.name] += 1
            return
        if isinstance(msg, wire.IpcFail):
            self._rx_fail(msg)
        elif isinstance(msg, wire.IpcPush):
            error = self._rx_push(msg, ident)
            if error is not QUEUED:
                ack = wire.IpcAck(
                    transfer_id=msg.transfer_id, ok=error is None, message=error or ""
                )
                sock.send_multipart([ident, wire.encode(ack)])
        else:
            self.stats["rejected_kind"] += 1

    def _rx_fail(self, msg: wire.IpcFail) -> None:
        book = self._book
        with book.lock:
            rx = book.rx.get(msg.transfer_id)
            if rx is None or not _same(rx.token, msg.token):
                self.stats["rejected_unknown"] += 1
                return
            book.fail(rx, f"sender failed the transfer: {msg.message}")
            book.cond.notify_all()

    def _rx_push(self, msg: wire.IpcPush, ident: bytes) -> str | None:
        """Check one push and copy it: returns None (done) or why it was refused, or
        QUEUED when device copies are under way (the landing thread acks it)."""
        book = self._book
        with book.lock:
            rx = book.rx.get(msg.transfer_id)
            if rx is None or not _same(rx.token, msg.token) or rx.lease_id != msg.lease_id:
                self.stats["rejected_unknown"] += 1
                return f"transfer {msg.transfer_id} is not expected here (or token/lease differ)"
            if rx.state.final:
                self.stats["rejected_late"] += 1
                return f"transfer {msg.transfer_id} is already {rx.state.value}"
            try:
                plans = self._plan(rx, msg)
                if time.monotonic() > msg.not_after - COPY_MARGIN_S:
                    raise _Refused("push arrived after the sender's deadline")
            except _Refused as e:
                self.stats["rejected_batch"] += 1
                book.fail(rx, str(e))
                book.cond.notify_all()
                return str(e)
            rx.inflight += 1  # abort() waits for this; poll/expect stay free meanwhile
        landing = _Landing(rx, ident, msg.not_after)
        try:
            devices: set[torch.device] = set()
            for plan in plans:
                if rx.state.final:  # aborted (or expired) between batches
                    break
                devices |= _copy(plan)
                b = plan.batch
                landing.batches.append((b.group, int(plan.slots.size), b.page_bytes))
            for d in devices:  # device copies are queued: they land when these fire
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(d))
                landing.events.append(ev)
        except Exception as exc:  # a CUDA error, a mapping gone: the transfer fails
            log.exception("ipc copy of transfer %d failed", rx.transfer_id)
            landing.error = f"copy failed: {type(exc).__name__}: {exc}"
        if landing.events and landing.error is None:
            self._landings.put(landing)  # the landing thread finishes and acks it
            return QUEUED
        return self._land(landing)

    def _land(self, landing: _Landing) -> str | None:
        """Finish a push whose copies are over (or failed); returns the ack's error."""
        book, rx = self._book, landing.rx
        if landing.error is None and time.monotonic() > landing.not_after:
            # The sender gave up at not_after and may have reused its rows since: a copy
            # seen to end later may hold them half rewritten, so it never counts.
            landing.error = "the copy ended after the sender's deadline (its rows may be reused)"
        with book.lock:
            rx.inflight -= 1
            if landing.error is not None:
                book.fail(rx, landing.error)
            elif not rx.state.final:
                for group, pages, page_bytes in landing.batches:
                    book.landed(rx, group, pages, pages * page_bytes)
                done = m.TransferDone(
                    transfer_id=rx.transfer_id, lease_id=rx.lease_id, token=rx.token
                )
                book.on_done(rx, done)
            book.cond.notify_all()
            if rx.state is not TransferState.DONE:
                return rx.error or "transfer did not complete"
            return None

    def _land_run(self) -> None:
        """Landing thread: waits for queued device copies in order, then finishes their
        transfers and hands the acks to the receiver thread (which owns the socket)."""
        while not (self._stop.is_set() and self._landings.empty()):
            try:
                landing = self._landings.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            try:
                for ev in landing.events:
                    ev.synchronize()  # releases the GIL while the GPU copies
            except Exception as exc:
                landing.error = f"copy failed: {type(exc).__name__}: {exc}"
            error = self._land(landing)
            ack = wire.IpcAck(
                transfer_id=landing.rx.transfer_id, ok=error is None, message=error or ""
            )
            self._acks.put((landing.ident, wire.encode(ack)))
            _poke(self._ack_w)

    def _plan(self, rx: Rx, msg: wire.IpcPush) -> list[_Plan]:
        """Validate every batch (and open its export) before any byte moves."""
        exports = {e.export_id: e for e in msg.exports}
        plans = []
        for batch in msg.batches:
            export = exports.get(batch.export_id)
            if export is None:
                raise _Refused(
                    f"batch for group {batch.group} names export {batch.export_id}, which the push does not describe"
                )
            if sum(n for _, n in batch.spans) != batch.page_bytes:
                raise _Refused(
                    f"batch for group {batch.group}: spans add up to {sum(n for _, n in batch.spans)} bytes, pages are {batch.page_bytes}"
                )
            rows = _int64s(batch.rows, "rows", batch.group)
            slots = _int64s(batch.slots, "slots", batch.group)
            if rows.size != slots.size:
                raise _Refused(
                    f"batch for group {batch.group}: {rows.size} source rows for {slots.size} slots"
                )
            if int(rows.min()) < 0:
                raise _Refused(
                    f"batch for group {batch.group}: negative source row {int(rows.min())}"
                )
            n_rows = int(rows.max()) + 1  # the source view covers rows [0, n_rows)
            end = max(c + n for c, n in batch.spans)
            last = batch.base + (n_rows - 1) * batch.row_stride + end
            if last > export.nbytes:
                raise _Refused(
                    f"batch for group {batch.group} reads up to byte {last} of export "
                    f"{export.export_id}, which has {export.nbytes}"
                )
            why = self._book.accept_slots(rx, batch.group, batch.page_bytes, slots)
            if why is not None:
                raise _Refused(why)
            src = self._open(export)
            plans.append(_Plan(self._book.groups[batch.group], batch, slots, rows, n_rows, src))
        return plans

    def _open(self, e: wire.Export) -> torch.Tensor:
        """The export as a uint8 1-D tensor of ``e.nbytes`` (opened once, then cached)."""
        if e.host != HOST:
            raise _Refused(
                f"export {e.export_id} is from another host ({e.host}); the ipc transport needs producer and consumer on one host (use zmq or ucx across hosts)"
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
        if e.kind == "cuda" and e.pid != os.getpid() and not _alive(e.pid):
            raise _Refused(f"the sender process {e.pid} of export {e.export_id} is gone")
        return t

    def _map(self, e: wire.Export) -> torch.Tensor:
        if e.pid == os.getpid():  # CUDA cannot open its own handle: use the tensor
            local = _local.get(e.export_id)
            if local is None:
                local = _local_auto.get(e.export_id)
            if local is not None:
                return local
        if e.kind == "shm":
            if not _SHM_NAME.match(e.name):
                raise _Refused(f"export {e.export_id} names {e.name!r}, not a disagg shm file")
            try:
                fd = os.open(os.path.join(SHM_DIR, e.name), os.O_RDONLY)
            except OSError as exc:
                raise _Refused(f"cannot open shared memory {e.name}: {exc}") from None
            try:
                size = os.fstat(fd).st_size
                if size < e.nbytes:
                    raise _Refused(
                        f"shared memory {e.name} holds {size} bytes, export says {e.nbytes}"
                    )
                mm = mmap.mmap(fd, max(1, e.nbytes), prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            with warnings.catch_warnings():  # read-only buffer: we never write it
                warnings.simplefilter("ignore")
                return torch.frombuffer(mm, dtype=torch.uint8)[: e.nbytes]
        if not torch.cuda.is_available():
            raise _Refused(f"export {e.export_id} is CUDA memory, and this process has no GPU")
        dev = next((i for i in range(torch.cuda.device_count()) if _uuid(i) == e.device_uuid), None)
        if dev is None:
            raise _Refused(
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
            raise _Refused(f"cannot open CUDA IPC export {e.export_id}: {exc}") from None
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage)

    # ================================= common ===========================================
    def close(self) -> None:
        self._stop.set()
        for t in (self._land_thread, self._rx_thread, self._tx_thread):
            t.join(5.0)
        for fd in (self._wake_r, self._wake_w, self._ack_r, self._ack_w):
            try:
                os.close(fd)
            except OSError:
                pass
        for src in self._sources:
            _local.pop(src.export.export_id, None)
            if src.path is not None:
                try:
                    os.unlink(src.path)
                except OSError:
                    pass
        self._sources = []


@dataclass
class _Landing:
    """A push whose copies were started: finished (and acked) once they end."""

    rx: Rx
    ident: bytes
    not_after: float  # the sender's deadline: a copy must be seen over before it
    events: list[Any] = field(default_factory=list)  # torch.cuda.Event per device
    batches: list[tuple[int, int, int]] = field(default_factory=list)  # group, pages, bytes
    error: str | None = None


QUEUED = "queued"  # _rx_push: the landing thread answers


class _Refused(Exception):
    """A push that fails its checks: the transfer fails, the sender is told why."""


class _Plan(NamedTuple):
    """One checked batch, ready to copy."""

    grp: Group
    batch: wire.IpcBatch
    slots: np.ndarray
    rows: np.ndarray
    n_rows: int  # one past the highest source row (checked inside the export)
    src: torch.Tensor  # the export, uint8 1-D


def _copy(plan: _Plan) -> set[torch.device]:
    """Copy one batch: each piece where a source span meets a destination region is one
    ``copy_indexed`` over all pages of the batch. Host copies are done on return; device
    copies are queued on the current streams of the devices returned."""
    grp, b, slots, rows, n_rows, src = plan
    dev = grp.regions[0].tensor.device
    if dev.type == "cuda" and all(r.tensor.device == dev for r in grp.regions):
        # Both index arrays in one host-to-device copy, from pinned memory: a copy from
        # pageable memory would block this thread until the GPU finished the copies
        # queued before it, so the next push could not be checked meanwhile. (torch's
        # pinned allocator keeps the buffer until the copy has run.)
        staged = torch.empty(slots.size + rows.size, dtype=torch.int64, pin_memory=True)
        np.concatenate((slots, rows), out=staged.numpy())
        both = staged.to(dev, non_blocking=True)
        dst_idx, src_idx = both[: slots.size], both[slots.size :]
    else:
        dst_idx, src_idx = torch.from_numpy(slots.copy()), torch.from_numpy(rows.copy())
    devices = set()
    for src_col, region, dst_col, length in _pieces(b.spans, [r.size for r in grp.regions]):
        view = src.as_strided(
            (n_rows, length), (b.row_stride, 1), src.storage_offset() + b.base + src_col
        )
        t = grp.regions[region].tensor
        copy_indexed(t[:, dst_col : dst_col + length], dst_idx, view, src_idx)
        if t.device.type == "cuda":
            devices.add(t.device)
    return devices


def _pieces(
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


def _int64s(blob: bytes, what: str, group: int) -> np.ndarray:
    if len(blob) % 8:
        raise _Refused(f"batch for group {group}: {what} blob of {len(blob)} bytes is not int64s")
    # read-only view of the message: staged into pinned memory (device) or copied (host)
    return np.frombuffer(blob, dtype="<i8")


def _rows_of(t: torch.Tensor) -> StoreRows:
    """A plain ``[n, page_bytes]`` source as StoreRows of itself."""
    if t.dim() != 2 or t.dtype != torch.uint8:
        raise ValueError(f"source rows must be a 2-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError("source rows must be contiguous (stride(1) == 1)")
    return StoreRows(t, np.arange(t.shape[0], dtype=np.int64), ((0, int(t.shape[1])),))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as uint8 1-D."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(s)


def _same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"x")
    except OSError:  # the pipe is full (the reader is awake anyway) or closed
        pass


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:  # empty (EAGAIN) or closed
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale_shm() -> None:
    """Remove shm files of disagg processes that died without closing their plane."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        match = _SHM_NAME.match(name)
        if match and not _alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
