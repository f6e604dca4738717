"""The consumer's engine-neutral core: producer links, claims, leases held, loads.

Rules it keeps (DESIGN §5):
- anything failing *before* a claim is answered is a miss (the engine recomputes);
- a lease is held from the claim until released (request end, cancel, reset, replay);
- a load that fails after the answer is recorded against its request, so the engine
  adapter can raise an error naming it before any forward pass reads those pages.

No call on the engine's thread waits without a deadline (config ``consumer.*``):

    wait                                     bounded by
    claim / lookup / Push request            claim_timeout_s per call (Hello + call; the
                                             link's lock is also taken with this timeout)
    async load (parked until get_finished)   load_timeout_s (the data plane's deadline)
    sync load (wait_for_layer_load)          load_timeout_s
    a producer that failed a call            skipped for DOWN_BACKOFF_S, then retried

The keepalive thread (not the engine's) renews every held lease at least three times per
granted TTL (``min(heartbeat_s, ttl / 3)``); a Renew is also the owner's heartbeat, so a
consumer that dies loses its leases after the producer's OWNER_DEAD_AFTER or LEASE_TTL.
Releases are queued and sent by the same thread; a failed one is counted and left to
the producer's TTL.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import DisaggConfig
from ..pages import PagePool
from ..protocol import messages as m
from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.fingerprint import Fingerprint
from ..protocol.version import PROTOCOL_VERSION
from ..service_base import ConnectorService, Registry
from ..transport.control import ControlClient
from ..transport.dataplane import DataPlane, TransferState
from ..transport.factory import make_data_plane
from ..transport.security import CurveClientKeys, client_keys_from

log = logging.getLogger("disagg.consumer")

V = PROTOCOL_VERSION
# A producer that failed a call is skipped for this long, then tried again (a dead peer
# must not be cached forever, nor retried on every query).
DOWN_BACKOFF_S = 2.0
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

_registry: Registry[ConsumerService] = Registry()
_services = _registry.services  # instance id -> live service (serve and metrics read it)


def service_for(config: DisaggConfig, llm_args: Any) -> ConsumerService:
    """The process's service for this instance id, created on first use."""
    return _registry.get(ConsumerService, config, llm_args)


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
        self, endpoint: str, owner: str, timeout_s: float, curve: CurveClientKeys | None = None
    ):
        self.endpoint = endpoint
        self.owner = owner
        self.fg = _Channel(endpoint, timeout_s, curve)
        self.bg = _Channel(endpoint, timeout_s, curve)
        self.down_until = 0.0

    def usable(self) -> bool:
        return time.monotonic() >= self.down_until

    def call(
        self, ch: _Channel, msg: Any, fingerprint: Fingerprint, data_endpoint: str, timeout_s: float
    ) -> Any:
        try:
            if not ch.ready:  # first use, or after any failure (the socket may be new)
                ch.client.call(
                    m.Hello(
                        v=V,
                        instance_id=self.owner,
                        role="consumer",
                        fingerprint=fingerprint,
                        data_endpoint=data_endpoint,
                    ),
                    timeout_s=timeout_s,
                )
                ch.ready = True
            return ch.client.call(msg, timeout_s=timeout_s)
        except ProtocolError as exc:
            if exc.code in _PEER_FAULTS:
                ch.ready = False
                self.down_until = time.monotonic() + DOWN_BACKOFF_S
            elif exc.code is ErrorCode.UNAUTHENTICATED:
                ch.ready = False  # e.g. the producer restarted: say Hello again
            raise

    def close(self) -> None:
        self.fg.client.close()
        self.bg.client.close()


@dataclass
class Claimed:
    link: ProducerLink
    lease_id: int
    num_blocks: int
    ttl_s: float = 30.0  # as granted: the producer may cap what we asked for


@dataclass
class Load:
    """One request's load: its lease, destination slots, and transfer state."""

    request_id: int
    claimed: Claimed
    first_block: int  # block ordinal in the request where the loaded run starts
    dst_slots: list[list[int]] | None = None
    transfer_id: int = 0
    token: bytes = b""
    dispatched: bool = False
    error: str | None = None
    done: bool = False
    deadline: float = 0.0
    # layer-wise loads: pages landed once each layer is complete (layer id -> count)
    layer_marks: dict[int, int] | None = None


class ConsumerService(ConnectorService):
    role = "consumer"
    shard_hint = "decode instances"

    def __init__(self, config: DisaggConfig, llm_args: Any):
        super().__init__(config, llm_args)
        assert config.consumer is not None  # validated: role consumer has the section
        self.ccfg = config.consumer
        self.owner = self.name  # the owner of our leases, as producers know us
        curve = client_keys_from(config.security)  # one key pair for every producer
        self.links = [
            ProducerLink(ep, self.owner, self.ccfg.claim_timeout_s, curve)
            for ep in self.ccfg.producers
        ]
        self.data: DataPlane | None = None
        self.loads: dict[int, Load] = {}
        self._transfer_ids = iter(range(1, 1 << 62))
        self._releases: list[tuple[ProducerLink, int]] = []
        self._lock = threading.Lock()
        self._lookups = ThreadPoolExecutor(
            max(1, len(self.links)), thread_name_prefix="disagg-lookup"
        )
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._renew_ttl_s = self.ccfg.lease_ttl_s  # the shortest TTL a producer granted

    def attach(self, pool: PagePool) -> None:
        self._attach_pool(pool)
        self.data = make_data_plane(
            self.config.transport, bind=self.ccfg.data, advertise_host=self.ccfg.advertise_host
        )
        # whole group pages for async loads, and one group per layer for layer-wise ones
        self.data.register_regions(pool.data_plane_groups())
        self._keepalive = threading.Thread(
            target=self._keepalive_loop, name="disagg-keepalive", daemon=True
        )
        self._keepalive.start()

    def _call(
        self,
        link: ProducerLink,
        msg: Any,
        timeout_s: float | None = None,
        background: bool = False,
    ) -> Any:
        assert self.fingerprint is not None and self.data is not None
        timeout = timeout_s or self.ccfg.claim_timeout_s
        ch = link.bg if background else link.fg
        # Bounded even while another thread (a lookup) holds the channel: the engine thread
        # calls this and must never wait without a deadline.
        if not ch.lock.acquire(timeout=timeout):
            raise ProtocolError(ErrorCode.BUSY, f"link to {link.endpoint} busy for {timeout}s")
        try:
            return link.call(ch, msg, self.fingerprint, self.data.endpoint, timeout)
        finally:
            ch.lock.release()

    # -- claims (engine thread, bounded by claim_timeout_s) -----------------------------
    def claim(self, request_id: int, keys: list[bytes]) -> Claimed | None:
        """Lease the longest run of ``keys`` any producer holds; None on a miss or on any
        failure (a miss: the engine recomputes)."""
        if self.fingerprint is None or not keys:
            return None
        links = [lk for lk in self.links if lk.usable()]
        if not links:
            self.metrics["claims_no_producer"] += 1
            return None
        if len(links) > 1:
            links = self._rank_by_lookup(links, keys)
        for link in links:
            try:
                ok = self._call(
                    link,
                    m.Claim(
                        v=V,
                        owner=self.owner,
                        request_id=str(request_id),
                        keys=keys,
                        ttl_s=self.ccfg.lease_ttl_s,
                    ),
                )
            except ProtocolError as exc:
                self.metrics["claims_failed"] += 1
                if exc.code is ErrorCode.INCOMPATIBLE_PEER:
                    # an operator error, not weather: say loudly which field differs
                    self.metrics["handshake_refused"] += 1
                    log.warning("producer %s refused us: %s", link.endpoint, exc.message)
                else:
                    log.info("claim on %s failed (a miss): %s", link.endpoint, exc)
                continue
            if ok.num_blocks > 0:
                self.metrics["claims_hit"] += 1
                if ok.ttl_s < self._renew_ttl_s:  # renew often enough for the granted TTL
                    self._renew_ttl_s = ok.ttl_s
                    self._wake.set()
                return Claimed(link, ok.lease_id, ok.num_blocks, ok.ttl_s)
        self.metrics["claims_miss"] += 1
        return None

    def _rank_by_lookup(self, links: list[ProducerLink], keys: list[bytes]) -> list[ProducerLink]:
        """Ask every producer in parallel how much it holds; best first, misses dropped."""
        msg = m.Lookup(v=V, owner=self.owner, keys=keys)
        futs = {self._lookups.submit(self._call, lk, msg): lk for lk in links}
        done, _ = wait(futs, timeout=self.ccfg.claim_timeout_s)
        held = []
        for f in done:
            if f.exception() is None and f.result().num_blocks > 0:
                held.append((f.result().num_blocks, futs[f]))
        held.sort(key=lambda x: -x[0])
        return [lk for _, lk in held]

    def release(self, claimed: Claimed) -> None:
        """Queue the release; the keepalive thread sends it (never the engine thread)."""
        with self._lock:
            self._releases.append((claimed.link, claimed.lease_id))
        self._wake.set()

    # -- loads (engine thread; never waits past a deadline) ------------------------------
    def dispatch(self, load: Load, layerwise: bool = False) -> None:
        """Ask the producer to push the leased pages into our slots (``layerwise``: layer by
        layer into the per-layer groups, see ``wait_layer``). A failure marks the load
        failed (reported by the adapter), it never raises into the engine."""
        assert self.data is not None and load.dst_slots is not None and self.pool is not None
        load.transfer_id = next(self._transfer_ids)
        load.token = secrets.token_bytes(16)
        load.dispatched = True
        load.deadline = time.monotonic() + self.ccfg.load_timeout_s
        slots_by_group = list(load.dst_slots)
        if layerwise:
            by_layer = [load.dst_slots[self.pool.group_of_layer(la)] for la in self.pool.layers]
            slots_by_group = [[] for _ in load.dst_slots] + by_layer
            counts = np.cumsum([sum(1 for s in g if s >= 0) for g in by_layer])
            load.layer_marks = dict(zip(self.pool.layers, counts.tolist()))
        pages_by_group = [sum(1 for s in g if s >= 0) for g in slots_by_group]
        try:
            self.data.expect(
                load.transfer_id,
                load.claimed.lease_id,
                load.token,
                pages_by_group,
                self.ccfg.load_timeout_s,
                slots_by_group=slots_by_group,
            )
            self._call(
                load.claimed.link,
                m.Push(
                    v=V,
                    owner=self.owner,
                    lease_id=load.claimed.lease_id,
                    transfer_id=load.transfer_id,
                    token=load.token,
                    data_endpoint=self.data.endpoint,
                    first_block=0,
                    num_blocks=load.claimed.num_blocks,
                    dst_slots=load.dst_slots,
                    layerwise=layerwise,
                ),
            )
            self.metrics["loads_started"] += 1
        except Exception as exc:
            self.fail(load, f"push request to {load.claimed.link.endpoint} failed: {exc}")

    def fail(self, load: Load, why: str) -> None:
        load.error, load.done = why, True
        self.metrics["loads_failed"] += 1
        if self.data is not None and load.transfer_id:
            self.data.abort(load.transfer_id)
        log.warning("KV load for request %d failed: %s", load.request_id, why)

    def poll(self, load: Load) -> bool:
        """True once the load is over (done or failed)."""
        if load.done or not load.dispatched:
            return load.done
        assert self.data is not None
        st = self.data.poll(load.transfer_id)
        if st.state is TransferState.DONE:
            load.done = True
            self.metrics["loads_done"] += 1
            self.metrics["pages_loaded"] += sum(
                sum(1 for s in g if s >= 0) for g in load.dst_slots or []
            )
        elif st.state is TransferState.FAILED:
            self.fail(load, st.error or "transfer failed")
        return load.done

    def wait_layer(self, load: Load, layer: int) -> None:
        """Layer-wise synchronous mode: wait (until the load's deadline) for ``layer``'s
        pages; the last layer waits for the whole transfer (its checksum included)."""
        assert self.data is not None and load.layer_marks is not None
        last = layer == max(load.layer_marks)
        need = load.layer_marks.get(layer)
        if need is None:
            return
        delay = 0.00005
        while not load.done:
            st = self.data.poll(load.transfer_id)
            if st.state is TransferState.FAILED or st.state is TransferState.DONE:
                self.poll(load)
                return
            if not last and st.pages >= need:
                return
            if time.monotonic() > load.deadline:
                self.fail(load, f"no pages within load_timeout_s={self.ccfg.load_timeout_s}")
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.001)

    def wait(self, load: Load) -> None:
        """Synchronous mode: wait until the load is over, bounded by its deadline."""
        deadline = time.monotonic() + self.ccfg.load_timeout_s
        while not self.poll(load):
            if time.monotonic() > deadline:
                self.fail(load, f"no pages within load_timeout_s={self.ccfg.load_timeout_s}")
                return
            time.sleep(0.0002)

    # -- keepalive: heartbeats, renewals, queued releases --------------------------------
    def _keepalive_loop(self) -> None:
        """Renews every held lease (the Renew is also the owner's heartbeat) at least three
        times per granted TTL, and sends queued releases. Survives any one bad pass: if
        this thread died, every lease would expire under requests still loading."""
        next_renew = time.monotonic()
        while not self._stop.is_set():
            period = max(0.05, min(self.ccfg.heartbeat_s, self._renew_ttl_s / 3))
            next_renew = min(next_renew, time.monotonic() + period)
            self._wake.wait(max(0.0, next_renew - time.monotonic()))
            self._wake.clear()
            try:
                self._send_releases()
                if time.monotonic() < next_renew:
                    continue
                next_renew = time.monotonic() + period
                self._renew_held()
            except Exception:
                log.exception("keepalive pass failed")

    def _renew_held(self) -> None:
        held: dict[ProducerLink, list[int]] = {}
        for load in list(self.loads.values()):
            held.setdefault(load.claimed.link, []).append(load.claimed.lease_id)
        for link, ids in held.items():
            try:
                ok = self._call(
                    link, m.Renew(v=V, owner=self.owner, lease_ids=ids), background=True
                )
                self.metrics["leases_renewed"] += len(ids) - len(ok.unknown)
                # a lost lease fails its push (UNKNOWN_LEASE) if the load is not over yet
                self.metrics["leases_lost"] += len(ok.unknown)
            except ProtocolError as exc:
                self.metrics["renew_failed"] += 1
                log.info("renewing leases on %s failed: %s", link.endpoint, exc)

    def _send_releases(self) -> None:
        with self._lock:
            todo, self._releases = self._releases, []
        for link, lease_id in todo:
            try:
                self._call(
                    link, m.Release(v=V, owner=self.owner, lease_id=lease_id), background=True
                )
                self.metrics["leases_released"] += 1
            except Exception as exc:  # the producer's TTL frees it anyway
                self.metrics["release_failed"] += 1
                log.info("release of lease %d failed: %s", lease_id, exc)

    def health(self) -> tuple[bool, str]:
        """``(healthy, why not)``: unhealthy when leases can no longer be renewed or released,
        or the data plane cannot prove which bytes it may still write."""
        if self.closed:
            return False, "the consumer service is closed"
        if self.pool is None:
            return False, "no KV cache registered yet"
        if not self._keepalive.is_alive():
            return False, "the keepalive thread stopped: leases are neither renewed nor released"
        return self.data.health() if self.data is not None else (False, "no data plane")

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._send_releases()
        self.closed = True
        for link in self.links:
            link.close()
        if self.data is not None:
            self.data.close()
        self._lookups.shutdown(wait=False, cancel_futures=True)
        _registry.forget(self)
