"""A CUDA driver call made straight through ctypes, for the ipc plane's receiver path.

Why: on the H200's VM each torch call on a just-woken thread costs 20-50 us (argument
parsing, dispatch, a slice and its tensor object before ``copy_``); the receiver makes
them in series with a ~0.5 ms copy, once per push. ``cuMemcpyHtoDAsync_v2`` through
ctypes is one foreign call. The caller keeps its torch fallback: every function here
returns False, doing nothing, where the driver library, the symbol or a current CUDA
context on the calling thread is missing (CPU-only hosts, a thread torch has not used
the GPU from yet).

The stream handle is a ``cudaStream_t`` (torch's ``stream.cuda_stream``): the runtime
and the driver share stream handles.
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
