"""Same-host data plane (``transport: ipc``): the receiver copies pages straight out of
the sender's store.

Why: a push over a socket moves each page at least three times (gather, wire, scatter);
between processes of one host the receiver can map the sender's store instead and move
each page once, source row to destination slot, with ``page_copy`` (one Triton kernel on
a GPU, torch's index kernels on the host). UCX's cuda_ipc path reached 0.02-0.13 of the
device-to-device copy rate for the same pages (``disagg bench gpu``).

How:
- The sender registers its store once (``register_source``): a device store is shared
  through CUDA IPC (torch's storage share), a host store is moved into a /dev/shm file
  (pinned again if it was pinned). Each push describes its pages as rows of an export
  (``protocol.ipc.IpcBatch``: rows and slots as raw little-endian int arrays, 4 bytes
  each when they fit) and carries the export descriptions; the receiver opens an export
  once and keeps it.
- The receiver checks everything before it copies a byte, with numpy over whole index
  arrays (no per-page Python): the transfer's token and lease, the ReceiverBook's slot
  checks and promises, that every source row lies inside the export, that the export is
  from this host (boot id) and, for CUDA, that its GPU is visible here. Then it copies:
  both index arrays go up in one host-to-device copy from a pinned buffer kept from push
  to push (``_Staging``), and each piece of a page layout is one kernel launch whose
  views were worked out by the first push of that layout (``_prepared``), launched
  directly once Triton compiled it (``page_copy.launch_raw``). It answers ``IpcAck`` once the copy is over: host copies
  at once, device copies from the landing thread when their CUDA event fires (so the
  receiver thread checks the next push while the GPU copies). The sender's push is DONE
  only on that answer, so the sender never reuses rows a copy may still read.
- Zombie reads: a push carries the sender's deadline on CLOCK_MONOTONIC (one clock per
  host). The sender keeps its rows until the push is final, and fails it no earlier than
  that deadline (also when its connection drops after the push left: the receiver may
  still copy it); the receiver starts no copy after it, and a copy it sees end after it
  fails the transfer instead of landing (the rows may have been reused meanwhile).
- Limits: one host only (a peer on another host is refused with a message naming the
  fix). A CUDA export is only as alive as the sender process: CUDA leaves reads of a dead
  exporter's memory undefined; the receiver checks the sender's pid before each device
  copy, which narrows but cannot close that window. (A /dev/shm export stays readable:
  the mapping outlives the sender.)

Control messages travel on framed stream sockets (``framed.py``: TCP or AF_UNIX at
``endpoint``, not ZMQ, whose two I/O threads cost a thread wake-up each way): the
receiver thread accepts and reads every connection (at most ``MAX_CONNS``; a frame over
``MAX_IPC_FRAME``, a bad preamble or a sender that reads no acks closes that connection,
counted); the landing thread writes its acks itself. The sender thread owns one
connection per receiver, sends the pushes the posting threads encoded, reads the acks,
and retries a refused connection until the pushes' deadlines.

Measured on one H200 (a Firecracker VM; its CPU runs a thread's first few hundred
microseconds after a sleep 2-3x slower than a busy loop, so every Python step of a
single push counts double). 1 GiB of random 64 KiB pages from a 2 GiB store into random
slots, ``disagg bench gpu --ipc-only --page-sizes 64KiB,256KiB,1MiB --ipc-depths 1,4,8``,
ratio to the device-to-device copy, pushes in flight 1 / 4 / 8:
  ZMQ control, 8-byte indices:      64K 0.19/0.60/0.68  256K 0.24/0.63/0.73  1M 0.42/0.57/0.74
  framed sockets (two machines):    64K 0.25-0.31/0.52-0.55/0.59-0.64  256K 0.37-0.40/
                                    0.66-0.68/0.77-0.78  1M 0.38-0.42/0.68-0.72/0.78-0.80
``disagg bench transfer --transports ipc-cuda`` (one push, its timing includes the
bench's own pipe and list conversions): 0.25/0.36/0.33 before, 0.26/0.31/0.36 after
(machines 20-30% apart in their host ceilings). Where one 64 KiB push's time goes
(a per-stage timeline across both processes, median of 20): the ZMQ hop in was 350 us
and the ack back 400 us; framed sockets 125-155 and 130-145 us. What remains of the
~2.2 ms for a 0.45-0.5 ms kernel: post_push + encode 190-250 us, the sender thread's
wake and send 230-250, checks 175-370, staging + launch 455-570 (cold CPU; the same
calls take 180 us in a busy loop), and the wake-ups of the landing and waiting threads.

Session 5 (H200, ``disagg bench gpu --ipc-only --page-sizes 64KiB,1MiB --total 1GiB
--ipc-depths 1,4``, A/B/A/B in one run): one push 0.30-0.33 (64K) / 0.38-0.45 (1M) of d2d,
four in flight 0.51-0.62 / 0.68-0.75. The kernel itself runs at 0.90 of d2d (see
``page_copy``); the ~1.6 ms of a single 1 GiB push is ~0.58 ms of copy and ~1 ms of
CPU steps in series. Tried, measured, and dropped (neither was faster): (1) sending the
push frame from the posting thread instead of waking the sender thread: post_push + send
229 us against 93 + 124 (the cost is the 128 KiB ``sendmsg`` on loopback TCP itself, not
the wake-up; an AF_UNIX endpoint is the lead there); (2) checking and launching a large
push in parts so the GPU starts early: each part cost the receiver thread ~160 us of
checks + launch, more than the GPU time of the first parts (one push 0.28-0.32 split
against 0.32-0.33 whole). What remains per 64 KiB push (timeline, no pause between
pushes): post_push ~95, send ~125, receiver wake ~60, decode ~22, checks ~220, staging +
launch ~320, landing + ack + waiter wake-ups ~180 us.

Session 6 (base e265a67; H200, ``disagg bench gpu --ipc-only --page-sizes 64KiB,1MiB
--total 1GiB --ipc-depths 1,4``, base and this code back to back, twice on each of two
machines; raw output in the session's notes): the receiver now stages both index arrays
in a ring of pinned buffers and one device buffer kept from push to push (``_Staging``)
and launches the kernel Triton compiled straight away (``page_copy.launch_raw``, on the
stream handle cached per device); post_push computes each bound once and hands msgspec
the converted arrays without ``tobytes``. One push: 64K 0.25-0.33 before / 0.28-0.39
after, 1M 0.34-0.37 / 0.39-0.42; four in flight: 64K 0.47-0.63 / 0.60-0.67, 1M
0.64-0.71 / 0.65-0.74. Timeline of one 64 KiB push (median of 20, no pause between
pushes; the second machine ran every step 20-50% slower): post_push 113-170, send
108-161, receiver wake 56-94, decode 17-30, checks 193-272 (of which the book's slot
checks ``accept_slots`` 137-173: three fancy-index passes and two counts over 16384
slots), staging 160-245 (base 161: the kept buffers save the allocations, but the
slice + ``copy_`` of a pinned buffer still costs ~50 us on a just-woken thread of that
VM, and the Python between the checks and the launch the rest), launch 35-49 (JIT 63),
landing + ack + waiter 180-250 (base 190); whole push 1515 / 1904 us on the two machines
(base 1494 on a third: single timelines vary more between machines than the change).
Tried, measured, and dropped: (1) keeping every thread busy-polling (select(0) loops,
event query spins, a spinning waiter) instead of sleeping: 1490 us against 1494 (the
spinning threads take the GIL from the working one); (2) the index arrays in a
/dev/shm ring of the sender's (16 parts of 1 MiB, a ~400-byte frame; the receiver copied
both arrays out before checking them): send fell to 62 us and decode to 16, but
post_push (writing the ring) stayed at 157 and the receiver's copy-out raised the
pre-check steps from 45-75 to 101 us; one push 0.29-0.32 against 0.30-0.31 for the base
in the same run, so no gain for its complexity. What would close the gap to 0.5 (~1.0 ms
for 1 GiB, ~0.45 ms of CPU in series with the ~0.55 ms kernel) is fewer interpreter and
torch steps on the receiver's path, not less data: the slot checks in one pass over one
state array per transfer (``ReceiverBook``: three fancy-index passes and two counts
today), and the staging fill, H2D copy, launch and event record in one C call (each of
those torch calls costs 20-50 us on a just-woken thread of this VM).

Session 8 (base e2b6158; H200, ``disagg bench gpu --ipc-only --page-sizes 64KiB,1MiB
--total 1GiB --ipc-depths 1,4``, base and this code interleaved, two rounds on each of
two machines; raw output in docs/perf/h200-ipc-session8/): the receiver's checks are one C pass
(``_slotcheck.c`` through ``ReceiverBook.accept_rows``) that also writes both index
arrays into the pinned staging buffer, and they go up with one ``cuMemcpyHtoDAsync``
through ctypes (``cuda_driver``). Per-call timings (median of 20 pushes, 16384 x 64 KiB):
the check and fill 80-125 us on that VM's just-woken thread (23 us warm on the 2-core CI
box, where the whole plan step fell from 216 to 109 us), the upload 50 -> 27 us, the
launch 40; the receiver's copy-launch step 233-248 -> 128-190 us. One push: 64 KiB
0.32-0.36 before, 0.31-0.37 after; 1 MiB 0.33-0.39 / 0.37-0.45; four in flight 0.62-0.70
both (noise). Tried, measured and dropped: (1) checking and launching a batch in parts
(first part 256/1024/4096 pages, each next 4x bigger, so the GPU starts on the first):
one push 0.30-0.38 against 0.34 whole: each part costs two uploads and a launch on a
cold thread, and the steps before the check do not overlap anything; (2) holding a 0 us
PM QoS request (/dev/cpu_dma_latency): that VM has no cpuidle driver, no change beyond
noise. A single 1 GiB push there is ~0.6 ms of GPU copy and ~0.95 ms of CPU in series:
post_push 130-215 us (numpy conversions of 16384 indices), the sender thread's wake and
128 KiB send 120-190, the receiver's wake 80-110, decode 20-30, checks 80-125, take +
upload + launch ~100, then the landing thread, the ack's hop back and the waiter's
wake-up (~200). The 0.5 target needs about half of that gone; what is left is thread
hand-offs and cold-thread execution, not any one step.

Session 9 (base e778e5b; H200, same bench, interleaved; raw output in
docs/perf/h200-ipc-session9/): the hand-offs themselves. (1) The sender and receiver
threads, after a wait that found work, spin for ``spin_us`` (default 2000 on hosts with 8+
CPUs, ``ipc_spin_us`` / ``DISAGG_SPIN_US``) on their selector's epoll descriptor before
they sleep, and ``wait_push`` spins on the handle's flag: in C with the GIL released
(``spin.py``), so no Python thread is held back (session 6's Python polling was). (2) A push
leaves from the posting thread when its connection is up and idle (``_send_now``; the
sender thread still reads acks and finishes what the socket did not take). (3) The sender
thread publishes finished pushes' flags only once it has released the GIL (``finish`` ->
``spin.wait_readable(..., publish)``), so a spinning waiter never wakes into a held GIL
(a futex sleep and wake-up, ~50 us there). (4) post_push packs both index arrays in one C
pass (``_slotcheck.pack_pair``). One 1 GiB push, 64 KiB / 1 MiB / 4 MiB, ratio of d2d:
base 0.34-0.37 / 0.35-0.53 / 0.46-0.56, new 0.44-0.50 / 0.50-0.67 / 0.56-0.67; four in
flight 0.67-0.76 -> 0.73-0.83. Spin alone gave most of it (0.40 / 0.53-0.62 / 0.47-0.56);
(2)-(4) without spin nothing beyond noise. Timeline of the 64 KiB push without a pause
between pushes: 1393 -> 1059 us (waiter wake-up 59 -> 24 us, ack hop 96 -> 44, send 128 ->
inside post_push). A 64-page push back to back: 510 -> 370 us; after a 5 ms pause (longer
than the window) 956 -> 941: an idle plane sleeps, and its first push pays the wake-ups.

Parts (session 10). A push of a device store with at least ``PARTS_MIN_PAGES`` (12288)
pages of at least ``PARTS_MIN_PAGE_BYTES`` (32 KiB) each that finds its receiver idle
leaves as two messages (``IpcPush.part`` / ``last``): since session 14 its first half (at
most ``PARTS_FIRST_MAX``, 8192 pages) and the rest (session 10: the first 4096 pages, then
the rest). The receiver checks
and launches the first part's copy while the second is still being sent and checked, so
the GPU starts ~200 us earlier; the first part's copies are waited for with the last
part's (one completion event: the landing thread does not wake mid-push), and only the
last part finishes the transfer and is answered. Rules: parts arrive in order (part ``k``
where ``k`` is due, else the transfer fails by name); a refused part, or a push whose last
part never comes (sender dead, abort, deadline: ``_sweep_open``), is answered only after
the copies of its earlier parts ended, since the sender reuses its rows once answered; a
receiver says it takes parts by ``?parts=1`` on its endpoint (older receivers never get
them); a push behind others still in flight to the same receiver travels whole (the
receiver's checks already overlap copies then). ``DISAGG_IPC_PARTS`` (comma-separated page
counts, ``0``: never) or ``push_parts`` set the leading sizes. Also: the staging ring now
pins all its buffers at the first push that needs them (each pinning costs ~0.1 ms
there, and ``disagg bench gpu``'s five pushes after one warm-up each paid one before).
Measured (H200, per-push timeline docs/perf/h200-ipc-session10/tl2.py, 1 GiB of 64 KiB
pages, pushes back to back, median of 21): 1084 -> 857 us on one VM (the GPU starts at
435 -> 204 us), 1210 -> 1140 on a slower one (the second part's checks there outlast the
first part's copy by 80 us). Split finer, worse: 2048 + 4096 + rest 1041 us (84 us idle
GPU before the second part; each part costs the receiver ~100 us of fixed work on that
VM). ``disagg bench gpu --ipc-only --page-sizes 64KiB --ipc-depths 1,4``, interleaved,
one push / four in flight: no parts .48/.77 .49/.75 .43/.76 and .57/.80 .51/.80 .49/.77
(second VM, ring fixed); 4096 .39/.68 .49/.75 .45/.73 and .50/.69 .55/.77 .53/.78; 3072
.53/.73 .49/.77 .61/.76: the bench's five-push median moves more between runs than the
change (raw output in docs/perf/h200-ipc-session10/). 16 KiB pages cut: 0.27-0.28
against 0.30-0.39 whole, hence ``PARTS_MIN_PAGE_BYTES``.

First part size (session 14, docs/perf/h200-session14/). The H200 VM's vCPUs run the same
code 1.8x slower in some phases (host sharing); there the receiver's work on the rest of
a push (~280 us) outlasted a 4096-page first part's copy (~200 us) and the GPU sat idle
44-118 us. Interleaved, pushes 2-6 of 1 GiB of 64 KiB pages: first part 4096
.56/.45/.43/.59 of d2d, 8192 .56/.54/.54/.57; on a VM that stayed fast, halves equalled
4096 except for 32768-page pushes (a 16384-page first part starts the GPU later), hence
PARTS_FIRST_MAX.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import mmap
import os
import queue
import re
import selectors
import threading
import time
import warnings
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ..protocol import ipc as wire
from ..protocol import messages as m
from ..protocol.errors import ProtocolError
from . import cuda_driver, framed, spin
from .dataplane import DataPlane, RowsSource, StoreRows, TransferState, TransferStatus
from .page_copy import DeviceCopy, copy_indexed, launch_device, launch_raw, prepare_device
from .receiver import BookedReceiver, Group, ReceiverBook, Rx

try:  # one pass packs a push's index arrays (receiver.py requires it under CI)
    from . import _slotcheck
except ImportError:
    _slotcheck = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_POLL_MS = 20
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^disagg-ipc-(\d+)-(\d+)$")
MAX_OPEN_EXPORTS = 256
# A push describes up to a few million pages (16 bytes each per layer batch): more than a
# control frame, still bounded.
MAX_IPC_FRAME = 64 << 20  # receiver-side cache of mapped exports
IDLE_SOCKET_S = 30.0
MAX_CONNS = 1024  # receiver: connections beyond this are closed at once (counted)
MAX_ACK_FRAME = 1 << 20  # sender: an ack is a few hundred bytes
MAX_PENDING_ACK_BYTES = 16 << 20  # receiver: acks queued for a sender that reads none
_RETRY_S = 0.05  # sender: pause between connection attempts to an absent receiver
_RW = selectors.EVENT_READ | selectors.EVENT_WRITE
_I32 = 1 << 31
_TORCH_INT = {4: torch.int32, 8: torch.int64}
_WAKE = object()  # selector tag of the receiver's wake-up pipe
# The receiver refuses to *start* a copy this close to the sender's deadline: the copy
# must end before the sender (and then the producer, after its grace) reuses the rows.
COPY_MARGIN_S = 0.25

# A plane's cache of prepared copies: (export tensor, group, layout) -> the prepared
# device copy of each piece. The receiver thread's alone. Entries hold the tensor and the
# group themselves, so their ids (in the key) cannot be reused while cached.
Prepared = OrderedDict[tuple[Any, ...], tuple[Any, Any, list[DeviceCopy]]]
MAX_PREPARED = 256


# Parts: a device push of many pages leaves as several messages, so the receiver checks
# and launches the first copy while the rest are still being sent and checked (see
# "Parts" above). By default a push of PARTS_MIN_PAGES or more leaves as two messages,
# the first half of it (at most PARTS_FIRST_MAX pages) and the rest: the first copy then
# outlasts the receiver's work on the rest even in the H200 VM's slow CPU phases
# (session 14: a first part of 4096 pages left the GPU idle 50-120 us there), and a very
# large push still starts its GPU copy early (a first half of 16384 pages was later).
# ``push_parts`` / ``DISAGG_IPC_PARTS`` give explicit leading sizes instead.
PARTS_MIN_PAGES = 12288
PARTS_FIRST_MAX = 8192
# Smaller pages are not cut: the GPU copies one in about the time the receiver checks
# one, so the first part's copy is over long before the rest are checked (16 KiB pages:
# one push 0.27-0.28 of d2d cut, 0.30-0.39 whole).
PARTS_MIN_PAGE_BYTES = 32 << 10
_PARTS_SUFFIX = "?parts=1"  # on a receiver's endpoint: it takes pushes in parts

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


class IpcDataPlane(BookedReceiver, DataPlane):
    """Both DataPlane sides for processes on one host (see the module docstring).
    ``bind``: where the receiver listens (``tcp://127.0.0.1:0`` or ``ipc://path``)."""

    accepts_store_rows = True  # producers hand StoreRows: no gather before a push

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        advertise: str | None = None,
        spin_us: int | None = None,
        push_parts: Sequence[int] | None = None,
    ) -> None:
        self.stats: Counter[str] = Counter()
        # leading part sizes (pages) of a device push sent in parts ("Parts"); () never;
        # None: the default (first half, at most PARTS_FIRST_MAX, from PARTS_MIN_PAGES)
        self._push_parts = _parts_setting(push_parts)
        self._parts_host = False  # tests: cut host pushes too
        self._parts_min_bytes = PARTS_MIN_PAGE_BYTES  # tests: 0 cuts pushes of small pages
        # spin-then-block window of the sender, receiver and waiting threads (spin.py)
        self._spin_ns = 1000 * (spin.default_spin_us() if spin_us is None else spin_us)
        self._book = ReceiverBook(self.stats)
        self._stop = threading.Event()
        self._sources: list[_Source] = []
        self._mapped: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()
        self._prepared: Prepared = OrderedDict()
        self._staging: dict[torch.device, _Staging] = {}  # the receiver thread's
        # pushes in parts whose device copies wait for a later part (the receiver thread's)
        self._parted: dict[int, _Landing] = {}
        self._listener, bound = framed.listen(bind)
        self._unix_path = bound[len("ipc://") :] if bound.startswith("ipc://") else None
        # the suffix tells senders that this receiver takes pushes in parts
        self._endpoint = (advertise or bound).removesuffix(_PARTS_SUFFIX) + _PARTS_SUFFIX
        self._jobs: queue.Queue[PushHandle] = queue.Queue()
        # the sender thread's connections; posting threads send on an idle one themselves
        # (_send_now). The lock is held by whoever works on them, never across a wait.
        self._peers: dict[str, _Peer] = {}
        self._tx_lock = threading.Lock()
        self._publish: list[bytearray] = []  # flags of pushes it finished (the sender thread's)
        self._wake_r, self._wake_w = os.pipe()
        # the landing thread writes acks itself; it pokes the receiver thread only when a
        # connection's buffer is full (the receiver then flushes it when writable)
        self._ack_r, self._ack_w = os.pipe()
        for fd in (self._wake_r, self._wake_w, self._ack_r, self._ack_w):
            os.set_blocking(fd, False)
        self._blocked: queue.Queue[framed.Conn] = queue.Queue()
        self._rx_scratch = bytearray(framed.RECV_CHUNK)  # the receiver thread's
        self._tx_scratch = bytearray(framed.RECV_CHUNK)  # the sender thread's
        self._rx_thread = threading.Thread(target=self._rx_run, name="disagg-ipc-rx", daemon=True)
        self._tx_thread = threading.Thread(target=self._tx_run, name="disagg-ipc-tx", daemon=True)
        # device copies land on their own thread, so the receiver checks the next push
        # while the GPU copies this one
        self._landings: queue.Queue[_Landing] = queue.Queue()
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
        caps: m.DataCaps | None = None,
    ) -> PushHandle:
        """Announce ``pages`` to the receiver at ``endpoint``; it copies them itself.
        Called from the producer's push pool (any thread); returns at once (the sender
        thread sends). Each source is ``StoreRows`` of a registered slab, or a 2-D uint8
        tensor inside one (a device tensor outside every source is shared on the spot);
        host memory outside a registered source raises ValueError, as do malformed
        shapes and slots < -1. The rows must not change until ``poll_push`` is final:
        DONE means the receiver's copy is over; FAILED (refusal, deadline, closed) means
        no copy will start any more (the receiver starts none after ``deadline_s``)."""
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
            sr = src if isinstance(src, StoreRows) else _rows_of(src)
            if len(sr.rows) != dst.size:
                raise ValueError(f"{len(sr.rows)} source rows for {dst.size} destination slots")
            rows, dst = _wire_indices(np.asarray(sr.rows, dtype=np.int64).reshape(-1), dst)
            if not dst.size:
                continue
            export, base = self._locate(sr.slab)
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
        leading: tuple[int, ...] | None = ()  # () never cuts; None: the default (see _part_sizes)
        if (device_only or self._parts_host) and not small:
            leading = self._push_parts
        peer = self._peers.get(endpoint)  # read without the lock: a hint only
        if not endpoint.endswith(_PARTS_SUFFIX) or (
            peer is not None and (peer.inflight or peer.waiting)
        ):
            # a receiver that takes no parts; or one busy with earlier pushes, whose
            # copies this push's checks overlap anyway (parts would only add work)
            leading = ()
        pieces = _cut([rows.size for _, rows, _ in specs], _part_sizes(count, leading))
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
        _poke(self._wake_w)  # wake the sender thread out of its select

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
            _poke(self._wake_w)

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
            _poke(self._wake_w)
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
                found = sel.select(0 if ready else _POLL_MS / 1000)
                busy = bool(found)
                with self._tx_lock:
                    for key, events in found:
                        peer = key.data
                        if peer is None:
                            _drain_pipe(self._wake_r)
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
                peer.retry_at = time.monotonic() + _RETRY_S
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
        peer.retry_at = time.monotonic() + _RETRY_S

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

    # ================================ receiver ==========================================
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
                found = sel.select(0 if ready else _POLL_MS / 1000)
                busy = bool(found)
                for key, events in found:
                    conn = key.data
                    if conn is None:
                        self._rx_accept(sel, conns)
                    elif conn is _WAKE:
                        _drain_pipe(self._ack_r)
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
                    self._landings.put(_Landing(None, conn, msg.not_after, msg.transfer_id, error))
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
            _poke(self._ack_w)

    def _rx_fail(self, msg: wire.IpcFail) -> None:
        book = self._book
        with book.lock:
            rx = book.rx.get(msg.transfer_id)
            if rx is None or not _same(rx.token, msg.token):
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
            if rx is None or not _same(rx.token, msg.token) or rx.lease_id != msg.lease_id:
                self.stats["rejected_unknown"] += 1
                return f"transfer {msg.transfer_id} is not expected here (or token/lease differ)"
            if rx.state.final:
                self.stats["rejected_late"] += 1
                return f"transfer {msg.transfer_id} is already {rx.state.value}"
        # staging buffers taken before this push (earlier parts' uploads among them)
        marks = {d: len(ring.unsealed) for d, ring in self._staging.items()}
        try:  # outside the lock: staging may wait for a buffer (the book's checks take it)
            if msg.part != rx.next_part:
                raise _Refused(
                    f"part {msg.part} of transfer {msg.transfer_id} arrived where part "
                    f"{rx.next_part} was due"
                )
            plans = self._plan(rx, msg)
            with book.lock:
                if time.monotonic() > msg.not_after - COPY_MARGIN_S:
                    raise _Refused("push arrived after the sender's deadline")
                if rx.state.final:  # aborted (or expired) while it was checked
                    raise _Refused(rx.error or f"transfer {rx.transfer_id} is {rx.state.value}")
                rx.inflight += 1  # abort() waits for this; poll/expect stay free meanwhile
                rx.next_part = msg.part + 1
        except _Refused as e:
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
            landing = _Landing(rx, conn, msg.not_after, rx.transfer_id)
        landing.parts += 1
        landing.last = msg.last
        devices = landing.devices  # where copies were (or may have been) queued
        try:
            for plan in plans:
                if rx.state.final:  # aborted (or expired) between batches
                    break
                # before the copy: one that fails halfway may have queued some launches
                devices |= {r.tensor.device for r in plan.grp.regions if r.tensor.is_cuda}
                _copy(plan)
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

    def _queue_landing(self, landing: _Landing) -> str | None:
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

    def _land(self, landing: _Landing) -> str | None:
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
                landing = self._landings.get(timeout=_POLL_MS / 1000)
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

    def _plan(self, rx: Rx, msg: wire.IpcPush) -> list[_Plan]:
        """Validate every batch (and open its export) before any byte moves. A batch for
        device slots has its index arrays copied into a pinned staging buffer by the
        same pass that checks them (``ReceiverBook.accept_rows``)."""
        exports = {e.export_id: e for e in msg.exports}
        groups = self._book.groups
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
            width = batch.index_bytes
            for what, blob in (("rows", batch.rows), ("slots", batch.slots)):
                if len(blob) % width:
                    raise _Refused(
                        f"batch for group {batch.group}: {what} blob of {len(blob)} bytes "
                        f"is not {width}-byte integers"
                    )
            n = len(batch.slots) // width
            if len(batch.rows) != len(batch.slots):
                raise _Refused(
                    f"batch for group {batch.group}: {len(batch.rows) // width} source rows for {n} slots"
                )
            # row r is read up to byte base + r * row_stride + end of the export
            end = max(c + k for c, k in batch.spans)
            room = export.nbytes - batch.base - end
            row_limit = room // batch.row_stride + 1 if room >= 0 else 0
            src = self._open(export)
            grp = groups[batch.group] if batch.group < len(groups) else None
            dev = _device_of(grp)
            staged = None
            out: Any = None
            rows_at = 0
            if dev is not None:  # the check copies the arrays into a pinned buffer
                staging = self._staging.get(dev)
                if staging is None:
                    staging = self._staging[dev] = _Staging(dev)
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
                raise _Refused(why)
            assert grp is not None  # accepted: the group exists
            slots = _indices(batch.slots, width)
            rows = _indices(batch.rows, width)
            plans.append(_Plan(grp, batch, slots, rows, high + 1, src, self._prepared, staged, dev))
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
        if self._unix_path is not None:
            try:
                os.unlink(self._unix_path)
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
        self._prepared.clear()  # drops its references to mapped exports
        self._staging.clear()


@dataclass
class _Landing:
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


class _Refused(Exception):
    """A push that fails its checks: the transfer fails, the sender is told why."""


class _Plan(NamedTuple):
    """One checked batch, ready to copy."""

    grp: Group
    batch: wire.IpcBatch
    slots: np.ndarray  # views of the message's arrays (int32 or int64)
    rows: np.ndarray
    n_rows: int  # one past the highest source row (checked inside the export)
    src: torch.Tensor  # the export, uint8 1-D
    cache: Prepared  # the plane's prepared device copies
    staged: _Staged | None  # where the check copied both arrays (device slots only)
    device: torch.device | None  # the one CUDA device of every region of the group


class _Staged(NamedTuple):
    """A batch's index arrays in a pinned staging buffer: slots from byte 0, rows from
    ``rows_at`` (16-byte aligned, as ``page_copy.launch_raw`` needs)."""

    staging: _Staging
    ring_at: int  # which buffer of the ring
    nbytes: int  # bytes used: both arrays
    rows_at: int
    pages: int  # indices in each array
    dtype: torch.dtype


class _Staging:
    """The receiver thread's index staging for one device: a ring of pinned host buffers
    and one device buffer, kept from push to push (a fresh pinned tensor, its numpy view
    and a fresh device tensor per push cost ~160 us of a just-woken CPU on the H200's VM;
    reused buffers ~40). The batch check writes both index arrays of a batch into a ring
    buffer as it checks them (``take``); they go up in one host-to-device copy
    (``upload``, a direct driver call where ``cuda_driver`` has one), each starting
    16-byte aligned.

    Reuse rules: a pinned buffer is rewritten only after the completion event of the
    push that last uploaded from it fired (``seal``; waited for, rarely, when more pushes
    than buffers are in flight); a buffer taken by the push being planned is never
    handed out twice (the ring grows instead: a push has at most a few batches). The
    device buffer is rewritten by copies queued on the same stream as the kernels that
    read it, so in stream order after them."""

    RING = 8
    MIN_BYTES = 256 << 10  # each ring buffer: both index arrays of 32768 pages

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.current_stream(device)  # the receiver thread's
        self.handle = int(self.stream.cuda_stream)
        self.host: list[torch.Tensor | None] = [None] * self.RING
        self.views: list[np.ndarray] = [np.empty(0, np.uint8)] * self.RING  # numpy of host
        self.busy: list[Any] = [None] * self.RING  # the event that frees each buffer
        self.unsealed: list[int] = []  # buffers taken since the last seal()
        self.next = 0
        self.dev: torch.Tensor | None = None

    def take(self, n: int, width: int) -> _Staged:
        """A free pinned buffer for ``n`` indices of ``width`` bytes in each array."""
        off = -(-n // (16 // width)) * (16 // width)  # rows start 16-byte aligned
        nbytes = (off + n) * width
        i = self.next
        self.next = (i + 1) % len(self.host)
        if i in self.unsealed:  # this push took every buffer already: one more
            i = len(self.host)
            self.host.append(None)
            self.views.append(np.empty(0, np.uint8))
            self.busy.append(None)
        ev = self.busy[i]
        if ev is not None and not ev.query():
            ev.synchronize()  # more pushes in flight than buffers: wait for the oldest
        self.busy[i] = None
        buf = self.host[i]
        if buf is None or buf.numel() < nbytes:
            self._grow(i, nbytes)
        self.unsealed.append(i)
        return _Staged(self, i, nbytes, off * width, n, _TORCH_INT[width])

    def _grow(self, i: int, nbytes: int) -> None:
        """A pinned buffer of at least ``nbytes`` at ``i``, and the same size at every
        other ring slot that is free now: pinning memory costs ~0.1 ms of the H200's VM
        per buffer, which the first pushes through a ring would each pay otherwise
        (a bench of five pushes after one warm-up saw nothing but cold buffers)."""
        cap = max(self.MIN_BYTES, 1 << (nbytes - 1).bit_length())
        for j, buf in enumerate(self.host):
            ev = self.busy[j]
            free = j not in self.unsealed and (ev is None or ev.query())
            if (j == i or free) and (buf is None or buf.numel() < cap):
                fresh = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
                self.host[j], self.views[j] = fresh, fresh.numpy()
                self.busy[j] = None

    def upload(self, staged: _Staged) -> torch.Tensor:
        """Queue the staged arrays' copy to the device buffer (on ``stream``); returns
        the device buffer (uint8; slots from byte 0, rows from ``staged.rows_at``)."""
        nbytes = staged.nbytes
        dev = self.dev
        if dev is None or dev.numel() < nbytes:
            dev = self.dev = torch.empty(
                max(nbytes, 1 << 16), dtype=torch.uint8, device=self.device
            )
        host = self.host[staged.ring_at]
        assert host is not None
        if not cuda_driver.copy_htod_async(dev.data_ptr(), host.data_ptr(), nbytes, self.handle):
            dev[:nbytes].copy_(host[:nbytes], non_blocking=True)
        return dev

    def seal(self, event: Any) -> None:
        """The buffers taken since the last call are free once ``event`` fired."""
        for i in self.unsealed:
            self.busy[i] = event
        self.unsealed.clear()

    def drop_unsealed(self, keep: int = 0) -> None:
        """A refused push: the buffers it took (those after the first ``keep``, which
        earlier parts of pushes in parts uploaded from) were never uploaded from, so
        they are free."""
        del self.unsealed[keep:]


def _device_of(grp: Group | None) -> torch.device | None:
    """The CUDA device every region of ``grp`` lives on, or None (host, mixed, no group)."""
    if grp is None:
        return None
    dev = grp.regions[0].tensor.device
    if dev.type != "cuda" or any(r.tensor.device != dev for r in grp.regions):
        return None
    return dev


def _copy(plan: _Plan) -> set[torch.device]:
    """Copy one batch: each piece where a source span meets a destination region is one
    ``copy_indexed`` over all pages of the batch. Host copies are done on return; device
    copies are queued on the current streams of the devices returned."""
    grp, b, slots, rows, n_rows, src, _, staged, dev = plan
    if staged is not None and dev is not None:
        # Both index arrays in one host-to-device copy, from pinned memory: a copy from
        # pageable memory would block this thread until the GPU finished the copies
        # queued before it, so the next push could not be checked meanwhile.
        both = staged.staging.upload(staged)
        n, dtype, off_bytes = staged.pages, staged.dtype, staged.rows_at
        prepared = _prepared(plan.cache, grp, b, src)
        if prepared is not None:  # the usual case: views worked out by an earlier push
            base = both.data_ptr()
            for c in prepared:  # straight launches once Triton compiled the kernel
                if not launch_raw(c, n, base, base + off_bytes, dtype, staged.staging.handle):
                    off = off_bytes // dtype.itemsize
                    launch_device(c, both.view(dtype)[:n], both.view(dtype)[off : off + n])
            return {dev}
        off = off_bytes // dtype.itemsize
        dst_idx, src_idx = both.view(dtype)[:n], both.view(dtype)[off : off + n]
    else:  # host index kernels take int64 (and a copy: the message's view is read-only)
        dst_idx = torch.from_numpy(slots.astype(np.int64))
        src_idx = torch.from_numpy(rows.astype(np.int64))
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


def _prepared(
    cache: Prepared, grp: Group, b: wire.IpcBatch, src: torch.Tensor
) -> list[DeviceCopy] | None:
    """The batch's device copies over views of every row the export holds (not just
    this push's: the views then serve every push of that layout; each push's rows were
    checked to lie inside the export, and ``as_strided`` checks the views against the
    storage). None where the Triton kernel cannot do it (then ``copy_indexed``)."""
    key = (id(src), id(grp), b.base, b.row_stride, tuple(b.spans))
    hit = cache.get(key)
    if hit is not None and hit[0] is src and hit[1] is grp:
        cache.move_to_end(key)
        return hit[2]
    out = []
    for src_col, region, dst_col, length in _pieces(b.spans, [r.size for r in grp.regions]):
        first = b.base + src_col  # byte of row 0's piece; rows lie every row_stride bytes
        n_view = (src.numel() - first - length) // b.row_stride + 1
        view = src.as_strided((n_view, length), (b.row_stride, 1), src.storage_offset() + first)
        t = grp.regions[region].tensor
        c = prepare_device(t[:, dst_col : dst_col + length], view)
        if c is None:
            return None
        out.append(c)
    cache[key] = (src, grp, out)
    while len(cache) > MAX_PREPARED:
        cache.popitem(last=False)
    return out


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


def _parts_setting(push_parts: Sequence[int] | None) -> tuple[int, ...] | None:
    """The leading part sizes: the argument, else ``DISAGG_IPC_PARTS`` (comma-separated
    page counts; empty or 0: never cut), else None (the default: see ``_part_sizes``)."""
    if push_parts is None:
        env = os.environ.get("DISAGG_IPC_PARTS")
        if env is None:
            return None
        try:
            push_parts = [int(x) for x in env.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(
                f"DISAGG_IPC_PARTS={env!r}: expected comma-separated page counts, e.g. 2048,4096"
            ) from None
    out = tuple(int(n) for n in push_parts)
    if any(n < 0 for n in out):
        raise ValueError(f"push parts must be page counts >= 0, got {out}")
    return () if out in ((), (0,)) else tuple(n for n in out if n > 0)


def _part_sizes(total: int, leading: Sequence[int] | None) -> list[int]:
    """Pages per part of a push of ``total`` pages. ``leading`` None (the default): from
    PARTS_MIN_PAGES pages, the first half (at most PARTS_FIRST_MAX) and the rest; fewer
    pages travel whole. Else each leading size in turn while at least twice as many pages
    would remain after it (a short last part would cost more than it overlaps), then the
    rest as the last part."""
    if leading is None:
        if total < PARTS_MIN_PAGES:
            return [total]
        first = min(total - total // 2, PARTS_FIRST_MAX)
        return [first, total - first]
    out, left = [], total
    for n in leading:
        if left < 3 * n:
            break
        out.append(n)
        left -= n
    out.append(left)
    return out


def _cut(lengths: Sequence[int], sizes: Sequence[int]) -> list[list[tuple[int, int, int]]]:
    """Batches of ``lengths`` pages laid end to end, cut into parts of ``sizes`` pages:
    per part, its (batch, start, stop) pieces in order (no empty piece)."""
    parts: list[list[tuple[int, int, int]]] = []
    b = at = 0
    for size in sizes:
        piece = []
        while size > 0:
            take = min(size, lengths[b] - at)
            piece.append((b, at, at + take))
            size -= take
            at += take
            if at == lengths[b]:
                b, at = b + 1, 0
        parts.append(piece)
    return parts


def _wire_indices(rows: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
        return _wire_indices(rows[keep], dst[keep])
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
