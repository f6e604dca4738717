"""A scripted connector taking prefix reservations, for the reference-engine tests
(imported by name). ``CONTROL``: ``answer`` (what ``reserve_prefix`` returns, or a
callable ``(req, P) -> answer``), ``hold`` (the worker withholds completions while true),
``hold_ranks`` (those TP ranks' workers withhold theirs), ``extra_ids`` (returned
besides real completions: stale/unknown/duplicate)."""

from __future__ import annotations

from typing import Any

from disagg.engine import KvCacheConnectorScheduler, KvCacheConnectorWorker
from disagg.engine.runtime import runtime_rank

CALLS: list[tuple[Any, ...]] = []
CONTROL: dict[str, Any] = {}


def reset(**control: Any) -> None:
    CALLS.clear()
    CONTROL.clear()
    CONTROL.update(control)


class PrefixScheduler(KvCacheConnectorScheduler):
    def reserve_prefix(self, request: Any, num_computed_tokens: int, reservation_id: int) -> Any:
        CALLS.append(("reserve", request.request_id, num_computed_tokens, reservation_id))
        a = CONTROL.get("answer", (0, False))
        return a(request, num_computed_tokens) if callable(a) else a

    def release_prefix_reservation(
        self, request: Any, reservation_id: int, start: int, end: int
    ) -> None:
        CALLS.append(("release", reservation_id, start, end))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        CALLS.append(("query", request.request_id))
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        CALLS.append(("alloc", request.request_id))

    def build_connector_meta(self, scheduler_output: Any) -> object:
        loads = list(scheduler_output.prefix_loads)
        CALLS.append(("meta", [(p.reservation_id, p.start, p.end, p.is_async) for p in loads]))
        return loads

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        CALLS.append(("finished", request.request_id))
        return False


class PrefixWorker(KvCacheConnectorWorker):
    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self.started: list[int] = []
        self.rank = runtime_rank()

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        pass

    def start_load_kv(self, stream: Any) -> None:
        for p in self._metadata or []:
            CALLS.append(("start", p.reservation_id))
            self.started.append(p.reservation_id)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        pass

    def wait_for_save(self, stream: Any) -> None:
        pass

    def get_finished(self, saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        return list(saving), list(loading)

    def get_finished_prefix_loads(self) -> list[int]:
        if CONTROL.get("hold") or self.rank in CONTROL.get("hold_ranks", ()):
            return list(CONTROL.get("extra_ids", []))
        out, self.started = self.started, []
        return out + list(CONTROL.get("extra_ids", []))


class NoWorkerHook(PrefixWorker):
    get_finished_prefix_loads = KvCacheConnectorWorker.get_finished_prefix_loads
