"""The consumer's scheduler (the leader: rank 0 under TP): answers the engine's query by
claiming the longest prefix a producer holds, records where it must land, trims it to
what the runtime honours, and plans loads into ``ConsumerMeta``. See ``connector`` for the
contract and docs/design/consumer.md for TP and prefix reservations.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..connector_common import request_tokens, resolve_config
from ..engine import KvCacheConnectorScheduler, SchedulerOutput
from ..identity import request_identity
from ..protocol.keys import block_key_blob, tokens_array
from .fence import Fence
from .loads import ORPHAN_AFTER, Load, LoadState, Reservation
from .metadata import (
    AwaitedLoad,
    BusAddress,
    ConsumerMeta,
    KvLoadFailedError,
    LoadFailure,
    LoadPlan,
    LoadStart,
    PrefixFailure,
    PrefixPlan,
    PrefixStart,
    loads_async,
)
from .service import ConsumerService, service_for

log = logging.getLogger("disagg.consumer")


class ConsumerScheduler(KvCacheConnectorScheduler):
    """Leader side of the consumer: claims remote prefixes and plans their loads."""

    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self.config = resolve_config(llm_args, "consumer")
        self.service: ConsumerService = service_for(self.config, llm_args)
        self.is_async = loads_async(self.service.config)
        self.fence = Fence()  # loads whose pages were handed to another request (fence.py)
        self._dropped: list[int] = []  # TP > 1: told to the other ranks in the next metadata
        self._prefix_dropped: list[int] = []  # TP > 1: reservations abandoned while loading
        # loads REFUSED before dispatch: told to every rank in the next metadata
        self._refused: list[LoadFailure] = []

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
        svc.stamp(rid, "claim0")
        try:
            ident = request_identity(request)  # salt, LoRA adapter, multimodal inputs
            # every rank's keys (head-blind, its namespace carries its tp_rank; else one
            # for all ranks), packed; the prompt is hashed as is (a block past `offerable` at most, cheaper than a copy)
            tokens = tokens_array(prompt) if svc.tp_size > 1 else prompt  # convert once
            keys = [
                block_key_blob(svc.namespace_seed(ident, tp_rank=r), tokens, tpb)[first:offerable]
                for r in range(1 if svc.routes is not None else svc.tp_size)
            ]
            # a lease the proxy's prefetch took while the prompt was prefilled (every
            # producer rank's; not where TP is head-blind: ``prefetch.why_not``)
            fetched = first == 0 and svc.prefetches.why_not is None
            claimed = svc.prefetches.take(keys[0]) if fetched else None
            if claimed is None:
                claimed = svc.claim(rid, keys[0], keys[1:] if len(keys) > 1 else None)
            svc.stamp(rid, "claim1")
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
        # every rank's keys (head-blind, its namespace carries its tp_rank; else one for
        # all ranks); the prompt converted once
        tokens = tokens_array(prompt) if svc.tp_size > 1 else prompt
        return first, [
            block_key_blob(svc.namespace_seed(ident, tp_rank=r), tokens, tpb)[first:offerable]
            for r in range(1 if svc.routes is not None else svc.tp_size)
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
            claimed = svc.claim(rid, keys[0], keys[1:] if len(keys) > 1 else None)
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
        svc.reservations[reservation_id] = Reservation(
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
            if load.state is LoadState.DISPATCHED:  # the runtime drains first; else stop it
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
        if load.started:
            return f"reservation {pl.reservation_id} was authorised twice"
        if load.over:
            return f"reservation {pl.reservation_id}'s load failed already: {load.error}"
        b0 = pl.start // tpb
        # per group, numpy (a long prompt is thousands of blocks); -1 past a short list
        dst = np.full((len(pl.block_ids_by_layer_group), nb), -1, dtype=np.int64)
        for g, ids in enumerate(pl.block_ids_by_layer_group):  # a few groups
            part = np.asarray(ids[b0 : b0 + nb], dtype=np.int64)
            dst[g, : part.size] = part
        if not (dst >= 0).any():
            return "the engine allocated no page for the reserved blocks"
        load.push_first, load.push_blocks, load.dst_slots = off, nb, dst.tolist()
        load.transition(LoadState.PLANNED)
        return None

    def _prefix_plan(self, reservation_id: int) -> PrefixPlan:
        """TP > 1: a planned reservation load as ranks > 0 need it (``_plan_prefix_load``
        filled the push fields)."""
        load = self.service.reservations[reservation_id].load
        c = load.claimed
        assert load.dst_slots is not None and load.push_blocks is not None
        return PrefixPlan(
            load.request_id,
            c.link.index,
            [r.lease_id for r in c.all_ranks()],
            c.num_blocks,
            load.first_block,
            load.push_first,
            load.push_blocks,
            load.dst_slots,
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
        loaded; the rest of the lease goes back at once. CLAIMED (or PLANNED: a second
        call) -> PLANNED, or REFUSED when the engine allocated no page for it. Every
        request's pages are first checked against the loads of requests that ended while
        their pages were still landing (``fence``)."""
        svc = self.service
        load = svc.loads.get(request.request_id)
        groups = block_ids_by_layer_group
        if isinstance(groups, dict):
            groups = [groups[g] for g in sorted(groups)]
        pending = Fence.pending(svc.loads.values(), svc.tp_size > 1)
        if pending and svc.pool is not None:
            # below the request's own load (or its computed position) its pages are a
            # cached prefix it reads; from there on it writes them
            pos = getattr(request, "context_current_position", None)
            reads = load.first_block if load is not None else None
            if reads is None:
                reads = pos // svc.pool.tokens_per_block if isinstance(pos, int) else 1 << 62
            self.fence.check(request.request_id, groups, reads, pending)
        if load is None or load.started:
            return
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
        if all(s < 0 for g in dst for s in g) and not load.over:
            why = "the engine allocated no page for the claimed blocks"
            self.service.fail(load, why)
            self._refused.append(LoadFailure(load.request_id, why))
        load.dst_slots = dst
        if not load.over:
            load.transition(LoadState.PLANNED)

    def _honour(self, load: Load, blocks: int) -> None:
        """Keep only the first ``blocks`` of a load not yet dispatched (a short honour or a
        ``cancel_load`` of the tail): the rest of the lease goes back now; none left drops
        the load (a parked request is still reported once, as loaded nothing)."""
        if load.started or blocks >= load.blocks:
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
        self._apply_fence(scheduler_output, meta)
        if tp:
            meta.dropped, self._dropped = self._dropped, []
            meta.prefix_dropped, self._prefix_dropped = self._prefix_dropped, []
            bus = self.service.bus
            if bus is not None and bus.address is not None:
                meta.bus = BusAddress(bus.address, bus.secret)
        for pl in getattr(scheduler_output, "prefix_loads", None) or []:
            why = self._plan_prefix_load(pl)
            if why is None:
                pplan = self._prefix_plan(pl.reservation_id) if tp else None
                meta.prefix_loads.append(PrefixStart(pl.reservation_id, bool(pl.is_async), pplan))
            else:
                self.service.metrics["prefix_loads_refused"] += 1
                log.warning("%s: the request fails rather than read those pages", why)
                meta.prefix_failed.append(PrefixFailure(pl.reservation_id, pl.request_id, why))
        # failed before dispatch (REFUSED): every rank must know
        meta.failed, self._refused = self._refused, []
        orphans = []
        for rid, load in self.service.loads.items():
            if load.state is LoadState.CLAIMED:
                # allocation follows the claim in the same iteration: a claim still without
                # one ORPHAN_AFTER iterations later belongs to a request the engine dropped
                # without a call (cancelled between query and allocation)
                load.unplanned += 1
                if load.unplanned > ORPHAN_AFTER:
                    orphans.append(rid)
            elif load.state is LoadState.PLANNED:
                plan = None
                if tp:
                    assert load.dst_slots is not None
                    c = load.claimed
                    plan = LoadPlan(
                        c.link.index,
                        [r.lease_id for r in c.all_ranks()],
                        load.blocks,
                        load.first_block,
                        load.dst_slots,
                        load.uid,
                        [r.incarnation for r in c.all_ranks()],
                    )
                meta.loads.append(LoadStart(rid, plan))
        for rid in orphans:
            self.service.metrics["claims_orphaned"] += 1
            log.info("request %d was never allocated after its claim: lease given back", rid)
            self._drop(rid)
        return meta

    def _apply_fence(self, scheduler_output: SchedulerOutput, meta: ConsumerMeta) -> None:
        """This pass's fence verdicts (``fence``), before any load starts or forward runs:
        a load whose pages another request writes is dropped (aborted here, and on the
        other ranks through this metadata's ``dropped``); one whose pages another request
        reads as a cached prefix is awaited by every rank (``meta.awaited``). Raises (fatal
        to the engine) if an abort could not prove the pages quiet."""
        svc = self.service
        pending = Fence.pending(svc.loads.values(), svc.tp_size > 1)
        if pending and svc.pool is not None:
            self.fence.check_output(scheduler_output, svc.pool.tokens_per_block, pending)
        fenced, awaited = self.fence.take()
        for rid, by in fenced.items():
            svc.metrics["loads_fenced"] += 1
            log.warning(
                "request %d's pages were handed to request %d while its KV load landed (the "
                "executor freed them without waiting): load fenced",
                rid,
                by,
            )
            self._drop(rid, f"its pages were handed to request {by} while it landed")
            if svc.stuck_writes:
                raise KvLoadFailedError(
                    f"fencing the KV load of request {rid}: {svc.stuck_writes}; request "
                    f"{by} must not run on those pages"
                )
            for reader in sorted(awaited.pop(rid, ())):
                why = f"its cached prefix holds pages of request {rid}'s load, fenced half landed"
                meta.failed.append(LoadFailure(reader, why))
        for rid, readers in awaited.items():
            svc.metrics["loads_awaited"] += 1
            log.info(
                "request(s) %s read pages of request %d's KV load, still landing after its "
                "request ended: the pass waits for it",
                sorted(readers),
                rid,
            )
            meta.awaited.append(AwaitedLoad(rid, sorted(readers)))

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Once at the end: release the lease, after stopping a load still landing (its
        pages are freed when this returns). Where the engine publishes a freed request's
        pages for reuse (``stop_on_failure``), a load still landing is not stopped: the
        pages are kept (``True``) until it is over, so what gets published holds the
        loaded bytes; the worker reports the id then (or stops the engine if it failed)."""
        rid = request.request_id
        load = self.service.loads.get(rid)
        if self.service.stop_on_failure and load is not None and load.state is LoadState.DISPATCHED:
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
        if load is None or load.started:
            return
        tpb = self.service.pool.tokens_per_block  # type: ignore[union-attr]
        self._honour(load, start // tpb - load.first_block)

    def request_reset(self, request: Any) -> None:
        """V2: the request will replay from scratch and be queried again."""
        self._drop(request.request_id)

    def _drop(self, rid: int, why: str | None = None) -> None:
        if self._refused:  # a failure not told yet is moot: the request's load is gone
            self._refused = [f for f in self._refused if f.request_id != rid]
        load = self.service.loads.pop(rid, None)
        if load is not None:
            # The engine frees (and may reuse) this request's pages as soon as we return:
            # a load still landing must not write one more byte into them.
            self.service.abandon(load, why or f"request {rid} ended before its pages landed")
            self.service.release(load.claimed)
            if self.service.tp_size > 1:
                self._dropped.append(rid)
