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
- GPU (when present): pinned host->device, device->host and device->device copies.

Each returns the median GB/s (1e9 B/s) of ``repeats`` timed runs after one warm-up.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
from typing import Any

import numpy as np

from .units import median

_CHUNK = 1 << 20


def memcpy_gbps(nbytes: int, repeats: int, plain: bool = False) -> float:
    import torch

    from .. import hostmem

    def alloc() -> np.ndarray:
        t = torch.empty(nbytes, dtype=torch.uint8) if plain else hostmem.empty(nbytes)
        return t.numpy()

    src, dst = alloc(), alloc()
    src[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst.fill(1)  # prefault
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        np.copyto(dst, src)
        if i:
            times.append(time.perf_counter() - t)
    return nbytes / median(times) / 1e9


def _stream_sender(family: int, addr: Any, nbytes: int, repeats: int) -> None:
    buf = np.ones(nbytes, dtype=np.uint8)
    mv = buf.data
    s = socket.socket(family, socket.SOCK_STREAM)
    s.connect(addr)
    for _ in range(repeats + 1):
        s.recv(1)  # go
        for off in range(0, nbytes, _CHUNK):
            s.sendall(mv[off : off + _CHUNK])
    s.recv(1)
    s.close()


def socket_gbps(kind: str, nbytes: int, repeats: int) -> float:
    """``kind``: ``tcp`` (127.0.0.1) or ``unix``. Times go-byte -> last byte received."""
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
    bound = srv.getsockname()
    p = mp.get_context("spawn").Process(
        target=_stream_sender, args=(family, bound, nbytes, repeats), daemon=True
    )
    p.start()
    conn, _ = srv.accept()
    dst = np.empty(nbytes, dtype=np.uint8)
    dst.fill(0)
    mv = dst.data
    times = []
    try:
        for i in range(repeats + 1):
            t = time.perf_counter()
            conn.sendall(b"g")
            got = 0
            while got < nbytes:
                n = conn.recv_into(mv[got:], nbytes - got)
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
            if i:
                times.append(time.perf_counter() - t)
        conn.sendall(b"q")
    finally:
        conn.close()
        srv.close()
        p.join(10)
        if tmpdir:
            try:
                os.unlink(os.path.join(tmpdir, "s"))
                os.rmdir(tmpdir)
            except OSError:
                pass
    return nbytes / median(times) / 1e9


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


def cuda_time(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, the device
    synchronised around each run (so queued GPU work is timed, not just its launch)."""
    import torch

    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    return median(times)
