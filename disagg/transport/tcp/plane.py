"""``TcpDataPlane``: both DataPlane sides over plain stream sockets (``transport: tcp``).

Endpoints: ``tcp://host:port`` (TCP; ``:0`` picks a port) or ``ipc://path`` (an AF_UNIX
socket: same host, large pages through a pipe). Control messages stay on ZMQ
(``transport/control.py``); the pages never touch it.

Copies: one per byte per side on the plain stream, both by the kernel (the sender's
``sendmsg`` reads the store rows, the receiver's ``recvmsg`` writes the slot rows of a
directly registered host region); one per byte in all through the pipe (the sender's
``vmsplice`` references the rows, the receiver's ``readv`` is the copy).

Receiver rules (authentication, slot checks before any byte lands, the transfer state
machine, abort) are the shared ``ReceiverBook``'s (``transport/receiver.py``); this
package only moves bytes: ``receiver`` (accept, check, land), ``sender`` (lanes, hello,
batches), ``plan`` (pages into batches), ``wire`` (the stream format), ``rowio`` (rows
through sockets and pipes).

Checksum: off by default. TCP and AF_UNIX deliver bytes intact and in order, and the
receiver checks each batch's slots and byte count and the per-group page counts
itself. ``checksum=True`` (config ``transport_checksum: true``) adds xxh3-64 over the
payload in wire order, verified at TransferDone, only when both planes have it on.

Switches (``disagg.tuning``): ``stream_pipe`` False neither offers nor accepts the pipe;
``stream_tcp_msg_bytes`` and ``stream_tcp_sndbuf`` (see ``plan`` and ``sender``).
Measurements behind the defaults: docs/design/tcp-plane.md.
"""

from __future__ import annotations

import threading
from collections import Counter

from ... import tuning
from ..dataplane import DataPlane
from . import rowio
from .plan import msg_bytes
from .receiver import StreamReceiver
from .sender import StreamSender


class TcpDataPlane(StreamReceiver, StreamSender, DataPlane):
    """Both DataPlane sides over plain stream sockets (see the module docstring).
    ``bind`` is the receiver endpoint (``tcp://host:0`` picks a port, ``ipc://path``);
    ``advertise`` replaces the bound address in ``endpoint`` when peers must use another
    name (e.g. bound on 0.0.0.0). ``checksum``: hash payloads with xxh3-64 and verify at
    the receiver (default off; verified only when both planes have it on)."""

    accepts_store_rows = True  # producers hand StoreRows: pages leave from the store rows

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        advertise: str | None = None,
        checksum: bool = False,
    ) -> None:
        self.checksum = checksum
        # same-host payloads on a pipe (offered as a sender, accepted as a receiver)
        self.pipe = tuning.current().stream_pipe is not False
        msg_bytes("tcp://")  # a malformed switch fails here, not at every push
        self.stats: Counter[str] = Counter()
        self._stop = threading.Event()
        self._tx_start()
        bound = self._rx_start(bind, checksum)
        self._endpoint = advertise or bound

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def health(self) -> tuple[bool, str]:
        if self._stop.is_set():
            return False, "data plane closed"
        if not self._rx_thread.is_alive():
            return False, "data plane receiver thread died"
        with self._lanes_lock:
            dead = [ep for ep, lane in self._lanes.items() if not lane.thread.is_alive()]
        if dead:
            return False, f"data plane sender for {dead[0]} died"
        return True, ""

    def close(self) -> None:
        self._stop.set()
        with self._lanes_lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            rowio.shutdown(lane.sock)  # a send blocked on a stalled peer ends now
        for t in [self._rx_thread, *(lane.thread for lane in lanes)]:
            t.join(5.0)
