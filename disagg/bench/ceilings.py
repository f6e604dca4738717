"""Ceilings measured in the same run as the transports: what the medium itself can do.

- memcpy: one thread copying the same bytes into a prefaulted buffer (``np.copyto``),
  the ceiling for shared memory (a transfer cannot copy faster than one memcpy). Both
  buffers come from ``hostmem.empty`` (huge pages where the kernel allows), like the
  bench's store and pool, so the ceiling is measured on the memory the transfers use;
  ``plain=True`` measures it on ordinary ``torch.empty`` buffers instead (4 KiB pages
  unless THP is ``always``), for reference: 11.9-12.1 GB/s against 12.1-13.3 on huge
  pages on the 2-core box (numpy's own big arrays are huge-page-advised too).
- raw TCP / AF_UNIX: a child process streaming the bytes with ``sendall`` into
  ``recv_into`` a prefaulted buffer over the same loopback: the ceiling for tcp / ipc.
  The buffer comes from ``hostmem.empty`` too, like the pool: into huge pages raw TCP
  read 4.5-4.9 GB/s against 3.2-4.2 into ``np.empty`` (256 MiB, 3 rounds on the 2-core
  box; the sender's buffer made no difference).
- GPU (when present): pinned host->device, device->host and device->device copies.

The ``*_gbps`` functions return the median GB/s (1e9 B/s) of ``repeats`` timed runs after
one warm-up. Their parts are exposed for ``bench transfer``'s paired ceilings, timed one
run at a time between a row's pushes: ``memcpy_timer``, ``d2d_timer``, and for streams
``listener`` / ``connect`` / ``serve_stream`` (the sending end, any process) /
``stream_timer`` (the receiving end).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .units import median

_CHUNK = 1 << 20
_ACCEPT_S = 120.0  # a peer that never connects (it died) fails the ceiling, not hangs it


def memcpy_timer(nbytes: int, plain: bool = False) -> Callable[[], float]:
    """One timed ``np.copyto`` of ``nbytes`` between two prefaulted buffers per call (its
    seconds): ``hostmem.empty`` ones (huge pages where the kernel allows, like the bench's
    store and pool), or ordinary ``torch.empty`` ones with ``plain``."""
    import torch

    from .. import hostmem

    def alloc() -> np.ndarray:
        t = torch.empty(nbytes, dtype=torch.uint8) if plain else hostmem.empty(nbytes)
        return t.numpy()

    src, dst = alloc(), alloc()
    src[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst.fill(1)  # prefault

    def once() -> float:
        t = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t

    return once


def memcpy_gbps(nbytes: int, repeats: int, plain: bool = False) -> float:
    return nbytes / _median_after_warmup(memcpy_timer(nbytes, plain), repeats) / 1e9


def listener(kind: str) -> tuple[socket.socket, Any, Callable[[], None]]:
    """A listening stream socket for ``kind`` ``tcp`` (127.0.0.1, any port) or ``unix``
    (a fresh temporary path): (socket, its address, cleanup that closes it and removes
    the path)."""
    tmpdir = None
    addr: Any
    if kind == "tcp":
        family, addr = socket.AF_INET, ("127.0.0.1", 0)
    else:
        tmpdir = tempfile.mkdtemp(prefix="disagg-bench-")
        family, addr = socket.AF_UNIX, os.path.join(tmpdir, "s")
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.bind(addr)
    srv.listen(1)
    srv.settimeout(_ACCEPT_S)

    def cleanup() -> None:
        srv.close()
        if tmpdir:
            try:
                os.unlink(os.path.join(tmpdir, "s"))
                os.rmdir(tmpdir)
            except OSError:
                pass

    return srv, srv.getsockname(), cleanup


def connect(addr: Any) -> socket.socket:
    """A stream socket connected to ``addr`` (a ``listener`` address: tuple -> TCP)."""
    family = socket.AF_INET if isinstance(addr, tuple) else socket.AF_UNIX
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(_ACCEPT_S)
    s.connect(addr)
    s.settimeout(None)
    return s


def serve_stream(sock: socket.socket, src: np.ndarray) -> None:
    """The sending end: on every go byte (``g``) from the receiver, ``sendall`` the bytes of
    ``src`` in 1 MiB chunks; returns on any other byte or end of stream, closing ``sock``."""
    mv = src.reshape(-1).view(np.uint8).data
    nbytes = mv.nbytes
    try:
        while sock.recv(1) == b"g":
            for off in range(0, nbytes, _CHUNK):
                sock.sendall(mv[off : off + _CHUNK])
    finally:
        sock.close()


def stream_timer(sock: socket.socket, dst: np.ndarray) -> Callable[[], float]:
    """The receiving end: each call sends a go byte and ``recv_into``s ``dst.nbytes`` into
    ``dst`` (a prefaulted buffer), returning seconds from go to the last byte received.
    Send ``b"q"`` (or close ``sock``) to end the sender's ``serve_stream``."""
    mv = dst.reshape(-1).view(np.uint8).data
    nbytes = mv.nbytes

    def once() -> float:
        t = time.perf_counter()
        sock.sendall(b"g")
        got = 0
        while got < nbytes:
            n = sock.recv_into(mv[got:], nbytes - got)
            if n == 0:
                raise ConnectionError("sender closed early")
            got += n
        return time.perf_counter() - t

    return once


def _stream_sender(addr: Any, nbytes: int) -> None:
    serve_stream(connect(addr), np.ones(nbytes, dtype=np.uint8))


def socket_gbps(kind: str, nbytes: int, repeats: int) -> float:
    """``kind``: ``tcp`` (127.0.0.1) or ``unix``. Times go-byte -> last byte received, from
    a child process's ``serve_stream`` into a prefaulted ``hostmem`` buffer."""
    srv, bound, cleanup = listener(kind)
    p = mp.get_context("spawn").Process(target=_stream_sender, args=(bound, nbytes), daemon=True)
    p.start()
    try:
        conn, _ = srv.accept()
    except BaseException:
        cleanup()
        p.kill()
        raise
    conn.settimeout(None)
    from .. import hostmem

    dst = hostmem.empty(nbytes).numpy()  # like the pool (and the memcpy ceiling's buffers)
    dst.fill(0)  # prefault
    try:
        seconds = _median_after_warmup(stream_timer(conn, dst), repeats)
        conn.sendall(b"q")
    finally:
        conn.close()
        cleanup()
        p.join(10)
    return nbytes / seconds / 1e9


def _median_after_warmup(once: Callable[[], float], repeats: int) -> float:
    once()
    return median([once() for _ in range(repeats)])


def gpu_ceilings(nbytes: int, repeats: int, only: str | None = None) -> dict[str, float]:
    """Pinned H2D, D2H and D2D GB/s on cuda:0 (just ``only`` when given); empty when
    there is no GPU."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    host = torch.empty(nbytes if only != "d2d" else 0, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    out = {}
    for name, fn in (
        ("pinned_h2d", lambda: dev.copy_(host, non_blocking=True)),
        ("pinned_d2h", lambda: host.copy_(dev, non_blocking=True)),
        ("d2d", lambda: dev2.copy_(dev)),
    ):
        if only in (None, name):
            out[name] = nbytes / cuda_time(fn, repeats) / 1e9
    return out


def cuda_once(fn: Any) -> float:
    """Seconds of one run of ``fn``, the device synchronised around it (so queued GPU work
    is timed, not just its launch)."""
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def cuda_time(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up (``cuda_once``)."""
    return _median_after_warmup(lambda: cuda_once(fn), repeats)


def d2d_timer(src: Any) -> Callable[[], float]:
    """One timed device-to-device copy of the CUDA tensor ``src`` into a fresh buffer of
    its size per call (its seconds)."""
    import torch

    dst = torch.empty_like(src)
    return lambda: cuda_once(lambda: dst.copy_(src))
