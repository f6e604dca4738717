"""The plane's UCX worker, its endpoints to peers, and the progress thread's inbox.

Contract: one progress thread (the plane's) owns the worker and makes every UCX call on
it. Other threads only queue work (``submit``) and wake it (``wake``: a byte on a pipe
the thread polls beside the worker's event fd). ``connect`` returns the endpoint for a
peer's address, made on first use and cached; ``close_ep`` and ``sever`` end them.
Closed endpoints are kept (``dead``) until the worker goes: destroying one mid-progress,
or closing one that already failed, crashes libucxx 0.52.

Endpoint strings (the plane's ``endpoint``: an address only; what the receiver takes
travels beside it as ``DataCaps`` in the control messages):

- ``ucx+tcp://host:port``: a UCX listener. Endpoints both ways have UCX error handling,
  so a peer that dies fails the requests in flight; ``sever`` force-closes the accepted
  ones.
- ``ucx+shm://<hex worker address>``: endpoints made from the worker address, without
  error handling: the only way UCX uses shared memory and cma here (with error handling
  UCX 1.21 picks no shared-memory lane). A peer that dies is noticed by a failed cma
  copy (cma_guard.py) or the transfer's deadline.
- ``ucx+addr://<hex worker address>``: the ``auto`` channel; UCX picks shared memory
  locally and tcp otherwise.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, urlsplit

import numpy as np
import ucxx._lib.libucxx as ucx_api
from ucxx._lib.arr import Array

from . import wire

log = logging.getLogger(__name__)

# How long a header or acknowledgement receive may take once its message was matched.
# Such messages are small (a header is at most wire.HDR_MAX): taking longer means the
# sender died or stopped in the middle of it.
SMALL_RECV_WAIT_S = 2.0


class Link:
    """See the module docstring. ``thread`` is the progress thread (set by the plane);
    ``worker`` and the endpoints exist between ``open`` and ``close_all``."""

    def __init__(self, stats: Counter[str]) -> None:
        self.stats = stats
        self.stop = threading.Event()
        self.jobs: deque[Callable[[], None]] = deque()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.thread: threading.Thread | None = None
        self.worker: Any = None
        self.endpoint = ""  # this plane's own address
        self.eps: dict[str, Any] = {}  # by peer address
        self.accepted: list[Any] = []  # endpoints the listener made (kept alive)
        self.dead: list[Any] = []
        self.listener: Any = None
        self._discards: list[tuple[Any, np.ndarray]] = []

    # ------------------------------------------------------------------ inbox
    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.append(job)
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def run_jobs(self) -> None:
        while self.jobs:
            self.jobs.popleft()()

    def drain_wakes(self) -> None:
        try:
            os.read(self.wake_r, 4096)
        except BlockingIOError:
            pass

    def close_pipe(self) -> None:
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def call(self, job: Callable[[], None], timeout_s: float = 10.0) -> None:
        """Run ``job`` on the progress thread (at once when already on it) and wait."""
        if threading.current_thread() is self.thread:
            job()
            return
        done = threading.Event()

        def run() -> None:
            try:
                job()
            finally:
                done.set()

        self.submit(run)
        done.wait(timeout_s)

    # -------------------------------------------------------------- endpoints
    def open(self, worker: Any, channel: str, bind: SplitResult, advertise: str | None) -> None:
        """Start serving on ``worker`` (progress thread): a listener on the ``tcp``
        channel, the worker's own address otherwise; sets ``endpoint``."""
        self.worker = worker
        if channel != "tcp":
            scheme = "ucx+shm" if channel == "shm" else "ucx+addr"
            self.endpoint = f"{scheme}://{worker.address.tobytes().hex()}"
            return
        host = bind.hostname or "127.0.0.1"
        self.listener = ucx_api.UCXListener.create(
            worker=worker, port=bind.port or 0, cb_func=self._on_connect
        )
        port = self.listener.port
        if advertise and advertise.startswith("ucx+"):
            self.endpoint = advertise
            return
        if advertise:
            a = urlsplit(advertise)
            host, port = a.hostname or host, a.port or port
        if host in ("0.0.0.0", "*", ""):
            host = "127.0.0.1"
        self.endpoint = f"ucx+tcp://{host}:{port}"

    def _on_connect(self, conn_request: Any) -> None:
        assert self.listener is not None
        self.accepted.append(self.listener.create_endpoint_from_conn_request(conn_request, True))

    def connect(self, endpoint: str) -> Any:
        """The endpoint to the peer at ``endpoint`` (made on first use, cached while it
        lives)."""
        ep = self.eps.get(endpoint)
        if ep is not None and ep.alive:
            return ep
        u = urlsplit(endpoint)
        if u.scheme == "ucx+tcp":
            ep = ucx_api.UCXEndpoint.create(self.worker, u.hostname or "127.0.0.1", u.port, True)
        else:
            ep = worker_address_ep(self.worker, endpoint)
        self.eps[endpoint] = ep
        return ep

    def close_ep(self, ep: Any) -> None:
        """Close ``ep`` (cancelling what is queued on it) and keep it until the worker
        goes."""
        try:
            if ep.alive:
                ep.close()
        except Exception:
            pass
        self.dead.append(ep)

    def drop(self, endpoint: str) -> None:
        """Close the cached endpoint to ``endpoint``, if any (the next push reconnects)."""
        ep = self.eps.pop(endpoint, None)
        if ep is not None:
            self.close_ep(ep)

    def sever(self, why: str) -> int:
        """Force-close every accepted (producer) endpoint, on the progress thread, and
        wait for it; returns how many were closed. Their matched receives end with an
        error; what those producers send later lands nowhere, and they reconnect on their
        next push. UCX does not say which connection a matched receive belongs to, so
        every producer's connection goes."""
        closed = [0]

        def job() -> None:
            eps = self.accepted[:]
            self.accepted.clear()
            for ep in eps:
                try:
                    # accepted endpoints have error handling: ucxx closes them with
                    # UCP_EP_CLOSE_FLAG_FORCE and then lets go of the UCP handle
                    if ep.alive:
                        ep.close_blocking()
                        closed[0] += 1
                except Exception:
                    log.exception("force-closing an accepted endpoint failed")
                self.dead.append(ep)
            self.stats["severed"] += closed[0]
            log.warning("severed %d producer connections (%s)", closed[0], why)

        self.call(job)
        return closed[0]

    def discard(self, probe: Any) -> None:
        """Receive an unwanted arrived message (a refused batch's payload, a stranger's,
        an unknown acknowledgement) somewhere harmless, so it does not pile up in UCX (a
        longer one than ``SEG_BYTES`` ends truncated, which is as good)."""
        buf = np.empty(min(max(int(probe.length), 1), wire.SEG_BYTES), dtype=np.uint8)
        self._discards.append((self.worker.tag_recv_with_handle(Array(buf), probe), buf))
        self.stats["discarded"] += 1

    def receive_small(self, probe: Any, buf: np.ndarray, what: str) -> Any:
        """Receive an arrived control message (a header, an acknowledgement) into ``buf``
        and wait for it, at most SMALL_RECV_WAIT_S: a peer that died or stopped in the
        middle of it (its rendezvous never answered; shm endpoints run without error
        handling) must not hold this thread. The request, or None when it was abandoned
        (``buf`` is then kept until the request ends or teardown cancels it)."""
        req = self.worker.tag_recv_with_handle(Array(buf), probe)
        if req.completed:
            return req
        give_up = time.monotonic() + SMALL_RECV_WAIT_S
        while not req.completed:
            if self.stop.is_set() or time.monotonic() > give_up:
                self._discards.append((req, buf))
                self.stats[f"abandoned_{what}"] += 1
                log.warning(
                    "a %s receive did not complete within %.1f s (its sender died or "
                    "stopped): abandoned",
                    what,
                    SMALL_RECV_WAIT_S,
                )
                return None
            self.worker.progress()
        return req

    def reap_discards(self) -> None:
        if self._discards:
            self._discards = [d for d in self._discards if not d[0].completed]

    def close_all(self) -> None:
        """Close every endpoint and the listener (progress thread, at teardown)."""
        for ep in list(self.eps.values()) + self.accepted:
            self.close_ep(ep)
        try:
            self.worker.cancel_inflight_requests()
            self.worker.progress()
        except Exception:
            pass

    def forget(self) -> None:
        """Drop the (closed) endpoints and the listener, after ``close_all`` and the
        other components' teardown."""
        self.eps.clear()
        self.accepted.clear()
        self.listener = None


def worker_address_ep(worker: Any, endpoint: str) -> Any:
    """An endpoint without error handling to the worker address in ``ucx+shm://<hex>`` or
    ``ucx+addr://<hex>`` (see the module docstring for why no error handling)."""
    u = urlsplit(endpoint)
    addr = ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(u.netloc or u.path.lstrip("/")))
    return ucx_api.UCXEndpoint.create_from_worker_address(worker, addr, False)
