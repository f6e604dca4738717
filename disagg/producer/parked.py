"""Claims that wait for their blocks: a consumer's prefetch asks once, the answer comes
when this producer holds every key.

A ``Claim`` with ``wait_s`` > 0 that this producer cannot grant whole at once is parked,
not answered: it is answered with a lease of every key as soon as a pass's reservation
makes them held (``held``, from the engine thread after ``store.plan``), else with a miss
(``num_blocks`` 0) once ``wait_s`` has passed. The consumer's prefetch thus learns of the
blocks the moment the producer reserves them (after the pass's first token is sent),
without polling the producer while it prefills (each lookup answered then would take its
GIL from the forward) and without the round trip of a claim after the continuation came.

Contract:
- everything here but ``held`` runs on the control server's thread (its handler,
  ``call_soon``, ``every_poll``); ``held`` only schedules a check there;
- a parked claim is answered exactly once: a whole lease, or a miss at its deadline (a
  part of the keys held is no answer: that part's lease is given back at once);
- at most ``MAX_PARKED`` wait at once; more are answered at once (a whole lease or a
  miss); a consumer whose connection goes away leaves its parked claims to their deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..protocol import messages as m
from ..protocol.version import PROTOCOL_VERSION
from ..transport.control import ControlServer, Later

MAX_PARKED = 64


@dataclass
class _Parked:
    owner: str
    claim: m.Claim
    later: Later
    deadline: float


class ParkedClaims:
    """The claims waiting for their blocks on one producer (rank)."""

    def __init__(self, leases: Any, metrics: Any, incarnation: int) -> None:
        self.leases, self.metrics, self.incarnation = leases, metrics, incarnation
        self.server: ControlServer | None = None
        self._parked: list[_Parked] = []
        self._check_queued = False

    def claim(self, owner: str, msg: m.Claim) -> m.ClaimOk | Later:
        """Answer ``msg`` at once if every key is held (or it cannot wait), else park it."""
        lease = self.leases.grant(owner, msg.request_id, msg.keys, msg.ttl_s)
        if lease is not None and len(lease.entries) == len(msg.keys):
            self.metrics["claims_hit"] += 1
            return self._answer(lease, msg)
        if lease is not None:  # a part is no answer to a waiting claim
            self.leases.release(owner, lease.lease_id)
        if self.server is None or msg.wait_s <= 0 or len(self._parked) >= MAX_PARKED:
            self.metrics["claims_miss"] += 1
            return self._answer(None, msg)
        later = self.server.later()
        self._parked.append(_Parked(owner, msg, later, time.monotonic() + msg.wait_s))
        self.metrics["claims_parked"] += 1
        return later

    def held(self) -> None:
        """Blocks became held (engine thread, after a reservation): the parked claims are
        tried again on the server thread."""
        if self._parked and self.server is not None and not self._check_queued:
            self._check_queued = True
            self.server.call_soon(self._check)

    def expire(self) -> None:
        """Answer the parked claims past their deadline with a miss (server thread)."""
        if not self._parked:
            return
        now = time.monotonic()
        keep = []
        for p in self._parked:
            if now < p.deadline:
                keep.append(p)
                continue
            self.metrics["claims_miss"] += 1
            p.later.answer(self._answer(None, p.claim))
        self._parked = keep

    def _check(self) -> None:
        self._check_queued = False
        keep = []
        for p in self._parked:
            lease = self.leases.grant(p.owner, p.claim.request_id, p.claim.keys, p.claim.ttl_s)
            if lease is not None and len(lease.entries) == len(p.claim.keys):
                self.metrics["claims_hit"] += 1
                self.metrics["claims_parked_granted"] += 1
                p.later.answer(self._answer(lease, p.claim))
                continue
            if lease is not None:
                self.leases.release(p.owner, lease.lease_id)
            keep.append(p)
        self._parked = keep
        self.expire()

    def _answer(self, lease: Any, msg: m.Claim) -> m.ClaimOk:
        return claim_ok(lease, msg.ttl_s, self.incarnation)


def claim_ok(lease: Any, ttl_s: float, incarnation: int) -> m.ClaimOk:
    """A Claim's answer: ``lease`` (one block per leased key), or a miss (None)."""
    if lease is None:
        return m.ClaimOk(
            v=PROTOCOL_VERSION, lease_id=0, num_blocks=0, ttl_s=ttl_s, incarnation=incarnation
        )
    return m.ClaimOk(
        v=PROTOCOL_VERSION,
        lease_id=lease.lease_id,
        num_blocks=len(lease.entries),
        ttl_s=lease.ttl_s,
        incarnation=incarnation,
    )
