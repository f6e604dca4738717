"""What the consumer's claims, keepalive and refusals use of the service that owns them.

``ConsumerService`` satisfies ``LinkHost``; the three modules take one at construction and
never import the service, so imports run downward (service -> claims/keepalive/refusals ->
host -> links, loads, routes).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

from ..config import ConsumerConfig, DisaggConfig
from ..protocol.fingerprint import Fingerprint
from .links import ProducerLink
from .loads import Claimed, Load, Reservation
from .routes import Routes


class Renewals(Protocol):
    def granted(self, ttl_s: float) -> None:
        """A producer granted a lease for ``ttl_s``."""


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

    def _call(
        self,
        link: ProducerLink,
        msg: Any,
        timeout_s: float | None = None,
        background: bool = False,
    ) -> Any: ...

    def release(self, claimed: Claimed) -> None: ...
