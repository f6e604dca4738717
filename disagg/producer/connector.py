"""The producer's engine adapter: TensorRT-LLM's scheduler/worker hooks over ``ProducerService``.

Thin on purpose: the scheduler turns ``SchedulerOutput`` deltas into save plans (which
completed blocks, under which content keys, from which page slots); the worker copies
those pages into the block store layer by layer and commits them. Everything else
(store, leases, control server, pushes) is engine-neutral and lives in ``service.py``.

Tensor parallelism (TP=N): the scheduler runs on rank 0 only and plans every rank's saves:
the same blocks and page slots on every rank (slots are rank-independent), under each
rank's own keys (the namespace carries ``tp_rank``; ``SaveOp.keys_for(rank)``). Every rank's
worker copies its own head shard into its own rank's store. ``request_finished`` answers for
all ranks: with N > 1 it holds the pages of any request that had a save planned, and each
rank's ``get_finished`` reports the request once that rank's own saves landed (the runtime
intersects the ranks' answers).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import tuning
from ..connector_common import resolve_config
from ..engine import KvCacheConnectorScheduler, KvCacheConnectorWorker, SchedulerOutput
from ..identity import RequestIdentity, request_identity
from ..pages import PagePool
from ..protocol.keys import block_keys
from .saving import (
    PassCopy,
    copy_ended_pass,
    copy_layer_to_store,
    flush_pass,
    plan_layers,
    plan_pass,
    reserve_layers,
)
from .service import ProducerService, service_for

log = logging.getLogger("disagg.producer")


@dataclass
class SaveOp:
    """Save ``keys`` (consecutive completed blocks of one request) from these page slots.
    ``keys`` are rank 0's; ``rank_keys[r - 1]`` are rank r's keys of the same blocks (TP > 1:
    empty with TP = 1)."""

    request_id: int
    keys: list[bytes]
    slots: list[list[int]]  # [group][i]: the page slot of keys[i] in that group
    rank_keys: list[list[bytes]] = field(default_factory=list)

    def keys_for(self, rank: int) -> list[bytes]:
        """Rank ``rank``'s keys of these blocks."""
        return self.keys if rank == 0 else self.rank_keys[rank - 1]


@dataclass
class ProducerMeta:
    saves: list[SaveOp] = field(default_factory=list)


@dataclass
class _RequestState:
    ident: RequestIdentity
    tokens: list[int] = field(default_factory=list)
    slots: list[list[int]] = field(default_factory=list)  # per group, per block ordinal
    keys: list[list[bytes]] = field(default_factory=list)  # per TP rank, per block ordinal
    planned: int = 0  # blocks [0, planned) were considered for saving
    saved: bool = False  # a save was planned (TP > 1: request_finished holds its pages)


class ProducerScheduler(KvCacheConnectorScheduler):
    """Leader side of the producer: plans saves of every block that completes."""

    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self.config = resolve_config(llm_args, "producer")
        self.service: ProducerService = service_for(self.config, llm_args)
        self._requests: dict[int, _RequestState] = {}
        # what decides each request's KV besides its tokens (LoRA adapter, multimodal
        # inputs): only the request object handed in here carries it, not RequestData
        self._idents: dict[int, RequestIdentity] = {}

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Once per request (again after a replay). A producer serves no loads: always
        ``(0, False)``; it records the request's identity, under which its blocks are
        saved (a request never seen here is not saved: its adapter is unknown)."""
        self._idents[request.request_id] = request_identity(request)
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Nothing to do: slots are taken from ``SchedulerOutput`` deltas, which also cover
        later chunks (V2) and generated blocks."""

    def update_state_after_alloc_by_layer_group(
        self, request: Any, block_ids_by_layer_group: list[list[int]]
    ) -> None:
        """Same as the flat form, for any number of layer groups."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ProducerMeta:
        """Once per iteration: plan saves of the blocks this pass completes, from new and
        cached requests alike (chunked prefill, V2 deltas, generated blocks)."""
        ns_fp = self.service.fingerprint
        meta = ProducerMeta()
        if ns_fp is None:  # no cache registered yet: nothing can be saved
            return meta
        tpb = ns_fp.tokens_per_block
        groups = len(ns_fp.groups)
        ranks = self.service.tp_size
        for rd in [*scheduler_output.new_requests, *scheduler_output.cached_requests]:
            st = self._requests.get(rd.request_id)
            if st is None:
                ident = self._idents.get(rd.request_id)
                if ident is None:  # never queried (e.g. a dummy request): identity unknown
                    self.service.metrics["saves_skipped_unknown_identity"] += 1
                    continue
                st = _RequestState(
                    ident,
                    slots=[[] for _ in range(groups)],
                    keys=[[] for _ in range(ranks)],
                )
                self._requests[rd.request_id] = st
            st.tokens.extend(rd.new_tokens)
            _extend_slots(st.slots, rd)
            end = min(rd.computed_position + rd.num_scheduled_tokens, len(st.tokens))
            full = end // tpb
            if full <= st.planned:
                continue
            for rank, keys in enumerate(st.keys):  # every rank's own key chain
                if len(keys) < full:
                    seed = self.service.namespace_seed(st.ident, tp_rank=rank)
                    prev = keys[-1] if keys else None
                    keys.extend(
                        block_keys(
                            seed, st.tokens[: full * tpb], tpb, start_block=len(keys), prev=prev
                        )
                    )
            op = _save_op(rd.request_id, st, st.planned, full)
            st.planned = full
            if op is not None:
                st.saved = True
                meta.saves.append(op)
                self.service.note_saving(rd.request_id, len(op.keys))
        return meta

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Once at the end: ``True`` while this request's saves are in flight (its pages are
        still being read); ``get_finished`` reports it once they landed. With TP > 1 the
        other ranks' saves are not visible here: any request that had a save planned is
        held, and every rank reports it once its own saves landed."""
        st = self._requests.pop(request.request_id, None)
        self._idents.pop(request.request_id, None)
        if self.service.tp_size > 1 and st is not None and st.saved:
            return True
        return self.service.saves_in_flight(request.request_id)

    def request_finished_by_layer_group(
        self, request: Any, cache_block_ids_by_layer_group: list[list[int]]
    ) -> bool:
        """Same as the flat form, for any number of layer groups."""
        return self.request_finished(request, [])


def _extend_slots(slots: list[list[int]], rd: Any) -> None:
    by_group = getattr(rd, "new_block_ids_by_layer_group", None) or []
    if isinstance(by_group, dict):  # one TensorRT-LLM branch reports a dict
        by_group = [by_group[k] for k in sorted(by_group)]
    if by_group:
        for g, ids in enumerate(by_group):
            slots[g].extend(int(i) for i in ids)
    elif rd.new_block_ids:
        slots[0].extend(int(i) for i in rd.new_block_ids)


def _save_op(request_id: int, st: _RequestState, start: int, end: int) -> SaveOp | None:
    """Blocks [start, end) whose page exists in every group (all groups or none)."""
    keep = [i for i in range(start, end) if all(i < len(g) and g[i] >= 0 for g in st.slots)]
    if not keep:
        return None
    keys = [[k[i] for i in keep] for k in st.keys]
    return SaveOp(request_id, keys[0], [[g[i] for i in keep] for g in st.slots], keys[1:])


class ProducerWorker(KvCacheConnectorWorker):
    """Worker side of the producer: copies planned pages into the block store."""

    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self.config = resolve_config(llm_args, "producer")
        self.service: ProducerService = service_for(self.config, llm_args)
        self._saves: list[SaveOp] = []  # bound for this pass, not planned yet
        self._held: list[int] = []  # layers saved before the plan (``save_kv_layer``)
        self._pass: _PassPlan | None = None
        self._finished_saving: list[int] = []
        self._save_stream: Any = None  # CUDA: the save copies' stream (made on first use)
        # a pass whose forward ended (``wait_for_save``) and whose copies wait for
        # ``get_finished``: the forward's stream, in a list so that ``None`` (the current
        # stream) is kept apart from no pass
        self._ended: list[Any] = []
        self._copied: Any = None  # CUDA: the last pass's copies, on the save stream

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """Bring-up, V1: the rank's single pool tensor."""
        tpb = self._llm_args.kv_cache_config.tokens_per_block
        self.service.attach(PagePool.from_v1_tensor(kv_cache_tensor, tpb))

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Bring-up, V2: any number of layer groups and regions."""
        self.service.attach(PagePool(layout))

    def bind_connector_meta(self, metadata: object) -> None:
        """Every iteration, before the forward: take this pass's saves. They are planned
        during the forward, while the device runs its first layers (``save_kv_layer``).
        A pass ended but not copied yet (no ``get_finished`` since) is copied first."""
        super().bind_connector_meta(metadata)
        self._copy_ended()
        self._abandon_pass()
        if isinstance(metadata, ProducerMeta) and metadata.saves:
            self._saves = metadata.saves

    def start_load_kv(self, stream: Any) -> None:
        """Every iteration, before the forward: a producer loads nothing, but the forward
        ``stream`` waits (on the device) for the copies of the passes before it, so no
        page they read is written first: the engine may have freed it meanwhile (a
        sliding window's page behind the window, a cancelled request's pages)."""
        copied, self._copied = self._copied, None
        if copied is not None:
            pool = self.service.pool
            assert pool is not None
            forward = stream if isinstance(stream, torch.cuda.Stream) else None
            (forward or torch.cuda.current_stream(pool.device)).wait_event(copied)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """A producer loads nothing."""

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Right after layer ``layer_idx`` is enqueued (engine thread, once per layer per
        pass). With ``tuning.save_reserve_layers`` = N the N-th layer's save reserves the
        pass's store rows (dedup, evict, drop: host work only, ``_PassPlan.reserve``); with
        0 (the default, ``saving.RESERVE_AFTER_LAYERS``) the pass's end does. With
        ``tuning.save_plan_layers`` = 0 (the default, ``saving.PLAN_AFTER_LAYERS``) the layer is only
        noted: the pass's end (``wait_for_save``, or ``get_finished`` after the responses)
        places the copy indices and copies every layer. With N, the N-th layer's save (or the
        reservation, if later) places the indices on their devices once
        (``saving.plan_pass``) and from there each layer's save enqueues the copy of its
        bytes of the pass's completed blocks into their rows, ordered after the layer (on
        CUDA on the save stream, which waits for the forward stream here:
        ``tuning.save_stream``); layers noted before are copied right after the indices
        are placed (a layer's pages are not written by the layers after it). Nothing here
        waits for the device."""
        plan = self._pass
        if plan is not None and plan.copy is not None:
            self._copy_layer(layer_idx, stream)
            return
        if plan is None and not self._saves:
            return
        self._held.append(layer_idx)
        if plan is None:
            at = reserve_layers()
            if at == 0 or len(self._held) < at:
                return
            self._reserve()
        after = plan_layers()
        if after and len(self._held) >= after:
            self._place(stream)

    def _reserve(self) -> None:
        saves, self._saves = self._saves, []
        self._pass = _PassPlan.reserve(self.service, saves)

    def _place(self, stream: Any, ended: bool = False) -> None:
        """Place the reserved pass's copy indices, then copy the layers noted so far: at
        the pass's end (``ended``) with every layer noted, its whole pages at once
        (``saving.copy_pass_to_store``; ``tuning.save_whole_pass``), else a layer at a
        time."""
        plan = self._pass
        pool = self.service.pool
        assert plan is not None and pool is not None
        held, self._held = self._held, []
        slab = self.service.store.slab
        with self._on_save_stream(stream):  # the indices belong to the copies' stream
            plan.place(pool, slab)
            assert plan.copy is not None
            if ended:
                if plan.keys:
                    self._staging(plan)
                    copy_ended_pass(pool, plan.copy, slab, held)
                return
        for layer in held:
            self._copy_layer(layer, stream)

    def _staging(self, plan: _PassPlan) -> None:
        if not plan.staging:
            self.service.store.mark_staging(plan.keys)
            plan.staging = True

    def _copy_layer(self, layer_idx: int, stream: Any) -> None:
        plan = self._pass
        if plan is None or plan.copy is None or not plan.keys:
            return
        self._staging(plan)
        pool = self.service.pool
        assert pool is not None
        with self._on_save_stream(stream):
            copy_layer_to_store(pool, layer_idx, plan.copy, self.service.store.slab)

    def wait_for_save(self, stream: Any) -> None:
        """After the forward (engine thread, before sampling): the pass's blocks are
        complete. With ``tuning.save_after_responses`` (default on) only the pass's end is
        noted: ``get_finished``, after the iteration's responses, copies it, so the first
        token is not sent behind that host work (its copies wait for the forward stream
        then, as in every mode: by that time it has only sampled since the pass).
        Else the pass is copied here. Either way its commit is queued for the committer
        thread (on CUDA once the copies' event fires); nothing waits for the device."""
        if tuning.current().save_after_responses is False:
            self._end_pass(stream)
            return
        self._ended = [stream]

    def _copy_ended(self) -> None:
        """Copy the pass whose forward ended, if its copies were left for later."""
        ended, self._ended = self._ended, []
        for stream in ended:
            self._end_pass(stream)

    def _end_pass(self, stream: Any) -> None:
        """Reserve (if not yet), place and copy the ended pass's layers not copied yet
        (all of them with ``save_plan_layers`` 0), then queue its commit."""
        if self._saves and self._held:  # saved, its rows not reserved yet
            self._reserve()
        if self._saves:  # no layer was saved: nothing of the pass is in the store
            self._abandon_pass()
        plan = self._pass
        if plan is None:
            return
        if plan.copy is None:
            self._place(stream, ended=True)
        self._pass = None
        assert plan.copy is not None
        with self._on_save_stream(stream) as save:
            flush_pass(plan.copy, self.service.store.slab)
        if isinstance(save, torch.cuda.Stream) and save is not stream:
            self._copied = torch.cuda.Event()
            self._copied.record(save)
        self.service.finish_pass(plan.keys, plan.request_counts, save, plan.copy)

    @contextlib.contextmanager
    def _on_save_stream(self, stream: Any) -> Iterator[Any]:
        """On CUDA with ``tuning.save_stream`` (default on): the save stream, made to wait
        for everything enqueued on the forward stream so far, as the current stream (its
        tensors are allocated for it, so the allocator never hands them to the forward
        while a copy still reads them). Else the forward stream itself."""
        pool = self.service.pool
        if pool is None or pool.device.type != "cuda" or tuning.current().save_stream is False:
            yield stream
            return
        forward = stream if isinstance(stream, torch.cuda.Stream) else None
        forward = forward or torch.cuda.current_stream(pool.device)
        if self._save_stream is None:
            self._save_stream = torch.cuda.Stream(pool.device)
        self._save_stream.wait_stream(forward)
        with torch.cuda.stream(self._save_stream):
            yield self._save_stream

    def _abandon_pass(self) -> None:
        """The forward failed (the executor's error path skips ``wait_for_save``): this
        pass's blocks will never be whole. Forget them now, so their requests stop
        counting as saving and their pages go back to the engine, instead of waiting for
        SAVE_TIMEOUT (which frees the store rows but not the requests' pages)."""
        saves, self._saves = self._saves, []
        self._held = []
        if saves:  # never planned: none of its saves is in flight
            self.service.metrics["passes_abandoned"] += 1
            self.service.note_planned(saves, {})
        plan, self._pass = self._pass, None
        if plan is not None:
            self.service.abandon_pass(plan.keys, plan.request_counts)

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """Every iteration, after its responses: copy the pass that ended (see
        ``wait_for_save``); report each handed-in request once its saves have landed."""
        self._copy_ended()
        self._abandon_pass()  # a pass still planned here never reached wait_for_save
        self._finished_saving.extend(finished_gen_req_ids)
        done = [r for r in self._finished_saving if not self.service.saves_in_flight(r)]
        if done:
            self._finished_saving = [r for r in self._finished_saving if r not in set(done)]
        return done, []


@dataclass
class _PassPlan:
    """One pass's saves: its store rows reserved (``reserve``), then its copy indices
    placed on their devices (``place``)."""

    keys: list[bytes]
    rows: np.ndarray  # the store row of each kept block
    slots: list[np.ndarray]  # per group: the page slot of each kept block
    request_counts: dict[int, int]
    copy: PassCopy | None = None
    staging: bool = False

    @classmethod
    def reserve(cls, service: ProducerService, saves: list[SaveOp]) -> _PassPlan:
        rank = service.tp_rank
        keys = [k for op in saves for k in op.keys_for(rank)]
        groups = len(saves[0].slots)
        slots = np.array(
            [[s for op in saves for s in op.slots[g]] for g in range(groups)], dtype=np.int64
        ).reshape(groups, -1)
        rows = service.store.plan(keys)
        keep = rows >= 0
        counts: dict[int, int] = {}
        owner = np.repeat([op.request_id for op in saves], [len(op.keys) for op in saves])
        for rid, n in zip(*np.unique(owner[keep], return_counts=True)):
            counts[int(rid)] = int(n)
        # saves that were deduplicated or dropped are not in flight
        service.note_planned(saves, counts)
        return cls(
            keys=[k for k, ok in zip(keys, keep) if ok],
            rows=rows[keep],
            slots=list(slots[:, keep]),
            request_counts=counts,
        )

    def place(self, pool: PagePool, slab: torch.Tensor) -> PassCopy:
        """Call with the copies' stream current."""
        self.copy = plan_pass(pool, slab, self.rows, self.slots)
        return self.copy
