"""Liveness fixes on the producer: a push pins what it reads, independently of its lease."""

import pytest
import torch

from disagg.producer.leases import LeaseTable
from disagg.producer.store import BlockStore
from disagg.protocol.errors import ErrorCode, ProtocolError


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(store: BlockStore, keys: list[bytes], value: int) -> None:
    rows = store.plan(keys)
    store.slab[torch.from_numpy(rows[rows >= 0])] = value
    store.commit(keys)


def test_lease_freed_mid_push_cannot_let_its_rows_be_reused():
    """A lease swept (dead owner, TTL) while its push is in flight must not let the
    pushed rows be evicted and rewritten under the data plane."""
    s = BlockStore(64, 64 * 4)
    fill(s, [key(i) for i in range(4)], 7)
    t = LeaseTable(s, max_ttl_s=1.0, owner_dead_after_s=0.5)
    lease = t.grant("c1", "r1", [key(0), key(1)], 1.0)
    assert lease is not None
    t.pin_for_push("c1", lease.lease_id, 0, 2)
    assert t.sweep(now=lease.deadline + 100) == 1  # owner dead: the lease is gone
    assert t.active() == 0 and s.pinned_blocks() == 2  # but the push still pins its rows
    rows = s.plan([key(10 + i) for i in range(4)])  # a burst of new saves
    assert (rows >= 0).sum() == 2 and s.stats.saves_dropped_full == 2
    assert {int(e.row) for e in lease.entries}.isdisjoint(rows[rows >= 0].tolist())
    s.unpin(lease.keys, lease.entries)  # the push is final
    assert s.pinned_blocks() == 0 and s.verify() == 0


def test_pin_for_push_refuses_unknown_and_foreign_leases():
    s = BlockStore(64, 64 * 4)
    fill(s, [key(0)], 1)
    t = LeaseTable(s)
    lease = t.grant("c1", "r1", [key(0)], 5.0)
    assert lease is not None
    with pytest.raises(ProtocolError) as e:
        t.pin_for_push("c2", lease.lease_id, 0, 1)
    assert e.value.code is ErrorCode.FOREIGN_LEASE
    with pytest.raises(ProtocolError) as e:
        t.pin_for_push("c1", 999, 0, 1)
    assert e.value.code is ErrorCode.UNKNOWN_LEASE
    assert s.pinned_blocks() == 1  # only the lease's own pin
