"""Handshake refusals: why a peer never got a connection, as both sides can tell it.

A CURVE refusal gives the refused side no reply, only ZMQ socket-monitor events; the
refusing side learns the peer's address and key only from ZAP. This module turns both
into one vocabulary of reasons (the metric label ``reason``, the consumer's ``/health``):

    reason               meaning
    key_not_allowed      the client's CURVE key is not on the server's allow-list (ZAP 400)
    server_key_mismatch  the server cannot open the client's CURVE handshake: the client's
                         server key is not the server's, or its key files are no pair
    curve_mismatch       CURVE on one side only
    handshake            another failed handshake (a ZAP error, a peer not speaking ZMTP)
    bad_version          another protocol version (BAD_VERSION)
    incompatible         the Hello's fingerprint or transport differs (INCOMPATIBLE_PEER)

Client (``HandshakeWatch`` on a DEALER's monitor; measured on libzmq 4.3.5):
``HANDSHAKE_FAILED_AUTH`` (400: key_not_allowed) and ``..._PROTOCOL`` (MECHANISM_MISMATCH:
curve_mismatch) are final. The side that finds a failure first reports it; the other sees
the connection close: ``..._NO_DETAIL``, after which libzmq reconnects every ~0.2 s. The
second one in a row (no success between; one alone may be a server that died
mid-handshake) is server_key_mismatch for a CURVE client (the server could not open our
HELLO) and curve_mismatch for one without keys. ``HANDSHAKE_SUCCEEDED`` clears it all.

Server (``RefusalLog``, fed by the ZAP handler and the ROUTER's monitor): a ZAP denial
names the peer's address and Z85 key; ``..._PROTOCOL`` ZMTP_CRYPTOGRAPHIC is
server_key_mismatch, MECHANISM_MISMATCH and ``..._NO_DETAIL`` curve_mismatch (a peer
without CURVE, or not ZMTP at all), all without address or key: libzmq's monitor names
only our own endpoint, and the peer's key sits in the part of the handshake that failed
(the control server names the address of a BAD_VERSION request). Each refusal is counted
(``refused_<reason>``) and said at warning level at most once per reason and peer every
``REFUSAL_LOG_EVERY_S``, with how many were not said since.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter

import zmq

from ..protocol.errors import ErrorCode, ProtocolError

log = logging.getLogger("disagg.security")

REASONS = (
    "key_not_allowed",
    "server_key_mismatch",
    "curve_mismatch",
    "handshake",
    "bad_version",
    "incompatible",
)
# one warning per reason and peer per this many seconds (a refused peer may retry often)
REFUSAL_LOG_EVERY_S = 60.0
_MAX_PEERS_REMEMBERED = 1024  # bounds the rate limiter's memory against key-spraying peers

HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
HANDSHAKE_EVENTS = HANDSHAKE_FAILED_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED
_watches = itertools.count(1)  # each watch's own inproc endpoint


class HandshakeRefused(ProtocolError):
    """The server refused our connection at the ZMQ handshake (code UNAUTHENTICATED, never
    sent: nothing reached the server's handler). ``reason``: one of ``REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(ErrorCode.UNAUTHENTICATED, message)
        self.reason = reason

    def __reduce__(self):  # picklable with its reason
        return (type(self), (self.reason, self.message))


_PROTOCOL_NAMES = {
    getattr(zmq, n): n[len("PROTOCOL_ERROR_") :]
    for n in dir(zmq)
    if n.startswith("PROTOCOL_ERROR_")
}


class HandshakeWatch:
    """A client socket's handshake outcomes, read from its monitor (``refusal()``)."""

    def __init__(self, sock: zmq.Socket, endpoint: str, curve: bool) -> None:
        # libzmq's I/O thread sends each event with a blocking send: a full queue would
        # stall every socket of the context. Unbounded instead (events are read on each
        # call that finds no connection; a socket retrying a refused handshake while
        # nobody calls queues ~60 B per retry).
        addr = f"inproc://disagg-handshakes-{next(_watches)}"
        sock.monitor(addr, HANDSHAKE_EVENTS)
        self.monitor = sock.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)
        self.monitor.connect(addr)
        self._sock = sock
        self._endpoint = endpoint
        self._curve = curve
        self._no_detail = 0  # consecutive NO_DETAIL failures
        self._refused: HandshakeRefused | None = None

    def refusal(self) -> HandshakeRefused | None:
        """Read the events so far; the refusal they amount to, if any (it stands until a
        handshake succeeds)."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self._refused
            if len(frames) != 2 or len(frames[0]) < 6:
                continue
            event = int.from_bytes(frames[0][:2], "little")
            value = int.from_bytes(frames[0][2:6], "little")
            self._refused = self._classify(event, value)

    def _classify(self, event: int, value: int) -> HandshakeRefused | None:
        ep = self._endpoint
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._no_detail = 0
            return None
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if value == 400:
                return HandshakeRefused(
                    "key_not_allowed", f"{ep} refused our CURVE key (not on its allow-list)"
                )
            return HandshakeRefused(
                "handshake", f"{ep}'s authenticator failed our handshake (ZAP status {value})"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                what = (
                    "does not use CURVE, but we do"
                    if self._curve
                    else "requires CURVE, and we have no keys"
                )
                return HandshakeRefused("curve_mismatch", f"{ep} {what}")
            return HandshakeRefused(
                "handshake",
                f"handshake with {ep} failed: {_PROTOCOL_NAMES.get(value, hex(value))}",
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._no_detail += 1
            if self._no_detail < 2:
                return self._refused
            if self._curve:
                return HandshakeRefused(
                    "server_key_mismatch",
                    f"{ep} drops our CURVE handshake: it does not open with its key pair "
                    "(or it does not use CURVE)",
                )
            # a server that saw the mismatch first just closes: no detail reaches us
            return HandshakeRefused("curve_mismatch", f"{ep} requires CURVE, and we have no keys")
        return self._refused

    def close(self) -> None:
        self._sock.disable_monitor()
        self.monitor.close(linger=0)


def server_refusal(event: int, value: int) -> tuple[str, str] | None:
    """(reason, what happened) for a failed handshake a server's monitor reported; None for
    one ZAP refused (the authenticator already said it, naming the peer)."""
    no_curve = (
        "curve_mismatch",
        "it does not use CURVE (no `security` section) or does not speak ZMTP: give it "
        "a security section whose server_public_key is our public key",
    )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return no_curve
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return (
                "server_key_mismatch",
                "its CURVE handshake does not open with our key: its "
                "security.server_public_key is not our public key, or its own two key files "
                "are not one pair",
            )
        return "handshake", f"its handshake failed: {_PROTOCOL_NAMES.get(value, hex(value))}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # the peer closed: it saw a mismatch
        return no_curve
    return None


class RefusalLog:
    """A server's refusals: counted in ``counts`` (``refused_<reason>``) and said at warning
    level at most once per (reason, address, key) every ``every_s``. Thread-safe (the ZAP
    thread and the server thread both report)."""

    def __init__(
        self,
        name: str,
        counts: Counter[str] | None = None,
        every_s: float = REFUSAL_LOG_EVERY_S,
    ) -> None:
        self.name = name  # e.g. "producer prefill-0 control tcp://0.0.0.0:5557"
        self.counts: Counter[str] = counts if counts is not None else Counter()
        self.every_s = every_s
        self._lock = threading.Lock()
        # (reason, address, key) -> (when last said, refusals not said since)
        self._said: dict[tuple[str, str | None, bytes | None], tuple[float, int]] = {}

    def refused(
        self,
        reason: str,
        what: str,
        *,
        address: str | None = None,
        key: bytes | None = None,
    ) -> None:
        """Count one refusal for ``reason`` and say ``what`` (naming the peer by
        ``address`` and Z85 ``key`` where known) unless said for this peer lately."""
        now = time.monotonic()
        peer = (reason, address, key)
        with self._lock:
            self.counts[f"refused_{reason}"] += 1
            said, quiet = self._said.get(peer, (-float("inf"), 0))
            if now - said < self.every_s:
                self._said[peer] = (said, quiet + 1)
                return
            if len(self._said) >= _MAX_PEERS_REMEMBERED:
                self._said = {p: v for p, v in self._said.items() if now - v[0] < self.every_s}
            self._said[peer] = (now, 0)
        if address is None and key is None:
            who = "a peer (ZMQ names neither address nor key for this failure)"
        else:
            who = f"peer {address or '(address unknown)'}"
            if key is not None:
                who += f" with CURVE key {key.decode('ascii', 'replace')}"
        more = f" ({quiet} more since the last warning)" if quiet else ""
        log.warning("%s refused %s: %s%s", self.name, who, what, more)
