"""CURVE authentication for the control and event sockets (ZMQ CURVE + a ZAP allow-list).

Contracts:

- A server socket secured with ``ServerAuth.secure(sock)`` completes a handshake only with
  a client that knows the server's public key and, when an allow-list is given, whose own
  public key is on it. Anyone else never gets a connection: ZMQ drops the handshake, so
  the client's call times out (``ProtocolError(TIMEOUT)`` within its deadline) and learns
  nothing, not even an error code (ControlClient tells the refusal apart from a dead
  peer by its socket monitor: refusals.py). Refusals are counted where ZMQ lets us see
  them: ``auth_refused`` (ZAP said no: a valid key that is not on the list) and
  ``handshake_failed`` (no key, a wrong server key, a broken handshake; reported by a
  socket monitor, see ControlServer), and said, rate-limited, by a ``RefusalLog`` (a ZAP
  denial with the peer's address and Z85 key).
- Every message that reaches a secured server carries its sender's Z85 public key as the
  ZAP ``User-Id`` property (``frame.get("User-Id")``), so a handler can bind what a peer
  claims to be (an owner name) to the key it proved it holds.
- A ZAP handler is per ``zmq.Context`` (it binds ``inproc://zeromq.zap.01``), so each
  ``ServerAuth`` owns a dedicated Context; secured server sockets must be made from
  ``ServerAuth.context``. Clients need no authenticator and may use any context.

Keys are Z85 text (40 ASCII bytes), as ``disagg keys`` writes them and
``zmq.curve_keypair()`` returns them.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any, NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from .refusals import RefusalLog

log = logging.getLogger(__name__)

ZAP_DOMAIN = "disagg"


class CurveServerKeys(NamedTuple):
    """A server's key pair and who may connect (None: any client that knows our public
    key; an empty list: nobody)."""

    secret_key: bytes
    public_key: bytes
    allowed_clients: Iterable[bytes] | None = None


class CurveClientKeys(NamedTuple):
    """A client's key pair and the public key of the server it trusts."""

    secret_key: bytes
    public_key: bytes
    server_key: bytes


def _check_key(key: Any, what: str) -> bytes:
    if isinstance(key, str):
        key = key.encode("ascii")
    if not isinstance(key, bytes) or len(key) != 40:
        raise ValueError(f"{what} must be a 40-character Z85 CURVE key, got {key!r:.60}")
    return key


class _AllowList:
    """ZAP credentials provider: a fixed set of Z85 client keys."""

    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys = frozenset(_check_key(k, "an allowed client key") for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class _CountingAuthenticator(ThreadAuthenticator):
    """The pyzmq ZAP authenticator, counting every verdict into ``stats`` and telling
    ``refusals`` who it refused (the ZAP request names the peer's address and key)."""

    def __init__(
        self,
        context: zmq.Context,
        stats: Counter[str],
        lock: threading.Lock,
        refusals: RefusalLog,
    ) -> None:
        super().__init__(context, log=log)
        self._stats = stats
        self._stats_lock = lock
        self._refusals = refusals
        # ZAP request id -> (peer address, Z85 key) until its verdict is sent
        self._asking: dict[bytes, tuple[str, bytes | None]] = {}

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # ZAP 1.0 request: version, request id, domain, address, identity, mechanism,
        # credentials (CURVE: the client's 32-byte long-term public key)
        if len(msg) >= 6:
            key = z85.encode(msg[6]) if len(msg) > 6 and len(msg[6]) == 32 else None
            self._asking[msg[1]] = (msg[3].decode("ascii", "replace"), key)
        try:
            await super().handle_zap_message(msg)
        finally:
            if len(msg) >= 2:
                self._asking.pop(msg[1], None)

    def _send_zap_reply(  # type: ignore[override]
        self, request_id: bytes, status_code: bytes, status_text: bytes, user_id: str = ""
    ) -> None:
        with self._stats_lock:
            self._stats["auth_ok" if status_code == b"200" else "auth_refused"] += 1
        if status_code != b"200":
            address, key = self._asking.get(request_id, (None, None))
            why = status_text.decode("ascii", "replace")
            if why == "Unknown key":
                self._refusals.refused(
                    "key_not_allowed",
                    "its CURVE key is not in security.allowed_client_keys: add its "
                    "NAME.key.pub there if it is one of ours",
                    address=address,
                    key=key,
                )
            else:
                self._refusals.refused(
                    "handshake", f"the authenticator refused it: {why}", address=address, key=key
                )
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


class ServerAuth:
    """A dedicated Context with a running ZAP authenticator for CURVE server sockets.

    ``stats`` (shared with the owner's counters when passed) gains ``auth_ok`` and
    ``auth_refused``; ``refusals`` (default: one counting into ``stats``) is told each
    denial with the peer's address and key. ``close()`` stops the authenticator and
    destroys the context: close the sockets first.
    """

    def __init__(
        self,
        keys: CurveServerKeys,
        stats: Counter[str] | None = None,
        refusals: RefusalLog | None = None,
    ) -> None:
        self.secret_key = _check_key(keys.secret_key, "the server secret key")
        self.public_key = _check_key(keys.public_key, "the server public key")
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.refusals = refusals if refusals is not None else RefusalLog("CURVE server", self.stats)
        self.context = zmq.Context()
        self._auth = _CountingAuthenticator(
            self.context, self.stats, threading.Lock(), self.refusals
        )
        self._auth.start()
        if keys.allowed_clients is None:
            self._auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            self._auth.configure_curve_callback(
                domain=ZAP_DOMAIN, credentials_provider=_AllowList(keys.allowed_clients)
            )

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (from ``self.context``, before bind) a CURVE server."""
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_server = True

    def close(self) -> None:
        self._auth.stop()
        self.context.destroy(linger=0)


def secure_client(sock: zmq.Socket, keys: CurveClientKeys) -> None:
    """Make ``sock`` (before connect) a CURVE client of the server whose key it names."""
    sock.curve_secretkey = _check_key(keys.secret_key, "the client secret key")
    sock.curve_publickey = _check_key(keys.public_key, "the client public key")
    sock.curve_serverkey = _check_key(keys.server_key, "the server public key")


def server_keys_from(security: Any) -> CurveServerKeys | None:
    """A producer's CurveServerKeys from a config ``security`` section (None: no CURVE).
    No ``allowed_client_keys`` means any client that holds our public key may connect."""
    if security is None or not security.enabled:
        return None
    allowed = security.client_keys()
    return CurveServerKeys(security.secret_key(), security.public_key(), allowed or None)


def client_keys_from(security: Any) -> CurveClientKeys | None:
    """A consumer's CurveClientKeys from a config ``security`` section (None: no CURVE)."""
    if security is None or not security.enabled:
        return None
    server = security.server_key()
    if server is None:
        raise ValueError("security.server_public_key is required for a CURVE client")
    return CurveClientKeys(security.secret_key(), security.public_key(), server)
