"""A peer that dies during a cma copy fails the UCX request instead of aborting this process.

UCX's cma transport logs a failed ``process_vm_readv``/``writev`` (peer gone: ESRCH;
memory unmapped: EFAULT) at FATAL level when the endpoint has no error handling, and
UCS's default log handler aborts on FATAL. The plane's shm endpoints cannot have error
handling: with ``UCP_ERR_HANDLING_MODE_PEER`` UCX 1.21 selects no shared-memory lane
(sysv/posix lack "peer failure"), so every get becomes software emulation over tcp/lo
at 0.43-0.69 GB/s against 10-14 on cma. Apart from that log call UCX's error path is the
ordinary one (the operation completes with UCS_ERR_IO_ERROR), so ``guard_cma`` installs,
once per process, a UCS log handler (C: ``_ucxrma.c``, ``cma_handler``) that takes exactly
cma_ep.c's FATAL messages (counted, the latest kept: ``cma_failures``) and passes every
other message on. So a consumer's read from a killed producer fails its batch, and a
producer's rendezvous write into a killed consumer (shm tag path) fails its push; both
keep serving (tests/transport/test_ucx_peer_death.py). The handler costs nothing on the
hot path: UCS calls it only for a message being logged.

Off (UCX's abort stays) without the ``_ucxrma`` extension, with libucp older than 1.15
(the mirrored log-handler signature), or with ``tuning.ucx_cma_guard`` False.
"""

from __future__ import annotations

import ctypes
import logging
import os

from ... import tuning
from . import iov
from .native_rma import _ucxrma

log = logging.getLogger(__name__)

_cma_guard: bool | None = None
_cma_guard_error: str | None = None


def _libucs() -> ctypes.CDLL:
    """The libucs that ucxx loaded (its log handlers are the ones UCX calls)."""
    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and os.path.basename(parts[-1]).startswith("libucs.so"):
                    path = parts[-1]
                    break
    except OSError:
        pass
    if path is None:
        ucp = iov.libucp_path()
        cand = os.path.join(os.path.dirname(ucp), "libucs.so") if ucp else None
        if cand is None or not os.path.exists(cand):
            raise RuntimeError("libucs not found (is ucxx imported?)")
        path = cand
    return ctypes.CDLL(path)


def guard_cma() -> bool:
    """Make a failed cma copy (``process_vm_readv``/``writev`` of a peer process that
    died or unmapped the memory) fail its UCX request instead of aborting this process
    (see above); once per process, after ucxx is imported. False, with the reason kept
    (``cma_guard_reason``), when the ``_ucxrma`` extension is missing, libucp is older
    than 1.15 (the log-handler signature mirrored in _ucxrma.c: ucs/debug/log_def.h with
    the component argument), libucs cannot be found, or ``tuning.ucx_cma_guard`` is False."""
    global _cma_guard, _cma_guard_error
    if _cma_guard is not None:
        return _cma_guard
    try:
        if tuning.current().ucx_cma_guard is False:
            raise RuntimeError("turned off by DISAGG_UCX_CMA_GUARD=0 (tuning.ucx_cma_guard)")
        if _ucxrma is None:
            raise RuntimeError("the _ucxrma extension is not built")
        ucp_path = iov.libucp_path()
        if ucp_path is None:
            raise RuntimeError("libucp not found (is ucxx imported?)")
        version = iov.bind_common(ctypes.CDLL(ucp_path))
        if version < (1, 15, 0):
            raise RuntimeError(f"libucp {version}: log handler mirrored for 1.15+")
        ucs = _libucs()
        push = int(ctypes.cast(ucs.ucs_log_push_handler, ctypes.c_void_p).value or 0)
        _cma_guard = bool(_ucxrma.guard_cma(push))
    except Exception as exc:
        _cma_guard = False
        _cma_guard_error = f"{type(exc).__name__}: {exc}"
        log.warning(
            "UCX cma failures stay fatal (%s): a peer killed during a cma copy aborts this process",
            _cma_guard_error,
        )
    return _cma_guard


def cma_guard_reason() -> str | None:
    """Why ``guard_cma`` is off, None when it is on (or was not tried)."""
    return _cma_guard_error


def cma_failures() -> tuple[int, str]:
    """(count, latest message) of the cma failures taken in this process."""
    if _ucxrma is None or not _cma_guard:
        return 0, ""
    n, text = _ucxrma.cma_failures()
    return int(n), str(text)


def note(seen: int = 0) -> str:
    """The latest cma failure this process took after ``seen`` (a count from
    ``cma_failures``), as a note for a failed request's error text: it names the call,
    the peer's pid and errno. "" when there is none."""
    n, last = cma_failures()
    return f"; latest cma failure here: {last}" if n > seen and last else ""
