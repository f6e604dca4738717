"""One-sided reads on a consumer: RMA batch headers checked, the producer's store rows
read straight into the slots (``ucp_get_nbx`` through native_rma.py, or a plain copy from
a mapped store: mapped.py), and the batch acknowledged.

Contract (``RmaReader``, the progress thread unless said otherwise):

- ``on_header``: parse (wire.py; another version is counted as ``rejected_rma_version``
  and logged, nothing else), authenticate (transfer, lease, token), and check the WHOLE
  batch before a single read is posted: the book's slot checks (bounds, promised slots,
  each once) and the source description (``_check``: rows inside the slab, columns inside
  a row and adding up to the page size, a host group, a worker-address endpoint). A
  refused batch fails its transfer and is acknowledged with the reason.
- Reading: connect back to the producer (cached; no error handling, like every shm
  endpoint), unpack its rkey (cached per endpoint and key), and build the read list with
  numpy (``native_rma.op_lists``: consecutive rows into consecutive slots merged). The
  batch's readers claim ``_RMA_SLICE`` bytes of it at a time from one atomic cursor, in
  the C loop, GIL released: this thread (at most ``_RMA_TURN`` bytes per loop turn, after
  it has handed out every arrived header) and ``readers - 1`` reader lanes (``ReadLane``,
  each a thread with its own worker, endpoint and key; UCX workers are single-threaded).
  A batch under ``_RMA_SPLIT_MIN`` bytes per reader stays on this thread.
- A batch lands (its pages count) only once every reader of it finished and every read
  completed with UCS_OK; then the producer is acknowledged under ``wire.ack_tag``, with
  an error text when it failed. A failed read fails the transfer. A batch whose transfer
  ended (failed, expired, aborted) while reads were under way is reaped without holding
  up later batches of other transfers; ``abort`` waits for the reads under way
  (``rx.inflight`` is released only after every reader finished).
- What is exposed: the consumer holds the rkey of the producer's whole store slab,
  read-only, as long as the producer keeps it mapped (NIXL's trust model, and the ipc
  plane's). Nothing of the consumer is registered: it writes only its own checked slots.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from ucxx._lib.arr import Array

from ..receiver import Group, ReceiverBook
from . import cma_guard, native_rma, wire
from .link import Link, ucx_api, worker_address_ep
from .mapped import MappedRangeError, MappedStores
from .receive import UcxRx
from .wire import RmaHeader

log = logging.getLogger(__name__)

_RMA_RKEYS = 64  # unpacked remote keys kept
_RMA_ROUNDS = 64  # worker progress calls per loop turn while reads are in flight
# readers claim about _RMA_SLICE bytes of reads at a time; a merged read longer than
# _RMA_MAX_READ is cut (so one long run is shared too); this thread posts at most
# _RMA_TURN bytes per loop turn; a batch smaller than _RMA_SPLIT_MIN per reader is read
# by this thread alone (waking a lane costs more than it saves)
_RMA_SLICE = 256 << 10
_RMA_MAX_READ = 2 << 20
_RMA_TURN = 16 << 20
_RMA_SPLIT_MIN = 256 << 10
_IDLE_WAIT_S = 0.05


@dataclass(eq=False)
class RmaRead:
    """An accepted batch whose reads are in flight: it lands (and the producer is told,
    under ``ack_tag`` on ``ep``) once every reader that took part (``left`` of them still
    reading) found nothing left to claim and its own reads completed. ``shared``: the
    read list and its cursor; ``mine``: this thread's share (None once finished).
    ``left``, ``error`` (the first failure) and ``posted`` change under the reader's lock."""

    rx: UcxRx
    group: int
    pages: int
    nbytes: int
    ack_tag: int
    ep: Any
    endpoint: str
    packed: bytes  # the producer's packed key: lanes unpack it on their own endpoints
    shared: native_rma.RmaShared
    left: int
    mine: native_rma.RmaPull | None = None
    error: str | None = None
    posted: int = 0


def pull_error(endpoint: str, pull: native_rma.RmaPull) -> str | None:
    """The failure of a reader's finished share, or None when all of it landed; a failed
    cma copy (the producer died or unmapped its store) is named (cma_guard.py)."""
    if pull.ok:
        return None
    why = f"RMA read from {endpoint} failed: {native_rma.status_text(pull.status)}"
    return why + cma_guard.note()


class RmaReader:
    """The consumer's one-sided reads (module docstring)."""

    def __init__(
        self,
        link: Link,
        book: ReceiverBook,
        stats: Counter[str],
        mapped: MappedStores,
        readers: int,
    ) -> None:
        self.link, self.book, self.stats, self.mapped = link, book, stats, mapped
        self.readers = readers
        self.ctx: Any = None  # the UCX context (set when the plane opens): lanes' workers
        self.reads: list[RmaRead] = []
        # unpacked remote keys by (producer endpoint, packed key); acknowledgement sends
        self._rkeys: dict[tuple[str, bytes], tuple[Any, int]] = {}
        self._acks: list[tuple[Any, np.ndarray]] = []
        self._lock = threading.Lock()  # each read's left, error, posted
        self._lanes: list[ReadLane] | None = None if readers > 1 else []

    @property
    def busy(self) -> bool:
        return bool(self.reads or self._acks)

    @property
    def reading_here(self) -> bool:
        """This thread has reads to claim or in flight (cma progresses only in worker
        progress, not on the event fd: the loop must not sleep)."""
        return any(r.mine is not None for r in self.reads)

    # ---------------------------------------------------------------- headers
    def on_header(self, body: bytes) -> None:
        """An RMA batch header (module docstring)."""
        try:
            hdr = wire.rma_parse(body)
        except wire.RmaVersionError as e:
            self.stats["rejected_rma_version"] += 1
            log.warning("%s", e)
            return
        except Exception:  # anything malformed: never let it end this thread
            self.stats["rejected_BAD_FRAME"] += 1
            return
        book = self.book
        with book.cond:
            rx = book.authenticate(hdr.identity())
            if rx is None:
                return
            assert isinstance(rx, UcxRx)
            ack = wire.ack_tag(wire.tag_key(rx.token), rx.transfer_id, hdr.batch)
            slots = hdr.slots  # int64, page order: checked here before any read
            why = self._check(hdr)
            if why is None:
                end = int(slots.max()) + 1
                why = book.accept_slots(rx, hdr.group, hdr.page_bytes, slots, end)
            elif not rx.state.final:
                self.stats["rejected_batch"] += 1
                book.fail(rx, why)
            if why is not None:
                book.cond.notify_all()
                self._ack(hdr.endpoint, ack, f"batch refused: {why}")
                return
            grp = book.groups[hdr.group]
            rx.inflight += 1
        try:
            pieces = native_rma.page_pieces(hdr.cols, [r.size for r in grp.regions])
            ep = self.link.connect(hdr.endpoint)
            rkey = self._rkey(hdr.endpoint, ep, hdr.rkey)
            ptr = self.mapped.local(hdr, rkey) if self.mapped.enabled else None
        except MappedRangeError as exc:  # a header past the producer's segment: no read
            self._finish(rx, hdr.group, 0, 0, hdr.endpoint, ack, str(exc), refused=True)
            return
        except Exception as exc:
            why = f"RMA reads from {hdr.endpoint} failed: {type(exc).__name__}: {exc}"
            self._finish(rx, hdr.group, 0, 0, hdr.endpoint, ack, why)
            return
        if ptr is not None:  # the producer's store is mapped here: copy, land, acknowledge
            self._copy(rx, grp, hdr, ptr, pieces, ack)
            return
        self._start(rx, grp, hdr, ep, rkey, pieces, ack)

    def _start(
        self,
        rx: UcxRx,
        grp: Group,
        hdr: RmaHeader,
        ep: Any,
        rkey: int,
        pieces: list[tuple[int, int, int, int]],
        ack: int,
    ) -> None:
        """Build a checked batch's read list and hand it to its readers."""
        book = self.book
        lanes = self._lanes_made()
        try:
            local, remote, length = native_rma.op_lists(
                hdr.base, hdr.stride, hdr.rows,
                [int(r.tensor.data_ptr()) for r in grp.regions],
                [int(r.tensor.stride(0)) for r in grp.regions],
                hdr.slots, pieces, _RMA_MAX_READ if lanes else None,
            )  # fmt: skip
            shared = native_rma.RmaShared(local, remote, length, _RMA_SLICE, grp.regions)
            mine = native_rma.RmaPull(shared, ep.handle, rkey)
        except Exception as exc:
            with book.cond:
                rx.inflight -= 1
                book.fail(rx, f"RMA reads from {hdr.endpoint} failed: {type(exc).__name__}: {exc}")
                book.cond.notify_all()
            self._ack(hdr.endpoint, ack, "reads failed")
            return
        pages = int(hdr.slots.size)
        nbytes = pages * hdr.page_bytes
        helpers = lanes if nbytes >= _RMA_SPLIT_MIN * (len(lanes) + 1) else []
        read = RmaRead(
            rx, hdr.group, pages, nbytes, ack, ep, hdr.endpoint, hdr.rkey, shared,
            1 + len(helpers), mine,
        )  # fmt: skip
        self.stats["rma_reads"] += int(local.size)
        self.reads.append(read)
        # the lanes start on it now; this thread takes its turns from the loop (``reap``),
        # after it has checked and handed out every header that has arrived, so a lane
        # finds the next batch queued when it ends one
        for lane in helpers:
            lane.submit(read)

    def _check(self, hdr: RmaHeader) -> str | None:
        """What is wrong with a batch's source description, or None (the slots are the
        book's). Reads into device memory are not done here: such a receiver does not
        offer RMA. Called under the book's lock."""
        if hdr.slots.size == 0:
            return "RMA batch of no pages"
        if int(hdr.rows.min()) < 0 or int(hdr.rows.max()) >= hdr.nrows:
            return f"RMA batch names source rows outside the producer's {hdr.nrows}"
        if hdr.width < 1 or hdr.stride < hdr.width:
            return f"RMA batch describes rows of {hdr.width} bytes {hdr.stride} apart"
        if not hdr.cols or any(o < 0 or c < 1 or o + c > hdr.width for o, c in hdr.cols):
            return f"RMA batch columns {hdr.cols} outside rows of {hdr.width} bytes"
        if sum(c for _, c in hdr.cols) != hdr.page_bytes:
            return f"RMA batch columns make {sum(c for _, c in hdr.cols)}-byte pages"
        groups = self.book.groups
        if not 0 <= hdr.group < len(groups):
            return None  # the book names this one
        if any(r.tensor.device.type != "cpu" for r in groups[hdr.group].regions):
            return f"RMA batch for group {hdr.group}, which lives in device memory"
        if not hdr.endpoint.startswith(("ucx+shm://", "ucx+addr://")):
            return "RMA batch names no worker-address endpoint to read from"
        return None

    def _rkey(self, endpoint: str, ep: Any, packed: bytes) -> int:
        """The unpacked remote key of ``packed`` on ``ep`` (cached; a key unpacked on an
        endpoint that was since replaced is destroyed and unpacked again)."""
        key = (endpoint, packed)
        got = self._rkeys.get(key)
        if got is not None:
            if got[0] is ep:
                return got[1]
            self._rkey_destroy(key)
        if len(self._rkeys) >= _RMA_RKEYS:
            busy = {id(r.ep) for r in self.reads}
            for k in [k for k, (e, _) in self._rkeys.items() if id(e) not in busy][:8]:
                self._rkey_destroy(k)
        handle = native_rma.unpack(ep.handle, packed)
        self.stats["rma_rkey_unpack"] += 1
        self._rkeys[key] = (ep, handle)
        return handle

    def _rkey_destroy(self, key: tuple[str, bytes]) -> None:
        self.mapped.forget(key)  # its local mapping goes with it
        _, handle = self._rkeys.pop(key)
        native_rma.destroy(handle)
        self.stats["rma_rkey_destroy"] += 1

    def _ack(self, endpoint: str, tag: int, error: str | None) -> None:
        """Tell the producer a batch is done with (its rows are no longer read): ``error``
        None when every read landed. Best effort: a producer that never hears fails its
        push at its deadline, and without its TransferDone the transfer here cannot end
        DONE."""
        body = b"\x00" if error is None else b"\x01" + error.encode()[:512]
        buf = np.frombuffer(body, dtype=np.uint8).copy()
        try:
            ep = self.link.connect(endpoint)
            self._acks.append((ep.tag_send(Array(buf), ucx_api.UCXXTag(tag)), buf))
        except Exception as exc:
            log.debug("RMA acknowledgement to %s failed: %s", endpoint, exc)

    # ------------------------------------------------------------ completion
    def _copy(
        self,
        rx: UcxRx,
        grp: Group,
        hdr: RmaHeader,
        ptr: int,
        pieces: list[tuple[int, int, int, int]],
        ack: int,
    ) -> None:
        """Copy a checked batch from the producer's mapped slab, then land it and
        acknowledge it (the copy is complete before the producer may reuse the rows), on
        this thread: ``abort`` waits for it (``rx.inflight``)."""
        pages = int(hdr.slots.size)
        nbytes = pages * hdr.page_bytes
        error = None
        if not rx.state.final:  # aborted or expired meanwhile: nothing would count it
            try:
                self.mapped.copy(grp, hdr, ptr, pieces)
                self.stats["rma_mapped_batches"] += 1
                self.stats["rma_mapped_bytes"] += nbytes
            except Exception as exc:
                error = f"copy from {hdr.endpoint}'s mapped store failed: {exc}"
        self._finish(rx, hdr.group, pages, nbytes, hdr.endpoint, ack, error)

    def _finish(
        self,
        rx: UcxRx,
        group: int,
        pages: int,
        nbytes: int,
        endpoint: str,
        ack: int,
        error: str | None,
        refused: bool = False,
    ) -> None:
        """A batch this thread took (``rx.inflight`` counts it) is over: its pages land
        when ``error`` is None and the transfer is still live, else the transfer fails
        (``refused``: counted as a rejected batch); the producer is told either way."""
        book = self.book
        with book.cond:
            if error is not None:
                if not rx.state.final:
                    if refused:
                        self.stats["rejected_batch"] += 1
                    book.fail(rx, error)
            elif rx.state.final:
                error = f"transfer {rx.transfer_id} ended: {rx.error}"
            else:
                book.landed(rx, group, pages, nbytes)
            rx.inflight -= 1
            book.maybe_finish(rx, rx.queued)
            book.cond.notify_all()
        self._ack(endpoint, ack, error if not refused else f"batch refused: {error}")

    def _lanes_made(self) -> list[ReadLane]:
        """The reader lanes (``readers - 1``), made on first use; none when a lane cannot
        start (logged: this thread then reads everything, as with one reader)."""
        if self._lanes is None:
            self._lanes = []
            try:
                for i in range(self.readers - 1):
                    self._lanes.append(ReadLane(self.ctx, self._done, self.stats, i))
            except Exception as exc:
                log.warning("UCX reader lanes: %s (reading on the progress thread)", exc)
                for lane in self._lanes:
                    lane.close()
                self._lanes = []
        return self._lanes

    def _done(self, read: RmaRead, posted: int, error: str | None) -> None:
        """A reader finished its share of ``read`` (any thread): ``error`` None when all
        of it landed. The last one wakes the progress thread, which lands (or fails) the
        batch and acknowledges it (``reap``)."""
        with self._lock:
            read.left -= 1
            read.posted += posted
            if error is not None and read.error is None:
                read.error = error
            last = read.left == 0
        if last and not self.link.stop.is_set():  # closing: the pipe may be gone
            self.link.wake()

    def _step(self, read: RmaRead) -> None:
        """This thread's turn at ``read``: claim and post up to ``_RMA_TURN`` bytes of
        its reads, reap what completed, and report its share once nothing is left to
        claim and its own reads completed."""
        mine = read.mine
        if mine is None:
            return
        if read.error is not None or read.rx.state.final:
            read.shared.stop()  # nothing would count its pages: claim no more
        wh = self.link.worker.handle
        mine.step(wh, _RMA_TURN)
        if mine.drive(wh, 0 if mine.left == 0 else _RMA_ROUNDS) == 0 and mine.finished:
            read.mine = None
            self._done(read, mine.posted, pull_error(read.endpoint, mine))

    def reap(self) -> None:
        """Take a turn at the oldest *live* batch this thread still reads, and at every
        batch that is over for its transfer (nothing more is claimed there, only its reads
        under way are reaped: such a batch must never keep this thread from later batches
        of other transfers); then land the batches every reader of which finished and
        acknowledge them. A failed read fails the transfer: its pages never count."""
        if self._acks:
            self._acks = [a for a in self._acks if not a[0].completed]
        if not self.reads:
            return
        live = False
        for r in self.reads:
            mine = r.mine
            if mine is None:
                continue
            over = r.error is not None or r.rx.state.final or not mine.ok
            if over or not live:
                self._step(r)
                live = live or not over
        still = []
        for r in self.reads:
            if r.left:
                still.append(r)
                continue
            book = self.book
            error = None
            with book.cond:
                rx = r.rx
                if r.error is not None and not rx.state.final:
                    error = r.error
                    if r.posted < r.shared.total:
                        error += f" ({r.posted} of {r.shared.total} reads posted)"
                    book.fail(rx, error)
                elif rx.state.final:
                    error = f"transfer {rx.transfer_id} ended: {rx.error}"
                else:
                    book.landed(rx, r.group, r.pages, r.nbytes)
                rx.inflight -= 1
                book.maybe_finish(rx, rx.queued)
                book.cond.notify_all()
            self._ack(r.endpoint, r.ack_tag, error)
        self.reads = still

    def close(self) -> None:
        """At close (progress thread): reads still in flight were cancelled with their
        endpoints (checked once here, freeing their requests); the lanes end their
        shares and go; remote keys destroyed."""
        for r in self.reads:
            r.shared.stop()  # readers claim nothing more
        for lane in self._lanes or ():
            lane.close()  # each lane ends its share, frees its keys, endpoints, worker
        self._lanes = []
        wh = self.link.worker.handle
        for r in self.reads:
            if r.mine is not None and r.mine.drive(wh, 16):
                log.warning("closing with %d RMA reads still in flight", r.mine.left)
            with self.book.cond:
                r.rx.inflight -= 1
        self.reads = []
        for key in list(self._rkeys):
            self._rkey_destroy(key)


class ReadLane:
    """A reader thread with its own UCX worker on the plane's context: takes the split
    batches the progress thread hands it (``submit``), in order, and claims and reads
    their reads alongside the other readers (``native_rma.RmaPull``) through its own
    endpoint to the producer and a key unpacked on it (both cached), then reports its
    share (``done``). Its worker, endpoints and keys are touched by its thread only;
    ``close`` stops it, and the thread destroys its keys, closes its endpoints and drops
    its worker before it ends."""

    def __init__(
        self,
        ctx: Any,
        done: Callable[[RmaRead, int, str | None], None],
        stats: Counter[str],
        index: int,
    ) -> None:
        self._ctx = ctx
        self._done = done
        self._stats = stats
        self._todo: deque[RmaRead] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"disagg-ucx-read{index}", daemon=True
        )
        self._thread.start()
        self._ready.wait(30.0)
        if self._error is not None or not self._ready.is_set():
            self.close()
            raise RuntimeError(f"UCX reader thread failed to start: {self._error}")

    def submit(self, read: RmaRead) -> None:
        """Take part in ``read`` (its ``left`` counts this lane)."""
        with self._cond:
            self._todo.append(read)
            self._cond.notify()

    def close(self) -> None:
        """Stop (stop the batches' cursors first: a share under way ends with its
        slice) and wait for the thread; batches it never took are reported skipped."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(10.0)
        if self._thread.is_alive():
            log.warning("UCX reader thread did not end within 10 s")
        while self._todo:
            self._done(self._todo.popleft(), 0, "data plane closed")

    def _run(self) -> None:
        try:
            worker = ucx_api.UCXWorker(self._ctx)
        except BaseException as exc:  # reported to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        eps: dict[str, Any] = {}
        dead: list[Any] = []
        rkeys: dict[tuple[str, bytes], tuple[Any, int]] = {}
        try:
            while True:
                with self._cond:
                    while not self._todo and not self._stop:
                        self._cond.wait(_IDLE_WAIT_S)
                    if self._stop:
                        return
                    read = self._todo.popleft()
                posted, error = self._read(worker, eps, dead, rkeys, read)
                self._done(read, posted, error)
        except Exception:
            log.exception("UCX reader thread died")
        finally:
            for key in list(rkeys):
                native_rma.destroy(rkeys.pop(key)[1])
                self._stats["rma_lane_rkey_destroy"] += 1
            for ep in list(eps.values()) + dead:
                try:
                    if ep.alive:
                        ep.close()
                except Exception:
                    pass
            try:
                worker.progress()
            except Exception:
                pass
            eps.clear()
            dead.clear()
            del worker

    def _read(
        self,
        worker: Any,
        eps: dict[str, Any],
        dead: list[Any],
        rkeys: dict[tuple[str, bytes], tuple[Any, int]],
        read: RmaRead,
    ) -> tuple[int, str | None]:
        """This lane's share of ``read``: (reads posted, failure or None). Nothing to do
        when every read was claimed already, the batch failed, or its transfer ended."""
        sh = read.shared
        if sh.claimed or read.error is not None or read.rx.state.final:
            return 0, None
        try:
            ep = eps.get(read.endpoint)
            if ep is None or not ep.alive:
                if ep is not None:
                    dead.append(ep)
                    for k in [k for k, (e, _) in rkeys.items() if e is ep]:
                        native_rma.destroy(rkeys.pop(k)[1])
                        self._stats["rma_lane_rkey_destroy"] += 1
                ep = worker_address_ep(worker, read.endpoint)
                eps[read.endpoint] = ep
            key = (read.endpoint, read.packed)
            got = rkeys.get(key)
            if got is None:
                if len(rkeys) >= _RMA_RKEYS:
                    for k in list(rkeys)[:8]:
                        native_rma.destroy(rkeys.pop(k)[1])
                        self._stats["rma_lane_rkey_destroy"] += 1
                got = (ep, native_rma.unpack(ep.handle, read.packed))
                self._stats["rma_lane_rkey_unpack"] += 1
                rkeys[key] = got
            pull = native_rma.RmaPull(sh, ep.handle, got[1])
            wh = worker.handle
            pull.step(wh)
            while pull.drive(wh, _RMA_ROUNDS):
                if self._stop:
                    log.warning("closing with %d RMA reads still in flight", pull.left)
                    return pull.posted, "data plane closed"
        except Exception as exc:
            sh.stop()
            return 0, f"RMA reads from {read.endpoint} failed: {type(exc).__name__}: {exc}"
        self._stats["rma_lane_reads"] += pull.posted
        return pull.posted, pull_error(read.endpoint, pull)
