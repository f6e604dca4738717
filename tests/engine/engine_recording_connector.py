"""A recording, scriptable connector for the reference-engine tests (imported by name).

Tests reset ``REC`` and set ``CONTROL`` before building an ``Engine``:

* ``match``: ``(N, is_async)`` or ``callable(request, P) -> (N, is_async)``;
* ``keep``: what ``request_finished`` returns;
* ``fail``: method name whose worker call raises ``RuntimeError("boom in <name>")``;
* ``fail_once``: same, but only the first time;
* ``fail_ranks``: with ``fail``, only these ranks' workers raise (default: every rank);
* ``finish``: ``callable(rank, handed_saving, handed_loading, worker) -> (saving, loading)``
  deciding what ``get_finished`` returns (default: everything handed in, at once).
"""

from __future__ import annotations

import copy
from typing import Any

from disagg.engine import KvCacheConnectorScheduler, KvCacheConnectorWorker
from disagg.engine.runtime import runtime_rank

REC: dict[str, list[Any]] = {}
CONTROL: dict[str, Any] = {}


def reset(**control: Any) -> None:
    REC.clear()
    for k in ("calls", "outputs", "allocs", "finished", "gf", "layout", "tensor", "metas"):
        REC[k] = []
    CONTROL.clear()
    CONTROL.update(control)


def _log(*item: Any) -> None:
    REC["calls"].append(item)


def _maybe_fail(name: str, rank: int = 0) -> None:
    ranks = CONTROL.get("fail_ranks")
    if CONTROL.get("fail") == name and (ranks is None or rank in ranks):
        raise RuntimeError(f"boom in {name}")
    if CONTROL.get("fail_once") == name:
        CONTROL.pop("fail_once")
        raise RuntimeError(f"boom in {name}")


class RecScheduler(KvCacheConnectorScheduler):
    """Flat-only."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        _log("query", request.request_id, num_computed_tokens)
        m = CONTROL.get("match", (0, False))
        return m(request, num_computed_tokens) if callable(m) else m

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        _log("alloc", request.request_id)
        REC["allocs"].append(("flat", list(block_ids)))

    def build_connector_meta(self, scheduler_output: Any) -> object:
        _log("build")
        REC["outputs"].append(copy.deepcopy(scheduler_output))
        return {"iteration": len(REC["outputs"])}

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        _log("finished", request.request_id)
        REC["finished"].append(("flat", list(cache_block_ids)))
        return bool(CONTROL.get("keep", False))


class RecGroupedScheduler(RecScheduler):
    """Both per-layer-group forms (the flat ones are inherited but must not be called)."""

    def update_state_after_alloc_by_layer_group(
        self, request: Any, block_ids_by_layer_group: list[list[int]]
    ) -> None:
        _log("alloc_grouped", request.request_id)
        REC["allocs"].append(("grouped", [list(x) for x in block_ids_by_layer_group]))

    def request_finished_by_layer_group(
        self, request: Any, cache_block_ids_by_layer_group: list[list[int]]
    ) -> bool:
        _log("finished_grouped", request.request_id)
        REC["finished"].append(("grouped", [list(x) for x in cache_block_ids_by_layer_group]))
        return bool(CONTROL.get("keep", False))


class RecWorker(KvCacheConnectorWorker):
    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self.rank = runtime_rank()
        self.handed_saving: list[int] = []
        self.handed_loading: list[int] = []

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        REC["tensor"].append((self.rank, kv_cache_tensor))

    def bind_connector_meta(self, metadata: object) -> None:
        REC["metas"].append((self.rank, metadata))
        super().bind_connector_meta(metadata)

    def start_load_kv(self, stream: Any) -> None:
        _log("start_load_kv", self.rank)
        _maybe_fail("start_load_kv", self.rank)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        _log("wait_for_layer_load", self.rank, layer_idx)
        _maybe_fail("wait_for_layer_load", self.rank)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        _log("save_kv_layer", self.rank, layer_idx)
        _maybe_fail("save_kv_layer", self.rank)

    def wait_for_save(self, stream: Any) -> None:
        _log("wait_for_save", self.rank)
        _maybe_fail("wait_for_save", self.rank)

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        REC["gf"].append((self.rank, list(finished_gen_req_ids), list(started_loading_req_ids)))
        self.handed_saving += finished_gen_req_ids
        self.handed_loading += started_loading_req_ids
        policy = CONTROL.get("finish")
        if policy is not None:
            return policy(self.rank, self.handed_saving, self.handed_loading, self)
        s, lo = self.handed_saving, self.handed_loading
        self.handed_saving, self.handed_loading = [], []
        return s, lo


class RecLayoutWorker(RecWorker):
    def register_kv_cache_layout(self, layout: Any) -> None:
        REC["layout"].append((self.rank, layout))
