"""A consumer load's life: one request's claimed blocks, from the claim to the verdict.

    CLAIMED --slots known--> PLANNED --expect, Push--> DISPATCHED --every page landed--> LANDED
       |                       |   ^                     |  |  |
       | no page allocated     |   |  failed or timed    |  |  +--request ended--> ABANDONED
       +---------> REFUSED <---+   +--out: fail-over <---+  |
                                      (once, TP = 1)        +--failed, or load_timeout_s
                                                               passed (no fail-over)--> FAILED
    TP > 1, the ranks' verdict:  LANDED --every rank landed it--> AGREED
                                 LANDED or a failure --a rank failed, or is silent--> REJECTED

Waiting states, and what bounds each (nothing waits without a deadline):

    CLAIMED     the allocation, in the same iteration: ``ORPHAN_AFTER`` metadata builds later
                the claim is dropped, its lease released (``claims_orphaned``). A reservation
                waits for the runtime to authorise or release it (the runtime's bound).
    PLANNED     the same iteration's ``start_load_kv``.
    DISPATCHED  ``consumer.load_timeout_s`` from dispatch: the data plane's deadline, also
                checked by the synchronous waits and (TP > 1) by the bus thread's polls.
    LANDED      TP > 1 only: ``load_timeout_s`` + ``rank_bus.PEER_GRACE_S`` for every rank's
                outcome; a rank silent past it counts as failed (REJECTED).

When a load times out (or its transfer fails): its producer is passed over for
``links.DOWN_BACKOFF_S``; a TP = 1 async load claims the same blocks once from another
producer (within the deadline) and pushes into the same slots (DISPATCHED -> PLANNED ->
DISPATCHED), else it is FAILED: the transfer is aborted first (no byte of it lands
afterwards; a write the plane cannot quiet makes the service unhealthy), then the error is
recorded against the request, whose forward raises (or which is reported for a restart)
before any layer reads those pages, and the lease is released once the worker takes the
outcome (``settle``) or the request ends. A request that ends while its load lands makes it
ABANDONED the same way (aborted before the engine may reuse the pages), and so does a load
whose pages the engine hands to another request while it lands (``fence``). A load REFUSED
before dispatch wrote nothing; the next metadata tells every rank (``ConsumerMeta.failed``),
which fail its request. Every failure state carries ``error``; final states: LANDED
(TP = 1), AGREED, REFUSED, FAILED, ABANDONED, REJECTED. An illegal transition raises
``LoadStateError``: a bug, never ignored.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .links import ProducerLink

# A legacy claim still without its allocation this many metadata builds after the one of
# its iteration belongs to a request the engine dropped without a call: released.
ORPHAN_AFTER = 2


class LoadState(enum.Enum):
    CLAIMED = "claimed"  # lease held; where the pages go is not known yet
    PLANNED = "planned"  # destination slots known; no push asked yet
    DISPATCHED = "dispatched"  # the plane expects the transfer; the push was asked for
    LANDED = "landed"  # every page landed here (checksum included)
    AGREED = "agreed"  # TP > 1: every rank landed it whole
    REFUSED = "refused"  # failed before a push was asked: nothing of it was written
    FAILED = "failed"  # failed after dispatch; its transfer aborted
    ABANDONED = "abandoned"  # its request ended while it landed; its transfer aborted
    REJECTED = "rejected"  # TP > 1: the ranks decided it failed (``error``: the verdict)


S = LoadState
TRANSITIONS: dict[LoadState, frozenset[LoadState]] = {
    S.CLAIMED: frozenset({S.PLANNED, S.REFUSED}),
    # PLANNED -> PLANNED: a later allocation call (flat, then per group) plans it again
    S.PLANNED: frozenset({S.PLANNED, S.DISPATCHED, S.REFUSED}),
    # DISPATCHED -> PLANNED: the fail-over, dispatched again at once from the new lease
    S.DISPATCHED: frozenset({S.LANDED, S.FAILED, S.ABANDONED, S.PLANNED}),
    S.LANDED: frozenset({S.AGREED, S.REJECTED}),
    S.REFUSED: frozenset({S.REJECTED}),
    S.FAILED: frozenset({S.REJECTED}),
    S.ABANDONED: frozenset({S.REJECTED}),
    S.AGREED: frozenset(),
    S.REJECTED: frozenset(),
}
# What bounds each waiting state (see the module docstring); a state not here waits on
# nothing (it is over, or passed through at once).
TIMEOUTS: dict[LoadState, str] = {
    S.CLAIMED: "ORPHAN_AFTER metadata builds (a reservation: the runtime's release)",
    S.PLANNED: "the same iteration's start_load_kv",
    S.DISPATCHED: "consumer.load_timeout_s",
    S.LANDED: "consumer.load_timeout_s + rank_bus.PEER_GRACE_S (TP > 1)",
}
OVER = frozenset({S.LANDED, S.AGREED, S.REFUSED, S.FAILED, S.ABANDONED, S.REJECTED})
FAILURES = frozenset({S.REFUSED, S.FAILED, S.ABANDONED, S.REJECTED})
_NOT_STARTED = frozenset({S.CLAIMED, S.PLANNED, S.REFUSED})


class LoadStateError(RuntimeError):
    """A transition the table does not allow: a bug in the consumer, never ignored."""


@dataclass
class Claimed:
    """A lease the consumer holds (every rank's, on the leader under TP)."""

    link: ProducerLink
    lease_id: int
    num_blocks: int
    ttl_s: float = 30.0  # as granted: the producer may cap what we asked for
    incarnation: int = 0  # the producer's that granted it (0: not named)
    # TP > 1, on the leader: the same blocks leased on the producer's ranks 1..N-1
    ranks: list[Claimed] = field(default_factory=list)
    released: bool = False  # given back (once: a second Release would name a dead lease)
    at: float = field(default_factory=time.monotonic)  # when it was granted
    # a prefetched lease's pages landing in the consumer's landing zone (``zone.Fill``):
    # its load completes by a local copy instead of a push into the engine's pages
    zone: Any = None

    def all_ranks(self) -> list[Claimed]:
        return [self, *self.ranks]


@dataclass
class Load:
    """One request's load: its lease, destination slots, transfer and state."""

    request_id: int
    claimed: Claimed
    first_block: int  # block ordinal in the request where the loaded run starts
    dst_slots: list[list[int]] | None = None  # known: PLANNED (on construction too)
    transfer_id: int = 0
    token: bytes = b""
    deadline: float = 0.0  # set at dispatch: now + load_timeout_s
    state: LoadState = LoadState.CLAIMED
    error: str | None = None  # why it failed (every failure state), else None
    # which blocks of the lease to push (prefix reservations push the accepted part)
    push_first: int = 0
    push_blocks: int | None = None  # None: the whole lease
    # layer-wise loads: pages landed once each layer is complete (layer id -> count)
    layer_marks: dict[int, int] | None = None
    # TP > 1: the load's id on every rank (the leader's choice, in the plan), and the
    # leading layers landed here (published on the rank bus)
    uid: int = 0
    layers_landed: int = 0
    # a prefix reservation's load (TensorRT-LLM main): its reservation id, else None
    reservation_id: int | None = None
    keys: Any = None  # the claimed blocks' keys (leader, TP = 1): to claim them elsewhere
    # TP sizes that differ (``routes``): ranks > 0, each producer rank's lease and the part
    # it sends (the leader derives them from ``claimed``); the parts' transfers after the
    # first (``transfer_id``)
    sources: list[tuple[Claimed, Any]] | None = None
    more_transfers: list[int] = field(default_factory=list)
    failovers: int = 0  # attempts to move it to another producer (at most one)
    unplanned: int = 0  # leader: metadata built since the claim without its allocation

    def __post_init__(self) -> None:
        if self.dst_slots is not None and self.state is LoadState.CLAIMED:
            self.state = LoadState.PLANNED  # built from a plan: its slots are known

    def transition(self, to: LoadState, error: str | None = None) -> None:
        """Move to ``to`` (a failure state with its ``error``), or raise ``LoadStateError``
        if the table does not allow it."""
        if to not in TRANSITIONS[self.state]:
            raise LoadStateError(
                f"KV load of request {self.request_id}: {self.state.name} -> {to.name} "
                "is not a transition of a load"
            )
        if to in FAILURES:
            if not error:
                raise LoadStateError(f"KV load of request {self.request_id}: {to.name} needs why")
            self.error = error
        self.state = to

    @property
    def over(self) -> bool:
        """Nothing of it writes any more: landed, or failed (its transfer aborted)."""
        return self.state in OVER

    @property
    def started(self) -> bool:
        """A push was asked for (whatever became of it since)."""
        return self.state not in _NOT_STARTED

    @property
    def transfer_ids(self) -> list[int]:
        """Every transfer of the load (one per producer rank it loads from)."""
        return [self.transfer_id, *self.more_transfers] if self.transfer_id else []

    @property
    def blocks(self) -> int:
        """How many blocks of the lease this load pushes (from ``push_first``)."""
        return self.claimed.num_blocks if self.push_blocks is None else self.push_blocks


@dataclass
class Reservation:
    """Scheduler: one prefix reservation's lease (``load.first_block``: the request's block
    ordinal of the lease's first block) and the token ranges still protected."""

    request_id: int
    load: Load
    protected: list[tuple[int, int]]
    released: np.ndarray  # per lease block (lease-relative): given back already
