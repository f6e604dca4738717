"""Connector bring-up and the manager-side bookkeeping of TensorRT-LLM's
``KvCacheConnectorManager`` (contract §7.1, §7.5, §7.8), for ``tp`` simulated ranks.

Every call into the connector goes through ``Driver`` so ``stats`` counts it: scheduler
calls once (rank 0 only), worker calls once per rank (counts are rank 0's).

Ranks in one process, faithfully (contract §7.7, §7.8). In TensorRT-LLM each TP rank is its
own MPI process: an exception in a forward hook (``wait_for_layer_load``, ``save_kv_layer``,
the forward-pass callable, ``wait_for_save``) is caught by *that rank's* ``_forward_step``
and ``_handle_errors`` fails *that rank's* batch; a rank whose hook did not raise goes on
into the layer's collectives (all-reduce) and waits there forever for the rank that left.
So ``each_worker`` calls every rank's hook and compares: all ranks raised (the batch fails
everywhere, with rank 0's message: rank 0 answers the client) or none did are both
consistent; some but not all is ``RankDivergenceError``, fatal, standing in for the hang
(unless a raising rank's error is fatal by TensorRT-LLM's classification anyway: that rank's
executor stops and the job with it, and that error is raised).
"""

from __future__ import annotations

import importlib
import pickle
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .. import KvCacheConnectorScheduler
from .._contract import reject_flat_only_scheduler
from .config import ConnectorSpec, EngineConfig, LlmArgs, llm_args_for_rank
from .kv_cache import KvCacheManager

# TensorRT-LLM's error classification (error_classification.py): an error whose message
# holds one of these stops the executor instead of failing the batch.
IMMEDIATE_FATAL_PATTERNS = (
    "cudaerrorillegaladdress",
    "cudaerrorlaunchfailure",
    "illegal memory access",
    "device-side assert",
    "unrecoverable",
)


def is_fatal(exc: BaseException) -> bool:
    """Would TensorRT-LLM stop the executor on ``exc`` (rather than fail the batch)?"""
    msg = f"{type(exc).__name__}: {exc}".lower()
    return any(p in msg for p in IMMEDIATE_FATAL_PATTERNS)


class RankDivergenceError(RuntimeError):
    """TP ranks disagreed in one forward pass: some ranks' connector hooks raised (their
    batch fails) and others' did not (they run the layer). In a real multi-process TP
    engine the ranks that went on block forever in the layer's all-reduce: a hang. The
    reference engine raises this instead; it is fatal (the engine is dead afterwards).

    ``hook``: where (e.g. ``wait_for_layer_load(layer 0)``); ``raised``: rank -> its error;
    ``clean``: ranks that did not raise; ``request_ids``: the batch (set by the executor)."""

    def __init__(
        self,
        hook: str,
        raised: dict[int, BaseException],
        clean: list[int],
        request_ids: list[int] | None = None,
    ):
        self.hook, self.raised, self.clean = hook, raised, clean
        self.request_ids = list(request_ids or [])
        errs = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(raised.items()))
        reqs = f" for request(s) {self.request_ids}" if self.request_ids else ""
        super().__init__(
            f"TP ranks diverged in {hook}{reqs}: rank(s) {sorted(raised)} raised and fail "
            f"the batch, rank(s) {clean} did not and would wait forever in the layer's "
            f"collectives (a hang in a real multi-process engine) -- {errs}"
        )

    def with_requests(self, request_ids: list[int]) -> RankDivergenceError:
        return RankDivergenceError(self.hook, self.raised, self.clean, request_ids)


class CpuStream:
    """Stands in for ``torch.cuda.current_stream()`` on CPU (all work is synchronous)."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event

    def __repr__(self) -> str:
        return "CpuStream()"


def current_stream(device: str) -> Any:
    return torch.cuda.current_stream() if device.startswith("cuda") else CpuStream()


class Driver:
    """Owns the scheduler (rank 0) and one worker per rank."""

    def __init__(
        self,
        cfg: EngineConfig,
        spec: ConnectorSpec,
        llm_args: LlmArgs,
        kv: KvCacheManager,
        calls: Counter[str],
    ):
        self.cfg, self.spec, self.kv, self.calls = cfg, spec, kv, calls
        self.stream = current_stream(cfg.device)
        module = importlib.import_module(spec.module)
        sched_cls = getattr(module, spec.scheduler_class)
        worker_cls = getattr(module, spec.worker_class)
        # Construct concurrently (a worker and its scheduler may rendezvous in __init__);
        # scheduler on rank 0 only. Any exception aborts bring-up.
        with ThreadPoolExecutor(max_workers=2) as pool:
            sched_f = pool.submit(sched_cls, llm_args_for_rank(llm_args, 0))
            worker_fs = [
                pool.submit(worker_cls, llm_args_for_rank(llm_args, r)) for r in range(cfg.tp)
            ]
            self.workers = [f.result() for f in worker_fs]
            self.scheduler = sched_f.result()
        self.callables: list[Callable[..., Any] | None] = []
        for w in self.workers:
            self._count("register_forward_pass_callable", rank0=w is self.workers[0])
            self.callables.append(w.register_forward_pass_callable() or None)
        self.n_groups = len(kv.groups)
        # Bring-up checks, then registration, then wait_for_initialization (§7.1, §9).
        if not cfg.enable_block_reuse:
            raise NotImplementedError("a KV connector requires enable_block_reuse=True")
        if cfg.kv_manager == "v1":
            if self.n_groups > 1:
                raise NotImplementedError(
                    f"VSWA ({self.n_groups} attention windows) is not supported with a KV "
                    "connector on the V1 KV cache manager; use kv_manager='v2'"
                )
            for r, w in enumerate(self.workers):
                self._count("register_kv_caches", rank0=r == 0)
                w.register_kv_caches(kv.v1_tensor(r))
        else:
            reject_flat_only_scheduler(self.scheduler, self.n_groups, KvCacheConnectorScheduler)
            for r, w in enumerate(self.workers):
                self._count("register_kv_cache_layout", rank0=r == 0)
                w.register_kv_cache_layout(kv.layout(r))
        self._count("wait_for_initialization")
        self.scheduler.wait_for_initialization()
        # get_finished bookkeeping, per rank (§7.5).
        # ids handed in and not yet returned, per rank; saving and loading apart, as the
        # manager keeps them in two dicts (a request parked on a load that ends while the
        # load lands is in both)
        self.pending_saving: list[set[int]] = [set() for _ in range(cfg.tp)]
        self.pending_loading: list[set[int]] = [set() for _ in range(cfg.tp)]
        self.local_saving: list[set[int]] = [set() for _ in range(cfg.tp)]
        self.local_loading: list[set[int]] = [set() for _ in range(cfg.tp)]

    def _count(self, name: str, rank0: bool = True) -> None:
        if rank0:
            self.calls[name] += 1

    # ----- leader calls (the answer would be broadcast) -------------------------------
    def sched(self, name: str, *args: Any) -> Any:
        self._count(name)
        return getattr(self.scheduler, name)(*args)

    # ----- per-iteration worker calls ---------------------------------------------------
    def bind_and_start(self, meta: object) -> None:
        """Pickle round-trip of the leader's metadata to every rank, bind, start_load_kv.
        Exceptions propagate (fatal for the executor)."""
        blob = pickle.dumps(meta)
        for r, w in enumerate(self.workers):
            self._count("bind_connector_meta", rank0=r == 0)
            w.bind_connector_meta(pickle.loads(blob))
        for r, w in enumerate(self.workers):
            self._count("start_load_kv", rank0=r == 0)
            w.start_load_kv(self.stream)

    def each_worker(self, name: str, *args: Any) -> None:
        """A forward hook on every rank (see the module docstring): every rank's hook runs
        (each rank is its own process, its own ``try``); then all ranks raised (rank 0's
        error is raised), none did, or ``RankDivergenceError``."""
        raised: dict[int, BaseException] = {}
        for r, w in enumerate(self.workers):
            self._count(name, rank0=r == 0)
            try:
                getattr(w, name)(*args)
            except Exception as exc:
                raised[r] = exc
        where = f"{name}(layer {args[0]})" if name != "wait_for_save" else name
        self._agree(where, raised)

    def forward_callables(self) -> None:
        if self.callables and self.callables[0] is not None:
            self.calls["forward_pass_callable"] += 1
        raised: dict[int, BaseException] = {}
        for r, c in enumerate(self.callables):
            if c is not None:
                try:
                    c()
                except Exception as exc:
                    raised[r] = exc
        self._agree("the forward-pass callable", raised)

    def _agree(self, where: str, raised: dict[int, BaseException]) -> None:
        if not raised:
            return
        if len(raised) == len(self.workers):
            raise raised[0]  # every rank fails the batch; rank 0 answers the client
        fatal = [e for e in raised.values() if is_fatal(e)]
        if fatal:  # that rank's executor stops, and the MPI job with it
            raise fatal[0]
        clean = [r for r in range(len(self.workers)) if r not in raised]
        raise RankDivergenceError(where, raised, clean)

    def get_finished(self, saving: list[int], loading: list[int]) -> tuple[set[int], set[int]]:
        """Hand each id in once per rank; return the ids every rank has reported
        ``(finished_saving, finished_loading)``. An id never handed in (or returned twice)
        raises ``KeyError``, as the manager's direct dict indexing does."""
        for r, w in enumerate(self.workers):
            self.pending_saving[r].update(saving)
            self.pending_loading[r].update(loading)
            self._count("get_finished", rank0=r == 0)
            done_save, done_load = w.get_finished(list(saving), list(loading))
            for ids, local, pending, what in (
                (done_save, self.local_saving[r], self.pending_saving[r], "saving"),
                (done_load, self.local_loading[r], self.pending_loading[r], "loading"),
            ):
                for rid in ids:
                    if rid not in pending:
                        raise KeyError(
                            f"rank {r} connector worker get_finished returned request id {rid!r} "
                            f"as finished {what}, which is not outstanding (never handed in, "
                            "or already returned)"
                        )
                    pending.discard(rid)
                    local.add(rid)
        fin_save = set.intersection(*self.local_saving)
        fin_load = set.intersection(*self.local_loading)
        for r in range(self.cfg.tp):
            self.local_saving[r] -= fin_save
            self.local_loading[r] -= fin_load
        return fin_save, fin_load
