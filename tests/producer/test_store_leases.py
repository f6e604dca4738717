"""Block store and lease table: states, eviction, pins, named timeouts."""

import time

import numpy as np
import pytest
import torch

from disagg.producer.leases import LeaseTable
from disagg.producer.store import BlockState, BlockStore, _Checksums
from disagg.protocol.errors import ErrorCode, ProtocolError


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(store: BlockStore, keys: list[bytes], value: int) -> None:
    rows = store.plan(keys)
    store.slab[torch.from_numpy(rows[rows >= 0])] = value
    store.commit(keys)


def test_plan_commit_dedup_and_checksums():
    stored = []
    s = BlockStore(64, 64 * 4, on_stored=stored.extend)
    rows = s.plan([key(1), key(2)])
    assert sorted(rows.tolist()) == [0, 1]
    assert s.state_of(key(1)) is BlockState.PLANNED
    s.mark_staging([key(1)])
    assert s.state_of(key(1)) is BlockState.STAGING
    s.slab[rows] = 7
    s.commit([key(1), key(2)])
    assert stored == [key(1), key(2)] and s.state_of(key(2)) is BlockState.STORED
    assert s.plan([key(1)]).tolist() == [-1] and s.stats.saves_deduplicated == 1
    assert s.verify() == 0
    s.slab[int(rows[0]), 3] ^= 0xFF  # a flipped byte is found
    assert s.verify() == 1


@pytest.mark.parametrize("width", [64, 60])  # 8-byte words, or bytes
@pytest.mark.parametrize("batched", [False, True])  # host xxh3, or the device kernel's sums
def test_checksums_find_every_changed_row(batched, width):
    slab = torch.randint(0, 256, (40, width), dtype=torch.uint8)
    sums = _Checksums(slab, batched=batched)
    rows = np.array([3, 7, 8, 30, 31], dtype=np.int64)
    sums.record(rows)
    assert sums.mismatches(rows) == 0
    slab[7, width - 1] ^= 1
    slab[30, 0] ^= 0x80
    slab[5, 2] ^= 1  # not recorded: not checked
    assert sums.mismatches(rows) == 2
    sums.record(np.array([7], dtype=np.int64))  # rewritten and recommitted
    assert sums.mismatches(rows) == 1


def test_full_store_evicts_lru_unpinned_and_drops_when_all_pinned():
    removed = []
    s = BlockStore(8, 8 * 2, on_removed=removed.extend)
    fill(s, [key(1), key(2)], 1)
    leases = LeaseTable(s)
    lease = leases.grant("c", "r", [key(1)], 5)
    assert lease is not None and len(lease.keys) == 1
    fill(s, [key(3)], 3)  # key(2) is the only unpinned block: evicted
    assert removed == [key(2)] and s.state_of(key(1)) is BlockState.STORED
    assert s.plan([key(4)]).tolist() == [1]  # key(3) is now the LRU unpinned block
    assert removed == [key(2), key(3)]
    # key(1) is pinned and key(4) is still being saved: nothing can make room
    assert s.plan([key(5)]).tolist() == [-1] and s.stats.saves_dropped_full == 1


def test_claim_longest_prefix_covers_planned_blocks():
    s = BlockStore(8, 8 * 8)
    fill(s, [key(1)], 1)
    s.plan([key(2)])  # still PLANNED: a claim may cover it, a push waits for it
    leases = LeaseTable(s)
    lease = leases.grant("c", "r", [key(1), key(2), key(3)], 5)
    assert lease is not None and lease.keys == [key(1), key(2)]
    with pytest.raises(TimeoutError):
        s.wait_stored(lease.entries, time.monotonic() + 0.05)
    s.commit([key(2)])
    assert len(s.wait_stored(lease.entries, time.monotonic() + 1)) == 2


def test_abort_of_leased_block_is_reported_and_row_not_reused_until_unpin():
    s = BlockStore(8, 8 * 1)
    s.plan([key(1)])
    leases = LeaseTable(s)
    lease = leases.grant("c", "r", [key(1)], 5)
    s.abort([key(1)])
    with pytest.raises(KeyError):
        s.wait_stored(lease.entries, time.monotonic() + 1)
    assert s.plan([key(2)]).tolist() == [-1]  # the row is still named by the lease
    leases.release("c", lease.lease_id)
    assert s.plan([key(2)]).tolist() == [0]


def test_lease_errors_renew_expiry_and_dead_owner():
    s = BlockStore(8, 8 * 8)
    fill(s, [key(1), key(2)], 1)
    t = LeaseTable(s, max_ttl_s=10, owner_dead_after_s=5)
    a = t.grant("a", "r1", [key(1)], 3.0)
    b = t.grant("b", "r2", [key(2)], 1.0)
    assert a and b
    with pytest.raises(ProtocolError) as e:
        t.release("b", a.lease_id)
    assert e.value.code is ErrorCode.FOREIGN_LEASE
    with pytest.raises(ProtocolError) as e:
        t.release("a", 999)
    assert e.value.code is ErrorCode.UNKNOWN_LEASE
    assert t.renew("a", [a.lease_id, b.lease_id, 77]) == [b.lease_id, 77]
    now = time.monotonic()
    t.heartbeat("a", now + 1.5)
    assert t.sweep(now + 1.5) == 1 and t.stats.expired == 1  # b's TTL passed
    assert s.pinned_blocks() == 1
    assert t.sweep(now + 7) == 1 and t.stats.freed_dead_owner == 1  # a went silent
    assert s.pinned_blocks() == 0 and t.active() == 0


def test_stale_saves_time_out():
    s = BlockStore(8, 8 * 2, save_timeout_s=0.01)
    s.plan([key(1)])
    assert s.sweep_stale_saves(time.monotonic() + 1) == 1
    assert s.state_of(key(1)) is None and s.used_blocks() == 0


def test_rows_freed_together_come_back_as_one_ascending_run():
    s = BlockStore(8, 8 * 6)
    fill(s, [key(i) for i in range(6)], 1)  # rows 0..5, LRU order 0..5
    rows = s.plan([key(10 + i) for i in range(3)])  # evicts keys 0,1,2
    assert rows.tolist() == [0, 1, 2]


def test_lease_max_hold_frees_a_lease_renewed_forever():
    """A consumer alive and renewing but never releasing (a leaked request): its lease
    ends at LEASE_MAX_HOLD, renewals never move the deadline past it, and its blocks
    become evictable again; the owner learns at its next renewal."""
    s = BlockStore(8, 8 * 8)
    fill(s, [key(1), key(2)], 1)
    t = LeaseTable(s, max_ttl_s=10, owner_dead_after_s=5, max_hold_s=20)
    lease = t.grant("a", "r1", [key(1), key(2)], 10.0)
    assert lease is not None and s.pinned_blocks() == 2
    start = time.monotonic()
    for step in range(1, 5):  # renewals and heartbeats every 4 s: never expired, never dead
        t.heartbeat("a", start + 4 * step)
        assert t.renew("a", [lease.lease_id], start + 4 * step) == []
        assert t.sweep(start + 4 * step) == 0
    assert lease.deadline <= lease.hold_until  # renewals stop at the max hold
    t.heartbeat("a", start + 20.5)
    assert t.sweep(start + 20.5) == 1
    assert t.stats.max_hold_exceeded == 1 and t.stats.expired == 0
    assert s.pinned_blocks() == 0 and t.active() == 0
    assert t.renew("a", [lease.lease_id], start + 21) == [lease.lease_id]  # it is gone


def test_lease_max_hold_shorter_than_ttl_is_refused():
    s = BlockStore(8, 8 * 8)
    with pytest.raises(ValueError, match="max hold"):
        LeaseTable(s, max_ttl_s=30, max_hold_s=10)


def test_release_range_frees_exactly_that_range_and_keeps_the_rest_leased():
    """Prefix reservations release a lease in parts: a block range is unpinned at once
    (evictable), the rest stays pinned and pushable, a push of a released block is refused,
    overlapping releases count a block once, and the lease ends with its last block."""
    s = BlockStore(64, 64 * 16)
    keys = [key(i) for i in range(8)]
    fill(s, keys, 1)
    t = LeaseTable(s)
    lease = t.grant("c", "r", keys, 30.0)
    assert lease is not None and s.pinned_blocks() == 8
    pins = lambda: [int(s._pins[e.row]) for e in lease.entries]  # noqa: E731
    assert t.release_range("c", lease.lease_id, 2, 3) == 3
    assert pins() == [1, 1, 0, 0, 0, 1, 1, 1] and t.active() == 1
    assert t.release_range("c", lease.lease_id, 4, 2) == 1  # block 4 was released already
    assert pins() == [1, 1, 0, 0, 0, 0, 1, 1]
    with pytest.raises(ProtocolError) as ei:
        t.pin_for_push("c", lease.lease_id, 1, 2)  # block 2 is gone
    assert ei.value.code is ErrorCode.OUT_OF_RANGE
    t.pin_for_push("c", lease.lease_id, 6, 2)  # the rest is still pushable
    s.unpin(keys[6:8], lease.entries[6:8])
    with pytest.raises(ProtocolError) as ei:
        t.release_range("c", lease.lease_id, 7, 2)  # past the lease
    assert ei.value.code is ErrorCode.OUT_OF_RANGE
    with pytest.raises(ProtocolError) as ei:
        t.release_range("other", lease.lease_id, 0, 1)
    assert ei.value.code is ErrorCode.FOREIGN_LEASE
    t.release("c", lease.lease_id)  # the whole release unpins only what is still held
    assert pins() == [0] * 8 and s.pinned_blocks() == 0 and t.active() == 0
    again = t.grant("c", "r", keys[:4], 30.0)
    assert again is not None
    t.release_range("c", again.lease_id, 0, 2)
    t.release_range("c", again.lease_id, 2, 2)  # the last blocks: the lease ends
    assert t.active() == 0 and s.pinned_blocks() == 0 and t.stats.released == 2
