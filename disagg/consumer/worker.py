"""The consumer's worker (every rank): has producers push the planned pages into this
rank's slots, reports completion through ``get_finished``, and makes sure no forward reads
a page whose load failed (it raises in ``wait_for_layer_load``, or reports the request
where the runtime takes failed-load reports). See ``connector`` for the contract.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..connector_common import resolve_config
from ..engine import KvCacheConnectorWorker, runtime
from ..pages import PagePool
from .loads import Load, LoadState
from .metadata import ConsumerMeta, KvLoadFailedError, loads_async
from .routes import rank_claims
from .service import ConsumerService, service_for

log = logging.getLogger("disagg.consumer")


class ConsumerWorker(KvCacheConnectorWorker):
    """Worker side of the consumer: has pages pushed into our slots, reports completion."""

    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self.config = resolve_config(llm_args, "consumer")
        self.service: ConsumerService = service_for(self.config, llm_args)
        self.is_async = loads_async(self.service.config)
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
                self.service.bus.connect(meta.bus.address, meta.bus.secret)
            self._adopt_plans(meta)
        for f in meta.failed:  # every rank fails these requests alike
            self._failed[f.request_id] = f.why
            if self.is_async:  # parked: get_finished reports it (rank > 0 has no load)
                self._failed_early.add(f.request_id)
        self._await_ended_loads(meta)
        if self.service.stop_on_failure:
            # Raised here, outside the forward's error handler, this stops the executor in
            # every TensorRT-LLM version, before the request's blocks could be released.
            bad = [rid for rid in meta.scheduled if rid in self._failed]
            if bad:
                raise self._load_failed(
                    "; ".join(f"request {rid}: {self._failed[rid]}" for rid in bad)
                )
        for pf in meta.prefix_failed:
            self._failed[pf.request_id] = pf.why  # its first forward raises, naming it
            self._prefix_over.append(pf.reservation_id)
        for res_id, pload, is_async in self._prefix_starting(meta):
            self.service.prefix_loads[res_id] = pload  # the bus thread (TP) polls it from here
            if not pload.over:  # else it failed while planned: reported as is
                self.service.dispatch(pload, layerwise=not is_async)
                if not is_async:
                    self._sync_pending.append(pload)
            self._prefix[res_id] = (pload, is_async)
        for start in meta.loads:
            load = self.service.loads.get(start.request_id)
            if load is None or load.state is not LoadState.PLANNED:
                continue
            # synchronous loads stream layer by layer: layer i computes while later
            # layers are still in flight
            self.service.dispatch(load, layerwise=not self.is_async)
            if not self.is_async:
                self._sync_pending.append(load)

    def _await_ended_loads(self, meta: ConsumerMeta) -> None:
        """Every rank, before this pass's loads and forward: wait for the loads whose
        pages a request of this pass reads as a cached prefix although their own request
        ended (``fence``), bounded by each load's deadline (TP > 1: the ranks' common
        verdict). A failed one fails its readers by the policy (``stop_on_failure``: the
        check right after this raises, before the forward)."""
        svc = self.service
        for aw in meta.awaited:
            load = svc.loads.get(aw.request_id)
            if load is None:
                continue  # reported and settled here already: it landed
            if self._tp:
                err = svc.rank_decision(load, None, wait=True)
            else:
                svc.wait(load)
                err = load.error
            if err:
                why = f"its cached prefix holds pages of request {aw.request_id}'s load: {err}"
                for reader in aw.readers:
                    self._failed[reader] = why

    def _prefix_starting(self, meta: ConsumerMeta) -> list[tuple[int, Load, bool]]:
        """This pass's reservation loads on this rank, not started yet: rank 0's are the
        scheduler's (its reservations, same process); rank r > 0 first stops the ones the
        leader dropped, then builds its own from each plan (its lease(s):
        ``routes.rank_claims``; the same destination slots, the load's bus uid)."""
        svc, rank = self.service, self.service.tp_rank
        out: list[tuple[int, Load, bool]] = []
        if rank == 0:
            for ps in meta.prefix_loads:
                res = svc.reservations.get(ps.reservation_id)
                if (
                    res is not None
                    and not res.load.started
                    and ps.reservation_id not in self._prefix
                ):
                    out.append((ps.reservation_id, res.load, ps.is_async))
            return out
        for res_id in meta.prefix_dropped:
            load = svc.prefix_loads.get(res_id)
            if load is not None:
                svc.abandon(load, f"reservation {res_id} released while loading (leader)")
        for ps in meta.prefix_loads:
            plan, res_id = ps.plan, ps.reservation_id
            if plan is None or res_id in self._prefix or res_id in svc.prefix_loads:
                continue  # seen already
            claimed, sources = rank_claims(
                svc, plan.producer, plan.lease_ids, plan.lease_blocks, plan.incarnations
            )
            load = Load(
                plan.request_id,
                claimed,
                plan.first_block,
                [list(g) for g in plan.dst_slots],
                uid=plan.uid,
                push_first=plan.push_first,
                push_blocks=plan.push_blocks,
                reservation_id=res_id,
                sources=sources,
            )
            out.append((res_id, load, ps.is_async))
        return out

    def _adopt_plans(self, meta: ConsumerMeta) -> None:
        """Ranks > 0: forget loads the leader dropped, and build this rank's ``Load`` of each
        planned one (its lease(s): ``routes.rank_claims``; the same destination slots)."""
        svc = self.service
        for rid in meta.dropped:
            load = svc.loads.pop(rid, None)
            if load is not None:
                svc.abandon(load, f"request {rid} ended before its pages landed (leader)")
                if rid in self._loading:
                    self._cancelled.add(rid)
        for start in meta.loads:
            plan, rid = start.plan, start.request_id
            if plan is None:
                continue  # not a TP plan (rank 0 builds none for itself)
            self._cancelled.discard(rid)
            claimed, sources = rank_claims(
                svc, plan.producer, plan.lease_ids, plan.num_blocks, plan.incarnations
            )
            old = svc.loads.get(rid)
            if old is not None and old.claimed.lease_id == claimed.lease_id:
                continue  # seen already
            svc.loads[rid] = Load(
                rid,
                claimed,
                plan.first_block,
                [list(g) for g in plan.dst_slots],
                uid=plan.uid,
                sources=sources,
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
                if load.over:
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
