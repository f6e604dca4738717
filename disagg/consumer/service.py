"""The consumer's engine-neutral core: producer links, claims, leases held, loads.

Rules it keeps (DESIGN §5):
- anything failing *before* a claim is answered is a miss (the engine recomputes);
- a lease is held from the claim until released (request end, cancel, reset, replay);
- a load that fails after the answer is recorded against its request, so the engine
  adapter can raise an error naming it before any forward pass reads those pages.

No call on the engine's thread waits without a deadline (config ``consumer.*``):

    wait                                     bounded by
    claim / lookup / Push request            claim_timeout_s per call (Hello + call, and
                                             one retry after a producer restart: links.py;
                                             the link's lock is also taken with it)
    async load (parked until get_finished)   load_timeout_s (the data plane's deadline)
    sync load (wait_for_layer_load)          load_timeout_s
    a producer that failed a call            skipped for DOWN_BACKOFF_S, then retried

The keepalive thread (not the engine's) renews every held lease at least three times per
granted TTL (``min(heartbeat_s, ttl / 3)``); a Renew is also the owner's heartbeat, so a
consumer that dies loses its leases after the producer's OWNER_DEAD_AFTER or LEASE_TTL.
Releases are queued and sent by the same thread; a failed one is counted and left to
the producer's TTL.

Tensor parallelism (TP=N on both sides, see ``service_base``): one service per rank. Each
configured producer has N control endpoints (``consumer.producers``: rank 0's endpoint with
rank r at port + r, or an explicit list of the ranks' endpoints). Rank r's service links to
rank r of every producer (``links``), for the pushes into its own head shard. Rank 0's
service, which the leader-only scheduler uses, also links to every rank of every producer
(``rank_links[p][r]``, greeting rank r with rank r's fingerprint) and claims on all of them:
a block is offered only if every rank holds it (the minimum of the grants; a rank granted
more is re-claimed for exactly that many, then its longer lease released). The claim's
rank leases travel to the other ranks in the (picklable) metadata; renewals and releases of
every rank's leases are sent by rank 0's keepalive. A rank grant that fails or times out
makes the whole claim a miss (the granted leases are released; one that answers after the
deadline expires by its TTL).

TP > 1, load outcomes (``rank_bus``): every rank must reach the same decision about a
request's load before any rank computes on it, or the rank that raises leaves the others
waiting in the layer's all-reduce. Each rank's bus thread polls the rank's in-flight loads
(``tick``) and publishes their states (layers landed, done, failed: ``_publish``, on every
transition wherever it is learned); ``rank_decision`` reads the common decision (every rank
landed, or which one failed), waiting at most until the load's deadline plus
``PEER_GRACE_S``. A load whose own transfer fails is aborted before its failure is
published, so no decision drawn from it can let pages be freed under a write still landing.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import DisaggConfig
from ..pages import PagePool
from ..protocol import messages as m
from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.keys import KeyBlob
from ..protocol.version import PROTOCOL_VERSION
from ..service_base import ConnectorService, Registry, rank_endpoint
from ..transport.dataplane import DataPlane, TransferState
from ..transport.factory import make_data_plane
from ..transport.security import client_keys_from
from .links import _PEER_FAULTS, DOWN_BACKOFF_S, ProducerLink
from .rank_bus import PEER_GRACE_S, RankBus

__all__ = ["DOWN_BACKOFF_S", "_PEER_FAULTS", "Claimed", "ConsumerService", "Load", "ProducerLink"]

log = logging.getLogger("disagg.consumer")

V = PROTOCOL_VERSION
_registry: Registry[ConsumerService] = Registry()
# instance id -> its lowest rank's live service here (serve reads it); every rank's:
# ``_registry.by_rank`` ((instance id, rank) -> service) and ``_registry.live()``
_services = _registry.services


def service_for(config: DisaggConfig, llm_args: Any) -> ConsumerService:
    """The process's service for this instance id, created on first use."""
    return _registry.get(ConsumerService, config, llm_args)


def _pages(slots: list[int]) -> int:
    """Pages a group's destination slots load (``-1``: a block not loaded)."""
    return int(np.count_nonzero(np.asarray(slots, dtype=np.int64) >= 0))


@dataclass
class Claimed:
    link: ProducerLink
    lease_id: int
    num_blocks: int
    ttl_s: float = 30.0  # as granted: the producer may cap what we asked for
    incarnation: int = 0  # the producer's that granted it (0: not named)
    # TP > 1, on the leader: the same blocks leased on the producer's ranks 1..N-1
    ranks: list[Claimed] = field(default_factory=list)
    released: bool = False  # given back (once: a second Release would name a dead lease)
    at: float = field(default_factory=time.monotonic)  # when it was granted

    def all_ranks(self) -> list[Claimed]:
        return [self, *self.ranks]


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
    # which blocks of the lease to push (prefix reservations push the accepted part)
    push_first: int = 0
    push_blocks: int | None = None  # None: the whole lease
    # layer-wise loads: pages landed once each layer is complete (layer id -> count)
    layer_marks: dict[int, int] | None = None
    # TP > 1: the load's id on every rank (the leader's choice, in the plan), the leading
    # layers landed here, and whether this rank's final state was published
    uid: int = 0
    progress: int = 0
    published_final: bool = False
    announced: bool = False  # leader: a failure before dispatch was told to every rank
    # TP > 1: the ranks' final decision once known (``rank_decision``: "" every rank landed
    # it whole, else the error); a failure decided for some layers is final for all
    decided: str | None = None
    # a prefix reservation's load (TensorRT-LLM main): its reservation id, else None
    reservation_id: int | None = None
    keys: Any = None  # the claimed blocks' keys (leader, TP = 1): to claim them elsewhere
    failovers: int = 0  # attempts to move it to another producer (at most one)
    unplanned: int = 0  # leader: metadata built since the claim without its allocation

    @property
    def blocks(self) -> int:
        """How many blocks of the lease this load pushes (from ``push_first``)."""
        return self.claimed.num_blocks if self.push_blocks is None else self.push_blocks


class ConsumerService(ConnectorService):
    role = "consumer"
    shard_hint = "decode instances"

    def __init__(self, config: DisaggConfig, llm_args: Any):
        super().__init__(config, llm_args)
        assert config.consumer is not None  # validated: role consumer has the section
        self.ccfg = config.consumer
        self.owner = self.name  # the owner of our leases, as producers know us
        # this process's incarnation (in every Hello): a producer that sees a new one for
        # our name frees the leases our previous process held
        self.incarnation = m.new_incarnation()
        curve = client_keys_from(config.security)  # one key pair for every producer
        timeout = self.ccfg.claim_timeout_s
        # rank_links[p][r]: producer p's rank r. Every rank links to its own rank; rank 0
        # (the leader's) links to every rank, since the scheduler claims on all of them.
        ranks = range(self.tp_size) if self.tp_rank == 0 else [self.tp_rank]
        self.rank_links: list[dict[int, ProducerLink]] = [
            {
                r: ProducerLink(
                    self._rank_endpoint(p, ep, r),
                    self.owner,
                    timeout,
                    curve,
                    p,
                    r,
                    transport=config.transport,
                )
                for r in ranks
            }
            for p, ep in enumerate(self.ccfg.producers)
        ]
        self.links = [rl[self.tp_rank] for rl in self.rank_links]
        for rl in self.rank_links:
            for link in rl.values():
                link.consumer_incarnation = self.incarnation
        self.data: DataPlane | None = None
        self.loads: dict[int, Load] = {}
        # prefix reservations (reservation id -> the connector's record, with ``.load``):
        # their leases are renewed like the loads' until released
        self.reservations: dict[int, Any] = {}
        # every rank: reservation id -> this rank's load of it, from dispatch until the
        # worker reported it (polled by the bus thread's ``tick`` like ``loads``)
        self.prefix_loads: dict[int, Load] = {}
        self._transfer_ids = iter(range(1, 1 << 62))
        # (lease, None: the whole lease | (first block, count): part of it)
        self._releases: list[tuple[Claimed, tuple[int, int] | None]] = []
        self._lock = threading.Lock()
        self._lookups = ThreadPoolExecutor(
            max(1, len(self.links) * len(ranks)), thread_name_prefix="disagg-lookup"
        )
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._renew_ttl_s = self.ccfg.lease_ttl_s  # the shortest TTL a producer granted
        self.stuck_writes: str | None = None  # set when an abort could not quiet a transfer
        # A failed load stops the engine instead of failing its request (set by the worker
        # at registration, from ``on_load_failure``): the engine publishes freed pages.
        self.stop_on_failure = False
        # TP > 1: the ranks' load-outcome bus (``rank_bus``), from ``attach``; loads' uids
        self.bus: RankBus | None = None
        self._uids = itertools.count(secrets.randbits(40) << 20)
        # transitions of a load (landed, failed, abandoned) and the abort that goes with a
        # failure happen under this lock: the bus thread and the engine thread both poll
        self._load_lock = threading.RLock()

    def _rank_endpoint(self, p: int, ep: str | tuple[str, ...], rank: int) -> str:
        """Producer ``p``'s rank ``rank``: listed explicitly, or rank 0's port + rank."""
        if isinstance(ep, tuple):
            if len(ep) != self.tp_size:
                raise ValueError(
                    f"consumer.producers[{p}] lists {len(ep)} rank endpoint(s), but this "
                    f"consumer runs tensor_parallel_size={self.tp_size}: list one per rank"
                )
            return ep[rank]
        return rank_endpoint(ep, rank)

    def attach(self, pool: PagePool) -> None:
        self._attach_pool(pool)
        self.data = make_data_plane(
            self.config.transport,
            bind=self.ccfg.data,
            advertise_host=self.ccfg.advertise_host,
            checksum=self.config.transport_checksum,
            ucx_channel=self.config.ucx_channel,
            ucx_rma_readers=self.config.ucx_rma_readers,
            ipc_spin_us=self.config.ipc_spin_us,
        )
        # whole group pages for async loads, and one group per layer for layer-wise ones
        self.data.register_regions(pool.data_plane_groups())
        self._keepalive = threading.Thread(
            target=self._keepalive_loop, name="disagg-keepalive", daemon=True
        )
        self._keepalive.start()
        if self.tp_size > 1:
            data = self.ccfg.data
            host = data[len("tcp://") :].rpartition(":")[0] if data.startswith("tcp://") else ""
            self.bus = RankBus(
                self.tp_rank,
                self.tp_size,
                self.tick,
                bind_host=host.strip("[]") or "127.0.0.1",
                advertise_host=self.ccfg.advertise_host,
            )

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
            fp = self.fingerprint_for(link.tp_rank)
            return link.call(ch, msg, fp, self.data.endpoint, timeout, self.data.capabilities)
        finally:
            ch.lock.release()

    # -- claims (engine thread, bounded by claim_timeout_s) -----------------------------
    def claim(
        self,
        request_id: int,
        keys: KeyBlob | Sequence[bytes],
        rank_keys: Sequence[KeyBlob | Sequence[bytes]] | None = None,
    ) -> Claimed | None:
        """Lease the longest run of ``keys`` any producer holds; None on a miss or on any
        failure (a miss: the engine recomputes). TP > 1 (leader only): ``keys`` are rank 0's
        and ``rank_keys[r - 1]`` rank r's keys of the same blocks; every rank of the chosen
        producer is claimed and the run every rank holds is leased (``_claim_ranks``).
        Keys travel packed (``KeyBlob``, e.g. from ``block_key_blob``); a list is packed."""
        if self.fingerprint is None or not keys:
            return None
        keys = KeyBlob.of(keys)
        ranks: list[KeyBlob] = []
        if self.tp_size > 1:
            if self.tp_rank != 0 or rank_keys is None or len(rank_keys) != self.tp_size - 1:
                raise ValueError("a TP claim needs the leader and every rank's keys")
            ranks = [KeyBlob.of(k) for k in rank_keys]
        links = [lk for lk in self.links if lk.usable()]
        if not links:
            self.metrics["claims_no_producer"] += 1
            return None
        if len(links) > 1:
            links = self._rank_by_lookup(links, keys)
        for link in links:
            if self.tp_size > 1:
                got = self._claim_ranks(link.index, request_id, [keys, *ranks])
                if got is not None:
                    return got
                continue
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
                return Claimed(link, ok.lease_id, ok.num_blocks, ok.ttl_s, ok.incarnation)
        self.metrics["claims_miss"] += 1
        return None

    def _claim_ranks(self, p: int, request_id: int, keys: list[KeyBlob]) -> Claimed | None:
        """TP: claim ``keys[r]`` on producer ``p``'s rank r, all ranks in parallel; lease the
        shortest run granted (a block is offered only if every rank holds it). A rank that
        granted more is re-claimed for exactly that run, then its longer lease released (the
        blocks stay pinned throughout). Any rank failing is a miss; granted leases go back."""
        links = [self.rank_links[p][r] for r in range(self.tp_size)]
        if not all(lk.usable() for lk in links):
            self.metrics["claims_rank_down"] += 1
            return None
        grants = self._claim_all(links, request_id, keys)
        if grants is not None:
            n = min(g.num_blocks for g in grants)
            if 0 < n < max(g.num_blocks for g in grants):
                self.metrics["claims_rank_short"] += 1
                longer = [r for r, g in enumerate(grants) if g.num_blocks > n]
                again = self._claim_all(
                    [links[r] for r in longer], request_id, [keys[r][:n] for r in longer]
                )
                for r in longer:  # the longer lease: its blocks are pinned by the new one
                    self.release(grants[r])
                    grants[r] = Claimed(links[r], 0, 0)
                if again is not None:
                    for r, g in zip(longer, again):
                        grants[r] = g
            if all(g.num_blocks == n > 0 for g in grants):
                self.metrics["claims_hit"] += 1
                ttl = min(g.ttl_s for g in grants)
                if ttl < self._renew_ttl_s:  # renew often enough for the granted TTL
                    self._renew_ttl_s = ttl
                    self._wake.set()
                first = grants[0]
                return Claimed(
                    first.link, first.lease_id, n, ttl, first.incarnation, ranks=grants[1:]
                )
            for g in grants:
                if g.lease_id:
                    self.release(g)
        self.metrics["claims_miss"] += 1
        return None

    def _claim_all(
        self, links: list[ProducerLink], request_id: int, keys: list[KeyBlob]
    ) -> list[Claimed] | None:
        """``Claim(keys[i])`` on ``links[i]``, in parallel, each bounded by its own deadline
        (and the whole by three times ``claim_timeout_s``: lock, Hello, call). None if any
        failed (what the others granted is released)."""
        futs = [
            self._lookups.submit(
                self._call,
                lk,
                m.Claim(
                    v=V,
                    owner=self.owner,
                    request_id=str(request_id),
                    keys=k,
                    ttl_s=self.ccfg.lease_ttl_s,
                ),
            )
            for lk, k in zip(links, keys)
        ]
        wait(futs, timeout=3 * self.ccfg.claim_timeout_s)
        grants: list[Claimed] = []
        failed = False
        for lk, f in zip(links, futs):
            exc = f.exception() if f.done() else TimeoutError("no answer within the deadline")
            if exc is None:
                ok = f.result()
                grants.append(Claimed(lk, ok.lease_id, ok.num_blocks, ok.ttl_s, ok.incarnation))
                continue
            failed = True
            self.metrics["claims_failed"] += 1
            if isinstance(exc, ProtocolError) and exc.code is ErrorCode.INCOMPATIBLE_PEER:
                self.metrics["handshake_refused"] += 1
                log.warning("producer %s refused us: %s", lk.endpoint, exc.message)
            else:
                log.info("claim on %s failed (a miss): %s", lk.endpoint, exc)
        if failed:
            for g in grants:
                if g.lease_id:
                    self.release(g)
            return None
        return grants

    def _rank_by_lookup(self, links: list[ProducerLink], keys: KeyBlob) -> list[ProducerLink]:
        """Ask every producer in parallel how much it holds; best first, misses dropped."""
        msg = m.Lookup(v=V, owner=self.owner, keys=keys)
        futs = {self._lookups.submit(self._call, lk, msg): lk for lk in links}
        done, _ = wait(futs, timeout=self.ccfg.claim_timeout_s)
        held = []
        for f in done:
            if f.exception() is None and f.result().num_blocks > 0:
                held.append((f.result().num_blocks, futs[f]))
        # most blocks first; ties in configured order (stable, not by who answered first)
        held.sort(key=lambda x: (-x[0], x[1].index))
        return [lk for _, lk in held]

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

    # -- loads (engine thread; never waits past a deadline) ------------------------------
    def dispatch(self, load: Load, layerwise: bool = False) -> None:
        """Ask the producer to push the leased pages into our slots (``layerwise``: layer by
        layer into the per-layer groups, see ``wait_layer``). A failure marks the load
        failed (reported by the adapter), it never raises into the engine."""
        assert self.data is not None and load.dst_slots is not None and self.pool is not None
        slots_by_group = list(load.dst_slots)
        # under the load lock: the bus thread (TP) polls a load only once it is dispatched,
        # which it is only once the plane expects it
        with self._load_lock:
            load.transfer_id = next(self._transfer_ids)
            load.token = secrets.token_bytes(16)
            load.deadline = time.monotonic() + self.ccfg.load_timeout_s
            # pages per group counted once (numpy), not once per layer in Python: a 128k
            # prompt is thousands of slots per group, and layer-wise loads repeat each
            # group's slots for every layer
            pages_by_group = [_pages(g) for g in load.dst_slots]
            if layerwise:
                layer_groups = [self.pool.group_of_layer(la) for la in self.pool.layers]
                slots_by_group = [[] for _ in load.dst_slots] + [
                    load.dst_slots[g] for g in layer_groups
                ]
                per_layer = [pages_by_group[g] for g in layer_groups]
                counts = np.cumsum(per_layer)
                load.layer_marks = dict(zip(self.pool.layers, counts.tolist()))
                pages_by_group = [0] * len(load.dst_slots) + per_layer
            try:
                self.data.expect(
                    load.transfer_id,
                    load.claimed.lease_id,
                    load.token,
                    pages_by_group,
                    self.ccfg.load_timeout_s,
                    slots_by_group=slots_by_group,
                )
            except Exception as exc:
                load.dispatched = True
                self.fail(load, f"the data plane refused the transfer: {exc}")
                return
            load.dispatched = True
        try:
            self._call(
                load.claimed.link,
                m.Push(
                    v=V,
                    owner=self.owner,
                    lease_id=load.claimed.lease_id,
                    transfer_id=load.transfer_id,
                    token=load.token,
                    data_endpoint=self.data.endpoint,
                    data_caps=self.data.capabilities,
                    first_block=load.push_first,
                    num_blocks=(
                        load.claimed.num_blocks if load.push_blocks is None else load.push_blocks
                    ),
                    dst_slots=load.dst_slots,
                    layerwise=layerwise,
                    incarnation=load.claimed.incarnation,
                ),
            )
            self.metrics["loads_started"] += 1
        except Exception as exc:
            self.fail(load, f"push request to {load.claimed.link.endpoint} failed: {exc}")
        if self.bus is not None:
            # the bus thread polls this load from its next pass: start that pass now rather
            # than after the thread's idle poll (50 ms), so peers learn the outcome early
            self.bus.wake()

    def fail(self, load: Load, why: str) -> None:
        """The load failed (a no-op once it is over: the first outcome stands). Its
        transfer is aborted (no byte of it lands afterwards) before the failure is
        published to the other ranks."""
        with self._load_lock:
            if load.done:
                return
            load.error, load.done = why, True
            self.metrics["loads_failed"] += 1
            self._abort_transfer(load, why)
            self._publish(load)
        log.warning("KV load for request %d failed: %s", load.request_id, why)

    def _peer_failed(self, load: Load, why: str) -> None:
        """The producer's transfer failed: it is passed over for ``DOWN_BACKOFF_S`` (a
        request the runtime restarts is not claimed from it again at once), and the load
        fails over to another producer holding the same blocks if one does, within the
        load's deadline; else it fails."""
        link = load.claimed.link
        link.down_until = max(link.down_until, time.monotonic() + DOWN_BACKOFF_S)
        if self._fail_over(load, why):
            return
        self.fail(load, why)

    def _fail_over(self, load: Load, why: str) -> bool:
        """Once per load, TP = 1, whole-page (async) loads: claim the same blocks from
        another producer; if one grants them, quiet the failed transfer (no byte of it
        lands afterwards), give its lease back and push into the same slots from the new
        one. False (nothing changed) when no other producer can serve them in time."""
        if (
            self.tp_size != 1
            or load.keys is None
            or load.failovers
            or load.layer_marks is not None
            or load.reservation_id is not None
            or time.monotonic() + self.ccfg.claim_timeout_s >= load.deadline
        ):
            return False
        load.failovers += 1  # one attempt per load: a claim costs a round trip
        old = load.claimed
        old.link.down_until = max(old.link.down_until, time.monotonic() + DOWN_BACKOFF_S)
        got = self.claim(load.request_id, load.keys)  # skips links that are down
        if got is None or got.link is old.link or got.num_blocks < load.push_first + load.blocks:
            if got is not None:
                self.release(got)
            return False
        self._abort_transfer(load, why)
        if self.stuck_writes:
            self.release(got)
            return False
        self.release(old)
        log.warning(
            "KV load for request %d failed on %s (%s): failing over to %s",
            load.request_id,
            old.link.endpoint,
            why,
            got.link.endpoint,
        )
        blocks = load.blocks
        load.claimed, load.push_blocks = got, blocks
        load.dispatched = False
        self.metrics["loads_failed_over"] += 1
        self.dispatch(load)
        return True

    def abandon(self, load: Load, why: str) -> None:
        """The request ended, or will replay, while its load may still be landing (engine
        thread: ``request_finished``, ``request_reset``; ranks > 0 when the leader's plan
        says so). Fails the transfer and waits (bounded by the plane's abort wait) for
        writes of it under way, so that once this returns no byte of it lands: the engine
        frees and reuses those pages right after. The lease is released separately."""
        with self._load_lock:  # also waits for a failure's abort under way on the bus thread
            if load.dispatched and not load.done:
                self.metrics["loads_abandoned"] += 1
                load.error, load.done = why, True
                self._abort_transfer(load, why)
                self._publish(load)

    def _abort_transfer(self, load: Load, why: str) -> None:
        if self.data is None or not load.transfer_id:
            return
        left = self.data.abort(load.transfer_id, why)
        if left:  # the plane cannot prove these slots are quiet: stop taking traffic
            self.stuck_writes = (
                f"transfer {load.transfer_id} (request {load.request_id}) still had {left} "
                "write(s) under way after its abort: pages it targets may change; restart "
                "this decode instance"
            )
            log.error("%s", self.stuck_writes)

    def poll(self, load: Load) -> bool:
        """True once the load is over (done or failed). Any thread (the engine's, the bus
        thread's ``tick``); TP > 1: publishes what it learns (layers landed, the end)."""
        with self._load_lock:
            if load.done or not load.dispatched:
                return load.done
            assert self.data is not None
            st = self.data.poll(load.transfer_id)
            if st.state is TransferState.DONE:
                load.done = True
                self.metrics["loads_done"] += 1
                self.metrics["pages_loaded"] += sum(_pages(g) for g in load.dst_slots or [])
                self._publish(load)
            elif st.state is TransferState.FAILED:
                self._peer_failed(load, st.error or "transfer failed")
            elif self.bus is None and not load.claimed.link.usable():
                # its producer stopped answering control calls: move the load to another
                # producer holding the blocks if there is one, else let it run on
                self._fail_over(load, "its producer stopped answering")
            elif self.bus is not None and load.layer_marks is not None:
                marks = list(load.layer_marks.values())[:-1]  # the last counts when DONE
                landed = bisect.bisect_right(marks, st.pages)
                if landed > load.progress:
                    load.progress = landed
                    self._publish(load)
                if time.monotonic() > load.deadline:
                    self._peer_failed(
                        load, f"no pages within load_timeout_s={self.ccfg.load_timeout_s}"
                    )
            return load.done

    # -- TP > 1: the ranks' common decision (rank_bus) -----------------------------------
    def new_load_uid(self) -> int:
        return next(self._uids)

    def _publish(self, load: Load) -> None:
        """Our state of ``load`` to every rank (load lock held)."""
        if self.bus is None or load.published_final:
            return
        final = None
        if load.done:
            final, load.published_final = load.error or "", True
        self.bus.record(load.uid, load.progress, final)

    def tick(self) -> bool:
        """Bus thread, every pass: poll this rank's loads in flight (publishing what they
        do). True while any is in flight."""
        busy = False
        for load in [*self.loads.values(), *self.prefix_loads.values()]:
            if load.dispatched and not load.done:
                busy = not self.poll(load) or busy
        return busy

    @staticmethod
    def layers_needed(load: Load, layer: int | None) -> int | None:
        """How many leading layers of ``load`` must have landed before ``layer`` runs
        (None: all of it, the last layer and async loads; -1: ``layer`` is not loaded)."""
        if layer is None or load.layer_marks is None:
            return None
        layers = list(load.layer_marks)
        if layer not in load.layer_marks:
            return -1
        i = layers.index(layer)
        return None if i == len(layers) - 1 else i + 1

    def rank_decision(self, load: Load, need: int | None, wait: bool) -> str | None:
        """TP > 1: every rank's common decision on ``load`` having landed ``need`` leading
        layers (None: all of it): ``""`` every rank has them, an error naming the rank
        that failed, or None while undecided (only when not ``wait``). Waits (``wait``) at
        most until the load's deadline plus ``PEER_GRACE_S``; a rank still silent then
        counts as failed here (logged naming it). A decision to fail aborts our own
        transfer before returning."""
        assert self.bus is not None
        if load.decided is not None and (load.decided or need is None):
            return load.decided  # decided before (and counted once)
        if not load.dispatched and not load.done:
            return None  # not started here yet: no deadline runs
        deadline = load.deadline + PEER_GRACE_S
        got = self.bus.wait(load.uid, need, deadline) if wait else self.bus.decision(load.uid, need)
        if got is None:
            if time.monotonic() <= deadline:
                return None
            silent = self.bus.missing(load.uid, need)
            why = (
                f"rank(s) {silent} reported no outcome of this load within "
                f"load_timeout_s={self.ccfg.load_timeout_s} (+{PEER_GRACE_S} s)"
            )
            self.metrics["rank_outcome_timeouts"] += 1
            log.warning(
                "KV load for request %d: %s; counted as failed on rank %d",
                load.request_id,
                why,
                self.tp_rank,
            )
            err = why
        else:
            err, rank = got
            if not err:
                if need is None:
                    load.decided = ""
                return ""
            if rank != self.tp_rank:
                err = f"the load failed on TP rank {rank}: {err}"
                self.metrics["loads_failed_on_other_rank"] += 1
        self.fail(load, err)  # stop our own part (no-op if it is over)
        load.decided = err
        return err

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
                self._peer_failed(
                    load, f"no pages within load_timeout_s={self.ccfg.load_timeout_s}"
                )
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.001)

    def wait(self, load: Load) -> None:
        """Synchronous mode: wait until the load is over, bounded by its deadline."""
        deadline = time.monotonic() + self.ccfg.load_timeout_s
        while not self.poll(load):
            if time.monotonic() > deadline:
                self._peer_failed(
                    load, f"no pages within load_timeout_s={self.ccfg.load_timeout_s}"
                )
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

    def settle(self, load: Load) -> None:
        """The load is over and its outcome recorded (the worker reported it, or its last
        layer landed): its lease protects nothing any more, so it goes back now rather than
        at ``request_finished``, which a cancelled request never gets. Leader only (it
        holds every rank's lease); the record is dropped once the outcome is taken."""
        if self.tp_rank == 0 and load.reservation_id is None:
            self.release(load.claimed)
        if self.loads.get(load.request_id) is load:
            del self.loads[load.request_id]

    def _renew_held(self) -> None:
        if self.tp_rank != 0:  # TP: the leader's rank 0 renews every rank's leases
            return
        held: dict[tuple[ProducerLink, int], list[int]] = {}
        loads = [*self.loads.values(), *(r.load for r in list(self.reservations.values()))]
        for load in loads:
            if load.claimed.released:
                continue
            for c in load.claimed.all_ranks():
                held.setdefault((c.link, c.incarnation), []).append(c.lease_id)
        for (link, inc), ids in held.items():
            if link.stale(inc):  # the producer restarted: these ids mean nothing there
                continue  # (counted once, when the restart was found; dropped at release)
            try:
                ok = self._call(
                    link,
                    m.Renew(v=V, owner=self.owner, lease_ids=ids, incarnation=inc),
                    background=True,
                )
                self.metrics["leases_renewed"] += len(ids) - len(ok.unknown)
                # a lost lease fails its push (UNKNOWN_LEASE) if the load is not over yet
                self.metrics["leases_lost"] += len(ok.unknown)
            except ProtocolError as exc:
                if exc.code is ErrorCode.STALE_INCARNATION:
                    self.metrics["leases_lost"] += len(ids)
                    continue
                self.metrics["renew_failed"] += 1
                log.info("renewing leases on %s failed: %s", link.endpoint, exc)

    def _send_releases(self) -> None:
        """Send the queued releases. One of a lease whose producer has restarted since is
        dropped, never sent (its id is meaningless there, or another lease's):
        ``releases_dropped_restart``."""
        with self._lock:
            todo, self._releases = self._releases, []
        for c, part in todo:
            if c.link.stale(c.incarnation):
                self.metrics["releases_dropped_restart"] += 1
                continue
            if part is not None:
                self._send_release_range(c, *part)
                continue
            try:
                self._call(
                    c.link,
                    m.Release(
                        v=V, owner=self.owner, lease_id=c.lease_id, incarnation=c.incarnation
                    ),
                    background=True,
                )
                self.metrics["leases_released"] += 1
            except ProtocolError as exc:
                if exc.code is ErrorCode.STALE_INCARNATION:
                    self.metrics["releases_dropped_restart"] += 1
                    continue
                self._release_failed(c.lease_id, exc)
            except Exception as exc:  # the producer's TTL frees it anyway
                self._release_failed(c.lease_id, exc)

    def _release_failed(self, lease_id: int, exc: Exception) -> None:
        self.metrics["release_failed"] += 1
        log.info("release of lease %d failed: %s", lease_id, exc)

    def _send_release_range(self, c: Claimed, first: int, n: int) -> None:
        link, lease_id = c.link, c.lease_id
        if link.features is not None and m.FEATURE_RELEASE_RANGE not in link.features:
            self.metrics["release_range_unsupported"] += 1  # kept until the whole release
            return
        try:
            self._call(
                link,
                m.ReleaseRange(
                    v=V,
                    owner=self.owner,
                    lease_id=lease_id,
                    first_block=first,
                    num_blocks=n,
                    incarnation=c.incarnation,
                ),
                background=True,
            )
            self.metrics["blocks_released_in_part"] += n
        except ProtocolError as exc:
            if exc.code is ErrorCode.STALE_INCARNATION:
                self.metrics["releases_dropped_restart"] += 1
            elif exc.code is ErrorCode.UNKNOWN_KIND:  # an older producer: by name, not misread
                link.features = (link.features or frozenset()) - {m.FEATURE_RELEASE_RANGE}
                self.metrics["release_range_unsupported"] += 1
                log.warning(
                    "producer %s does not serve release_range (%s): its blocks stay leased "
                    "until the whole reservation is released",
                    link.endpoint,
                    exc.message,
                )
            else:  # released with the whole lease, or by the producer's TTL
                self.metrics["release_failed"] += 1
                log.info("release of blocks of lease %d failed: %s", lease_id, exc)

    def health(self) -> tuple[bool, str]:
        """``(healthy, why not)``: unhealthy when leases can no longer be renewed or released,
        or the data plane cannot prove which bytes it may still write."""
        if self.closed:
            return False, "the consumer service is closed"
        if self.pool is None:
            return False, "no KV cache registered yet"
        if not self._keepalive.is_alive():
            return False, "the keepalive thread stopped: leases are neither renewed nor released"
        if self.stuck_writes is not None:
            return False, self.stuck_writes
        return self.data.health() if self.data is not None else (False, "no data plane")

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.bus is not None:
            self.bus.close()
        self._send_releases()
        self.closed = True
        for rl in self.rank_links:
            for link in rl.values():
                link.close()
        if self.data is not None:
            self.data.close()
        self._lookups.shutdown(wait=False, cancel_futures=True)
        _registry.forget(self)
