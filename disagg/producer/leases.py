"""Leases: one consumer request's ownership of a run of stored blocks.

Lease states and the named timeout that ends each one:

    ACTIVE --release / LEASE_TTL unrenewed / OWNER_DEAD_AFTER without heartbeat
           / LEASE_MAX_HOLD since the grant--> freed

A lease pins its blocks in the store (no eviction, no reuse of their rows) until freed.
LEASE_MAX_HOLD bounds the one zombie the other two miss: a consumer that is alive and
renewing, but never releases (a request its engine leaked, a bug): without it those
blocks would stay pinned for the life of that consumer. Renewals never move a deadline
past it. A lease may also be released in part (``release_range``: a block range, for TensorRT-LLM's
prefix reservations, which release a clipped tail before the load and the loaded part
after it): those blocks are unpinned at once, the rest stay leased, and the lease ends
once no block is left; a push of a released block is refused (OUT_OF_RANGE).
A push in flight holds pins of its own, so freeing its lease cannot pull the
rows from under it; the consumer learns the lease is gone at its next renewal (reported
unknown) or push (UNKNOWN_LEASE), and its failure rule applies.
Deadlines are not ordered (renewals move them), so ``sweep`` looks at every lease.

Liveness is judged by the judge's own clock: a sweep that comes more than ``stall_after_s``
after the previous one means this process was itself stalled (stopped, starved), so the
silence it would count was partly its own. That sweep frees nothing; it opens STALL_GRACE
(``stall_grace_s``, default OWNER_DEAD_AFTER + 2 x LEASE_TTL): no owner is declared dead
and no lease expires before it ends unless the owner is heard from first (then it is judged
as usual again). The grace covers what a live owner needs to reach us again after our
resume: its calls that timed out while we were stopped, a new connection and Hello, and
a few of its renewals (every TTL/3). LEASE_MAX_HOLD is kept, and an owner really gone is
freed at most one STALL_GRACE later than it would have been.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.keys import KeyBlob
from .store import BlockStore, Entry

DEFAULT_LEASE_TTL_S = 30.0
DEFAULT_OWNER_DEAD_AFTER_S = 15.0
DEFAULT_LEASE_MAX_HOLD_S = 600.0


@dataclass
class Lease:
    lease_id: int
    owner: str
    request_id: str
    keys: Sequence[bytes]  # as claimed: a KeyBlob (packed) from the wire, or a list
    entries: list[Entry]
    ttl_s: float
    deadline: float
    hold_until: float = float("inf")  # LEASE_MAX_HOLD: no renewal moves deadline past it
    pushes: int = 0
    rows: np.ndarray | None = None  # entries[i].row (from the claim's pin)
    unique_rows: bool = False  # no entry listed twice (a vectorised unpin is exact)
    released: np.ndarray | None = None  # per block: given back by release_range (None: none)

    def held_runs(self, first: int = 0, end: int | None = None) -> list[tuple[int, int]]:
        """``[a, b)`` runs of blocks in ``[first, end)`` still leased (not released)."""
        end = len(self.entries) if end is None else end
        if self.released is None:
            return [(first, end)] if end > first else []
        held = ~self.released[first:end]
        if not held.any():
            return []
        edges = np.flatnonzero(np.diff(np.concatenate(([0], held.view(np.int8), [0]))))
        return [(first + int(a), first + int(b)) for a, b in zip(edges[0::2], edges[1::2])]


@dataclass
class LeaseStats:
    granted: int = 0
    released: int = 0
    expired: int = 0
    freed_dead_owner: int = 0
    max_hold_exceeded: int = 0
    renewed: int = 0
    owners_declared_dead: int = 0
    stalls_forgiven: int = 0  # sweeps after a stall of our own: grace, nothing freed
    freed_owner_restart: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class LeaseTable:
    """Grants, renews and frees leases over a ``BlockStore``. Thread-safe."""

    def __init__(
        self,
        store: BlockStore,
        *,
        max_ttl_s: float = DEFAULT_LEASE_TTL_S,
        owner_dead_after_s: float = DEFAULT_OWNER_DEAD_AFTER_S,
        max_hold_s: float = DEFAULT_LEASE_MAX_HOLD_S,
        first_id: int = 1,
        stall_after_s: float | None = None,
        stall_grace_s: float | None = None,
    ):
        if max_hold_s < max_ttl_s:
            raise ValueError(
                f"a lease's max hold ({max_hold_s} s) must be at least its TTL ({max_ttl_s} s)"
            )
        self.store = store
        self.max_ttl_s = max_ttl_s
        self.owner_dead_after_s = owner_dead_after_s
        self.max_hold_s = max_hold_s
        self._leases: dict[int, Lease] = {}
        self._last_seen: dict[str, float] = {}
        self._ids = itertools.count(first_id)
        self.stall_after_s = stall_after_s
        self.stall_grace_s = (
            owner_dead_after_s + 2 * max_ttl_s if stall_grace_s is None else stall_grace_s
        )
        # The judge's clock runs from the table's start: a stall before the first sweep
        # (a producer stopped within one sweep period of starting) is a stall too.
        self._last_sweep = time.monotonic()
        self._lock = threading.Lock()
        self.stats = LeaseStats()

    def heartbeat(self, owner: str, now: float | None = None) -> None:
        with self._lock:
            self._last_seen[owner] = time.monotonic() if now is None else now

    def grant(
        self, owner: str, request_id: str, keys: KeyBlob | Sequence[bytes], ttl_s: float
    ) -> Lease | None:
        """Pin the longest held prefix of ``keys`` (packed keys, as a Claim carries them, are
        looked up a stored run at a time); None when not even one block is held."""
        now = time.monotonic()
        ttl = min(max(ttl_s, 0.1), self.max_ttl_s)
        entries, rows, unique = self.store.pin_rows(keys)
        if not entries:
            return None
        n = len(entries)
        # All of a packed claim held (the usual case): the KeyBlob is immutable, keep it as
        # is instead of building a slice of it (a list is copied, as the caller may reuse it).
        held = keys if isinstance(keys, KeyBlob) and n == len(keys) else keys[:n]
        with self._lock:
            self._last_seen[owner] = now
            lease = Lease(
                next(self._ids),
                owner,
                request_id,
                held,
                entries,
                ttl,
                now + ttl,
                hold_until=now + self.max_hold_s,
                rows=rows,
                unique_rows=unique,
            )
            self._leases[lease.lease_id] = lease
            self.stats.granted += 1
            return lease

    def get(self, owner: str, lease_id: int) -> Lease:
        """The caller's lease; typed errors for an unknown or someone else's lease."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_LEASE, f"lease {lease_id} is unknown (expired or released)"
                )
            if lease.owner != owner:
                raise ProtocolError(
                    ErrorCode.FOREIGN_LEASE, f"lease {lease_id} belongs to another consumer"
                )
            return lease

    def _unpin_held(self, lease: Lease, first: int = 0, end: int | None = None) -> int:
        """Unpin ``lease``'s blocks in ``[first, end)`` not released yet; returns how many."""
        count = 0
        for a, b in lease.held_runs(first, end):
            rows = None if lease.rows is None else lease.rows[a:b]
            self.store.unpin(lease.keys[a:b], lease.entries[a:b], rows, lease.unique_rows)
            count += b - a
        return count

    def pin_for_push(self, owner: str, lease_id: int, first: int, n: int) -> Lease:
        """The caller's lease, with blocks ``[first, first + n)`` pinned once more for a
        push; the pusher must ``store.unpin`` them when its transfer is final. Atomic with
        ``sweep``: a lease freed concurrently is either found (and its blocks pinned
        before the sweep unpins them) or refused as unknown."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.owner == owner:
                end = first + n
                if lease.released is not None and lease.released[first:end].any():
                    raise ProtocolError(
                        ErrorCode.OUT_OF_RANGE,
                        f"push of blocks [{first}, {end}) of lease {lease_id}: some were "
                        "released (release_range)",
                    )
                self.store.pin_entries(
                    lease.keys[first:end],
                    lease.entries[first:end],
                    None if lease.rows is None else lease.rows[first:end],
                    lease.unique_rows,
                )
                return lease
        return self.get(owner, lease_id)  # raises the typed error (unknown or foreign)

    def renew(self, owner: str, lease_ids: list[int], now: float | None = None) -> list[int]:
        """Extend the caller's leases by their TTL (never past LEASE_MAX_HOLD); returns the
        ids it does not hold."""
        now = time.monotonic() if now is None else now
        unknown = []
        with self._lock:
            self._last_seen[owner] = now
            for lid in lease_ids:
                lease = self._leases.get(lid)
                if lease is None or lease.owner != owner:
                    unknown.append(lid)
                    continue
                lease.deadline = min(now + lease.ttl_s, lease.hold_until)
                self.stats.renewed += 1
        return unknown

    def release(self, owner: str, lease_id: int) -> None:
        lease = self.get(owner, lease_id)
        with self._lock:
            if self._leases.pop(lease_id, None) is None:
                return
            self.stats.released += 1
        # out of the table: release_range no longer touches it, so unpin without the lock
        self._unpin_held(lease)

    def release_range(self, owner: str, lease_id: int, first: int, n: int) -> int:
        """Release blocks ``[first, first + n)`` of the caller's lease (relative to the
        lease); blocks released before are skipped. The lease ends once every block is
        released. Returns how many blocks this call unpinned. ``OUT_OF_RANGE`` if the range
        is not inside the lease."""
        lease = self.get(owner, lease_id)
        end = first + n
        if n < 1 or end > len(lease.entries):
            raise ProtocolError(
                ErrorCode.OUT_OF_RANGE,
                f"release of blocks [{first}, {end}) is outside lease {lease_id}, which "
                f"holds {len(lease.entries)} block(s)",
            )
        with self._lock:
            if self._leases.get(lease_id) is not lease:
                return 0  # freed concurrently (sweep, release): its blocks are unpinned
            count = self._unpin_held(lease, first, end)
            if lease.released is None:
                lease.released = np.zeros(len(lease.entries), dtype=bool)
            lease.released[first:end] = True
            self.stats.extra["blocks_released_in_part"] = (
                self.stats.extra.get("blocks_released_in_part", 0) + count
            )
            if lease.released.all():
                del self._leases[lease_id]
                self.stats.released += 1
        return count

    def sweep(self, now: float | None = None) -> int:
        """Free expired leases (LEASE_TTL unrenewed, or LEASE_MAX_HOLD reached) and every
        lease of owners silent past OWNER_DEAD_AFTER."""
        now = time.monotonic() if now is None else now
        freed: list[Lease] = []
        with self._lock:
            last, self._last_sweep = self._last_sweep, now
            if self.stall_after_s is not None:
                if now - last > self.stall_after_s:
                    self._forgive(now)
                    return 0
            dead = {
                o for o, seen in self._last_seen.items() if now - seen > self.owner_dead_after_s
            }
            for o in dead:
                del self._last_seen[o]
            self.stats.owners_declared_dead += len(dead)
            for lid, lease in list(self._leases.items()):
                if lease.owner in dead:
                    self.stats.freed_dead_owner += 1
                elif lease.hold_until < now:
                    self.stats.max_hold_exceeded += 1
                elif lease.deadline < now:
                    self.stats.expired += 1
                else:
                    continue
                freed.append(self._leases.pop(lid))
        for lease in freed:
            self._unpin_held(lease)
        return len(freed)

    def _forgive(self, now: float) -> None:
        """We were stalled: nobody is judged before STALL_GRACE from now (lock held). An
        owner's silence is counted from the grace's end (a heartbeat restarts it at once);
        a lease's deadline moves to the grace's end at least (a renewal sets it as usual)."""
        self.stats.stalls_forgiven += 1
        grace_end = now + self.stall_grace_s
        for o in self._last_seen:
            self._last_seen[o] = max(self._last_seen[o], grace_end - self.owner_dead_after_s)
        for lease in self._leases.values():
            lease.deadline = max(lease.deadline, min(grace_end, lease.hold_until))

    def free_owner(self, owner: str) -> int:
        """Free every lease of ``owner`` now (its process restarted); returns how many."""
        with self._lock:
            freed = [lid for lid, lease in self._leases.items() if lease.owner == owner]
            leases = [self._leases.pop(lid) for lid in freed]
            self.stats.freed_owner_restart += len(leases)
        for lease in leases:
            self._unpin_held(lease)
        return len(leases)

    def active(self) -> int:
        with self._lock:
            return len(self._leases)

    def owners(self) -> list[str]:
        with self._lock:
            return sorted({lease.owner for lease in self._leases.values()})
