"""The consumer's reads: a producer's ``ReadPlan`` checked, cut into chunks, read with
NIXL, and landed in order.

Contract (``Reader``, the plane's thread unless said otherwise):

- ``on_plan``: authenticate (expected transfer, lease, token, a producer agent whose
  metadata came over the control channel, ``add_source``), then check every batch before
  a single read is posted: the source description (rows inside the slab, columns inside
  a row adding up to the page size) and the book's slot checks (bounds, promised slots,
  each once). A refused batch fails its transfer. The plan's deadline (what the producer
  had left, less ``DEADLINE_MARGIN_S``) becomes the transfer's deadline if earlier: the
  producer reuses the rows after its own, so a read that ends later is never counted.
- Descriptor lists are prepared once per layout (``prep_xfer_dlist``, strided): locally
  one per (group, pieces), remotely one per (producer, slab, pieces), where a *piece* is a
  stretch of a page that is contiguous on both sides (a page is one piece when the group
  has one region and the producer sends whole rows). A read is posted as index lists into
  them (``make_prepped_xfer``); NIXL merges descriptors that are adjacent on both sides,
  so a run of consecutive rows into consecutive slots goes as one descriptor. A plane that
  closes with no read in flight releases them (``release_lists``) before its memory.
- Chunks of at most ``HOST_CHUNK`` / ``DEVICE_CHUNK`` bytes are posted in plan order, at
  most ``HOST_WINDOW`` / ``DEVICE_WINDOW`` at once per producer (a stalled producer holds its own window, never another's reads); a
  chunk counts in ``rx.inflight`` from its post until NIXL reports it final (its bytes
  stop there), and its pages land only when every earlier chunk of the transfer landed
  (a layer-wise load sees its layers complete in order). A failed chunk fails the
  transfer at once; chunks of a transfer that ended are never posted.
- A producer whose reads have not moved for ``PROBE_S`` is probed with a notification;
  when NIXL says it is disconnected, its agent is dropped (``remove_remote_agent``),
  which ends its reads still in flight: without UCX's peer error handling
  (``nixl_error_handling: none``) a read from a killed producer over tcp is otherwise
  never completed. The dropped endpoint had failed already (no more bytes come through
  it), so this never ends a read whose bytes may still land. A plan from a dropped
  producer fails by name until it greets again.
- Once a transfer is final and nothing of it is read any more, the producer is told
  (``ReadDone``: ok, or the reason) so it can reuse its rows.

What abort can and cannot do: NIXL 1.5.1 cannot stop a posted read (releasing its handle,
or invalidating the producer's metadata, returns while its bytes keep landing: measured in
docs/design/nixl-plane.md). ``abort`` therefore stops posting and waits for the chunks in
flight; against a live or dead producer they end within a chunk's time (a dead one's
once the probe above drops it), against a stalled one they may not (then ``abort``
returns them as still under way).
"""

from __future__ import annotations

import functools
import hmac
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...protocol import messages as m
from ..receiver import Group, ReceiverBook, Rx
from . import agent as nx
from . import wire

log = logging.getLogger(__name__)

HOST_CHUNK = 32 << 20  # bytes per chunk read into host memory: on cma each request costs
# ~40 us of NIXL and the plane's Python between copies (docs/design/nixl-plane.md)
HOST_WINDOW = 2  # chunks in flight at once per producer: 64 MiB, what abort may wait for
DEVICE_CHUNK = 512 << 20  # ... into device memory (a chunk costs ~0.1 ms to post)
DEVICE_WINDOW = 4
DEADLINE_MARGIN_S = 0.25
DRAIN_S = 0.02  # the longest pump keeps posting before the plane's loop looks at notices
PROBE_S = 0.1  # a producer's reads quiet this long: is it still connected?
_INT32 = (1 << 31) - 1


@dataclass
class NixlRx(Rx):
    """An expected transfer, with the plane's reading state."""

    source: str | None = None  # the producer agent whose plan it took
    queued: int = 0  # chunks not posted yet
    chunks: deque[Chunk] = field(default_factory=deque)  # posted, in plan order
    told: bool = False  # ReadDone sent


@dataclass(eq=False)
class Chunk:
    rx: NixlRx
    group: int
    pages: int
    nbytes: int
    local: Any  # prepared list handles
    remote: Any
    lidx: np.ndarray  # int32 indices into them, piece-major
    ridx: np.ndarray
    window: int  # chunks of its producer in flight at once
    xfer: Any = None
    state: str = ""  # "" queued, PROC, DONE, or an error text
    final: bool = False


@functools.lru_cache(maxsize=256)
def pieces(
    region_sizes: tuple[int, ...], cols: tuple[tuple[int, int], ...]
) -> tuple[tuple[int, int, int, int], ...]:
    """(region, offset in its slot, offset in the source row, length) for each stretch of
    a page that is contiguous on both sides, in page order (cached: a layout repeats for
    every plan, and this costs ~20 us of numpy)."""
    lcuts = np.cumsum([0, *region_sizes])
    ccuts = np.cumsum([0, *(c for _, c in cols)])
    cuts = np.union1d(lcuts, ccuts)
    out = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        if a >= min(lcuts[-1], ccuts[-1]):
            break
        r = int(np.searchsorted(lcuts, a, side="right") - 1)
        k = int(np.searchsorted(ccuts, a, side="right") - 1)
        out.append((r, int(a - lcuts[r]), int(cols[k][0] + a - ccuts[k]), int(b - a)))
    return tuple(out)


class Reader:
    """The consumer's reads (module docstring)."""

    def __init__(
        self,
        agent: Any,
        book: ReceiverBook,
        stats: Counter[str],
        send: Callable[[str, bytes], None],
        telemetry: bool = False,
    ) -> None:
        self.agent, self.book, self.stats, self.send = agent, book, stats, send
        self.telemetry = telemetry
        self.sources: dict[str, bytes] = {}  # producer agent -> the metadata loaded
        self.sources_lock = threading.Lock()  # sources, and the remote lists, change under it
        self.queue: deque[Chunk] = deque()
        self.reading: dict[int, NixlRx] = {}  # transfers with a plan, until told
        self._local: dict[tuple[Any, ...], Any] = {}
        self._remote: dict[tuple[Any, ...], Any] = {}
        self.posted = 0
        self.posted_by: Counter[str | None] = Counter()  # chunks in flight per producer
        self.moved_at: dict[str | None, float] = {}  # a producer's last read posted or ended

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.posted or self.reading)

    def forget_lists(self) -> None:
        """Regions re-registered: local lists are prepared again on next use."""
        self._local.clear()

    def release_lists(self) -> None:
        """The plane closes with no read in flight: every prepared list is released here,
        before the plane deregisters its memory, rather than by the collector later (from
        whatever thread it runs in, after the memory is gone)."""
        with self.sources_lock:
            lists = [h for h, _ in self._local.values()] + list(self._remote.values())
            self._local.clear()
            self._remote.clear()
        for handle in lists:
            try:
                handle.release()
            except Exception as exc:
                log.debug("releasing a prepared NIXL list failed: %s", exc)

    # ---------------------------------------------------------------- plans
    def on_plan(self, sender: str, plan: wire.ReadPlan) -> None:
        book = self.book
        with book.cond:
            rx = book.rx.get(plan.transfer_id)
            if (
                not isinstance(rx, NixlRx)
                or not hmac.compare_digest(rx.token, plan.token)
                or plan.lease_id != rx.lease_id
            ):
                self.stats["rejected_unknown"] += 1
                return
            if rx.source is not None and rx.source != sender:
                self.stats["rejected_unknown"] += 1  # another agent naming this transfer
                return
            if rx.state.final:
                self.stats["rejected_late"] += 1
                if rx.source is None:
                    rx.source = sender  # told below, that its rows are free again
                    self.reading[rx.transfer_id] = rx
                return
            rx.source = sender
            self.reading[rx.transfer_id] = rx
            why = self._take(sender, rx, plan)
            if why is not None:
                if not rx.state.final:
                    self.stats["rejected_batch"] += 1
                    book.fail(rx, why)
            elif plan.last:
                rx.done_msg = m.TransferDone(transfer_id=rx.transfer_id, ok=True)
                book.maybe_finish(rx, rx.queued + len(rx.chunks))
            book.cond.notify_all()

    def _take(self, sender: str, rx: NixlRx, plan: wire.ReadPlan) -> str | None:
        """Check a plan and queue its chunks (book lock held); the reason it is refused."""
        if sender not in self.sources:
            return (
                f"producer agent {sender!r} sent no NIXL metadata over the control channel "
                "(an older producer, or another transport): set transport: nixl on both sides"
            )
        if plan.part != rx.next_part:
            return f"read plan part {plan.part} arrived, part {rx.next_part} expected"
        rx.next_part += 1
        if plan.deadline_ms:
            left = plan.deadline_ms / 1000.0 - DEADLINE_MARGIN_S
            rx.deadline = min(rx.deadline, time.monotonic() + left)
        slab = plan.slab
        if slab.width < 1 or slab.stride < slab.width or slab.nrows < 1:
            return (
                f"read plan describes {slab.nrows} rows of {slab.width} bytes {slab.stride} apart"
            )
        todo = []
        for b in plan.batches:
            arrays = b.arrays()
            if arrays is None or arrays[0].size == 0:
                return f"read plan batch for group {b.group} has no pages or unpaired arrays"
            rows, slots = arrays
            why = self._check(slab, b, rows)
            if why is None:
                end = int(slots.max()) + 1
                why = self.book.accept_slots(rx, b.group, b.page_bytes, slots, end)
            if why is not None:
                return why
            todo.append((b, rows, slots))
        for b, rows, slots in todo:
            try:
                self._queue(sender, rx, slab, b, rows, slots)
            except Exception as exc:
                return f"NIXL could not prepare reads from {sender}: {type(exc).__name__}: {exc}"
        return None

    def _check(self, slab: wire.Slab, b: wire.Batch, rows: np.ndarray) -> str | None:
        if int(rows.min()) < 0 or int(rows.max()) >= slab.nrows:
            return f"read plan names source rows outside the producer's {slab.nrows}"
        if any(o + c > slab.width or c < 1 for o, c in b.cols):
            return f"read plan columns {b.cols} outside rows of {slab.width} bytes"
        if sum(c for _, c in b.cols) != b.page_bytes:
            return f"read plan columns make {sum(c for _, c in b.cols)}-byte pages"
        return None

    def _queue(
        self,
        sender: str,
        rx: NixlRx,
        slab: wire.Slab,
        b: wire.Batch,
        rows: np.ndarray,
        slots: np.ndarray,
    ) -> None:
        grp = self.book.groups[b.group]
        ps = pieces(tuple(r.size for r in grp.regions), tuple((int(o), int(c)) for o, c in b.cols))
        local, nslots = self._local_list(b.group, grp, ps)
        remote = self._remote_list(sender, slab, ps)
        P = len(ps)
        if P * max(nslots, slab.nrows) > _INT32:
            raise ValueError(f"{P} pieces x {max(nslots, slab.nrows)} rows exceed NIXL's indices")
        mem = nx.mem_of(grp.regions[0].tensor)[0]
        device = mem == "VRAM"
        per = max(1, (DEVICE_CHUNK if device else HOST_CHUNK) // b.page_bytes)
        window = DEVICE_WINDOW if device else HOST_WINDOW
        # every chunk's indices in two array operations; a chunk's are a slice of them
        # (a view when a page is one piece)
        piece = np.arange(P, dtype=np.int64)[:, None]
        lidx = (piece * nslots + slots[None, :]).astype(np.int32)
        ridx = (piece * slab.nrows + rows[None, :]).astype(np.int32)
        for i in range(0, rows.size, per):
            k = min(per, rows.size - i)
            self.queue.append(
                Chunk(
                    rx, b.group, k, k * b.page_bytes, local, remote,
                    lidx[:, i : i + k].reshape(-1), ridx[:, i : i + k].reshape(-1), window,
                )
            )  # fmt: skip
            rx.queued += 1

    def _local_list(self, g: int, grp: Group, ps: tuple[tuple[int, int, int, int], ...]) -> Any:
        key = (g, tuple(ps))
        got = self._local.get(key)
        if got is None:
            n = grp.num_slots
            rows = [
                (int(grp.regions[r].tensor.data_ptr()) + lo, ln,
                 nx.mem_of(grp.regions[r].tensor)[1], int(grp.regions[r].tensor.stride(0)), n)
                for r, lo, _, ln in ps
            ]  # fmt: skip
            mem = nx.mem_of(grp.regions[0].tensor)[0]
            got = self._local[key] = (self._prep("", rows, mem), n)
            self.stats["nixl_local_lists"] += 1
        return got

    def _remote_list(
        self, sender: str, slab: wire.Slab, ps: tuple[tuple[int, int, int, int], ...]
    ) -> Any:
        key = (sender, slab, tuple((ro, ln) for _, _, ro, ln in ps))
        got = self._remote.get(key)
        if got is None:
            rows = [(slab.base + ro, ln, slab.dev, slab.stride, slab.nrows) for _, _, ro, ln in ps]
            got = self._remote[key] = self._prep(sender, rows, slab.mem)
            self.stats["nixl_remote_lists"] += 1
        return got

    def _prep(self, agent_name: str, rows: Sequence[tuple[int, ...]], mem: str) -> Any:
        arr = np.asarray(rows, dtype=np.uint64).reshape(-1, 5)
        return self.agent.prep_xfer_dlist(agent_name, arr, mem)

    def forget_source(self, name: str) -> None:
        for key in [k for k in self._remote if k[0] == name]:
            del self._remote[key]

    # ---------------------------------------------------------------- reading
    def pump(self) -> bool:
        """Post queued chunks (up to a window in flight), reap those NIXL finished, land
        them in order; tell producers about transfers that are over. True when anything
        moved."""
        moved = False
        until = time.monotonic() + DRAIN_S
        while True:
            moved = self._post_queued() or moved
            if not self.posted:
                break
            reaped = self._reap()
            moved = reaped or moved
            # chunks that ended inside their post (cma copies in ``transfer``) free their
            # window at once: the next ones go without a round of the plane's loop (~0.2
            # ms on two cores, docs/design/nixl-plane.md), for at most DRAIN_S
            if not (reaped and self.queue) or time.monotonic() > until:
                break
        if self.posted:
            self._probe_quiet()
        if self.reading:
            moved = self._tell() or moved
        return moved

    def _post_queued(self) -> bool:
        """Post queued chunks while their producers' windows allow; True when any was
        taken from the queue."""
        moved = False
        book = self.book
        while self.queue:
            ch = self._next()
            if ch is None:
                break
            moved = True
            rx = ch.rx
            with book.cond:
                rx.queued -= 1
                if rx.state.final:
                    book.cond.notify_all()
                    continue
                rx.inflight += 1
                rx.chunks.append(ch)
            self.posted += 1
            self.posted_by[rx.source] += 1
            self.moved_at[rx.source] = time.monotonic()
            self._post(ch)
        return moved

    def _next(self) -> Chunk | None:
        """Take the first queued chunk that is over (dropped when posted) or whose
        producer has fewer than its window of chunks in flight."""
        for i, ch in enumerate(self.queue):
            if ch.rx.state.final or self.posted_by[ch.rx.source] < ch.window:
                del self.queue[i]
                return ch
        return None

    def _post(self, ch: Chunk) -> None:
        try:
            ch.xfer = self.agent.make_prepped_xfer("READ", ch.local, ch.lidx, ch.remote, ch.ridx)
            ch.state = self.agent.transfer(ch.xfer)  # cma: the copy happens in this call
        except Exception as exc:
            ch.state = f"{type(exc).__name__}: {exc}"
        self.stats["nixl_reads"] += 1

    def _state(self, ch: Chunk) -> str:
        if ch.state != "PROC":
            return ch.state
        try:
            ch.state = self.agent.check_xfer_state(ch.xfer)
        except Exception as exc:  # NIXL raises for a peer gone (REMOTE_DISCONNECT)
            ch.state = f"{type(exc).__name__}: {exc}"
        return ch.state

    def _reap(self) -> bool:
        moved = False
        book = self.book
        for rx in list(self.reading.values()):
            for ch in rx.chunks:
                if ch.final or self._state(ch) == "PROC":
                    continue
                ch.final = True
                moved = True
                self.posted -= 1
                self.posted_by[rx.source] -= 1
                if not self.posted_by[rx.source]:
                    del self.posted_by[rx.source]
                self.moved_at[rx.source] = time.monotonic()
                self._release(ch)
                with book.cond:
                    rx.inflight -= 1
                    if rx.state.final:  # an abort waits for its reads to drain
                        book.cond.notify_all()
            while rx.chunks and rx.chunks[0].final:
                self._land(rx.chunks.popleft())
            failed = next((c for c in rx.chunks if c.final and c.state != "DONE"), None)
            if failed is not None and not rx.state.final:  # earlier chunks still read
                with book.cond:
                    book.fail(rx, f"NIXL read from {rx.source} failed: {failed.state}")
                    book.cond.notify_all()
        return moved

    def _probe_quiet(self) -> None:
        """Probe each producer whose reads in flight have not moved for ``PROBE_S``; drop
        those NIXL says are disconnected (module docstring)."""
        now = time.monotonic()
        for src in [s for s, n in self.posted_by.items() if n and s is not None]:
            if now - self.moved_at.get(src, now) < PROBE_S:
                continue
            self.moved_at[src] = now  # next probe after another PROBE_S
            try:
                self.agent.send_notif(src, wire.encode(wire.Probe()))
            except Exception as exc:
                if "DISCONNECT" in f"{type(exc).__name__} {exc}".upper():
                    self.drop_source(src, f"{type(exc).__name__}: {exc}")

    def drop_source(self, name: str, why: str) -> None:
        """Forget a disconnected producer agent: NIXL fails its reads still in flight."""
        log.warning("NIXL producer agent %s is disconnected (%s): dropped", name, why)
        self.stats["nixl_sources_dropped"] += 1
        with self.sources_lock:
            self.sources.pop(name, None)
            self.forget_source(name)
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:
                log.warning("dropping NIXL agent %s failed: %s", name, exc)

    def _release(self, ch: Chunk) -> None:
        if ch.xfer is None:
            return
        if self.telemetry and ch.state == "DONE":
            try:
                self.stats["nixl_descs"] += int(self.agent.get_xfer_telemetry(ch.xfer).descCount)
            except Exception:
                pass
        try:
            ch.xfer.release()
        except Exception as exc:
            log.warning("releasing a NIXL read failed: %s", exc)
        ch.xfer = None

    def _land(self, ch: Chunk) -> None:
        rx, book = ch.rx, self.book
        with book.cond:
            if ch.state != "DONE":
                if not rx.state.final:
                    book.fail(rx, f"NIXL read from {rx.source} failed: {ch.state}")
            elif not rx.state.final:
                book.landed(rx, ch.group, ch.pages, ch.nbytes)
                self.stats["nixl_bytes"] += ch.nbytes
            book.maybe_finish(rx, rx.queued + len(rx.chunks))
            if rx.state.final:  # waiters wait for the end, not for each chunk
                book.cond.notify_all()

    def _tell(self) -> bool:
        """ReadDone to the producer of each transfer that is over and quiet."""
        moved = False
        for tid, rx in list(self.reading.items()):
            if not rx.state.final or rx.queued or rx.chunks or rx.inflight:
                continue
            del self.reading[tid]
            moved = True
            if rx.told or rx.source is None:
                continue
            rx.told = True
            ok = rx.state.name == "DONE"
            msg = wire.ReadDone(
                transfer_id=tid, token=rx.token, ok=ok, error="" if ok else str(rx.error)[:4000]
            )
            self.send(rx.source, wire.encode(msg))
        return moved

    def on_failed(self, sender: str, msg: wire.PushFailed) -> None:
        book = self.book
        with book.cond:
            rx = book.rx.get(msg.transfer_id)
            if not isinstance(rx, NixlRx) or not hmac.compare_digest(rx.token, msg.token):
                self.stats["rejected_unknown"] += 1
                return
            if rx.source not in (None, sender):
                self.stats["rejected_unknown"] += 1
                return
            book.fail(rx, f"sender failed the transfer: {msg.error}")
            book.cond.notify_all()

    def close(self, wait_s: float) -> int:
        """Drop what was not posted and wait (``wait_s``) for chunks in flight; returns
        how many are still in flight (their memory must then stay registered)."""
        self.queue.clear()
        end = time.monotonic() + wait_s
        while self.posted and time.monotonic() < end:
            self._reap()
            time.sleep(0.001)
        return self.posted
