"""Claims that wait at the producer for their blocks (disagg/producer/parked.py): answered
with a whole lease once a reservation makes every key held, with a miss at their deadline
or at once when too many wait; never with a part of the keys."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from disagg.producer import parked
from disagg.producer.parked import ParkedClaims
from disagg.protocol import messages as m

KEY = 16


@dataclass
class _Lease:
    lease_id: int
    entries: list[bytes]
    ttl_s: float = 30.0


@dataclass
class _Leases:
    """Holds the leading keys in ``held``; grants the longest held prefix."""

    held: set[bytes] = field(default_factory=set)
    granted: dict[int, _Lease] = field(default_factory=dict)
    released: list[int] = field(default_factory=list)

    def grant(self, owner, request_id, keys, ttl_s):
        run = []
        for i in range(len(keys)):
            k = keys.blob[i * KEY : (i + 1) * KEY]
            if k not in self.held:
                break
            run.append(k)
        if not run:
            return None
        lease = _Lease(len(self.granted) + len(self.released) + 1, run, ttl_s)
        self.granted[lease.lease_id] = lease
        return lease

    def release(self, owner, lease_id):
        self.granted.pop(lease_id)
        self.released.append(lease_id)


class _Later:
    def __init__(self) -> None:
        self.answers: list[m.ClaimOk] = []

    def answer(self, reply):
        self.answers.append(reply)


class _Server:
    def later(self):
        return _Later()

    def call_soon(self, fn):
        fn()  # on "the server thread" at once


def _claim(keys: list[bytes], wait_s: float = 5.0) -> m.Claim:
    return m.Claim(owner="c", request_id="prefetch", keys=keys, wait_s=wait_s)


def _parked(leases: _Leases) -> ParkedClaims:
    p = ParkedClaims(leases, Counter(), incarnation=7)
    p.server = _Server()  # type: ignore[assignment]
    return p


def test_a_waiting_claim_is_answered_whole_once_every_key_is_held(monkeypatch):
    monkeypatch.setattr(parked, "MAX_PARKED", 2)
    keys = [bytes([i]) * KEY for i in range(4)]
    leases = _Leases(held=set(keys[:2]))  # a part held: no answer yet
    p = _parked(leases)
    first, second = p.claim("c", _claim(keys)), p.claim("c", _claim(keys[1:]))
    assert isinstance(first, _Later) and isinstance(second, _Later)
    assert not leases.granted and len(leases.released) == 2  # the parts were given back
    full = p.claim("c", _claim(keys))  # too many wait: answered at once, never a part
    assert isinstance(full, m.ClaimOk) and full.num_blocks == 0 and not leases.granted
    leases.held.add(keys[2])
    p.held()  # still a part for both
    assert not first.answers and not second.answers and not leases.granted
    leases.held.add(keys[3])
    p.held()
    ((a,),) = (first.answers,)
    ((b,),) = (second.answers,)
    assert (a.num_blocks, b.num_blocks) == (4, 3) and a.incarnation == 7
    assert {a.lease_id, b.lease_id} == set(leases.granted)
    assert p.metrics["claims_parked"] == 2 and p.metrics["claims_parked_granted"] == 2
    assert p.claim("c", _claim(keys)).num_blocks == 4  # held: answered at once


def test_a_waiting_claim_past_its_deadline_is_answered_with_a_miss():
    keys = [bytes([i]) * KEY for i in range(2)]
    p = _parked(_Leases())
    waiting = p.claim("c", _claim(keys, wait_s=0.05))
    p.expire()
    assert not waiting.answers  # not yet
    time.sleep(0.06)
    p.expire()
    assert [a.num_blocks for a in waiting.answers] == [0]
    p.held()  # answered once only
    assert len(waiting.answers) == 1


def test_a_claim_that_may_not_wait_is_never_parked():
    keys = [bytes([i]) * KEY for i in range(3)]
    leases = _Leases(held=set(keys[:1]))
    p = _parked(leases)
    reply = p.claim("c", _claim(keys, wait_s=0.0))
    assert isinstance(reply, m.ClaimOk) and reply.num_blocks == 0 and not leases.granted
    assert p.metrics["claims_parked"] == 0
