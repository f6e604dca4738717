"""Block events over PUB/SUB: producers publish ``Stored``/``Removed`` with per-producer
sequence numbers; subscribers apply them in order and resync from a snapshot when they
see a gap (missed events, a late join) or another ``incarnation`` (a producer restart: its
stream is a new one, numbered from 1, so no number of it is compared with the old one's).

With ``curve=`` both ends use CURVE (security.py): a subscriber without the producer's
public key, or whose own key is not allowed, never connects and receives nothing; a
publisher without the matching secret key cannot feed a subscriber forged events.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import zmq

from ..protocol import messages as m
from ..protocol.errors import ProtocolError
from .refusals import RefusalLog
from .security import CurveClientKeys, CurveServerKeys, ServerAuth, secure_client

log = logging.getLogger(__name__)

Event = m.Stored | m.Removed | m.SnapshotOk


class EventPublisher:
    """PUB socket publishing one frame per event. Thread-safe. ``seq`` is the sequence
    number of the last published event (0 before any); a producer's snapshot handler
    reads it under the same lock it uses to change its key set, so a SnapshotOk's ``seq``
    matches its keys. ``curve`` = (secret, public, allowed subscriber keys or None) makes
    it a CURVE server on its own context (``stats`` counts ``auth_ok``/``auth_refused``;
    a refused subscriber is said, rate-limited, with its address and key)."""

    def __init__(
        self,
        bind: str,
        producer: str,
        *,
        context: zmq.Context | None = None,
        curve: CurveServerKeys | tuple[bytes, bytes, Sequence[bytes] | None] | None = None,
        incarnation: int = 0,
    ):
        self.producer = producer
        self.incarnation = incarnation
        self.stats: Counter[str] = Counter()
        self._auth: ServerAuth | None = None
        if curve is not None:
            if context is not None:
                raise ValueError("a CURVE EventPublisher makes its own context; pass no context")
            refusals = RefusalLog(f"producer {producer} events {bind}", self.stats)
            self._auth = ServerAuth(CurveServerKeys(*curve), self.stats, refusals)
            context = self._auth.context
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        if self._auth is not None:
            self._auth.secure(self._sock)
        self._sock.bind(bind)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self.seq = 0

    def _publish(self, cls: type[m.Stored] | type[m.Removed], keys: Iterable[bytes]) -> int:
        with self._lock:
            self.seq += 1
            msg = cls(
                producer=self.producer,
                seq=self.seq,
                keys=list(keys),
                incarnation=self.incarnation,
            )
            try:
                self._sock.send(m.encode(msg), zmq.NOBLOCK)
            except zmq.Again:  # a slow subscriber will see the gap and resync
                pass
            return self.seq

    def publish_stored(self, keys: Iterable[bytes]) -> int:
        """Publish that ``keys`` are now held; returns the event's sequence number."""
        return self._publish(m.Stored, keys)

    def publish_removed(self, keys: Iterable[bytes]) -> int:
        """Publish that ``keys`` are no longer held; returns the event's sequence number."""
        return self._publish(m.Removed, keys)

    def close(self) -> None:
        with self._lock:
            self._sock.close(linger=0)
            if self._auth is not None:
                self._auth.close()
                self._auth = None


class EventSubscriber:
    """SUB socket on ``endpoints``, in a background thread.

    ``on_event(msg)`` receives, per producer and in order, ``SnapshotOk`` (replace
    everything known of ``msg.producer`` with ``msg.keys``), then ``Stored``/``Removed``
    with consecutive ``seq`` of the snapshot's incarnation. On the first event from a
    producer, on a gap, or on an event of another incarnation (or, from a publisher that
    names none, seq back to 1), it calls ``snapshot_fn(producer) -> SnapshotOk`` and
    delivers that instead; events already covered by the snapshot are dropped. A snapshot
    of another incarnation than the event that asked for it (the producer restarted in
    between) leaves the producer unsynced: the next event retries. If the snapshot fails,
    the producer stays unsynced and the next event retries.
    ``resync(producer)`` forces one (e.g. at start-up, before any event).
    Undecodable frames and frames of other kinds are dropped and counted in
    ``stats["bad"]``. ``curve`` = (client secret, client public, producer public key).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        on_event: Callable[[Event], None],
        snapshot_fn: Callable[[str], m.SnapshotOk],
        *,
        context: zmq.Context | None = None,
        max_frame: int = 64 * 1024 * 1024,
        curve: CurveClientKeys | tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        self._on_event = on_event
        self._snapshot_fn = snapshot_fn
        self._ctx = context or zmq.Context.instance()
        self.max_frame = max_frame
        # per synced producer: (incarnation, last applied seq)
        self._seq: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        # frames: every frame received; bad: dropped as undecodable or of another kind
        self.stats: dict[str, int] = {
            "frames": 0,
            "events": 0,
            "gaps": 0,
            "resyncs": 0,
            "restarts": 0,
            "bad": 0,
        }
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        # libzmq drops (and disconnects) a frame far above the limit before allocating it
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_frame + 1024)
        if curve is not None:
            secure_client(self._sock, CurveClientKeys(*curve))
        for ep in endpoints:
            self._sock.connect(ep)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disagg-events", daemon=True)
        self._thread.start()

    def resync(self, producer: str) -> bool:
        """Fetch and deliver a snapshot of ``producer`` now; False if it failed."""
        with self._lock:
            return self._resync(producer)

    def _resync(self, producer: str) -> bool:
        self.stats["resyncs"] += 1
        try:
            snap = self._snapshot_fn(producer)
        except (ProtocolError, OSError, zmq.ZMQError) as e:
            log.warning("snapshot of producer %s failed: %s", producer, e)
            self._seq.pop(producer, None)
            return False
        self._seq[producer] = (snap.incarnation, snap.seq)
        self._on_event(snap)
        return True

    def synced(self, producer: str) -> tuple[int, int] | None:
        """(incarnation, last applied seq) of ``producer``, None while unsynced."""
        with self._lock:
            return self._seq.get(producer)

    def _apply(self, ev: m.Stored | m.Removed) -> None:
        with self._lock:
            known = self._seq.get(ev.producer)
            if known is not None:
                inc, last = known
                if ev.incarnation != inc:
                    self.stats["restarts"] += 1  # a new stream: none of its numbers count
                elif ev.seq == last + 1:
                    self._deliver(ev)
                    return
                elif ev.seq <= last and (inc or ev.seq != 1):
                    return  # a duplicate, or already in the snapshot we applied
            # Unknown producer, a gap, or a restart: resync.
            self.stats["gaps"] += 1
            if not self._resync(ev.producer):
                return
            inc, last = self._seq[ev.producer]
            if inc != ev.incarnation:  # restarted between the event and the snapshot
                self._seq.pop(ev.producer, None)
            elif ev.seq == last + 1:
                self._deliver(ev)
            elif ev.seq > last + 1:  # the snapshot is older than ev: retry on the next
                self._seq.pop(ev.producer, None)

    def _deliver(self, ev: m.Stored | m.Removed) -> None:
        self._seq[ev.producer] = (ev.incarnation, ev.seq)
        self.stats["events"] += 1
        self._on_event(ev)

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(50, zmq.POLLIN):
                    continue
                data = sock.recv()
                self.stats["frames"] += 1
                try:
                    ev = m.decode(data, self.max_frame)
                except ProtocolError:
                    self.stats["bad"] += 1
                    continue
                if isinstance(ev, m.Stored | m.Removed):
                    try:
                        self._apply(ev)
                    except Exception:  # a bad callback must not kill the stream
                        log.exception("event callback failed")
                else:
                    self.stats["bad"] += 1
        finally:
            sock.close(linger=0)

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
