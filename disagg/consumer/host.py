"""What the consumer's claims, keepalive, refusals and prefetches use of the service that
owns them.

``ConsumerService`` satisfies ``LinkHost``; those modules take one at construction and
never import the service, so imports run downward (service -> claims/keepalive/refusals/
prefetch -> host -> links, loads, routes).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

from ..config import ConsumerConfig, DisaggConfig
from ..protocol.fingerprint import Fingerprint
from ..protocol.keys import KeyBlob
from .links import ProducerLink
from .loads import Claimed, Load, Reservation
from .routes import Routes


class Renewals(Protocol):
    def granted(self, ttl_s: float) -> None:
        """A producer granted a lease for ``ttl_s``."""


class HeldLeases(Protocol):
    """Leases held outside any load (prefetched): renewed and swept by the keepalive."""

    def leases(self) -> list[Claimed]: ...

    def sweep(self, now: float | None = None) -> int: ...


class RankClaims(Protocol):
    def claim_ranks(
        self, p: int, request_id: int | str, keys: list[KeyBlob], background: bool = False
    ) -> Claimed | None:
        """Lease ``keys[r]`` on producer ``p``'s rank r, the run every rank holds."""


class LinkHost(Protocol):
    """The service's links to producers, its identity and counters, and its one way to
    call a producer (``_call``: bounded, refusals noted)."""

    config: DisaggConfig
    ccfg: ConsumerConfig
    owner: str
    tp_size: int
    tp_rank: int
    fingerprint: Fingerprint | None
    metrics: Counter[str]
    links: list[ProducerLink]
    rank_links: list[dict[int, ProducerLink]]
    routes: Routes | None  # where KV heads come from (None: head-blind)
    producer_tps: list[int]  # each configured producer's TP size
    loads: dict[int, Load]
    reservations: dict[int, Reservation]

    @property
    def keepalive(self) -> Renewals: ...

    @property
    def prefetches(self) -> HeldLeases: ...

    @property
    def claims(self) -> RankClaims: ...

    def _call(
        self,
        link: ProducerLink,
        msg: Any,
        timeout_s: float | None = None,
        background: bool = False,
        waits: bool = False,
    ) -> Any: ...

    def release(self, claimed: Claimed) -> None: ...

    @property
    def zone(self) -> Any: ...  # the landing zone (``zone.LandingZone``), or None
