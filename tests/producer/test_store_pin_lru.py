"""BlockStore pins leave keys in the LRU (claims of long prompts are one pass): eviction
skips pinned keys, and the last unpin makes a key the most recently used."""

import torch

from disagg.producer.store import BlockState, BlockStore


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(store: BlockStore, keys: list[bytes]) -> None:
    rows = store.plan(keys)
    store.slab[torch.from_numpy(rows[rows >= 0])] = 1
    store.commit(keys)


def test_longest_prefix_and_pin_stop_at_the_first_missing_key():
    s = BlockStore(8, 8 * 8)
    fill(s, [key(1), key(2), key(4)])
    assert s.longest_prefix([key(1), key(2), key(3), key(4)]) == 2
    assert s.longest_prefix([key(3), key(1)]) == 0 and s.longest_prefix([]) == 0
    entries = s.pin([key(1), key(2), key(3), key(4)])
    assert [e.pins for e in entries] == [1, 1] and s.pinned_blocks() == 2
    assert s.pin([key(9)]) == []
    s.unpin([key(1), key(2)], entries)
    assert s.pinned_blocks() == 0


def test_eviction_skips_pinned_keys_and_unpin_makes_them_most_recent():
    removed: list[bytes] = []
    s = BlockStore(8, 8 * 3, on_removed=removed.extend)
    fill(s, [key(1), key(2), key(3)])  # LRU order 1, 2, 3
    pinned = s.pin([key(1)])
    fill(s, [key(4)])  # 1 is pinned (skipped and dropped from the LRU): 2 goes
    assert removed == [key(2)] and s.state_of(key(1)) is BlockState.STORED
    s.unpin([key(1)], pinned)  # back in the LRU, as the most recent
    fill(s, [key(5)])
    assert removed == [key(2), key(3)]
    fill(s, [key(6)])
    assert removed == [key(2), key(3), key(4)]
    fill(s, [key(7)])
    assert removed == [key(2), key(3), key(4), key(1)]


def test_unpin_of_keys_never_evicted_moves_them_to_the_end():
    removed: list[bytes] = []
    s = BlockStore(8, 8 * 3, on_removed=removed.extend)
    fill(s, [key(1), key(2), key(3)])
    entries = s.pin([key(1), key(2)])
    s.unpin([key(1), key(2)], entries)  # order now 3, 1, 2
    fill(s, [key(4), key(5)])
    assert removed == [key(3), key(1)]


def test_a_block_pinned_twice_stays_until_the_last_unpin():
    removed: list[bytes] = []
    s = BlockStore(8, 8 * 2, on_removed=removed.extend)
    fill(s, [key(1), key(2)])
    a = s.pin([key(1)])
    b = s.pin([key(1)])
    s.unpin([key(1)], a)
    fill(s, [key(3)])
    assert removed == [key(2)]
    assert s.plan([key(4)]).tolist() == [1]  # only key(3) could go
    assert removed == [key(2), key(3)]
    s.unpin([key(1)], b)
    s.commit([key(4)])
    fill(s, [key(5)])
    assert removed == [key(2), key(3), key(1)]


def test_entries_compare_by_identity():
    s = BlockStore(8, 8 * 4)
    fill(s, [key(1), key(2)])
    a, b = s.pin([key(1), key(2)])
    a.row, b.row = 0, 0  # equal fields, different entries
    assert a != b and a == a


def test_a_commit_wakes_its_pushes_before_the_checksums_and_holds_the_rows_until_then():
    """``on_stored`` (the pushes' wake) runs before the commit's checksums: the blocks
    are STORED and readable then, but pinned by the commit (a plan cannot evict them)
    and skipped by ``verify``; once the checksums are in, they are evictable and checked,
    and a push's pin taken meanwhile still holds them."""
    seen: list[tuple] = []
    s = BlockStore(8, 8 * 2)

    def woken(keys):
        seen.append((s.pinned_blocks(), s.verify(), s.plan([key(9)]).tolist()))
        entries = s.pin(keys)  # a push reading the rows
        rows = s.wait_stored(entries, 0.0)
        s.slab[torch.from_numpy(rows)] = 7  # what the checksums are taken of
        seen.append(entries)

    s._on_stored = woken
    rows = s.plan([key(1), key(2)])
    s.commit([key(1), key(2)])
    assert seen[0] == (2, 0, [-1])  # pinned, unchecked, not evictable (the plan drops)
    assert s.pinned_blocks() == 2 and s.verify() == 0  # the push's pins hold; sums agree
    s.slab[int(rows[0])] = 3
    assert s.verify() == 1  # checked now
    s.unpin([key(1), key(2)], seen[1])
    assert s.pinned_blocks() == 0
    assert s.plan([key(3)]).tolist() != [-1]  # evictable now
