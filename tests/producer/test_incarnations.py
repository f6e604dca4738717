"""Incarnations on the wire and the sweeper's own clock (issue 25), in one process.

- a request naming another producer incarnation is refused by name (STALE_INCARNATION)
  and never touches a lease of the live one;
- a TP=1 consumer that says Hello with a new incarnation (it restarted) loses the old
  process's leases at once, and the old connection must say Hello again;
- a lease table whose own sweeps were stalled forgives everyone once, then judges again;
- an event stream of a new incarnation is resynced even when its numbers are below the
  old stream's and its first event was missed.
"""

from __future__ import annotations

import time

import pytest
from harness import SHAPE, close_all_services, make_producer, prompts, run

from disagg.engine.reference import EngineConfig
from disagg.producer.leases import LeaseTable
from disagg.producer.store import BlockStore
from disagg.protocol import messages as m
from disagg.protocol.errors import ErrorCode, ProtocolError
from disagg.protocol.keys import block_key_blob
from disagg.transport import ControlClient
from disagg.transport.events import EventSubscriber

CFG = EngineConfig(**SHAPE)


@pytest.fixture(scope="module")
def producer():
    prod, psvc = make_producer(CFG, lease_ttl_s=30.0, owner_dead_after_s=30.0)
    ps = prompts(n=1)
    run(prod, ps, 1)
    keys = block_key_blob(psvc.namespace_seed(None), ps[0], CFG.tokens_per_block)
    yield psvc, keys
    close_all_services()


def _client(psvc, owner: str, incarnation: int) -> tuple[ControlClient, m.HelloOk]:
    c = ControlClient(psvc.endpoint, default_timeout_s=5.0)
    ok = c.call(
        m.Hello(
            instance_id=owner,
            role="consumer",
            fingerprint=psvc.fingerprint,
            incarnation=incarnation,
        )
    )
    assert isinstance(ok, m.HelloOk)
    return c, ok


def test_requests_naming_another_incarnation_are_refused_by_name(producer):
    psvc, keys = producer
    c, ok = _client(psvc, "inc-a", 11)
    try:
        assert ok.incarnation == psvc.incarnation != 0
        lease = c.call(
            m.Claim(owner="inc-a", request_id="1", keys=keys, incarnation=ok.incarnation)
        )
        assert lease.num_blocks == len(keys) and lease.incarnation == psvc.incarnation
        before = psvc.leases.active()
        dead = psvc.incarnation ^ 0x5A5A
        for msg in (
            m.Release(owner="inc-a", lease_id=lease.lease_id, incarnation=dead),
            m.ReleaseRange(
                owner="inc-a",
                lease_id=lease.lease_id,
                first_block=0,
                num_blocks=1,
                incarnation=dead,
            ),
            m.Renew(owner="inc-a", lease_ids=[lease.lease_id], incarnation=dead),
            m.Claim(owner="inc-a", request_id="2", keys=keys, incarnation=dead),
            m.Lookup(owner="inc-a", keys=keys, incarnation=dead),
        ):
            with pytest.raises(ProtocolError) as e:
                c.call(msg)
            assert e.value.code is ErrorCode.STALE_INCARNATION, e.value
            assert f"{dead:#x}" in e.value.message and "restarted" in e.value.message
        assert psvc.leases.active() == before  # nothing freed, nothing granted
        # the live incarnation's own release works
        c.call(m.Release(owner="inc-a", lease_id=lease.lease_id, incarnation=psvc.incarnation))
        assert psvc.leases.active() == before - 1
    finally:
        c.close()


def test_lease_ids_start_at_a_random_base(producer):
    psvc, keys = producer
    c, ok = _client(psvc, "inc-b", 12)
    try:
        lease = c.call(m.Claim(owner="inc-b", request_id="1", keys=keys))
        assert lease.lease_id > 1  # not 1, 2, ... again after every restart
        c.call(m.Release(owner="inc-b", lease_id=lease.lease_id))
    finally:
        c.close()


def test_a_restarted_consumer_loses_the_old_process_leases(producer):
    psvc, keys = producer
    old, _ = _client(psvc, "inc-c", 21)
    try:
        lease = old.call(m.Claim(owner="inc-c", request_id="1", keys=keys))
        assert "inc-c" in psvc.leases.owners()
        new, _ = _client(psvc, "inc-c", 22)  # the same name, a new process
        try:
            assert "inc-c" not in psvc.leases.owners()
            assert psvc.leases.stats.freed_owner_restart >= 1
            # the old process's connection is no longer this owner's
            with pytest.raises(ProtocolError) as e:
                old.call(m.Release(owner="inc-c", lease_id=lease.lease_id))
            assert e.value.code is ErrorCode.UNAUTHENTICATED
            # the new process claims as usual
            again = new.call(m.Claim(owner="inc-c", request_id="2", keys=keys))
            assert again.num_blocks == len(keys)
            new.call(m.Release(owner="inc-c", lease_id=again.lease_id))
        finally:
            new.close()
    finally:
        old.close()


def _owned_lease(
    blocks: int = 2, stall_after_s: float | None = 1.0
) -> tuple[BlockStore, LeaseTable, float]:
    """A lease table (TTL 1 s, owner dead after 0.6 s) whose one owner, heard from at t0,
    holds a 1 s lease of ``blocks`` stored blocks: (store, table, t0)."""
    store = BlockStore(64, 64 * 8)
    keys = [bytes([i]) * 16 for i in range(blocks)]
    store.plan(keys)
    store.commit(keys)
    table = LeaseTable(store, max_ttl_s=1.0, owner_dead_after_s=0.6, stall_after_s=stall_after_s)
    t0 = time.monotonic()  # grant() stamps its deadlines on this clock
    table.heartbeat("owner", now=t0)
    assert table.grant("owner", "r", keys, 1.0) is not None
    return store, table, t0


def test_a_stalled_sweeper_forgives_once_then_judges():
    store, table, t0 = _owned_lease(blocks=4)
    assert table.sweep(now=t0 + 0.25) == 0
    # the producer itself was stopped for 5 s: the owner's silence is ours
    assert table.sweep(now=t0 + 5.25) == 0
    assert table.active() == 1 and table.stats.stalls_forgiven == 1
    # STALL_GRACE (0.6 + 2 x 1.0 s from the resume) covers the owner's reconnect: neither
    # its silence nor the lease's TTL is judged inside it
    assert table.stall_grace_s == 2.6
    for at in (5.5, 6.25, 7.0, 7.75):
        assert table.sweep(now=t0 + at) == 0
    # the owner stays silent past the grace's end on our own clock: dead
    assert table.sweep(now=t0 + 7.9) == 1
    assert table.stats.freed_dead_owner == 1 and store.pinned_blocks() == 0


def test_a_stall_before_the_first_sweep_is_a_stall():
    """Stopped within one sweep period of starting: the first sweep's gap counts from the
    table's start."""
    store, table, t0 = _owned_lease()
    assert table.sweep(now=t0 + 5.0) == 0  # the first sweep ever, after a 5 s stop
    assert table.stats.stalls_forgiven == 1 and table.active() == 1


def test_an_owner_heard_from_after_a_stall_is_judged_as_usual_again():
    store, table, t0 = _owned_lease()
    assert table.sweep(now=t0 + 0.25) == 0
    assert table.sweep(now=t0 + 5.25) == 0  # our own stall: the grace opens
    table.heartbeat("owner", now=t0 + 5.5)  # it reached us again, then went silent
    assert table.sweep(now=t0 + 6.0) == 0
    assert table.sweep(now=t0 + 6.2) == 1  # one OWNER_DEAD_AFTER after it was heard
    assert table.stats.freed_dead_owner == 1


def test_without_stall_detection_the_pause_would_have_freed_a_live_lease():
    """The control case: the same timeline, judged without the own-clock rule."""
    _, table, t0 = _owned_lease(stall_after_s=None)
    assert table.sweep(now=t0 + 0.25) == 0
    assert table.sweep(now=t0 + 5.25) == 1


def test_events_of_a_new_incarnation_resync_even_below_the_old_numbers():
    delivered: list[m.Message] = []
    snapshots = {"inc": 1, "keys": [b"a" * 16], "seq": 10}

    def snapshot(producer: str) -> m.SnapshotOk:
        return m.SnapshotOk(
            producer=producer,
            seq=snapshots["seq"],
            keys=snapshots["keys"],
            incarnation=snapshots["inc"],
        )

    sub = EventSubscriber([], delivered.append, snapshot)
    try:
        assert sub.resync("p")
        assert sub.synced("p") == (1, 10)
        # the producer restarts: incarnation 2 numbers from 1, and its event 1 is lost
        snapshots.update(inc=2, keys=[b"b" * 16], seq=1)
        sub._apply(m.Stored(producer="p", seq=2, keys=[b"c" * 16], incarnation=2))
        assert sub.synced("p") == (2, 2)
        assert isinstance(delivered[-2], m.SnapshotOk) and delivered[-2].keys == [b"b" * 16]
        assert isinstance(delivered[-1], m.Stored) and delivered[-1].keys == [b"c" * 16]
        # a late event of the dead incarnation is not applied to the new one's keys
        n = len(delivered)
        sub._apply(m.Removed(producer="p", seq=3, keys=[b"b" * 16], incarnation=1))
        assert not any(isinstance(e, m.Removed) for e in delivered[n:])
    finally:
        sub.close()
