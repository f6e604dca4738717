"""Claims: lease the longest run of a request's blocks that a producer holds.

Contract: ``Claims.claim`` runs on the engine's thread and answers within its deadlines:
``consumer.claim_timeout_s`` per call (the link's lock, Hello and call, one retry after a
producer restart: ``links``); with several producers a parallel ``Lookup`` ranks them first
(bounded by one ``claim_timeout_s``), best first. Anything failing before the answer is a
miss (None): the engine recomputes, and a grant that answers after its deadline expires by
its TTL. A producer that is down or refuses us (``refusals``) is skipped without a call. A
grant's TTL may be shorter than asked: the keepalive then renews more often
(``Keepalive.granted``).

TP > 1 on either side (the leader: rank 0's service, which links to every rank of every
producer): the chosen producer's ranks are claimed in parallel, rank r with rank r's keys
(where the KV heads are located, ``routes``: every rank with the same keys, on however many
ranks the producer runs; bounded by three times ``claim_timeout_s``), and a block is
offered only if every rank holds it: the minimum of the grants. A rank granted more is claimed again for exactly that run, then its longer
lease released (the blocks stay pinned throughout). Any rank failing makes the claim a
miss; what the others granted is released. The returned ``Claimed`` carries the other
ranks' leases (``Claimed.ranks``), which travel to them in the metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from ..protocol import messages as m
from ..protocol.errors import ProtocolError
from ..protocol.keys import KeyBlob
from ..protocol.version import PROTOCOL_VERSION
from .host import LinkHost
from .links import ProducerLink
from .loads import Claimed

log = logging.getLogger("disagg.consumer")

V = PROTOCOL_VERSION


class Claims:
    """The service's claiming (``ConsumerService.claim`` calls ``claim``)."""

    def __init__(self, svc: LinkHost, threads: int):
        self.svc = svc
        self._lookups = ThreadPoolExecutor(max(1, threads), thread_name_prefix="disagg-lookup")

    def close(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)

    def claim(
        self,
        request_id: int,
        keys: KeyBlob | Sequence[bytes],
        rank_keys: Sequence[KeyBlob | Sequence[bytes]] | None = None,
    ) -> Claimed | None:
        """Lease the longest run of ``keys`` any producer holds; None on a miss or on any
        failure (a miss: the engine recomputes). TP > 1 (leader only): ``keys`` are rank 0's
        and ``rank_keys[r - 1]`` rank r's keys of the same blocks; every rank of the chosen
        producer is claimed and the run every rank holds is leased (``claim_ranks``).
        Keys travel packed (``KeyBlob``, e.g. from ``block_key_blob``); a list is packed."""
        svc = self.svc
        if svc.fingerprint is None or not keys:
            return None
        keys = KeyBlob.of(keys)
        ranks: list[KeyBlob] = []
        if svc.tp_size > 1 and svc.tp_rank != 0:
            raise ValueError("a TP claim is the leader's")
        if svc.tp_size > 1 and svc.routes is None:
            if rank_keys is None or len(rank_keys) != svc.tp_size - 1:
                raise ValueError("a head-blind TP claim needs every rank's keys")
            ranks = [KeyBlob.of(k) for k in rank_keys]
        links = [lk for lk in svc.links if lk.usable()]
        if not links:
            svc.metrics["claims_no_producer"] += 1
            return None
        if len(links) > 1:
            links = self._rank_by_lookup(links, keys)
        for link in links:
            n = svc.tp_size if svc.routes is None else svc.producer_tps[link.index]
            if n > 1:
                got = self.claim_ranks(
                    link.index, request_id, [keys, *ranks] if ranks else [keys] * n
                )
                if got is not None:
                    return got
                continue
            try:
                ok = svc._call(
                    link,
                    m.Claim(
                        v=V,
                        owner=svc.owner,
                        request_id=str(request_id),
                        keys=keys,
                        ttl_s=svc.ccfg.lease_ttl_s,
                    ),
                )
            except ProtocolError as exc:
                svc.metrics["claims_failed"] += 1
                if link.refusal is None:  # a refusal is said once, by ``refusals``
                    log.info("claim on %s failed (a miss): %s", link.endpoint, exc)
                continue
            if ok.num_blocks > 0:
                svc.metrics["claims_hit"] += 1
                svc.keepalive.granted(ok.ttl_s)
                return Claimed(link, ok.lease_id, ok.num_blocks, ok.ttl_s, ok.incarnation)
        svc.metrics["claims_miss"] += 1
        return None

    def claim_ranks(
        self, p: int, request_id: int | str, keys: list[KeyBlob], background: bool = False
    ) -> Claimed | None:
        """TP: claim ``keys[r]`` on producer ``p``'s rank r, all ranks in parallel; lease the
        shortest run granted (a block is offered only if every rank holds it). A rank that
        granted more is re-claimed for exactly that run, then its longer lease released (the
        blocks stay pinned throughout). Any rank failing is a miss; granted leases go back.
        ``background``: on the links' background channels, counted as ``prefetch_claims_*``
        (a prefetch's, off the engine's thread)."""
        svc = self.svc
        tag = "prefetch_claims" if background else "claims"
        links = [svc.rank_links[p][r] for r in range(len(keys))]
        if not all(lk.usable() for lk in links):
            svc.metrics[f"{tag}_rank_down"] += 1
            return None
        grants = self._claim_all(links, request_id, keys, background)
        if grants is not None:
            n = min(g.num_blocks for g in grants)
            if 0 < n < max(g.num_blocks for g in grants):
                svc.metrics[f"{tag}_rank_short"] += 1
                longer = [r for r, g in enumerate(grants) if g.num_blocks > n]
                again = self._claim_all(
                    [links[r] for r in longer],
                    request_id,
                    [keys[r][:n] for r in longer],
                    background,
                )
                for r in longer:  # the longer lease: its blocks are pinned by the new one
                    svc.release(grants[r])
                    grants[r] = Claimed(links[r], 0, 0)
                if again is not None:
                    for r, g in zip(longer, again):
                        grants[r] = g
            if all(g.num_blocks == n > 0 for g in grants):
                svc.metrics[f"{tag}_hit"] += 1
                ttl = min(g.ttl_s for g in grants)
                svc.keepalive.granted(ttl)
                first = grants[0]
                return Claimed(
                    first.link, first.lease_id, n, ttl, first.incarnation, ranks=grants[1:]
                )
            for g in grants:
                if g.lease_id:
                    svc.release(g)
        svc.metrics[f"{tag}_miss"] += 1
        return None

    def _claim_all(
        self,
        links: list[ProducerLink],
        request_id: int | str,
        keys: list[KeyBlob],
        background: bool = False,
    ) -> list[Claimed] | None:
        """``Claim(keys[i])`` on ``links[i]``, in parallel, each bounded by its own deadline
        (and the whole by three times ``claim_timeout_s``: lock, Hello, call). None if any
        failed (what the others granted is released)."""
        svc = self.svc
        futs = [
            self._lookups.submit(
                svc._call,
                lk,
                m.Claim(
                    v=V,
                    owner=svc.owner,
                    request_id=str(request_id),
                    keys=k,
                    ttl_s=svc.ccfg.lease_ttl_s,
                ),
                background=background,
            )
            for lk, k in zip(links, keys)
        ]
        wait(futs, timeout=3 * svc.ccfg.claim_timeout_s)
        grants: list[Claimed] = []
        failed = False
        for lk, f in zip(links, futs):
            exc = f.exception() if f.done() else TimeoutError("no answer within the deadline")
            if exc is None:
                ok = f.result()
                grants.append(Claimed(lk, ok.lease_id, ok.num_blocks, ok.ttl_s, ok.incarnation))
                continue
            failed = True
            svc.metrics["prefetch_claims_failed" if background else "claims_failed"] += 1
            if lk.refusal is None:  # a refusal is said once, by ``refusals``
                log.info("claim on %s failed (a miss): %s", lk.endpoint, exc)
        if failed:
            for g in grants:
                if g.lease_id:
                    svc.release(g)
            return None
        return grants

    def _rank_by_lookup(self, links: list[ProducerLink], keys: KeyBlob) -> list[ProducerLink]:
        """Ask every producer in parallel how much it holds; best first, misses dropped."""
        svc = self.svc
        msg = m.Lookup(v=V, owner=svc.owner, keys=keys)
        futs = {self._lookups.submit(svc._call, lk, msg): lk for lk in links}
        done, _ = wait(futs, timeout=svc.ccfg.claim_timeout_s)
        held = []
        for f in done:
            if f.exception() is None and f.result().num_blocks > 0:
                held.append((f.result().num_blocks, futs[f]))
        # most blocks first; ties in configured order (stable, not by who answered first)
        held.sort(key=lambda x: (-x[0], x[1].index))
        return [lk for _, lk in held]
