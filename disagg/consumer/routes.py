"""Which producer ranks a consumer rank loads its KV heads from, when TP sizes may differ.

Where the model's KV head count is known (``engine.heads``), consumer rank ``d`` of TP
``D`` holds heads ``rank_heads(kv, D, d)``; producer ``p`` runs TP ``P_p`` (the number of
rank endpoints ``consumer.producers[p]`` lists; one endpoint: ``P_p = D``). Its route to
producer ``p`` is ``heads.sources(kv, P_p, held)``: one ``(producer rank, heads)`` per
producer rank whose heads it needs, each taken whole (a replicated head from the first
rank holding it):

- ``P_p <= D`` (the producer's ranks hold more heads): one part, the consumer's own heads,
  landing in its whole pages; the Push names those heads (``heads``) unless they are every
  head the producer rank holds (equal TP: the whole page, as ever);
- ``P_p > D`` (a consumer page assembled from several producer ranks): one part per
  producer rank, each landing in the receiver's groups of exactly those heads
  (``group_base``): a slice pool per part (``engine.heads.slice_layout``) registered on the
  data plane after the engine's own groups, so every part lands in place in the slots.

A load runs one transfer per part, all with the load's token; it lands when every part's
did, fails when any part's does (``status``), and an abort stops every part.
Head-blind (the count unknown, or not located in the pages): ``Routes.none`` and a TP
shard is loaded from the producer rank of the same index, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..engine.heads import HeadGeometry, rank_heads, slice_layout, sources
from ..pages import PagePool
from ..transport.dataplane import TransferState, TransferStatus
from .loads import Claimed


@dataclass(frozen=True)
class Part:
    """One producer rank's share of a consumer rank's load."""

    rank: int  # the producer's rank
    heads: range  # absolute KV heads it sends
    whole_source: bool  # every head that producer rank holds (Push.heads left empty)


class Routes:
    """This consumer rank's routes to every configured producer (module docstring)."""

    def __init__(self, num_kv_heads: int, tp_size: int, tp_rank: int, producer_tps: list[int]):
        self.num_kv_heads = num_kv_heads
        self.held = rank_heads(num_kv_heads, tp_size, tp_rank)
        self.producer_tps = producer_tps
        self.parts: list[list[Part]] = [
            [
                Part(r, part, part == rank_heads(num_kv_heads, tp, r))
                for r, part in sources(num_kv_heads, tp, self.held)
            ]
            for tp in producer_tps
        ]
        self.group_base: dict[range, int] = {}  # slice -> its first data-plane group
        self._slices: list[PagePool] = []

    @staticmethod
    def of(svc: Any, producer_tps: list[int]) -> Routes | None:
        """The routes of ``svc`` (a consumer service), None when head-blind. ValueError
        naming ``consumer.producers[i]`` for a producer TP size the heads cannot split
        over."""
        kv = svc.num_kv_heads
        if not kv:
            return None
        try:
            rank_heads(kv, svc.tp_size, svc.tp_rank)
        except ValueError:
            return None  # our own TP size: the engine refuses it, or we are head-blind
        for i, tp in enumerate(producer_tps):
            if kv % tp and tp % kv:
                raise ValueError(
                    f"consumer.producers[{i}] lists {tp} rank endpoints, a TP size that "
                    f"neither divides the model's {kv} KV heads nor is a multiple of them: "
                    "list every rank of the producer, in rank order"
                )
        return Routes(kv, svc.tp_size, svc.tp_rank, producer_tps)

    def ranks_linked(self, producer: int, leader: bool) -> list[int]:
        """The producer ranks this rank talks to: the leader claims on all of them."""
        if leader:
            return list(range(self.producer_tps[producer]))
        return [part.rank for part in self.parts[producer]]

    def data_plane_groups(self, pool: PagePool, geom: HeadGeometry) -> list[list[torch.Tensor]]:
        """The receiver's groups: ``pool``'s own, then each slice's that some route lands
        in (``group_base`` records where each starts)."""
        groups = pool.data_plane_groups()
        for part in sorted({p.heads for ps in self.parts for p in ps}, key=lambda r: r.start):
            if part == self.held:
                continue
            sliced = PagePool(slice_layout(pool.layout, geom, part, device=str(pool.device)))
            self._slices.append(sliced)
            self.group_base[part] = len(groups)
            groups += sliced.data_plane_groups()
        return groups

    def base_of(self, part: Part) -> int:
        return 0 if part.heads == self.held else self.group_base[part.heads]


def status(data: Any, transfer_ids: list[int]) -> TransferStatus:
    """One load's transfers as one: FAILED once any failed, DONE once all are; else the
    pages every part has landed (parts carry equal pages per layer, so layer marks hold)."""
    sts = [data.poll(t) for t in transfer_ids]
    if len(sts) == 1:
        return sts[0]
    for st in sts:
        if st.state is TransferState.FAILED:
            return st
    if all(st.state is TransferState.DONE for st in sts):
        return TransferStatus(
            TransferState.DONE, pages=sum(s.pages for s in sts), nbytes=sum(s.nbytes for s in sts)
        )
    return TransferStatus(
        TransferState.RECEIVING,
        pages=min(s.pages for s in sts),
        nbytes=sum(s.nbytes for s in sts),
    )


def rank_claims(
    svc: Any, producer: int, lease_ids: list[int], num_blocks: int, incarnations: list[int]
) -> tuple[Claimed, list[tuple[Claimed, Part]] | None]:
    """Ranks > 0: this rank's lease(s) of a plan (``lease_ids``, ``incarnations``: per
    producer rank). Head-blind: the lease of the producer rank of our index, no sources;
    else the first source's lease and every source (its producer rank's lease, its part)."""

    def claimed(r: int, link: Any) -> Claimed:
        inc = incarnations[r] if incarnations else 0
        return Claimed(link, lease_ids[r], num_blocks, incarnation=inc)

    if svc.routes is None:
        return claimed(svc.tp_rank, svc.links[producer]), None
    links = svc.rank_links[producer]
    srcs = [(claimed(p.rank, links[p.rank]), p) for p in svc.routes.parts[producer]]
    return srcs[0][0], srcs
