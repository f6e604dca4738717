"""Commits of saved passes, off the engine thread.

A forward pass's save copies are enqueued layer by layer (``saving.py``); in
``wait_for_save`` the engine thread only queues the pass here (CUDA: with an event recorded
after its copies) and goes on to sample its tokens. One committer thread per service takes
the passes in order: it waits for the pass's event (a blocking-sync event: the wait sleeps
and releases the GIL), then runs the commit (land a host store's staging, checksum the
rows, mark them STORED, publish index events, wake the pushes waiting for them, settle
the requests' saves in flight). So nothing between the last layer and the first token
waits for, or spends time on, a commit.

The guarantees stay the connector's: a block is published only after its bytes landed
(the event), and a request is reported finished (its pages handed back to the engine)
only once its saves are settled, which happens after the commit. A commit that raises
aborts the pass's blocks (never served half written) and still settles the requests.

The bound: each pass's lag, from ``submit`` (end of the forward) to its commit done, is
kept (``lags_s``, the last ``LAG_WINDOW`` passes; the service counts their sum as
``commit_lag_seconds`` over ``passes_committed``); ``drain`` waits until everything queued
is committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("disagg.producer")

LAG_WINDOW = 256


@dataclass(eq=False)
class PendingPass:
    """A pass whose copies are enqueued: committed once ``event`` (None: at once) fired."""

    keys: list[bytes]
    counts: dict[int, int]
    event: Any = None
    stream: Any = None  # the copies' stream: the commit's device work is ordered on it
    copy: Any = None
    queued_at: float = field(default_factory=time.perf_counter)


class Committer:
    """One thread committing queued passes in order (see the module docstring)."""

    def __init__(
        self,
        commit: Callable[[PendingPass], None],
        abort: Callable[[PendingPass], None],
        name: str = "disagg-commit",
    ) -> None:
        self._commit, self._abort = commit, abort
        self._queue: deque[PendingPass] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.lags_s: deque[float] = deque(maxlen=LAG_WINDOW)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, p: PendingPass) -> None:
        with self._cv:
            self._queue.append(p)
            self._cv.notify_all()

    def pending(self) -> int:
        with self._cv:
            return len(self._queue)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every pass queued so far is committed; False on timeout."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while self._queue:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                p = self._queue[0]
            try:
                if p.event is not None:
                    p.event.synchronize()
                self._commit(p)
            except Exception:  # the thread must outlive any one bad pass
                log.exception("commit of a saved pass failed: its blocks are dropped")
                try:
                    self._abort(p)
                except Exception:
                    log.exception("aborting a failed commit failed")
            with self._cv:
                self._queue.popleft()
                self.lags_s.append(time.perf_counter() - p.queued_at)
                self._cv.notify_all()
