"""What the consumer's scheduler hands its workers, and the load-mode rule.

``ConsumerMeta`` is built once per iteration by ``ConsumerScheduler.build_connector_meta``
on the leader and handed to every rank's worker through TensorRT-LLM's connector manager,
which broadcasts it pickled under TP (the reference engine pickles it on one process too):
every type here is a plain ``msgspec.Struct`` of ints, strings, bytes and lists, so it
pickles and copies as is. One struct per request (or reservation) and event:

    scheduled       request ids computed this pass
    loads           ``LoadStart``: a legacy load starting now (TP > 1: with its
                    ``LoadPlan`` for ranks > 0: producer, every rank's lease, slots, bus uid)
    failed          ``LoadFailure``: a load that failed before dispatch (every rank fails
                    the request)
    dropped         TP > 1: request ids whose loads were dropped since the last metadata
                    (ended, or fenced: their pages were handed to another request)
    awaited         ``AwaitedLoad``: a load of a request that ended while it landed, whose
                    pages another request of this pass reads as a cached prefix: every
                    rank waits for it to land before this pass's loads and forward
    prefix_loads    ``PrefixStart``: an authorised reservation load starting now (TP > 1:
                    with its ``PrefixPlan``)
    prefix_failed   ``PrefixFailure``: an authorised reservation load refused by name
    prefix_dropped  TP > 1: reservations released while their load still landed
    bus             TP > 1: the ranks' outcome bus (``BusAddress``)

``KvLoadFailedError`` is what a worker raises where a failed load must stop a forward (see
``ConsumerWorker``).
"""

from __future__ import annotations

import msgspec

from ..config import ConfigError, DisaggConfig
from ..transport.factory import abort_gap


class KvLoadFailedError(RuntimeError):
    """A claimed prefix could not be loaded; the request must fail, never read those pages."""


class LoadPlan(msgspec.Struct):
    """TP > 1: what a rank other than 0 needs to start its shard's load of a request."""

    producer: int  # index into consumer.producers
    lease_ids: list[int]  # per producer rank, rank order
    num_blocks: int
    first_block: int
    dst_slots: list[list[int]]
    uid: int = 0  # the load's id on the ranks' outcome bus (chosen by the leader)
    incarnations: list[int] = []  # per producer rank, rank order


class LoadStart(msgspec.Struct):
    """A legacy load that starts now; ``plan`` (TP > 1) for ranks other than 0."""

    request_id: int
    plan: LoadPlan | None = None


class LoadFailure(msgspec.Struct):
    """A load that failed before dispatch: every rank fails its request with ``why``."""

    request_id: int
    why: str


class PrefixPlan(msgspec.Struct):
    """TP > 1: one authorised prefix load, for ranks other than 0: rank r pushes blocks
    ``[push_first, push_first + push_blocks)`` of its own lease ``lease_ids[r]``
    (``lease_blocks`` long; the same blocks under rank r's keys) into the same destination
    slots of its own shard."""

    request_id: int
    producer: int  # index into consumer.producers
    lease_ids: list[int]  # per producer rank, rank order
    lease_blocks: int
    first_block: int  # the request's block ordinal of the lease's first block
    push_first: int  # lease-relative
    push_blocks: int
    dst_slots: list[list[int]]
    uid: int  # the load's id on the ranks' outcome bus
    incarnations: list[int] = []  # per producer rank, rank order


class PrefixStart(msgspec.Struct):
    """An authorised reservation load that starts now; ``plan`` (TP > 1) for ranks > 0."""

    reservation_id: int
    is_async: bool
    plan: PrefixPlan | None = None


class PrefixFailure(msgspec.Struct):
    """An authorised reservation load refused before dispatch (reported failed)."""

    reservation_id: int
    request_id: int
    why: str


class BusAddress(msgspec.Struct):
    """TP > 1: where ranks > 0 reach the outcome bus, and its secret."""

    address: str
    secret: bytes


class AwaitedLoad(msgspec.Struct):
    """A load still landing in pages the engine now serves as a cached prefix to
    ``readers`` (its own request ended; the bytes landing are the ones they read)."""

    request_id: int
    readers: list[int]


class ConsumerMeta(msgspec.Struct):
    """The scheduler's word to every worker for one iteration (see the module docstring)."""

    scheduled: list[int] = []
    loads: list[LoadStart] = []
    failed: list[LoadFailure] = []
    dropped: list[int] = []
    prefix_loads: list[PrefixStart] = []
    prefix_failed: list[PrefixFailure] = []
    prefix_dropped: list[int] = []
    bus: BusAddress | None = None
    awaited: list[AwaitedLoad] = []


def loads_async(config: DisaggConfig) -> bool:
    """``consumer.load_mode`` against the data plane: an executor may free a cancelled
    request's pages at once and hand them to another request while its load still lands
    (no stored TensorRT-LLM executor waits), and the consumer then fences that load by
    aborting it (``fence``). ``auto`` loads asynchronously where the plane's abort proves
    that no byte lands afterwards, else layer by layer (a synchronous load ends inside the
    forward that reads it); ``async`` on a plane whose abort can leave writes landing is
    refused naming the fix."""
    assert config.consumer is not None
    load_mode = config.consumer.load_mode
    gap = abort_gap(config.transport, config.ucx_channel)
    if load_mode == "auto":
        return gap is None
    if load_mode == "async" and gap is not None:
        raise ConfigError(
            f"consumer.load_mode: async loads need a data plane whose abort proves that no "
            f"byte lands afterwards, and {gap}: set load_mode: sync (or auto), or use a "
            "plane whose abort is complete (tcp, ipc, ucx with ucx_channel: tcp)"
        )
    return load_mode == "async"
