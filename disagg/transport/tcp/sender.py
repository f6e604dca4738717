"""The stream plane's sending side: one lane (thread, queue, connection) per receiver.

``post_push`` plans the push (``plan``) and queues it on the lane of its endpoint;
it returns at once. A lane connects (retrying a refused connection until the push's
deadline), says the hello (``wire``; on AF_UNIX it offers the payload pipe when this
plane may use it), then sends each batch: its header, then its pages straight from the
store rows (``rowio.send_rows``; in the pipe with ``splice_rows`` for pages of at least
``PIPE_MIN_PAGE``), and at the end TransferDone. A stalled or dead receiver holds back
only its own lane's pushes; a lane idle for ``LANE_IDLE_S`` is retired.

Contract: a push is DONE on the sender once the kernel has taken its last byte and the
pipe, if any, has been read empty, so the source rows are no longer referenced; delivery
is the receiver's state. The pipe references the rows' pages until the receiver copied
them out, so TransferDone goes only after ``drain_pipe``; a push that fails before
(deadline, abort, close) sends no TransferDone, and the receiver never completes a
transfer with pages read from rows the producer reused. The rows must not change until
``poll_push`` is final.

Socket buffers: a TCP sender asks for ``TCP_SNDBUF`` (the kernel doubles it) where
``net.core.wmem_max`` grants all of it (``tuning.stream_tcp_sndbuf`` False keeps the
kernel's autotuning); an AF_UNIX sender asks for ``UNIX_SNDBUF``. Both let a sender
queue the next batch while the receiver checks a header (docs/design/tcp-plane.md).
"""

from __future__ import annotations

import math
import os
import queue
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from ... import tuning
from ...protocol import messages as m
from .. import framed
from ..dataplane import RowsSource, TransferState, TransferStatus
from . import rowio
from .plan import Source, gathered, msg_bytes, plan_group
from .wire import (
    HELLO,
    HELLO_TIMEOUT_S,
    MODE_INLINE,
    MODE_PIPE,
    PIPED,
    PREAMBLE,
    PREFIX,
    STREAM_MAGIC,
    answer_refused,
    frame,
)

PIPE_MIN_PAGE = 64 << 10  # smaller pages stay on the stream (the pipe measured slower)
TCP_SNDBUF = 4 << 20  # asked for by a TCP sender (module docstring)
UNIX_SNDBUF = 4 << 20  # AF_UNIX send buffer (capped by net.core.wmem_max)
MAX_LANES = 256  # peers at once
LANE_IDLE_S = 30.0  # a lane idle this long is retired
CONNECT_RETRY_S = 0.05
POLL_MS = 20


@dataclass
class _Lane:
    """Pushes to one peer endpoint, in order, on their own thread and connection."""

    endpoint: str
    jobs: queue.Queue[PushHandle | None] = field(default_factory=queue.Queue)
    sock: socket.socket | None = None
    pipe: int | None = None  # the payload pipe's write end (MODE_PIPE), else None
    thread: threading.Thread = field(default=None)  # type: ignore[assignment]
    closing: bool = False


@dataclass
class PushHandle:
    """Sender-side handle returned by ``post_push``."""

    transfer_id: int
    endpoint: str
    deadline: float
    plan: list[Source]
    pages: int
    lease_id: int
    token: bytes
    state: TransferState = TransferState.PENDING
    error: str | None = None
    nbytes: int = 0

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.error, self.pages, self.nbytes)


class StreamSender:
    """The sender half of ``TcpDataPlane`` (mixed in; ``_tx_start`` in ``__init__``)."""

    stats: Counter[str]
    checksum: bool
    pipe: bool  # may offer the payload pipe to a same-host receiver
    _stop: threading.Event

    def _tx_start(self) -> None:
        # One sender lane (queue, thread, connection) per peer endpoint: a dead or slow
        # peer holds up only its own pushes, never another consumer's.
        self._lanes: dict[str, _Lane] = {}
        self._lanes_lock = threading.Lock()

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
        plan: list[Source] = []
        npages = 0
        per_msg = msg_bytes(endpoint)
        for group, rows, dst_slots in pages:
            src, n = plan_group(
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
                    h = lane.jobs.get(timeout=POLL_MS / 1000)
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
        if sock.family == socket.AF_UNIX and self.pipe and rowio.has_native():
            pipe = rowio.open_pipe()
        try:
            end = min(h.deadline, time.monotonic() + HELLO_TIMEOUT_S)
            if pipe is None:
                rowio.send_bytes(sock, HELLO, end)
            else:
                rowio.wait_ready(sock, select.POLLOUT, end, "the hello unsent")
                socket.send_fds(sock, [PREAMBLE + bytes([MODE_PIPE])], [pipe[0]])
                os.close(pipe[0])  # the receiver's copy is the only read end left
                pipe = (-1, pipe[1])
            got = _read_upto(sock, len(PREAMBLE) + 1, end, self._stop)
            if got[: len(PREAMBLE)] != PREAMBLE or len(got) <= len(PREAMBLE):
                raise _Refused(answer_refused(got))
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
                        hasher.update(gathered(src, b).data)
                    if pipe is None or src.page_bytes < PIPE_MIN_PAGE:
                        rowio.send_rows(sock, b.head, src.arr, b.rows, src.cols, h.deadline)
                    else:  # the header on the stream (flagged), the pages into the pipe
                        hlen, plen = PREFIX.unpack_from(b.head)
                        rowio.send_bytes(
                            sock,
                            PREFIX.pack(hlen, plen | PIPED) + b.head[PREFIX.size :],
                            h.deadline,
                        )
                        rowio.splice_rows(pipe, sock, src.arr, b.rows, src.cols, h.deadline)
                    h.nbytes += b.nbytes
            if pipe is not None:
                # the pipe references the rows' pages until the receiver has copied them
                # out: only then are the rows free, and only then may TransferDone go
                # (a push that fails before sends none, so no transfer completes with
                # pages read from rows the producer reused)
                rowio.drain_pipe(pipe, sock, h.deadline)
            done = m.TransferDone(
                transfer_id=h.transfer_id,
                lease_id=h.lease_id,
                token=h.token,
                checksum=hasher.intdigest() if hasher is not None else 0,
            )
            header = m.encode(done)
            rowio.send_bytes(sock, frame(header, 0), h.deadline)
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
                rowio.wait_ready(sock, select.POLLIN, min(deadline, time.monotonic() + 0.05), "")
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


def _wmem_max() -> int:
    """``net.core.wmem_max`` (the largest send buffer a process may ask for), 0 unknown."""
    return rowio.sysctl("net/core/wmem_max", 0)


def _ask_tcp_sndbuf(sock: socket.socket) -> None:
    """Give a TCP sender's socket TCP_SNDBUF, where the host grants all of it: a size
    set by hand turns the kernel's autotuning off (it grows to ``tcp_wmem``'s max,
    4 MiB by default), so an ask capped by a small ``wmem_max`` would shrink it."""
    if tuning.current().stream_tcp_sndbuf is False or _wmem_max() < TCP_SNDBUF:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, TCP_SNDBUF)
