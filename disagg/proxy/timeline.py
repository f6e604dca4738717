"""Where one request's time goes in the proxy: named moments, logged once at its end.

``begin()`` (the request handler, first thing) starts a request's record in a context
variable, so every coroutine and task the request runs marks into its own record with
``mark(name)`` (no argument threading; a mark outside a request is ignored). ``marks()``
gives them as ``time.monotonic()`` seconds: that clock is the machine's, so ``disagg bench
overhead --http`` lines them up with the consumer's and the client's own (the same host).

Moments (each set once, the first time): ``received``; ``prefill_sent``; ``producer_token``
(the producer's first token read); ``producer_done`` (its answer read to the end);
``client_token`` (the first token about to be written to the client); ``prefetch_sent`` (the consumer
told of the prompt); ``consumer_sent`` (the continuation posted); ``consumer_first`` (the
consumer's first bytes read).

``defer(fn)`` keeps work a request owes but its client does not wait for (log lines, the
routing index's note) off the first token's path: ``take_deferred()`` hands it over once
the consumer's request is posted (the proxy then waits a forward for the answer), and the
handler runs what is left at the request's end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextvars import ContextVar

_marks: ContextVar[dict[str, float] | None] = ContextVar("disagg_proxy_marks", default=None)
_later: ContextVar[list[Callable[[], object]] | None] = ContextVar(
    "disagg_proxy_later", default=None
)
log = logging.getLogger("disagg.proxy")


def begin() -> dict[str, float]:
    """A new record for the request running in this context, ``received`` marked."""
    d = {"received": time.monotonic()}
    _marks.set(d)
    _later.set([])
    return d


def mark(name: str) -> None:
    """Mark ``name`` now in this request's record (once; no record: nothing)."""
    d = _marks.get()
    if d is not None and name not in d:
        d[name] = time.monotonic()


def marks() -> dict[str, float]:
    """This request's moments (empty outside a request)."""
    return dict(_marks.get() or {})


def defer(fn: Callable[[], object]) -> None:
    """Run ``fn`` once the request's client-facing path allows (outside a request: now)."""
    later = _later.get()
    if later is None:
        run([fn])
    else:
        later.append(fn)


def take_deferred() -> list[Callable[[], object]]:
    """The request's deferred work so far, handed to the caller to run (see ``run``)."""
    later = _later.get()
    if not later:
        return []
    out = later[:]
    later.clear()
    return out


def run(fns: list[Callable[[], object]]) -> None:
    """Run deferred work in order; one that raises is logged and the rest still run."""
    for fn in fns:
        try:
            fn()
        except Exception:
            log.exception("deferred request work failed")
