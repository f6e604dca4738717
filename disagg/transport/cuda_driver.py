"""CUDA driver calls made straight through ctypes, for the ipc plane's receiver path.

Why: on the H200's VM each torch call on a just-woken thread costs 20-50 us (argument
parsing, dispatch, a slice and its tensor object before ``copy_``); the receiver makes
them in series with a ~0.5 ms copy, once per push. ``cuMemcpyHtoDAsync_v2`` through
ctypes is one foreign call. The caller keeps its torch fallback: every function here
returns False, doing nothing, where the driver library, the symbol or a current CUDA
context on the calling thread is missing (CPU-only hosts, a thread torch has not used
the GPU from yet).

The stream handle is a ``cudaStream_t`` (torch's ``stream.cuda_stream``): the runtime
and the driver share stream handles.

``enable_peer_access(device, peer)`` lets kernels running on GPU ``device`` read GPU
``peer``'s memory (the ipc plane's copy kernel runs on the consumer's GPU and reads the
producer's store, opened through CUDA IPC on the producer's GPU): torch has no call for
it (its own cross-device copies enable it only inside ``copy_``). Device numbers are
this process's CUDA ordinals (after CUDA_VISIBLE_DEVICES), as torch's.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

_tls = threading.local()  # per thread: whether a CUDA context is current


@functools.cache
def _lib() -> Any:
    """libcuda's two entry points used here, or None where they cannot be had."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        copy = lib.cuMemcpyHtoDAsync_v2
        current = lib.cuCtxGetCurrent
        name = lib.cuGetErrorName
    except (OSError, AttributeError):
        return None
    copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    copy.restype = ctypes.c_int
    current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    current.restype = ctypes.c_int
    name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    name.restype = ctypes.c_int
    return lib


@functools.cache
def _peer_lib() -> Any:
    """libcuda with the peer-access entry points typed, or None."""
    lib = _lib()
    try:
        fns = (
            lib.cuInit,
            lib.cuDeviceGet,
            lib.cuDeviceCanAccessPeer,
            lib.cuDevicePrimaryCtxRetain,
            lib.cuCtxPushCurrent_v2,
            lib.cuCtxPopCurrent_v2,
            lib.cuCtxEnablePeerAccess,
        )
    except (AttributeError, TypeError):  # TypeError: no library at all (None)
        return None
    init, get, can, retain, push, pop, enable = fns
    init.argtypes = [ctypes.c_uint]
    get.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    can.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    push.argtypes = [ctypes.c_void_p]
    pop.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    enable.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    for f in fns:
        f.restype = ctypes.c_int
    return lib


_PEER_ALREADY_ENABLED = 704  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED


@functools.cache
def enable_peer_access(device: int, peer: int) -> str | None:
    """Let kernels on GPU ``device`` access GPU ``peer``'s memory (including memory this
    process opened there through CUDA IPC). None when they can (now, or ``device ==
    peer``); else why not, in a few words (the GPUs have no peer path, no driver).
    Done once per pair and process; the answer is cached."""
    if device == peer:
        return None
    lib = _peer_lib()
    if lib is None:
        return "the CUDA driver library (libcuda.so.1) cannot be loaded"
    dev, other = ctypes.c_int(), ctypes.c_int()
    rc = lib.cuInit(0)
    if rc == 0:
        rc = lib.cuDeviceGet(ctypes.byref(dev), device)
    if rc == 0:
        rc = lib.cuDeviceGet(ctypes.byref(other), peer)
    if rc != 0:
        return str(_error(lib, rc, f"cuDeviceGet(cuda:{device} / cuda:{peer})"))
    can = ctypes.c_int()
    rc = lib.cuDeviceCanAccessPeer(ctypes.byref(can), dev, other)
    if rc != 0:
        return str(_error(lib, rc, "cuDeviceCanAccessPeer"))
    if not can.value:
        return f"cuda:{device} has no peer access to cuda:{peer} (no NVLink or PCIe P2P path)"
    ctx, peer_ctx = ctypes.c_void_p(), ctypes.c_void_p()
    # the primary contexts (torch's): retained for the life of the process, like torch's
    rc = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    if rc == 0:
        rc = lib.cuDevicePrimaryCtxRetain(ctypes.byref(peer_ctx), other)
    if rc != 0:
        return str(_error(lib, rc, "cuDevicePrimaryCtxRetain"))
    rc = lib.cuCtxPushCurrent_v2(ctx)
    if rc != 0:
        return str(_error(lib, rc, "cuCtxPushCurrent"))
    try:
        rc = lib.cuCtxEnablePeerAccess(peer_ctx, 0)
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    if rc not in (0, _PEER_ALREADY_ENABLED):
        return str(_error(lib, rc, f"cuCtxEnablePeerAccess(cuda:{device} -> cuda:{peer})"))
    return None


def _has_context(lib: Any) -> bool:
    """Whether this thread has a current CUDA context (asked once per thread, until a
    context is found: torch makes the primary context current on first use)."""
    if getattr(_tls, "context", False):
        return True
    ctx = ctypes.c_void_p()
    ok = lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and bool(ctx.value)
    _tls.context = ok
    return ok


def _error(lib: Any, rc: int, what: str) -> RuntimeError:
    s = ctypes.c_char_p()
    label = s.value.decode() if lib.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value else ""
    return RuntimeError(f"{what} failed: CUresult {rc} {label}".rstrip())


def copy_htod_async(dst: int, src: int, nbytes: int, stream: int) -> bool:
    """Queue ``nbytes`` from host address ``src`` (pinned, or the copy is synchronous)
    to device address ``dst`` on ``stream``. Returns False, queueing nothing, where the
    driver call is not available on this thread (then use torch); raises RuntimeError
    naming the CUresult when the driver refuses the copy."""
    lib = _lib()
    if lib is None or not _has_context(lib):
        return False
    rc = lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream)
    if rc != 0:
        raise _error(lib, rc, "cuMemcpyHtoDAsync")
    return True
