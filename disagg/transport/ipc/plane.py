"""``IpcDataPlane`` (``transport: ipc``): producer and consumer on one host; the
receiver copies pages straight out of the sender's store.

A push over a socket moves each page at least three times (gather, wire, scatter);
between processes of one host the receiver maps the sender's store instead and moves
each page once, source row to destination slot, with ``page_copy`` (one Triton kernel on
a GPU, torch's index kernels on the host).

- The sender registers its store once (``register_source``): a device store is shared
  through CUDA IPC, a host store is moved into a /dev/shm file (``host``).
- A push (``protocol.ipc.IpcPush``) describes its pages as rows of an export and their
  destination slots, and carries the exports' descriptions; the receiver opens an
  export once and keeps it. Control messages travel on framed stream sockets
  (``framed``: TCP or AF_UNIX at ``endpoint``, a bare address).
- The receiver checks everything before it copies a byte (the shared ``ReceiverBook``
  rules, plus export bounds and host identity), copies (``staging``), and answers
  ``IpcAck`` once the copy is over; the sender's push is DONE only on that answer.
- ``capabilities``: ``DataCaps(parts=True)``: this receiver takes a push in parts
  (``parts``), and a sender cuts one only when the caps it was given say so.

Limits: one host only (a peer on another host is refused with a message naming the
fix). A CUDA export is only as alive as the sender process: the receiver checks the
sender's pid before each device copy, which narrows but cannot close that window (a
/dev/shm export stays readable: the mapping outlives the sender).

Threads: a sender thread (``sender``), a receiver thread and a landing thread
(``receiver``). After a wait that found work each spins for ``spin_us`` (``spin``;
``ipc_spin_us`` / ``tuning.spin_us``) before it blocks again. Measurements behind
these choices: docs/design/ipc-plane.md.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Sequence

from ...protocol import messages as m
from .. import spin
from ..dataplane import DataPlane
from . import host
from .parts import parts_setting
from .receiver import IpcReceiver
from .sender import IpcSender


class IpcDataPlane(IpcReceiver, IpcSender, DataPlane):
    """Both DataPlane sides for processes on one host (see the module docstring).
    ``bind``: where the receiver listens (``tcp://127.0.0.1:0`` or ``ipc://path``);
    ``advertise`` replaces the bound address in ``endpoint``. ``spin_us``: the threads'
    spin window (None: ``spin.default_spin_us()``). ``push_parts``: leading part sizes in
    pages of a push sent in parts (None: ``parts``' default; ``[0]`` never)."""

    accepts_store_rows = True  # producers hand StoreRows: no gather before a push

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        advertise: str | None = None,
        spin_us: int | None = None,
        push_parts: Sequence[int] | None = None,
    ) -> None:
        parts = parts_setting(push_parts)
        self.stats: Counter[str] = Counter()
        # spin-then-block window of the sender, receiver and waiting threads (spin.py)
        self._spin_ns = 1000 * (spin.default_spin_us() if spin_us is None else spin_us)
        self._stop = threading.Event()
        self._tx_start(parts)
        self._endpoint = advertise or self._rx_start(bind)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def capabilities(self) -> m.DataCaps:
        return m.DataCaps(parts=True)

    def health(self) -> tuple[bool, str]:
        if self._stop.is_set():
            return False, "data plane closed"
        if not self._rx_thread.is_alive():
            return False, "ipc data plane receiver thread died"
        if not self._tx_thread.is_alive():
            return False, "ipc data plane sender thread died"
        if not self._land_thread.is_alive():
            return False, "ipc data plane landing thread died"
        return True, ""

    def close(self) -> None:
        self._stop.set()
        for t in (self._land_thread, self._rx_thread, self._tx_thread):
            t.join(5.0)
        for fd in (self._wake_r, self._wake_w, self._ack_r, self._ack_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self._unix_path is not None:
            try:
                os.unlink(self._unix_path)
            except OSError:
                pass
        host.release(self._sources)
        self._prepared.clear()  # drops its references to mapped exports
        self._staging.clear()
