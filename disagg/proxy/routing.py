"""Which producer should prefill a prompt: the one holding the longest prefix, else the
least loaded.

Where a producer's held blocks come from
    1. **Its event stream** (exact): the producer's ``disagg serve`` answers
       ``GET /disagg/info`` with its instance id, ``tokens_per_block``, namespace seed and
       events endpoint (``producer.events`` in its config; a wildcard bind host is replaced
       by the host of the producer's URL, or ``--producer-events`` names the endpoints).
       An :class:`~disagg.transport.events.EventSubscriber` applies ``Stored``/``Removed``
       to a key set per producer and resyncs from ``GET /disagg/snapshot`` on a gap.
    2. **What this proxy routed** (a hint): for a producer without an event stream, the
       keys of prompts the proxy itself sent there (bounded, oldest forgotten first). It
       does not see evictions, so it can send a request to a producer that no longer holds
       the prefix; the cost is a normal prefill there.

Keys are computed exactly as the connectors do (:func:`disagg.protocol.keys.block_keys`
with the producer's namespace seed for the request's ``cache_salt``), so a prompt's keys
match the producer's stored keys. Text prompts are keyed through the reference engine's
byte tokenizer; with a real tokenizer (TensorRT-LLM) text prompts simply never match and
fall through to least-loaded, which is safe.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..protocol import messages as m
from ..protocol.keys import block_keys
from ..protocol.version import PROTOCOL_VERSION
from ..transport.events import EventSubscriber

log = logging.getLogger("disagg.proxy.routing")

_WILDCARDS = ("0.0.0.0", "*", "[::]", "::")


def advertised(endpoint: str, base_url: str) -> str:
    """``tcp://0.0.0.0:5558`` seen from ``http://prefill:8100`` -> ``tcp://prefill:5558``."""
    scheme, sep, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if sep and host in _WILDCARDS:
        return f"{scheme}://{urlsplit(base_url).hostname}:{port}"
    return endpoint


@dataclass
class Upstream:
    """One producer or consumer server. ``in_flight`` is changed on the event loop only."""

    url: str
    in_flight: int = 0
    failures: int = 0
    # health, from heartbeats and expired deadlines (proxy/app.py): ``down_reason`` is
    # None while up, else why (never empty); a deadline keeps it down until ``down_until``
    down_reason: str | None = None
    down_until: float = 0.0
    misses: int = 0
    beaten: bool = False  # a heartbeat has completed (answered or not)
    incarnation: int | None = None  # producer: the process's, from /health
    continuation: bool | None = None  # consumer: takes disagg.first_tokens (None: unknown)
    prefetch: bool | None = None  # consumer: answers POST /disagg/prefetch (None: unknown)
    # producer: the index's seq of its stream when a heartbeat last found it behind
    behind_at: int | None = None
    # consumer: why it serves without producers (every one refuses it), from its /health;
    # it still answers (computing every prompt), so it is up, and tried after the others
    degraded: str | None = None

    def known_down(self) -> bool:
        """Down by a heartbeat or an expired deadline (unknown before the first beat)."""
        return self.beaten and self.down_reason is not None

    # producer only, from /disagg/info:
    instance_id: str | None = None
    tokens_per_block: int | None = None
    seeds: dict[str | None, bytes] = field(default_factory=dict)
    events: str | None = None


class PrefixIndex:
    """Key sets per producer instance id; thread-safe (events arrive on subscriber threads,
    lookups on the event loop)."""

    def __init__(self, routed_capacity: int = 200_000) -> None:
        self._lock = threading.Lock()
        self._event_keys: dict[str, set[bytes]] = {}  # producers with a live event stream
        self._routed: dict[str, OrderedDict[bytes, None]] = {}
        self._routed_capacity = routed_capacity

    # -- event stream --------------------------------------------------------------------
    def on_event(self, ev: m.Stored | m.Removed | m.SnapshotOk) -> None:
        with self._lock:
            if isinstance(ev, m.SnapshotOk):
                self._event_keys[ev.producer] = set(ev.keys)
                return
            keys = self._event_keys.setdefault(ev.producer, set())
            if isinstance(ev, m.Stored):
                keys.update(ev.keys)
            else:
                keys.difference_update(ev.keys)

    def has_events(self, producer: str) -> bool:
        with self._lock:
            return producer in self._event_keys

    # -- what we routed ------------------------------------------------------------------
    def note_routed(self, producer: str, keys: Sequence[bytes]) -> None:
        with self._lock:
            if producer in self._event_keys:
                return  # the event stream is the truth
            od = self._routed.setdefault(producer, OrderedDict())
            for k in keys:
                od[k] = None
                od.move_to_end(k)
            while len(od) > self._routed_capacity:
                od.popitem(last=False)

    # -- lookup --------------------------------------------------------------------------
    def longest_prefix(self, producer: str, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` the producer holds (or was sent)."""
        with self._lock:
            held: set[bytes] | OrderedDict[bytes, None] | None = self._event_keys.get(producer)
            if held is None:
                held = self._routed.get(producer)
            if not held:
                return 0
            n = 0
            for k in keys:
                if k not in held:
                    break
                n += 1
            return n

    def held(self, producer: str) -> int:
        with self._lock:
            if producer in self._event_keys:
                return len(self._event_keys[producer])
            return len(self._routed.get(producer) or ())


def prompt_keys(up: Upstream, tokens: Sequence[int], salt: str | None) -> list[bytes]:
    """The prompt's full-block keys in ``up``'s namespace ([] when unknown)."""
    seed = up.seeds.get(salt)
    if seed is None or not up.tokens_per_block:
        return []
    return block_keys(seed, list(tokens), up.tokens_per_block)


def choose(
    producers: Sequence[Upstream],
    index: PrefixIndex,
    tokens: Sequence[int] | None,
    salt: str | None,
    max_skew: int | None = None,
) -> tuple[list[Upstream], int]:
    """Producers in the order to try, and the first one's matched block count: those not
    known to be down first, then longest held prefix, then fewest in-flight requests. With
    ``max_skew``, a held prefix counts only for a producer with at most that many more
    requests in flight than the least loaded live one (a prefix every prompt shares would
    otherwise send every prefill to one producer)."""
    live = [up.in_flight for up in producers if not up.known_down()]
    least = min(live, default=0)
    scored: list[tuple[bool, int, int, int, Upstream, int]] = []
    for i, up in enumerate(producers):
        matched = 0
        if tokens and up.instance_id is not None:
            keys = prompt_keys(up, tokens, salt)
            matched = index.longest_prefix(up.instance_id, keys) if keys else 0
        preferred = matched
        if max_skew is not None and up.in_flight > least + max_skew:
            preferred = 0  # too busy to be worth its prefix
        # one known to be down is tried only once every other one failed
        scored.append((up.known_down(), -preferred, up.in_flight, i, up, matched))
    scored.sort(key=lambda t: t[:4])
    return [t[4] for t in scored], scored[0][5] if scored else 0


class EventFeeds:
    """One :class:`EventSubscriber` per producer event endpoint, feeding a :class:`PrefixIndex`;
    snapshots come from the producer's ``GET /disagg/snapshot``."""

    def __init__(self, index: PrefixIndex, timeout_s: float = 5.0, curve: Any = None) -> None:
        self.index = index
        self._curve = curve  # CurveClientKeys for secured event streams, or None
        self._by_instance: dict[str, str] = {}  # instance id -> producer base URL
        self._subs: dict[str, Any] = {}
        self._endpoints: dict[str, set[str]] = {}  # instance id -> its event endpoints
        self._timeout_s = timeout_s
        self._lock = threading.Lock()

    def add(self, endpoint: str, instance_id: str, base_url: str) -> None:
        with self._lock:
            self._by_instance[instance_id] = base_url
            self._endpoints.setdefault(instance_id, set()).add(endpoint)
            if endpoint in self._subs:
                return
            sub = EventSubscriber(
                [endpoint], self.index.on_event, self._snapshot, curve=self._curve
            )
            self._subs[endpoint] = sub
        # Load the current keys now rather than waiting for the first event.
        sub.resync(instance_id)
        log.info(
            "subscribed to producer events", extra={"endpoint": endpoint, "producer": instance_id}
        )

    def resync(self, instance_id: str) -> bool:
        """Reload ``instance_id``'s keys from a snapshot now (it restarted); False if no
        stream of it is known or the snapshot failed."""
        with self._lock:
            subs = [self._subs[e] for e in self._endpoints.get(instance_id, ()) if e in self._subs]
        return any([sub.resync(instance_id) for sub in subs])

    def synced(self, instance_id: str) -> tuple[int, int] | None:
        """(incarnation, seq) the index holds of ``instance_id``'s stream, None if unsynced."""
        with self._lock:
            subs = [self._subs[e] for e in self._endpoints.get(instance_id, ()) if e in self._subs]
        for sub in subs:
            got = sub.synced(instance_id)
            if got is not None:
                return got  # type: ignore[no-any-return]
        return None

    def _snapshot(self, producer: str) -> m.SnapshotOk:
        url = self._by_instance.get(producer)
        if url is None:
            raise OSError(f"no HTTP URL known for producer {producer!r}")
        # A blocking GET on the subscriber's thread; urlopen raises HTTPError (an OSError)
        # on a non-2xx answer.
        try:
            with urllib.request.urlopen(f"{url}/disagg/snapshot", timeout=self._timeout_s) as r:
                body = r.read()
        except (OSError, http.client.HTTPException) as e:
            raise OSError(f"snapshot of {producer} from {url}: {e}") from e
        d = json.loads(body)
        return m.SnapshotOk(
            v=PROTOCOL_VERSION,
            producer=d["producer"],
            seq=int(d["seq"]),
            keys=[bytes.fromhex(k) for k in d["keys"]],
            incarnation=int(d.get("incarnation", 0)),
        )

    def close(self) -> None:
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            sub.close()
