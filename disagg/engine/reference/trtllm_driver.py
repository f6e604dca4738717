"""The reference engine driving a connector through TensorRT-LLM's own manager.

``EngineConfig.connector_manager="trtllm"``: instead of our bookkeeping (``Driver``), every
connector call goes through the loaded TensorRT-LLM line's ``KvCacheConnectorManager``
(an installed ``tensorrt_llm``, or a source tree via ``DISAGG_TRTLLM_SRC``), in the order
``py_executor.py`` calls it:

- query: V1 ``get_num_new_matched_tokens(cpp_request, P)`` (query and commit fused, as C++
  ``addSequence`` calls it, with the C++-bound request); V2 ``query_num_new_matched_tokens``
  then ``commit_new_matched_tokens(request, honoured, is_async)`` and, on the line that has
  it, ``cancel_load`` for the part not honoured;
- ``update_state_after_alloc(request, flat[, by_layer_group])`` in the line's signature;
- per iteration: ``build_scheduler_output(ScheduledRequests, cache)`` (the manager builds
  the deltas from the request and the cache, ``cache`` answering ``get_cache_indices`` /
  ``commit_and_get_block_hashes`` or ``get_page_indices_by_layer_group``), then
  ``take_scheduled_requests_pending_load``, ``handle_metadata`` and ``start_load_kv``;
- ``request_finished``, ``get_finished`` (finished loads read off the manager),
  ``has_pending_transfers``, ``take_failed_*load_requests``, ``forget_request``.

TP ranks are threads of this process (``trtllm_src.RankWorld``): each rank's manager
makes its collective calls (``mpi_broadcast``/``mpi_allgather``) concurrently with the
others', and ``mpi_rank()`` answers the calling thread's rank. Forward hooks are called
on the workers directly (what the manager's layer hooks do). Prefix reservations and the
MPI mode are not driven this way.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import TRTLLM_SOURCE, USING_TRTLLM
from ..runtime import set_rank
from ..trtllm_src import LlmRequestState, RankWorld, set_world
from .connector_driver import Driver, RankDivergenceError

_PYEXEC = "tensorrt_llm._torch.pyexecutor"
_STATES = {
    "waiting": "CONTEXT_INIT",
    "context": "CONTEXT_INIT",
    "loading": "DISAGG_GENERATION_TRANS_IN_PROGRESS",
    "generation": "GENERATION_IN_PROGRESS",
    "finishing": "GENERATION_COMPLETE",
    "saving": "DISAGG_CONTEXT_TRANS_IN_PROGRESS",
}


class TrtRequest:
    """The Python ``LlmRequest`` the manager holds: the engine's request, its state in
    TensorRT-LLM's enum (the manager's own state writes are ignored: the engine makes the
    same transitions itself), and its tokens as the overlap scheduler shows them (the last
    sampled token not yet appended)."""

    def __init__(self, req: Any):
        object.__setattr__(self, "_req", req)
        object.__setattr__(self, "lag", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "lag":
            object.__setattr__(self, name, value)
        elif name != "state":
            setattr(self._req, name, value)

    @property
    def state(self) -> Any:
        name = _STATES.get(self._req.state, "GENERATION_COMPLETE")
        enum = _state_enum()
        return getattr(enum, name)

    def get_tokens(self, beam: int = 0) -> list[int]:
        toks = self._req.get_tokens(beam)
        return toks[: len(toks) - self.lag] if self.lag else toks


def _state_enum() -> Any:
    try:
        from tensorrt_llm.bindings import LlmRequestState as real  # type: ignore

        return real
    except Exception:
        return LlmRequestState


class _Cache:
    """What ``update_and_build_data`` asks of the KV cache manager."""

    def __init__(self, hashes: Callable[[Any], list[int]], by_dict: bool = False):
        self._hashes = hashes
        self._by_dict = by_dict  # the line keys layer groups by id

    def get_cache_indices(self, req: Any) -> list[int]:
        return list(req.pages[0])

    def commit_and_get_block_hashes(self, req: Any) -> list[int]:
        return self._hashes(req)

    def get_priority_by_block_id(self, block_id: int) -> int:
        return 35  # TensorRT-LLM's default retention priority

    def get_page_indices_by_layer_group(self, req: Any) -> Any:
        pages = [list(p) for p in req.pages]
        return dict(enumerate(pages)) if self._by_dict else pages


def _v2_cache_class() -> type:
    for name in (f"{_PYEXEC}.kv_cache.kv_cache_manager_v2", f"{_PYEXEC}.kv_cache_manager_v2"):
        try:
            base = importlib.import_module(name).KVCacheManagerV2
        except Exception:
            continue
        return type("ReferenceKVCacheManagerV2", (_Cache, base), {"__init__": _Cache.__init__})
    return _Cache


class TrtllmDriver(Driver):
    """``Driver`` over TensorRT-LLM's ``KvCacheConnectorManager`` (module docstring)."""

    builds_scheduler_output = True

    def __init__(self, *args: Any, hashes: Callable[[Any], list[int]], **kwargs: Any):
        cfg = args[0]
        if not USING_TRTLLM:
            raise ValueError(
                "EngineConfig.connector_manager='trtllm' needs TensorRT-LLM's connector "
                "package: install tensorrt_llm or set DISAGG_TRTLLM_SRC to a source tree"
            )
        if kwargs.get("comm") is not None or (len(args) > 5 and args[5] is not None):
            raise ValueError("connector_manager='trtllm' drives ranks as threads, not MPI")
        if cfg.prefix_aware_scheduling:
            raise ValueError("connector_manager='trtllm' does not drive prefix reservations")
        set_world(RankWorld(cfg.tp))
        self._threads = ThreadPoolExecutor(max_workers=cfg.tp, thread_name_prefix="rank")
        super().__init__(*args, **kwargs)
        conn = importlib.import_module(TRTLLM_SOURCE)
        self.mgrs: list[Any] = self._all(
            lambda r: conn.KvCacheConnectorManager(
                self.workers[r], self.scheduler if r == 0 else None
            ),
            "KvCacheConnectorManager()",
        )
        cache_cls = _v2_cache_class() if self.cfg.kv_manager == "v2" else _Cache
        self.cache = cache_cls(hashes, self.features.grouped == "dict")
        self._views: dict[int, TrtRequest] = {}
        self._async: dict[int, bool] = {}
        self._parked: set[int] = set()  # answered async, not yet reported loaded
        self._alloc_params = len(
            inspect.signature(self.mgrs[0].update_state_after_alloc).parameters
        )
        self._finish_params = len(inspect.signature(self.mgrs[0].request_finished).parameters)

    # ----- ranks as threads ------------------------------------------------------------
    def _all(self, fn: Callable[[int], Any], where: str) -> list[Any]:
        """``fn(rank)`` on every rank's thread at once (collectives meet); all ranks
        raising raises rank 0's error, some but not all is a ``RankDivergenceError``."""

        def run(r: int) -> Any:
            set_rank(r)
            return fn(r)

        futs = [self._threads.submit(run, r) for r in range(len(self.workers))]
        out: list[Any] = []
        raised: dict[int, BaseException] = {}
        for r, f in enumerate(futs):
            try:
                out.append(f.result())
            except Exception as exc:
                out.append(None)
                raised[r] = exc
        if raised and len(raised) == len(futs):
            raise raised[0]
        if raised:
            raise RankDivergenceError(
                where, raised, [r for r in range(len(futs)) if r not in raised]
            )
        return out

    def view(self, req: Any) -> TrtRequest:
        v = self._views.get(req.request_id)
        if v is None or v._req is not req:
            v = self._views[req.request_id] = TrtRequest(req)
        return v

    # ----- the calls -------------------------------------------------------------------
    def query(self, req: Any, num_computed: int) -> tuple[int, bool]:
        self.calls["get_num_new_matched_tokens"] += 1
        rid = req.request_id
        if self.cfg.kv_manager == "v1":
            cpp = req.cpp_view()
            got = self._all(
                lambda r: self.mgrs[r].get_num_new_matched_tokens(cpp, num_computed),
                "get_num_new_matched_tokens",
            )
            n = int(got[0])
            is_async = rid in self.mgrs[0].new_async_requests.loading
            if is_async:  # the manager holds the canonical (Python) request from here
                for m in self.mgrs:
                    m.new_async_requests.loading[rid] = self.view(req)
        else:
            n, is_async = self._all(
                lambda r: self.mgrs[r].query_num_new_matched_tokens(self.view(req), num_computed),
                "query_num_new_matched_tokens",
            )[0]
        self._async[rid] = bool(is_async)
        if is_async:
            self._parked.add(rid)
        return int(n), bool(is_async)

    def commit(self, req: Any, start: int, offered: int, honoured: int) -> None:
        req.py_num_connector_matched_tokens = req.num_connector_matched_tokens = honoured
        if self.cfg.kv_manager == "v1":
            return  # committed inside the query, as C++ does
        v, is_async = self.view(req), self._async.get(req.request_id, False)
        for m in self.mgrs:
            m.commit_new_matched_tokens(v, honoured, is_async)
        if honoured < offered and hasattr(self.mgrs[0], "cancel_load"):
            self.calls["cancel_load"] += 1
            for m in self.mgrs:
                m.cancel_load(v, start + honoured, start + offered)

    def after_alloc(self, req: Any) -> None:
        pages = [list(p) for p in req.pages]
        v = self.view(req)
        flat = pages[0] if len(pages) == 1 else []
        by_group: Any = None
        if self.cfg.kv_manager == "v2":
            by_group = dict(enumerate(pages)) if self.features.grouped == "dict" else pages
        self.calls["update_state_after_alloc"] += 1
        for m in self.mgrs:
            if self._alloc_params >= 3 and by_group is not None:
                m.update_state_after_alloc(v, flat, by_group)
            else:
                m.update_state_after_alloc(v, flat)

    def start_batch(self, ctx: list[Any], gen: list[Any], lags: dict[int, int]) -> None:
        """Scheduler output, parking, metadata and ``start_load_kv`` of one iteration."""
        ctx_v = [self.view(r) for r in ctx]
        gen_v = [self.view(r) for r in gen]
        for v in gen_v:
            v.lag = lags.get(v.request_id, 0)
        for v in ctx_v:
            v.lag = 0
        sched_cls = importlib.import_module(f"{_PYEXEC}.scheduler").ScheduledRequests
        for m in self.mgrs:
            sr = sched_cls()
            sr.context_requests_last_chunk = list(ctx_v)
            sr.generation_requests = list(gen_v)
            m.build_scheduler_output(sr, self.cache)
            m.take_scheduled_requests_pending_load(sr)
        self.calls["build_connector_meta"] += 1
        self._all(lambda r: self.mgrs[r].handle_metadata(), "handle_metadata")
        for r, w in enumerate(self.workers):
            self._count("start_load_kv", rank0=r == 0)
            w.start_load_kv(self.stream)

    def finish(self, req: Any) -> bool:
        pages = [list(p) for p in req.pages]
        flat = pages[0] if len(pages) == 1 else []
        v = self.view(req)
        by_group = (
            pages if self.cfg.kv_manager == "v2" and self.features.grouped == "list" else None
        )
        self.calls["request_finished"] += 1
        if self._finish_params >= 3 and by_group is not None:
            got = self._all(
                lambda r: self.mgrs[r].request_finished(v, flat, by_group), "request_finished"
            )
        else:
            got = self._all(lambda r: self.mgrs[r].request_finished(v, flat), "request_finished")
        return bool(got[0])

    def reset(self, req: Any) -> None:
        v = self.view(req)
        for m in self.mgrs:
            if hasattr(m, "forget_request"):
                m.forget_request(v)
            elif hasattr(m, "reset_request_state"):
                m.reset_request_state(v)

    def pending_transfer(self, request_id: int) -> bool:
        m = self.mgrs[0]
        return bool(hasattr(m, "has_pending_transfers") and m.has_pending_transfers(request_id))

    def take_failed_loads(self, parked: bool) -> set[int]:
        name = "take_failed_async_load_requests" if parked else "take_failed_load_requests"
        out: set[int] = set()
        for m in self.mgrs:
            if hasattr(m, name):
                out |= {int(i) for i in getattr(m, name)()}
        return out

    def get_finished(self, saving: list[int], loading: list[int]) -> tuple[set[int], set[int]]:
        self.calls["get_finished"] += 1
        got = self._all(lambda r: self.mgrs[r].get_finished(), "get_finished")
        fin_save = {int(r.request_id) for r in got[0]}
        # a load is over once every rank reported it: the manager then holds the request in
        # finished_async_loading_requests and no longer in its pending sets (a replayed
        # request may already be there from its first load: not a membership diff)
        m = self.mgrs[0]
        fin_load = {
            rid
            for rid in self._parked
            if rid in m.finished_async_loading_requests and not self.pending_transfer(rid)
        }
        self._parked -= fin_load
        return fin_save, fin_load

    def close(self) -> None:
        self._threads.shutdown(wait=False)
