"""Framed stream sockets for the same-host (``ipc``) data plane's control messages.

Why not ZMQ: a ZMQ message crosses two I/O threads (the sender's and the receiver's) on
its way, each a thread wake-up. On the H200 host (a Firecracker VM) a small ZMQ round
trip between two processes took 200 us (tcp and ipc alike), a plain AF_UNIX one 49 us
(121 us with a 256 KiB frame out, against 306 through ZMQ); a push and its ack are one
such round trip on the critical path of every transfer.

Wire: the connecting side first sends ``MAGIC`` (8 bytes: names this stream and its
version; anything else is refused and the connection closed), then both sides send
frames: a 4-byte little-endian length, then that many bytes (one msgpack message).

``Conn`` is one such socket, non-blocking: ``send`` queues a frame and writes what the
kernel takes at once (the rest goes out when the owner sees the socket writable), and is
safe from any thread; ``read_frames`` is for the one thread that polls the socket.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
import threading
from typing import Any

MAGIC = b"DGIPC\x00\x00\x01"
_HDR = struct.Struct("<I")
RECV_CHUNK = 1 << 20


class FrameError(Exception):
    """The peer broke the framing (bad preamble, a frame over the limit): close it.
    ``code``: the ProtocolError code name it counts as."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def sockaddr(endpoint: str) -> tuple[int, Any]:
    """(address family, address) of ``tcp://host:port`` or ``ipc://path``; ValueError
    naming the endpoint otherwise. ``*`` binds every IPv4 address, like ZMQ's."""
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme == "ipc" and rest:
        return socket.AF_UNIX, rest
    if sep and scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if host and port.isdigit() and int(port) < 65536:
            host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
            host = "0.0.0.0" if host == "*" else host
            return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))
    raise ValueError(f"endpoint {endpoint!r}: expected tcp://host:port or ipc://path")


def listen(bind: str) -> tuple[socket.socket, str]:
    """A non-blocking listening socket at ``bind`` and the endpoint it got (the port a
    ``:0`` bind was given). A stale socket file at an ``ipc://`` path is replaced."""
    family, addr = sockaddr(bind)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_UNIX:
            try:
                if stat.S_ISSOCK(os.lstat(addr).st_mode):
                    os.unlink(addr)  # left by a process that died (ZMQ's ipc did this too)
            except FileNotFoundError:
                pass
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    if family == socket.AF_UNIX:
        return sock, f"ipc://{addr}"
    host, port = sock.getsockname()[:2]
    return sock, f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else f"tcp://{host}:{port}"


def connect(endpoint: str) -> tuple[socket.socket, bool]:
    """Start a non-blocking connection: (socket, connected now). Not connected yet: wait
    for it to be writable, then ``finish_connect``. OSError when refused at once."""
    family, addr = sockaddr(endpoint)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        rc = sock.connect_ex(addr)
    except BaseException:  # e.g. a host name that does not resolve
        sock.close()
        raise
    if rc not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
        sock.close()
        raise OSError(rc, f"connect to {endpoint}: {os.strerror(rc)}")
    return sock, rc == 0


def finish_connect(sock: socket.socket) -> None:
    """After a pending connection turned writable: OSError if it failed."""
    rc = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if rc:
        raise OSError(rc, os.strerror(rc))


class Conn:
    """One framed connection (see the module docstring). ``send`` may be called from any
    thread; ``read_frames``, ``flush`` and ``close`` from the thread that polls it.
    ``accepted``: bytes the kernel has taken so far; ``queued``: bytes handed to ``send``
    (a frame whose end lies at or below ``accepted`` has fully left this process)."""

    def __init__(self, sock: socket.socket, *, greet: bool, max_frame: int) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self.lock = threading.Lock()
        self.closed = False
        self.inbuf = bytearray()
        self.out = bytearray()
        self.accepted = 0
        self.queued = 0
        self.need_magic = not greet  # the accepting side checks the preamble
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if greet:
            self._write(MAGIC)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, frame: bytes) -> bool:
        """Queue one frame and write what the kernel takes now. Returns True while bytes
        wait for the socket to turn writable (the polling thread must ``flush`` then).
        A closed connection drops the frame (returns False)."""
        return self._write(_HDR.pack(len(frame)), frame)

    def _write(self, *parts: bytes) -> bool:
        with self.lock:
            if self.closed:
                return False
            self.queued += sum(len(p) for p in parts)
            if self.out:
                for p in parts:
                    self.out += p
                return True
            try:
                n = self.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:  # the peer went away: the reader sees it and closes
                return False
            self.accepted += n
            for p in parts:  # keep what the kernel did not take
                if n >= len(p):
                    n -= len(p)
                    continue
                self.out += memoryview(p)[n:]
                n = 0
            return bool(self.out)

    def flush(self) -> bool:
        """Write queued bytes; True while some still wait."""
        with self.lock:
            if self.closed or not self.out:
                return False
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            self.accepted += n
            del self.out[:n]
            return bool(self.out)

    def read_frames(self, scratch: bytearray) -> list[bytes] | None:
        """The frames completed by what the socket holds now; None when the peer closed
        the connection. FrameError when it broke the framing (close it then).
        ``scratch``: the polling thread's receive buffer (one per thread, reused: no fresh
        buffer per recv, and no per-connection one)."""
        try:
            got = self.sock.recv_into(scratch)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not got:
            return None
        buf = self.inbuf
        with memoryview(scratch) as mv:
            buf += mv[:got]
        pos = 0
        if self.need_magic:
            if len(buf) < len(MAGIC):
                if MAGIC.startswith(bytes(buf)):
                    return []
            if bytes(buf[: len(MAGIC)]) != MAGIC:
                raise FrameError(
                    "BAD_VERSION",
                    "the peer is not a disagg ipc plane of this version (bad stream preamble)",
                )
            self.need_magic = False
            pos = len(MAGIC)
        frames = []
        with memoryview(buf) as view:  # released before the buffer is trimmed below
            while len(buf) - pos >= _HDR.size:
                (n,) = _HDR.unpack_from(buf, pos)
                if n > self.max_frame:
                    raise FrameError(
                        "TOO_LARGE", f"frame of {n} bytes exceeds the limit of {self.max_frame}"
                    )
                if len(buf) - pos - _HDR.size < n:
                    break
                start = pos + _HDR.size
                frames.append(bytes(view[start : start + n]))  # one copy
                pos = start + n
        if pos:
            del buf[:pos]
        return frames

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self.closed = True
                self.out.clear()
                self.sock.close()
