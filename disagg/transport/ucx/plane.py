"""``UcxDataPlane``: the DataPlane over UCX (ucxx), a thin facade over the package's parts.

Contract: both DataPlane sides (dataplane.py), with the receiver rules of the shared
``ReceiverBook`` (every slot of a batch checked before any byte of it is written; only
expected transfers with matching lease and token; ``abort`` fails the transfer and
waits for its writes under way). ``endpoint`` is an address only; ``capabilities`` says
what this receiver takes beyond the base behaviour (``DataCaps``: the consumer sends it
in every control Push), and a sender decides from the ``caps`` it is given (None: the
base behaviour, as if the receiver offered nothing).

Where things live:

- this file: the public API, the choice of path per push, and the progress thread's
  loop (one thread owns the UCX worker and makes every UCX call; it sleeps on the
  worker's event fd and a wake-up pipe whenever UCX has nothing ready);
- receive.py: receiving pages from tag messages (headers, segments, scratch, iov
  receives, device scatters); hostcopy.py: the host row copies of that path;
- plan.py: cutting a push into messages; send.py: posting them (ring, iov sends, RMA
  headers, acknowledgements), DONE and FAILED;
- rma.py: a consumer's one-sided reads and reader lanes; mapped.py: copies from a
  producer's store mapped into the consumer; native_rma.py / iov.py / cma_guard.py: the
  libucp calls ucxx does not expose (ctypes, and the C loop in ``_ucxrma.c``);
- wire.py: tags, frames, segment cuts, the RMA header; link.py: the worker, endpoints,
  endpoint strings; settings.py: the UCX context's configuration.

Paths by channel: ``shm`` with host ``StoreRows`` to a receiver offering ``rma``: the
consumer reads the rows itself (rma.py; mapped.py where the store is mapped); otherwise
tag messages, iov sends of scattered store rows on shm and over tcp under large
segments. ``tcp``: tag messages, cut in 2 MiB segments (iov receives straight into the
slots where the receiver offers them). CUDA rows: whole batches, one message each.
docs/design/ucx-plane.md has each decision and the measurement behind it.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import Counter
from collections.abc import Sequence
from urllib.parse import urlsplit

import torch

from ... import hostmem
from ...protocol import messages as m
from ..dataplane import DataPlane, RegionSpec, RowsSource, TransferStatus
from ..receiver import BookedReceiver, ReceiverBook, build_groups
from . import cma_guard, iov, native_rma, settings, wire
from .link import Link, ucx_api
from .mapped import MappedStores
from .plan import plan_push
from .receive import Receiver, UcxRx
from .rma import RmaReader
from .send import PushHandle, Sender

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_BUSY_WAIT_S = 0.002  # safety net only: UCX signals the event fd when work arrives


class UcxDataPlane(BookedReceiver, DataPlane):
    """Both DataPlane sides over UCX (module docstring).

    ``bind``: ``tcp://host:port`` (port 0 picks one) for the listener of the ``tcp``
    channel; ``advertise``: the address peers should use instead (``tcp://host[:port]``
    or a full ``ucx+...`` endpoint); ``channel``: ``tcp`` (listener), ``shm`` (worker
    address; shared memory between processes of one host), or ``auto`` (worker address;
    UCX picks shared memory locally and TCP otherwise). ``cuda``: accept CUDA regions and
    CUDA source rows; ``None`` turns it on when this process has already initialised
    CUDA (use ``shm``/``auto`` for CUDA peers on one node: cuda_ipc needs worker-address
    endpoints). ``rma_readers``: threads that copy a consumer's one-sided reads of a
    batch (``None``: ``settings.default_rma_readers()``)."""

    # producers hand StoreRows of their host slab: never gathered up front
    accepts_store_rows = True
    # wait() sleeps on the book's condition in short slices: the base class's backoff
    # grows to 10 ms, a third of a 30 ms transfer
    wait_slice_s = _BUSY_WAIT_S * 5
    # after severing the producers' connections (abort), how long their receives may
    # take to end with an error (0.04-0.27 s measured for ~60 receives of 2 MiB)
    sever_wait_s = 2.0

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        advertise: str | None = None,
        channel: str = "tcp",
        cuda: bool | None = None,
        rma_readers: int | None = None,
    ) -> None:
        if channel not in ("tcp", "shm", "auto"):
            raise ValueError(f"channel must be tcp, shm or auto, not {channel!r}")
        if rma_readers is None:
            rma_readers = settings.default_rma_readers()
        elif isinstance(rma_readers, bool) or not isinstance(rma_readers, int) or rma_readers < 1:
            raise ValueError(f"rma_readers must be an integer >= 1, not {rma_readers!r}")
        self.rma_readers = rma_readers
        if cuda is None:
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("UcxDataPlane(cuda=True) but no CUDA device is available")
        self.channel = channel
        # abort severs a stalled producer's connections on the tcp channel only (``abort``)
        self.abort_complete = channel == "tcp"
        self.cuda = bool(cuda)
        self._cuda_device = torch.cuda.current_device() if self.cuda else -1
        self._bind = urlsplit(bind)
        self._advertise = advertise
        self._settings = settings.decide(channel, self._bind.hostname, self.cuda)
        # pushes to ucx+tcp endpoints send scattered StoreRows segments as iov messages;
        # a tcp receiver posts packed segments for host slots as iov receives
        self.tcp_iov_sends = self._settings.tcp_iov_sends
        self.tcp_iov_recvs = self._settings.tcp_iov_recvs
        self.stats: Counter[str] = Counter()
        self._book = ReceiverBook(self.stats, rx_factory=UcxRx)
        self._link = Link(self.stats)
        self._mapped = MappedStores(self._link, self.stats)
        self._rma = RmaReader(self._link, self._book, self.stats, self._mapped, rma_readers)
        self._receiver = Receiver(
            self._link, self._book, self.stats, channel, self.tcp_iov_recvs, self._rma.on_header
        )
        self._sender = Sender(self._link, self.stats, self._mapped)
        # what this receiver offers (set with the regions): every host region is huge
        # pages (shm: runs may land in the rows); reads StoreRows batches itself; takes
        # packed segments as iov receives (tcp)
        self._shm_direct = False
        self._rma_rx_ok = False
        self._iov_rx_ok = False
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="disagg-ucx", daemon=True)
        self._link.thread = self._thread
        self._thread.start()
        self._ready.wait(30.0)
        if self._init_error is not None:
            raise RuntimeError(f"UCX data plane failed to start: {self._init_error}")
        if not self._ready.is_set():
            raise RuntimeError("UCX data plane did not start within 30 s")

    # ================================ receiver ==========================================
    @property
    def endpoint(self) -> str:
        return self._link.endpoint

    @property
    def capabilities(self) -> m.DataCaps:
        if self.channel == "tcp":
            return m.DataCaps(
                tcp_segment_bytes=wire.TCP_SEG_BYTES,
                tcp_rx_segment_bytes=self._settings.tcp_rx_seg,
                iov_recv=self._iov_rx_ok,
            )
        return m.DataCaps(direct=self._shm_direct, rma=wire.RMA_VERSION if self._rma_rx_ok else 0)

    def register_regions(
        self, group_regions: Sequence[Sequence[RegionSpec | torch.Tensor]]
    ) -> None:
        specs = [
            [r if isinstance(r, RegionSpec) else RegionSpec(r) for r in g] for g in group_regions
        ]
        gdev, gdirect = self._receiver.layout(specs, self.cuda)
        groups = build_groups(specs)
        host = [r.tensor for g, regs in enumerate(specs) if gdev[g] is None for r in regs]
        host_only = all(d is None for d in gdev)
        with self._book.lock:
            self._book.groups = groups
            self._receiver.gdev, self._receiver.gdirect = gdev, gdirect
            self._shm_direct = (
                self.channel == "shm" and bool(host) and all(map(hostmem.is_huge, host))
            )
            self._rma_rx_ok = self._settings.rma and host_only
            self._iov_rx_ok = self.tcp_iov_recvs and host_only

    def abort(self, transfer_id: int, reason: str = "aborted") -> int:
        """Fail the transfer and wait (``abort_wait_s``) for its writes under way.

        Writes that outlive the wait are receives UCX already matched, straight into
        slots (iov receives, runs landing in place): UCX cannot cancel them, and a
        stalled producer that resumes would finish them into slots the engine may reuse.
        On the tcp channel the plane then severs its producers' connections (every
        accepted endpoint force-closed, which ends those receives with an error and drops
        whatever that producer sends later) and waits again (``sever_wait_s``). Returns
        the writes still under way after that: 0 unless the plane could not sever
        (shm/auto channels have no accepted endpoints), in which case the caller must not
        reuse the slots."""
        left = self._book.abort(transfer_id, reason, self.abort_wait_s)
        if left and self._link.listener is not None and not self._link.stop.is_set():
            n = self._link.sever(f"transfer {transfer_id}: {left} writes outlived its abort")
            left = self._book.abort(transfer_id, reason, self.sever_wait_s)
            log.warning(
                "transfer %d: severed %d producer connections; %d writes left",
                transfer_id,
                n,
                left,
            )
        if left:
            log.warning("transfer %d: %d writes still in flight after abort", transfer_id, left)
        return left

    # ================================= sender ===========================================
    def post_push(
        self,
        endpoint: str,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        pages: Sequence[RowsSource],
        deadline_s: float = 30.0,
        caps: m.DataCaps | None = None,
    ) -> PushHandle:
        """Plan the push on this thread (plan.py) and queue it. ``caps`` (the receiver's
        ``capabilities``; None: it offered nothing) decides the cut of host batches
        (``wire.send_cut``), whether host ``StoreRows`` go as RMA batches, and the
        refusal of a tcp receiver whose UCX segments could not take ours."""
        if not endpoint.startswith(("ucx+tcp://", "ucx+shm://", "ucx+addr://")):
            raise ValueError(f"not a UCX data endpoint: {endpoint!r}")
        caps = m.DataCaps() if caps is None else caps
        shm = endpoint.startswith("ucx+shm://")
        tcp = endpoint.startswith("ucx+tcp://")
        tx_seg, rx_seg = self._settings.tcp_tx_seg, caps.tcp_rx_segment_bytes
        if tcp and 0 < rx_seg < tx_seg:
            raise ValueError(
                f"the receiver at {endpoint} takes UCX tcp segments of {rx_seg} bytes, and "
                f"this plane sends active-message fragments of {tx_seg}: it would never take "
                "them. Give both sides the same UCX tcp settings, or start this side with "
                "UCX_TCP_PUT_ENABLE=y UCX_RNDV_SCHEME=put_zcopy (put rendezvous in UCX's "
                "own segments, which lets peers write this process's memory)"
            )
        # Over tcp with UCX's default tcp settings (and ucx+addr, which may be tcp) UCX
        # sends an iov in 8 KiB copy-in pieces: there the gather into the ring is faster
        iov_sends = (shm or (self.tcp_iov_sends and tcp)) and iov.available()
        # one-sided: the receiver reads host StoreRows itself (rma.py)
        rma = shm and self._settings.rma and caps.rma == wire.RMA_VERSION
        cut = wire.send_cut(self.channel, endpoint, caps)
        plan = plan_push(transfer_id, lease_id, bytes(token), pages, cut, iov_sends, rma, self.cuda)
        return self._sender.start(endpoint, transfer_id, plan, deadline_s)

    def poll_push(self, handle: PushHandle) -> TransferStatus:
        return handle.status()

    def register_source(self, tensor: torch.Tensor) -> torch.Tensor:
        """Producer: put a host store slab where consumers on this host can map it
        (mapped.py); returns the tensor to use from now on (the same one where that is
        not possible: ``shm`` channel with RMA only; logged at info). Call once per slab,
        at start-up (it copies the whole slab)."""
        why = None
        if self.channel != "shm":
            why = f"channel {self.channel} (mapped stores need shm)"
        elif not self._settings.rma:
            why = f"UCX RMA unavailable ({native_rma.unavailable_reason()})"
        return self._mapped.place(tensor, why)

    # ================================= common ===========================================
    def close(self) -> None:
        if self._link.stop.is_set():
            return
        self._link.stop.set()
        self._link.wake()
        self._thread.join(10.0)
        self._link.close_pipe()

    # ============================ progress thread =======================================
    def _run(self) -> None:
        try:
            self._setup()
        except BaseException as exc:  # reported to the constructor
            self._init_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except Exception:
            log.exception("UCX data plane progress thread died")
        finally:
            self._teardown()

    def _setup(self) -> None:
        if self.cuda:
            # UCX's cuda transports want the device's context current in the thread
            # that creates the context/worker and makes every UCX call (this one).
            torch.cuda.set_device(self._cuda_device)
            torch.empty(1, device=f"cuda:{self._cuda_device}")
        # A peer that dies during a cma copy (our reads on shm, or UCX's rendezvous
        # writes on the tag path) must fail the request, not abort this process.
        cma_guard.guard_cma()
        features = [ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP]
        if self._settings.rma:
            features.append(ucx_api.Feature.RMA)
        self._ctx = ucx_api.UCXContext(
            config_dict=self._settings.config, feature_flags=tuple(features)
        )
        self._sender.ctx_handle = self._mapped.ctx_handle = self._ctx.handle
        self._rma.ctx = self._ctx
        worker = ucx_api.UCXWorker(self._ctx)
        worker.init_blocking_progress_mode()
        self._receiver.open()
        self._link.open(worker, self.channel, self._bind, self._advertise)

    def _teardown(self) -> None:
        with self._book.lock:
            self._book.fail_all("data plane closed")
        self._sender.fail_all("data plane closed")
        self._link.jobs.clear()  # queued pushes: their handles fail via ``stop``
        self._link.close_all()
        self._rma.close()
        self._sender.close()
        self._mapped.release(self._ctx)
        self._link.forget()

    def _loop(self) -> None:
        link, rx, tx, rma = self._link, self._receiver, self._sender, self._rma
        worker = link.worker
        poller = select.poll()
        poller.register(link.wake_r, select.POLLIN)
        poller.register(worker.epoll_file_descriptor, select.POLLIN)
        last_sweep = 0.0
        while not link.stop.is_set():
            link.run_jobs()
            worker.progress()
            rx.rx_headers()
            if tx.ack_wait:
                tx.rx_acks()
            rx.rx_segments()
            rx.reap()
            if rma.busy:
                rma.reap()
            rx.scatter_reap(block=False)
            tx_more = tx.reap()
            now = time.monotonic()
            if now - last_sweep > 0.01:
                last_sweep = now
                rx.sweep(now)
            if link.jobs or tx_more:
                continue
            if rx.scatters:  # short device work that does not signal the event fd
                rx.scatter_reap(block=True)
                continue
            # cma reads progress in worker progress, not on the fd: keep going while
            # this thread has reads to claim or in flight; while only the lanes read,
            # sleep (the last reader of a batch wakes this thread)
            if rma.reading_here:
                continue
            # Blocking progress: sleep on the worker's event fd even with data in flight
            # (UCX signals it on every completion / arrival), so this thread never spins
            # against the peer process or the engine on a small host.
            busy = rx.busy or bool(tx.active)
            if self.cuda and (rx.reqs or tx.active):
                # cuda_ipc copy completions are polled by UCX, not signalled on the fd
                # (and poll() cannot sleep under 1 ms): keep progressing while requests
                # are in flight, yielding the GIL each turn
                time.sleep(0)
                continue
            if worker.arm():
                poller.poll((_BUSY_WAIT_S if busy else _IDLE_WAIT_S) * 1000)
                link.drain_wakes()
        link.run_jobs()  # pushes queued after the loop ended


__all__ = ["UcxDataPlane", "PushHandle"]
