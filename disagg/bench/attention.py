"""``disagg bench engine --kernels``: one layer's attention over a batch's paged keys, each
way the reference engine could compute it, on the engine's own pools and indices.

Shapes (rows): ``decode S x C`` (S requests of C cached tokens, one new token each),
``prefill N`` (one N-token prompt from position 0), ``mixed`` (32 decode tokens of 2k
context plus a 4k-token chunk over 4k cached tokens). Kernels:

- ``flash-varlen``: the engine's gather of every attended key from the pages into one
  ragged, compact tensor (``KvCacheManager.read_layer``), then FlashAttention's
  variable-length kernel over the whole batch (``attention.flash_varlen``); timed
  together, and the gather alone (``gather``);
- ``per-request``: the same gather, then one fused-attention call per request with an
  explicit mask (``attention.per_request``: the engine before batching, and its fallback);
- ``padded-sdpa``: the keys gathered into a ``[S, max keys]`` padded batch, one PyTorch
  fused-attention call with a padding mask (decode rows only);
- ``cudnn-whole``: cuDNN's fused attention over each whole prompt padded to its length
  bucket (prefill rows; the engine's path for whole prompts of 1,024+ tokens);
- ``paged``: what the engine runs when ``paged.py`` serves (CUDA, Triton): spans of a few
  tokens straight over the pages, the others gathered then FlashAttention varlen;
- ``flex``: FlexAttention (compiled) over the compact keys with a document mask built per
  call (``create_block_mask``: its time is ``flex-mask``; the kernel alone ``flex``), on
  the ``mixed`` row (each shape compiles anew).

Medians of 20 timed calls after 3 warm-ups (CUDA events); ms per layer call.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..engine.reference import attention as att
from ..engine.reference.batch import Batch, build


class _Req:
    """What ``batch.build`` reads of a request."""

    def __init__(self, rid: int, tokens: list[int], pages: list[list[int]]) -> None:
        self.request_id, self.tokens, self.pages, self.adapter = rid, tokens, pages, None


def _batch(engine: Any, spans: list[tuple[int, int]], paged_max_n: int = 0) -> Batch:
    """A batch of fresh page slots for ``(start, n)`` spans, over the engine's pools."""
    kv, tpb = engine.kv, engine.config.tokens_per_block
    slots = iter(range(engine.config.num_blocks))
    reqs = []
    for i, (s, n) in enumerate(spans):
        pages = [[next(slots) for _ in range(-(-(s + n) // tpb))] for _ in kv.groups]
        reqs.append((_Req(i, [0] * (s + n), pages), s, n))
    return build(reqs, kv, paged_max_n)


def _time(fn: Any, cuda: bool, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _padded(engine: Any, b: Batch) -> Any:
    """A decode batch's keys gathered into ``[S, max keys]`` (short rows repeat their last
    key, masked out) and one fused-attention call: returns the timed callable's maker."""
    g, dev = b.groups[0], b.cu_q.device
    lens = [e - s for s, e in zip(g.k_starts, g.k_starts[1:], strict=False)]
    m = max(lens)
    idx = torch.tensor(
        [g.k_starts[i] + min(j, n - 1) for i, n in enumerate(lens) for j in range(m)], device=dev
    )
    rows = g.read[0][:, idx]
    mask = torch.arange(m, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
    mask = mask[:, None, None]

    def run(q: torch.Tensor) -> torch.Tensor:
        keys, vals = engine.kv.read_layer(rows, 0)
        rep = q.shape[1] // keys.shape[1]
        kp = keys.view(len(lens), m, *keys.shape[1:]).repeat_interleave(rep, 2).transpose(1, 2)
        vp = vals.view(len(lens), m, *vals.shape[1:]).repeat_interleave(rep, 2).transpose(1, 2)
        qp = q.view(len(lens), 1, *q.shape[1:]).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)
        return out.transpose(1, 2).reshape(q.shape)

    return run


def _flex(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, b: Batch) -> dict[str, float]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g, dev = b.groups[0], q.device
    doc_q = torch.repeat_interleave(
        torch.arange(len(b.lens), device=dev), torch.tensor(b.lens, device=dev)
    )
    klens = torch.tensor([e - s for s, e in zip(g.k_starts, g.k_starts[1:], strict=False)])
    doc_k = torch.repeat_interleave(torch.arange(len(b.lens)), klens).to(dev)
    pos_q = b.positions
    ranges = zip(g.lo, b.starts, b.lens, strict=True)
    pos_k = torch.cat([torch.arange(lo, s + n) for lo, s, n in ranges]).to(dev)

    def mask_mod(bb: Any, h: Any, qi: Any, ki: Any) -> Any:
        return (doc_q[qi] == doc_k[ki]) & (pos_k[ki] <= pos_q[qi])

    def mask() -> Any:
        return create_block_mask(mask_mod, 1, None, q.shape[0], keys.shape[0], device=dev)

    fn = torch.compile(flex_attention)
    bm = mask()
    qq, kk, vv = (t.transpose(0, 1)[None] for t in (q, keys, vals))
    cuda = q.is_cuda
    return {
        "flex-mask": _time(mask, cuda, 5),
        "flex": _time(lambda: fn(qq, kk, vv, block_mask=bm, enable_gqa=True), cuda),
    }


def compare(
    engine: Any,
    streams: list[int],
    context: int,
    prefill: list[int],
    mixed_prompt: int,
    flex: bool = True,
) -> list[dict[str, Any]]:
    """Each shape's per-kernel ms (module docstring) on ``engine``'s pools: decode rows of
    ``streams`` x ``context``, prefill rows, and the mixed row (``min(32, max streams)``
    decode tokens plus a ``mixed_prompt`` chunk over as many cached tokens)."""
    cfg = engine.config
    cuda = cfg.device.startswith("cuda")
    shapes = {f"decode {n} x {context}": [(context, 1)] * n for n in streams}
    shapes.update({f"prefill {n}": [(0, n)] for n in prefill})
    mixed = min(32, max(streams))
    mixed_name = f"mixed {mixed} x {context} + {mixed_prompt}"
    shapes[mixed_name] = [(context, 1)] * mixed + [(mixed_prompt, mixed_prompt)]
    rows = []
    for name, spans in shapes.items():
        b = _batch(engine, spans)
        g = b.groups[0]
        q = torch.randn(b.rows, cfg.num_heads, cfg.head_dim, device=cfg.device).to(cfg.torch_dtype)

        def gather(g: Any = g) -> tuple[torch.Tensor, torch.Tensor]:
            return engine.kv.read_layer(g.read[0], 0)

        keys, vals = gather()
        row: dict[str, Any] = {"shape": name, "gather": _time(gather, cuda)}
        kernels = {"per-request": att.per_request}
        if engine.model.attention.batched:
            kernels["flash-varlen"] = att.flash_varlen

        def call(fn: Any, q: Any = q, b: Any = b, g: Any = g) -> Any:
            return fn(q, *gather(g), b, g, None)

        if name.startswith("prefill") and not engine.model.attention.whole_reason:
            kernels["cudnn-whole"] = att.cudnn_whole
        for kname, fn in kernels.items():
            row[kname] = _time(lambda fn=fn: call(fn), cuda)
        paged_n = engine.model.paged_max_n(engine.kv)
        if paged_n:  # the engine's path: short spans over the pages, the rest gathered
            pb = _batch(engine, spans, paged_n)
            row["paged"] = _time(lambda pb=pb, q=q: engine.model.attend(0, q, pb, engine.kv), cuda)
        if name.startswith("decode") and cuda:
            padded = _padded(engine, b)
            row["padded-sdpa"] = _time(lambda padded=padded, q=q: padded(q), cuda)
        if flex and cuda and name == mixed_name:
            try:
                row.update(_flex(q, keys, vals, b))
            except Exception as exc:  # not compiled here: say why, keep the other rows
                row["flex"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
    return rows
