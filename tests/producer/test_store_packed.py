"""Claims look packed keys (a KeyBlob) up a stored run at a time; whatever the save
pattern, evictions, aborts and re-saves, the answer is the per-key lookup's."""

import random

import numpy as np
import torch

from disagg.producer.leases import LeaseTable
from disagg.producer.store import (
    _BISECT_KEYS,
    _COMPACT_MIN,
    _MAX_SHORT_HOPS,
    BlockStore,
    _common_keys,
)
from disagg.protocol.keys import KeyBlob, block_key_blob


def chain(seed: int, n: int) -> list[bytes]:
    toks = np.random.default_rng(seed).integers(0, 1 << 20, n * 4)
    return block_key_blob(bytes(16), toks, 4).tolist()


def fill(store: BlockStore, keys: list[bytes]) -> None:
    rows = store.plan(keys)
    store.slab[torch.from_numpy(rows[rows >= 0])] = 1
    store.commit(keys)


def packed_vs_each(store: BlockStore, keys: list[bytes]) -> list:
    with store._lock:
        want = store._held_prefix_each(keys)
        got = store._held_prefix(KeyBlob.of(keys))
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))
    return got


def test_a_prompt_saved_in_passes_shared_with_others_is_found_whole():
    a, b = chain(1, 100), chain(2, 70)
    s = BlockStore(8, 8 * 400)
    for j in range(0, 100, 32):  # passes of 32 blocks, each also holding b's chunk
        fill(s, a[j : j + 32] + b[j : j + 32])
    assert s.longest_prefix(KeyBlob.of(a)) == 100 and s.longest_prefix(KeyBlob.of(b)) == 70
    assert len(packed_vs_each(s, a)) == 100
    assert s.longest_prefix(KeyBlob.of(a[:37] + chain(3, 5))) == 37  # diverges mid-run
    assert s.longest_prefix(KeyBlob.of(a[5:])) == 95  # a suffix (mid-run start) is held too
    assert s.longest_prefix(KeyBlob()) == 0 and s.longest_prefix(KeyBlob.of(chain(4, 3))) == 0


def test_a_block_gone_from_its_run_ends_the_prefix_until_saved_again():
    a = chain(1, 40)
    s = BlockStore(8, 8 * 41)
    fill(s, a)
    with s._changed:  # block 17 aborted/evicted (the TP test drops one like this)
        s._drop(a[17], s._entries[a[17]])
    assert s.longest_prefix(KeyBlob.of(a)) == 17
    packed_vs_each(s, a)
    fill(s, [a[17]])  # saved again, in a run of its own: found through the index
    assert s.longest_prefix(KeyBlob.of(a)) == 40
    packed_vs_each(s, a)


def test_eviction_ends_the_prefix_and_pins_hold_what_a_claim_found():
    removed: list[bytes] = []
    a, b = chain(1, 12), chain(2, 6)
    s = BlockStore(8, 8 * 12, on_removed=removed.extend)
    fill(s, a)
    lease = LeaseTable(s).grant("c", "r", KeyBlob.of(a[:4]), 5.0)
    assert lease is not None and isinstance(lease.keys, KeyBlob) and lease.keys == a[:4]
    fill(s, b)  # evicts the 6 least recent unpinned blocks: a[4:10]
    assert removed == a[4:10]
    assert s.longest_prefix(KeyBlob.of(a)) == 4 and s.pinned_blocks() == 4
    packed_vs_each(s, a)
    s.unpin(lease.keys, lease.entries)
    assert s.pinned_blocks() == 0


def test_fragmented_runs_fall_back_to_one_lookup_per_key():
    a = chain(1, 4 * _MAX_SHORT_HOPS)
    s = BlockStore(8, 8 * len(a))
    for k in reversed(a):  # one plan per block: every run holds one key
        fill(s, [k])
    assert len(packed_vs_each(s, a)) == len(a)
    assert len(packed_vs_each(s, a[:-1] + chain(9, 1))) == len(a) - 1


def test_keys_of_other_sizes_are_held_but_never_in_a_run():
    s = BlockStore(8, 8 * 8)
    odd = [b"short", b"x" * 16]
    fill(s, odd)
    assert all(s._entries[k].run is None for k in odd)
    assert s.longest_prefix(odd) == 2 and s.longest_prefix(KeyBlob.of(odd[1:])) == 1


def test_a_run_mostly_gone_is_compacted_to_its_survivors():
    n = 4 * _COMPACT_MIN
    a = chain(1, n)
    s = BlockStore(8, 8 * n)
    fill(s, a)
    run = s._entries[a[0]].run
    keep = set(range(0, n, 5)) | set(range(100, 110))  # a tenth or so, partly adjacent
    with s._changed:
        for i in range(n):
            if i not in keep:
                s._drop(a[i], s._entries[a[i]])
    new = s._entries[a[0]].run
    assert new is not run and new.live == len(keep) and len(new.entries) <= n // 4
    held = [new.blob[16 * i : 16 * (i + 1)] for i, ok in enumerate(new.alive) if ok]
    assert held == [a[i] for i in sorted(keep)]  # the survivors, in order
    assert all(s._entries[a[i]].run is new for i in keep)
    for q in (a, a[100:], a[105:], a[::5], [a[i] for i in sorted(keep)]):
        packed_vs_each(s, q)
    assert s.longest_prefix(KeyBlob.of(a[100:])) == 11  # 100..110 (110 is a fifth)


def test_packed_lookup_matches_the_per_key_lookup_under_churn():
    """Random save passes (interleaved chains, dedup, a store far too small, so LRU
    eviction is constant and long runs get compacted), aborts, re-saves and claims of
    prefixes, suffixes, spliced and duplicated keys: the packed lookup returns the very
    entries the per-key one does."""
    rng = random.Random(5)
    chains = [chain(i, rng.randrange(1, 200)) for i in range(12)]
    s = BlockStore(8, 8 * 250)
    leases: list = []
    table = LeaseTable(s)
    for step in range(400):
        op = rng.random()
        if op < 0.45:  # a pass: chunks of a few chains
            keys: list[bytes] = []
            for c in rng.sample(chains, rng.randrange(1, 4)):
                j = rng.randrange(len(c))
                keys += c[j : j + rng.randrange(1, 120)]
            rows = s.plan(keys)
            if rng.random() < 0.8:
                s.commit(keys)
            else:
                s.abort([k for k, r in zip(keys, rows, strict=True) if r >= 0][:3])
        elif op < 0.75:  # a claim
            c = rng.choice(chains)
            q = c[rng.randrange(len(c)) :] if rng.random() < 0.3 else list(c)
            if rng.random() < 0.2:
                q = q[:5] + rng.choice(chains)[:5] + q[5:]
            if rng.random() < 0.1 and q:
                q = [q[0]] * 3 + q
            packed_vs_each(s, q)
            lease = table.grant("c", str(step), KeyBlob.of(q), 5.0)
            if lease is not None:
                assert lease.keys == q[: len(lease.entries)]
                leases.append(lease)
        elif leases and op < 0.85:  # a push pins part of a lease, then unpins it as the
            lease = rng.choice(leases)  # push path does: by entries, rows recomputed
            a = rng.randrange(len(lease.entries))
            b = rng.randrange(a, len(lease.entries)) + 1
            pinned = table.pin_for_push("c", lease.lease_id, a, b - a)
            s.unpin(pinned.keys[a:b], pinned.entries[a:b])
        elif leases:  # a release
            table.release("c", leases.pop(rng.randrange(len(leases))).lease_id)
        assert (s._pins >= 0).all()
    for lease in leases:
        table.release("c", lease.lease_id)
    assert s.pinned_blocks() == 0 and s.verify() == 0
    assert not s._pins.any()  # every pin taken was given back, once
    for c in chains:
        packed_vs_each(s, c)


def test_a_claim_listing_a_block_twice_pins_it_twice_and_unpins_it_cleanly():
    a = chain(1, 8)
    removed: list[bytes] = []
    s = BlockStore(8, 8 * 8, on_removed=removed.extend)
    fill(s, a)
    table = LeaseTable(s)
    lease = table.grant("c", "r", KeyBlob.of(a[:3] + a[:3] + a[3:]), 5.0)
    assert lease is not None and len(lease.entries) == 11 and not lease.unique_rows
    assert [e.pins for e in lease.entries[:3]] == [2, 2, 2] and lease.entries[6].pins == 1
    other = table.grant("c", "r2", KeyBlob.of(a), 5.0)
    assert other is not None and other.unique_rows and lease.entries[0].pins == 3
    table.release("c", lease.lease_id)
    assert [e.pins for e in other.entries] == [1] * 8
    table.release("c", other.lease_id)
    assert s.pinned_blocks() == 0 and not s._pins.any()
    fill(s, chain(2, 8))  # every block of `a` is evictable again, oldest first
    assert removed == a


def test_common_keys_bisects_short_runs_and_compares_long_ones_in_numpy():
    for k in (2, 3, 17, _BISECT_KEYS, _BISECT_KEYS + 1, 3 * _BISECT_KEYS):
        a = chain(k, k)
        for j in sorted({1, 2, k // 2, k - 1} - {0, k}):
            b = a[:j] + chain(k + 1, k - j)
            p = 5  # the run holds 5 other keys first
            run_blob = b"".join(chain(99, p) + b)
            assert _common_keys(b"".join(a), run_blob, p) == j, (k, j)
