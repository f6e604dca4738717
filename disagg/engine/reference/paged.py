"""Attention for a batch's short spans (decode tokens) straight over the pages, on CUDA
(Triton): no gather of the attended keys.

The batched path (``attention.flash_varlen``) first gathers every attended key into one
compact tensor: for decode steps that gather moves each key twice more than attention
reads it, and with head-major pages (``kv_cache``: a page's K or V buffer is ``[heads,
tokens, head_dim]``) it gathers 256-byte head rows through PyTorch's index kernels, which
made a 32-stream decode step 1.4x slower than token-major pages did
(docs/design/reference-engine.md). Here one program per (request, KV head) walks the
request's pages in order, loads each page's ``[tokens_per_block, head_dim]`` key and value
slice of that head (one contiguous run each) and keeps FlashAttention's running softmax in
float32 over them, for every query row of the request times the query heads of that KV
head (at most ``BLOCK_M`` such rows: ``max_rows``).

Numerics: a request's rows see only that request's pages, in the same order, with the same
tile shapes, whatever else is in the batch and wherever its rows fall: batch-invariant, as
the varlen kernel is. Which kernel a request takes depends only on its own span length
(``batch.build``), so a decode token's output does not depend on the batch either.

Inputs: queries ``[rows, heads, head_dim]`` (any strides; heads = REP x the KV heads held);
the output ``[rows, heads, head_dim]`` contiguous, written for the short requests' rows
only; ``pool`` a group's pool as head rows (``KvCacheManager.head_rows``); ``base`` the
layer's first row in a page, ``stride`` a page's rows; per request (device tensors of
``batch``): its first query row, span start and length, first attended position ``lo``,
its page table offset; ``sel`` the short requests' indices.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .attention import per_request
from .batch import build
from .config import EngineConfig
from .kv_cache import KvCacheManager

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU test machine has no Triton
    triton = None

BLOCK_M = 16  # query rows (span tokens x query heads per KV head) a program holds


def max_rows(heads: int, kv_heads: int) -> int:
    """The longest span (tokens) this kernel serves for ``heads`` query heads over
    ``kv_heads`` KV heads; 0 if it serves none."""
    rep = heads // kv_heads
    return BLOCK_M // rep if 0 < rep <= BLOCK_M else 0


def available(device: torch.device, head_dim: int, tokens_per_block: int) -> bool:
    """Whether the kernel runs here: Triton on CUDA, power-of-two head_dim and
    tokens_per_block of at least 16 (``tl.dot``'s smallest tile)."""

    def pow2(x: int) -> bool:
        return x >= 16 and x & (x - 1) == 0

    return (
        triton is not None and device.type == "cuda" and pow2(head_dim) and pow2(tokens_per_block)
    )


if triton is not None:

    @triton.jit
    def _paged_kernel(
        q_ptr,
        o_ptr,
        kv_ptr,
        table_ptr,
        off_ptr,
        lo_ptr,
        start_ptr,
        len_ptr,
        q0_ptr,
        sel_ptr,
        sq_row,
        sq_head,
        so_row,
        so_head,
        base,
        stride,
        heads_per_pool,
        scale,
        window,
        REP: tl.constexpr,
        TPB: tl.constexpr,
        HD: tl.constexpr,
        BM: tl.constexpr,
        WINDOWED: tl.constexpr,
    ):  # pragma: no cover - runs on CUDA only
        r = tl.load(sel_ptr + tl.program_id(0)).to(tl.int64)
        h = tl.program_id(1)
        start = tl.load(start_ptr + r)
        n = tl.load(len_ptr + r)
        lo = tl.load(lo_ptr + r)
        q0 = tl.load(q0_ptr + r).to(tl.int64)
        off = tl.load(off_ptr + r)
        m = tl.arange(0, BM)
        qi = m // REP
        hq = h * REP + m % REP
        live = qi < n
        qpos = start + qi
        d = tl.arange(0, HD)
        t = tl.arange(0, TPB)
        q = tl.load(
            q_ptr + (q0 + qi)[:, None] * sq_row + hq[:, None] * sq_head + d[None, :],
            mask=live[:, None],
            other=0.0,
        )
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, HD], tl.float32)
        head_row = base + h * TPB
        for b in range(lo // TPB, (start + n - 1) // TPB + 1):
            slot = tl.load(table_ptr + off + b)
            row = slot * stride + head_row
            k = tl.load(kv_ptr + (row + t)[:, None] * HD + d[None, :])
            v = tl.load(kv_ptr + (row + heads_per_pool * TPB + t)[:, None] * HD + d[None, :])
            s = tl.dot(q, tl.trans(k)) * scale
            kpos = b * TPB + t
            ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= lo)
            if WINDOWED:
                ok = ok & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            o_ptr + (q0 + qi)[:, None] * so_row + hq[:, None] * so_head + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=live[:, None],
        )


def attend(
    q: torch.Tensor,
    out: torch.Tensor,
    pool: torch.Tensor,
    base: int,
    stride: int,
    heads_per_pool: int,
    tokens_per_block: int,
    table: torch.Tensor,
    offsets: torch.Tensor,
    lo: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    q_starts: torch.Tensor,
    sel: torch.Tensor,
    window: int | None,
) -> None:
    """Write into ``out`` the attention of the requests ``sel`` (module docstring); every
    per-request tensor is indexed by the request's place in the batch."""
    count = sel.numel()
    if count == 0:
        return
    hd = q.shape[-1]
    rep = q.shape[1] // heads_per_pool
    assert q.stride(2) == 1 and out.stride(2) == 1 and rep * heads_per_pool == q.shape[1]
    _paged_kernel[(count, heads_per_pool)](
        q,
        out,
        pool,
        table,
        offsets,
        lo,
        starts,
        lens,
        q_starts,
        sel,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        base,
        stride,
        heads_per_pool,
        1.0 / math.sqrt(hd),
        window or 0,
        REP=rep,
        TPB=tokens_per_block,
        HD=hd,
        BM=BLOCK_M,
        WINDOWED=window is not None,
    )


def probe(cfg: EngineConfig, heads: int) -> str:
    """Run ``attend`` for a few short spans over a small pool of ``cfg``'s head shape
    (``heads`` query heads over the KV heads a rank holds, a sliding window if ``cfg``
    has one) against ``attention.per_request``: ``""`` if they agree, else why not."""
    windows = sorted({w for w in cfg.layer_windows if w is not None})[:1]
    small = replace(
        cfg,
        num_layers=1 + len(windows),
        windows=(None, *windows),
        num_blocks=32,
        tp=1,
        num_kv_heads=cfg.kv_heads_per_rank,
        num_heads=heads,
        hidden_size=heads * cfg.head_dim,
    )
    kv = KvCacheManager(small)
    g = torch.Generator(device="cpu").manual_seed(0)
    for group in kv.groups:
        group.pools[0].copy_(torch.randn(group.pools[0].shape, generator=g))
    tpb, n = small.tokens_per_block, max_rows(heads, small.num_kv_heads)
    spans = [(3 * tpb + 5, 1), (tpb - 1, n), (0, 1), (2 * tpb, min(2, n))]
    slots = iter(range(small.num_blocks))

    class _Req:
        def __init__(self, i: int, end: int) -> None:
            self.request_id, self.tokens, self.adapter = i, [0] * end, None
            self.pages = [[next(slots) for _ in range(-(-end // tpb))] for _ in kv.groups]

    reqs = [(_Req(i, s + k), s, k) for i, (s, k) in enumerate(spans)]
    whole, part = build(reqs, kv), build(reqs, kv, n)
    q = torch.randn(whole.rows, heads, small.head_dim, generator=g).to(kv.device, small.torch_dtype)
    assert part.short is not None
    for layer in range(small.num_layers):
        gid, li, window = kv.layer_group[layer], kv.layer_index[layer], small.layer_windows[layer]
        keys, vals = kv.read_layer(whole.groups[gid].read[li], layer)
        want = per_request(q, keys, vals, whole, whole.groups[gid], window).float()
        got = torch.zeros_like(q)
        base, stride = kv.layer_rows(layer)
        grp = part.groups[gid]
        assert grp.table is not None and grp.offsets is not None and grp.lo_t is not None
        assert part.start_t is not None and part.len_t is not None
        attend(
            q, got, kv.head_rows(gid)[0], base, stride, kv.heads_per_pool, tpb, grp.table,
            grp.offsets, grp.lo_t, part.start_t, part.len_t, part.cu_q, part.short, window,
        )  # fmt: skip
        err = (got.float() - want).abs().max().item()
        if not err < 2e-2:
            return (
                f"paged attention differs from per-request attention by {err:.3g} (window {window})"
            )
    return ""
