"""The fallback DataPlane (``transport: zmq``): pages over plain stream sockets.

Named zmq for config compatibility; the payload travels on plain sockets (TCP for
``tcp://`` endpoints, AF_UNIX for ``ipc://``, where large pages go through a pipe, see
below); control stays on ZMQ (control.py), and no ZMQ is left in this module. A ZMQ
peer (a zmq plane from before) or a stream of another version is refused at its first
bytes, by name: both ends must be upgraded together.

Wire (stream version 2): one connection per (sender plane, receiver endpoint), opened
by the sender. It starts with the hello: ``PREAMBLE`` (``b"DGSTRM\\0"`` and one version
byte) and one payload mode byte: ``MODE_INLINE`` (payloads on the stream) or
``MODE_PIPE`` (AF_UNIX only: the read end of a pipe comes with the hello as SCM_RIGHTS
ancillary data). The receiver answers ``PREAMBLE`` and the mode it takes: ``MODE_PIPE``
when it was offered a pipe and may use it (``DISAGG_STREAM_PIPE=0`` on either end, or no
C extension, keeps ``MODE_INLINE``; the sender waits for the answer). It refuses anything
else (a ZMTP greeting, another version, garbage: ``rejected_BAD_VERSION``; an unknown
mode, a pipe over TCP, no or several descriptors, one that is not a pipe's read end:
``rejected_BAD_HELLO``) with an error naming what it saw, writes its bare preamble back
(so the sender can say which version refused it) and closes that connection only; any
descriptor that came along is closed. Then messages, each ``<u32 header length><u64
payload length>``, the msgpack header (``PageBatch`` or ``TransferDone``), and the
payload: a batch's pages in run order (``len(slots) * page_bytes`` bytes; any other
length fails the transfer). The payload follows its header on the stream, or, when the
length's top bit (``PIPED``) is set, in the pipe (a ``PIPED`` message on a connection
without a pipe closes it: ``rejected_framing``). Explicit lengths keep the stream (and
the pipe) in step past any refused header: its payload is read and dropped, and the
connection keeps serving.

Copies (plain stream): exactly one per byte per side, by the kernel. The sender ``sendmsg``s straight
from the store rows (an iovec per page column span, adjacent ones merged: whole-row runs
are one iovec); the receiver checks the batch header (``authenticate`` and
``accept_batch``: bounds, promises, counts) and then ``recvmsg``s the payload straight
into the destination slot rows of a directly registered host region. Other groups
(several regions, device regions) land in a per-connection scratch buffer and are
scattered (``Group.scatter``). The iovec loops are C (``_streamio.c``: GIL released,
IOV_MAX chunks, partial transfers, EINTR, a deadline in poll(), row indices checked
before a byte moves); without the extension a pure-Python path does the same with
``sendmsg`` / ``recv_into`` and one vectorised gather or scatter per 4 MiB (a copy more;
``DISAGG_REQUIRE_NATIVE=1`` makes a missing extension an ImportError).

The pipe (``MODE_PIPE``, batches of pages of ``PIPE_MIN_PAGE`` = 64 KiB or more): one
copy per byte in all. The sender ``vmsplice``s the store rows into the pipe (the pages
are referenced by the pipe, not copied) and the receiver, after the same header checks,
``readv``s them out of the pipe into the slots (the only copy). Because the pipe
references the rows, the sender waits for the pipe to be empty (``drain_pipe``:
FIONREAD, checked every 20 us; the last pipe-full drains in about 0.2 ms) before it
sends TransferDone and calls the push DONE: the rows are free only then, and a push
that fails before (deadline, abort, close) sends no TransferDone, so the receiver never
completes a transfer with pages read from rows the producer has reused. The pipe is
sized ``PIPE_BYTES`` or what the kernel allows (``fs.pipe-max-size``, 1 MiB here); a
smaller one (a user's pipe quota spent) keeps the plain stream. Both C loops poll the
pipe together with the stream socket, so a shutdown of the socket (``abort``, ``close``,
a peer gone) ends them at once; SIGPIPE is blocked around ``vmsplice`` (EPIPE instead).
Smaller pages stay on the stream: at 16 KiB the pipe measured slower (0.55-0.66 of the
ceiling against 0.70-0.80).

Threads: the receiver has one acceptor thread (it also expires transfers past their
deadline) and one thread per connection, which reads a header, then its payload, with
no lock held while bytes land (``Rx.inflight`` counts the write; ``abort`` shuts the
connection down to end a write in progress at once). The sender has one thread and
connection per peer endpoint: a stalled or dead consumer holds back only its own
pushes. A push is DONE on the sender once the kernel has taken its last byte and the
pipe, if any, has been read empty (the rows are no longer referenced); delivery is the
receiver's state.

Checksum: off by default. TCP and AF_UNIX deliver the bytes intact and in order, and the
receiver checks the framing itself (each batch's slots and byte count before a byte
lands, the per-group page counts at TransferDone). ``checksum=True`` (config
``transport_checksum: true``) adds xxh3-64 over the payload in wire order on both
sides (the sender gathers scattered pages to hash them; the receiver hashes the landed
slots), verified at TransferDone, only when both planes have it on.

Why (profiled on the 2-core box): the raw-socket ceiling already keeps both cores busy,
each with one kernel copy. The ZMQ version added a second receive copy (libzmq owns its
receive buffers, so every byte was copied again into the slots), two io threads, and a
sender-side gather of small scattered pages into staging buffers: 0.54-0.66 of raw TCP
and 0.40-0.42 of raw AF_UNIX at 64 KiB. Here the sender's and the receiver's threads
each make one kernel copy, like the ceiling. The calls block in the kernel (C path):
a blocking ``sendmsg`` and a ``recvmsg(MSG_WAITALL)`` move a whole batch per call, where
non-blocking calls came back to user space each time the socket buffer filled (0.70-0.80
of raw AF_UNIX that way); AF_UNIX senders also ask for a 4 MiB send buffer
(``UNIX_SNDBUF``; 1 MiB pages went from about 0.8 to 0.95-1.2 of the ceiling).

Measured (2-core AMD EPYC box, loopback, 256 MiB of random store rows of a 2N-row store
into random slots of a 2N-slot pool, median of 5, ratio against the raw socket measured
right before each row; ``disagg bench transfer --transports zmq-tcp,zmq-ipc --page-sizes
64KiB,256KiB,1MiB,4MiB --total 256MiB --repeats 5``; before: 3 runs, after: 4 runs; the
ceilings themselves moved between runs: raw TCP 1.7-4.9 GB/s, AF_UNIX 4.6-6.3 GB/s):

    ======== ========================== =========================================
    page     ZMQ (before): ratio          plain stream: ratio
    ======== ========================== =========================================
    tcp 64K  0.54-0.66 (2.3-2.6 GB/s)     0.44-1.44, median 0.90 (1.5-3.2 GB/s)
    tcp 256K 0.55-0.82                    0.68-1.09, median 0.89
    tcp 1M   0.73-0.96                    0.78-1.00, median 0.89
    tcp 4M   0.66-0.87                    0.78-1.09, median 0.95
    ipc 64K  0.40-0.42 (2.0-2.7 GB/s)     0.77-0.88, median 0.84 (4.5-5.2 GB/s)
    ipc 256K 0.46-0.55                    0.65-1.04, median 0.87
    ipc 1M   0.53-0.57                    0.87-0.99, median 0.90
    ipc 4M   0.52-0.59                    0.89-1.08, median 0.97
    ======== ========================== =========================================

Same-host pipe (``MODE_PIPE``), A/B back to back with ``DISAGG_STREAM_PIPE=0|1``,
``disagg bench transfer --transports zmq-ipc --page-sizes
16KiB,64KiB,256KiB,1MiB,4MiB --total 256MiB --repeats 5`` (12 pairs at 64K and 256K,
3 of them with ``--page-sizes 64KiB,256KiB --repeats 7``; 9 pairs at 1M and 4M); ratios
against the AF_UNIX ceiling measured right before each row, which itself moved 3.3-6.3
GB/s between rows (so the GB/s, side by side, say more; medians in brackets):

    ======== ================================== ==================================
    page     plain stream: ratio, GB/s            pipe: ratio, GB/s
    ======== ================================== ==================================
    ipc 64K  0.69-1.27 [0.86], 3.2-5.0 [4.15]     0.72-1.18 [0.93], 3.6-5.4 [4.94]
    ipc 256K 0.63-1.31 [0.89], 3.3-5.6 [4.38]     0.87-1.40 [1.06], 4.9-6.7 [5.81]
    ipc 1M   0.57-1.04 [0.89], 2.6-5.7 [4.83]     0.84-1.59 [1.13], 4.2-7.8 [6.18]
    ipc 4M   0.72-1.30 [0.91], 4.3-5.7 [4.96]     1.01-1.52 [1.19], 4.1-7.1 [6.32]
    ======== ================================== ==================================

The C loops alone (two threads, 256 MiB, random rows of a 2N-row huge-page store into
random slots, 8 MiB batches): 64 KiB 5.7-7.0 GB/s through the pipe against 5.8-5.9 over
the socket, 256 KiB 7.7 against 6.1; 16 KiB 4.5-4.9 against 4.7-5.4 (hence
``PIPE_MIN_PAGE``). A C spike (two processes, 5 x 256 MiB at 64 KiB, setup included)
used 0.28 s of system time with vmsplice + readv against 0.45 s with sendmsg + recvmsg
(0.52 s for the contiguous ceiling): the sender's copy is gone, and the freed core is
what the plane gains.

What still limits it: the receiver's single thread, which does all the copying now
(``readv`` out of 4 KiB pipe buffers into the slots) and, between batches, the header
checks in Python; the pipe holds only 1 MiB (``fs.pipe-max-size``; raising it needs
CAP_SYS_RESOURCE, refused in this container even as root), so a sender waits while the
receiver checks a header, where the socket's 4 MiB send buffer let it run ahead. At
64 KiB the plain stream's limit was the scatter itself: two threads over an AF_UNIX
socketpair (``send_rows`` / ``recv_rows``) made 5.5-6.3 GB/s between random rows and
slots against 6.7-7.2 between contiguous ones, while the ceiling is one contiguous
buffer. The rest is per-push work the ceiling does not have (planning about 1.3 ms for
4096 pages, one header check per 8 MiB batch) and the bench's own polling thread on a
2-core box.

TCP batches (``TCP_MSG_BYTES`` = 2 MiB, session 13): with 8 MiB batches the plain TCP
stream sat at 0.74-0.92 of raw TCP. Timed per batch in a steady loop
(``docs/spikes/tcp-64k/zloop.py``), the receiver's thread spent ~240 us between payloads
(the next header's wait, read and checks) while its payload phase ran only at the
sender's pace: an 8 MiB ``sendmsg`` outgrows the 4 MiB send buffer and blocks on it, so
the receiver's pause stalled the sender too. A 2 MiB batch fits the buffer: the sender
queues the next batch while the receiver checks a header, and the receiver then reads
buffered bytes (its 2 MiB payload phase at ~6.6 GB/s, the sender's at ~4.9). A/B in the
bench (6 alternating pairs, paired-median ratio, 8 MiB -> 2 MiB): 64 KiB 0.74-0.92 ->
0.87-1.08, 256 KiB 0.76-0.86 -> 0.84-0.98, 1 MiB 0.79-1.07 -> 0.87-1.07 (5 of 6 pairs
better at each), 4 MiB pages about even (0.73-0.89 -> 0.80-0.91); a sweep put 1 MiB
batches below 2 MiB and 4 MiB between. AF_UNIX keeps 8 MiB (its pipe path measured
0.96-1.19 with 8 MiB against 0.87-0.98 with 2 MiB at 64 KiB). Measured on loopback (this
2-core box; on a 16-core host the earlier settings already reached 0.90-1.06 and these
0.89-1.11: docs/perf/h200-session13); ``DISAGG_STREAM_TCP_MSG_BYTES`` sets the TCP cut.
For the same reason a TCP sender asks for a send buffer of ``TCP_SNDBUF`` (4 MiB, which
the kernel doubles) where ``net.core.wmem_max`` grants it (an explicit size ends the
kernel's autotuning, which would otherwise reach 4 MiB): a 4 MiB page is one batch, and
with autotuning its ``sendmsg`` filled the buffer. A/B in the bench (8 alternating pairs
of 64 KiB / 256 KiB / 4 MiB, 4 of 1 MiB; autotuned -> 8 MiB): 64 KiB 0.82-0.88 ->
0.88-1.06, 256 KiB 0.82-0.92 -> 0.94-1.11, 1 MiB 0.87-0.96 -> 0.95-1.12, 4 MiB
0.81-0.95 -> 0.88-0.99 (better in 4/4, 4/4, 3/4 and 7/8 pairs).
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import queue
import select
import socket
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ..protocol import messages as m
from ..protocol.errors import ProtocolError
from ..protocol.version import MAX_CONTROL_FRAME
from . import framed
from .dataplane import (
    DataPlane,
    RowsSource,
    StoreRows,
    TransferState,
    TransferStatus,
    check_store_rows,
    gather_pages,
)
from .receiver import BookedReceiver, Group, ReceiverBook, Rx

try:  # the iovec loops (_streamio.c, built at install; optional like the row copy)
    from . import _streamio
except ImportError:  # no compiler at install time: the Python path below
    _streamio = None  # type: ignore[assignment]
    if os.environ.get("DISAGG_REQUIRE_NATIVE") == "1":
        raise

log = logging.getLogger(__name__)

STREAM_MAGIC = b"DGSTRM\x00"
STREAM_VERSION = 2  # 2: the hello carries a payload mode and the receiver answers it
PREAMBLE = STREAM_MAGIC + bytes([STREAM_VERSION])
MODE_INLINE = 0  # each payload follows its header on the stream
MODE_PIPE = 1  # payloads travel on a pipe whose read end comes with the hello (AF_UNIX)
HELLO = PREAMBLE + bytes([MODE_INLINE])  # what StreamPush (tests, tools) says
# DISAGG_STREAM_PIPE=0: neither offer nor accept the pipe (A/B switch; read per plane)
PIPE_ENV = "DISAGG_STREAM_PIPE"
PIPE_BYTES = 4 << 20  # pipe size asked for; the kernel caps it (fs.pipe-max-size, 1 MiB)
MIN_PIPE_BYTES = 256 << 10  # a smaller pipe (per-user pipe quota spent): the plain stream
_PREFIX = struct.Struct("<IQ")  # header length, payload length
PIPED = 1 << 63  # payload length flag: this payload travels in the pipe (MODE_PIPE only)
PIPE_MIN_PAGE = 64 << 10  # smaller pages stay on the stream: see the module docstring
MAX_HEADER = MAX_CONTROL_FRAME  # a longer header is skipped unread and counted TOO_LARGE

MSG_BYTES = 8 << 20  # payload per batch message on AF_UNIX (one header check per this many)
# TCP batches are smaller: with 2 MiB batches 64 KiB-1 MiB pages moved at paired medians
# of 0.93-1.02 of raw TCP against 0.81-0.87 with 8 MiB (6 A/B pairs; module docstring).
# DISAGG_STREAM_TCP_MSG_BYTES overrides it (A/B switch; checked when a plane starts, read
# per push).
TCP_MSG_BYTES = 2 << 20
TCP_MSG_ENV = "DISAGG_STREAM_TCP_MSG_BYTES"
# A TCP sender asks for this send buffer (the kernel doubles it: 8 MiB), so that it can
# queue a batch or a large page while the receiver checks a header (module docstring);
# only where net.core.wmem_max grants all of it. DISAGG_STREAM_TCP_SNDBUF=0 keeps the
# kernel's autotuning (A/B switch).
TCP_SNDBUF = 4 << 20
TCP_SNDBUF_ENV = "DISAGG_STREAM_TCP_SNDBUF"
MAX_BATCH_PAGES = 1 << 16  # pages per batch (bounds a header's runs for tiny pages)
PY_CHUNK = 4 << 20  # the Python path gathers / scatters this much per step

# Sender lanes: at most this many peers at once; a lane idle this long is retired.
MAX_LANES = 256
LANE_IDLE_S = 30.0
MAX_CONNS = 256  # receiver connections at once (a thread each); more are refused
PREAMBLE_TIMEOUT_S = 10.0  # a connection that does not introduce itself by then is closed
HEADER_TIMEOUT_S = 30.0  # once a message's length prefix arrived, its header must follow
CONNECT_RETRY_S = 0.05
UNIX_SNDBUF = 4 << 20  # AF_UNIX send buffer (capped by net.core.wmem_max): see the docstring
_POLL_MS = 20

_native: Any = _streamio  # tests switch this to None to run the Python path


# ================================ payload I/O ==============================================
def send_rows(
    sock: socket.socket,
    head: bytes | None,
    arr: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    deadline: float,
) -> int:
    """Send ``head``, then columns ``cols`` (int64 ``[k, 2]`` (offset, length) pairs) of
    rows ``rows`` (int64) of ``arr`` (2-D uint8, rows contiguous, any row stride), page
    by page; returns the bytes sent. Every row and span is checked first (IndexError
    naming the first bad one). ``deadline``: ``time.monotonic()`` by which all must be
    out (TimeoutError), ``<= 0`` for none; OSError (BrokenPipeError, ...) otherwise."""
    if _native is not None:
        return int(_native.send_rows(sock.fileno(), head, arr, rows, cols, deadline))
    return _py_send_rows(sock, head, arr, rows, cols, deadline)


def recv_rows(
    sock: socket.socket, arr: np.ndarray, rows: np.ndarray, cols: np.ndarray, deadline: float
) -> int:
    """Receive into columns ``cols`` of rows ``rows`` of ``arr`` (writable), in that
    order: the mirror of ``send_rows``. ConnectionError when the peer closes first."""
    if _native is not None:
        return int(_native.recv_rows(sock.fileno(), arr, rows, cols, deadline))
    return _py_recv_rows(sock, arr, rows, cols, deadline)


def splice_rows(
    pipe_fd: int,
    watch: socket.socket,
    arr: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    deadline: float,
) -> int:
    """``send_rows`` into a pipe with ``vmsplice``: the pages are referenced, not copied,
    so they must stay unchanged until ``drain_pipe`` returned. Ends (ConnectionError)
    when ``watch``, the stream socket, is shut down or hangs up; needs the extension."""
    return int(_streamio.splice_rows(pipe_fd, watch.fileno(), arr, rows, cols, deadline))


def recv_pipe_rows(
    pipe_fd: int,
    watch: socket.socket,
    arr: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    deadline: float,
) -> int:
    """``recv_rows`` from a non-blocking pipe (``readv``: the only copy of the pipe
    path); ConnectionError at the pipe's EOF or when ``watch`` is shut down (abort)."""
    return int(_streamio.recv_rows(pipe_fd, arr, rows, cols, deadline, watch.fileno()))


def drain_pipe(pipe_fd: int, watch: socket.socket, deadline: float) -> None:
    """Wait until the receiver has read every byte in the pipe (its rows are free)."""
    _streamio.pipe_drain(pipe_fd, watch.fileno(), deadline)


def open_pipe() -> tuple[int, int] | None:
    """A pipe for the payload, ``(read end, write end)``, both close-on-exec and
    non-blocking, sized ``PIPE_BYTES`` or what the kernel allows; None when no pipe of
    ``MIN_PIPE_BYTES`` can be had (the caller keeps the plain stream)."""
    try:
        r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        size = 0
        for want in (PIPE_BYTES, _pipe_max()):
            try:
                size = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, want)
                break
            except OSError:  # above fs.pipe-max-size, or this user's pipe quota is spent
                continue
        if size >= MIN_PIPE_BYTES:
            return r, w
    except OSError:
        pass
    os.close(r)
    os.close(w)
    return None


def _sysctl(name: str, default: int) -> int:
    """An integer kernel setting (``/proc/sys/<name>``), or ``default`` when unreadable."""
    try:
        with open(f"/proc/sys/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return default


def _pipe_max() -> int:
    return _sysctl("fs/pipe-max-size", 1 << 20)


def _check(arr: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> int:
    """The C extension's checks (same errors); returns bytes per row."""
    if arr.ndim != 2 or arr.itemsize != 1:
        raise ValueError(f"rows must be a 2-D byte array, got {arr.ndim}-D")
    nrows, width = arr.shape
    if width > 1 and arr.strides[1] != 1:
        raise ValueError("rows must be contiguous (stride 1 within a row)")
    c = np.asarray(cols, dtype=np.int64).reshape(-1, 2)
    if c.shape[0] == 0:
        raise ValueError("cols must be one or more (offset, length) pairs")
    bad = np.flatnonzero((c[:, 0] < 0) | (c[:, 1] < 1) | (c[:, 0] + c[:, 1] > width))
    if bad.size:
        j = int(bad[0])
        raise IndexError(
            f"column span {j} (offset {c[j, 0]}, length {c[j, 1]}) outside rows of {width} bytes"
        )
    bad = np.flatnonzero((rows < 0) | (rows >= nrows))
    if bad.size:
        i = int(bad[0])
        raise IndexError(f"row {int(rows[i])} (index {i}) outside {nrows} rows")
    return int(c[:, 1].sum())


def _wait(sock: socket.socket, events: int, deadline: float, what: str) -> None:
    timeout = None
    if deadline > 0:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"deadline passed with {what}")
        timeout = max(1, math.ceil(left * 1000))
    p = select.poll()
    p.register(sock, events)
    if not p.poll(timeout):
        raise TimeoutError(f"deadline passed with {what}")


def _send_all(sock: socket.socket, bufs: list[Any], deadline: float, done: int, total: int) -> int:
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    flags = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
    while views:
        try:
            n = sock.sendmsg(views[:1024], [], flags)
        except BlockingIOError:
            _wait(sock, select.POLLOUT, deadline, f"{done} of {total} payload bytes sent")
            continue
        done += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
    return done


def _recv_all(sock: socket.socket, mv: memoryview, deadline: float, done: int, total: int) -> int:
    got, size = 0, len(mv)
    while got < size:
        try:
            n = sock.recv_into(mv[got:], size - got, socket.MSG_DONTWAIT)
        except BlockingIOError:
            _wait(sock, select.POLLIN, deadline, f"{done + got} of {total} payload bytes received")
            continue
        if n == 0:
            raise ConnectionError(
                f"peer closed the connection with {done + got} of {total} payload bytes received"
            )
        got += n
    return done + got


def _runs_of(rows: np.ndarray) -> bool:
    return rows.size < 2 or bool((np.diff(rows) == 1).all())


def _py_send_rows(
    sock: socket.socket,
    head: bytes | None,
    arr: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    deadline: float,
) -> int:
    per_row = _check(arr, rows, cols)
    c = np.asarray(cols, dtype=np.int64).reshape(-1, 2)
    total = rows.size * per_row + (len(head) if head else 0)
    first: list[Any] = [head] if head else []
    whole = c.shape[0] == 1 and c[0, 0] == 0 and c[0, 1] == arr.shape[1]
    if rows.size and whole and _runs_of(rows) and arr[:1].flags.c_contiguous:
        r0 = int(rows[0])
        block = arr[r0 : r0 + rows.size]
        if block.flags.c_contiguous:  # one run of rows back to back: send in place
            return _send_all(sock, [*first, block.reshape(-1)], deadline, 0, total)
    spans = tuple((int(o), int(n)) for o, n in c)
    per = max(1, PY_CHUNK // max(1, per_row))
    buf = np.empty(min(per, rows.size) * per_row, dtype=np.uint8)
    done = 0
    for s in range(0, rows.size, per):  # one vectorised gather per chunk, not per page
        part = rows[s : s + per]
        out = buf[: part.size * per_row]
        gather_pages(out, arr, part, spans)
        done = _send_all(sock, [*first, out], deadline, done, total)
        first = []
    if first:
        done = _send_all(sock, first, deadline, done, total)
    return done


def _py_recv_rows(
    sock: socket.socket, arr: np.ndarray, rows: np.ndarray, cols: np.ndarray, deadline: float
) -> int:
    per_row = _check(arr, rows, cols)
    if not arr.flags.writeable:
        raise ValueError("the destination rows are read-only")
    c = np.asarray(cols, dtype=np.int64).reshape(-1, 2)
    total = rows.size * per_row
    whole = c.shape[0] == 1 and c[0, 0] == 0 and c[0, 1] == arr.shape[1]
    if rows.size and whole and _runs_of(rows):
        r0 = int(rows[0])
        block = arr[r0 : r0 + rows.size]
        if block.flags.c_contiguous:  # one run of rows back to back: receive in place
            return _recv_all(sock, block.reshape(-1).data, deadline, 0, total)
    per = max(1, PY_CHUNK // max(1, per_row))
    buf = np.empty(min(per, rows.size) * per_row, dtype=np.uint8)
    done = 0
    for s in range(0, rows.size, per):  # receive a chunk, then one scatter per span
        part = rows[s : s + per]
        pages = buf[: part.size * per_row]
        done = _recv_all(sock, pages.data, deadline, done, total)
        pages = pages.reshape(part.size, per_row)
        col = 0
        for o, n in c.tolist():
            arr[part, o : o + n] = pages[:, col : col + n]
            col += n
    return done


def _send_bytes(sock: socket.socket, data: bytes, deadline: float) -> None:
    send_rows(sock, data, _NOTHING, _NO_ROWS, _ONE_COL, deadline)


_NOTHING = np.zeros((1, 1), dtype=np.uint8)
_NO_ROWS = np.zeros(0, dtype=np.int64)
_ONE_COL = np.array([[0, 1]], dtype=np.int64)


def _shutdown(sock: socket.socket | None) -> None:
    """Wake a thread blocked on ``sock`` (its reads see EOF, its writes EPIPE)."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed or never connected
            pass


def frame(header: bytes, payload_len: int, piped: bool = False) -> bytes:
    """A message's length prefix and header (its payload follows on the stream)."""
    return _PREFIX.pack(len(header), payload_len | (PIPED if piped else 0)) + header


class StreamPush:
    """A blocking client of the stream wire, for tests and tools that hand-make (or
    forge) messages: ``send_multipart([header, *payload])`` sends one message, its
    payload the concatenation of the rest, like the ZMQ PUSH socket it replaces."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0, preamble: bytes = HELLO):
        family, addr = framed.sockaddr(endpoint)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(addr)
        if preamble:
            self.sock.sendall(preamble)

    def send_multipart(self, frames: Sequence[bytes]) -> None:
        head, payload = bytes(frames[0]), b"".join(bytes(f) for f in frames[1:])
        self.sock.sendall(frame(head, len(payload)) + payload)

    def send(self, data: bytes) -> None:
        self.send_multipart([data])

    def close(self) -> None:
        self.sock.close()


# ================================ the plane ================================================
@dataclass
class _Batch:
    """One planned message: its prefix and PageBatch header, and its source rows."""

    head: bytes
    rows: np.ndarray  # int64, contiguous: rows of the source's ``arr``
    nbytes: int


@dataclass
class _Source:
    """One group's pages of a push: ``arr`` (a 2-D uint8 view of the slab or tensor,
    kept alive by ``keep``), the column spans of a page, and its batches."""

    arr: np.ndarray
    cols: np.ndarray  # int64 [k, 2]
    keep: torch.Tensor
    batches: list[_Batch]

    @property
    def page_bytes(self) -> int:
        return int(self.cols[:, 1].sum())


@dataclass
class _Lane:
    """Pushes to one peer endpoint, in order, on their own thread and connection."""

    endpoint: str
    jobs: queue.Queue[PushHandle | None] = field(default_factory=queue.Queue)
    sock: socket.socket | None = None
    pipe: int | None = None  # the payload pipe's write end (MODE_PIPE), else None
    thread: threading.Thread = field(default=None)  # type: ignore[assignment]
    closing: bool = False


@dataclass(eq=False)  # kept in a set: hashed by identity
class _Conn:
    """One accepted connection: its thread reads message after message."""

    sock: socket.socket
    peer: str
    thread: threading.Thread = field(default=None)  # type: ignore[assignment]
    pipe: int | None = None  # the payload pipe's read end (MODE_PIPE), else None
    writing: Rx | None = None  # the transfer whose payload is landing now
    scratch: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    skip: bytearray = field(default_factory=lambda: bytearray(1 << 20))


@dataclass
class PushHandle:
    """Sender-side handle returned by ``post_push``."""

    transfer_id: int
    endpoint: str
    deadline: float
    plan: list[_Source]
    pages: int
    lease_id: int
    token: bytes
    state: TransferState = TransferState.PENDING
    error: str | None = None
    nbytes: int = 0

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.error, self.pages, self.nbytes)


class _Closed(Exception):
    """The plane is closing: the connection thread ends."""


class ZmqDataPlane(BookedReceiver, DataPlane):
    """Both DataPlane sides over plain stream sockets (see the module docstring; the name
    is the config's). ``bind`` is the receiver endpoint (``tcp://host:0`` picks a port,
    ``ipc://path``); ``advertise`` replaces the bound address in ``endpoint`` when peers
    must use another name (e.g. bound on 0.0.0.0). ``checksum``: hash payloads with
    xxh3-64 and verify at the receiver (default off; verified only when both planes have
    it on)."""

    accepts_store_rows = True  # producers hand StoreRows: pages leave from the store rows

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        advertise: str | None = None,
        context: object | None = None,  # accepted for compatibility; unused
        checksum: bool = False,
    ) -> None:
        self.checksum = checksum
        # same-host payloads on a pipe (offered as a sender, accepted as a receiver)
        self.pipe = os.environ.get(PIPE_ENV, "1") != "0"
        _msg_bytes("tcp://")  # a malformed DISAGG_STREAM_TCP_MSG_BYTES fails here, not per push
        self.stats: Counter[str] = Counter()
        self._book = ReceiverBook(self.stats, checksum=checksum)
        self._stop = threading.Event()
        self._listener, bound = framed.listen(bind)
        self._ipc_path = bound[len("ipc://") :] if bound.startswith("ipc://") else None
        self._endpoint = advertise or bound
        self._conns: set[_Conn] = set()
        self._conns_lock = threading.Lock()
        self._refusals_logged = 0

        # One sender lane (queue, thread, connection) per peer endpoint: a dead or slow
        # peer holds up only its own pushes, never another consumer's.
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
        """Accept connections (a thread each) and expire transfers past their deadline."""
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        last_sweep = 0.0
        try:
            while not self._stop.is_set():
                if poller.poll(_POLL_MS):
                    self._accept()
                last_sweep = self._sweep_if_due(last_sweep)
        finally:
            self._listener.close()
            if self._ipc_path is not None:
                try:
                    os.unlink(self._ipc_path)
                except OSError:
                    pass
            with self._conns_lock:
                conns = list(self._conns)
            for c in conns:
                _shutdown(c.sock)
            for c in conns:
                c.thread.join(2.0)
            self._fail_all_closed()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                log.exception("data plane accept failed")
                return
            with self._conns_lock:
                if len(self._conns) >= MAX_CONNS:
                    self.stats["rejected_conns"] += 1
                    sock.close()
                    continue
                conn = _Conn(sock, str(addr) if addr else "local")
                self._conns.add(conn)
            sock.setblocking(False)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.thread = threading.Thread(
                target=self._conn_run, args=(conn,), name="disagg-dp-conn", daemon=True
            )
            conn.thread.start()

    def _conn_run(self, conn: _Conn) -> None:
        try:
            if self._preamble(conn):
                while not self._stop.is_set() and self._rx_message(conn):
                    pass
        except _Closed:
            pass
        except (ConnectionError, TimeoutError) as e:  # between messages: that peer only
            log.info("data plane connection from %s closed: %s", conn.peer, e)
        except Exception:  # never let one connection take the receiver down
            log.exception("data plane receiver error")
            self.stats["internal_error"] += 1
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.sock.close()
            if conn.pipe is not None:
                os.close(conn.pipe)
                conn.pipe = None

    def _read(
        self, conn: _Conn, n: int, timeout_s: float | None, fds: list[int] | None = None
    ) -> bytes | None:
        """``n`` bytes of the connection; None when the peer closed before the first one.
        ``timeout_s``: None waits for as long as the plane runs. ``fds``: collect the
        file descriptors that come with the bytes (SCM_RIGHTS; the caller closes them)."""
        buf = bytearray(n)
        mv = memoryview(buf)
        got = 0
        end = None if timeout_s is None else time.monotonic() + timeout_s
        poller = None  # made on the first wait: a header is usually there already
        while got < n:
            try:
                if fds is None or conn.sock.family != socket.AF_UNIX:
                    k = conn.sock.recv_into(mv[got:], n - got)
                else:
                    k = _recv_with_fds(conn.sock, mv[got:], fds)
            except (BlockingIOError, InterruptedError):
                k = -1
            if k == 0:
                if got == 0:
                    return None
                raise ConnectionError(f"peer closed the connection inside a {n}-byte header")
            if k > 0:
                got += k
                continue
            if self._stop.is_set():
                raise _Closed
            wait = _POLL_MS
            if end is not None:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{got} of {n} header bytes arrived in {timeout_s} s")
                wait = min(wait, max(1, math.ceil(left * 1000)))
            if poller is None:
                poller = select.poll()
                poller.register(conn.sock, select.POLLIN)
            poller.poll(wait)
        return bytes(buf)

    def _preamble(self, conn: _Conn) -> bool:
        """The hello: ``PREAMBLE`` and a payload mode byte (with the pipe's read end for
        MODE_PIPE); answered with ``PREAMBLE`` and the mode this receiver takes, or
        refused (``PREAMBLE`` alone, then the connection closes). False: closed."""
        fds: list[int] = []
        try:
            return self._hello(conn, fds)
        finally:
            for fd in fds:  # any descriptor that came along and was not taken
                os.close(fd)

    def _hello(self, conn: _Conn, fds: list[int]) -> bool:
        try:
            got = self._read(conn, len(PREAMBLE), PREAMBLE_TIMEOUT_S, fds)
        except TimeoutError:
            got = b"(nothing in time)"
        if got is None:
            return False
        if got == PREAMBLE:
            try:
                mode = self._read(conn, 1, PREAMBLE_TIMEOUT_S, fds)
            except TimeoutError:
                mode = b""
            if mode is None:
                return False
            why = self._payload_mode(conn, mode, fds)
            if why is None:
                answer = PREAMBLE + bytes([MODE_INLINE if conn.pipe is None else MODE_PIPE])
                try:
                    _send_bytes(conn.sock, answer, time.monotonic() + PREAMBLE_TIMEOUT_S)
                except OSError as e:
                    log.info("data plane connection from %s closed: %s", conn.peer, e)
                    return False
                return True
            return self._refuse(conn, "rejected_BAD_HELLO", why)
        if got[: len(STREAM_MAGIC)] == STREAM_MAGIC:
            why = f"stream protocol version {got[-1]}, this receiver speaks {STREAM_VERSION}"
        elif got[:1] == b"\xff":
            why = (
                "the peer speaks ZMTP (a ZMQ socket, such as a zmq data plane from before "
                "the payload moved to plain sockets): upgrade the sender"
            )
        else:
            why = f"not a disagg data stream (preamble {got!r})"
        return self._refuse(conn, "rejected_BAD_VERSION", why)

    def _payload_mode(self, conn: _Conn, mode: bytes, fds: list[int]) -> str | None:
        """Take the hello's payload mode (sets ``conn.pipe`` for an accepted pipe);
        returns why the hello is refused, or None."""
        if not mode:
            return "no payload mode after the preamble"
        if mode[0] == MODE_INLINE:
            if fds:
                return f"{len(fds)} file descriptor(s) came with an inline stream's hello"
            return None
        if mode[0] != MODE_PIPE:
            return f"unknown payload mode {mode[0]}"
        if conn.sock.family != socket.AF_UNIX:
            return "a payload pipe offered over TCP (same-host AF_UNIX streams only)"
        if len(fds) != 1:
            return f"the pipe payload mode needs one file descriptor, {len(fds)} came"
        try:
            st = os.fstat(fds[0])
            acc = fcntl.fcntl(fds[0], fcntl.F_GETFL) & os.O_ACCMODE
        except OSError as e:
            return f"the payload pipe cannot be inspected: {e}"
        if not stat.S_ISFIFO(st.st_mode) or acc != os.O_RDONLY:
            return "the payload pipe is not the read end of a pipe"
        if self.pipe and _native is not None:  # else answer MODE_INLINE (fd closed)
            conn.pipe = fds.pop()
            os.set_blocking(conn.pipe, False)  # recv_pipe_rows polls it with the socket
        return None

    def _refuse(self, conn: _Conn, stat_key: str, why: str) -> bool:
        with self._book.lock:
            self.stats[stat_key] += 1
            self._refusals_logged += 1
        if self._refusals_logged <= 10:  # a reconnecting ZMQ peer comes back every 100 ms
            log.warning("data plane refused a connection from %s: %s", conn.peer, why)
        try:  # tell a stream peer of another version which one this is
            conn.sock.send(PREAMBLE, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError:
            pass
        return False

    def _skip(self, conn: _Conn, n: int, piped: bool) -> bool:
        """Read and drop ``n`` bytes of a refused message (from the pipe when ``piped``,
        else from the stream); False on EOF."""
        buf = np.frombuffer(conn.skip, dtype=np.uint8).reshape(1, -1)
        cols = np.array([[0, buf.shape[1]]], dtype=np.int64)
        row = np.zeros(1, dtype=np.int64)
        while n > 0:
            if self._stop.is_set():
                raise _Closed
            k = min(n, buf.shape[1])
            if k < buf.shape[1]:
                cols = np.array([[0, k]], dtype=np.int64)
            try:
                end = time.monotonic() + HEADER_TIMEOUT_S
                self._recv_payload(conn, piped, buf, row, cols, end)
            except ConnectionError:
                return False
            n -= k
        return True

    def _rx_message(self, conn: _Conn) -> bool:
        """Read one message and act on it; False when the connection is done."""
        pre = self._read(conn, _PREFIX.size, None)
        if pre is None:
            return False
        hlen, plen = _PREFIX.unpack(pre)
        piped = bool(plen & PIPED)
        plen &= ~PIPED
        if piped and conn.pipe is None:  # where its payload is cannot be known: out of step
            with self._book.lock:
                self.stats["rejected_framing"] += 1
            log.warning(
                "data plane connection from %s closed: a message's payload was said to be "
                "in a pipe, and this stream has none",
                conn.peer,
            )
            return False
        if hlen > MAX_HEADER:
            with self._book.lock:
                self.stats["rejected_TOO_LARGE"] += 1
            return self._skip(conn, hlen, False) and self._skip(conn, plen, piped)
        head = self._read(conn, hlen, HEADER_TIMEOUT_S) if hlen else b""
        if head is None:
            return False
        try:
            msg = m.decode(head)
        except ProtocolError as e:
            with self._book.lock:  # connection threads count into one Counter
                self.stats["rejected_" + e.code.name] += 1
            return self._skip(conn, plen, piped)
        book = self._book
        land: tuple[Rx, m.PageBatch, Group, np.ndarray] | None = None
        with book.lock:
            rx = book.authenticate(msg)
            if rx is not None and isinstance(msg, m.TransferDone):
                if plen:
                    self.stats["rejected_batch"] += 1
                    book.fail(rx, f"the sender's TransferDone carried {plen} payload bytes")
                else:
                    book.on_done(rx, msg)
            elif rx is not None and isinstance(msg, m.PageBatch):
                why, slots, _ = book.accept_runs(rx, msg)
                if why is None:
                    assert slots is not None  # checked: bounds, counts and promises
                    grp = book.groups[msg.group]
                    want = int(slots.size) * msg.page_bytes
                    if plen != want:
                        self.stats["rejected_batch"] += 1
                        book.fail(
                            rx,
                            f"batch for group {msg.group} carries {plen} payload bytes, "
                            f"its {slots.size} pages take {want}",
                        )
                    else:
                        rx.inflight += 1  # abort waits for it (or ends it: see abort)
                        conn.writing = rx
                        land = (rx, msg, grp, slots)
            if rx is not None and rx.state.final:
                book.cond.notify_all()  # wake wait()
        if land is None:
            return self._skip(conn, plen, piped)
        return self._land(conn, piped, *land)

    def _land(
        self, conn: _Conn, piped: bool, rx: Rx, h: m.PageBatch, grp: Group, slots: np.ndarray
    ) -> bool:
        """Receive a checked batch's payload straight into its slots (a directly
        registered region) or through the connection's scratch buffer; no lock held."""
        pb = h.page_bytes
        total = int(slots.size) * pb
        error = None
        try:
            if grp.direct is not None:
                cols = np.array([[0, pb]], dtype=np.int64)
                self._recv_payload(conn, piped, grp.direct, slots, cols, rx.deadline)
                if rx.hasher is not None:
                    s0 = int(slots[0])
                    run = _runs_of(slots)
                    rx.hasher.update(grp.direct[s0 : s0 + slots.size] if run else grp.direct[slots])
            else:
                if conn.scratch.numel() < total:
                    pin = torch.cuda.is_available()  # pinned host memory copies to a GPU faster
                    conn.scratch = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
                flat = conn.scratch.numpy()[:total]
                cols = np.array([[0, total]], dtype=np.int64)
                one = np.zeros(1, np.int64)
                self._recv_payload(conn, piped, flat.reshape(1, -1), one, cols, rx.deadline)
                if rx.hasher is not None:
                    rx.hasher.update(flat)
                grp.scatter(slots, flat.reshape(-1, pb))
        except TimeoutError as e:
            error = f"batch for group {h.group} missed the transfer's deadline: {e}"
        except OSError as e:  # ConnectionError: the peer went away mid-payload
            error = f"batch for group {h.group} broke off: {e}"
            if self._stop.is_set():
                error = "data plane closed"
        except Exception as e:  # e.g. a device scatter: still end the write's accounting
            log.exception("data plane receiver error")
            self.stats["internal_error"] += 1
            error = f"batch for group {h.group} could not land: {e}"
        book = self._book
        with book.lock:
            rx.inflight -= 1
            conn.writing = None
            if error is not None:
                self.stats["payload_broken"] += 1
                book.fail(rx, error)
            elif not rx.state.final:
                book.landed(rx, h.group, int(slots.size), total)
                book.maybe_finish(rx)
            book.cond.notify_all()
        return error is None  # after a broken payload the stream is out of step: close

    def _recv_payload(
        self,
        conn: _Conn,
        piped: bool,
        arr: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        deadline: float,
    ) -> None:
        if piped and conn.pipe is not None:
            recv_pipe_rows(conn.pipe, conn.sock, arr, rows, cols, deadline)
        else:
            recv_rows(conn.sock, arr, rows, cols, deadline)

    def abort(self, transfer_id: int, reason: str = "aborted") -> int:
        """Fail the transfer; a payload of it landing now is cut off at once (its
        connection is shut down: the sender's push fails, later pushes reconnect)."""
        book = self._book
        with book.lock:
            rx = book.rx.get(transfer_id)
            if rx is not None and not rx.state.final:
                book.fail(rx, reason)
            if rx is not None and rx.inflight:
                with self._conns_lock:
                    for c in self._conns:
                        if c.writing is rx:
                            _shutdown(c.sock)
        return super().abort(transfer_id, reason)

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
        """Queue ``pages`` for the peer at ``endpoint``; returns at once. Each source is
        a uint8 ``[n, page_bytes]`` tensor or ``StoreRows`` of a host slab (left in place:
        the kernel reads the pages from the rows). The rows must not change until
        ``poll_push`` is final. Malformed sources raise ValueError."""
        plan: list[_Source] = []
        npages = 0
        per_msg = _msg_bytes(endpoint)
        for group, rows, dst_slots in pages:
            src, n = _plan_group(
                transfer_id, lease_id, bytes(token), group, rows, dst_slots, per_msg
            )
            plan.append(src)
            npages += n
        handle = PushHandle(
            transfer_id,
            endpoint,
            time.monotonic() + deadline_s,
            plan,
            npages,
            lease_id,
            bytes(token),
        )
        with self._lanes_lock:
            if self._stop.is_set():
                handle.state, handle.error = TransferState.FAILED, "data plane closed"
                return handle
            lane = self._lanes.get(endpoint)
            if lane is None or lane.closing:
                if len(self._lanes) >= MAX_LANES:
                    handle.state = TransferState.FAILED
                    handle.error = f"too many peers at once ({MAX_LANES})"
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
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > LANE_IDLE_S:
                    with self._lanes_lock:  # retire: a later push to this peer starts anew
                        if lane.jobs.empty():
                            lane.closing = True
                            self._lanes.pop(lane.endpoint, None)
                            return
        finally:
            while not lane.jobs.empty():
                h = lane.jobs.get_nowait()
                if h is not None and not h.state.final:
                    h.state, h.error = TransferState.FAILED, "data plane closed"
            self._tx_drop_socket(lane)

    def _tx_drop_socket(self, lane: _Lane) -> None:
        sock, lane.sock = lane.sock, None
        pipe, lane.pipe = lane.pipe, None
        if sock is not None:
            sock.close()
        if pipe is not None:  # pages still in it stay readable; no TransferDone follows them
            os.close(pipe)

    def _tx_socket(self, lane: _Lane, h: PushHandle) -> socket.socket | None:
        """The lane's connection, (re)connected and introduced; None when the push failed
        (its deadline passed while the peer refused connections, or the plane closed)."""
        sock = lane.sock
        if sock is not None:
            # the receiver never writes unless it refused us or went away: readable
            # means this connection is dead (a restarted peer); start a fresh one
            p = select.poll()
            p.register(sock, select.POLLIN)
            if p.poll(0):
                self._tx_drop_socket(lane)
                sock = None
        if sock is not None:
            return sock
        last = "no connection yet"
        while True:
            if self._stop.is_set():
                self._tx_fail(h, "data plane closed")
                return None
            left = h.deadline - time.monotonic()
            if left <= 0:
                self._tx_fail(
                    h, f"peer {h.endpoint} did not take the data before the deadline ({last})"
                )
                return None
            try:
                sock, ready = framed.connect(h.endpoint)
            except ValueError as e:  # not an endpoint we can reach: fail now
                self._tx_fail(h, f"send to {h.endpoint} failed: {e}")
                return None
            except OSError as e:
                last = f"connect: {e}"
                time.sleep(min(CONNECT_RETRY_S, max(left, 0)))
                continue
            try:
                if not ready:
                    p = select.poll()
                    p.register(sock, select.POLLOUT)
                    p.poll(max(1, math.ceil(min(left, 1.0) * 1000)))
                    framed.finish_connect(sock)
                if sock.family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    _ask_tcp_sndbuf(sock)
                elif UNIX_SNDBUF:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
                pipe = self._tx_hello(sock, h)
            except _Refused as e:  # a receiver that will not take this stream: fail now
                sock.close()
                self._tx_fail(h, f"send to {h.endpoint} failed: {e}")
                return None
            except OSError as e:  # refused or reset: the peer is not (yet) there
                sock.close()
                last = f"connect: {e}"
                time.sleep(min(CONNECT_RETRY_S, max(h.deadline - time.monotonic(), 0)))
                continue
            lane.sock, lane.pipe = sock, pipe
            return sock

    def _tx_hello(self, sock: socket.socket, h: PushHandle) -> int | None:
        """Say the hello (offering the pipe on AF_UNIX when this plane may) and read the
        receiver's answer; returns the pipe's write end when the receiver took it, None
        for the plain stream. _Refused when the receiver refused the stream, OSError
        when the connection failed (the caller retries)."""
        pipe = None
        if sock.family == socket.AF_UNIX and self.pipe and _native is not None:
            pipe = open_pipe()
        try:
            end = min(h.deadline, time.monotonic() + PREAMBLE_TIMEOUT_S)
            if pipe is None:
                _send_bytes(sock, HELLO, end)
            else:
                _wait(sock, select.POLLOUT, end, "the hello unsent")
                socket.send_fds(sock, [PREAMBLE + bytes([MODE_PIPE])], [pipe[0]])
                os.close(pipe[0])  # the receiver's copy is the only read end left
                pipe = (-1, pipe[1])
            got = _read_upto(sock, len(PREAMBLE) + 1, end, self._stop)
            if got[: len(PREAMBLE)] != PREAMBLE or len(got) <= len(PREAMBLE):
                raise _Refused(_answer_refused(got))
            if got[-1] == MODE_PIPE and pipe is not None:
                return pipe[1]
            if got[-1] != MODE_INLINE:
                raise _Refused(f"the receiver answered with payload mode {got[-1]}")
        except BaseException:
            if pipe is not None:
                os.close(pipe[1])
                if pipe[0] >= 0:
                    os.close(pipe[0])
            raise
        if pipe is not None:  # the receiver keeps to the plain stream
            os.close(pipe[1])
        return None

    def _tx_send(self, lane: _Lane, h: PushHandle) -> None:
        hasher = xxhash.xxh3_64() if self.checksum else None
        h.state = TransferState.RECEIVING
        sock = None
        try:
            sock = self._tx_socket(lane, h)
            if sock is None:
                return
            pipe = lane.pipe
            for src in h.plan:
                for b in src.batches:
                    if not self._wait_writable(sock, h):
                        self._tx_drop_socket(lane)
                        return
                    if hasher is not None:
                        hasher.update(_gathered(src, b).data)
                    if pipe is None or src.page_bytes < PIPE_MIN_PAGE:
                        send_rows(sock, b.head, src.arr, b.rows, src.cols, h.deadline)
                    else:  # the header on the stream (flagged), the pages into the pipe
                        hlen, plen = _PREFIX.unpack_from(b.head)
                        _send_bytes(
                            sock,
                            _PREFIX.pack(hlen, plen | PIPED) + b.head[_PREFIX.size :],
                            h.deadline,
                        )
                        splice_rows(pipe, sock, src.arr, b.rows, src.cols, h.deadline)
                    h.nbytes += b.nbytes
            if pipe is not None:
                # the pipe references the rows' pages until the receiver has copied them
                # out: only then are the rows free, and only then may TransferDone go
                # (a push that fails before sends none, so no transfer completes with
                # pages read from rows the producer reused)
                drain_pipe(pipe, sock, h.deadline)
            done = m.TransferDone(
                transfer_id=h.transfer_id,
                lease_id=h.lease_id,
                token=h.token,
                checksum=hasher.intdigest() if hasher is not None else 0,
            )
            header = m.encode(done)
            _send_bytes(sock, frame(header, 0), h.deadline)
            # the kernel holds every byte now (the receiver has read the pipe): the rows
            # are free again
            h.state = TransferState.DONE
            h.plan = []
            self.stats["push_done"] += 1
        except TimeoutError as e:
            self._tx_fail(h, f"peer {h.endpoint} did not take the data before the deadline ({e})")
            self._tx_drop_socket(lane)
        except OSError as e:
            why = f"send to {h.endpoint} failed: {e}{_refusal(sock)}"
            self._tx_fail(h, "data plane closed" if self._stop.is_set() else why)
            self._tx_drop_socket(lane)

    def _wait_writable(self, sock: socket.socket, h: PushHandle) -> bool:
        """Before each message: False (the push failed) once the deadline passed or the
        plane closed while the peer took nothing."""
        p = select.poll()
        p.register(sock, select.POLLOUT)
        while not self._stop.is_set():
            left = h.deadline - time.monotonic()
            if left <= 0:
                self._tx_fail(h, f"peer {h.endpoint} did not take the data before the deadline")
                return False
            if p.poll(max(1, min(math.ceil(left * 1000), 100))):
                return True
        self._tx_fail(h, "data plane closed")
        return False

    def _tx_fail(self, h: PushHandle, why: str) -> None:
        if not h.state.final:
            h.state, h.error = TransferState.FAILED, why
            self.stats["push_failed"] += 1
        h.plan = []

    # ================================= common ===========================================
    def close(self) -> None:
        self._stop.set()
        with self._lanes_lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            _shutdown(lane.sock)  # a send blocked on a stalled peer ends now
        for t in [self._rx_thread, *(lane.thread for lane in lanes)]:
            t.join(5.0)


class _Refused(Exception):
    """The receiver refused the hello (another stream version, a bad hello)."""


def _read_upto(sock: socket.socket, n: int, deadline: float, stop: threading.Event) -> bytes:
    """Up to ``n`` bytes: fewer only when the peer closed the connection first.
    TimeoutError at ``deadline``; OSError when nothing came before the close (a
    receiver that went away, or refused connections: the caller retries) or when
    ``stop`` is set (the plane closes)."""
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except (BlockingIOError, InterruptedError):
            if stop.is_set():
                raise ConnectionAbortedError("data plane closed") from None
            try:  # in slices, to see stop
                _wait(sock, select.POLLIN, min(deadline, time.monotonic() + 0.05), "")
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"deadline passed with {len(buf)} of {n} answer bytes received"
                    ) from None
            continue
        except OSError:  # a reset after a refusal (our unread hello byte): say the refusal
            if buf:
                break
            raise
        if not chunk:
            if not buf:
                raise ConnectionResetError("the receiver closed the connection at the hello")
            break
        buf += chunk
    return buf


def _answer_refused(got: bytes) -> str:
    if got[: len(STREAM_MAGIC)] == STREAM_MAGIC and len(got) >= len(PREAMBLE):
        v = got[len(STREAM_MAGIC)]
        if v != STREAM_VERSION:
            return (
                f"the receiver refused this stream: it speaks stream version {v}, this "
                f"sender {STREAM_VERSION} (upgrade both ends together)"
            )
        return "the receiver refused this stream's hello (its log says why)"
    return f"the receiver answered the hello with {got[:16]!r}, not a disagg data stream"


def _recv_with_fds(sock: socket.socket, mv: memoryview, fds: list[int]) -> int:
    """``recv_into`` that also collects SCM_RIGHTS descriptors (appended to ``fds``)."""
    data, anc, _flags, _addr = sock.recvmsg(
        len(mv), socket.CMSG_SPACE(4 * 4), getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    )
    for level, kind, blob in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(blob) - len(blob) % 4
            fds.extend(np.frombuffer(blob[:usable], dtype=np.int32).tolist())
    mv[: len(data)] = data
    return len(data)


def _refusal(sock: socket.socket | None) -> str:
    """What a receiver that refused this connection wrote back (its preamble), if any."""
    if sock is None:
        return ""
    try:
        got = sock.recv(len(PREAMBLE), socket.MSG_DONTWAIT)
    except OSError:
        return ""
    if got[: len(STREAM_MAGIC)] == STREAM_MAGIC and len(got) == len(PREAMBLE):
        return f" (the receiver refused this stream: it speaks stream version {got[-1]})"
    return ""


def _gathered(src: _Source, b: _Batch) -> np.ndarray:
    """A batch's payload as one buffer (to hash it; only with the checksum on)."""
    per_row = int(src.cols[:, 1].sum())
    out = np.empty(b.rows.size * per_row, dtype=np.uint8)
    gather_pages(out, src.arr, b.rows, tuple((int(o), int(n)) for o, n in src.cols))
    return out


def _source(
    group: int, src: torch.Tensor | StoreRows, n: int
) -> tuple[torch.Tensor, np.ndarray, tuple[tuple[int, int], ...]]:
    """``(slab, rows, cols)`` of a push source, checked: a host uint8 ``[R, W]`` slab with
    contiguous rows, ``n`` rows inside it and columns inside a row. A device source is
    copied to the host first (this plane moves host memory only)."""
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
    if src.shape[1] > 1 and src.stride(1) != 1:
        src = src.contiguous()
    return src, np.arange(n, dtype=np.int64), ((0, int(src.shape[1])),)


def _wmem_max() -> int:
    """``net.core.wmem_max`` (the largest send buffer a process may ask for), 0 unknown."""
    return _sysctl("net/core/wmem_max", 0)


def _ask_tcp_sndbuf(sock: socket.socket) -> None:
    """Give a TCP sender's socket TCP_SNDBUF, where the host grants all of it: a size
    set by hand turns the kernel's autotuning off (it grows to ``tcp_wmem``'s max,
    4 MiB by default), so an ask capped by a small ``wmem_max`` would shrink it."""
    if os.environ.get(TCP_SNDBUF_ENV, "1") == "0" or _wmem_max() < TCP_SNDBUF:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, TCP_SNDBUF)


def _msg_bytes(endpoint: str) -> int:
    """Payload bytes per batch message for a push to ``endpoint``: MSG_BYTES, and over
    TCP at most TCP_MSG_BYTES (or what ``DISAGG_STREAM_TCP_MSG_BYTES`` says)."""
    if not endpoint.startswith("tcp://"):
        return MSG_BYTES
    raw = os.environ.get(TCP_MSG_ENV, "")
    if not raw:
        return min(MSG_BYTES, TCP_MSG_BYTES)
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{TCP_MSG_ENV}={raw!r}: give a positive byte count (default {TCP_MSG_BYTES})"
        )
    return min(MSG_BYTES, value)


def _plan_group(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    src: torch.Tensor | StoreRows,
    dst_slots: Sequence[int],
    msg_bytes: int | None = None,
) -> tuple[_Source, int]:
    """Split one group's pages into batches of at most ``msg_bytes`` (default MSG_BYTES;
    and MAX_BATCH_PAGES):
    each names its pages' destination runs (consecutive slots coalesced) and the source
    rows to send, in that order. Vectorised: loops over batches only."""
    slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    slab, rows, cols = _source(group, src, int(slots.shape[0]))
    if (slots < -1).any():
        raise ValueError(f"group {group}: destination slots must be >= -1")
    pb = sum(c for _, c in cols)
    arr = slab.numpy()  # [R, W] view, rows contiguous
    cols_arr = np.array(cols, dtype=np.int64).reshape(-1, 2)
    out = _Source(arr, cols_arr, slab, [])
    idx = np.flatnonzero(slots >= 0)
    if idx.size == 0:
        return out, 0
    dst = slots[idx]
    rows = np.ascontiguousarray(rows[idx], dtype=np.int64)
    per_msg = max(1, min((msg_bytes or MSG_BYTES) // pb, MAX_BATCH_PAGES))
    brk = np.flatnonzero(np.diff(dst) != 1) + 1  # where destination runs break
    for m0 in range(0, int(idx.size), per_msg):
        m1 = min(m0 + per_msg, int(idx.size))
        cuts = brk[(brk > m0) & (brk < m1)]
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
        nbytes = (m1 - m0) * pb
        out.batches.append(_Batch(frame(header, nbytes), rows[m0:m1], nbytes))
    return out, int(idx.size)
