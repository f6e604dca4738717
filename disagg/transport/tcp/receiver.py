"""The stream plane's receiving side: accept connections, check each batch header, land
its payload straight in the slots.

Threads: one acceptor thread (it also expires transfers past their deadline, and
takes at most ``MAX_CONNS`` connections) and one thread per connection, which reads the
hello (``wire``), then message after message: a header, checked by the shared
``ReceiverBook`` (``authenticate``, ``accept_runs``: bounds, promises, counts) before a
payload byte lands, then its payload. No lock is held while bytes land: ``Rx.inflight``
counts the write, and ``abort`` shuts the connection down to end a write in progress at
once (the sender's push then fails; later pushes reconnect).

Landing: a group of one directly registered, contiguous host region receives its
payload straight into the destination slot rows (``rowio.recv_rows``, or
``recv_pipe_rows`` from the pipe); other groups (several regions, device regions) land
in a per-connection scratch buffer and are scattered (``Group.scatter``). A refused
header's payload is read and dropped, so the connection stays in step; a payload that
breaks off (deadline, peer gone) fails its transfer and closes that connection only.

With the checksum on (both sides), the landed bytes are hashed in wire order and
checked against the sender's TransferDone.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import select
import socket
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from ...protocol import messages as m
from ...protocol.errors import ProtocolError
from .. import framed
from ..receiver import BookedReceiver, Group, ReceiverBook, Rx
from . import rowio
from .wire import (
    HELLO_TIMEOUT_S,
    MAX_HEADER,
    MODE_INLINE,
    MODE_PIPE,
    PIPED,
    PREAMBLE,
    PREFIX,
    bad_preamble,
)

log = logging.getLogger(__name__)

MAX_CONNS = 256  # receiver connections at once (a thread each); more are refused
HEADER_TIMEOUT_S = 30.0  # once a message's length prefix arrived, its header must follow
POLL_MS = 20


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


class _Closed(Exception):
    """The plane is closing: the connection thread ends."""


class StreamReceiver(BookedReceiver):
    """The receiver half of ``TcpDataPlane`` (mixed in; ``_rx_start`` in ``__init__``)."""

    stats: Counter[str]
    pipe: bool  # may take the payload pipe a same-host sender offers
    _stop: threading.Event

    def _rx_start(self, bind: str, checksum: bool) -> str:
        """Listen at ``bind`` and start the acceptor thread; returns the bound endpoint."""
        self._book = ReceiverBook(self.stats, checksum=checksum)
        self._listener, bound = framed.listen(bind)
        self._ipc_path = bound[len("ipc://") :] if bound.startswith("ipc://") else None
        self._conns: set[_Conn] = set()
        self._conns_lock = threading.Lock()
        self._refusals_logged = 0
        self._rx_thread = threading.Thread(target=self._rx_run, name="disagg-dp-rx", daemon=True)
        self._rx_thread.start()
        return bound

    def _rx_run(self) -> None:
        """Accept connections (a thread each) and expire transfers past their deadline."""
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        last_sweep = 0.0
        try:
            while not self._stop.is_set():
                if poller.poll(POLL_MS):
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
                rowio.shutdown(c.sock)
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
            wait = POLL_MS
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
            got = self._read(conn, len(PREAMBLE), HELLO_TIMEOUT_S, fds)
        except TimeoutError:
            got = b"(nothing in time)"
        if got is None:
            return False
        if got == PREAMBLE:
            try:
                mode = self._read(conn, 1, HELLO_TIMEOUT_S, fds)
            except TimeoutError:
                mode = b""
            if mode is None:
                return False
            why = self._payload_mode(conn, mode, fds)
            if why is None:
                answer = PREAMBLE + bytes([MODE_INLINE if conn.pipe is None else MODE_PIPE])
                try:
                    rowio.send_bytes(conn.sock, answer, time.monotonic() + HELLO_TIMEOUT_S)
                except OSError as e:
                    log.info("data plane connection from %s closed: %s", conn.peer, e)
                    return False
                return True
            return self._refuse(conn, "rejected_BAD_HELLO", why)
        return self._refuse(conn, "rejected_BAD_VERSION", bad_preamble(got))

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
        if self.pipe and rowio.has_native():  # else answer MODE_INLINE (fd closed)
            conn.pipe = fds.pop()
            os.set_blocking(conn.pipe, False)  # recv_pipe_rows polls it with the socket
        return None

    def _refuse(self, conn: _Conn, stat_key: str, why: str) -> bool:
        with self._book.lock:
            self.stats[stat_key] += 1
            self._refusals_logged += 1
        if self._refusals_logged <= 10:  # a misdirected peer may reconnect every 100 ms
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
        pre = self._read(conn, PREFIX.size, None)
        if pre is None:
            return False
        hlen, plen = PREFIX.unpack(pre)
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
                    run = rowio.runs_of(slots)
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
            rowio.recv_pipe_rows(conn.pipe, conn.sock, arr, rows, cols, deadline)
        else:
            rowio.recv_rows(conn.sock, arr, rows, cols, deadline)

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
                            rowio.shutdown(c.sock)
        return super().abort(transfer_id, reason)


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
