"""One-sided UCX reads (``ucp_get_nbx``) and memory registration, for the UCX plane.

ucxx 0.52 exposes no memory handles, rkeys or put/get to Python. This module calls
libucp directly (the copy ucxx loaded, ``iov.libucp_path``) on ucxx's raw handles
(``context.handle``, ``worker.handle``, ``ep.handle``):

- producer: ``register`` (``ucp_mem_map`` of a store slab, remote read, its rkey packed
  once), ``allocate`` (memory UCX allocates, shareable: a mapped store), ``Registration``;
- consumer: ``unpack`` / ``destroy`` of a producer's rkey on an endpoint, ``rkey_ptr``
  (where a producer's memory is mapped into this process) with ``shared_mapping`` to
  bound every access, ``populate`` (map a range's pages ahead of the copies);
- the read list of a batch (``page_pieces``, ``op_lists``: vectorised, one read per run
  of rows into a run of slots) and its readers: ``RmaShared`` (the list and an atomic
  cursor) and ``RmaPull`` (one thread's share, posted and reaped on its own worker by
  the C loop in ``_ucxrma.c``, GIL released, no Python step per read).

The C loop receives libucp's function addresses from ctypes as integers, so it needs no
UCX header at build time. ``ucp_mem_map_params_t`` and ``ucp_mem_attr_t`` are mirrored
below and checked field by field against a C compile of the installed ucp.h in
tests/transport/test_ucx_rma.py (``ucp_request_param_t`` is iov.py's).

Capability check (``available()``): the ``_ucxrma`` extension is built, libucp loads with
the symbols and an API version whose layouts are mirrored (1.10+), the structs agree with
their recorded offsets, and ``tuning.ucx_rma`` is not False. Without the extension the
plane keeps its tag-message path; with ``tuning.require_native`` a missing extension
raises at import.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import native, tuning
from . import iov

# the RMA loop (_ucxrma.c; without a compiler at install time, the plane keeps its tag path)
_ucxrma = native.load("disagg.transport._ucxrma")

log = logging.getLogger(__name__)

# ucp.h (1.21): enum ucp_mem_map_params_field, ucp_mem_map_prot_t, ucp_op_attr_t
MAP_FIELD_ADDRESS = 1 << 0
MAP_FIELD_LENGTH = 1 << 1
MAP_FIELD_FLAGS = 1 << 2
MAP_FIELD_PROT = 1 << 3
MAP_ALLOCATE = 1 << 1  # ucp_mem_map flag: UCX allocates the memory (shareable: sysv/posix)
MEM_ATTR_ADDRESS = 1 << 0  # ucp_mem_attr_field
MEM_ATTR_LENGTH = 1 << 1
PROT_LOCAL_READ = 1 << 0
PROT_LOCAL_WRITE = 1 << 1
PROT_REMOTE_READ = 1 << 8
PROT_REMOTE_WRITE = 1 << 9
_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
_UCS_OK = 0


class MapParams(ctypes.Structure):
    """``ucp_mem_map_params_t`` (ucp.h 1.21): 48 bytes."""

    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


# (field, offset) of the C layout, checked at load and against a C compile in the tests
MAP_LAYOUT = {
    "field_mask": 0,
    "address": 8,
    "length": 16,
    "flags": 24,
    "prot": 28,
    "memory_type": 32,
    "exported_memh_buffer": 40,
}
MAP_SIZE = 48


class MemAttr(ctypes.Structure):
    """``ucp_mem_attr_t`` (ucp.h 1.21), the fields up to ``mem_type``."""

    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("mem_type", ctypes.c_int),
    ]


MEM_ATTR_LAYOUT = {"field_mask": 0, "address": 8, "length": 16, "mem_type": 24}


def _layout_ok() -> bool:
    return iov.layout_matches(MapParams, MAP_LAYOUT, MAP_SIZE) and iov.layout_matches(
        MemAttr, MEM_ATTR_LAYOUT, 32
    )


class _Lib:
    """The bound libucp functions, their addresses for the C loop, and the one request
    parameter block every get uses (host memory: spares UCX a lookup per operation)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        vp, sz, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
        status = ctypes.c_int8  # ucs_status_t: a packed enum, one signed byte
        lib.ucp_mem_map.restype = status
        lib.ucp_mem_map.argtypes = [vp, ctypes.POINTER(MapParams), ctypes.POINTER(vp)]
        lib.ucp_mem_unmap.restype = status
        lib.ucp_mem_unmap.argtypes = [vp, vp]
        lib.ucp_rkey_pack.restype = status
        lib.ucp_rkey_pack.argtypes = [vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)]
        lib.ucp_rkey_buffer_release.restype = None
        lib.ucp_rkey_buffer_release.argtypes = [vp]
        lib.ucp_ep_rkey_unpack.restype = status
        lib.ucp_ep_rkey_unpack.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(vp)]
        lib.ucp_rkey_destroy.restype = None
        lib.ucp_rkey_destroy.argtypes = [vp]
        lib.ucp_get_nbx.restype = vp
        lib.ucp_get_nbx.argtypes = [vp, vp, sz, u64, vp, vp]
        lib.ucp_ep_flush_nbx.restype = vp
        lib.ucp_ep_flush_nbx.argtypes = [vp, vp]
        lib.ucp_worker_progress.restype = ctypes.c_uint
        lib.ucp_worker_progress.argtypes = [vp]
        lib.ucp_mem_query.restype = status
        lib.ucp_mem_query.argtypes = [vp, ctypes.POINTER(MemAttr)]
        lib.ucp_rkey_ptr.restype = status
        lib.ucp_rkey_ptr.argtypes = [vp, u64, ctypes.POINTER(vp)]
        self.version = iov.bind_common(lib)
        self.lib = lib

        def addr(name: str) -> int:
            return int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0)

        self.get_fn = addr("ucp_get_nbx")
        self.put_fn = addr("ucp_put_nbx")
        self.progress_fn = addr("ucp_worker_progress")
        self.check_fn = addr("ucp_request_check_status")
        self.free_fn = addr("ucp_request_free")
        if not all((self.get_fn, self.put_fn, self.progress_fn, self.check_fn, self.free_fn)):
            raise RuntimeError("libucp lacks an RMA entry point")
        p = iov.RequestParam()
        p.op_attr_mask = _OP_ATTR_FIELD_MEMORY_TYPE
        p.memory_type = 0  # UCS_MEMORY_TYPE_HOST
        self.param = p  # kept alive: the C loop reads it
        self.param_addr = ctypes.addressof(p)


_lib: _Lib | None = None
_lib_error: str | None = None


def load() -> _Lib | None:
    """Bind libucp once (after ucxx is imported); None, with the reason kept, when the
    capability check fails."""
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:
        return _lib
    try:
        if tuning.current().ucx_rma is False:
            raise RuntimeError("turned off by DISAGG_UCX_RMA=0 (tuning.ucx_rma)")
        if _ucxrma is None:
            raise RuntimeError("the _ucxrma extension is not built")
        # the libucp ucxx loaded, and the layouts iov.py mirrors (not its on/off switch:
        # DISAGG_UCX_IOV=0 turns off iov sends only)
        path = iov.libucp_path()
        if path is None:
            raise RuntimeError("libucp not found (is ucxx imported?)")
        if not iov.layout_ok() or not _layout_ok():
            raise RuntimeError("ctypes layouts of ucp_request_param_t / ucp_mem_map_params_t")
        _lib = _Lib(path)
    except Exception as exc:
        _lib_error = f"{type(exc).__name__}: {exc}"
        log.info("UCX RMA unavailable (%s): tag messages instead", _lib_error)
    return _lib


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _lib_error


def _need() -> _Lib:
    lib = load()
    if lib is None:
        raise RuntimeError(f"UCX RMA unavailable: {_lib_error}")
    return lib


_STATUS_NAMES = {
    -3: "UCS_ERR_IO_ERROR",
    -4: "UCS_ERR_NO_MEMORY",
    -6: "UCS_ERR_UNREACHABLE",
    -16: "UCS_ERR_CANCELED",
    -25: "UCS_ERR_CONNECTION_RESET",
    -80: "UCS_ERR_ENDPOINT_TIMEOUT",
}


def status_text(status: int) -> str:
    """``ucs_status <n>`` with its UCS name where known."""
    name = _STATUS_NAMES.get(int(status))
    return f"ucs_status {status} ({name})" if name else f"ucs_status {status}"


@dataclass
class Registration:
    """A host range mapped with ``ucp_mem_map`` (remote read) and its packed rkey.
    ``owner`` keeps the memory alive while it is mapped; ``close()`` unmaps (idempotent).
    Create, use and close it on the thread that owns the context's worker."""

    ctx: int
    memh: int
    address: int
    length: int
    rkey: bytes
    owner: Any
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        st = int(_need().lib.ucp_mem_unmap(self.ctx, self.memh))
        if st != _UCS_OK:
            log.warning("ucp_mem_unmap failed: ucs_status %d", st)


def register(
    ctx_handle: int, address: int, length: int, owner: Any, writable: bool = False
) -> Registration:
    """Map ``[address, address + length)`` for remote reads (and writes, ``writable``)
    and pack its rkey (the packed buffer is copied, then released at once)."""
    lib = _need().lib
    if length < 1:
        raise ValueError("cannot register an empty range")
    p = MapParams()
    p.field_mask = MAP_FIELD_ADDRESS | MAP_FIELD_LENGTH | MAP_FIELD_PROT
    p.address, p.length = address, length
    p.prot = PROT_LOCAL_READ | PROT_LOCAL_WRITE | PROT_REMOTE_READ
    if writable:
        p.prot |= PROT_REMOTE_WRITE
    memh = ctypes.c_void_p()
    st = int(lib.ucp_mem_map(ctx_handle, ctypes.byref(p), ctypes.byref(memh)))
    if st != _UCS_OK or not memh.value:
        raise RuntimeError(f"ucp_mem_map of {length} bytes failed: ucs_status {st}")
    try:
        return register_rkey(ctx_handle, int(memh.value), address, length, owner)
    except BaseException:
        lib.ucp_mem_unmap(ctx_handle, memh)
        raise


def allocate(ctx_handle: int, length: int) -> tuple[Registration, Any]:
    """Memory UCX allocates (``ucp_mem_map`` with ``UCP_MEM_MAP_ALLOCATE``, remote read):
    UCX tries its allocators in ``UCX_MEM_MALLOC_HOOKS``/``UCX_MEM_ALLOC_METHODS`` order,
    shared memory (``sysv``, ``posix``) first where the mm transports are enabled, so a
    consumer on this host can map it (``rkey_ptr``); where it fell back to private
    memory the consumer's ``rkey_ptr`` simply fails and it reads with gets. Returns the
    registration (its rkey packed once; no ``owner``) and a
    ``ctypes`` byte array over the memory (weak-referenceable): keep the array alive
    while the memory is used, and unmap only once it is gone (``release_when_unused``).
    Call on the thread that owns the context's worker."""
    lib = _need().lib
    if length < 1:
        raise ValueError("cannot allocate an empty range")
    p = MapParams()
    p.field_mask = MAP_FIELD_LENGTH | MAP_FIELD_PROT | MAP_FIELD_FLAGS
    p.length = length
    p.flags = MAP_ALLOCATE
    p.prot = PROT_LOCAL_READ | PROT_LOCAL_WRITE | PROT_REMOTE_READ
    memh = ctypes.c_void_p()
    st = int(lib.ucp_mem_map(ctx_handle, ctypes.byref(p), ctypes.byref(memh)))
    if st != _UCS_OK or not memh.value:
        raise RuntimeError(f"ucp_mem_map(ALLOCATE) of {length} bytes failed: ucs_status {st}")
    try:
        attr = MemAttr()
        attr.field_mask = MEM_ATTR_ADDRESS | MEM_ATTR_LENGTH
        st = int(lib.ucp_mem_query(memh, ctypes.byref(attr)))
        if st != _UCS_OK or not attr.address:
            raise RuntimeError(f"ucp_mem_query failed: ucs_status {st}")
        if attr.length < length:
            raise RuntimeError(f"ucp_mem_map(ALLOCATE) gave {attr.length} of {length} bytes")
        # a subclass of the array type: its instances take weak references
        buf_t: Any = type("UcxBytes", (ctypes.c_uint8 * length,), {})
        buf = buf_t.from_address(attr.address)
        # no owner: the registration must not keep the array (and so itself) alive
        reg = register_rkey(ctx_handle, int(memh.value), int(attr.address), length, None)
    except BaseException:
        lib.ucp_mem_unmap(ctx_handle, memh)
        raise
    return reg, buf


def register_rkey(
    ctx_handle: int, memh: int, address: int, length: int, owner: Any
) -> Registration:
    """The ``Registration`` of an existing memory handle, its rkey packed (the packed
    buffer copied, then released at once); the caller unmaps ``memh`` on failure."""
    lib = _need().lib
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    st = int(lib.ucp_rkey_pack(ctx_handle, memh, ctypes.byref(buf), ctypes.byref(size)))
    if st != _UCS_OK or not buf.value:
        raise RuntimeError(f"ucp_rkey_pack failed: ucs_status {st}")
    try:
        rkey = ctypes.string_at(buf.value, size.value)
    finally:
        lib.ucp_rkey_buffer_release(buf)
    return Registration(ctx_handle, memh, address, length, rkey, owner)


def release_when_unused(reg: Registration, buf_ref: Any, keep: Any) -> bool:
    """Unmap an allocated registration (``allocate``) now if its byte array is gone
    (``buf_ref``: a weak reference to it), else once the array is collected, keeping
    ``keep`` (the UCX context: the unmap needs it) alive until then. Call once the
    owning plane stopped using the memory (its progress thread ended). Returns whether
    it was unmapped now. Nothing is unmapped at interpreter exit (the process's end
    frees it), so a tensor over the memory is never left dangling."""
    buf = buf_ref()
    if buf is None:
        reg.close()
        return True

    def free(reg: Registration = reg, keep: Any = keep) -> None:
        reg.close()  # ``keep`` (the context) is released with this function, after

    fin = weakref.finalize(buf, free)
    fin.atexit = False
    return False


def rkey_ptr(rkey: int, raddr: int) -> tuple[int, int]:
    """(ucs_status, local address) of remote address ``raddr`` under an unpacked key:
    status 0 only where the key's memory is mapped into this process (shared-memory
    transports, memory UCX allocated). UCX only adds an offset: the caller bounds every
    access (``shared_mapping``)."""
    out = ctypes.c_void_p()
    st = int(_need().lib.ucp_rkey_ptr(rkey, raddr & ((1 << 64) - 1), ctypes.byref(out)))
    return st, int(out.value or 0)


def shared_mapping(addr: int) -> tuple[int, int] | None:
    """[start, end) of the readable *shared* mapping of this process containing ``addr``
    (/proc/self/maps: permissions ``r..s``), or None: where a mapped remote key's memory
    lies, so reads through it can be bounded (a header naming rows past the producer's
    segment must never make this process read outside it)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                rng, perms = line.split(None, 2)[:2]
                lo_s, hi_s = rng.split("-")
                lo, hi = int(lo_s, 16), int(hi_s, 16)
                if lo <= addr < hi:
                    return (lo, hi) if perms[0] == "r" and perms[3] == "s" else None
    except (OSError, ValueError):
        return None
    return None


_MADV_POPULATE_READ = 22  # Linux 5.14+
_libc: Any = None


def populate(start: int, end: int) -> int:
    """Map the pages of ``[start, end)`` of this process's address space for reading
    (``madvise(MADV_POPULATE_READ)``: what first touches would do, ~2.4x cheaper than
    the faults on this VM); returns 0 or the errno (EINVAL before Linux 5.14). The range
    must be mapped (``shared_mapping``) and stay mapped during the call."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.restype = ctypes.c_int
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = lib
    if _libc.madvise(start, end - start, _MADV_POPULATE_READ) == 0:
        return 0
    return ctypes.get_errno() or -1


def unpack(ep_handle: int, rkey: bytes) -> int:
    """A remote key handle for ``rkey`` (packed by the peer) on the endpoint; destroy it
    with ``destroy`` before the plane closes."""
    out = ctypes.c_void_p()
    st = int(_need().lib.ucp_ep_rkey_unpack(ep_handle, rkey, ctypes.byref(out)))
    if st != _UCS_OK or not out.value:
        raise RuntimeError(f"ucp_ep_rkey_unpack failed: ucs_status {st}")
    return int(out.value)


def destroy(rkey: int) -> None:
    _need().lib.ucp_rkey_destroy(rkey)


def page_pieces(
    cols: tuple[tuple[int, int], ...], parts: list[int]
) -> list[tuple[int, int, int, int]]:
    """Cut a page into pieces that are each one span of the source (its column spans
    ``cols`` of a store row, in page order) and one span of one destination region
    (``parts``: the group's region sizes, in page order); both partitions cover the same
    ``page_bytes``. Returns (source column offset in the row, destination region,
    offset in that region's row, length) per piece. Worked out once per layout: every
    RMA batch asks, and a TP slice's layout has ``2 * layers`` pieces (a numpy search
    per edge)."""
    return list(_pieces(tuple((int(o), int(n)) for o, n in cols), tuple(int(n) for n in parts)))


@functools.lru_cache(maxsize=256)
def _pieces(
    cols: tuple[tuple[int, int], ...], parts: tuple[int, ...]
) -> tuple[tuple[int, int, int, int], ...]:
    cuts = {0}
    at = 0
    for _, n in cols:
        at += n
        cuts.add(at)
    total = at
    at = 0
    for n in parts:
        at += n
        cuts.add(at)
    if at != total:
        raise ValueError(f"source pages of {total} bytes, destination pages of {at}")
    edges = sorted(cuts)
    col_starts = np.cumsum([0] + [n for _, n in cols])
    reg_starts = np.cumsum([0] + list(parts))
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        c = int(np.searchsorted(col_starts, a, side="right")) - 1
        r = int(np.searchsorted(reg_starts, a, side="right")) - 1
        out.append((cols[c][0] + a - int(col_starts[c]), r, a - int(reg_starts[r]), b - a))
    return tuple(out)


def op_lists(
    src_base: int,
    src_stride: int,
    rows: np.ndarray,
    dst_bases: list[int],
    dst_strides: list[int],
    slots: np.ndarray,
    pieces: list[tuple[int, int, int, int]],
    max_len: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local, remote, length) uint64 arrays of the reads that move pages: page ``i`` is
    row ``rows[i]`` of the remote slab (``src_base`` + row * ``src_stride``) landing in
    slot ``slots[i]`` of each destination region (``dst_bases``/``dst_strides``), cut
    into ``pieces`` (``page_pieces``). Reads that continue one another on both sides are
    merged into one (consecutive rows into consecutive slots: one read per run); with
    ``max_len``, a read longer than that is then cut into reads of at most ``max_len``
    bytes (so a long run can be shared between reader threads: ``RmaShared``).
    Vectorised: no Python step per page."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    if rows.size != slots.size:
        raise ValueError(f"{rows.size} rows for {slots.size} slots")
    soff = np.array([p[0] for p in pieces], dtype=np.int64)
    reg = np.array([p[1] for p in pieces], dtype=np.int64)
    doff = np.array([p[2] for p in pieces], dtype=np.int64)
    plen = np.array([p[3] for p in pieces], dtype=np.int64)
    dbase = np.asarray(dst_bases, dtype=np.int64)[reg] + doff
    dstride = np.asarray(dst_strides, dtype=np.int64)[reg]
    remote = (src_base + rows[:, None] * src_stride + soff[None, :]).reshape(-1)
    local = (dbase[None, :] + slots[:, None] * dstride[None, :]).reshape(-1)
    length = np.broadcast_to(plen, (rows.size, plen.size)).reshape(-1)
    if remote.size == 0:
        e = np.empty(0, dtype=np.uint64)
        return e, e.copy(), e.copy()
    start = np.ones(remote.size, dtype=bool)
    ends_r = remote[:-1] + length[:-1]
    ends_l = local[:-1] + length[:-1]
    start[1:] = (remote[1:] != ends_r) | (local[1:] != ends_l)
    first = np.flatnonzero(start)
    loc, rem, ln = local[first], remote[first], np.add.reduceat(length, first)
    if max_len is not None and ln.size and int(ln.max()) > max_len:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, not {max_len}")
        cuts = -(-ln // max_len)  # reads per merged read
        at = np.repeat(np.cumsum(cuts) - cuts, cuts)  # index of each piece's first piece
        off = (np.arange(int(cuts.sum()), dtype=np.int64) - at) * max_len
        loc, rem = np.repeat(loc, cuts) + off, np.repeat(rem, cuts) + off
        ln = np.minimum(np.repeat(ln, cuts) - off, max_len)
    return loc.astype(np.uint64), rem.astype(np.uint64), ln.astype(np.uint64)


class RmaShared:
    """A read list that several threads read at once (the consumer's reader threads,
    "Reader threads" in rma.py), each through its own ``RmaPull``: they claim
    ``slice`` reads at a time from one atomic cursor (``_ucxrma.pull``), so the list is
    shared out as it goes, whatever each thread's speed. Keeps the arrays (and ``keep``:
    what they point into) alive while any reader may still post from them."""

    __slots__ = ("local", "remote", "length", "cursor", "slice", "keep", "total", "addrs")

    def __init__(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        length: np.ndarray,
        slice_bytes: int,
        keep: Any = None,
    ) -> None:
        n = int(local.size)
        for a in (local, remote, length):
            if a.dtype != np.uint64 or not a.flags.c_contiguous or a.size != n:
                raise ValueError("local/remote/length must be C-contiguous uint64 of one size")
        self.local, self.remote, self.length, self.keep = local, remote, length, keep
        self.total = n
        mean = int(length.sum()) // n if n else 1
        self.slice = max(1, min(64, slice_bytes // max(mean, 1)))
        self.cursor = np.zeros(1, dtype=np.int64)  # next unclaimed read (atomic in C)
        # (local, remote, length, cursor) addresses, taken once (``.ctypes`` costs µs)
        self.addrs = tuple(int(a.ctypes.data) for a in (local, remote, length, self.cursor))

    @property
    def claimed(self) -> bool:
        """Every read was claimed by some reader (or the list was stopped)."""
        return int(self.cursor[0]) >= self.total

    def stop(self) -> None:
        """No reader claims another read (a plain aligned 8-byte store; readers may
        still finish the slice they hold)."""
        self.cursor[0] = max(self.total, int(self.cursor[0]))


class RmaPull:
    """One thread's share of an ``RmaShared`` read list, posted on its own endpoint with
    a remote key unpacked there, progressed and reaped on its own worker (only ever
    from that worker's thread)."""

    __slots__ = (
        "_lib",
        "_shared",
        "_ep",
        "_rkey",
        "_reqs",
        "_reqs_addr",
        "_n",
        "_start",
        "status",
        "posted",
    )

    def __init__(self, shared: RmaShared, ep_handle: int, rkey: int) -> None:
        self._lib = _need()
        assert _ucxrma is not None
        self._shared = shared
        self._ep, self._rkey = ep_handle, rkey
        self._reqs = np.zeros(max(shared.total, 1), dtype=np.uint64)
        self._reqs_addr = int(self._reqs.ctypes.data)
        self._n = 0  # requests UCX returned (the others completed in place)
        self._start = 0  # of those, seen complete and freed
        self.status = _UCS_OK  # first failure (refused at post or completed in error)
        self.posted = 0

    def step(self, worker_handle: int, max_bytes: int = 0) -> int:
        """Claim and post reads until none is left to claim or this call posted
        ``max_bytes`` (0: no limit); returns the bytes posted."""
        sh = self._shared
        if sh.claimed or self.status != _UCS_OK:
            return 0
        assert _ucxrma is not None
        lib = self._lib
        local, remote, length, cursor = sh.addrs
        posted, nbytes, self._n, self._start, st = _ucxrma.pull(
            lib.get_fn,
            self._ep,
            self._rkey,
            lib.param_addr,
            local,
            remote,
            length,
            sh.total,
            cursor,
            sh.slice,
            max_bytes,
            lib.progress_fn,
            worker_handle,
            lib.check_fn,
            lib.free_fn,
            self._reqs_addr,
            self._n,
            self._start,
        )
        self.posted += posted
        if st and self.status == _UCS_OK:
            self.status = st
        return int(nbytes)

    @property
    def left(self) -> int:
        """Requests posted by this reader not yet seen complete."""
        return self._n - self._start

    @property
    def finished(self) -> bool:
        """Nothing left to claim (for anyone) and every request of this reader done."""
        return (self._shared.claimed or self.status != _UCS_OK) and self.left == 0

    @property
    def ok(self) -> bool:
        return self.status == _UCS_OK

    def drive(self, worker_handle: int, rounds: int) -> int:
        """Progress the worker up to ``rounds`` times (0: only check), reaping this
        reader's requests; returns how many are still in flight."""
        if self._start < self._n:
            assert _ucxrma is not None
            lib = self._lib
            self._start, st = _ucxrma.drive(
                lib.progress_fn,
                worker_handle,
                lib.check_fn,
                lib.free_fn,
                self._reqs_addr,
                self._n,
                self._start,
                rounds,
            )
            if st and self.status == _UCS_OK:
                self.status = st
                self._shared.stop()
        return self.left
