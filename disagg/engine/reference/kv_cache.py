"""Paged KV cache: one page pool per layer group (one group per distinct attention window,
in first-appearance order, like TensorRT-LLM's V2 manager), per TP rank held in this
process: every rank when the ranks are simulated in one process, only its own when each
rank is its own process (``ranks=[r]``, the MPI mode). Page slots, allocation and reuse are
rank-independent (every rank's allocator takes the same decisions from the same inputs).

Pool tensor of group ``g`` on rank ``r``: ``[num_blocks, len(layer_ids), 2,
kv_heads_per_rank * tokens_per_block * head_dim]`` in the KV dtype, each K or V buffer
head-major (``[heads, tokens, head_dim]``, TensorRT-LLM's block layout), so one head's slice
of a page is one contiguous run per buffer (``engine.heads``). Rank ``r`` holds the KV
heads ``heads.rank_heads(num_kv_heads, tp, r)`` (replicated when ``tp > num_kv_heads``).
In V1 mode the single
group's tensor is exactly what ``register_kv_caches`` receives; in V2 mode each tensor is
described by one ``KvCacheRegion`` (buffers ``(layer, "key"), (layer, "value")`` per layer,
ascending) inside a ``KvCacheLayout``.

Block reuse: a full block's content hash (chained over the prefix and the cache salt) maps
to a page per group. Freed hashed pages stay cached until evicted (LRU) by an allocation.
Sliding-window pages are reclaimed once the window has passed their block; the request's
page list keeps ``-1`` in their place.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ...protocol.keys import block_keys
from .. import layout as _layout_mod
from ..heads import rank_heads
from .config import EngineConfig

BAD = -1


def block_hashes(
    tokens: list[int],
    tpb: int,
    salt: str | None,
    adapter: str | None = None,
    known: list[bytes] | None = None,
) -> list[bytes]:
    """Chained hashes of every full block of ``tokens`` (the salt and the request's
    adapter, LoRA task and multimodal inputs, seed the chain, as TensorRT-LLM's block
    reuse keys do). ``known``: the hashes of the leading blocks, already computed: only
    the blocks after them are hashed (the chain runs in C: a 12k-token prompt's blocks
    are hashed on the admission path of every request)."""
    out = list(known or [])
    if len(tokens) // tpb <= len(out):
        return out
    prev = out[-1] if out else None
    seed = prev if prev is not None else _seed(salt, adapter)
    return out + block_keys(seed, tokens, tpb, len(out), prev)


def _seed(salt: str | None, adapter: str | None) -> bytes:
    seed = xxhash.xxh3_128_digest(b"disagg-reference" + (salt or "").encode())
    if adapter is not None:
        seed = xxhash.xxh3_128_digest(seed + adapter.encode())
    return seed


class OutOfPages(RuntimeError):
    pass


@dataclass
class GroupState:
    window: int | None
    layer_ids: tuple[int, ...]
    pools: list[torch.Tensor]  # one per rank held here (``KvCacheManager.ranks`` order)
    free: list[int] = field(default_factory=list)
    cached: OrderedDict[bytes, int] = field(default_factory=OrderedDict)  # free, hashed (LRU)
    live: dict[bytes, int] = field(default_factory=dict)  # in use, hashed
    refcnt: list[int] = field(default_factory=list)
    slot_hash: list[bytes | None] = field(default_factory=list)

    def available(self) -> int:
        return len(self.free) + len(self.cached)


class KvCacheManager:
    """Page pools plus allocation, reuse and reclamation. ``ranks``: the TP ranks whose
    KV-head shards this process holds (default: all of them, the one-process simulation)."""

    def __init__(self, cfg: EngineConfig, ranks: list[int] | None = None):
        self.cfg = cfg
        self.tpb = cfg.tokens_per_block
        self.ranks = list(range(cfg.tp)) if ranks is None else list(ranks)
        if not self.ranks or any(not 0 <= r < cfg.tp for r in self.ranks):
            raise ValueError(f"KvCacheManager: ranks {self.ranks} not within tp={cfg.tp}")
        width = cfg.tokens_per_block * cfg.kv_heads_per_rank * cfg.head_dim
        self.heads = [rank_heads(cfg.num_kv_heads, cfg.tp, r) for r in self.ranks]
        self.groups: list[GroupState] = []
        self.layer_group: dict[int, int] = {}
        self.layer_index: dict[int, int] = {}
        for gid, (window, layer_ids) in enumerate(cfg.layer_groups):
            pools = [
                torch.zeros(
                    cfg.num_blocks,
                    len(layer_ids),
                    2,
                    width,
                    dtype=cfg.torch_dtype,
                    device=cfg.device,
                )
                for _ in self.ranks
            ]
            g = GroupState(
                window,
                layer_ids,
                pools,
                free=list(range(cfg.num_blocks - 1, -1, -1)),
                refcnt=[0] * cfg.num_blocks,
                slot_hash=[None] * cfg.num_blocks,
            )
            self.groups.append(g)
            for li, layer in enumerate(layer_ids):
                self.layer_group[layer] = gid
                self.layer_index[layer] = li
        # every pool as rows of one head's key (or value) at one token (``head_rows``)
        self._rows = [[p.view(-1, cfg.head_dim) for p in g.pools] for g in self.groups]
        # a head's rows are ``tokens_per_block`` rows after the previous head's
        self._head_offsets = (
            torch.arange(cfg.kv_heads_per_rank, device=cfg.device) * cfg.tokens_per_block
        )

    @property
    def device(self) -> torch.device:
        return self.groups[0].pools[0].device

    def local(self, rank: int) -> int:
        """Index of ``rank``'s pool in ``GroupState.pools`` (``KeyError``-like ValueError
        naming the rank if this process does not hold it)."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"TP rank {rank} is not held here (ranks {self.ranks})") from None

    # ----- registration views -------------------------------------------------------
    def v1_tensor(self, rank: int) -> torch.Tensor:
        """The V1 ``register_kv_caches`` tensor of ``rank`` (single group only)."""
        if len(self.groups) != 1:
            raise NotImplementedError(
                f"the V1 KV cache manager describes one pool, but this model has "
                f"{len(self.groups)} attention windows (VSWA): use kv_manager='v2'"
            )
        return self.groups[0].pools[self.local(rank)]

    def layout(self, rank: int) -> _layout_mod.KvCacheLayout:
        """The V2 ``register_kv_cache_layout`` description of ``rank``'s pools, in the layout
        classes of the TensorRT-LLM line in use (fields it lacks are left out). With
        ``replicated_regions`` each group's last layer is described as a replicated region
        (where the line's classes have them)."""
        from .. import KvCacheBufferRef, KvCacheLayerGroupLayout, KvCacheLayout, KvCacheRegion

        region_fields = getattr(KvCacheRegion, "__dataclass_fields__", {})
        group_fields = getattr(KvCacheLayerGroupLayout, "__dataclass_fields__", {})
        layout_fields = getattr(KvCacheLayout, "__dataclass_fields__", {})
        split = self.cfg.replicated_regions and "replicated_regions" in group_fields

        def region(t: torch.Tensor, layers: tuple[int, ...], first: int) -> Any:
            per_layer = t[0, 0].numel() * t.element_size()  # one layer's K and V
            bufs = tuple(
                KvCacheBufferRef(layer_id=layer, role=role)
                for layer in layers
                for role in ("key", "value")
            )
            kw = {"device": str(t.device)} if "device" in region_fields else {}
            page = t[0].numel() * t.element_size()
            return KvCacheRegion(
                t.data_ptr() + first * per_layer,
                per_layer * len(layers),
                page,
                t.shape[0],
                bufs,
                **kw,
            )

        groups = []
        for gid, g in enumerate(self.groups):
            t = g.pools[self.local(rank)]
            layers = tuple(g.layer_ids)
            if split and len(layers) > 1:
                main = (region(t, layers[:-1], 0),)
                extra = {"replicated_regions": (region(t, layers[-1:], len(layers) - 1),)}
            else:
                main, extra = (region(t, layers, 0),), {}
            groups.append(KvCacheLayerGroupLayout(gid, layers, g.window, main, **extra))
        kw = {"dtype": self.cfg.torch_dtype} if "dtype" in layout_fields else {}
        return KvCacheLayout(self.tpb, tuple(groups), **kw)

    # ----- reuse ----------------------------------------------------------------------
    def match_prefix(self, hashes: list[bytes], prompt_len: int) -> int:
        """Device-matched prefix P in tokens: leading blocks cached in every group, capped
        so at least one prompt token is left to compute (always block-aligned)."""
        if not self.cfg.enable_block_reuse:
            return 0
        n = 0
        for h in hashes:
            if all(h in g.live or h in g.cached for g in self.groups):
                n += 1
            else:
                break
        return min(n, (prompt_len - 1) // self.tpb) * self.tpb

    def needed_block(self, gid: int, ordinal: int, first_pos: int) -> bool:
        """Whether block ``ordinal`` needs a page in group ``gid`` when computing starts at
        position ``first_pos`` (the query at ``first_pos`` looks back ``window-1``)."""
        w = self.groups[gid].window
        return w is None or (ordinal + 1) * self.tpb - 1 >= first_pos - w + 1

    def pages_to_take(self, gid: int, have: int, upto_tokens: int, first_pos: int) -> int:
        nb = -(-upto_tokens // self.tpb)
        return sum(1 for b in range(have, nb) if self.needed_block(gid, b, first_pos))

    def extend(
        self,
        pages: list[list[int]],
        upto_tokens: int,
        first_pos: int,
        hashes: list[bytes],
        reuse_blocks: int,
    ) -> None:
        """Grow a request's per-group page lists to cover ``upto_tokens`` tokens. Blocks
        below ``reuse_blocks`` take the cached page; dead sliding blocks get ``-1``."""
        nb = -(-upto_tokens // self.tpb)
        for gid, g in enumerate(self.groups):
            lst = pages[gid]
            for b in range(len(lst), nb):
                if not self.needed_block(gid, b, first_pos):
                    lst.append(BAD)
                elif b < reuse_blocks:
                    lst.append(self._take_cached(g, hashes[b]))
                else:
                    lst.append(self._alloc(g))

    def _take_cached(self, g: GroupState, h: bytes) -> int:
        if h in g.live:
            slot = g.live[h]
        else:
            slot = g.cached.pop(h)
            g.live[h] = slot
        g.refcnt[slot] += 1
        return slot

    def _alloc(self, g: GroupState) -> int:
        if g.free:
            slot = g.free.pop()
        elif g.cached:
            h, slot = g.cached.popitem(last=False)
            g.slot_hash[slot] = None
        else:
            raise OutOfPages("KV cache pool exhausted")
        g.refcnt[slot] = 1
        return slot

    def _release(self, g: GroupState, slot: int) -> None:
        g.refcnt[slot] -= 1
        if g.refcnt[slot] > 0:
            return
        h = g.slot_hash[slot]
        if h is not None and g.live.get(h) == slot:
            del g.live[h]
            g.cached[h] = slot
        else:
            g.slot_hash[slot] = None
            g.free.append(slot)

    def register(self, pages: list[list[int]], hashes: list[bytes], start: int, end: int) -> None:
        """Publish full blocks ``[start, end)`` of a request for reuse."""
        if not self.cfg.enable_block_reuse:
            return
        for gid, g in enumerate(self.groups):
            for b in range(start, min(end, len(pages[gid]), len(hashes))):
                slot, h = pages[gid][b], hashes[b]
                if slot < 0 or g.slot_hash[slot] is not None or h in g.live or h in g.cached:
                    continue
                g.slot_hash[slot] = h
                g.live[h] = slot

    def reclaim(self, pages: list[list[int]], next_pos: int) -> None:
        """Free sliding-window pages no query at or after ``next_pos`` can reach."""
        for gid, g in enumerate(self.groups):
            if g.window is None:
                continue
            lst = pages[gid]
            for b, slot in enumerate(lst):
                if slot >= 0 and not self.needed_block(gid, b, next_pos):
                    self._release(g, slot)
                    lst[b] = BAD

    def free(self, pages: list[list[int]]) -> None:
        for gid, g in enumerate(self.groups):
            for slot in pages[gid]:
                if slot >= 0:
                    self._release(g, slot)
            pages[gid] = []

    # ----- the forward's page access ---------------------------------------------------
    @property
    def heads_per_pool(self) -> int:
        """KV heads in each rank's pool (the ``H`` of ``batch``'s row arithmetic)."""
        return self.cfg.kv_heads_per_rank

    def head_rows(self, gid: int) -> list[torch.Tensor]:
        """Group ``gid``'s pool of each rank held here as rows of one head's key (or value)
        at one token: ``[num_blocks * layers * 2 * heads * tokens_per_block, head_dim]``
        views; ``batch`` says which row is which."""
        return self._rows[gid]

    def layer_rows(self, layer: int) -> tuple[int, int]:
        """``(base, stride)`` of ``layer`` in its group's ``head_rows``: a page's first row
        of the layer's keys (its values are ``heads_per_pool * tokens_per_block`` rows on)
        and the rows of one page."""
        buffer = self.heads_per_pool * self.tpb
        layers = len(self.groups[self.layer_group[layer]].layer_ids)
        return 2 * buffer * self.layer_index[layer], 2 * buffer * layers

    def _expand(self, rows: torch.Tensor) -> torch.Tensor:
        """Head 0's rows ``[n]`` -> every held head's ``[n * heads]`` (token-major)."""
        return (rows[:, None] + self._head_offsets).reshape(-1)

    def write_layer(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a forward's new keys/values of ``layer`` ``[n, num_kv_heads * head_dim]``
        (every KV head: each rank's pool keeps its heads) at ``rows`` (``[2, n]``: the
        keys' and the values' head-0 rows in the group's ``head_rows``,
        ``batch.GroupRows``): one copy each per rank held here."""
        hd, n = self.cfg.head_dim, k.shape[0]
        kr, vr = self._expand(rows[0]), self._expand(rows[1])
        for heads, view in zip(self.heads, self._rows[self.layer_group[layer]], strict=True):
            shard = slice(heads.start * hd, heads.stop * hd)
            view.index_copy_(0, kr, k[:, shard].reshape(n * len(heads), hd).to(view.dtype))
            view.index_copy_(0, vr, v[:, shard].reshape(n * len(heads), hd).to(view.dtype))

    def read_layer(self, rows: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of ``layer`` at ``rows`` (``[2, m]``, ``batch.GroupRows.read``):
        ``[m, kv heads held here, head_dim]``, the heads of the ranks held here side by
        side in rank order (every KV head in the one-process simulation; a replicated
        head once per rank holding it, which grouped-query attention maps right)."""
        views = self._rows[self.layer_group[layer]]
        shape = (rows.shape[1], -1, self.cfg.head_dim)
        kr, vr = self._expand(rows[0]), self._expand(rows[1])
        if len(views) == 1:
            return views[0][kr].view(shape), views[0][vr].view(shape)
        k = torch.cat([view[kr].view(shape) for view in views], dim=1)
        v = torch.cat([view[vr].view(shape) for view in views], dim=1)
        return k, v

    # ----- byte access ----------------------------------------------------------------
    def snapshot(
        self, pages: list[list[int]], lo: int, hi: int, complete: bool = False
    ) -> dict[tuple[int, int], bytes]:
        """``{(group, block): bytes}`` of a request's pages over positions ``[lo, hi)``
        (``complete``: only blocks whose last position is in the range)."""
        tpb, out = self.tpb, {}
        first, last = lo // tpb, hi // tpb if complete else -(-hi // tpb)
        for gid, lst in enumerate(pages):
            for b in range(first, min(last, len(lst))):
                if complete and not (lo < (b + 1) * tpb <= hi):
                    continue
                if lst[b] >= 0:
                    out[(gid, b)] = self.page_bytes(gid, lst[b])
        return out

    def page_bytes(self, gid: int, slot: int) -> bytes:
        """A group page's bytes: the slot of every rank held here, concatenated in rank
        order (in the MPI mode: this rank's shard only)."""
        return b"".join(
            p[slot].contiguous().view(torch.uint8).cpu().numpy().tobytes()
            for p in self.groups[gid].pools
        )


def page_by_head(cfg: EngineConfig, gid: int, data: bytes) -> bytes:
    """A group page of every rank (``KvCacheManager.page_bytes`` of the one-process
    simulation, ranks in order) as ``[layers, 2, num_kv_heads, tokens, head_dim]`` by
    absolute KV head, a replicated head once: the same bytes whatever the TP size."""
    layers = len(cfg.layer_groups[gid][1])
    ranks = np.frombuffer(data, dtype=np.uint8).reshape(cfg.tp, layers, 2, -1)
    heads: dict[int, np.ndarray] = {}
    for r in range(cfg.tp):
        held = rank_heads(cfg.num_kv_heads, cfg.tp, r)
        mine = ranks[r].reshape(layers, 2, len(held), -1)
        for i, h in enumerate(held):
            heads.setdefault(h, mine[:, :, i])
    return np.stack([heads[h] for h in range(cfg.num_kv_heads)], axis=2).tobytes()
