"""Producers that refuse this consumer: said once, skipped on the request path, retried.

Contract: a call on a link (``ConsumerService._call``) that a producer refuses for a
configuration reason (its handshake refused our CURVE keys or mechanism:
``HandshakeRefused``; another protocol version: BAD_VERSION; a Hello whose fingerprint or
transport differs: INCOMPATIBLE_PEER naming the field) marks the link refused
(``ProducerLink.refusal``). A refused link is not usable: claims skip it without a call,
so a request pays nothing for it (the engine computes the prompt). Nothing of the
configuration can change without a restart or an operator's edit, so one background
thread ("disagg-refusals", started at the first refusal) tries each refused link again
every ``REFUSED_RETRY_S`` (a ``Heartbeat`` on the link's background channel, after its
Hello); the first call that succeeds clears the refusal.

Said at warning level once per link and state change (refused for a reason, refused
for another, accepted again), naming the producer endpoint and the fix (which config
field, which key file). Counted per reason (``refused_<reason>``: every refusal, the
retries' included; ``handshake_refused``: per state change). ``report()`` is what the
consumer's ``/health`` body lists: ``refused_by`` (one entry per refused link) and, when
every configured producer refuses us, ``degraded`` (the instance still serves, computing
every prompt itself).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..protocol import messages as m
from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.version import PROTOCOL_VERSION
from ..transport.refusals import HandshakeRefused

if TYPE_CHECKING:
    from .host import LinkHost
    from .links import ProducerLink

log = logging.getLogger("disagg.consumer")

# A refused producer is tried again this often (in the background, never on a request).
REFUSED_RETRY_S = 30.0


@dataclass(frozen=True)
class Refusal:
    """Why a producer refuses us: ``reason`` (refusals.REASONS), what it or ZMQ said,
    the fix, and since when (wall clock, for ``/health``)."""

    reason: str
    message: str
    fix: str
    since: float


def reason_of(exc: BaseException) -> str | None:
    """The refusal reason ``exc`` amounts to; None for a failure that is not one (a dead
    or slow producer, an error about one request)."""
    if isinstance(exc, HandshakeRefused):
        return exc.reason
    if isinstance(exc, ProtocolError):
        if exc.code is ErrorCode.BAD_VERSION:
            return "bad_version"
        if exc.code is ErrorCode.INCOMPATIBLE_PEER:
            return "incompatible"
    return None


def _fix(reason: str, security: Any) -> str:
    """The change that ends a refusal for ``reason``, in this consumer's config terms."""
    curve = security is not None and security.enabled
    if reason == "key_not_allowed":
        return (
            f"add this consumer's public key ({security.curve_public_key_file}) to the "
            "producer's security.allowed_client_keys, or point security.curve_secret_key_file "
            "and curve_public_key_file at a key pair the producer allows"
        )
    if reason == "server_key_mismatch":
        return (
            f"set security.server_public_key (now {security.server_public_key}) to the "
            "producer's public key file (its NAME.key.pub); check that curve_secret_key_file "
            "and curve_public_key_file are one pair from `disagg keys`; a producer without "
            "CURVE needs a security section too"
        )
    if reason == "curve_mismatch":
        if curve:
            return (
                "the producer runs without CURVE: give it a security section (listing this "
                "consumer's public key in allowed_client_keys), or remove this consumer's"
            )
        return (
            "the producer requires CURVE: add a security section (curve_secret_key_file and "
            "curve_public_key_file from `disagg keys NAME`, server_public_key: the producer's "
            "NAME.key.pub) and list this consumer's public key in the producer's "
            "security.allowed_client_keys"
        )
    if reason == "bad_version":
        return "run the same disagg version on both roles (upgrade the older one)"
    if reason == "incompatible":
        return "make the field named above equal on both roles"
    return "check both roles' security sections"


class Refusals:
    """The service's refused links (``ConsumerService.refusals``)."""

    def __init__(self, svc: LinkHost):
        self.svc = svc
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def note(self, link: ProducerLink, exc: BaseException) -> None:
        """A call on ``link`` failed with ``exc`` (any thread): mark it refused if ``exc``
        is a refusal, saying so if that is news."""
        reason = reason_of(exc)
        if reason is None:
            return
        message = exc.message if isinstance(exc, ProtocolError) else str(exc)
        refusal = Refusal(reason, message, _fix(reason, self.svc.config.security), time.time())
        metrics = self.svc.metrics
        with self._lock:
            before = link.refusal
            news = before is None or (before.reason, before.message) != (reason, message)
            link.refusal = refusal if news else before
            metrics[f"refused_{reason}"] += 1
            if news:
                metrics["handshake_refused"] += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="disagg-refusals", daemon=True
                )
                self._thread.start()
        for ch in (link.fg, link.bg):
            ch.ready = False  # greet again when it is tried again
            ch.client.disconnect()  # a refused socket would only retry its handshake
        if news:
            log.warning(
                "producer %s%s refuses this consumer (%s): %s. Fix: %s. Its blocks are not "
                "used (prompts are computed here); retried every %g s",
                link.endpoint,
                f" (rank {link.tp_rank})" if self.svc.tp_size > 1 else "",
                reason,
                message,
                refusal.fix,
                REFUSED_RETRY_S,
            )

    def accepted(self, link: ProducerLink) -> None:
        """A call on ``link`` succeeded: if it was refused, it is usable again."""
        with self._lock:
            before, link.refusal = link.refusal, None
        if before is not None:
            self.svc.metrics["refusals_cleared"] += 1
            log.warning(
                "producer %s accepts this consumer again (it refused it since %s: %s)",
                link.endpoint,
                time.strftime("%H:%M:%S", time.localtime(before.since)),
                before.reason,
            )

    def _links(self) -> list[ProducerLink]:
        return [link for rl in self.svc.rank_links for link in rl.values()]

    def _run(self) -> None:
        """Every ``REFUSED_RETRY_S``: try each refused link once (Hello and Heartbeat)."""
        while not self._stop.wait(REFUSED_RETRY_S):
            for link in self._links():
                if self._stop.is_set():
                    return
                if link.refusal is None:
                    continue
                try:
                    self.svc._call(
                        link, m.Heartbeat(v=PROTOCOL_VERSION, owner=self.svc.owner), background=True
                    )
                except Exception as exc:  # still refused (noted by _call), or down
                    log.debug("retrying refused producer %s: %s", link.endpoint, exc)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=2.0)

    def report(self) -> dict[str, Any]:
        """For ``/health``: ``refused_by`` (empty when nobody refuses us) and, when every
        configured producer refuses us (any of its ranks), ``degraded`` saying why."""
        refused = []
        whole: list[str] = []
        for p, rl in enumerate(self.svc.rank_links):
            first = None
            for r, link in rl.items():
                got = link.refusal
                if got is None:
                    continue
                if first is None:
                    first = f"{link.endpoint}: {got.reason} ({got.message})"
                refused.append(
                    {
                        "producer": link.endpoint,
                        "index": p,
                        "rank": r,
                        "reason": got.reason,
                        "message": got.message,
                        "fix": got.fix,
                        "since": round(got.since, 3),
                    }
                )
            if first is not None:
                whole.append(first)
        out: dict[str, Any] = {"refused_by": refused}
        if self.svc.rank_links and len(whole) == len(self.svc.rank_links):
            out["degraded"] = (
                "every producer refuses this consumer, so it computes every prompt itself: "
                + "; ".join(whole)
            )
        return out
