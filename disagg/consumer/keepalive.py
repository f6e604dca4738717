"""Keepalive: the leases held are renewed, and releases sent, by one thread (never the engine's).

Contract: the thread renews every held lease (loads' and prefix reservations') at least
three times per granted TTL (``min(consumer.heartbeat_s, ttl / 3)``, the shortest TTL any
producer granted); a Renew is also the owner's heartbeat, so a consumer that dies loses
its leases after the producer's OWNER_DEAD_AFTER or LEASE_TTL. ``release`` and
``release_blocks`` only queue (the engine's thread never waits on the network); the thread
sends the queue at once. A failed Release is counted and left to the producer's TTL; one of
a lease whose producer has restarted since is dropped, never sent (its id is meaningless
there, or another lease's). Under TP the leader (rank 0) renews and releases every rank's
leases. The thread survives any one bad pass: if it died, every lease would expire under
requests still loading (``ConsumerService.health`` reports it).
"""

from __future__ import annotations

import logging
import threading
import time

from ..protocol import messages as m
from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.version import PROTOCOL_VERSION
from .host import LinkHost
from .links import ProducerLink
from .loads import Claimed

log = logging.getLogger("disagg.consumer")

V = PROTOCOL_VERSION


class Keepalive:
    """The service's renewals and releases (``ConsumerService.keepalive``)."""

    def __init__(self, svc: LinkHost):
        self.svc = svc
        # (lease, None: the whole lease | (first block, count): part of it)
        self._releases: list[tuple[Claimed, tuple[int, int] | None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.renew_ttl_s = svc.ccfg.lease_ttl_s  # the shortest TTL a producer granted
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="disagg-keepalive", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pending(self) -> int:
        """Releases queued and not sent yet."""
        with self._lock:
            return len(self._releases)

    def stop(self) -> None:
        """Stop the thread (its pass under way ends first); ``send_releases`` sends what
        is still queued."""
        self._stop.set()
        self._wake.set()

    def granted(self, ttl_s: float) -> None:
        """A producer granted a lease for ``ttl_s``: renew often enough for it."""
        if ttl_s < self.renew_ttl_s:
            self.renew_ttl_s = ttl_s
            self._wake.set()

    def release(self, claimed: Claimed) -> None:
        """Queue the release (of every rank's lease, TP > 1); the keepalive thread sends it
        (never the engine thread). Once per lease: later calls do nothing."""
        with self._lock:
            if claimed.released:
                return
            claimed.released = True
            for c in claimed.all_ranks():
                if c.lease_id:
                    self._releases.append((c, None))
        self._wake.set()

    def release_blocks(self, claimed: Claimed, first: int, n: int) -> None:
        """Queue the release of blocks ``[first, first + n)`` of the lease (every rank's);
        the keepalive thread sends it as ``ReleaseRange``. A producer that does not serve
        it (an older one: no ``release_range`` in its HelloOk, or it refused the kind)
        keeps the blocks until the whole lease is released: protected longer, never
        less."""
        with self._lock:
            for c in claimed.all_ranks():
                if c.lease_id:
                    self._releases.append((c, (first, n)))
        self._wake.set()

    def _run(self) -> None:
        """Renews every held lease (the Renew is also the owner's heartbeat) at least three
        times per granted TTL, and sends queued releases. Survives any one bad pass: if
        this thread died, every lease would expire under requests still loading."""
        next_renew = time.monotonic()
        while not self._stop.is_set():
            period = max(0.05, min(self.svc.ccfg.heartbeat_s, self.renew_ttl_s / 3))
            next_renew = min(next_renew, time.monotonic() + period)
            self._wake.wait(max(0.0, next_renew - time.monotonic()))
            self._wake.clear()
            try:
                self.svc.prefetches.sweep()  # prefetched leases no continuation took
                self.send_releases()
                if time.monotonic() < next_renew:
                    continue
                next_renew = time.monotonic() + period
                self.renew_held()
            except Exception:
                log.exception("keepalive pass failed")

    def renew_held(self) -> None:
        """One Renew per producer (and incarnation) of every lease held, on ``bg``."""
        svc = self.svc
        if svc.tp_rank != 0:  # TP: the leader's rank 0 renews every rank's leases
            return
        held: dict[tuple[ProducerLink, int], list[int]] = {}
        loads = [*svc.loads.values(), *(r.load for r in list(svc.reservations.values()))]
        for claimed in [load.claimed for load in loads] + svc.prefetches.leases():
            if claimed.released:
                continue
            for c in claimed.all_ranks():
                held.setdefault((c.link, c.incarnation), []).append(c.lease_id)
        for (link, inc), ids in held.items():
            if link.stale(inc):  # the producer restarted: these ids mean nothing there
                continue  # (counted once, when the restart was found; dropped at release)
            try:
                ok = svc._call(
                    link,
                    m.Renew(v=V, owner=svc.owner, lease_ids=ids, incarnation=inc),
                    background=True,
                )
                svc.metrics["leases_renewed"] += len(ids) - len(ok.unknown)
                # a lost lease fails its push (UNKNOWN_LEASE) if the load is not over yet
                svc.metrics["leases_lost"] += len(ok.unknown)
            except ProtocolError as exc:
                if exc.code is ErrorCode.STALE_INCARNATION:
                    svc.metrics["leases_lost"] += len(ids)
                    continue
                svc.metrics["renew_failed"] += 1
                log.info("renewing leases on %s failed: %s", link.endpoint, exc)

    def send_releases(self) -> None:
        """Send the queued releases. One of a lease whose producer has restarted since is
        dropped, never sent (its id is meaningless there, or another lease's):
        ``releases_dropped_restart``."""
        svc = self.svc
        with self._lock:
            todo, self._releases = self._releases, []
        for c, part in todo:
            if c.link.stale(c.incarnation):
                svc.metrics["releases_dropped_restart"] += 1
                continue
            if part is not None:
                self._send_release_range(c, *part)
                continue
            try:
                svc._call(
                    c.link,
                    m.Release(v=V, owner=svc.owner, lease_id=c.lease_id, incarnation=c.incarnation),
                    background=True,
                )
                svc.metrics["leases_released"] += 1
            except ProtocolError as exc:
                if exc.code is ErrorCode.STALE_INCARNATION:
                    svc.metrics["releases_dropped_restart"] += 1
                    continue
                self._release_failed(c.lease_id, exc)
            except Exception as exc:  # the producer's TTL frees it anyway
                self._release_failed(c.lease_id, exc)

    def _release_failed(self, lease_id: int, exc: Exception) -> None:
        self.svc.metrics["release_failed"] += 1
        log.info("release of lease %d failed: %s", lease_id, exc)

    def _send_release_range(self, c: Claimed, first: int, n: int) -> None:
        svc = self.svc
        link, lease_id = c.link, c.lease_id
        if link.features is not None and m.FEATURE_RELEASE_RANGE not in link.features:
            svc.metrics["release_range_unsupported"] += 1  # kept until the whole release
            return
        try:
            svc._call(
                link,
                m.ReleaseRange(
                    v=V,
                    owner=svc.owner,
                    lease_id=lease_id,
                    first_block=first,
                    num_blocks=n,
                    incarnation=c.incarnation,
                ),
                background=True,
            )
            svc.metrics["blocks_released_in_part"] += n
        except ProtocolError as exc:
            if exc.code is ErrorCode.STALE_INCARNATION:
                svc.metrics["releases_dropped_restart"] += 1
            elif exc.code is ErrorCode.UNKNOWN_KIND:  # an older producer: by name, not misread
                link.features = (link.features or frozenset()) - {m.FEATURE_RELEASE_RANGE}
                svc.metrics["release_range_unsupported"] += 1
                log.warning(
                    "producer %s does not serve release_range (%s): its blocks stay leased "
                    "until the whole reservation is released",
                    link.endpoint,
                    exc.message,
                )
            else:  # released with the whole lease, or by the producer's TTL
                svc.metrics["release_failed"] += 1
                log.info("release of blocks of lease %d failed: %s", lease_id, exc)
