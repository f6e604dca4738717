"""The committer thread: passes committed in order once their event fired, a failing
commit aborts its pass and the thread goes on, ``drain`` waits for everything queued."""

from __future__ import annotations

import threading

from disagg.producer.commits import Committer, PendingPass


class _Event:
    """Stands in for a CUDA event: ``synchronize`` blocks until ``fire``."""

    def __init__(self) -> None:
        self._fired = threading.Event()

    def fire(self) -> None:
        self._fired.set()

    def synchronize(self) -> None:
        assert self._fired.wait(10)


def test_passes_commit_in_order_after_their_event_and_failures_abort():
    committed: list[list[bytes]] = []
    aborted: list[list[bytes]] = []

    def commit(p: PendingPass) -> None:
        if p.keys == [b"bad"]:
            raise RuntimeError("injected commit failure")
        committed.append(p.keys)

    c = Committer(commit, lambda p: aborted.append(p.keys))
    try:
        first, second = _Event(), _Event()
        c.submit(PendingPass([b"a"], {1: 1}, event=first))
        c.submit(PendingPass([b"b"], {1: 1}, event=second))
        c.submit(PendingPass([b"bad"], {2: 1}))
        c.submit(PendingPass([b"c"], {3: 1}))  # CPU: no event, committed at once in turn
        second.fire()  # the later pass's copies are done; the first's are not
        assert not c.drain(0.2) and committed == [] and c.pending() == 4
        first.fire()
        assert c.drain(10)
        assert committed == [[b"a"], [b"b"], [b"c"]] and aborted == [[b"bad"]]
        assert c.alive() and len(c.lags_s) == 4 and all(lag >= 0 for lag in c.lags_s)
    finally:
        c.close()
