"""Moving rows of pages through stream sockets and pipes, one kernel copy per byte.

``send_rows`` / ``recv_rows``: columns ``cols`` ((offset, length) pairs) of rows ``rows``
of a 2-D uint8 array, page by page, straight from the store rows into the socket and
out of it into the destination slot rows (an iovec per page column span, adjacent ones
merged). The loops are C (``_streamio.c``: GIL released, IOV_MAX chunks, partial
transfers, EINTR, a deadline in poll(), every row and span checked before a byte
moves); without the extension a Python path does the same with ``sendmsg`` /
``recv_into`` and one vectorised gather or scatter per ``PY_CHUNK`` (a copy more).
``tuning.require_native`` (``DISAGG_REQUIRE_NATIVE=1``) makes a missing extension an
ImportError.

The pipe (same host, AF_UNIX streams; needs the extension): ``splice_rows`` vmsplices
the store rows into the pipe (referenced, not copied), ``recv_pipe_rows`` readv's them
into the slots (the only copy). The rows stay referenced until ``drain_pipe`` returned.
Both pipe loops poll the pipe together with the stream socket (``watch``), so a
shutdown of that socket (abort, close, a peer gone) ends them at once; SIGPIPE is
blocked around vmsplice (EPIPE instead).

Errors: TimeoutError at the deadline, ConnectionError when the peer closes first,
IndexError / ValueError for rows or spans outside the array (nothing moved).
"""

from __future__ import annotations

import fcntl
import math
import os
import select
import socket
import time
from typing import Any

import numpy as np

from ...native import load
from ..dataplane import gather_pages

# the iovec loops (_streamio.c; without a compiler at install time, the Python path below)
_streamio = load("disagg.transport._streamio")

PIPE_BYTES = 4 << 20  # pipe size asked for; the kernel caps it (fs.pipe-max-size, 1 MiB)
MIN_PIPE_BYTES = 256 << 10  # a smaller pipe (per-user pipe quota spent): the plain stream
PY_CHUNK = 4 << 20  # the Python path gathers / scatters this much per step

_native: Any = _streamio  # tests switch this to None to run the Python path


def has_native() -> bool:
    """The C loops are in use (the pipe needs them)."""
    return _native is not None


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


def sysctl(name: str, default: int) -> int:
    """An integer kernel setting (``/proc/sys/<name>``), or ``default`` when unreadable."""
    try:
        with open(f"/proc/sys/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return default


def _pipe_max() -> int:
    return sysctl("fs/pipe-max-size", 1 << 20)


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


def wait_ready(sock: socket.socket, events: int, deadline: float, what: str) -> None:
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
            wait_ready(sock, select.POLLOUT, deadline, f"{done} of {total} payload bytes sent")
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
            wait_ready(
                sock, select.POLLIN, deadline, f"{done + got} of {total} payload bytes received"
            )
            continue
        if n == 0:
            raise ConnectionError(
                f"peer closed the connection with {done + got} of {total} payload bytes received"
            )
        got += n
    return done + got


def runs_of(rows: np.ndarray) -> bool:
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
    if rows.size and whole and runs_of(rows) and arr[:1].flags.c_contiguous:
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
    if rows.size and whole and runs_of(rows):
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


def send_bytes(sock: socket.socket, data: bytes, deadline: float) -> None:
    send_rows(sock, data, _NOTHING, _NO_ROWS, _ONE_COL, deadline)


_NOTHING = np.zeros((1, 1), dtype=np.uint8)
_NO_ROWS = np.zeros(0, dtype=np.int64)
_ONE_COL = np.array([[0, 1]], dtype=np.int64)


def shutdown(sock: socket.socket | None) -> None:
    """Wake a thread blocked on ``sock`` (its reads see EOF, its writes EPIPE)."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed or never connected
            pass
