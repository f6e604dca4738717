"""Control RPC over ZMQ: a ROUTER server with a handler thread, and a DEALER client.

Wire: the client sends two frames ``[correlation_id (8 bytes), message]``; the server
replies ``[correlation_id, reply]`` (ROUTER adds/strips the identity frame). A client
discards replies whose correlation id is not the one it waits for, so a late reply to a
timed-out call can never be taken for the answer to the next one.

Authentication (optional, ``curve=``): the server is a CURVE server with a ZAP allow-list
and the client a CURVE client (see security.py). A peer without the right keys never gets
a connection. The client reads its socket's monitor, so a call refused at the handshake
raises ``HandshakeRefused`` (its ``reason``, refusals.py) as soon as ZMQ reports it instead
of timing out like a call to a dead peer. The server counts refusals in ``stats``
(``auth_refused``, ``handshake_failed``), tells its ``refusals`` log (rate-limited
warnings naming the peer, ``refused_<reason>`` counts), and tells the handler who is
calling (``peer_key``, ``peer_address``). A request of another protocol version is
refused with BAD_VERSION and logged the same way.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from ..protocol import messages as m
from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.version import MAX_CONTROL_FRAME
from .refusals import (
    HANDSHAKE_FAILED_EVENTS,
    HandshakeRefused,
    HandshakeWatch,
    RefusalLog,
    server_refusal,
)
from .security import CurveClientKeys, CurveServerKeys, ServerAuth, secure_client

log = logging.getLogger(__name__)

Handler = Callable[[bytes, m.Message], "m.Message | Later | None"]
_POLL_MS = 50  # how often the server thread, and a client's call, check for close()


class ControlServer:
    """Serve ``handler(identity, msg) -> reply`` on a ROUTER socket in one thread.

    The handler runs on the server thread, one request at a time; it returns the reply
    message (None means ``Ok``). A ProtocolError it raises becomes an Error reply with that
    code; any other exception becomes INTERNAL. Malformed frames get an Error reply (when
    there is anyone to reply to) and are counted in ``stats`` by code name; the server
    keeps serving.

    ``curve`` = (server secret key, server public key, allowed client public keys or None)
    makes the socket a CURVE server on a dedicated context (one ZAP authenticator per
    context; ``context`` must then be None). During a handler call, ``peer_key`` is the
    caller's authenticated Z85 public key (None without CURVE) and ``peer_address`` its IP
    address; both are only meaningful on the server thread, where handlers run.
    ``refusals`` says and counts who was refused (into ``refusal_counts``, default
    ``stats``, as ``refused_<reason>``); a handler may report its own refusals there.

    A handler may answer later: it returns ``later()`` (a ``Later`` bound to the message
    being served) and calls its ``answer`` on the server thread, from a function given to
    ``call_soon`` (any thread: it runs on the server thread between messages, at once).
    ``every_poll``, if set, runs on the server thread at least every ``_POLL_MS``.
    """

    def __init__(
        self,
        bind: str,
        handler: Handler,
        *,
        context: zmq.Context | None = None,
        max_frame: int = MAX_CONTROL_FRAME,
        curve: CurveServerKeys | tuple[bytes, bytes, Sequence[bytes] | None] | None = None,
        name: str = "control server",
        refusal_counts: Counter[str] | None = None,
    ) -> None:
        self._bind = bind
        self._handler = handler
        self.max_frame = max_frame
        self.stats: Counter[str] = Counter()
        self.name = name
        self.refusals = RefusalLog(
            f"{name} {bind}", self.stats if refusal_counts is None else refusal_counts
        )
        self._auth: ServerAuth | None = None
        if curve is not None:
            if context is not None:
                raise ValueError("a CURVE ControlServer makes its own context; pass no context")
            self._auth = ServerAuth(CurveServerKeys(*curve), self.stats, self.refusals)
        self._ctx = (
            self._auth.context if self._auth is not None else (context or zmq.Context.instance())
        )
        self.peer_key: bytes | None = None
        self._head: zmq.Frame | None = None  # the message being served: its peer's metadata
        self._serving: tuple[bytes, bytes] | None = None  # its identity and correlation id
        self._soon: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()  # call_soon wakes the poll
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.every_poll: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None
        self.endpoint = ""

    def alive(self) -> bool:
        """True while the serving thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> ControlServer:
        """Bind (so ``endpoint`` is known on return) and start serving."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops (and disconnects) anything far above the limit before allocating it;
        # frames just above it still get a TOO_LARGE reply from decode().
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_frame + 1024)
        if self._auth is not None:
            self._auth.secure(sock)
        sock.bind(self._bind)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.refusals.name = f"{self.name} {self.endpoint}"
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="disagg-control", daemon=True)
        self._thread.start()
        return self

    def later(self) -> Later:
        """Inside a handler: the message being served, to be answered later."""
        assert self._serving is not None, "later() is for a handler, on the server thread"
        return Later(self, *self._serving)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server thread, between messages (any thread may call this)."""
        self._soon.put(fn)
        with contextlib.suppress(BlockingIOError, OSError):  # a wake already pending
            self._wake_w.send(b"\0")

    def _run_soon(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                fn = self._soon.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:  # the server must outlive any of them
                log.exception("a control server callback failed")

    def _send_later(self, ident: bytes, corr: bytes, reply: m.Message) -> None:
        assert self._sock is not None and threading.current_thread() is self._thread
        try:
            self._sock.send_multipart([ident, corr, m.encode(reply)], zmq.NOBLOCK)
            self.stats["ok"] += 1
        except zmq.Again:
            self.stats["reply_dropped"] += 1

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._wake_r.close()
        self._wake_w.close()
        if self._auth is not None:
            self._auth.close()
            self._auth = None

    def __enter__(self) -> ControlServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        monitor = None
        if self._auth is not None:  # failed handshakes are only visible to a monitor
            monitor = sock.get_monitor_socket(HANDSHAKE_FAILED_EVENTS)
            poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = poller.poll(_POLL_MS)
                if self.every_poll is not None:
                    self.every_poll()
                if any(s == self._wake_r.fileno() for s, _ in ready):
                    self._run_soon()
                if not any(s is sock or s is monitor for s, _ in ready):
                    continue
                if monitor is not None and any(s is monitor for s, _ in ready):
                    self._count_monitor_events(monitor)
                    if not any(s is sock for s, _ in ready):
                        continue
                if self._auth is None:
                    # the identity as a frame (its metadata names the peer's address); the
                    # rest copied (even a 32 KiB Claim: cheaper than zmq.Frame objects)
                    head = sock.recv(copy=False)
                    frames = [head.bytes, *(sock.recv_multipart(copy=True) if head.more else ())]
                else:
                    parts = sock.recv_multipart(copy=False)
                    head = parts[-1]
                    # ZAP's User-Id: the key this connection proved it holds.
                    self.peer_key = _user_id(head)
                    frames = [p.bytes for p in parts]
                self._head = head
                try:
                    reply = self._serve(frames)
                finally:
                    self.peer_key = None
                    self._head = None
                    self._serving = None
                if reply is not None:
                    try:
                        sock.send_multipart(reply, zmq.NOBLOCK)
                    except zmq.Again:  # peer gone or flooding us: drop the reply
                        self.stats["reply_dropped"] += 1
        finally:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)

    @property
    def peer_address(self) -> str | None:
        """The IP address of the peer whose message is being served (server thread)."""
        if self._head is None:
            return None
        try:
            address = self._head.get("Peer-Address")
        except zmq.ZMQError:
            return None
        return address if isinstance(address, str) and address else None

    def _count_monitor_events(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 2 and len(frames[0]) >= 6:
                event = int.from_bytes(frames[0][:2], "little")
                if event & HANDSHAKE_FAILED_EVENTS:
                    self.stats["handshake_failed"] += 1
                    refusal = server_refusal(event, int.from_bytes(frames[0][2:6], "little"))
                    if refusal is not None:
                        self.refusals.refused(*refusal)

    def _serve(self, frames: list[bytes]) -> list[bytes] | None:
        """Answer one ROUTER message; returns the frames to send back (or None)."""
        if len(frames) < 2:  # an identity alone: nothing to reply to
            self.stats[ErrorCode.BAD_FRAME.name] += 1
            return None
        ident = frames[0]
        if len(frames) != 3:
            corr = frames[1] if len(frames) > 3 else b""
            err = ProtocolError(
                ErrorCode.BAD_FRAME,
                f"expected [correlation id, message], got {len(frames) - 1} frames",
            )
            return self._error(ident, corr, err)
        corr, body = frames[1], frames[2]
        try:
            msg = m.decode(body, self.max_frame)
        except ProtocolError as e:
            if e.code is ErrorCode.BAD_VERSION:  # a peer of another release: say so
                self.refusals.refused(
                    "bad_version",
                    f"{e.message} (run the same disagg version on both roles)",
                    address=self.peer_address,
                    key=self.peer_key,
                )
            return self._error(ident, corr, e)
        except Exception as e:  # a decoder bug must not end the server: the frame is bad
            log.exception("decoding a control frame failed")
            return self._error(ident, corr, ProtocolError(ErrorCode.BAD_FRAME, repr(e)))
        try:
            self._serving = (ident, corr)
            reply = self._handler(ident, msg)
            if isinstance(reply, Later):  # answered by the handler's own time
                return None
            if reply is None:
                reply = m.Ok()
            out = m.encode(reply)
        except Exception as e:  # the server must outlive any handler bug
            if not isinstance(e, ProtocolError):
                log.exception("control handler failed on %s", type(msg).__name__)
            return self._error(ident, corr, e)
        self.stats["ok"] += 1
        return [ident, corr, out]

    def _error(self, ident: bytes, corr: bytes, exc: BaseException) -> list[bytes]:
        reply = m.error_reply(exc)
        self.stats[ErrorCode.from_wire(reply.code).name] += 1
        return [ident, corr, m.encode(reply)]


class Later:
    """A request its handler answers later (``ControlServer.later``): ``answer`` once, on
    the server thread. Never answered, the client's call times out as for a dead peer."""

    def __init__(self, server: ControlServer, ident: bytes, corr: bytes) -> None:
        self._server, self._ident, self._corr = server, ident, corr
        self.answered = False

    def answer(self, reply: m.Message) -> None:
        if not self.answered:
            self.answered = True
            self._server._send_later(self._ident, self._corr, reply)


def _user_id(frame: zmq.Frame) -> bytes | None:
    """The ZAP User-Id (the CURVE client's Z85 key) a received frame carries, if any."""
    try:
        uid = frame.get("User-Id")
    except zmq.ZMQError:  # no ZAP verdict on this connection
        return None
    return uid.encode("ascii") if isinstance(uid, str) and uid else None


class ControlClient:
    """Blocking request/reply client. Thread-safe: calls are serialised by a lock.

    ``call`` returns the reply message, or raises ProtocolError: ``HandshakeRefused`` (code
    UNAUTHENTICATED, with a ``reason``) as soon as the socket's monitor shows the server
    refusing our handshake (CURVE keys or mechanism: ``curve`` = (client secret, client
    public, server public)); TIMEOUT when no reply came before the deadline; the reply's
    code when the server answered Error; or a decode error code when the reply itself was
    malformed. After a refusal, or a timeout with the request sent, the socket is
    recreated (a refused socket would only retry its handshake; a sent one may hold a
    queued request and a late reply); after a timeout with no connection to send it on
    ("not connected"), the socket and its handshake under way are kept for the next call.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.Context | None = None,
        default_timeout_s: float = 2.0,
        max_frame: int = MAX_CONTROL_FRAME,
        curve: CurveClientKeys | tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.curve = CurveClientKeys(*curve) if curve is not None else None
        self.default_timeout_s = default_timeout_s
        self.max_frame = max_frame
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._replies: zmq.Poller | None = None  # POLLIN on _sock, built once per socket
        self._watch: HandshakeWatch | None = None  # _sock's handshake outcomes
        self._connecting: zmq.Poller | None = None  # POLLOUT on _sock, POLLIN on its monitor
        self._closed = False

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # Queue requests only on live connections, so a dead peer shows as a timeout
            # instead of a request delivered much later.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_frame + 1024)
            if self.curve is not None:
                secure_client(sock, self.curve)
            watch = HandshakeWatch(sock, self.endpoint, curve=self.curve is not None)
            sock.connect(self.endpoint)
            # Socket.poll() builds and registers a new Poller on every call; one per socket
            # takes that off every call's path (the wait itself is the same zmq_poll).
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            connecting = zmq.Poller()
            connecting.register(sock, zmq.POLLOUT)
            connecting.register(watch.monitor, zmq.POLLIN)
            self._sock, self._replies = sock, poller
            self._watch, self._connecting = watch, connecting
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            if self._watch is not None:
                self._watch.close()
            self._sock.close(linger=0)
            self._sock = None
            self._replies = None
            self._watch = self._connecting = None

    def _wait_connected(self, sock: zmq.Socket, deadline: float) -> bool:
        """Wait until ``sock`` can send (True) or the deadline passed (False); raise
        HandshakeRefused once its monitor shows the server refusing us."""
        watch, connecting = self._watch, self._connecting
        assert watch is not None and connecting is not None
        while True:
            refused = watch.refusal()
            if refused is not None:
                raise refused
            ready = dict(self._poll(connecting, deadline))
            if ready.get(sock, 0) & zmq.POLLOUT:
                return True
            if not ready:
                refused = watch.refusal()
                if refused is not None:
                    raise refused
                return False

    def call(self, msg: m.Message, timeout_s: float | None = None) -> m.Message:
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        body = m.encode(msg)
        with self._lock:
            if self._closed:
                raise ProtocolError(ErrorCode.PEER_GONE, "control client is closed")
            sock = self._socket()
            replies = self._replies
            assert replies is not None
            corr = next(self._ids).to_bytes(8, "little")
            sent = False
            try:
                try:
                    # A live connection with room takes the request at once (IMMEDIATE:
                    # only live connections queue anything); wait for one only if not.
                    sock.send_multipart([corr, body], zmq.NOBLOCK)
                except zmq.Again:
                    if not self._wait_connected(sock, deadline):
                        raise self._timeout(msg, timeout, "not connected") from None
                    sock.send_multipart([corr, body], zmq.NOBLOCK)
                sent = True
                while True:
                    if not self._poll(replies, deadline):
                        raise self._timeout(msg, timeout, "no reply")
                    frames = sock.recv_multipart()
                    if len(frames) == 2 and frames[0] == corr:
                        break  # anything else is a stale reply or garbage: skip it
            except (ProtocolError, zmq.ZMQError) as exc:
                # Not sent ("not connected"): nothing is queued, so the socket is kept; a
                # new one would restart a handshake that may take longer than one call.
                # A refused one is closed: it would only retry a handshake bound to fail.
                if sent or not isinstance(exc, ProtocolError) or isinstance(exc, HandshakeRefused):
                    self._reset()
                raise
        reply = m.decode(frames[1], self.max_frame)
        return m.raise_if_error(reply)

    @staticmethod
    def _ms_left(deadline: float) -> int:
        return max(0, int((deadline - time.monotonic()) * 1000))

    def _poll(self, poller: zmq.Poller, deadline: float) -> list[tuple[Any, int]]:
        """``poller``'s ready sockets, or [] once the deadline passed; PEER_GONE as soon as
        ``close`` was called (a call to a silent peer would otherwise hold ``close``, and
        its service's shutdown, for the rest of its timeout)."""
        while True:
            left = self._ms_left(deadline)
            ready = poller.poll(min(left, _POLL_MS))
            if ready:
                return ready
            if self._closed:
                raise ProtocolError(ErrorCode.PEER_GONE, "control client is closed")
            if left <= _POLL_MS:
                return []

    def _timeout(self, msg: m.Message, timeout: float, why: str) -> ProtocolError:
        return ProtocolError(
            ErrorCode.TIMEOUT,
            f"{type(msg).__name__} to {self.endpoint} timed out after {timeout:.3g}s ({why})",
        )

    def disconnect(self) -> bool:
        """Close the socket now unless a call is using it (False then); the next call
        makes a new one. For a peer known to refuse us: its socket would retry the
        handshake every ~0.2 s until then."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._reset()
            return True
        finally:
            self._lock.release()

    def close(self) -> None:
        """No call is made after this; a call under way ends within ``_POLL_MS``."""
        self._closed = True
        with self._lock:
            self._reset()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
