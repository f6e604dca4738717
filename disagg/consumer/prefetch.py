"""Prefetch: lease a prompt's blocks while the producer still prefills it.

The proxy tells the consumer about a request when it sends the prefill (``POST
/disagg/prefetch``, :mod:`disagg.serve.app`); the continuation (prompt + the producer's
first token) arrives once the producer's first token is back. Between the two, this
module leases every whole block of the prompt as soon as a producer holds them (from the
reservation of their rows: a pass's end, or a layer's save, ``HelloOk.reserves_at_layer``).
With one producer serving ``claim_wait`` it sends one ``Claim`` that waits there for the
blocks (``_park``, on one of the link's ``waits`` channels); else it polls with ``Lookup`` and
claims. When the continuation reaches the scheduler, ``take`` hands that lease over, so
the engine's thread skips the claim's round trip; the push itself still waits, on the
producer, until the blocks are stored.

Contract:
- nothing here runs on the engine's thread; nothing writes a page (a lease only pins the
  producer's blocks), so the fence and the load states are untouched: a lease taken is
  one more ``Claimed`` for an ordinary ``Load``;
- the wait for the producer is bounded by ``PREFETCH_WAIT_S`` (a waiting claim by
  ``PARK_S`` each; polls back off to ``POLL_MAX_S``, a producer reserving at a pass's end
  is asked once, then every ``POLL_AFTER_PASS_S``); a lease no continuation takes is
  released ``PREFETCH_HOLD_S`` after its grant (``sweep``, from the keepalive thread,
  which also renews it meanwhile);
- a continuation that arrives while the prefetch still polls wakes it (``confirm_ahead``,
  from its HTTP handler) and ``take`` waits for its answer within the claim's budget: a
  producer that answered the first token holds the prompt's blocks, so the lease is one
  ``Claim`` away (no lookup first), asked while the engine admits the request. Past that
  budget the continuation claims as usual and the prefetch, once granted, is released
  at once (``abandoned``, counted ``prefetch_late``);
- any failure (no producer, a producer that dies, a refusal) ends the prefetch with
  nothing held: the continuation claims as usual (a miss there recomputes). ``take``
  confirms the lease with one ``Renew`` (bounded as a claim is, and cheaper), asked on
  a background thread as the continuation arrives (``confirm_ahead``, from its HTTP
  handler: the round trip overlaps the engine's admission), else on the engine's
  thread; a lease whose producer is down, restarted or no longer knows it is given
  back and claimed afresh, so a producer that died after the grant costs a miss, as a
  plain claim on it would;
- TP on either side, where the model's KV head count is known (``routes``: every rank's
  keys are the same): the prefetch leases every rank of the producer as the scheduler's
  claim does (``Claims.claim_ranks``, on the background channels) and the continuation
  takes all of them; ``take`` confirms every rank's lease. Head-blind TP (each rank's
  keys differ) is not prefetched: ``start`` says why (``why_not``), counted
  ``prefetch_declined_tp``, and the continuation claims as usual;
- with a landing zone (``zone``, TP = 1 on both sides), a granted lease's pages are
  pushed into it at once (before the lease can be taken); a lease whose fill is whole
  when taken needs no confirmation.

Matching: a prefetch is keyed by its prompt's keys; the continuation's offer (keys of the
prompt + first token's whole blocks, from block 0) must start with exactly those keys.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..protocol import messages as m
from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.keys import KEY_BYTES, KeyBlob
from ..protocol.version import PROTOCOL_VERSION
from .host import LinkHost
from .links import ProducerLink
from .loads import Claimed

log = logging.getLogger("disagg.consumer")

PREFETCH_WAIT_S = 60.0  # longest wait for a producer to hold the prompt's blocks
PREFETCH_HOLD_S = 10.0  # a granted lease no continuation took is released after this
AHEAD_FRESH_S = 0.005  # a confirmation asked ahead counts for a take at most this much later
POLL_MIN_S, POLL_MAX_S = 0.001, 0.02  # Lookup polls back off between these
# a producer that reserves a pass's blocks at its end (``HelloOk.reserves_at_layer`` 0)
# holds none of the prompt's while it prefills: each lookup it answered then would only
# take its GIL from the forward, so it is asked at once (a prompt it holds already) and
# then only this seldom; the continuation, sent after the first token, wakes the prefetch
POLL_AFTER_PASS_S = 0.1
# a consumer of one producer that serves ``Claim.wait_s`` asks once and the answer comes as
# the producer reserves the blocks (at its pass's end, after the first token is sent), no
# polling and no round trip after the continuation came; a claim waits this long at most,
# then is asked again
PARK_S = 2.0
MAX_PENDING = 256  # prefetches in flight or held at once; more are declined


@dataclass
class _Entry:
    keys: KeyBlob
    claimed: Claimed | None = None
    granted_at: float = 0.0
    abandoned: bool = False  # a continuation came first, or the service closes
    confirmed: threading.Event | None = None  # set once a confirmation asked ahead is in
    confirm_ok: bool = False
    confirmed_at: float = 0.0
    wake: threading.Event = field(default_factory=threading.Event)  # poll now
    settled: threading.Event = field(default_factory=threading.Event)  # the poll ended


class Prefetches:
    """The service's prefetched leases (``ConsumerService.prefetches``)."""

    def __init__(self, svc: LinkHost):
        self.svc = svc
        self._lock = threading.Lock()
        self._by_first: dict[bytes, _Entry] = {}  # the prompt's first key -> its prefetch
        self.closed = False
        self._ahead: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
        self._confirmer: threading.Thread | None = None

    def start(self, keys: KeyBlob) -> str | None:
        """Begin prefetching ``keys`` (a prompt's whole blocks, from block 0) in the
        background; None when started, else why not."""
        svc = self.svc
        why = self.why_not
        if why is not None:
            svc.metrics["prefetch_declined_tp"] += 1
            return why
        if svc.fingerprint is None or not len(keys):
            return "no KV cache registered yet" if svc.fingerprint is None else "no whole block"
        first = keys.blob[:KEY_BYTES]
        with self._lock:
            if self.closed:
                return "closing"
            if first in self._by_first:
                return "this prompt is being prefetched already"
            if len(self._by_first) >= MAX_PENDING:
                svc.metrics["prefetch_declined_full"] += 1
                return f"{MAX_PENDING} prefetches in flight"
            entry = self._by_first[first] = _Entry(keys)
        svc.metrics["prefetch_started"] += 1
        # one daemon thread each (at most MAX_PENDING): a slow producer delays no other
        # prefetch, and a process that exits never waits for a poll
        threading.Thread(
            target=self._run, args=(entry,), name="disagg-prefetch", daemon=True
        ).start()
        return None

    @property
    def why_not(self) -> str | None:
        """Why this service does not prefetch (None: it does)."""
        svc = self.svc
        tp = svc.tp_size > 1 or any(n > 1 for n in svc.producer_tps)
        if tp and svc.routes is None:
            return (
                "TP without the model's KV head count (each rank's keys differ): the "
                "continuation's claim covers every rank"
            )
        return None

    def _run(self, entry: _Entry) -> None:
        svc = self.svc
        try:
            claimed = self._lease(entry)
        except Exception:  # a miss: the continuation claims as usual
            log.exception("prefetch failed")
            claimed = None
        if claimed is not None and svc.zone is not None and not entry.abandoned:
            # before the lease can be taken: a load sees its fill from the start
            svc.zone.fill(claimed)
        with self._lock:
            entry.claimed, entry.granted_at = claimed, time.monotonic()
            drop = claimed is None or entry.abandoned or self.closed
            if drop:
                self._forget(entry)
        entry.settled.set()
        if claimed is None:
            svc.metrics["prefetch_missed"] += 1
        elif drop:
            svc.metrics["prefetch_abandoned"] += 1
            svc.release(claimed)
        else:
            svc.metrics["prefetch_granted"] += 1

    def _lease(self, entry: _Entry) -> Claimed | None:
        """A lease of every key once a producer holds them (or None when the wait ends):
        a claim waiting at the producer where it can (``_parks``), else polls and a claim."""
        svc = self.svc
        keys, want = entry.keys, len(entry.keys)
        deadline = time.monotonic() + PREFETCH_WAIT_S
        pause = POLL_MIN_S
        msg = m.Lookup(v=PROTOCOL_VERSION, owner=svc.owner, keys=keys)
        woken = False
        asked: dict[int, float] = {}  # link index -> its last lookup
        while not entry.abandoned and not self.closed and time.monotonic() < deadline:
            links = [lk for lk in svc.links if lk.usable()]
            if len(links) == 1 and self._parks(links[0]):
                got = self._park(links[0], keys)
                if isinstance(got, Claimed):
                    return got
                if got is None:  # a miss at the wait's end (or at once): ask again
                    if entry.wake.wait(pause):
                        entry.wake.clear()
                    pause = min(POLL_MAX_S, pause * 2)
                    continue
                # every waiting channel of the link is taken by other prefetches: poll it
            for link in links:
                if woken:  # one producer holds the blocks: ask for them without a lookup
                    got = self._claim_all(link, keys)
                    if got is not None:
                        return got
                    continue
                now = time.monotonic()
                last = asked.get(link.index)
                # one that holds them once its pass has ended (known after its first answer)
                if (
                    link.reserves_at_layer == 0
                    and last is not None
                    and now - last < POLL_AFTER_PASS_S
                ):
                    continue
                asked[link.index] = now
                try:  # every rank of a TP producer: each plans its saves on its own
                    held = min(
                        svc._call(lk, msg, background=True).num_blocks for lk in self._ranks(link)
                    )
                except ProtocolError:
                    continue  # that producer is down or refuses us: the others may hold it
                if held >= want:
                    return self._claim(link, keys)
            woken = entry.wake.wait(pause)  # the continuation is here: its blocks are held
            if woken:
                entry.wake.clear()
                pause = POLL_MIN_S
            else:
                pause = min(POLL_MAX_S, pause * 2)
        return None

    def _parks(self, link: ProducerLink) -> bool:
        """Whether a claim on ``link`` waits there for its blocks: its producer serves
        ``Claim.wait_s`` and is one rank (a TP producer's ranks are polled)."""
        features = link.features
        return (
            features is not None
            and m.FEATURE_CLAIM_WAIT in features
            and len(self._ranks(link)) == 1
        )

    def _park(self, link: ProducerLink, keys: KeyBlob) -> Claimed | None | bool:
        """Claim ``keys`` on ``link``, the answer waiting at the producer until it holds
        every one (at most ``PARK_S``): the lease, None on a miss (or a failure: the link
        is then down for a while), False if another prefetch waits on the link already."""
        try:
            got = self._claim_one(link, keys, PARK_S)
        except ProtocolError as exc:
            return False if exc.code is ErrorCode.BUSY else None
        if got is not None:
            self.svc.metrics["prefetch_parked_granted"] += 1
        return got

    def _claim_all(self, link: ProducerLink, keys: KeyBlob) -> Claimed | None:
        """``_claim``, kept only if it leases every key (else given back at once)."""
        try:
            got = self._claim(link, keys)
        except ProtocolError:
            return None
        if got is not None and got.num_blocks < len(keys):
            self.svc.release(got)
            return None
        return got

    def _ranks(self, link: ProducerLink) -> list[ProducerLink]:
        """The links to every rank of ``link``'s producer the prefetch leases on."""
        svc = self.svc
        n = svc.producer_tps[link.index] if svc.routes is not None else 1
        return [svc.rank_links[link.index][r] for r in range(n)] if n > 1 else [link]

    def _claim(self, link: ProducerLink, keys: KeyBlob) -> Claimed | None:
        """Lease ``keys`` on ``link``'s background channel (the engine's claims use the
        other one), on every rank of a TP producer; None on a miss."""
        svc = self.svc
        ranks = len(self._ranks(link))
        if ranks > 1:
            return svc.claims.claim_ranks(link.index, "prefetch", [keys] * ranks, True)
        return self._claim_one(link, keys)

    def _claim_one(self, link: ProducerLink, keys: KeyBlob, wait_s: float = 0.0) -> Claimed | None:
        """One ``Claim`` on ``link``: the background channel, or (``wait_s``) a waiting
        one, its answer bounded by ``wait_s`` + the claim's budget; None on a miss."""
        svc = self.svc
        claim = m.Claim(
            v=PROTOCOL_VERSION,
            owner=svc.owner,
            request_id="prefetch",
            keys=keys,
            ttl_s=svc.ccfg.lease_ttl_s,
            wait_s=wait_s,
        )
        if wait_s:
            ok = svc._call(link, claim, wait_s + svc.ccfg.claim_timeout_s, waits=True)
        else:
            ok = svc._call(link, claim, background=True)
        if ok.num_blocks <= 0:
            return None
        svc.keepalive.granted(ok.ttl_s)
        return Claimed(link, ok.lease_id, ok.num_blocks, ok.ttl_s, ok.incarnation)

    def confirm_ahead(self, first: bytes) -> bool:
        """The continuation of the prompt whose first key is ``first`` has arrived (its
        HTTP handler, before the engine sees it): confirm its granted lease now, on the
        background channel, so that ``take`` finds the answer instead of paying the round
        trip on the engine's thread; a prefetch still polling is woken to poll at once.
        Never blocks; False when there is nothing to confirm (not prefetched, not granted
        yet, asked already)."""
        with self._lock:
            e = self._by_first.get(first)
            if self.closed or e is None or e.confirmed is not None:
                return False
            if e.claimed is None:
                if not e.settled.is_set():
                    e.wake.set()
                    self.svc.metrics["prefetch_woken"] += 1
                return False
            e.confirmed = threading.Event()
            if self._confirmer is None:
                self._confirmer = threading.Thread(
                    target=self._confirm_loop, name="disagg-prefetch-confirm", daemon=True
                )
                self._confirmer.start()
        self._ahead.put(e)
        self.svc.metrics["prefetch_confirmed_ahead"] += 1
        return True

    def _confirm_loop(self) -> None:
        while (e := self._ahead.get()) is not None:
            assert e.claimed is not None and e.confirmed is not None
            try:
                e.confirm_ok = self._confirm(e.claimed, background=True)
            except Exception:  # unconfirmed: the continuation claims afresh
                log.exception("prefetched lease confirmation failed")
            e.confirmed_at = time.monotonic()
            e.confirmed.set()

    def take(self, offer: KeyBlob) -> Claimed | None:
        """The lease prefetched for a prompt whose keys start ``offer`` (taken: the caller
        owns it now), or None. A prefetch still polling is woken and waited for within the
        claim's budget; past it, it is abandoned and the caller claims."""
        first = offer.blob[:KEY_BYTES]
        with self._lock:
            entry = self._by_first.get(first)
            if entry is None or offer.blob[: len(entry.keys.blob)] != entry.keys.blob:
                return None
        if entry.claimed is None:
            entry.wake.set()
            entry.settled.wait(self.svc.ccfg.claim_timeout_s)
        with self._lock:
            if entry.abandoned or self._by_first.get(first) is not entry:
                return None  # closed, swept, or missed meanwhile
            self._forget(entry)
            if entry.claimed is None:
                entry.abandoned = True
                self.svc.metrics["prefetch_late"] += 1
                return None
        c = entry.claimed
        if c.num_blocks > len(offer):  # never more than offered (the key check implies it)
            self.svc.release(c)
            return None
        if self._landed(c):  # its pages are here: whatever became of the producer since
            self.svc.metrics["prefetch_taken"] += 1
            return c
        down = any(not r.link.usable() or r.link.stale(r.incarnation) for r in c.all_ranks())
        if down or not self._confirmed(entry, c):
            self.svc.metrics["prefetch_dropped_down"] += 1  # its producer failed since
            self.svc.release(c)
            return None
        self.svc.metrics["prefetch_taken"] += 1
        return c

    def _landed(self, c: Claimed) -> bool:
        """Whether ``c``'s landing-zone fill is whole here; a failed one is dropped (the
        lease is then taken, or not, as a plain one)."""
        zone = self.svc.zone
        if c.zone is None or zone is None:
            return False
        st = zone.state(c)
        if st.failed:
            self.svc.metrics["zone_fills_failed"] += 1
            zone.drop(c)
        return bool(st.done)

    def _confirmed(self, entry: _Entry, c: Claimed) -> bool:
        """``_confirm`` for the take: the answer asked ahead (waited for within the claim's
        budget: a confirmation never answered is a refusal), else, or when that answer is
        older than ``AHEAD_FRESH_S`` (the engine queued the request), asked now; a grant
        younger than that needs none."""
        ahead = entry.confirmed
        if ahead is None:  # a grant this fresh answered for the lease as a renewal would
            fresh = time.monotonic() - entry.granted_at <= AHEAD_FRESH_S
            return fresh or self._confirm(c)
        if not ahead.wait(self.svc.ccfg.claim_timeout_s) or not entry.confirm_ok:
            return False
        if time.monotonic() - entry.confirmed_at > AHEAD_FRESH_S:
            return self._confirm(c)
        return True

    def _confirm(self, c: Claimed, background: bool = False) -> bool:
        """Whether ``c``'s producer still holds the lease, every rank's (one ``Renew`` per
        producer rank, each within the claim's budget)."""
        svc = self.svc
        for r in c.all_ranks():
            renew = m.Renew(
                v=PROTOCOL_VERSION,
                owner=svc.owner,
                lease_ids=[r.lease_id],
                incarnation=r.incarnation,
            )
            try:
                ok = svc._call(r.link, renew, background=background)
            except ProtocolError as exc:
                log.info(
                    "prefetched lease on %s not confirmed (claiming afresh): %s",
                    r.link.endpoint,
                    exc,
                )
                return False
            if r.lease_id in ok.unknown:
                return False
        return True

    def leases(self) -> list[Claimed]:
        """Leases held and not taken yet (the keepalive renews them)."""
        with self._lock:
            return [e.claimed for e in self._by_first.values() if e.claimed is not None]

    def sweep(self, now: float | None = None) -> int:
        """Release leases no continuation took within ``PREFETCH_HOLD_S``; how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [
                e
                for e in self._by_first.values()
                if e.claimed is not None and now - e.granted_at >= PREFETCH_HOLD_S
            ]
            for e in old:
                self._forget(e)
        for e in old:
            assert e.claimed is not None
            self.svc.metrics["prefetch_expired"] += 1
            self.svc.release(e.claimed)
        return len(old)

    def _forget(self, entry: _Entry) -> None:
        first = entry.keys.blob[:KEY_BYTES]
        if self._by_first.get(first) is entry:
            del self._by_first[first]

    def close(self) -> None:
        """Stop polling and give back every lease held (queued on the keepalive)."""
        with self._lock:
            self.closed = True
            held = [e.claimed for e in self._by_first.values() if e.claimed is not None]
            for e in self._by_first.values():
                e.abandoned = True
            self._by_first.clear()
            if self._confirmer is not None:
                self._ahead.put(None)
        for c in held:
            self.svc.release(c)
