"""The consumer's channels to one producer (``ProducerLink``), and how a call on one ends.

A link holds DEALER channels (``fg``: the engine thread's claims, lookups and pushes;
``bg``: the keepalive's renewals and releases, the prefetch's lookups and claims;
``waits``: ``WAIT_CHANNELS`` for prefetches' claims waiting at the producer), each
greeted with ``Hello`` before its first request and again after any failure. Every call is bounded by one deadline, the
Hello and one retry included.

Incarnations: ``HelloOk`` names the producer process's incarnation (``incarnation``), the
link remembers the last one. A Claim or Lookup names it; a request about a lease names the
lease's own (``Claimed.incarnation``). After a producer restart the first request on a
channel is refused by the new process (STALE_INCARNATION, or UNAUTHENTICATED: it has never
heard of this connection); the link says Hello again and retries once: a Claim or Lookup
under the new incarnation, a lease's request only if its lease is of the incarnation now
serving. A lease of the old one is refused locally (STALE_INCARNATION) and never sent, so
its id can never free or push another lease of the new process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ..protocol import messages as m
from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.fingerprint import Fingerprint
from ..protocol.version import PROTOCOL_VERSION
from ..transport.control import ControlClient
from ..transport.security import CurveClientKeys

log = logging.getLogger("disagg.consumer")

V = PROTOCOL_VERSION
# A producer that failed a call is skipped for this long, then tried again (a dead peer
# must not be cached forever, nor retried on every query).
DOWN_BACKOFF_S = 2.0
# Claims waiting at a producer at once, per link (one channel each): more prefetches poll.
WAIT_CHANNELS = 4
# Errors about one request (a lease that expired, a bad field) say nothing about the
# producer's health: only these mark a link down (and force a new Hello).
_PEER_FAULTS = frozenset(
    {
        ErrorCode.TIMEOUT,
        ErrorCode.PEER_GONE,
        ErrorCode.NOT_READY,
        ErrorCode.BUSY,
        ErrorCode.INTERNAL,
        ErrorCode.BAD_FRAME,
        ErrorCode.BAD_VERSION,
        ErrorCode.INCOMPATIBLE_PEER,
    }
)

# A refusal that a new Hello may cure (the producer restarted and does not know us).
_RE_HELLO = frozenset({ErrorCode.UNAUTHENTICATED, ErrorCode.STALE_INCARNATION})
# Requests about one lease: they name its incarnation. Requests that name the producer's.
_LEASE_REQUESTS = (m.Renew, m.Release, m.ReleaseRange, m.Push)
_NAMED_REQUESTS = (m.Claim, m.Lookup)


def _left(deadline: float, msg: Any, endpoint: str) -> float:
    """Seconds left before ``deadline``; TIMEOUT once none is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ProtocolError(
            ErrorCode.TIMEOUT, f"{type(msg).__name__} to {endpoint}: no time left (deadline)"
        )
    return left


class _Channel:
    """One DEALER socket to a producer, greeted with Hello before its first request."""

    def __init__(self, endpoint: str, timeout_s: float, curve: CurveClientKeys | None):
        self.client = ControlClient(endpoint, default_timeout_s=timeout_s, curve=curve)
        self.ready = False
        self.lock = threading.Lock()


class ProducerLink:
    """One producer's control channels: ``fg`` for the engine thread's claims, lookups
    and pushes, ``bg`` for the keepalive's renewals and releases, so a claim never queues
    behind a release (a release's unpin of a long prefix takes a while)."""

    def __init__(
        self,
        endpoint: str,
        owner: str,
        timeout_s: float,
        curve: CurveClientKeys | None = None,
        index: int = 0,
        tp_rank: int = 0,
        transport: str = "tcp",
    ):
        self.endpoint = endpoint
        self.owner = owner
        self.transport = transport  # our data plane: the producer refuses another one
        self.index = index  # which configured producer
        self.tp_rank = tp_rank  # which of its ranks (greeted with that rank's fingerprint)
        # TP sizes that may differ (``routes``): the producer's TP size, and the HelloOk
        # must come from rank ``tp_rank`` of it (0: not checked, head-blind)
        self.producer_tp = 0
        self.fg = _Channel(endpoint, timeout_s, curve)
        self.bg = _Channel(endpoint, timeout_s, curve)
        # prefetches' claims waiting at the producer for their blocks (``Claim.wait_s``):
        # channels of their own, so no renewal or lookup queues behind one
        self.waits = [_Channel(endpoint, timeout_s, curve) for _ in range(WAIT_CHANNELS)]
        self.down_until = 0.0
        # why the producer refuses us (``refusals.Refusal``; None while it does not): a
        # refused link is skipped until a background retry finds it accepting us again
        self.refusal: Any = None
        self.consumer_incarnation = 0  # ours, named in Hello (set by the service)
        # the producer's incarnation, from its last HelloOk (0: not greeted yet, or an
        # older producer that names none); ``restarts``: how often it changed
        self.incarnation = 0
        self.restarts = 0
        # the optional requests the producer announced (HelloOk.features); None until the
        # first Hello answered
        self.features: frozenset[str] | None = None
        # the layer whose save makes a pass's blocks leasable there (HelloOk; 0: the
        # pass's end, 1 until greeted, as an older producer)
        self.reserves_at_layer = 1
        # our data plane's ``add_source``: takes the producer's HelloOk.data_caps (set by
        # the service once its plane exists)
        self.data_source: Callable[[m.DataCaps], None] | None = None

    def take_channel(self, background: bool, waits: bool, timeout_s: float) -> _Channel:
        """A channel for one call, its lock held (the caller releases it): ``fg``, ``bg``,
        or (``waits``) a free waiting one. BUSY if none is free within ``timeout_s`` (a
        waiting one: at once); bounded, as the engine thread calls this."""
        if waits:
            ch = next((c for c in self.waits if c.lock.acquire(blocking=False)), None)
            if ch is None:
                raise ProtocolError(ErrorCode.BUSY, f"every waiting channel to {self.endpoint}")
            return ch
        ch = self.bg if background else self.fg
        if not ch.lock.acquire(timeout=timeout_s):
            raise ProtocolError(ErrorCode.BUSY, f"link to {self.endpoint} busy for {timeout_s}s")
        return ch

    def usable(self) -> bool:
        return self.refusal is None and time.monotonic() >= self.down_until

    def call(
        self,
        ch: _Channel,
        msg: Any,
        fingerprint: Fingerprint,
        data_endpoint: str,
        timeout_s: float,
        data_caps: m.DataCaps | None = None,
    ) -> Any:
        """``msg``'s reply, saying Hello first when the channel needs it, all within
        ``timeout_s``. A request the producer refuses as coming from before its restart
        (STALE_INCARNATION, or UNAUTHENTICATED: it does not know this connection) is
        retried once after a new Hello, within the same deadline: a Claim or Lookup names
        the new incarnation; a request about a lease (Renew, Release, ReleaseRange, Push)
        is retried only if its lease belongs to the incarnation now serving, and refused
        here (STALE_INCARNATION, never sent) otherwise: the old process's lease ids mean
        nothing, or someone else's lease, to the new one."""
        deadline = time.monotonic() + timeout_s
        for attempt in (0, 1):
            sent = False
            try:
                if not ch.ready:  # first use, or after any failure (the socket may be new)
                    self._hello(ch, fingerprint, data_endpoint, deadline, data_caps)
                out = self._bind(msg)
                sent = True
                return ch.client.call(out, timeout_s=_left(deadline, out, self.endpoint))
            except ProtocolError as exc:
                if exc.code in _PEER_FAULTS:
                    ch.ready = False
                    self.down_until = time.monotonic() + DOWN_BACKOFF_S
                    raise
                if exc.code not in _RE_HELLO or not sent:  # not sent: refused here, or Hello
                    raise
                ch.ready = False  # e.g. the producer restarted: say Hello again
                if attempt or time.monotonic() >= deadline:
                    raise
        raise AssertionError("unreachable")

    def _hello(
        self,
        ch: _Channel,
        fingerprint: Fingerprint,
        data_endpoint: str,
        deadline: float,
        data_caps: m.DataCaps | None = None,
    ) -> None:
        hello = m.Hello(
            v=V,
            instance_id=self.owner,
            role="consumer",
            fingerprint=fingerprint,
            data_endpoint=data_endpoint,
            data_caps=data_caps or m.DataCaps(),
            transport=self.transport,
            incarnation=self.consumer_incarnation,
        )
        ok = ch.client.call(hello, timeout_s=_left(deadline, hello, self.endpoint))
        theirs = getattr(ok, "fingerprint", None) or Fingerprint("", "", 1, [])
        if self.producer_tp and (theirs.tp_size, theirs.tp_rank) != (
            self.producer_tp,
            self.tp_rank,
        ):
            raise ProtocolError(
                ErrorCode.INCOMPATIBLE_PEER,
                f"{self.endpoint} is rank {theirs.tp_rank} of a TP={theirs.tp_size} producer, "
                f"but consumer.producers lists it as rank {self.tp_rank} of {self.producer_tp}: "
                "list each producer's rank endpoints in rank order",
            )
        if self.data_source is not None:
            try:
                self.data_source(getattr(ok, "data_caps", None) or m.DataCaps())
            except ValueError as exc:
                raise ProtocolError(
                    ErrorCode.INCOMPATIBLE_PEER, f"{self.endpoint}: {exc}"
                ) from None
        self.features = frozenset(getattr(ok, "features", ()) or ())
        self.reserves_at_layer = int(getattr(ok, "reserves_at_layer", 1))
        inc = int(getattr(ok, "incarnation", 0) or 0)
        if self.incarnation and inc != self.incarnation:
            self.restarts += 1
            log.warning(
                "producer %s restarted (incarnation %#x -> %#x): leases held with the old "
                "one are dropped, never sent to the new one",
                self.endpoint,
                self.incarnation,
                inc,
            )
        self.incarnation = inc
        ch.ready = True

    def _bind(self, msg: Any) -> Any:
        """``msg`` as it goes out: a Claim or Lookup names the incarnation we greeted; a
        lease's request keeps its lease's, and is refused here if that one is gone."""
        if isinstance(msg, _LEASE_REQUESTS):
            if msg.incarnation and self.incarnation and msg.incarnation != self.incarnation:
                raise ProtocolError(
                    ErrorCode.STALE_INCARNATION,
                    f"{type(msg).__name__} of a lease of producer incarnation "
                    f"{msg.incarnation:#x}, but {self.endpoint} restarted as "
                    f"{self.incarnation:#x}: the lease is gone (not sent)",
                )
            return msg
        if isinstance(msg, _NAMED_REQUESTS) and msg.incarnation != self.incarnation:
            return msgspec.structs.replace(msg, incarnation=self.incarnation)
        return msg

    def stale(self, incarnation: int) -> bool:
        """True if a lease granted by ``incarnation`` is known to be gone (the producer
        has restarted since)."""
        return bool(incarnation and self.incarnation and incarnation != self.incarnation)

    def close(self) -> None:
        self.fg.client.close()
        self.bg.client.close()
        for ch in self.waits:
            ch.client.close()
