"""What processes of one host share for the ipc plane: exports of the sender's store.

An export (``protocol.ipc.Export``) describes memory a receiver on this host can map:
a device slab shared through CUDA IPC (torch's storage share: handle, offset, event),
or a host slab moved into a ``/dev/shm`` file named ``disagg-ipc-<pid>-<id>`` (pinned
again if it was pinned). ``register`` makes a slab an export once, at start-up;
``locate`` finds the export holding a tensor (a device tensor outside every registered
source is shared on the spot). Every export names this host's boot id (``HOST``) and
the sender's pid: a receiver refuses an export of another host and checks that the
sender of a CUDA export is alive before each copy. Shm files of processes that died
without closing their plane are removed by the next ``register`` of a host slab.

A receiver in the sending process itself uses the tensor (``local``): CUDA cannot
open an IPC handle in the process that made it.

Also here: the plane threads' wake-up pipes (``poke`` / ``drain``).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ...protocol import ipc as wire

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"^disagg-ipc-(\d+)-(\d+)$")
MAX_LOCAL_EXPORTS = 64  # shared-on-the-spot device tensors remembered for local readers

_ids = itertools.count(1)
# Exports of this process, by id: a receiver in the same process uses the tensor itself.
local: dict[int, torch.Tensor] = {}  # registered sources, until their plane closes
local_auto: OrderedDict[int, torch.Tensor] = OrderedDict()  # shared on the spot


def host_id() -> str:
    """This host's boot id: equal for every process (and container) on one kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename


HOST = host_id()


def uuid_of(device: int) -> str:
    """The UUID of CUDA device ``device``: what an export names its GPU by."""
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass
class Source:
    """A registered slab: its export and the whole export as a tensor."""

    export: wire.Export
    tensor: torch.Tensor  # uint8, 1-D, the whole export
    path: str | None = None  # shm file to unlink on close
    keep: Any = None  # the mmap


def register(sources: list[Source], tensor: torch.Tensor) -> torch.Tensor:
    """Make ``tensor`` (a store slab) readable by receivers on this host and add it to
    ``sources``; returns the tensor to use from now on. A device tensor is shared as it
    is (CUDA IPC); a host tensor is copied into a new /dev/shm file (and pinned if it
    was), and the copy is returned."""
    if tensor.device.type == "cuda":
        export = cuda_export(tensor)
        local[export.export_id] = whole = flat(tensor)
        sources.append(Source(export, whole))
        return tensor
    if tensor.device.type != "cpu":
        raise ValueError(f"ipc plane cannot share {tensor.device.type} memory")
    src = shm_source(tensor.nbytes)
    out = src.tensor.view(tensor.shape) if tensor.dim() else src.tensor
    if tensor.dim() and tensor.is_contiguous():
        out.copy_(tensor)
    else:
        raise ValueError("register_source needs a contiguous tensor")
    if tensor.is_pinned() and torch.cuda.is_available():
        rc = torch.cuda.cudart().cudaHostRegister(out.data_ptr(), max(1, out.nbytes), 0)
        if rc != 0:
            log.warning("cudaHostRegister of the shared store failed (%s): unpinned", rc)
    sources.append(src)
    return out


def release(sources: list[Source]) -> None:
    """Forget ``sources`` (a plane closes): local readers lose them, shm files go."""
    for src in sources:
        local.pop(src.export.export_id, None)
        if src.path is not None:
            try:
                os.unlink(src.path)
            except OSError:
                pass
    sources.clear()


def shm_source(nbytes: int) -> Source:
    """A new /dev/shm file of ``nbytes``, mapped, as an export of this process."""
    sweep_stale_shm()
    eid = next(_ids)
    name = f"disagg-ipc-{os.getpid()}-{eid}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(1, nbytes))
        mm = mmap.mmap(fd, max(1, nbytes))
    finally:
        os.close(fd)
    t = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
    export = wire.Export(
        export_id=eid, kind="shm", host=HOST, pid=os.getpid(), nbytes=nbytes, name=name
    )
    local[eid] = t
    return Source(export, t, path, mm)


def cuda_export(tensor: torch.Tensor) -> wire.Export:
    """The CUDA IPC export of ``tensor``'s whole storage."""
    storage = tensor.untyped_storage()
    dev, handle, size, offset, ref_h, ref_off, ev_h, ev_sync = storage._share_cuda_()
    eid = next(_ids)
    return wire.Export(
        export_id=eid,
        kind="cuda",
        host=HOST,
        pid=os.getpid(),
        nbytes=int(size),
        device_uuid=uuid_of(int(dev)),
        handle=bytes(handle),
        offset=int(offset),
        ref_handle=bytes(ref_h),
        ref_offset=int(ref_off),
        event_handle=bytes(ev_h or b""),
        event_sync=bool(ev_sync),
    )


def locate(sources: list[Source], t: torch.Tensor) -> tuple[wire.Export, int]:
    """The export holding ``t``'s first byte and that byte's offset in it. A device
    tensor outside every registered source is shared on the spot (its storage)."""
    ptr = t.data_ptr()
    for src in sources:
        base = src.tensor.data_ptr()
        if base <= ptr < base + src.export.nbytes and src.tensor.device == t.device:
            return src.export, ptr - base
    if t.device.type == "cuda":
        export = cuda_export(t)
        local_auto[export.export_id] = flat(t)
        while len(local_auto) > MAX_LOCAL_EXPORTS:
            local_auto.popitem(last=False)
        return export, ptr - t.untyped_storage().data_ptr()
    raise ValueError(
        "the ipc plane sends host memory only from a registered source: pass the store "
        "slab through register_source() first"
    )


def flat(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as uint8 1-D."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(s)


def wake_pipe() -> tuple[int, int]:
    """A non-blocking pipe ``(read end, write end)`` that wakes a thread's select."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def poke(fd: int) -> None:
    """Wake the thread that selects on the read end of the pipe ``fd`` writes to."""
    try:
        os.write(fd, b"x")
    except OSError:  # the pipe is full (the reader is awake anyway) or closed
        pass


def drain(fd: int) -> None:
    """Empty a wake-up pipe's read end (non-blocking)."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:  # empty (EAGAIN) or closed
        pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_shm() -> None:
    """Remove shm files of disagg processes that died without closing their plane."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        match = SHM_NAME.match(name)
        if match and not alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
