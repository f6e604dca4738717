"""Connector bring-up and the manager-side bookkeeping of TensorRT-LLM's
``KvCacheConnectorManager`` (contract §7.1, §7.5, §7.8), for ``tp`` simulated ranks.

Every call into the connector goes through ``Driver`` so ``stats`` counts it: scheduler
calls once (rank 0 only), worker calls once per rank (counts are rank 0's).
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
        for r, w in enumerate(self.workers):
            self._count(name, rank0=r == 0)
            getattr(w, name)(*args)

    def forward_callables(self) -> None:
        if self.callables and self.callables[0] is not None:
            self.calls["forward_pass_callable"] += 1
        for c in self.callables:
            if c is not None:
                c()

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
