"""Scatter-gather tag sends and receives on ucxx handles, through libucp directly (ctypes).

ucxx 0.52's Python API sends one contiguous buffer per message. UCX itself takes an array
of (pointer, length) pairs (``UCP_DATATYPE_IOV``), so a message whose pages lie in
scattered rows of a store slab can leave from where they lie (``tag_send``), and a message
can land straight in scattered slots (``probe_length`` + ``tag_recv_exact``). The calls
go to the very ``ucp_ep_h`` / ``ucp_worker_h`` a ucxx object wraps (``.handle``), from
the thread that owns the worker; requests are polled with ``ucp_request_check_status``
(``RawRequest``: no callback, so no Python runs inside UCX). The receiver cannot tell an
iov message from a gathered one: the bytes are the same.

Capability check (``available()``): libucp is the copy ucxx loaded (found in
``/proc/self/maps``, else next to the ``libucx`` wheel), the symbols exist, and the
library's API version is one whose struct layouts are mirrored here (1.10+, where
``ucp_request_param_t`` took its current 72-byte shape; checked field by field against
a C compile in tests/transport/test_ucx_iov.py), and ``tuning.ucx_iov`` is not False.
Otherwise callers gather into a buffer instead.

Where UCX 1.21 moves an iov (``UCX_PROTO_INFO=used``): over tcp with active-message
rendezvous in large segments, zero-copy both ways ("rendezvous data send from iov[32]
... zero-copy", "rendezvous data fetch into iov[32] ... zero-copy"); over tcp with UCX's
default settings in 8 KiB copy-in pieces (the plane gathers there instead); on shm
through the sysv FIFO, copy-in copy-out in lock step (the plane sends that way, where it
measured no worse than gathering, and never receives so: docs/design/ucx-plane.md).

Also here: the ctypes plumbing the RMA helper shares (``RequestParam``,
``layout_matches``, ``bind_common``, ``libucp_path``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import tuning

log = logging.getLogger(__name__)

# ucp.h (1.21): enum ucp_op_attr_t, ucp_dt_type, ucs_memory_type_t, ucs_status_t
_OP_ATTR_FIELD_DATATYPE = 1 << 3
_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
_DATATYPE_IOV = 2
_MEMORY_TYPE_HOST = 0
_UCS_OK = 0
_UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100
_PTR_ERR_MIN = (1 << 64) + _UCS_ERR_LAST  # UCS_PTR_IS_ERR: (uintptr_t)p >= UCS_ERR_LAST
_U64 = (1 << 64) - 1  # tags and masks are uint64_t


class RequestParam(ctypes.Structure):
    """``ucp_request_param_t`` (ucp.h): 72 bytes; the unions are pointer-sized."""

    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


# (field, offset) of the C layout, checked at load and against a C compile in the tests
PARAM_LAYOUT = {
    "op_attr_mask": 0,
    "flags": 4,
    "request": 8,
    "cb": 16,
    "datatype": 24,
    "user_data": 32,
    "reply_buffer": 40,
    "memory_type": 48,
    "recv_info": 56,
    "memh": 64,
}
PARAM_SIZE = 72
IOV_ENTRY_SIZE = 16  # ucp_dt_iov_t: void *buffer; size_t length


def layout_matches(cls: type[ctypes.Structure], layout: dict[str, int], size: int) -> bool:
    """A ctypes mirror agrees with the C layout recorded for it (size and field offsets)."""
    if ctypes.sizeof(cls) != size:
        return False
    return all(getattr(cls, f).offset == off for f, off in layout.items())


def bind_common(lib: ctypes.CDLL) -> tuple[int, int, int]:
    """Declare the libucp calls every ctypes user here needs (request status and free,
    version) and return libucp's version; RuntimeError for one whose struct layouts are
    not mirrored (before 1.10)."""
    vp = ctypes.c_void_p
    lib.ucp_request_check_status.restype = ctypes.c_int8  # ucs_status_t: a one-byte enum
    lib.ucp_request_check_status.argtypes = [vp]
    lib.ucp_request_free.restype = None
    lib.ucp_request_free.argtypes = [vp]
    lib.ucp_get_version.restype = None
    lib.ucp_get_version.argtypes = [ctypes.POINTER(ctypes.c_uint)] * 3
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    lib.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    version = (major.value, minor.value, release.value)
    if version[0] != 1 or version[1] < 10:
        raise RuntimeError(f"libucp {version}: struct layouts mirrored for 1.10+")
    return version


class TagRecvInfo(ctypes.Structure):
    """``ucp_tag_recv_info_t`` (ucp.h): sender tag and message length."""

    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


RECV_INFO_SIZE = 16


class _Lib:
    """The bound libucp functions and the one request-parameter block sends and
    receives use (ctypes passes it by reference; UCX only reads it)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        vp, u64, sz = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        lib.ucp_tag_send_nbx.restype = vp
        lib.ucp_tag_send_nbx.argtypes = [vp, vp, sz, u64, vp]
        lib.ucp_tag_probe_nb.restype = vp
        lib.ucp_tag_probe_nb.argtypes = [vp, u64, u64, ctypes.c_int, ctypes.POINTER(TagRecvInfo)]
        lib.ucp_tag_msg_recv_nbx.restype = vp
        lib.ucp_tag_msg_recv_nbx.argtypes = [vp, vp, sz, vp, vp]
        self.version = bind_common(lib)
        self.lib = lib
        self.path = path
        p = RequestParam()
        p.op_attr_mask = _OP_ATTR_FIELD_DATATYPE | _OP_ATTR_FIELD_MEMORY_TYPE
        p.datatype = _DATATYPE_IOV
        p.memory_type = _MEMORY_TYPE_HOST  # host only: spares UCX a lookup per entry
        self.iov_param = p
        self.iov_param_ref = ctypes.byref(p)


_lib: _Lib | None = None
_lib_error: str | None = None


def libucp_path() -> str | None:
    """The libucp that ucxx loaded (so both speak to the same worker objects)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and os.path.basename(parts[-1]).startswith("libucp.so"):
                    return parts[-1]
    except OSError:
        pass
    try:
        import libucx

        cand = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so")
        return cand if os.path.exists(cand) else None
    except Exception:
        return None


def layout_ok() -> bool:
    return layout_matches(RequestParam, PARAM_LAYOUT, PARAM_SIZE) and (
        ctypes.sizeof(TagRecvInfo) == RECV_INFO_SIZE
    )


def load() -> _Lib | None:
    """Bind libucp once (after ucxx is imported); None, with the reason logged, when
    the capability check fails."""
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:
        return _lib
    if tuning.current().ucx_iov is False:
        _lib_error = "turned off by DISAGG_UCX_IOV=0 (tuning.ucx_iov)"
        return None
    path = libucp_path()
    try:
        if path is None:
            raise OSError("libucp not found (is ucxx imported?)")
        if not layout_ok():
            raise RuntimeError("ctypes layout of ucp_request_param_t does not match ucp.h")
        _lib = _Lib(path)
    except Exception as exc:
        _lib_error = f"{type(exc).__name__}: {exc}"
        log.info("UCX scatter-gather sends unavailable (%s): gathering instead", _lib_error)
    return _lib


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _lib_error


@dataclass
class IovBuf:
    """One message's payload as ``ucp_dt_iov_t`` entries: ``iov`` is uint64 [k, 2]
    (address, length), kept alive (with what it points into, ``owner``) until the send
    completes."""

    iov: np.ndarray
    nbytes: int
    owner: Any


def iov_entries(
    base: int, row_stride: int, rows: np.ndarray, cols: tuple[tuple[int, int], ...]
) -> np.ndarray:
    """The (address, length) entries of pages ``rows`` (slab row numbers, in page order)
    of a host slab at ``base`` with ``row_stride`` bytes per row, each page the
    concatenation of column spans ``cols``; entries that continue one another in memory
    are merged (adjacent rows of full-width columns become one entry). Vectorised: no
    Python step per page. Returns uint64 [k, 2]."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    offs = np.array([o for o, _ in cols], dtype=np.int64)
    lens = np.array([n for _, n in cols], dtype=np.int64)
    addr = (base + rows[:, None] * row_stride + offs[None, :]).reshape(-1)
    ln = np.broadcast_to(lens, (rows.size, lens.size)).reshape(-1)
    if addr.size == 0:
        return np.empty((0, 2), dtype=np.uint64)
    keep = ln > 0
    addr, ln = addr[keep], ln[keep]
    # a new entry starts wherever the previous one does not end right here
    start = np.ones(addr.size, dtype=bool)
    start[1:] = addr[1:] != addr[:-1] + ln[:-1]
    first = np.flatnonzero(start)
    out = np.empty((first.size, 2), dtype=np.uint64)
    out[:, 0] = addr[first]
    out[:, 1] = np.add.reduceat(ln, first)
    return out


class RawRequest:
    """A libucp send or receive request polled from the worker's thread; duck-types the
    bits of a ucxx request the plane uses (``completed``, ``check_error``). Frees itself
    the first time it is seen complete."""

    __slots__ = ("_lib", "_ptr", "_status", "buf", "what")

    def __init__(
        self, lib: _Lib, ptr: int | None, status: int, buf: IovBuf, what: str = "send"
    ) -> None:
        self._lib = lib
        self._ptr = ptr
        self._status = status
        self.buf = buf  # the iov and its memory stay alive as long as this does
        self.what = what

    @property
    def completed(self) -> bool:
        if self._ptr is not None:
            st = int(self._lib.lib.ucp_request_check_status(self._ptr))
            if st == _UCS_INPROGRESS:
                return False
            self._lib.lib.ucp_request_free(self._ptr)
            self._ptr, self._status = None, st
        return True

    def check_error(self) -> None:
        if self._status not in (_UCS_OK, _UCS_INPROGRESS):
            raise RuntimeError(f"UCX scatter-gather {self.what} failed: ucs_status {self._status}")


def _lib_and_iov(buf: IovBuf, what: str) -> tuple[_Lib, np.ndarray]:
    """The bound libucp and ``buf``'s entries, checked: RuntimeError when libucp is not
    usable, ValueError for entries UCX could not read as ``ucp_dt_iov_t``."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"UCX scatter-gather {what} unavailable: {_lib_error}")
    iov = buf.iov
    if iov.dtype != np.uint64 or iov.ndim != 2 or iov.shape[1] != 2 or not iov.flags.c_contiguous:
        raise ValueError("iov must be a C-contiguous uint64 [k, 2] array")
    return lib, iov


def tag_send(ep_handle: int, buf: IovBuf, tag: int) -> RawRequest:
    """Post ``buf`` as one tagged message on the ``ucp_ep_h`` ``ep_handle`` (call from the
    worker's thread). Raises when UCX refuses it at once."""
    lib, iov = _lib_and_iov(buf, "sends")
    ptr = lib.lib.ucp_tag_send_nbx(
        ep_handle, iov.ctypes.data, iov.shape[0], tag & _U64, lib.iov_param_ref
    )
    if ptr is None:  # completed in place (small message)
        return RawRequest(lib, None, _UCS_OK, buf)
    if ptr >= _PTR_ERR_MIN:
        status = ptr - (1 << 64)
        raise RuntimeError(f"ucp_tag_send_nbx (iov) failed: ucs_status {status}")
    return RawRequest(lib, ptr, _UCS_INPROGRESS, buf)


def page_iov(regions: list[tuple[int, int, int]], slots: np.ndarray) -> np.ndarray:
    """The (address, length) entries of pages landing in ``slots`` (in page order) of a
    host layer group made of ``regions`` ((base address, row stride, row bytes) each, in
    column order: a page is the concatenation of its row in every region). Returns
    uint64 [pages, len(regions), 2]: the entries of pages ``a:b`` are ``out[a:b]
    .reshape(-1, 2)`` (a view), so one call serves every segment of a batch. Not merged:
    a run of slots stays one entry per page and region (UCX unpacks an iov entry by
    entry either way). Vectorised: no Python step per page."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    base = np.array([b for b, _, _ in regions], dtype=np.int64)
    stride = np.array([s for _, s, _ in regions], dtype=np.int64)
    out = np.empty((slots.size, len(regions), 2), dtype=np.uint64)
    out[:, :, 0] = base[None, :] + slots[:, None] * stride[None, :]
    out[:, :, 1] = np.array([n for _, _, n in regions], dtype=np.uint64)[None, :]
    return out


def probe_length(worker_handle: int, tag: int, mask: int) -> tuple[int, int] | None:
    """(sender tag, length) of the first arrived message matching ``tag``/``mask`` on the
    ``ucp_worker_h`` ``worker_handle``, left where it is (``ucp_tag_probe_nb`` without
    remove); None when there is none. Call from the worker's thread."""
    lib = load()
    if lib is None:
        return None
    info = TagRecvInfo()
    h = lib.lib.ucp_tag_probe_nb(worker_handle, tag & _U64, mask & _U64, 0, ctypes.byref(info))
    if not h:
        return None
    return int(info.sender_tag), int(info.length)


def tag_recv_exact(worker_handle: int, tag: int, buf: IovBuf) -> RawRequest | None:
    """Take the first arrived message under exactly ``tag`` (probe with remove) and post
    its receive into ``buf``'s iov (``ucp_tag_msg_recv_nbx`` with ``UCP_DATATYPE_IOV``);
    None when no such message has arrived (nothing taken). The caller has checked the
    message's length (``probe_length``) against ``buf.nbytes``: a longer one would end in
    UCX's truncation error, never past the iov. Call from the worker's thread. Raises
    when UCX refuses the receive at once (the message is then consumed)."""
    lib, iov = _lib_and_iov(buf, "receives")
    info = TagRecvInfo()
    msg = lib.lib.ucp_tag_probe_nb(worker_handle, tag & _U64, _U64, 1, ctypes.byref(info))
    if not msg:
        return None
    ptr = lib.lib.ucp_tag_msg_recv_nbx(
        worker_handle, iov.ctypes.data, iov.shape[0], msg, lib.iov_param_ref
    )
    if ptr is None:  # completed in place
        return RawRequest(lib, None, _UCS_OK, buf, "receive")
    if ptr >= _PTR_ERR_MIN:
        status = ptr - (1 << 64)
        raise RuntimeError(f"ucp_tag_msg_recv_nbx (iov) failed: ucs_status {status}")
    return RawRequest(lib, ptr, _UCS_INPROGRESS, buf, "receive")
