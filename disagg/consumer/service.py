"""The consumer's engine-neutral core: producer links, leases held, and each load's life.

Contract:
- anything failing *before* a claim is answered is a miss (the engine recomputes);
- a lease is held from the claim until released (request end, cancel, reset, replay);
- a load that fails after the answer is recorded against its request (``Load.error``), so
  the engine adapter can raise an error naming it before any forward pass reads its pages;
- no byte of a load lands once its request ended: ``abandon`` aborts the transfer (and
  waits, bounded, for writes under way) before the engine frees the pages.

A load's states, their transitions and what bounds each wait: ``loads`` (its first lines).
This module drives them; ``claims`` leases blocks, ``keepalive`` renews and releases.
No call on the engine's thread waits without a deadline (config ``consumer.*``):

    wait                                     bounded by
    claim / lookup / Push request            claim_timeout_s per call (``claims``, ``links``)
    async load (parked until get_finished)   load_timeout_s (the data plane's deadline)
    sync load (wait, wait_layer)             load_timeout_s
    a producer that failed a call            skipped for DOWN_BACKOFF_S, then retried
    a producer that refused us (keys,        skipped without a call; retried in the
      version, fingerprint)                  background every REFUSED_RETRY_S (``refusals``)

Tensor parallelism (TP=N on both sides, see ``service_base``): one service per rank. Each
configured producer has N control endpoints (``consumer.producers``: rank 0's endpoint with
rank r at port + r, or an explicit list). Rank r's service links to rank r of every producer
(``links``), for the pushes into its own head shard; rank 0's, which the leader-only
scheduler uses, also links to every rank of every producer (``rank_links[p][r]``) and claims
on all of them (``claims``). The claim's rank leases travel to the other ranks in the
(picklable) metadata; rank 0's keepalive renews and releases every rank's leases.

TP > 1, load outcomes (``rank_bus``): every rank must reach the same verdict on a request's
load before any rank computes on it, or the rank that raises leaves the others waiting in
the layer's all-reduce. Each rank's bus thread polls the rank's loads in flight (``tick``)
and publishes their states (layers landed, the end: ``_publish``, on every transition
wherever it is learned); ``rank_decision`` reads the common verdict (AGREED, or REJECTED
naming the rank that failed), waiting at most until the load's deadline plus
``PEER_GRACE_S``. A load whose own transfer fails is aborted before its failure is
published, so no verdict drawn from it can let pages be freed under a write still landing.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..config import DisaggConfig
from ..metrics import list_services
from ..pages import PagePool
from ..protocol import messages as m
from ..protocol.errors import ProtocolError
from ..protocol.keys import KeyBlob
from ..protocol.version import PROTOCOL_VERSION
from ..service_base import ConnectorService, Registry, rank_endpoint
from ..transport.dataplane import DataPlane, TransferState
from ..transport.factory import make_data_plane
from ..transport.security import client_keys_from
from .claims import Claims
from .keepalive import Keepalive
from .links import _PEER_FAULTS, DOWN_BACKOFF_S, ProducerLink
from .loads import Claimed, Load, LoadState, Reservation
from .prefetch import Prefetches
from .rank_bus import PEER_GRACE_S, RankBus
from .refusals import Refusals
from .routes import Part, Routes, status
from .zone import LandingZone

__all__ = [
    "DOWN_BACKOFF_S",
    "_PEER_FAULTS",
    "Claimed",
    "ConsumerService",
    "Load",
    "LoadState",
    "ProducerLink",
]

log = logging.getLogger("disagg.consumer")

V = PROTOCOL_VERSION
_registry: Registry[ConsumerService] = Registry()
list_services("consumer", _registry.live)
# instance id -> its lowest rank's live service here (serve reads it); every rank's:
# ``_registry.by_rank`` ((instance id, rank) -> service) and ``_registry.live()``
_services = _registry.services


def service_for(config: DisaggConfig, llm_args: Any) -> ConsumerService:
    """The process's service for this instance id, created on first use."""
    return _registry.get(ConsumerService, config, llm_args)


def _pages(slots: list[int]) -> int:
    """Pages a group's destination slots load (``-1``: a block not loaded)."""
    return int(np.count_nonzero(np.asarray(slots, dtype=np.int64) >= 0))


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
        # where this rank's KV heads come from when TP sizes may differ (``routes``): each
        # producer's TP size is the count of rank endpoints listed (one endpoint: ours)
        self.producer_tps = [
            len(ep) if isinstance(ep, tuple) else self.tp_size for ep in self.ccfg.producers
        ]
        self.routes = Routes.of(self, self.producer_tps)
        # rank_links[p][r]: producer p's rank r. Every rank links to the ranks it loads
        # from (head-blind: its own index); rank 0 (the leader's) links to every rank,
        # since the scheduler claims on all of them.
        self.rank_links: list[dict[int, ProducerLink]] = []
        for p, ep in enumerate(self.ccfg.producers):
            if self.routes is not None:
                ranks = self.routes.ranks_linked(p, self.tp_rank == 0)
            else:
                ranks = list(range(self.tp_size)) if self.tp_rank == 0 else [self.tp_rank]
            self.rank_links.append(
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
            )
        # the link claims go to (rank 0's), and a rank's first source
        self.links = [
            rl[min(rl) if self.tp_rank == 0 else next(iter(rl))] for rl in self.rank_links
        ]
        for p, rl in enumerate(self.rank_links):
            for link in rl.values():
                link.consumer_incarnation = self.incarnation
                if self.routes is not None:  # the rank must be the one routed to
                    link.producer_tp = self.producer_tps[p]
        self.data: DataPlane | None = None
        self.loads: dict[int, Load] = {}
        # prefix reservations (reservation id -> the connector's record, with ``.load``):
        # their leases are renewed like the loads' until released
        self.reservations: dict[int, Reservation] = {}
        # every rank: reservation id -> this rank's load of it, from dispatch until the
        # worker reported it (polled by the bus thread's ``tick`` like ``loads``)
        self.prefix_loads: dict[int, Load] = {}
        self._transfer_ids = iter(range(1, 1 << 62))
        self.claims = Claims(self, sum(len(rl) for rl in self.rank_links))
        self.claim_seconds = 0.0  # time spent in ``claim`` (the engine's thread waits on it)
        self.refusals = Refusals(self)  # producers refusing us: skipped, retried, reported
        self.keepalive = Keepalive(self)
        self.prefetches = Prefetches(self)  # leases taken while the producer prefills
        self.zone: LandingZone | None = None  # where prefetched pages land early (``zone``)
        # request id -> moments of its load (monotonic s): claim0/claim1, landed; bounded
        self.timeline: OrderedDict[int, dict[str, float]] = OrderedDict()
        self.stuck_writes: str | None = None  # set when an abort could not quiet a transfer
        # A failed load stops the engine instead of failing its request (set by the worker
        # at registration, from ``on_load_failure``): the engine publishes freed pages.
        self.stop_on_failure = False
        # TP > 1: the ranks' load-outcome bus (``rank_bus``), from ``attach``; loads' uids
        self.bus: RankBus | None = None
        self._uids = itertools.count(secrets.randbits(40) << 20)
        # a load's transitions from DISPATCHED (and the abort that goes with a failure)
        # happen under this lock: the bus thread and the engine thread both poll
        self._load_lock = threading.RLock()

    def _rank_endpoint(self, p: int, ep: str | tuple[str, ...], rank: int) -> str:
        """Producer ``p``'s rank ``rank``: listed explicitly, or rank 0's port + rank."""
        if isinstance(ep, tuple):
            if len(ep) != self.tp_size and self.routes is None:
                raise ValueError(
                    f"num_kv_heads: consumer.producers[{p}] lists {len(ep)} rank endpoint(s), "
                    f"a TP size other than this consumer's ({self.tp_size}), and the model's "
                    "KV head count is unknown here: set num_kv_heads in the disagg config of "
                    "both roles (the checkpoint's num_key_value_heads)"
                )
            return ep[rank]
        return rank_endpoint(ep, rank)

    def attach(self, pool: PagePool) -> None:
        self._attach_pool(pool)
        if self.routes is not None and self.heads is None:
            self.routes = None  # heads not located in the pages: head-blind after all
            for p, tp in enumerate(self.producer_tps):
                if tp != self.tp_size:
                    raise ValueError(
                        f"consumer.producers[{p}] lists {tp} rank endpoints, a TP size other "
                        f"than this consumer's ({self.tp_size}), but the KV heads were not "
                        "located in the pages (logged above): list one endpoint per rank of "
                        "a producer of this TP size, or fix num_kv_heads"
                    )
        self.data = make_data_plane(
            self.config.transport,
            bind=self.ccfg.data,
            advertise_host=self.ccfg.advertise_host,
            checksum=self.config.transport_checksum,
            ucx_channel=self.config.ucx_channel,
            ucx_rma_readers=self.config.ucx_rma_readers,
            ipc_spin_us=self.config.ipc_spin_us,
            nixl_backend=self.config.nixl_backend,
            nixl_devices=self.config.nixl_devices,
            nixl_error_handling=self.config.nixl_error_handling,
        )
        # whole group pages for async loads, and one group per layer for layer-wise ones;
        # with routes, the same for each head slice a part lands in
        if self.routes is not None and self.heads is not None:
            groups = self.routes.data_plane_groups(pool, self.heads)
        else:
            groups = pool.data_plane_groups()
        size = self.ccfg.landing_zone_size  # prefetches (its only users) are TP = 1 only
        if size is not None and self.tp_size == 1 and set(self.producer_tps) <= {1}:
            self.zone = LandingZone(self, pool, size, self.ccfg.landing_zone_device)
            groups += self.zone.groups(len(groups))  # after every group a push names
        self.data.register_regions(groups)
        for rl in self.rank_links:  # each producer's HelloOk tells the plane how to read it
            for link in rl.values():
                link.data_source = self.data.add_source
        self.keepalive.start()
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
        waits: bool = False,  # on a free channel of waiting claims, BUSY if none
    ) -> Any:
        assert self.fingerprint is not None and self.data is not None
        timeout = timeout_s or self.ccfg.claim_timeout_s
        ch = link.take_channel(background, waits, timeout)
        try:
            fp = self.fingerprint if self.routes is not None else self.fingerprint_for(link.tp_rank)
            reply = link.call(ch, msg, fp, self.data.endpoint, timeout, self.data.capabilities)
        except ProtocolError as exc:
            self.refusals.note(link, exc)  # a refusal: skipped on the request path from now
            raise
        finally:
            ch.lock.release()
        if link.refusal is not None:
            self.refusals.accepted(link)
        return reply

    # -- claims and releases (``claims``, ``keepalive``) ---------------------------------
    def claim(
        self,
        request_id: int,
        keys: KeyBlob | Sequence[bytes],
        rank_keys: Sequence[KeyBlob | Sequence[bytes]] | None = None,
    ) -> Claimed | None:
        """``Claims.claim``: a lease of the longest run a producer holds, or None (a miss)."""
        t0 = time.perf_counter()
        try:
            return self.claims.claim(request_id, keys, rank_keys)
        finally:
            self.claim_seconds += time.perf_counter() - t0

    def release(self, claimed: Claimed) -> None:
        """Queue the release of every rank's lease, once (``Keepalive.release``); its
        landing-zone fill, if any, is aborted (if still landing) and its slots freed."""
        if claimed.zone is not None and self.zone is not None:
            self.zone.drop(claimed)
        self.keepalive.release(claimed)

    def next_transfer_id(self) -> int:
        return next(self._transfer_ids)

    def release_blocks(self, claimed: Claimed, first: int, n: int) -> None:
        """Queue the release of blocks ``[first, first + n)`` of every rank's lease."""
        self.keepalive.release_blocks(claimed, first, n)

    # -- loads (engine thread; never waits past a deadline) ------------------------------
    def dispatch(self, load: Load, layerwise: bool = False) -> None:
        """PLANNED -> DISPATCHED: ask the producer to push the leased pages into our slots
        (``layerwise``: layer by layer into the per-layer groups, see ``wait_layer``). A
        failure makes the load FAILED (reported by the adapter), it never raises into the
        engine."""
        assert self.data is not None and load.dst_slots is not None and self.pool is not None
        if self.zone is not None and load.claimed.zone is not None:  # no push: a copy
            self.stamp(load.request_id, "dispatched")
            return self.zone.dispatch(load, self._load_lock)
        slots_by_group = list(load.dst_slots)
        # under the load lock: the bus thread (TP) polls a load only once it is dispatched,
        # which it is only once the plane expects it
        self.stamp(load.request_id, "dispatched")
        with self._load_lock:
            load.transition(LoadState.DISPATCHED)
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
            parts = self._parts(load)
            load.more_transfers = [next(self._transfer_ids) for _ in parts[1:]]
            try:
                for tid, (claimed, part) in zip(load.transfer_ids, parts, strict=True):
                    base = 0 if part is None else self.routes.base_of(part)  # type: ignore[union-attr]
                    self.data.expect(
                        tid,
                        claimed.lease_id,
                        load.token,
                        [0] * base + pages_by_group,
                        self.ccfg.load_timeout_s,
                        slots_by_group=[*([] for _ in range(base)), *slots_by_group],
                    )
            except Exception as exc:
                self.fail(load, f"the data plane refused the transfer: {exc}")
                return
        for tid, (claimed, part) in zip(load.transfer_ids, parts, strict=True):
            try:
                self._call(
                    claimed.link,
                    m.Push(
                        v=V,
                        owner=self.owner,
                        lease_id=claimed.lease_id,
                        transfer_id=tid,
                        token=load.token,
                        data_endpoint=self.data.endpoint,
                        data_caps=self.data.capabilities,
                        first_block=load.push_first,
                        num_blocks=(
                            load.claimed.num_blocks
                            if load.push_blocks is None
                            else load.push_blocks
                        ),
                        dst_slots=load.dst_slots,
                        layerwise=layerwise,
                        incarnation=claimed.incarnation,
                        heads=[]
                        if part is None or part.whole_source
                        else [
                            part.heads.start,
                            part.heads.stop,
                        ],
                        group_base=0 if part is None else self.routes.base_of(part),  # type: ignore[union-attr]
                    ),
                )
                self.metrics["loads_started"] += 1
            except Exception as exc:
                self.fail(load, f"push request to {claimed.link.endpoint} failed: {exc}")
                break
        if self.bus is not None:
            # the bus thread polls this load from its next pass: start that pass now rather
            # than after the thread's idle poll (50 ms), so peers learn the outcome early
            self.bus.wake()

    def _parts(self, load: Load) -> list[tuple[Claimed, Part | None]]:
        """The load's sources: ``(lease, part)`` per producer rank it loads from (one,
        with no part, where head-blind: the whole page from the rank of our index)."""
        if load.sources is not None:
            return load.sources
        if self.routes is None:
            return [(load.claimed, None)]
        every = load.claimed.all_ranks()
        return [(every[p.rank], p) for p in self.routes.parts[load.claimed.link.index]]

    def fail(self, load: Load, why: str) -> None:
        """The load failed: FAILED once dispatched, else REFUSED (a no-op once it is over:
        the first outcome stands). Its transfer is aborted (no byte of it lands afterwards)
        before the failure is published to the other ranks."""
        with self._load_lock:
            if load.over:
                return
            dispatched = load.state is LoadState.DISPATCHED
            load.transition(LoadState.FAILED if dispatched else LoadState.REFUSED, why)
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
            or load.claimed.ranks  # several producer ranks: TP sizes that differ
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
        load.transition(LoadState.PLANNED)  # dispatched again at once, from the new lease
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
            if load.state is LoadState.DISPATCHED:
                self.metrics["loads_abandoned"] += 1
                load.transition(LoadState.ABANDONED, why)
                self._abort_transfer(load, why)
                self._publish(load)

    def _abort_transfer(self, load: Load, why: str) -> None:
        if self.data is None or not load.transfer_id:
            return
        left = sum(self.data.abort(tid, why) for tid in load.transfer_ids)
        if left:  # the plane cannot prove these slots are quiet: stop taking traffic
            self.stuck_writes = (
                f"transfer {load.transfer_id} (request {load.request_id}) still had {left} "
                "write(s) under way after its abort: pages it targets may change; restart "
                "this decode instance"
            )
            log.error("%s", self.stuck_writes)

    def poll(self, load: Load) -> bool:
        """True once the load is over (landed or failed). A DISPATCHED load moves on from
        what the plane says: LANDED, or (failed, or past its deadline) failed over or
        FAILED. Any thread (the engine's, the bus thread's ``tick``); TP > 1: publishes what
        it learns (layers landed, the end)."""
        with self._load_lock:
            if load.state is not LoadState.DISPATCHED:
                return load.over
            assert self.data is not None
            st = status(self.data, load.transfer_ids)
            if st.state is TransferState.DONE:
                if not load.token:  # a landing-zone load (dispatched without a push)
                    try:  # zone -> the engine's pages, before anything reads them
                        self.zone.copy_in(load)  # type: ignore[union-attr]
                    except Exception as exc:
                        self.fail(load, f"the copy out of the landing zone failed: {exc}")
                        return True
                load.transition(LoadState.LANDED)
                self.stamp(load.request_id, "landed")
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
                if landed > load.layers_landed:
                    load.layers_landed = landed
                    self._publish(load)
                if time.monotonic() > load.deadline:
                    self._peer_failed(
                        load, f"no pages within load_timeout_s={self.ccfg.load_timeout_s}"
                    )
            return load.over

    # -- TP > 1: the ranks' common decision (rank_bus) -----------------------------------
    def new_load_uid(self) -> int:
        return next(self._uids)

    def _publish(self, load: Load) -> None:
        """Our state of ``load`` to every rank (load lock held): called on each transition
        out of DISPATCHED (the end, once: a load over makes no more) and each layer landed."""
        if self.bus is None:
            return
        final = (load.error or "") if load.over else None
        self.bus.record(load.uid, load.layers_landed, final)

    def tick(self) -> bool:
        """Bus thread, every pass: poll this rank's loads in flight (publishing what they
        do). True while any is in flight."""
        busy = False
        for load in [*self.loads.values(), *self.prefix_loads.values()]:
            if load.state is LoadState.DISPATCHED:
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
        layers (None: all of it): ``""`` every rank has them (all of it: AGREED), an error
        naming the rank that failed (REJECTED, final), or None while undecided (only when
        not ``wait``). Waits (``wait``) at most until the load's deadline plus
        ``PEER_GRACE_S``; a rank still silent then counts as failed here (logged naming
        it). A decision to fail aborts our own transfer before returning."""
        assert self.bus is not None
        if load.state is LoadState.REJECTED:
            assert load.error  # every failure state carries its reason
            return load.error  # decided before (and counted once)
        if load.state is LoadState.AGREED:
            return ""  # every rank landed all of it: any leading layers too
        if load.state in (LoadState.CLAIMED, LoadState.PLANNED):
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
                    load.transition(LoadState.AGREED)
                return ""
            if rank != self.tp_rank:
                err = f"the load failed on TP rank {rank}: {err}"
                self.metrics["loads_failed_on_other_rank"] += 1
        with self._load_lock:
            self.fail(load, err)  # stop our own part (no-op if it is over)
            load.transition(LoadState.REJECTED, err)
        return err

    def wait_layer(self, load: Load, layer: int) -> None:
        """Layer-wise synchronous mode: wait (until the load's deadline) for ``layer``'s
        pages; the last layer waits for the whole transfer (its checksum included)."""
        assert self.data is not None
        if load.layer_marks is None:  # a landing-zone load lands whole, by one copy
            self.wait(load)
            return
        last = layer == max(load.layer_marks)
        need = load.layer_marks.get(layer)
        if need is None:
            return
        delay = 0.00005
        while not load.over:
            st = status(self.data, load.transfer_ids)
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

    def settle(self, load: Load) -> None:
        """The load is over and its outcome recorded (the worker reported it, or its last
        layer landed): its lease protects nothing any more, so it goes back now rather than
        at ``request_finished``, which a cancelled request never gets. Leader only (it
        holds every rank's lease); the record is dropped once the outcome is taken."""
        if self.tp_rank == 0 and load.reservation_id is None:
            self.release(load.claimed)
        if self.loads.get(load.request_id) is load:
            del self.loads[load.request_id]

    def health(self) -> tuple[bool, str]:
        """``(healthy, why not)``: unhealthy when leases can no longer be renewed or released,
        or the data plane cannot prove which bytes it may still write."""
        if self.closed:
            return False, "the consumer service is closed"
        if self.pool is None:
            return False, "no KV cache registered yet"
        if not self.keepalive.alive():
            return False, "the keepalive thread stopped: leases are neither renewed nor released"
        if self.stuck_writes is not None:
            return False, self.stuck_writes
        return self.data.health() if self.data is not None else (False, "no data plane")

    def stamp(self, request_id: int, what: str) -> None:
        """Note when ``what`` happened to ``request_id``'s load (``disagg bench overhead
        --http`` reads them through the server's log); the last 1024 requests are kept."""
        marks = self.timeline.get(request_id)
        if marks is None:
            marks = self.timeline[request_id] = {}
            while len(self.timeline) > 1024:
                self.timeline.popitem(last=False)
        marks[what] = time.monotonic()

    def close(self) -> None:
        self.prefetches.close()
        self.keepalive.stop()
        self.refusals.stop()
        if self.bus is not None:
            self.bus.close()
        self.keepalive.send_releases()
        self.closed = True
        for rl in self.rank_links:
            for link in rl.values():
                link.close()
        if self.data is not None:
            self.data.close()
        self.claims.close()
        _registry.forget(self)
