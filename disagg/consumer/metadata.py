"""What the consumer's scheduler hands its workers, and the load-mode rule.

``ConsumerMeta`` is built once per iteration by ``ConsumerScheduler.build_connector_meta``
on the leader and pickled to every rank: the requests whose loads start now, the requests
computed this pass, and (TP > 1) each load's plan for ranks > 0 (``LoadPlan``,
``PrefixPlan``), the loads dropped since the last metadata, failures decided before
dispatch and the ranks' outcome bus. ``KvLoadFailedError`` is what a worker raises where a
failed load must stop a forward (see ``ConsumerWorker``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import ConfigError
from ..engine import runtime
from .service import Load


class KvLoadFailedError(RuntimeError):
    """A claimed prefix could not be loaded; the request must fail, never read those pages."""


@dataclass
class LoadPlan:
    """TP > 1: what a rank other than 0 needs to start its shard's load of a request."""

    request_id: int
    producer: int  # index into consumer.producers
    lease_ids: list[int]  # per producer rank, rank order
    num_blocks: int
    first_block: int
    dst_slots: list[list[int]]
    uid: int = 0  # the load's id on the ranks' outcome bus (chosen by the leader)
    incarnations: list[int] = field(default_factory=list)  # per producer rank, rank order


@dataclass
class PrefixPlan:
    """TP > 1: one authorised prefix load, for ranks other than 0 (keyed by reservation id):
    rank r pushes blocks ``[push_first, push_first + push_blocks)`` of its own lease
    ``lease_ids[r]`` (``lease_blocks`` long; the same blocks under rank r's keys) into the
    same destination slots of its own shard."""

    reservation_id: int
    request_id: int
    producer: int  # index into consumer.producers
    lease_ids: list[int]  # per producer rank, rank order
    lease_blocks: int
    first_block: int  # the request's block ordinal of the lease's first block
    push_first: int  # lease-relative
    push_blocks: int
    dst_slots: list[list[int]]
    is_async: bool
    uid: int  # the load's id on the ranks' outcome bus
    incarnations: list[int] = field(default_factory=list)  # per producer rank, rank order


@dataclass
class Reservation:
    """Scheduler: one reservation's lease (``load.first_block``: the request's block
    ordinal of the lease's first block) and the token ranges still protected."""

    request_id: int
    load: Load
    protected: list[tuple[int, int]]
    released: np.ndarray  # per lease block (lease-relative): given back already


@dataclass
class ConsumerMeta:
    loads: list[int] = field(default_factory=list)  # request ids whose load starts now
    scheduled: list[int] = field(default_factory=list)  # every request computed this pass
    plans: list[LoadPlan] = field(default_factory=list)  # TP > 1: the loads, for ranks > 0
    dropped: list[int] = field(default_factory=list)  # TP > 1: loads released since last
    # loads that failed before dispatch (request id, why): every rank fails the request
    failed: list[tuple[int, str]] = field(default_factory=list)
    bus: tuple[str, bytes] | None = None  # TP > 1: the outcome bus (address, secret)
    # prefix reservations: (reservation id, is_async) whose loads start now, and
    # (reservation id, request id, why) refused before dispatch (reported failed)
    prefix_loads: list[tuple[int, bool]] = field(default_factory=list)
    prefix_failed: list[tuple[int, int, str]] = field(default_factory=list)
    # TP > 1: the prefix loads starting now, for ranks > 0; reservations released while
    # their load was still landing (a runtime that did not drain it: every rank stops it)
    prefix_plans: list[PrefixPlan] = field(default_factory=list)
    prefix_dropped: list[int] = field(default_factory=list)


def loads_async(load_mode: str) -> bool:
    """``consumer.load_mode`` against the runtime: ``auto`` loads asynchronously where the
    runtime keeps a cancelled request's pages while its load is pending, else layer by
    layer (a synchronous load ends inside the forward that reads it); ``async`` on a
    runtime that frees them at once is refused: a load still landing would write into
    pages another request owns."""
    feats = runtime.current()
    if load_mode == "auto":
        return feats.keeps_cancelled_pages
    if load_mode == "async" and not feats.keeps_cancelled_pages:
        raise ConfigError(
            f"consumer.load_mode: async loads need a runtime that keeps a cancelled "
            f"request's pages while its load is pending, and TensorRT-LLM's {feats.line} "
            "frees them at once (no has_pending_transfers): set load_mode: sync (or auto)"
        )
    return load_mode == "async"
