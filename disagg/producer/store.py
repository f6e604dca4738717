"""The producer's block store: a fixed byte budget of store blocks, indexed by content key.

Block states, each with a named way out so nothing is stuck forever:

    PLANNED  --first layer copied-->  STAGING  --commit-->  STORED  --evict (unpinned)--> gone
       |                                 |
       +-------- abort / SAVE_TIMEOUT ---+--> gone

- Leases pin blocks (any state); a pinned block is never evicted or aborted-and-reused
  while a push may read it.
- When the store is full, a new save evicts the least-recently-used unpinned STORED block;
  if none can be evicted the save is dropped (counted), never blocking the engine.
- Every STORED block carries a checksum of its bytes, so corruption is detectable
  (``verify``, which skips a block until its sum is in). It is computed where the store
  lives, for a whole commit at once and after the commit wakes its pushes: xxh3 of
  each host row, or on a GPU one batched kernel whose sums stay on the GPU (a host hash of
  a device store copied every block to the host: 190 ms of a 12k-token prompt's prefill).

Claims look keys up in *runs*: the blocks one ``plan`` call created, in order, with their
keys packed in one ``bytes`` like a Claim's ``KeyBlob`` and their rows in one array. A
claim of a prompt saved in a few passes is then a few dict lookups and ``memcmp``s of the
packed keys, not one lookup per block (``_held_prefix_packed``; the per-key dict stays the
authority), and its pins one vectorised add: pins are counted per row (``Entry.pins``
reads them), so pinning touches no entry object.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from ..protocol.keys import KEY_BYTES, KeyBlob

# Named timeout: a block planned for saving but not committed within this long is aborted.
DEFAULT_SAVE_TIMEOUT_S = 30.0


class BlockState(enum.Enum):
    PLANNED = "planned"
    STAGING = "staging"
    STORED = "stored"


class _Run:
    """The blocks one ``plan`` call created, in order: ``blob`` packs their keys (16 bytes
    each), ``entries[i]`` is block i's entry while ``alive[i]`` (it is in the index), and
    None once it left (evicted or aborted: the run keeps no entry alive, and an entry that
    left no longer points at its run). ``live`` counts the blocks still held; a run whose
    blocks mostly left is compacted to the survivors (``_left_index``), so stranded runs
    cost at most a few times 25 B per block held."""

    __slots__ = ("alive", "blob", "entries", "live", "rows")

    def __init__(self, blob: bytes, entries: list[Entry | None], rows: np.ndarray) -> None:
        self.blob = blob
        self.entries = entries
        self.rows = rows  # entries[i].row, as one array (int64)
        self.alive = bytearray(b"\x01") * len(entries)
        self.live = len(entries)

    def __repr__(self) -> str:
        return f"_Run({len(self.entries)} blocks, {self.live} held)"


@dataclass(eq=False)  # identity: a lease holds these very entries (and `index(None)` is C-fast)
class Entry:
    row: int
    state: BlockState
    planned_at: float
    dead: bool = False  # dropped from the index while pinned
    run: _Run | None = field(default=None, repr=False)  # the plan call that created it
    pos: int = 0  # its index in ``run``
    counts: np.ndarray | None = field(default=None, repr=False)  # the store's pins per row

    @property
    def pins(self) -> int:
        """Pins on this block (leases, pushes). A row has one entry from its plan until it
        is freed, and a pinned row is never freed, so the store counts pins per row."""
        return 0 if self.counts is None else int(self.counts[self.row])


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
        if dev == "cpu":  # huge pages where the kernel allows (pinned: registered)
            from ..hostmem import empty as host_empty

            self.slab = host_empty((capacity, block_bytes), pin=pin)
        else:
            self.slab = torch.empty((capacity, block_bytes), dtype=torch.uint8, device=dev)
        self.block_bytes = block_bytes
        self.capacity = capacity
        self._sums = _Checksums(self.slab)
        self.save_timeout_s = save_timeout_s
        self._entries: dict[bytes, Entry] = {}
        # STORED blocks in least-recently-used order. Pinning does not remove a key (claims
        # of long prompts pin thousands of blocks on the control thread, so a pin is one
        # counter increment); eviction skips keys that are pinned, and the last unpin puts
        # a key back as most recently used.
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._pins = np.zeros(capacity, dtype=np.int32)  # per row (see Entry.pins)
        self._unsummed: set[bytes] = set()  # STORED, checksum not recorded yet (commit)
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
            planned_keys: list[bytes] = []
            run = _Run(b"", [], _NO_ROWS)  # this call's blocks; keys and rows packed below
            for i, key in enumerate(keys):
                if key in self._entries:  # also a key planned earlier in this call
                    self.stats.saves_deduplicated += 1
                    continue
                row = self._take_row(removed)
                if row is None:
                    self.stats.saves_dropped_full += 1
                    continue
                entry = self._entries[key] = Entry(
                    row, BlockState.PLANNED, now, run=run, pos=len(planned), counts=self._pins
                )
                planned.append(entry)
                run.entries.append(entry)
                planned_keys.append(key)
                rows[i] = row
                self.stats.saves_planned += 1
            if planned:
                run.blob = b"".join(planned_keys)
                run.alive = bytearray(b"\x01") * len(planned)
                run.live = len(planned)
                if set(map(len, planned_keys)) != {KEY_BYTES}:  # keys of other sizes are
                    for entry in planned:  # only in the per-key index
                        entry.run = None
            # Hand the rows out in ascending order: rows freed together (an LRU run) then
            # form one run, which the save path copies in one piece instead of scattering.
            kept = rows >= 0
            rows[kept] = np.sort(rows[kept])
            run.rows = rows[kept]  # a copy, in planned order
            for entry, row in zip(planned, run.rows.tolist()):
                entry.row = row
        if removed:
            self._on_removed(removed)
        return rows

    def _take_row(self, removed: list[bytes]) -> int | None:
        if self._free:
            return self._free.pop()
        while self._lru:
            key, _ = self._lru.popitem(last=False)
            entry = self._entries.get(key)
            if entry is None or self._pins[entry.row]:  # pinned: back in LRU on last unpin
                continue
            del self._entries[key]
            _left_index(entry)
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
        """The bytes of these blocks have landed in their rows: publish them. Pushes
        waiting for them are woken first and the checksums taken after (a device store's
        are a few dozen launches, a host store's a hash of every byte: neither belongs
        between a pass's end and its pushes). Until its checksum is recorded a block is
        pinned by the commit (never evicted, its row never reused) and ``verify`` skips
        it."""
        done: list[bytes] = []
        entries: list[Entry] = []
        with self._changed:
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.state is BlockState.STORED:
                    continue
                e.state = BlockState.STORED
                done.append(key)
                entries.append(e)
            rows = _rows_of(entries)
            self._pins[rows] += 1
            self._unsummed.update(done)
            self.stats.saves_committed += len(done)
            self._changed.notify_all()
        if not done:
            return
        try:
            self._on_stored(done)
        finally:
            self._sums.record(rows)  # the rows are pinned: outside the lock
            with self._changed:
                self._pins[rows] -= 1
                self._unsummed.difference_update(done)
                for key, e in zip(done, entries):
                    if self._pins[e.row]:
                        continue  # the last unpin puts it back, or frees a dead one
                    if e.dead:
                        self._free.append(e.row)
                    elif self._entries.get(key) is e:
                        self._lru[key] = None

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
        _left_index(e)
        self._lru.pop(key, None)
        e.dead = True
        if self._pins[e.row] == 0:  # else the row returns to the free list on the last unpin
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
    def longest_prefix(self, keys: KeyBlob | Sequence[bytes]) -> int:
        """How many leading keys are held (in any state)."""
        with self._lock:
            return len(self._held_prefix(keys))

    def _held_prefix(self, keys: KeyBlob | Sequence[bytes]) -> list[Entry]:
        """Entries of the longest held prefix of ``keys`` (lock held)."""
        return self._held(keys)[0]

    def _held(self, keys: KeyBlob | Sequence[bytes]) -> tuple[list[Entry], np.ndarray, bool]:
        """``_held_prefix``, with the entries' rows and whether no entry can repeat (the
        keys were found in distinct runs' ranges, so a vectorised pin counts each once)."""
        if isinstance(keys, KeyBlob):
            return self._held_prefix_packed(keys.blob)
        entries = self._held_prefix_each(keys)
        return entries, _rows_of(entries), False

    def _held_prefix_each(self, keys: Iterable[bytes]) -> list[Entry]:
        """One dict lookup per key, in one C-level pass (``map``)."""
        entries: list[Entry | None] = list(map(self._entries.get, keys))
        try:
            del entries[entries.index(None) :]
        except ValueError:
            pass
        return entries  # type: ignore[return-value]

    def _held_prefix_packed(self, blob: bytes) -> tuple[list[Entry], np.ndarray, bool]:
        """The same from packed keys, a run at a time: look the next key up, then take as
        many of the following keys as its run holds in the same order (one ``memcmp`` of
        the packed keys, and ``alive`` for blocks that left since). A prompt saved in a few
        passes costs a few lookups however many blocks it has. Runs too fragmented to pay
        (fewer than ``_MIN_RUN`` keys per lookup on average) fall back to one lookup each."""
        n = len(blob) // KEY_BYTES
        out: list[Entry] = []
        segs: list[np.ndarray] = []
        seen: set[int] = set()  # runs visited: a second visit may repeat entries
        unique = True
        get = self._entries.get
        i = hops = 0
        while i < n:
            if hops >= _MAX_SHORT_HOPS and i < _MIN_RUN * hops:
                rest = self._held_prefix_each(KeyBlob(blob[i * KEY_BYTES :]).tolist())
                out += rest
                segs.append(_rows_of(rest))
                unique = False
                break
            hops += 1
            e = get(blob[i * KEY_BYTES : (i + 1) * KEY_BYTES])
            if e is None:
                break
            run = e.run
            if run is None:  # not from a packable plan: this block alone
                out.append(e)
                segs.append(np.array([e.row], dtype=np.int64))
                unique = False
                i += 1
                continue
            if id(run) in seen:
                unique = False
            seen.add(id(run))
            p = e.pos
            k = min(n - i, len(run.entries) - p)
            mine = blob[i * KEY_BYTES : (i + k) * KEY_BYTES]
            if mine != run.blob[p * KEY_BYTES : (p + k) * KEY_BYTES]:
                k = _common_keys(mine, run.blob, p)
            gone = run.alive.find(0, p, p + k)  # a block of the run that left since
            if gone >= 0:
                k = gone - p  # >= 1: block p is e, which is held
            out += run.entries[p : p + k]  # type: ignore[arg-type]  # alive: not None
            segs.append(run.rows[p : p + k])
            i += k  # the next key (if any) is in another run, or not held
        if len(segs) > 1:
            return out, np.concatenate(segs), unique
        return out, segs[0] if segs else _NO_ROWS, unique  # a view: run rows never change

    def pin(self, keys: KeyBlob | Sequence[bytes]) -> list[Entry]:
        """Pin the longest held prefix of ``keys``; returns the pinned entries (a lease
        holds entries, not keys, so a key re-saved after an abort is not confused)."""
        return self.pin_rows(keys)[0]

    def pin_rows(self, keys: KeyBlob | Sequence[bytes]) -> tuple[list[Entry], np.ndarray, bool]:
        """``pin``, also returning the entries' rows and whether they are distinct: hand
        both back to ``unpin``/``pin_entries`` to skip recomputing them."""
        with self._lock:
            entries, rows, unique = self._held(keys)
            self._add_pins(rows, unique, 1)
            return entries, rows, unique

    def _add_pins(self, rows: np.ndarray, unique: bool, delta: int) -> None:
        if unique:
            self._pins[rows] += delta
        else:  # a row listed twice counts twice
            np.add.at(self._pins, rows, delta)

    def pin_entries(
        self,
        keys: Sequence[bytes],
        entries: Sequence[Entry],
        rows: np.ndarray | None = None,
        unique: bool = False,
    ) -> None:
        """Add a pin to entries already held (a push pins what it reads, so a lease freed
        by its TTL mid-push cannot let those rows be evicted and reused under it)."""
        with self._lock:
            self._add_pins(_rows_of(entries) if rows is None else rows, unique, 1)

    def unpin(
        self,
        keys: Sequence[bytes],
        entries: Sequence[Entry],
        rows: np.ndarray | None = None,
        unique: bool = False,
    ) -> None:
        """Remove one pin from each of ``entries`` (``keys[i]`` is entry i's key; ``rows``
        and ``unique`` as ``pin_rows`` returned them, if known). A block left unpinned
        becomes the most recently used, or frees its row if it was dropped meanwhile."""
        with self._lock:
            if rows is None:
                rows = _rows_of(entries)
            self._add_pins(rows, unique, -1)
            left = self._pins[rows]
            key_list = keys.tolist() if isinstance(keys, KeyBlob) else keys
            back = []
            if unique and not left.any():  # the usual release: every block unpinned now
                for key, e in zip(key_list, entries):
                    if e.dead:
                        self._free.append(e.row)
                    elif e.state is BlockState.STORED:
                        back.append(key)
            else:
                done: set[int] = set()  # an entry listed twice is released once
                for i in np.flatnonzero(left == 0).tolist():
                    e = entries[i]
                    if e.row in done:
                        continue
                    done.add(e.row)
                    if e.dead:
                        self._free.append(e.row)
                    elif e.state is BlockState.STORED:
                        back.append(key_list[i])
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
            return int(np.count_nonzero(self._pins[_rows_of(list(self._entries.values()))]))

    def verify(self) -> int:
        """Re-read every STORED block against its checksum; returns the number corrupted."""
        with self._lock:
            stored = [
                e
                for k, e in self._entries.items()
                if e.state is BlockState.STORED and k not in self._unsummed
            ]
            bad = self._sums.mismatches(_rows_of(stored))
        self.stats.corruptions_found += bad
        return bad


_NO_ROWS = np.empty(0, dtype=np.int64)


def _rows_of(entries: Sequence[Entry]) -> np.ndarray:
    return np.fromiter((e.row for e in entries), dtype=np.int64, count=len(entries))


# Packed lookups fall back to one dict lookup per key when, after this many lookups, the
# runs found averaged fewer than _MIN_RUN keys each.
_MAX_SHORT_HOPS = 16
_MIN_RUN = 8
# A run of at least _COMPACT_MIN blocks is compacted once at most 1/_COMPACT_BELOW of
# its blocks are still held.
_COMPACT_MIN = 64
_COMPACT_BELOW = 4
_BISECT_KEYS = 512  # _common_keys bisects up to this many keys, else compares in numpy


def _left_index(e: Entry) -> None:
    """``e`` is no longer in the store's index (lock held): its run must not offer it any
    more. A run left with a quarter of its blocks or fewer is rebuilt from the survivors
    (in order; the keys of blocks that were not adjacent become adjacent, which lookups
    handle like any mismatch: they compare the keys)."""
    run = e.run
    if run is None:
        return
    e.run = None
    if run.entries[e.pos] is not e:
        return
    run.alive[e.pos] = 0
    run.entries[e.pos] = None
    run.live -= 1
    n = len(run.entries)
    if run.live and n >= _COMPACT_MIN and run.live * _COMPACT_BELOW <= n:
        keep = np.frombuffer(run.alive, dtype=np.bool_)
        survivors = [x for x in run.entries if x is not None]
        blob = np.frombuffer(run.blob, dtype=f"V{KEY_BYTES}")[keep].tobytes()
        new = _Run(blob, list[Entry | None](survivors), run.rows[keep])
        for pos, x in enumerate(survivors):
            x.run, x.pos = new, pos


def _common_keys(mine: bytes, blob: bytes, p: int) -> int:
    """How many leading 16-byte keys of ``mine`` equal those of ``blob`` from key ``p``
    (the first one is known to be equal, and not all of them are)."""
    k = len(mine) // KEY_BYTES
    if k <= _BISECT_KEYS:  # a few memcmp of prefixes: cheaper than numpy's fixed cost
        lo, hi = 1, k  # keys [0, lo) are equal, [0, hi) are not all equal
        base = p * KEY_BYTES
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if mine[: mid * KEY_BYTES] == blob[base : base + mid * KEY_BYTES]:
                lo = mid
            else:
                hi = mid
        return lo
    a = np.frombuffer(mine, dtype="<u8")
    b = np.frombuffer(blob, dtype="<u8", count=2 * k, offset=p * KEY_BYTES)
    diff = np.flatnonzero(a != b)
    return int(diff[0]) // 2 if len(diff) else k


def _checksum(row: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(row.contiguous().numpy().data)


# Device rows are summed this many bytes at a time (the gathered copy is a temporary).
_SUM_CHUNK_BYTES = 64 << 20


class _Checksums:
    """One checksum per slab row. Host slab: xxh3-64 of the row. Device slab: a linear
    hash of the row's 8-byte words (bytes when the row is not a whole number of them)
    with fixed random odd weights, wrapping mod 2**64: a changed word always changes it.
    Device sums are enqueued on the current stream and stay on the device."""

    def __init__(self, slab: torch.Tensor, batched: bool | None = None) -> None:
        self.slab = slab
        self.device = slab.device.type != "cpu" if batched is None else batched
        if not self.device:
            self.host = np.zeros(slab.shape[0], dtype=np.uint64)
            return
        width = slab.shape[1]
        words = width // 8 if width % 8 == 0 else width
        g = torch.Generator().manual_seed(0x5EED)
        w = torch.randint(-(1 << 62), 1 << 62, (words,), generator=g, dtype=torch.int64)
        self.weights = (w * 2 + 1).to(slab.device)
        self.sums = torch.zeros(slab.shape[0], dtype=torch.int64, device=slab.device)

    def _device_sums(self, rows: np.ndarray, idx: torch.Tensor | None = None) -> torch.Tensor:
        if idx is None:
            idx = torch.from_numpy(rows).to(self.slab.device)
        out = torch.empty(len(rows), dtype=torch.int64, device=self.slab.device)
        step = max(1, _SUM_CHUNK_BYTES // max(1, self.slab.shape[1]))
        for i in range(0, len(rows), step):
            part = self.slab.index_select(0, idx[i : i + step])
            if self.weights.numel() * 8 == part.shape[1]:
                words = part.view(torch.int64)
            else:
                words = part.to(torch.int64)
            out[i : i + step] = (words * self.weights).sum(dim=1)
        return out

    def _host_sums(self, rows: np.ndarray) -> np.ndarray:
        return np.fromiter(
            (_checksum(self.slab[int(r)]) for r in rows), dtype=np.uint64, count=len(rows)
        )

    def record(self, rows: np.ndarray) -> None:
        """Checksum these rows' bytes as they are now."""
        if len(rows) == 0:
            return
        if self.device:
            idx = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
            if self.slab.device.type == "cuda":  # from pinned memory: the host never waits
                idx = idx.pin_memory().to(self.slab.device, non_blocking=True)
            self.sums[idx] = self._device_sums(rows, idx)
        else:
            self.host[rows] = self._host_sums(rows)

    def mismatches(self, rows: np.ndarray) -> int:
        """How many of these rows no longer match their recorded checksum."""
        if len(rows) == 0:
            return 0
        if self.device:
            idx = torch.from_numpy(rows).to(self.slab.device)
            return int((self._device_sums(rows) != self.sums[idx]).sum().item())
        return int(np.count_nonzero(self._host_sums(rows) != self.host[rows]))
