"""Our contract-faithful definitions of TensorRT-LLM's KV cache connector base classes.

Used only when TensorRT-LLM is not importable. Written from TensorRT-LLM's documented
connector API (the worker, the scheduler and the data handed to ``build_connector_meta``),
not from its code: same names, signatures, abstract methods and defaults, including the per-layer-group forms that fold
back to the flat ones, and the stand-in that lets a grouped-only connector instantiate.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .layout import KvCacheLayout

# (flat, grouped) pairs: implementing either one satisfies the pair's abstract method.
_SCHEDULER_PAIRS = (
    ("update_state_after_alloc", "update_state_after_alloc_by_layer_group"),
    ("request_finished", "request_finished_by_layer_group"),
)
_WORKER_PAIRS = (("register_kv_caches", "register_kv_cache_layout"),)


def _flat_stand_in(name: str, grouped: str) -> Callable[..., Any]:
    def stand_in(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} implements only {grouped}(); the engine called the "
            f"flat {name}(), which this connector does not support"
        )

    stand_in.__name__ = name
    stand_in._disagg_stand_in = True  # type: ignore[attr-defined]
    return stand_in


def _satisfy_flat_abstracts(cls: type, base: type, pairs: tuple[tuple[str, str], ...]) -> None:
    """Give a subclass that overrides only the grouped form a flat stand-in, so ABCMeta
    (which computes abstract methods after ``__init_subclass__``) lets it instantiate."""
    for flat, grouped in pairs:
        overrides_grouped = getattr(cls, grouped) is not getattr(base, grouped)
        flat_impl = getattr(cls, flat, None)
        flat_abstract = getattr(flat_impl, "__isabstractmethod__", False)
        if overrides_grouped and flat_abstract:
            setattr(cls, flat, _flat_stand_in(flat, grouped))


def overrides(cls_or_obj: Any, base: type, name: str) -> bool:
    """True if ``name`` is implemented below ``base`` (and is not our flat stand-in)."""
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    impl = getattr(cls, name, None)
    if impl is None or getattr(impl, "_disagg_stand_in", False):
        return False
    return impl is not getattr(base, name, None)


@dataclass
class RequestData:
    """One request's report in a ``SchedulerOutput``: deltas since its previous report.

    ``computed_position``: tokens whose KV is valid before this pass (on the first report
    it excludes the connector-matched tokens). ``num_scheduled_tokens``: what this pass
    computes. ``new_block_ids_by_layer_group``: V2 per-group deltas (``-1`` in place).
    """

    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    priorities: list[int] | None = None
    cache_salt: str | None = None
    new_block_ids_by_layer_group: list[list[int]] = field(default_factory=list)


@dataclass
class PrefixLoad:
    """One load a reservation was accepted for (TensorRT-LLM main, #17974):
    the exact interval ``[start, end)`` (absolute prompt positions, block-aligned) of the
    reservation ``reservation_id`` to load for request ``request_id``, into the complete
    destination page lists ``block_ids_by_layer_group[g][ordinal]`` (``-1``: no page)."""

    reservation_id: int
    request_id: int
    start: int
    end: int
    is_async: bool
    block_ids_by_layer_group: list[list[int]]
    tokens: list[int]
    cache_salt: str | None = None


@dataclass
class SchedulerOutput:
    """What one iteration scheduled: first reports in ``new_requests``, every later report
    (later chunks, generation steps) in ``cached_requests``. ``prefix_loads`` (prefix-aware
    scheduling only): the reservation loads authorised this iteration, present even for
    requests absent from both lists (parked async loads) and when nothing computes."""

    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)
    attention_dp_rank: int | None = None
    prefix_loads: list[PrefixLoad] = field(default_factory=list)


class KvCacheConnectorWorker(ABC):
    """Runs on every rank; moves bytes. Built as ``cls(llm_args)`` at bring-up."""

    supports_attention_dp: bool = False

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        self._metadata: object = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _satisfy_flat_abstracts(cls, KvCacheConnectorWorker, _WORKER_PAIRS)

    def bind_connector_meta(self, metadata: object) -> None:
        """Called once per iteration on every rank with the leader's (unpickled) metadata."""
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_forward_pass_callable(self) -> Callable[..., Any] | None:
        """Called once at bring-up; a truthy result runs at the end of every forward."""
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """V1 bring-up: the rank's ``[num_blocks, num_layers, kv_factor, block_size]`` pool."""

    def register_kv_cache_layout(self, layout: KvCacheLayout) -> None:
        """V2 bring-up, called instead of ``register_kv_caches``. Default: forward the single
        pool view, or refuse a layout that has none."""
        tensor = layout.as_single_pool_tensor()
        if tensor is None:
            regions = sum(len(g.regions) for g in layout.groups)
            raise NotImplementedError(
                f"{type(self).__name__} supports only a single-pool KV cache, but the layout "
                f"has {len(layout.groups)} layer group(s) and {regions} region(s); implement "
                "register_kv_cache_layout()"
            )
        self.register_kv_caches(tensor)

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None:
        """Once per forward pass, after ``bind_connector_meta``; an exception is fatal."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Forward pre-hook of each decoder layer, in ascending layer order."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Forward post-hook of each decoder layer, right after its work is enqueued."""

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None:
        """Once per forward pass, right after the forward returns."""

    @abstractmethod
    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """Every iteration: returns ``(finished_saving_ids, finished_loading_ids)``. An id
        may be returned only after it was handed in, and only once."""

    def take_failed_load_requests(self) -> set[int]:
        """After each forward (one line): requests whose load in it failed; the runtime
        drops their allocation and admits them again. Cleared on return."""
        return set()

    def take_failed_async_load_requests(self) -> set[int]:
        """After ``get_finished`` (one line): parked requests reported loaded whose load
        failed; the runtime restarts them. Cleared on return."""
        return set()

    # Opt-in prefix reservations (docs/design/prefix-reservations.md): all three hooks or
    # none.
    def get_finished_prefix_loads(self) -> list[int]:
        """Every iteration (prefix-aware scheduling): reservation ids whose loads finished
        on this worker (reads and writes over); must not wait for other workers."""
        raise NotImplementedError(f"{type(self).__name__} does not take prefix reservations")


class KvCacheConnectorScheduler(ABC):
    """The leader: decides what to load and save. Rank 0 only under TP."""

    supports_attention_dp: bool = False

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _satisfy_flat_abstracts(cls, KvCacheConnectorScheduler, _SCHEDULER_PAIRS)

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """Once per iteration; the result must be picklable (it is broadcast under TP)."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Once per request: tokens beyond the device match the connector supplies, and
        whether the load is asynchronous. ``(0, True)`` is an error."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Right after the allocation that followed the query (V1: all prompt blocks)."""

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Once when the request ends; ``True`` keeps its pages until ``get_finished``."""

    def update_state_after_alloc_by_layer_group(
        self, request: Any, block_ids_by_layer_group: list[list[int]]
    ) -> None:
        if len(block_ids_by_layer_group) == 1:
            return self.update_state_after_alloc(request, block_ids_by_layer_group[0])
        raise NotImplementedError(
            f"{type(self).__name__} has no update_state_after_alloc_by_layer_group() for "
            f"{len(block_ids_by_layer_group)} layer groups"
        )

    def request_finished_by_layer_group(
        self, request: Any, cache_block_ids_by_layer_group: list[list[int]]
    ) -> bool:
        if len(cache_block_ids_by_layer_group) == 1:
            return self.request_finished(request, cache_block_ids_by_layer_group[0])
        raise NotImplementedError(
            f"{type(self).__name__} has no request_finished_by_layer_group() for "
            f"{len(cache_block_ids_by_layer_group)} layer groups"
        )

    def wait_for_initialization(self) -> None:
        """Once at the end of bring-up, after KV registration and hook installation."""

    # Opt-in prefix reservations (docs/design/prefix-reservations.md): all three hooks or
    # none.
    def reserve_prefix(
        self, request: Any, num_computed_tokens: int, reservation_id: int
    ) -> tuple[int, bool]:
        """Admission: protect the source from ``num_computed_tokens`` on, start no transfer;
        ``(tokens, is_async)``, ``(0, True)`` is refused."""
        raise NotImplementedError(f"{type(self).__name__} does not take prefix reservations")

    def release_prefix_reservation(
        self, request: Any, reservation_id: int, start: int, end: int
    ) -> None:
        """Release ``[start, end)`` of a reservation's protection."""
        raise NotImplementedError(f"{type(self).__name__} does not take prefix reservations")

    # Optional V2 hooks (documented in newer TensorRT-LLM docs; no-op defaults).
    def cancel_load(self, request: Any, start: int, end: int) -> None:
        """The runtime will not consume ``[start, end)`` of an offer. Best effort."""

    def request_reset(self, request: Any) -> None:
        """The allocation was released; the request will replay from scratch."""


PREFIX_HOOKS = (
    ("scheduler", "reserve_prefix"),
    ("scheduler", "release_prefix_reservation"),
    ("worker", "get_finished_prefix_loads"),
)


def prefix_reservation_capability(
    scheduler: Any,
    worker: Any,
    scheduler_base: type = KvCacheConnectorScheduler,
    worker_base: type = KvCacheConnectorWorker,
) -> bool:
    """Bring-up check of TensorRT-LLM's ``configure_prefix_reservations`` (UT-RES): True if
    the connector implements all three reservation hooks, False if none (the legacy query
    path), ``ValueError("prefix reservations require ...")`` naming what is missing if only
    some. ``scheduler`` may be None (a rank without one): only the worker is checked."""
    have = {}
    for side, name in PREFIX_HOOKS:
        obj, base = (scheduler, scheduler_base) if side == "scheduler" else (worker, worker_base)
        if obj is not None:
            have[name] = overrides(obj, base, name)
    if all(have.values()):
        return True
    if not any(have.values()):
        return False
    missing = [n for n, ok in have.items() if not ok]
    raise ValueError(
        "prefix reservations require reserve_prefix and release_prefix_reservation on the "
        "scheduler and get_finished_prefix_loads on the worker, all three or none; "
        f"{type(scheduler).__name__}/{type(worker).__name__} lack {', '.join(missing)}"
    )


def reject_flat_only_scheduler(
    scheduler: Any, num_layer_groups: int, base: type = KvCacheConnectorScheduler
) -> None:
    """Bring-up check: several layer groups need both per-group scheduler forms."""
    if num_layer_groups <= 1:
        return
    missing = [
        grouped for _, grouped in _SCHEDULER_PAIRS if not overrides(scheduler, base, grouped)
    ]
    if missing:
        raise NotImplementedError(
            f"the KV cache has {num_layer_groups} layer groups (VSWA), but connector scheduler "
            f"{type(scheduler).__name__} does not implement {', '.join(missing)}"
        )
