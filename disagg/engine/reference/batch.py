"""One iteration's forward batch: every scheduled context chunk and generation token as the
rows of one tensor, and the page indices every layer of the forward uses.

Rows: request ``i``'s span ``[start_i, start_i + n_i)`` is rows ``[q_starts[i],
q_starts[i + 1])``, requests in the executor's batch order. Pages: a layer group's pools
are rows of one KV head's key (or value) at one token (``KvCacheManager.head_rows``, the
buffers head-major); position ``p`` of a request is, for the rank's first head, row
``slot * stride + (layer_index * 2 + kv) * H * tokens_per_block + p % tokens_per_block``,
``slot`` its page of block ``p // tokens_per_block``, ``H`` the heads per pool, ``stride
= 2 * H * tokens_per_block * layers in the group``; head ``j`` held is ``j *
tokens_per_block`` rows further (added by the cache manager).
Per group and layer the batch holds the rows of the new tokens (``write``) and of every
key they attend to (``read``: ``[lo_i, start_i + n_i)``, ``lo_i`` the window's first
position), concatenated in batch order: one ``index_copy_`` stores a layer's new keys for
the whole batch and one ``index_select`` gathers the keys attended, ragged and compact as a
varlen attention kernel takes them (``k_starts`` their offsets).

Built once per forward: a few host ints per request and the page slots its spans touch,
one host-to-device copy, a few vectorised ops on the device (no per-token Python). A span
reaching a block without a page is refused here (``RuntimeError``), failing the batch.

Short spans (``paged_max_n``: at most that many tokens, decode steps; 0 = none) attend
straight over the pages (``paged``): their keys are not gathered, and ``read``, ``lo``,
``k_starts`` and the ``long`` sub-batch cover the other requests only.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from .kv_cache import KvCacheManager


@dataclass
class GroupRows:
    """One layer group's page rows for the batch (see the module docstring)."""

    write: torch.Tensor  # [layers in the group, 2 (keys, values), rows] int64
    read: torch.Tensor  # [layers in the group, 2, keys] int64
    lo: list[int]  # first key position per request
    k_starts: list[int]  # offsets of each request's keys in ``read``, and the total
    cu_k: torch.Tensor  # k_starts as int32 on the device
    max_k: int
    table: torch.Tensor | None = None  # every request's page slots used, concatenated
    offsets: torch.Tensor | None = None  # [requests]: table[offsets[i] + b] is block b's page
    lo_t: torch.Tensor | None = None  # [requests] first key position, on the device


@dataclass
class Batch:
    """Rows of one forward (see the module docstring)."""

    starts: list[int]
    lens: list[int]
    adapters: list[str | None]
    ids: torch.Tensor  # [rows] token ids
    positions: torch.Tensor  # [rows] int64
    q_starts: list[int]
    cu_q: torch.Tensor  # q_starts as int32 on the device
    max_q: int
    groups: list[GroupRows]
    start_t: torch.Tensor | None = None  # [requests] int64 on the device
    len_t: torch.Tensor | None = None
    short: torch.Tensor | None = None  # [short requests] their indices (paged attention)
    long: Batch | None = None  # the other requests' sub-batch, rows compacted
    long_rows: torch.Tensor | None = None  # their rows in this batch

    @property
    def rows(self) -> int:
        return self.q_starts[-1]

    def last_row(self, i: int) -> int:
        """The row of request ``i``'s last position (the one it samples from)."""
        return self.q_starts[i + 1] - 1


def build(spans: list[tuple[Any, int, int]], kv: KvCacheManager, paged_max_n: int = 0) -> Batch:
    """The batch of ``spans`` (``(request, start, n)``, batch order); each request's page
    lists must cover ``[lo, start + n)`` in every group. Spans of at most ``paged_max_n``
    tokens are short (module docstring)."""
    tpb = kv.tpb
    starts = [s for _, s, _ in spans]
    lens = [n for _, _, n in spans]
    ends = [s + n for s, n in zip(starts, lens, strict=True)]
    q_starts = [0, *accumulate(lens)]
    nreq = len(spans)
    short = [i for i, n in enumerate(lens) if n <= paged_max_n]
    longs = [i for i, n in enumerate(lens) if n > paged_max_n] if short else list(range(nreq))
    host: list[int] = []
    for req, s, n in spans:
        host += req.tokens[s : s + n]
    host += starts + lens + q_starts
    if short:
        host += short + longs
    per_group: list[tuple[list[int], list[int], int]] = []
    for gid, g in enumerate(kv.groups):
        lo = [0 if g.window is None else max(0, s - g.window + 1) for s in starts]
        k_starts = [0, *accumulate(ends[i] - lo[i] for i in longs)]
        offsets: list[int] = []
        pages_used: list[int] = []
        for (req, _, _), b, e in zip(spans, lo, ends, strict=True):
            b0, b1 = b // tpb, (e - 1) // tpb + 1
            pages = req.pages[gid][b0:b1]
            if len(pages) < b1 - b0 or min(pages) < 0:
                bad = next((b0 + i for i, p in enumerate(pages) if p < 0), b0 + len(pages))
                raise RuntimeError(
                    f"request {req.request_id}: layer group {gid} has no page for position "
                    f"block {bad}"
                )
            offsets.append(len(pages_used) - b0)
            pages_used += pages
        per_group.append(([lo[i] for i in longs], k_starts, len(pages_used)))
        host += lo + [e - b for b, e in zip(lo, ends, strict=True)] + offsets + pages_used
        host += k_starts
    dev = kv.device
    flat = torch.tensor(host, dtype=torch.int64).to(dev)
    rows = q_starts[-1]
    at = 0

    def take(count: int) -> torch.Tensor:
        nonlocal at
        at += count
        return flat[at - count : at]

    ids = take(rows)
    start_t, len_t, q_start_t = take(nreq), take(nreq), take(nreq + 1)
    cu_q = q_start_t.to(torch.int32)
    short_t = long_t = None
    if short:
        short_t, long_t = take(len(short)), take(len(longs))
    positions = torch.empty(0, dtype=torch.int64, device=dev)
    groups = []
    for gid, (lo, k_starts, table_len) in enumerate(per_group):
        lo_t, span_t, off_t = take(nreq), take(nreq), take(nreq)
        table = take(table_len)
        cu_k = take(len(longs) + 1).to(torch.int32)
        layers = len(kv.groups[gid].layer_ids)
        buffer = kv.heads_per_pool * tpb  # rows of one (layer, role) buffer of a page
        stride = 2 * buffer * layers
        pos, write = _page_rows(start_t, len_t, rows, off_t, table, stride, tpb)
        if long_t is None:
            _, read = _page_rows(lo_t, span_t, k_starts[-1], off_t, table, stride, tpb)
        else:
            _, read = _page_rows(
                lo_t[long_t], span_t[long_t], k_starts[-1], off_t[long_t], table, stride, tpb
            )
        # every layer's rows at once: layer l's keys are 2 * l buffers on, its values one more
        shift = torch.arange(2 * layers, device=dev).view(layers, 2, 1) * buffer
        write, read = write + shift, read + shift
        positions = pos
        groups.append(
            GroupRows(
                write,
                read,
                lo,
                k_starts,
                cu_k,
                max((b - a for a, b in zip(k_starts, k_starts[1:], strict=False)), default=0),
                table,
                off_t,
                lo_t,
            )
        )
    batch = Batch(
        starts,
        lens,
        [req.adapter for req, _, _ in spans],
        ids,
        positions,
        q_starts,
        cu_q,
        max(lens),
        groups,
        start_t,
        len_t,
    )
    if short_t is not None:
        batch.short = short_t
        if longs:
            l_lens = [lens[i] for i in longs]
            l_q = [0, *accumulate(l_lens)]
            batch.long = Batch(
                [starts[i] for i in longs],
                l_lens,
                [batch.adapters[i] for i in longs],
                ids,
                positions,
                l_q,
                torch.tensor(l_q, dtype=torch.int32).to(dev),
                max(l_lens),
                groups,
            )
            batch.long_rows = _ranges(q_start_t[long_t], len_t[long_t], l_q[-1])[0]
    return batch


def _ranges(
    first: torch.Tensor, count: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[first_i, first_i + count_i)`` of every i, concatenated (``total`` values), and
    which i each value belongs to."""
    dev = first.device
    req = torch.repeat_interleave(torch.arange(first.numel(), device=dev), count, output_size=total)
    done = torch.cumsum(count, 0) - count
    return first[req] + torch.arange(total, device=dev) - done[req], req


def _page_rows(
    lo: torch.Tensor,
    count: torch.Tensor,
    total: int,
    offsets: torch.Tensor,
    table: torch.Tensor,
    stride: int,
    tpb: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[lo_i, lo_i + count_i)`` of every request, concatenated, and their base
    page rows (``table[offsets_i + p // tpb]`` is request i's page of block p)."""
    pos, req = _ranges(lo, count, total)
    slot = table[offsets[req] + torch.div(pos, tpb, rounding_mode="floor")]
    return pos, slot * stride + pos % tpb
