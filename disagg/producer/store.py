"""The producer's block store: a fixed byte budget of store blocks, indexed by content key.

Block states (DESIGN §4), each with a named way out so nothing is stuck forever:

    PLANNED  --first layer copied-->  STAGING  --commit-->  STORED  --evict (unpinned)--> gone
       |                                 |
       +-------- abort / SAVE_TIMEOUT ---+--> gone

- Leases pin blocks (any state); a pinned block is never evicted or aborted-and-reused
  while a push may read it.
- When the store is full, a new save evicts the least-recently-used unpinned STORED block;
  if none can be evicted the save is dropped (counted), never blocking the engine.
- Every STORED block carries a checksum of its bytes, so corruption is detectable
  (``verify``) and a push can prove what it sent.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

# Named timeout: a block planned for saving but not committed within this long is aborted.
DEFAULT_SAVE_TIMEOUT_S = 30.0


class BlockState(enum.Enum):
    PLANNED = "planned"
    STAGING = "staging"
    STORED = "stored"


@dataclass(eq=False)  # identity: a lease holds these very entries (and `index(None)` is C-fast)
class Entry:
    row: int
    state: BlockState
    planned_at: float
    pins: int = 0
    checksum: int = 0
    dead: bool = False  # dropped from the index while pinned


@dataclass
class StoreStats:
    saves_planned: int = 0
    saves_committed: int = 0
    saves_dropped_full: int = 0
    saves_deduplicated: int = 0
    saves_aborted: int = 0
    evictions: int = 0
    corruptions_found: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class StoreFull(Exception):
    pass


class BlockStore:
    """Store blocks of ``block_bytes`` each in one preallocated slab.

    Thread-safe: the engine thread plans/commits, the control server pins/reads.
    """

    def __init__(
        self,
        block_bytes: int,
        budget_bytes: int,
        *,
        device: str = "cpu",
        save_timeout_s: float = DEFAULT_SAVE_TIMEOUT_S,
        on_stored: Callable[[list[bytes]], None] | None = None,
        on_removed: Callable[[list[bytes]], None] | None = None,
    ):
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        capacity = budget_bytes // block_bytes
        if capacity < 1:
            raise ValueError(
                f"store budget {budget_bytes} B holds no block of {block_bytes} B: raise "
                f"producer.store_size to at least {block_bytes} B"
            )
        pin = device == "pinned" and torch.cuda.is_available()
        dev = "cpu" if device == "pinned" else device
        self.slab = torch.empty(
            (capacity, block_bytes), dtype=torch.uint8, device=dev, pin_memory=pin
        )
        self.block_bytes = block_bytes
        self.capacity = capacity
        self.save_timeout_s = save_timeout_s
        self._entries: dict[bytes, Entry] = {}
        # STORED blocks in least-recently-used order. Pinning does not remove a key (claims
        # of long prompts pin thousands of blocks on the control thread, so a pin is one
        # counter increment); eviction skips keys that are pinned, and the last unpin puts
        # a key back as most recently used.
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._on_stored = on_stored or (lambda keys: None)
        self._on_removed = on_removed or (lambda keys: None)
        self.stats = StoreStats()

    # -- saving (engine thread) ---------------------------------------------------------
    def plan(self, keys: Iterable[bytes]) -> np.ndarray:
        """Reserve rows for new blocks. Returns one row per key: ``-1`` where the key is
        already held (deduplicated) or the store is full of pinned blocks (dropped)."""
        now = time.monotonic()
        keys = list(keys)
        rows = np.full(len(keys), -1, dtype=np.int64)
        removed: list[bytes] = []
        with self._lock:
            planned: list[Entry] = []
            for i, key in enumerate(keys):
                if key in self._entries:  # also a key planned earlier in this call
                    self.stats.saves_deduplicated += 1
                    continue
                row = self._take_row(removed)
                if row is None:
                    self.stats.saves_dropped_full += 1
                    continue
                entry = self._entries[key] = Entry(row, BlockState.PLANNED, now)
                planned.append(entry)
                rows[i] = row
                self.stats.saves_planned += 1
            # Hand the rows out in ascending order: rows freed together (an LRU run) then
            # form one run, which the save path copies in one piece instead of scattering.
            kept = rows >= 0
            rows[kept] = np.sort(rows[kept])
            for entry, row in zip(planned, rows[kept]):
                entry.row = int(row)
        if removed:
            self._on_removed(removed)
        return rows

    def _take_row(self, removed: list[bytes]) -> int | None:
        if self._free:
            return self._free.pop()
        while self._lru:
            key, _ = self._lru.popitem(last=False)
            entry = self._entries.get(key)
            if entry is None or entry.pins:  # pinned: back in the LRU on its last unpin
                continue
            del self._entries[key]
            self.stats.evictions += 1
            removed.append(key)
            return entry.row
        return None

    def mark_staging(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is not None and e.state is BlockState.PLANNED:
                    e.state = BlockState.STAGING

    def commit(self, keys: Iterable[bytes]) -> None:
        """The bytes of these blocks have landed in their rows: publish them."""
        done: list[bytes] = []
        with self._changed:
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.state is BlockState.STORED:
                    continue
                e.state = BlockState.STORED
                e.checksum = _checksum(self.slab[e.row])
                if e.pins == 0:
                    self._lru[key] = None
                done.append(key)
            self.stats.saves_committed += len(done)
            self._changed.notify_all()
        if done:
            self._on_stored(done)

    def abort(self, keys: Iterable[bytes]) -> None:
        """A save failed: forget these blocks (never serve half-written bytes)."""
        with self._changed:
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.state is BlockState.STORED:
                    continue
                self._drop(key, e)
                self.stats.saves_aborted += 1
            self._changed.notify_all()

    def _drop(self, key: bytes, e: Entry) -> None:
        del self._entries[key]
        self._lru.pop(key, None)
        e.dead = True
        if e.pins == 0:  # else the row returns to the free list on the last unpin
            self._free.append(e.row)

    def sweep_stale_saves(self, now: float | None = None) -> int:
        """SAVE_TIMEOUT: abort saves planned longer ago than ``save_timeout_s``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [
                k
                for k, e in self._entries.items()
                if e.state is not BlockState.STORED and now - e.planned_at > self.save_timeout_s
            ]
        self.abort(stale)
        return len(stale)

    # -- serving (control server thread) ------------------------------------------------
    def longest_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys are held (in any state)."""
        with self._lock:
            return len(self._held_prefix(keys))

    def _held_prefix(self, keys: list[bytes]) -> list[Entry]:
        """Entries of the longest held prefix of ``keys`` (lock held). One C-level pass
        (``map``) instead of a Python loop: claims of 128k-token prompts look up 8k keys."""
        entries: list[Entry | None] = list(map(self._entries.get, keys))
        try:
            del entries[entries.index(None) :]
        except ValueError:
            pass
        return entries  # type: ignore[return-value]

    def pin(self, keys: list[bytes]) -> list[Entry]:
        """Pin the longest held prefix of ``keys``; returns the pinned entries (a lease
        holds entries, not keys, so a key re-saved after an abort is not confused)."""
        with self._lock:
            entries = self._held_prefix(keys)
            for e in entries:
                e.pins += 1
            return entries

    def pin_entries(self, keys: list[bytes], entries: list[Entry]) -> None:
        """Add a pin to entries already held (a push pins what it reads, so a lease freed
        by its TTL mid-push cannot let those rows be evicted and reused under it)."""
        with self._lock:
            for e in entries:
                e.pins += 1

    def unpin(self, keys: list[bytes], entries: list[Entry]) -> None:
        with self._lock:
            back = []
            for key, e in zip(keys, entries):
                e.pins -= 1
                if e.pins:
                    continue
                if e.dead:
                    self._free.append(e.row)
                elif e.state is BlockState.STORED:
                    back.append(key)
            if back:  # most recently used now (pinning left them where they were)
                lru = self._lru
                try:
                    deque(map(lru.move_to_end, back), maxlen=0)  # one C-level pass
                except KeyError:  # some were skipped (and dropped) by an eviction
                    for key in back:
                        lru[key] = None
                        lru.move_to_end(key)

    def wait_stored(self, entries: list[Entry], deadline: float) -> np.ndarray:
        """Block (a server thread, never the engine's) until every pinned entry is STORED;
        return their rows. Raises TimeoutError at ``deadline``, KeyError if one was aborted."""
        with self._changed:
            while True:
                dead = sum(e.dead for e in entries)
                if dead:
                    raise KeyError(f"{dead} leased block(s) were aborted before the push")
                if all(e.state is BlockState.STORED for e in entries):
                    return np.fromiter((e.row for e in entries), dtype=np.int64, count=len(entries))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("leased blocks were not saved before the push deadline")
                self._changed.wait(min(left, 0.5))

    # -- inspection -----------------------------------------------------------------------
    def state_of(self, key: bytes) -> BlockState | None:
        with self._lock:
            e = self._entries.get(key)
            return None if e is None else e.state

    def keys(self) -> list[bytes]:
        with self._lock:
            return [k for k, e in self._entries.items() if e.state is BlockState.STORED]

    def used_blocks(self) -> int:
        with self._lock:
            return len(self._entries)

    def pinned_blocks(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.pins)

    def verify(self) -> int:
        """Re-read every STORED block against its checksum; returns the number corrupted."""
        with self._lock:
            bad = sum(
                1
                for e in self._entries.values()
                if e.state is BlockState.STORED and _checksum(self.slab[e.row]) != e.checksum
            )
        self.stats.corruptions_found += bad
        return bad


def _checksum(row: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(row.cpu().contiguous().numpy().data)
