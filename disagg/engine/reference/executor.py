"""The executor loop: drives the model, the paged cache and a connector exactly as
TensorRT-LLM's PyTorch executor does (``py_executor.py``'s call order and failure paths),
with in-flight batching as its scheduler does it. One ``Engine.step()`` is one iteration:

1. schedule (TensorRT-LLM's capacity then micro-batch scheduler, same limits and names):
   waiting requests are admitted FIFO while fewer than ``max_batch_size`` run and the pools
   can hold their whole lifetime (GUARANTEED_NO_EVICT); the batch takes every generation
   request first (one token each), then context chunks in arrival order (at most
   ``chunk_size``) while ``max_num_tokens`` and ``max_batch_size`` last: a chunk that does
   not fit is cut to whole blocks of what is left, one that cannot get a block waits
   (the policy: ``scheduling.py``);
2. prepare_resources: a request's first context chunk computes the device-matched prefix P,
   asks ``get_num_new_matched_tokens(req, P)`` once, allocates (V1: every prompt block; V2:
   P+N plus the first chunk) and calls ``update_state_after_alloc`` (flat, V1) or
   ``update_state_after_alloc_by_layer_group`` (V2); later chunks/generation grow pages;
3. a ``SchedulerOutput`` of deltas (async-loading requests left out), then
   ``build_connector_meta`` -> pickle round trip -> ``bind_connector_meta`` on every rank ->
   ``start_load_kv`` (an exception there is fatal: the engine is dead);
4. one forward over the whole batch: per layer ``wait_for_layer_load`` -> the layer for
   every request at once -> ``save_kv_layer``; ``wait_for_save``. An exception fails every
   request of the batch; others keep being served. Under TP every rank's hook is called
   and they must agree, else ``RankDivergenceError`` (fatal: a real multi-process engine
   would hang in the layer's all-reduce); with ``comm`` (MPI mode, one TP rank per
   process, ``connector_driver.TpComm``) only this rank's hook runs and each layer
   all-gathers the heads (``RankHangError`` after the comm's ``hang_timeout_s``);
5. sampling (greedy, one call), block registration for reuse, sliding-window reclamation;
   then the responses (``_handle_responses``): ``Engine.respond``, if set, is called, so a
   server sends the new tokens before the connector's ``get_finished`` work;
6. finished requests: ``request_finished`` (grouped form in V2); ``True`` keeps pages until
   every rank reports the save;
7. ``get_finished`` every iteration, forward or not.

Prefix-aware scheduling (``EngineConfig.prefix_aware_scheduling``): reservations instead
of ``get_num_new_matched_tokens``, their loads and when they retire: ``prefix_loads``.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import tuning
from .. import SchedulerOutput
from . import scheduling
from .config import ConnectorSpec, EngineConfig, build_llm_args, features_for
from .connector_driver import IMMEDIATE_FATAL_PATTERNS, Driver, RankDivergenceError, TpComm
from .kv_cache import KvCacheManager, block_hashes
from .model import TinyLlama
from .prefix_loads import PrefixLoads
from .requests import EngineStats, Request, RequestResult, report

IDLE_WAIT_US = 100


class Engine:
    """The reference engine. Single-threaded: call ``add_request`` and ``step`` from the
    same thread. See the module docstring for what one ``step`` does.

    ``comm`` (MPI mode, ``disagg.engine.reference.mpi.MpiComm``): this process is TP rank
    ``comm.rank`` of ``config.tp == comm.size``; every rank's process builds its own
    ``Engine`` and must be given the same requests (and cancels) in the same order, as
    TensorRT-LLM's rank 0 broadcasts the request queue; the ranks then schedule alike.
    Pools, ``page_bytes`` and page snapshots hold this rank's KV-head shard only."""

    def __init__(
        self,
        config: EngineConfig,
        connector: ConnectorSpec | None = None,
        comm: TpComm | None = None,
    ):
        self.config = cfg = config
        if cfg.device.startswith("cuda:"):
            # its GPU current on the thread that builds and steps it (a thread starts on
            # cuda:0), as TensorRT-LLM's executor makes its rank's GPU current: the
            # connectors' streams and events are the current device's
            import torch

            torch.cuda.set_device(cfg.device)
        if comm is not None and comm.size != cfg.tp:
            raise ValueError(f"Engine: comm has {comm.size} ranks, config says tp={cfg.tp}")
        self.comm = comm
        self.stats = EngineStats()
        self.model = TinyLlama(cfg, tp=comm)
        self.kv = KvCacheManager(cfg, ranks=None if comm is None else [comm.rank])
        self.llm_args = build_llm_args(cfg, connector)
        self.features = features_for(cfg)
        self.driver: Driver | None = None
        if connector and cfg.connector_manager == "trtllm":
            from .trtllm_driver import TrtllmDriver

            self.driver = TrtllmDriver(
                cfg,
                connector,
                self.llm_args,
                self.kv,
                self.stats.calls,
                comm,
                self.features,
                hashes=self._int_hashes,
            )
        elif connector:
            self.driver = Driver(
                cfg, connector, self.llm_args, self.kv, self.stats.calls, comm, self.features
            )
        self.results: dict[int, RequestResult] = {}
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count(1)
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._iteration = 0
        self._fatal: BaseException | None = None
        self._new_saving: list[int] = []
        self._hidden: Any = None
        self._spans: dict[int, tuple[int, int]] = {}
        self._cancels: list[int] = []
        self._replays: list[int] = []
        # called (engine thread) once per iteration after sampling, before step 6: where
        # TensorRT-LLM's executor enqueues its responses (``_handle_responses``)
        self.respond: Callable[[], None] | None = None
        # prefix reservations (opt-in): the connector's capability decides, as in
        # TensorRT-LLM's configure_prefix_reservations (partial implementation: ValueError)
        self.prefix_reservations = bool(
            self.driver is not None
            and cfg.prefix_aware_scheduling
            and self.driver.prefix_capability()
        )
        self.prefix = PrefixLoads(cfg, self.driver, self._hand_back)
        idle_us = tuning.current().engine_idle_wait_us
        self._idle_wait_s = (IDLE_WAIT_US if idle_us is None else idle_us) / 1e6

    # ----- public API -----------------------------------------------------------------
    @property
    def kv_pools(self) -> list[list[Any]]:
        """``kv_pools[group][i]``: the pool tensors of the ranks held here, rank order
        (every rank; MPI mode: this rank's alone); see ``kv_cache`` for the layout."""
        return [g.pools for g in self.kv.groups]

    def request_pages(self, request_id: int) -> list[list[int]]:
        """The request's current page slots per layer group (``-1`` = no page)."""
        return [list(p) for p in self.requests[request_id].pages]

    def page_bytes(self, group: int, slot: int) -> bytes:
        """One group page's bytes (every rank's shard held here, rank order)."""
        return self.kv.page_bytes(group, slot)

    def add_request(
        self,
        prompt_tokens: list[int],
        max_tokens: int,
        cache_salt: str | None = None,
        lora_task_id: int | None = None,
        multimodal_hashes: list[list[int]] | None = None,
    ) -> int:
        """Queue a request. ``lora_task_id`` and ``multimodal_hashes`` stand for a LoRA
        adapter and multimodal inputs: the model's output depends on them (a per-identity
        embedding offset), as a real adapter's or image's would."""
        cfg = self.config
        if not prompt_tokens:
            raise ValueError("prompt must not be empty")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        ids = np.asarray(prompt_tokens, dtype=np.int64)
        if ids.ndim != 1 or ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size})")
        if len(prompt_tokens) + max_tokens > cfg.max_seq_len:
            raise ValueError(f"prompt + max_tokens exceeds max_seq_len {cfg.max_seq_len}")
        need = -(-(len(prompt_tokens) + max_tokens) // cfg.tokens_per_block)
        if need > cfg.num_blocks:
            raise ValueError(
                f"prompt + max_tokens needs {need} KV blocks per layer group; the pools hold "
                f"num_blocks {cfg.num_blocks}"
            )
        rid = next(self._ids)
        req = Request(
            rid,
            ids.tolist(),
            max_tokens,
            cache_salt,
            len(self.kv.groups),
            lora_task_id,
            multimodal_hashes,
        )
        self.requests[rid] = req
        self.results[rid] = RequestResult()
        self._waiting.append(req)
        return rid

    def cancel(self, request_id: int) -> None:
        """Cancel a request (a client going away), as TensorRT-LLM's executor does
        (``_handle_canceled_requests``): it ends at the start of the next iteration with the
        error ``cancelled``, and the connector is not told (no ``request_finished``). Its
        pages are freed at once, as every stored ``py_executor.py`` does, unless
        ``EngineConfig.cancel_waits_for_transfers`` (an executor that asks
        ``has_pending_transfers``: a parked load not yet reported by every rank): then
        they are freed once it is. A reservation load drains first
        (``defer_load_termination``). Finished or unknown requests are ignored."""
        if request_id in self.requests:
            self._cancels.append(request_id)

    def replay(self, request_id: int) -> None:
        """Drop a running request's allocation and run it again from scratch at the start
        of the next iteration, as a V2 runtime does on preemption (``reset_request_state``;
        one line also calls the scheduler's ``request_reset``): asked again, reported as a
        new request. Ignored for a request parked on a transfer or already ended."""
        if request_id in self.requests:
            self._replays.append(request_id)

    def _apply_replays(self) -> None:
        replays, self._replays = self._replays, []
        for rid in replays:
            req = self.requests[rid]
            if req.state in ("context", "generation") and not self.results[rid].finished:
                self.stats.replays += 1
                self._restart(req)

    def _apply_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        for rid in cancels:
            req = self.requests[rid]
            if req.state in ("done", "saving", "draining", "cancelled"):
                continue
            if self.results[rid].finished:
                continue
            if req in self._waiting:
                self._waiting.remove(req)
            res = self.results[rid]
            res.error, res.finished = "cancelled", True
            self.stats.requests_failed += 1
            if self.prefix.defer_end(req):
                continue
            if (
                self.driver is not None
                and self.config.cancel_waits_for_transfers
                and self.driver.pending_transfer(rid)
            ):
                req.state = "cancelled"  # freed when every rank reported the transfer
                continue
            self._release(req)  # free_resources (V1: its blocks stored for reuse, as C++ does)
            self._drop(req)

    def has_work(self) -> bool:
        return bool(self._waiting or self._active)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int | list[int],
        cache_salt: str | None = None,
        lora_task_id: int | None = None,
        multimodal_hashes: list[list[int]] | None = None,
    ) -> list[list[int]]:
        """Run prompts to completion; raises ``RuntimeError`` naming a failed request."""
        mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        ids = [
            self.add_request(p, m, cache_salt, lora_task_id, multimodal_hashes)
            for p, m in zip(prompts, mts, strict=True)
        ]
        while any(not self.results[i].finished for i in ids) or self.has_work():
            self.step()
        for i in ids:
            if self.results[i].error:
                raise RuntimeError(f"request {i} failed: {self.results[i].error}")
        return [list(self.results[i].tokens) for i in ids]

    # ----- one iteration --------------------------------------------------------------
    def step(self) -> bool:
        """One iteration; whether it did anything (a forward, a request loaded or ended).
        An idle one with work left (every request waits on the connector) sleeps
        ``tuning.engine_idle_wait_us`` first: a loop polling ``get_finished`` holds the
        GIL, and the connector's threads it waits for (commits, data plane, HTTP) would
        get it only at each thread switch interval."""
        if self._fatal is not None:
            raise RuntimeError(
                f"engine is dead after a fatal error: {self._fatal}"
            ) from self._fatal
        try:
            busy = self._step()
        except BaseException as e:
            self._fatal = e
            raise
        if not busy and self._idle_wait_s and self.has_work():
            time.sleep(self._idle_wait_s)
        return busy

    def _step(self) -> bool:
        cfg, drv = self.config, self.driver
        self._iteration += 1
        it = self._iteration
        self.stats.iterations += 1
        self._new_saving = []
        new_loading: list[int] = []
        self._apply_cancels()
        self._apply_replays()
        self.prefix.retire()

        # 1. schedule: admission while the pools and the batch limit allow, then the
        # micro-batch: generation first, then context chunks while the token budget lasts
        ctx = [r for r in self._active if r.state == "context"]
        gen = [r for r in self._active if r.state == "generation"]
        while self._waiting and len(ctx) + len(gen) < cfg.max_batch_size:
            req = self._waiting[0]
            if not scheduling.fits(cfg, self.kv, self._active, req):
                break
            self._waiting.popleft()
            req.state = "context"
            self._active.append(req)
            ctx.append(req)
        gen = gen[: min(cfg.max_batch_size, cfg.max_num_tokens)]
        budget, room = cfg.max_num_tokens - len(gen), cfg.max_batch_size - len(gen)

        # 2. prepare_resources
        sched_ctx: list[Request] = []
        for req in ctx:
            if not room or not budget:
                break
            if not req.queried:
                if budget < min(cfg.tokens_per_block, req.prompt_len):
                    continue  # its first chunk might not fit: not asked, not allocated yet
                if not self._first_allocation(req, new_loading, budget):
                    continue
            else:
                req.context_chunk_size = scheduling.chunk(cfg, req, budget)
                if not req.context_chunk_size:
                    continue
                if cfg.kv_manager == "v2":
                    upto = req.context_current_position + req.context_chunk_size
                    self.kv.extend(req.pages, upto, req.context_current_position, req.hashes, 0)
            budget -= req.context_chunk_size
            room -= 1
            sched_ctx.append(req)
        for req in gen:
            self.kv.extend(req.pages, len(req.tokens), len(req.tokens) - 1, req.hashes, 0)

        # 3. scheduler output, park async loads, metadata, start_load_kv
        scheduled = sched_ctx + gen
        batch = [r for r in sched_ctx if r.state == "context"] + gen
        accepted = self.prefix.take_accepted()
        if drv is not None and drv.builds_scheduler_output and scheduled:
            lags = {r.request_id: int(cfg.overlap and r.sampled_iter == it - 1) for r in gen}
            drv.start_batch(sched_ctx, gen, lags)  # type: ignore[attr-defined]
        elif drv is not None and (scheduled or accepted):
            out = SchedulerOutput()
            for req in batch:
                (out.cached_requests if req.reported else out.new_requests).append(
                    self._report(req, it)
                )
            if self.prefix_reservations:
                out.prefix_loads = accepted
            meta = drv.sched("build_connector_meta", out)
            self.prefix.dispatched(accepted)
            drv.bind_and_start(meta)
        for req in sched_ctx:
            req.external_load = None
        # 4. forward
        busy = bool(batch)
        if batch:
            self.stats.forward_passes += 1
            if not self._forward(batch):
                batch = []
        if drv is not None and batch:
            failed = drv.take_failed_loads(parked=False)
            for req in [r for r in batch if r.request_id in failed]:
                self.stats.load_restarts += 1
                self._restart(req)  # its output of this pass is discarded
            batch = [r for r in batch if r.request_id not in failed]
        # Loaded pages are snapshotted after the forward: a synchronous load lands inside
        # wait_for_layer_load, and the forward never writes below P + N.
        if cfg.capture_pages:
            for req in batch:
                if not req.forwarded and req.N > 0:
                    self._snapshot(
                        req, req.P, req.P + req.N, self.results[req.request_id].loaded_pages
                    )

        # 5. sampling and bookkeeping
        sampled = self._sample(batch) if batch else {}
        for req in batch:
            self._after_forward(req, it, sampled.get(req.request_id))
        if self.respond is not None and batch:
            self.respond()

        # 6. terminate finished requests (one iteration late under the overlap scheduler)
        for req in list(self._active):
            if req.state == "finishing" and (not cfg.overlap or req.finished_iter < it):
                self._terminate(req)

        # 7. get_finished, every iteration
        if drv is not None:
            fin_save, fin_load = drv.get_finished(self._new_saving, new_loading)
            if self.prefix_reservations:
                self.prefix.reported(drv.get_finished_prefix_loads())
            for rid in sorted(fin_load):
                req = self.requests[rid]
                if req.state == "loading":  # not if it ended while parked (cancelled)
                    req.state = "context"
                elif req.state == "cancelled" and not drv.pending_transfer(rid):
                    self._release(req)
                    self._drop(req)
            failed = drv.take_failed_loads(parked=True)
            for rid in sorted(failed):
                req = self.requests[rid]
                if req.state == "context":  # reported loaded, but not every page landed
                    self.stats.load_restarts += 1
                    self._restart(req)
            for rid in sorted(fin_save):
                req = self.requests[rid]
                self._release(req)
                self._drop(req)
            busy = busy or bool(fin_save or fin_load or failed)
        return busy

    # ----- helpers --------------------------------------------------------------------
    def _extend_hashes(self, req: Request, ntokens: int) -> list[bytes]:
        tpb = self.config.tokens_per_block
        nb = min(ntokens, len(req.tokens)) // tpb
        if len(req.hashes) < nb:
            req.hashes = block_hashes(
                req.tokens[: nb * tpb], tpb, req.cache_salt, req.adapter, req.hashes
            )
        return req.hashes

    def _first_allocation(self, req: Request, new_loading: list[int], budget: int) -> bool:
        cfg, drv = self.config, self.driver
        hashes = self._extend_hashes(req, req.prompt_len)
        P = self.kv.match_prefix(hashes, req.prompt_len)
        N, is_async = 0, False
        reservation: int | None = None
        if drv is not None and self.prefix_reservations:
            got = self.prefix.reserve(req, P)
            if isinstance(got, str):  # an invalid answer: the request fails, naming it
                self._fail(req, got)
                return False
            N, is_async, reservation = got
        elif drv is not None:
            N, is_async = drv.query(req, P)
            if N == 0 and is_async:
                self._fail(req, "load_kv_async must be False when num_tokens is 0!")
                return False
            if N < 0 or P + N >= req.prompt_len:
                self._fail(
                    req,
                    f"There must be at least one uncomputed token in the prompt! "
                    f"(device-matched {P} + connector-matched {N} >= prompt length "
                    f"{req.prompt_len})",
                )
                return False
        req.queried = True
        if drv is not None and reservation is None:
            offered, N = N, scheduling.honoured(cfg, N)
            drv.commit(req, P, offered, N)
        req.P, req.N = P, N
        req.external_load = N
        req.py_num_connector_matched_tokens = req.num_connector_matched_tokens = N
        req.context_current_position = P + N
        req.context_chunk_size = scheduling.chunk(cfg, req, budget)
        res = self.results[req.request_id]
        res.device_matched_tokens, res.connector_matched_tokens = P, N
        self.stats.device_matched_tokens += P
        self.stats.connector_matched_tokens += N
        upto = req.prompt_len if cfg.kv_manager == "v1" else P + N + req.context_chunk_size
        self.kv.extend(req.pages, upto, P + N, hashes, P // cfg.tokens_per_block)
        if drv is not None:
            drv.after_alloc(req)
            if reservation is not None:
                self.prefix.accept(req, P, N, is_async, reservation)
            elif is_async:
                req.state = "loading"
                new_loading.append(req.request_id)
        return True

    def _report(self, req: Request, it: int) -> Any:
        cfg = self.config
        lag = 1 if cfg.overlap and req.sampled_iter == it - 1 else 0
        v1 = cfg.kv_manager == "v1"
        hashes = self._extend_hashes(req, len(req.tokens) - lag) if v1 else []
        return report(req, cfg.kv_manager, self.features.grouped, lag, hashes)

    def _span(self, req: Request) -> tuple[int, int]:
        if req.state == "generation":
            return len(req.tokens) - 1, 1
        return req.context_current_position, req.context_chunk_size

    def _forward(self, batch: list[Request]) -> bool:
        """One forward over ``batch`` (context chunks, then generation tokens): per layer
        ``wait_for_layer_load``, the layer over every request's rows, ``save_kv_layer``;
        then the forward-pass callable and ``wait_for_save``. Leaves the final hidden
        rows for sampling (``_sample``); False when the batch failed."""
        drv, model = self.driver, self.model
        stream = drv.stream if drv is not None else None
        spans = {r.request_id: self._span(r) for r in batch}
        try:
            plan = model.plan([(r, *spans[r.request_id]) for r in batch], self.kv)
            x = model.embed_batch(plan)
            layer = model.layer_runner(plan, x, model.rope_tables(plan), self.kv)
            for i in range(self.config.num_layers):
                if drv is not None:
                    drv.each_worker("wait_for_layer_load", i, stream)
                x = layer(i, x)
                if drv is not None:
                    drv.each_worker("save_kv_layer", i, stream)
            if drv is not None:
                drv.forward_callables()
                drv.each_worker("wait_for_save", stream)
        except RankDivergenceError as e:  # the ranks would hang: the engine is dead
            raise e.with_requests([r.request_id for r in batch]) from e
        except Exception as e:  # _handle_errors(requests=None): fail every active request
            msg = f"{type(e).__name__}: {e}"
            if any(p in msg.lower() for p in IMMEDIATE_FATAL_PATTERNS):
                raise  # newer executors stop on these (error_classification.py)
            self.stats.forward_errors += 1
            ended = ("saving", "draining", "cancelled", "done")
            for r in [r for r in self._active if r.state not in ended]:
                if not self.results[r.request_id].finished:
                    self._fail(r, msg)
            if (
                self.config.error_budget is not None
                and self.stats.forward_errors > self.config.error_budget
            ):
                raise RuntimeError(
                    f"the executor's error budget ({self.config.error_budget}) is spent: "
                    f"shutting down after: {msg}"
                ) from e
            return False
        self._hidden = (x, {r.request_id: plan.last_row(i) for i, r in enumerate(batch)})
        self._spans = spans
        return True

    def _sample(self, batch: list[Request]) -> dict[int, int]:
        """Greedy tokens of the requests of ``batch`` that sample this iteration (generation,
        or a prompt's last chunk), in one batched call."""
        x, last = self._hidden
        samplers = [
            r.request_id
            for r in batch
            if r.state == "generation" or sum(self._spans[r.request_id]) >= r.prompt_len
        ]
        tokens = self.model.sample(x, [last[rid] for rid in samplers])
        self._hidden = None
        return dict(zip(samplers, tokens, strict=True))

    def _after_forward(self, req: Request, it: int, tok: int | None) -> None:
        cfg, tpb = self.config, self.config.tokens_per_block
        s, n = self._spans[req.request_id]
        req.forwarded = True
        end = s + n
        self.stats.computed_tokens += n
        if cfg.capture_pages:
            self._snapshot(req, s, end, self.results[req.request_id].computed_pages, complete=True)
        sample = False
        if req.state == "context":
            req.context_current_position = end
            if end >= req.prompt_len:
                req.state = "generation"
                sample = True
        else:
            sample = True
        if sample:
            assert tok is not None
            req.tokens.append(tok)
            req.generated.append(tok)
            req.sampled_iter = it
            self.results[req.request_id].tokens.append(tok)
        hashes = self._extend_hashes(req, end)
        self.kv.register(req.pages, hashes, s // tpb, end // tpb)
        self.kv.reclaim(req.pages, end)
        if len(req.generated) >= req.max_new_tokens:
            req.state = "finishing"
            req.finished_iter = it
            self.results[req.request_id].finished = True

    def _snapshot(
        self,
        req: Request,
        lo: int,
        hi: int,
        into: dict[tuple[int, int], bytes],
        complete: bool = False,
    ) -> None:
        into.update(self.kv.snapshot(req.pages, lo, hi, complete))

    def _terminate(self, req: Request) -> None:
        self.stats.requests_finished += 1
        if self.prefix.defer_end(req):
            return
        self._hand_back(req, tolerant=False)

    def _hand_back(self, req: Request, tolerant: bool | None = None) -> None:
        """``request_finished`` (a failed request's errors there are swallowed:
        ``tolerant``, by default whether it failed), then free its pages unless the
        connector keeps them for a save."""
        if tolerant is None:
            tolerant = self.results[req.request_id].error is not None
        if tolerant:
            self._finish_failed(req)
            return
        keep = False
        drv = self.driver
        if drv is not None:
            keep = drv.finish(req)
        if keep:
            req.state = "saving"
            self._new_saving.append(req.request_id)
        else:
            self._release(req)
            self._drop(req)

    def _restart(self, req: Request) -> None:
        """Drop the allocation (none of it registered for reuse: pages may hold what never
        landed), let the connector forget the request (``forget_request`` /
        ``reset_request_state``), and admit it again from scratch, asked again: a load the
        connector reported failed (``_recover_failed_connector_loads``) or a replay."""
        self.kv.free(req.pages)
        groups = len(req.pages)
        req.pages = [[] for _ in range(groups)]
        req.tokens = req.tokens[: req.prompt_len]
        req.generated = []
        req.hashes = []
        req.queried = req.forwarded = req.reported = False
        req.rep_tokens, req.rep_pages = 0, [0] * groups
        req.P = req.N = 0
        req.external_load = None
        req.context_current_position = 0
        req.state = "waiting"
        res = self.results[req.request_id]
        res.tokens, res.loaded_pages, res.computed_pages = [], {}, {}
        if req in self._active:
            self._active.remove(req)
        self._waiting.appendleft(req)
        if self.driver is not None:
            self.driver.reset(req)

    def _int_hashes(self, req: Request) -> list[int]:
        """V1 block hashes of the request's full blocks, as ints (``block_hashes``)."""
        return [int.from_bytes(h[:8], "big") for h in self._extend_hashes(req, len(req.tokens))]

    def _fail(self, req: Request, msg: str) -> None:
        res = self.results[req.request_id]
        res.error, res.finished = msg, True
        self.stats.requests_failed += 1
        if self.prefix.defer_end(req):
            return
        self._finish_failed(req)

    def _finish_failed(self, req: Request) -> None:
        keep = False
        if self.driver is not None and req.queried:
            try:
                keep = self.driver.finish(req)
            except RankDivergenceError:  # the ranks parted ways (MPI mode): fatal
                raise
            except Exception:
                keep = False
        if keep:
            req.state = "saving"
            self._new_saving.append(req.request_id)
            return
        self._release(req)
        self._drop(req)

    def _release(self, req: Request) -> None:
        """Free a request's pages. V1 with block reuse first stores every full block of its
        tokens but the last for reuse, as TensorRT-LLM's ``releaseBlocks`` does (it counts
        the request's tokens, not what it computed): a request that failed mid-prefill
        publishes pages it never filled, where a later request will find them."""
        cfg, tpb = self.config, self.config.tokens_per_block
        if cfg.kv_manager == "v1" and cfg.store_blocks_on_release and any(req.pages):
            n = (len(req.tokens) - 1) // tpb
            self.kv.register(req.pages, self._extend_hashes(req, n * tpb), 0, n)
        self.kv.free(req.pages)

    def _drop(self, req: Request) -> None:
        req.state = "done"
        if req in self._active:
            self._active.remove(req)
