"""One thread that owns the reference engine and steps it while there is work.

The engine is single-threaded (``add_request`` and ``step`` from one thread), and its
connector's service threads must never be driven from the HTTP event loop. So:

- HTTP handlers call :meth:`EngineLoop.submit` (any thread), which puts a :class:`Job` on a
  thread-safe queue and returns at once;
- the engine thread drains the queue, adds the requests, steps the engine while any request
  is unfinished or the engine has work, and reports each job's new tokens and its end
  through the job's callbacks (which the server turns into ``loop.call_soon_threadsafe``);
- the engine is *built* in that thread too, so every engine call stays on one thread.

If a step raises, the engine is dead (it refuses further steps): every pending job fails
with the error, the loop records it in :attr:`fatal`, and ``/health`` turns 503.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("disagg.serve.engine")

FIRST_TOKEN_HANDOFF_S = 100e-6  # see EngineLoop._respond


@dataclass
class Job:
    """A request for the engine thread. ``on_tokens(new_ids)`` is called (engine thread)
    with each batch of new tokens; ``on_done(error_or_None, stats)`` exactly once at the
    end. Callbacks must be quick and must not raise."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    cache_salt: str | None
    on_tokens: Callable[[list[int]], None]
    on_done: Callable[[str | None, dict[str, Any]], None]
    sent: int = 0
    rid: int = -1
    t0: float = field(default_factory=time.monotonic)
    # monotonic moments: "added" (to the engine), "first_token" (its first tokens reported)
    marks: dict[str, float] = field(default_factory=dict)


class EngineLoop:
    """Owns ``make_engine()``'s engine in a daemon thread. ``start()`` waits until the engine
    is built and re-raises a construction error in the caller."""

    def __init__(self, make_engine: Callable[[], Any], idle_wait_s: float = 0.05) -> None:
        self._make_engine = make_engine
        self._idle_wait_s = idle_wait_s
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._jobs: dict[int, Job] = {}
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disagg-engine", daemon=True)
        self.engine: Any = None
        self.fatal: BaseException | None = None
        self._build_error: BaseException | None = None
        # A copy refreshed by the engine thread, so scrapes never read half-updated stats.
        self.stats: dict[str, Any] = {}
        self.in_flight = 0

    # -- any thread ----------------------------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the engine was not built within {timeout_s} s")
        if self._build_error is not None:
            raise self._build_error

    def submit(self, job: Job) -> None:
        if not self.alive:
            raise RuntimeError(f"engine loop is not running: {self.fatal or 'stopped'}")
        self._queue.put(job)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None and not self._stop.is_set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._queue.put(None)  # wake the thread
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
        except BaseException as e:  # reported to start()'s caller
            self.fatal = self._build_error = e
            self._ready.set()
            return
        self._ready.set()
        eng = self.engine
        eng.respond = self._respond  # new tokens out before the connector's get_finished
        try:
            while not self._stop.is_set():
                busy = bool(self._jobs) or eng.has_work()
                self._admit(block=not busy)
                if self._stop.is_set():
                    break
                if self._jobs or eng.has_work():
                    eng.step()
                    self._report()
                self.stats = eng.stats.as_dict()
        except BaseException as e:
            self.fatal = e
            log.exception("engine loop died", extra={"error": str(e)})
            for job in self._jobs.values():
                job.on_done(f"engine failed: {e}", {})
            self._jobs.clear()
        finally:
            self._drain_after_stop()

    def _admit(self, block: bool) -> None:
        """Move queued jobs into the engine; wait briefly for one when idle."""
        try:
            item = self._queue.get(timeout=self._idle_wait_s) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._add(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return

    def _add(self, job: Job) -> None:
        try:
            job.rid = self.engine.add_request(job.prompt, job.max_tokens, job.cache_salt)
        except ValueError as e:  # bad prompt/max_tokens: the client's error, not the engine's
            job.on_done(f"invalid request: {e}", {"client_error": True})
            return
        job.marks["added"] = time.monotonic()
        self._jobs[job.rid] = job
        self.in_flight = len(self._jobs)

    def _report(self) -> None:
        self._respond()
        eng = self.engine
        # Forget requests the engine is completely done with (results would grow forever).
        for rid, req in list(eng.requests.items()):
            if req.state == "done" and rid not in self._jobs:
                eng.requests.pop(rid, None)
                eng.results.pop(rid, None)

    def _respond(self) -> None:
        """Each job's new tokens, and its end once its request finished (engine thread:
        inside a step, as the engine's ``respond``, and after it). After a job's first
        token the thread sleeps ``FIRST_TOKEN_HANDOFF_S``, so the event loop takes the GIL
        and writes it at once instead of after the engine's next work (the connector's
        end-of-pass copies) has held the GIL for a switch interval."""
        eng = self.engine
        first = False
        for rid, job in list(self._jobs.items()):
            res = eng.results[rid]
            if len(res.tokens) > job.sent:
                if not job.sent:
                    job.marks["first_token"] = time.monotonic()
                    first = True
                job.on_tokens(list(res.tokens[job.sent :]))
                job.sent = len(res.tokens)
            if res.finished:
                del self._jobs[rid]
                job.on_done(
                    res.error,
                    {
                        "connector_matched_tokens": res.connector_matched_tokens,
                        "device_matched_tokens": res.device_matched_tokens,
                    },
                )
        self.in_flight = len(self._jobs)
        if first:
            time.sleep(FIRST_TOKEN_HANDOFF_S)

    def _drain_after_stop(self) -> None:
        why = f"engine failed: {self.fatal}" if self.fatal else "server is shutting down"
        for job in self._jobs.values():
            job.on_done(why, {})
        self._jobs.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item.on_done(why, {})
