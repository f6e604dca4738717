"""The consumer's engine adapter: TensorRT-LLM's scheduler/worker hooks over ``ConsumerService``.

Scheduler: answers ``get_num_new_matched_tokens`` by claiming the longest prefix a producer
holds, captures destination slots from the allocation callback, and hands loads to the
worker in the metadata. Worker: asks the producer to push, reports completion through
``get_finished``, and raises an error naming the request before any forward pass could
read pages whose load failed (there is no API to report a failed load).

Tensor parallelism (TP=N): the scheduler runs on rank 0 only. It computes every rank's keys
and claims on every rank of a producer (``ConsumerService.claim``); the metadata carries,
per load, the producer and each rank's lease id (``LoadPlan``), and the requests whose
loads were dropped since the last metadata. Rank 0's worker shares the scheduler's ``Load``;
rank r's worker builds its own from the plan and asks producer rank r to push into its own
shard's slots (the slots are the same on every rank). Rank 0's keepalive renews and
releases every rank's leases.

TP: every rank decides the same about a load, before any rank computes on it. A rank that
alone raised in a forward hook would fail only its own batch while the others ran the layer
and waited forever in its all-reduce (TensorRT-LLM catches hook errors per rank). So the
ranks share each load's outcome over a side channel (``rank_bus``: rank 0's service binds
it, its address travels in this metadata) and decide from every rank's outcome:

- async loads: ``get_finished`` reports a request once its load is over on *every* rank; if
  it failed on any, every rank records the failure, so at the request's first forward (the
  same iteration on every rank: TensorRT-LLM intersects the ranks' reports) every rank
  raises in ``wait_for_layer_load`` (``start_load_kv`` with ``stop_on_failure``);
- sync (layer-wise) loads: before layer i, every rank waits until every rank has layer i's
  pages, or one has failed short of them: then all raise at layer i, or all proceed;
- a load the leader failed before dispatching it is listed in the metadata (``failed``), so
  every rank records it (rank > 0 never had a plan for it).

Every wait is bounded: by the load's deadline (``load_timeout_s``) plus a grace for a peer's
report to arrive; a peer rank silent past that counts as failed (logged naming the rank).

Prefix reservations (TensorRT-LLM main, opt-in: the V2 manager with prefix-aware
scheduling; contract §4.3, docs/design/prefix-reservations.md): the scheduler offers
``reserve_prefix`` (query + claim keyed by the reservation id: the lease protects the
source, nothing is pushed), ``release_prefix_reservation`` (gives back the lease's blocks
no protected range still covers: ``ReleaseRange``, or the whole lease once nothing is
protected), and plans ``SchedulerOutput.prefix_loads`` (each accepted ``[start, end)``
pushed from the matching blocks of the lease into ``block_ids_by_layer_group``); the
worker reports ``get_finished_prefix_loads``. There is no API for a failed load: a failed
one is reported finished (nothing writes into its pages any more, so the runtime may
retire it) and recorded, so the request's first forward raises in ``wait_for_layer_load``
as on the legacy path (a synchronous one raises in the forward it loads under).

Prefix reservations under TP > 1, as legacy loads: ``reserve_prefix`` (rank 0) claims on
every rank of the producer (each rank's keys; the run every rank holds) and keeps every
rank's lease under the reservation id; ``release_prefix_reservation`` releases the same
blocks of every rank's lease (``ReleaseRange`` per rank where that rank announced it, else
kept until the whole release). ``build_connector_meta`` sends each authorised load to the
other ranks as a ``PrefixPlan`` (producer, each rank's lease id, lease-relative first
block, block count, destination slots, the load's bus uid, ``is_async``); rank r's worker
builds its own ``Load`` and asks producer rank r to push into its shard. Completion is
per rank (TensorRT-LLM's ``PrefixLoadCompletionTracker`` retires a load once every rank
reported it), but a rank reports a reservation only once the ranks' common decision on
its load is known (``rank_decision``: landed on every rank, or failed on one, which
aborts this rank's part first): so a failure is recorded on every rank before any rank
reports, hence before the runtime resumes the request, and its first forward raises on
every rank alike (async); a synchronous load is decided layer by layer as legacy ones
(every rank raises at the same layer). A rank never reports a load that could still
write into its pages. A reservation released while its load was still landing (the
runtime drains first; defensive) is stopped on rank 0 at once and on the other ranks at
the next metadata (``prefix_dropped``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..config import ConfigError
from ..connector_common import request_tokens, resolve_config
from ..engine import KvCacheConnectorScheduler, KvCacheConnectorWorker, SchedulerOutput, runtime
from ..identity import request_identity
from ..pages import PagePool
from ..protocol.keys import block_key_blob, tokens_array
from .service import Claimed, ConsumerService, Load, service_for

log = logging.getLogger("disagg.consumer")


class KvLoadFailedError(RuntimeError):
    """A claimed prefix could not be loaded; the request must fail, never read those pages."""


@dataclass
class LoadPlan:
    """TP > 1: what a rank other than 0 needs to start its shard's load of a request."""

    request_id: int
    producer: int  # index into consumer.producers
    lease_ids: list[int]  # per producer rank, rank order
    num_blocks: int
    first_block: int
    dst_slots: list[list[int]]
    uid: int = 0  # the load's id on the ranks' outcome bus (chosen by the leader)
    incarnations: list[int] = field(default_factory=list)  # per producer rank, rank order


@dataclass
class PrefixPlan:
    """TP > 1: one authorised prefix load, for ranks other than 0 (keyed by reservation id):
    rank r pushes blocks ``[push_first, push_first + push_blocks)`` of its own lease
    ``lease_ids[r]`` (``lease_blocks`` long; the same blocks under rank r's keys) into the
    same destination slots of its own shard."""

    reservation_id: int
    request_id: int
    producer: int  # index into consumer.producers
    lease_ids: list[int]  # per producer rank, rank order
    lease_blocks: int
    first_block: int  # the request's block ordinal of the lease's first block
    push_first: int  # lease-relative
    push_blocks: int
    dst_slots: list[list[int]]
    is_async: bool
    uid: int  # the load's id on the ranks' outcome bus
    incarnations: list[int] = field(default_factory=list)  # per producer rank, rank order


@dataclass
class _Reservation:
    """Scheduler: one reservation's lease (``load.first_block``: the request's block
    ordinal of the lease's first block) and the token ranges still protected."""

    request_id: int
    load: Load
    protected: list[tuple[int, int]]
    released: np.ndarray  # per lease block (lease-relative): given back already


@dataclass
class ConsumerMeta:
    loads: list[int] = field(default_factory=list)  # request ids whose load starts now
    scheduled: list[int] = field(default_factory=list)  # every request computed this pass
    plans: list[LoadPlan] = field(default_factory=list)  # TP > 1: the loads, for ranks > 0
    dropped: list[int] = field(default_factory=list)  # TP > 1: loads released since last
    # loads that failed before dispatch (request id, why): every rank fails the request
    failed: list[tuple[int, str]] = field(default_factory=list)
    bus: tuple[str, bytes] | None = None  # TP > 1: the outcome bus (address, secret)
    # prefix reservations: (reservation id, is_async) whose loads start now, and
    # (reservation id, request id, why) refused before dispatch (reported failed)
    prefix_loads: list[tuple[int, bool]] = field(default_factory=list)
    prefix_failed: list[tuple[int, int, str]] = field(default_factory=list)
    # TP > 1: the prefix loads starting now, for ranks > 0; reservations released while
    # their load was still landing (a runtime that did not drain it: every rank stops it)
    prefix_plans: list[PrefixPlan] = field(default_factory=list)
    prefix_dropped: list[int] = field(default_factory=list)


def loads_async(load_mode: str) -> bool:
    """``consumer.load_mode`` against the runtime: ``auto`` loads asynchronously where the
    runtime keeps a cancelled request's pages while its load is pending, else layer by
    layer (a synchronous load ends inside the forward that reads it); ``async`` on a
    runtime that frees them at once is refused: a load still landing would write into
    pages another request owns."""
    feats = runtime.current()
    if load_mode == "auto":
        return feats.keeps_cancelled_pages
    if load_mode == "async" and not feats.keeps_cancelled_pages:
        raise ConfigError(
            f"consumer.load_mode: async loads need a runtime that keeps a cancelled "
            f"request's pages while its load is pending, and TensorRT-LLM's {feats.line} "
            "frees them at once (no has_pending_transfers): set load_mode: sync (or auto)"
        )
    return load_mode == "async"


class ConsumerScheduler(KvCacheConnectorScheduler):
    """Leader side of the consumer: claims remote prefixes and plans their loads."""

    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self.config = resolve_config(llm_args, "consumer")
        self.service: ConsumerService = service_for(self.config, llm_args)
        self.is_async = loads_async(self.service.ccfg.load_mode)
        self._dropped: list[int] = []  # TP > 1: told to the other ranks in the next metadata
        self._prefix_dropped: list[int] = []  # TP > 1: reservations abandoned while loading

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Once per request (again after a replay). Offers whole blocks past a block-aligned
        device match, never the last prompt token, only blocks a producer holds in every
        layer group and has leased to us. Any failure before the answer is a miss."""
        svc = self.service
        rid = request.request_id
        self._drop(rid)  # a replayed request must not leak its first lease
        if svc.pool is None:
            return 0, False
        tpb = svc.pool.tokens_per_block
        if num_computed_tokens % tpb:
            svc.metrics["declined_unaligned"] += 1
            return 0, False
        prompt = request_tokens(request)
        offerable = (len(prompt) - 1) // tpb  # the last prompt token is always computed here
        first = num_computed_tokens // tpb
        if offerable <= first:
            return 0, False
        try:
            ident = request_identity(request)  # salt, LoRA adapter, multimodal inputs
            # every rank's keys (its namespace carries its tp_rank), packed; the prompt
            # is hashed as is (a block past `offerable` at most, cheaper than a copy)
            tokens = tokens_array(prompt) if svc.tp_size > 1 else prompt  # convert once
            keys = [
                block_key_blob(svc.namespace_seed(ident, tp_rank=r), tokens, tpb)[first:offerable]
                for r in range(svc.tp_size)
            ]
            claimed = svc.claim(rid, keys[0], keys[1:] if svc.tp_size > 1 else None)
        except Exception:  # a miss, never an engine failure
            log.exception("claim for request %d failed; recomputing", rid)
            return 0, False
        if claimed is None:
            return 0, False
        svc.loads[rid] = Load(
            rid,
            claimed,
            first_block=first,
            uid=svc.new_load_uid(),
            keys=keys[0] if svc.tp_size == 1 else None,
        )
        return claimed.num_blocks * tpb, self.is_async

    def _prefix_keys(self, request: Any, num_computed_tokens: int) -> tuple[int, list[Any]] | None:
        """The first offerable block and every rank's packed keys (rank order; TP=1: one)
        of the blocks a claim may lease (block-aligned past the device match, never the
        last prompt token)."""
        svc = self.service
        assert svc.pool is not None
        tpb = svc.pool.tokens_per_block
        if num_computed_tokens % tpb:
            svc.metrics["declined_unaligned"] += 1
            return None
        prompt = request_tokens(request)
        offerable = (len(prompt) - 1) // tpb  # the last prompt token is always computed here
        first = num_computed_tokens // tpb
        if offerable <= first:
            return None
        ident = request_identity(request)  # salt, LoRA adapter, multimodal inputs
        # every rank's keys (its namespace carries its tp_rank); the prompt converted once
        tokens = tokens_array(prompt) if svc.tp_size > 1 else prompt
        return first, [
            block_key_blob(svc.namespace_seed(ident, tp_rank=r), tokens, tpb)[first:offerable]
            for r in range(svc.tp_size)
        ]

    def reserve_prefix(
        self, request: Any, num_computed_tokens: int, reservation_id: int
    ) -> tuple[int, bool]:
        """Prefix-aware admission (rank 0, once per attempt, each with a fresh
        ``reservation_id``): claim the longest run a producer holds past
        ``num_computed_tokens`` and keep its lease under ``reservation_id``: the lease is
        the protection; no push starts and no destination page is written until the
        runtime authorises a range in ``SchedulerOutput.prefix_loads``. Answers
        ``(tokens, is_async)`` (``is_async`` from ``load_mode``), or ``(0, False)`` on a miss
        or any failure (never ``(0, True)``, never an exception into the engine). The
        runtime may accept less: it releases the rest (``release_prefix_reservation``).
        TP > 1: claims on every rank of the producer (each rank's keys; a block is offered
        only if every rank holds it, as ``get_num_new_matched_tokens``) and keeps every
        rank's lease under ``reservation_id``. Makes no collective call: the ranks > 0 learn
        of the reservation only if the runtime authorises a load of it (the plan)."""
        svc = self.service
        if svc.pool is None:
            return 0, False
        if reservation_id in svc.reservations:  # the runtime promises a fresh id
            log.warning("reservation id %d reused: declining", reservation_id)
            return 0, False
        rid = request.request_id
        try:
            got = self._prefix_keys(request, num_computed_tokens)
            if got is None:
                return 0, False
            first, keys = got
            claimed = svc.claim(rid, keys[0], keys[1:] if svc.tp_size > 1 else None)
        except Exception:  # a miss, never an engine failure
            log.exception("claim for request %d (reservation %d) failed", rid, reservation_id)
            return 0, False
        if claimed is None:
            return 0, False
        tpb = svc.pool.tokens_per_block
        load = Load(
            rid, claimed, first_block=first, uid=svc.new_load_uid(), reservation_id=reservation_id
        )
        span = (first * tpb, (first + claimed.num_blocks) * tpb)
        svc.reservations[reservation_id] = _Reservation(
            rid, load, [span], np.zeros(claimed.num_blocks, dtype=bool)
        )
        svc.metrics["prefix_reserved"] += 1
        return claimed.num_blocks * tpb, self.is_async

    def release_prefix_reservation(
        self, request: Any, reservation_id: int, start: int, end: int
    ) -> None:
        """Rank 0: the runtime no longer needs ``[start, end)`` (absolute prompt positions,
        half-open) of the reservation: the clipped or rejected part before any transfer,
        the accepted part once every worker reported its load. Gives back the lease's
        blocks no still-protected range overlaps (``ReleaseRange``, sent by the keepalive
        thread: this never waits on the network), and the whole lease once nothing is
        protected. Idempotent; an unknown id is ignored. Other reservations (even of the
        same blocks) hold leases of their own and keep them. TP > 1: the same blocks of
        every rank's lease (per producer rank: ``ReleaseRange`` if it announced the
        feature, else kept until the whole release); no collective."""
        svc = self.service
        res = svc.reservations.get(reservation_id)
        if res is None or end <= start or svc.pool is None:
            return
        left: list[tuple[int, int]] = []
        for a, b in res.protected:
            if b <= start or a >= end:
                left.append((a, b))
                continue
            if a < start:
                left.append((a, start))
            if end < b:
                left.append((end, b))
        res.protected = left
        load = res.load
        if not left:
            svc.reservations.pop(reservation_id, None)
            if load.dispatched and not load.done:  # the runtime drains first; if not, stop it
                svc.abandon(load, f"reservation {reservation_id} released while loading")
                if svc.tp_size > 1:  # the other ranks stop theirs at the next metadata
                    self._prefix_dropped.append(reservation_id)
            svc.release(load.claimed)  # every rank's lease
            return
        # blocks no protected range overlaps and not given back yet: released in runs
        # (vectorised: a 128k-token prompt leases thousands of blocks)
        tpb = svc.pool.tokens_per_block
        starts = (load.first_block + np.arange(load.claimed.num_blocks)) * tpb
        covered = np.zeros(starts.size, dtype=bool)
        for a, z in left:  # a few ranges
            covered |= (starts < z) & (starts + tpb > a)
        free = ~covered & ~res.released
        edges = np.flatnonzero(np.diff(np.concatenate(([0], free.view(np.int8), [0]))))
        for a, z in zip(edges[0::2], edges[1::2], strict=True):
            svc.release_blocks(load.claimed, int(a), int(z - a))
        res.released |= free

    def _plan_prefix_load(self, pl: Any) -> str | None:
        """Turn one authorised ``PrefixLoad`` into its reservation's push (lease-relative
        first block, block count, destination slots); an error naming why it cannot be."""
        svc = self.service
        res = svc.reservations.get(pl.reservation_id)
        if res is None:
            return (
                f"prefix load of reservation {pl.reservation_id} (request {pl.request_id}): "
                "this scheduler holds no such reservation (never reserved here, or released)"
            )
        if res.request_id != pl.request_id:
            return (
                f"reservation {pl.reservation_id} belongs to request {res.request_id}, not "
                f"{pl.request_id}"
            )
        assert svc.pool is not None
        tpb = svc.pool.tokens_per_block
        load = res.load
        lo, hi = load.first_block * tpb, (load.first_block + load.claimed.num_blocks) * tpb
        if pl.start % tpb or pl.end % tpb or not lo <= pl.start < pl.end <= hi:
            return (
                f"prefix load [{pl.start}, {pl.end}) of reservation {pl.reservation_id} is "
                f"not whole blocks of its lease [{lo}, {hi})"
            )
        off, nb = pl.start // tpb - load.first_block, (pl.end - pl.start) // tpb
        if res.released[off : off + nb].any():
            return f"prefix load of reservation {pl.reservation_id} covers released blocks"
        if load.dispatched:
            return f"reservation {pl.reservation_id} was authorised twice"
        b0 = pl.start // tpb
        # per group, numpy (a long prompt is thousands of blocks); -1 past a short list
        dst = np.full((len(pl.block_ids_by_layer_group), nb), -1, dtype=np.int64)
        for g, ids in enumerate(pl.block_ids_by_layer_group):  # a few groups
            part = np.asarray(ids[b0 : b0 + nb], dtype=np.int64)
            dst[g, : part.size] = part
        if not (dst >= 0).any():
            return "the engine allocated no page for the reserved blocks"
        load.push_first, load.push_blocks, load.dst_slots = off, nb, dst.tolist()
        return None

    def _prefix_plan(self, reservation_id: int, is_async: bool) -> PrefixPlan:
        """TP > 1: a planned reservation load as ranks > 0 need it (``_plan_prefix_load``
        filled the push fields)."""
        load = self.service.reservations[reservation_id].load
        c = load.claimed
        assert load.dst_slots is not None and load.push_blocks is not None
        return PrefixPlan(
            reservation_id,
            load.request_id,
            c.link.index,
            [r.lease_id for r in c.all_ranks()],
            c.num_blocks,
            load.first_block,
            load.push_first,
            load.push_blocks,
            load.dst_slots,
            bool(is_async),
            load.uid,
            [r.incarnation for r in c.all_ranks()],
        )

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Right after allocation (leader only, once per allocation, never waits): remember
        where the claimed blocks must land. A line that passes layer groups as a dict
        calls this flat form first for every cache; with several groups it carries
        nothing (the per-group call follows)."""
        pool = self.service.pool
        if pool is not None and pool.num_groups > 1:
            return
        self.update_state_after_alloc_by_layer_group(request, [list(block_ids)])

    def update_state_after_alloc_by_layer_group(
        self, request: Any, block_ids_by_layer_group: list[list[int]] | dict[int, list[int]]
    ) -> None:
        """Per-group form (a list indexed by group id, or a dict keyed by it): slot
        ``[g][i]`` of block ordinal ``i``; ``-1`` (outside a sliding window) means that
        group's page is not wanted and is skipped. Only what the runtime honoured
        (``py_num_connector_matched_tokens``, set by its commit before this call) is
        loaded; the rest of the lease goes back at once."""
        load = self.service.loads.get(request.request_id)
        if load is None or load.dispatched:
            return
        groups = block_ids_by_layer_group
        if isinstance(groups, dict):
            groups = [groups[g] for g in sorted(groups)]
        honoured = getattr(request, "py_num_connector_matched_tokens", None)
        if isinstance(honoured, int) and not isinstance(honoured, bool):
            self._honour(load, honoured // self.service.pool.tokens_per_block)  # type: ignore[union-attr]
            if self.service.loads.get(request.request_id) is not load:
                return  # nothing honoured: dropped
        first, n = load.first_block, load.blocks
        dst = []
        for ids in groups:
            part = [int(s) for s in ids[first : first + n]]
            dst.append(part + [-1] * (n - len(part)))
        if all(s < 0 for g in dst for s in g):
            self.service.fail(load, "the engine allocated no page for the claimed blocks")
        load.dst_slots = dst

    def _honour(self, load: Load, blocks: int) -> None:
        """Keep only the first ``blocks`` of a load not yet dispatched (a short honour or a
        ``cancel_load`` of the tail): the rest of the lease goes back now; none left drops
        the load (a parked request is still reported once, as loaded nothing)."""
        if load.dispatched or blocks >= load.blocks:
            return
        if blocks <= 0:
            self._drop(load.request_id)
            return
        self.service.release_blocks(load.claimed, blocks, load.blocks - blocks)
        load.push_blocks = blocks
        if load.dst_slots is not None:
            load.dst_slots = [g[:blocks] for g in load.dst_slots]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConsumerMeta:
        """Rank 0, once per iteration (the result is pickled and broadcast to every rank):
        loads whose slots are known start now (async requests are parked, so they are
        absent from the output: the loads travel here anyway), and the authorised prefix
        loads (``scheduler_output.prefix_loads``), each planned or refused by name (the
        request then fails at its first forward); never raises for one bad load. TP > 1:
        each planned prefix load also travels as a ``PrefixPlan`` for ranks > 0."""
        meta = ConsumerMeta(
            scheduled=[
                rd.request_id
                for rd in [*scheduler_output.new_requests, *scheduler_output.cached_requests]
            ]
        )
        tp = self.service.tp_size > 1
        if tp:
            meta.dropped, self._dropped = self._dropped, []
            bus = self.service.bus
            if bus is not None and bus.address is not None:
                meta.bus = (bus.address, bus.secret)
        if tp:
            meta.prefix_dropped, self._prefix_dropped = self._prefix_dropped, []
        for pl in getattr(scheduler_output, "prefix_loads", None) or []:
            why = self._plan_prefix_load(pl)
            if why is None:
                meta.prefix_loads.append((pl.reservation_id, bool(pl.is_async)))
                if tp:
                    meta.prefix_plans.append(self._prefix_plan(pl.reservation_id, pl.is_async))
            else:
                self.service.metrics["prefix_loads_refused"] += 1
                log.warning("%s: the request fails rather than read those pages", why)
                meta.prefix_failed.append((pl.reservation_id, pl.request_id, why))
        orphans = []
        for rid, load in self.service.loads.items():
            if not load.dispatched and load.dst_slots is None and not load.done:
                # allocation follows the claim in the same iteration: a claim still without
                # one two iterations later belongs to a request the engine dropped without
                # a call (cancelled between query and allocation)
                load.unplanned += 1
                if load.unplanned > 2:
                    orphans.append(rid)
            if load.done and load.error and not load.dispatched and not load.announced:
                load.announced = True  # failed before dispatch: every rank must know
                meta.failed.append((rid, load.error))
            if not load.dispatched and load.dst_slots is not None and not load.done:
                meta.loads.append(rid)
                if tp:
                    c = load.claimed
                    meta.plans.append(
                        LoadPlan(
                            rid,
                            c.link.index,
                            [r.lease_id for r in c.all_ranks()],
                            load.blocks,
                            load.first_block,
                            load.dst_slots,
                            load.uid,
                            [r.incarnation for r in c.all_ranks()],
                        )
                    )
        for rid in orphans:
            self.service.metrics["claims_orphaned"] += 1
            log.info("request %d was never allocated after its claim: lease given back", rid)
            self._drop(rid)
        return meta

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Once at the end: release the lease, after stopping a load still landing (its
        pages are freed when this returns). Where the engine publishes a freed request's
        pages for reuse (``stop_on_failure``), a load still landing is not stopped: the
        pages are kept (``True``) until it is over, so what gets published holds the
        loaded bytes; the worker reports the id then (or stops the engine if it failed)."""
        rid = request.request_id
        load = self.service.loads.get(rid)
        if self.service.stop_on_failure and load is not None and load.dispatched and not load.done:
            self.service.metrics["loads_outlived_request"] += 1
            return True
        self._drop(rid)
        return False

    def request_finished_by_layer_group(
        self, request: Any, cache_block_ids_by_layer_group: list[list[int]]
    ) -> bool:
        return self.request_finished(request, [])

    def cancel_load(self, request: Any, start: int, end: int) -> None:
        """Leader, from the runtime's scheduling pass (never waits): it will not consume
        ``[start, end)`` of the offer (a short honour, or the local cache overtook it).
        The load keeps the blocks before ``start`` and gives the rest back; nothing left
        drops it. A load already dispatched is left to land (the runtime recomputes and
        overwrites that range after it)."""
        load = self.service.loads.get(request.request_id)
        if load is None or load.dispatched:
            return
        tpb = self.service.pool.tokens_per_block  # type: ignore[union-attr]
        self._honour(load, start // tpb - load.first_block)

    def request_reset(self, request: Any) -> None:
        """V2: the request will replay from scratch and be queried again."""
        self._drop(request.request_id)

    def _drop(self, rid: int) -> None:
        load = self.service.loads.pop(rid, None)
        if load is not None:
            # The engine frees (and may reuse) this request's pages as soon as we return:
            # a load still landing must not write one more byte into them.
            self.service.abandon(load, f"request {rid} ended before its pages landed")
            self.service.release(load.claimed)
            if self.service.tp_size > 1:
                self._dropped.append(rid)


class ConsumerWorker(KvCacheConnectorWorker):
    """Worker side of the consumer: has pages pushed into our slots, reports completion."""

    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self.config = resolve_config(llm_args, "consumer")
        self.service: ConsumerService = service_for(self.config, llm_args)
        self.is_async = loads_async(self.service.ccfg.load_mode)
        self._loading: set[int] = set()  # ids handed in through get_finished
        self._failed: dict[int, str] = {}
        self._sync_pending: list[Load] = []
        self._cancelled: set[int] = set()  # TP, ranks > 0: parked loads the leader dropped
        self._holding: set[int] = set()  # finished requests whose pages await their load
        self._tp = self.service.tp_size > 1
        self._failed_early: set[int] = set()  # the leader failed these before dispatch
        # prefix reservations: reservation id -> (load, is_async) dispatched, not reported;
        # ids to report at the next get_finished_prefix_loads (refused before dispatch)
        self._prefix: dict[int, tuple[Load, bool]] = {}
        self._prefix_over: list[int] = []
        # failed loads reported to a runtime that restarts their requests
        self._failed_report: set[int] = set()
        self._failed_async_report: set[int] = set()

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """Bring-up, V1: the rank's single pool tensor."""
        tpb = self._llm_args.kv_cache_config.tokens_per_block
        self.service.attach(PagePool.from_v1_tensor(kv_cache_tensor, tpb))
        # V1 stores every prompt block of a released request for reuse, a failed one's
        # too (kvCacheManager.cpp releaseBlocks): unfilled pages would be served later.
        reuse = getattr(self._llm_args.kv_cache_config, "enable_block_reuse", True)
        self._decide_failure_policy(reuse is not False)

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Bring-up, V2: any number of layer groups and regions."""
        self.service.attach(PagePool(layout))
        self._decide_failure_policy(False)  # V2 publishes only what a forward committed

    def _decide_failure_policy(self, engine_reuses_failed_pages: bool) -> None:
        policy = self.service.ccfg.on_load_failure
        if policy == "auto":
            policy = "stop_instance" if engine_reuses_failed_pages else "fail_request"
        self.service.stop_on_failure = policy == "stop_instance"
        if self.service.stop_on_failure:
            log.info(
                "consumer: a failed KV load stops this instance (on_load_failure=%s): the "
                "engine would keep the request's unfilled pages for reuse",
                self.service.ccfg.on_load_failure,
            )

    def _load_failed(self, msg: str) -> KvLoadFailedError:
        """The error that keeps a failed load's pages from being read: it fails the
        request, or (``stop_on_failure``) carries TensorRT-LLM's fatal marker
        ("unrecoverable") so the engine stops instead of publishing those pages."""
        if not self.service.stop_on_failure:
            return KvLoadFailedError(
                f"KV cache load failed, refusing to compute on unloaded pages ({msg})"
            )
        return KvLoadFailedError(
            f"KV cache load failed ({msg}); unrecoverable by policy: this engine (V1 KV "
            "cache manager, block reuse on) would keep the request's unfilled pages for "
            "reuse, so the instance stops rather than serve them. To fail only the request, "
            "turn off kv_cache_config.enable_block_reuse or use the V2 manager "
            "(consumer.on_load_failure: fail_request)"
        )

    def start_load_kv(self, stream: Any) -> None:
        """Once per pass: ask producers to push this pass's loads. An exception here is
        fatal to the executor, so load failures are recorded instead; the one exception
        is on purpose: with ``stop_on_failure``, a scheduled request whose load failed
        stops the engine here (see ``_load_failed``)."""
        meta = self._metadata
        if not isinstance(meta, ConsumerMeta):
            return
        if self.service.tp_rank != 0:
            if meta.bus is not None and self.service.bus is not None:
                self.service.bus.connect(*meta.bus)
            self._adopt_plans(meta)
        for rid, why in meta.failed:  # every rank fails these requests alike
            self._failed[rid] = why
            if self.is_async:  # parked: get_finished reports it (rank > 0 has no load)
                self._failed_early.add(rid)
        if self.service.stop_on_failure:
            # Raised here, outside the forward's error handler, this stops the executor in
            # every TensorRT-LLM version, before the request's blocks could be released.
            bad = [rid for rid in meta.scheduled if rid in self._failed]
            if bad:
                raise self._load_failed(
                    "; ".join(f"request {rid}: {self._failed[rid]}" for rid in bad)
                )
        for res_id, rid, why in meta.prefix_failed:
            self._failed[rid] = why  # its first forward raises, naming it
            self._prefix_over.append(res_id)
        for res_id, pload, is_async in self._prefix_starting(meta):
            self.service.prefix_loads[res_id] = pload  # the bus thread (TP) polls it from here
            if not pload.done:  # else it failed while planned: reported as is
                self.service.dispatch(pload, layerwise=not is_async)
                if not is_async:
                    self._sync_pending.append(pload)
            self._prefix[res_id] = (pload, is_async)
        for rid in meta.loads:
            load = self.service.loads.get(rid)
            if load is None or load.dispatched:
                continue
            # synchronous loads stream layer by layer: layer i computes while later
            # layers are still in flight
            self.service.dispatch(load, layerwise=not self.is_async)
            if not self.is_async:
                self._sync_pending.append(load)

    def _prefix_starting(self, meta: ConsumerMeta) -> list[tuple[int, Load, bool]]:
        """This pass's reservation loads on this rank, not started yet: rank 0's are the
        scheduler's (its reservations, same process); rank r > 0 first stops the ones the
        leader dropped, then builds its own from each plan (its lease on producer rank r,
        the same destination slots, the load's bus uid)."""
        svc, rank = self.service, self.service.tp_rank
        out: list[tuple[int, Load, bool]] = []
        if rank == 0:
            for res_id, is_async in meta.prefix_loads:
                res = svc.reservations.get(res_id)
                if res is not None and not res.load.dispatched and res_id not in self._prefix:
                    out.append((res_id, res.load, is_async))
            return out
        for res_id in meta.prefix_dropped:
            load = svc.prefix_loads.get(res_id)
            if load is not None:
                svc.abandon(load, f"reservation {res_id} released while loading (leader)")
        for plan in meta.prefix_plans:
            if plan.reservation_id in self._prefix or plan.reservation_id in svc.prefix_loads:
                continue  # seen already
            claimed = Claimed(
                svc.links[plan.producer],
                plan.lease_ids[rank],
                plan.lease_blocks,
                incarnation=plan.incarnations[rank] if plan.incarnations else 0,
            )
            load = Load(
                plan.request_id,
                claimed,
                plan.first_block,
                [list(g) for g in plan.dst_slots],
                uid=plan.uid,
                push_first=plan.push_first,
                push_blocks=plan.push_blocks,
                reservation_id=plan.reservation_id,
            )
            out.append((plan.reservation_id, load, plan.is_async))
        return out

    def _adopt_plans(self, meta: ConsumerMeta) -> None:
        """Ranks > 0: forget loads the leader dropped, and build this rank's ``Load`` of each
        planned one (this rank's lease on producer rank r, the same destination slots)."""
        svc, rank = self.service, self.service.tp_rank
        for rid in meta.dropped:
            load = svc.loads.pop(rid, None)
            if load is not None:
                svc.abandon(load, f"request {rid} ended before its pages landed (leader)")
                if rid in self._loading:
                    self._cancelled.add(rid)
        for plan in meta.plans:
            self._cancelled.discard(plan.request_id)
            old = svc.loads.get(plan.request_id)
            if old is not None and old.claimed.lease_id == plan.lease_ids[rank]:
                continue  # seen already
            link = svc.links[plan.producer]
            claimed = Claimed(
                link,
                plan.lease_ids[rank],
                plan.num_blocks,
                incarnation=plan.incarnations[rank] if plan.incarnations else 0,
            )
            svc.loads[plan.request_id] = Load(
                plan.request_id,
                claimed,
                plan.first_block,
                [list(g) for g in plan.dst_slots],
                uid=plan.uid,
            )

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Before each layer: synchronous loads wait (bounded) for this layer's pages, and
        any request of this batch whose load failed raises an error naming it, so no layer
        reads pages that did not land. TP: every rank waits for every rank's pages of
        this layer (``rank_decision``), so all ranks raise here or none does."""
        if self._tp:
            self._wait_layer_all_ranks(layer_idx)
        else:
            keep = []
            for load in self._sync_pending:
                self.service.wait_layer(load, layer_idx)
                if load.error:
                    self._failed[load.request_id] = load.error
                if load.done or load.error:
                    self._settle(load)
                else:
                    keep.append(load)
            self._sync_pending = keep
        if not self._failed:
            return
        meta = self._metadata
        scheduled = meta.scheduled if isinstance(meta, ConsumerMeta) else []
        bad = [rid for rid in scheduled if rid in self._failed]
        if bad and self._reports_failures:
            # the runtime restarts exactly these requests after this forward
            # (take_failed_load_requests), instead of every active request failing
            for rid in bad:
                log.warning(
                    "KV load of request %d failed (%s): reported for a restart",
                    rid,
                    self._failed.pop(rid),
                )
                self._failed_report.add(rid)
        elif bad:
            msg = "; ".join(f"request {rid}: {self._failed.pop(rid)}" for rid in bad)
            raise self._load_failed(msg)

    @property
    def _reports_failures(self) -> bool:
        """The runtime takes failed-load reports (one TensorRT-LLM line), and a failure
        need not stop the instance (``stop_on_failure``: the pages would be reused)."""
        return runtime.current().failed_load_reports and not self.service.stop_on_failure

    def take_failed_load_requests(self) -> set[int]:
        """After each forward (lines that ask): requests whose synchronous load failed in
        it; the runtime drops their allocation and admits them again. Cleared on return."""
        out, self._failed_report = self._failed_report, set()
        return out

    def take_failed_async_load_requests(self) -> set[int]:
        """After ``get_finished`` (lines that ask): parked requests reported loaded whose
        load failed; the runtime restarts them instead of running them. Cleared."""
        out, self._failed_async_report = self._failed_async_report, set()
        return out

    def _settle(self, load: Load) -> None:
        """The load's outcome is recorded: its lease goes back now (``settle``), also for a
        request that ends without ``request_finished`` (cancelled)."""
        if load.reservation_id is None:
            self.service.settle(load)

    def _wait_layer_all_ranks(self, layer_idx: int) -> None:
        svc, keep = self.service, []
        for load in self._sync_pending:
            if load.reservation_id is None and svc.loads.get(load.request_id) is not load:
                continue  # dropped (its request ended; a reservation's load drains first)
            if load.reservation_id is not None and load.reservation_id not in self._prefix:
                continue  # reported: decided on every rank already (a forward cut short)
            need = svc.layers_needed(load, layer_idx)
            if need == -1:  # this layer loads nothing
                keep.append(load)
                continue
            err = svc.rank_decision(load, need, wait=True)
            if err:
                self._failed[load.request_id] = err
                self._settle(load)
            elif need is not None:  # more layers to come
                keep.append(load)
            else:
                self._settle(load)
        self._sync_pending = keep

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """A consumer saves nothing."""

    def wait_for_save(self, stream: Any) -> None:
        """A consumer saves nothing."""

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """Every iteration: report each handed-in async load once it is over. A failed load
        is reported too (so the request leaves the parking lot) and recorded, so its first
        forward pass raises in ``wait_for_layer_load`` instead of reading its pages. TP: a
        load is reported once it is over on every rank, failed if it failed on any."""
        self._loading.update(started_loading_req_ids)
        self._holding.update(finished_gen_req_ids)
        done = []
        for rid in list(self._loading):
            if rid in self._failed_early:  # the leader failed it before dispatch
                self._failed_early.discard(rid)
                done.append(rid)
                continue
            load = self.service.loads.get(rid)
            if load is None and self.service.tp_rank != 0 and rid not in self._cancelled:
                continue  # TP: this rank has not seen the leader's plan for it yet
            if load is None:
                # Dropped while parked (``abandon``: nothing of it lands any more). The
                # request ended, or replays from scratch after a new query: nothing will
                # read these pages as loaded, so no failure is recorded (one would fail a
                # replay that recomputes them).
                self._cancelled.discard(rid)
                done.append(rid)
                continue
            err: str | None = None
            if self._tp:
                self.service.poll(load)  # our own news first (the bus thread polls too)
                err = self.service.rank_decision(load, None, wait=False)
                if err is None:
                    continue
            elif self.service.poll(load):
                err = load.error or ""
            else:
                continue
            done.append(rid)
            self._settle(load)
            if err and self._reports_failures:
                self._failed_async_report.add(rid)
            elif err and self.service.stop_on_failure:
                # the engine may free (and publish for reuse) these pages without ever
                # scheduling the request again (it was cancelled): stop it now
                raise self._load_failed(f"request {rid}: {err}")
            elif err:
                self._failed[rid] = err
        self._loading.difference_update(done)
        return self._released(), done

    def get_finished_prefix_loads(self) -> list[int]:
        """Every iteration (prefix-aware scheduling), on every rank, from the executor's
        thread: reservation ids whose loads are over here (landed, or failed: nothing of
        them writes any more), each once; never waits (no collective, no blocking wait).
        A failed async load is recorded against its request, whose first forward then
        raises in ``wait_for_layer_load`` (a synchronous one raised in the forward it
        loaded under), so no token is computed on its pages. The runtime retires the load
        (and releases the accepted range) once every worker reported it.

        TP > 1: a load is reported once the ranks' common decision on it is known
        (``rank_decision``: landed on every rank, or failed on one, which aborts ours
        first), not merely once ours is over: so before any rank reports it, every rank
        has recorded a failure, and the request's first forward (after the runtime saw
        every rank's report) raises on every rank alike. A peer rank silent past the
        load's deadline plus ``PEER_GRACE_S`` counts as failed."""
        svc = self.service
        out, self._prefix_over = self._prefix_over, []
        for res_id, (load, is_async) in list(self._prefix.items()):
            if self._tp:
                svc.poll(load)  # our own news first (the bus thread polls too)
                decided = svc.rank_decision(load, None, wait=False)
                if decided is None:
                    continue
                err: str | None = decided or None
            else:
                if not svc.poll(load):
                    continue
                err = load.error
            del self._prefix[res_id]
            svc.prefix_loads.pop(res_id, None)
            out.append(res_id)
            if err and is_async:
                self._failed[load.request_id] = err
        return out

    def _released(self) -> list[int]:
        """Finished requests whose pages were kept for a load still landing (see
        ``ConsumerScheduler.request_finished``): reported once the load is over and its
        lease given back. A failed one stops the engine (raised outside the forward's
        error handler): its pages would be published for reuse half filled."""
        svc, out = self.service, []
        for rid in list(self._holding):
            load = svc.loads.get(rid)
            if load is not None and not svc.poll(load):
                continue
            err = load.error if load is not None else None
            if load is not None and self._tp:  # every rank stops, or none does
                decided = svc.rank_decision(load, None, wait=False)
                if decided is None:
                    continue
                err = decided or None
            if load is not None:
                svc.loads.pop(rid, None)
                if svc.tp_rank == 0:  # the leader gives back every rank's lease
                    svc.release(load.claimed)
                if err:
                    raise self._load_failed(f"request {rid} (already finished): {err}")
            self._holding.discard(rid)
            out.append(rid)
        return out
