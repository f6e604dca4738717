"""Attention over a batch's ragged keys: one call per layer for the whole batch, or one per
request where each request's numbers must not depend on the rest of the batch.

Inputs (``batch.Batch`` and ``batch.GroupRows``): queries ``[rows, heads, head_dim]`` of
every request's new positions, concatenated; keys/values ``[keys, kv_heads, head_dim]`` of
every request's attended positions ``[lo_i, start_i + n_i)``, concatenated; query ``i`` of
request ``r`` (position ``start_r + i``) attends to keys ``[max(lo_r, p - window + 1), p]``.
Grouped-query heads: query head ``h`` reads KV head ``h // (heads / kv_heads)``.

Kernels (docs/design/reference-engine.md has the measurements behind the choice):

- ``flash-varlen``: FlashAttention's variable-length kernel (PyTorch's
  ``_flash_attention_forward`` with cumulative lengths, causal aligned to each sequence's
  last key, GQA and sliding windows natively): CUDA, float16/bfloat16. Probed once per
  engine against ``per-request`` on a small ragged batch; if the kernel is missing, refuses
  the arguments or disagrees, ``per-request`` serves and ``reason`` says why.
- ``per-request``: a loop over the batch's requests, each with the shapes of its own span
  alone: in float32 on the CPU (explicit scores, softmax, the exact path of the tests),
  PyTorch's fused attention with an explicit mask on CUDA.
- ``cudnn-whole`` (beside ``flash-varlen``): a batch whose every request is a whole prompt
  from position 0 of at least ``WHOLE_MIN`` tokens, without a sliding window, runs each
  through cuDNN's fused attention (twice FlashAttention 2's speed on an H200). cuDNN plans
  on the host for every new shape (~40 ms), so each prompt is zero-padded at the end to a
  length bucket (``bucket``), which causal attention never lets a real query see. Probed
  like ``flash-varlen``; where cuDNN is absent or disagrees, ``flash-varlen`` serves.
"""

from __future__ import annotations

import math
from itertools import accumulate

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .batch import Batch, GroupRows

_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def _mask(start: int, lo: int, n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[n, start + n - lo]``: which keys from position ``lo`` each query of positions
    ``[start, start+n)`` attends to, built on the keys' device."""
    qpos = torch.arange(start, start + n, device=device)[:, None]
    kpos = torch.arange(lo, start + n, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def per_request(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    batch: Batch,
    group: GroupRows,
    window: int | None,
) -> torch.Tensor:
    """Each request's attention on its own (module docstring): ``[rows, heads, head_dim]``."""
    hd = q.shape[-1]
    rep = q.shape[1] // keys.shape[1]
    outs = []
    for i, (start, n) in enumerate(zip(batch.starts, batch.lens, strict=True)):
        lo = group.lo[i]
        qi = q[batch.q_starts[i] : batch.q_starts[i + 1]]
        ki = keys[group.k_starts[i] : group.k_starts[i + 1]]
        vi = vals[group.k_starts[i] : group.k_starts[i + 1]]
        if qi.is_cuda:
            kh = ki.repeat_interleave(rep, dim=1).transpose(0, 1)
            vh = vi.repeat_interleave(rep, dim=1).transpose(0, 1)
            # a whole prompt from position 0 is plain causal: the flash kernel, no mask
            whole = start == lo == 0 and ki.shape[0] == n and window is None
            mask = None if whole else _mask(start, lo, n, window, ki.device)[None, None]
            with sdpa_kernel(_SDPA_BACKENDS):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qi.transpose(0, 1)[None], kh[None], vh[None], attn_mask=mask, is_causal=whole
                )
            outs.append(out[0].transpose(0, 1))
        else:
            kf = ki.float().repeat_interleave(rep, dim=1)  # [m, H, hd]
            vf = vi.float().repeat_interleave(rep, dim=1)
            scores = torch.einsum("nhd,mhd->hnm", qi.float(), kf) / math.sqrt(hd)
            mask = _mask(start, lo, n, window, ki.device)
            scores = scores.masked_fill(~mask[None], float("-inf"))
            outs.append(torch.einsum("hnm,mhd->nhd", scores.softmax(-1), vf).to(q.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def flash_varlen(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    batch: Batch,
    group: GroupRows,
    window: int | None,
) -> torch.Tensor:
    """The whole batch in one FlashAttention call (module docstring)."""
    extra = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
    out = torch.ops.aten._flash_attention_forward(
        q,
        keys,
        vals,
        batch.cu_q,
        group.cu_k,
        batch.max_q,
        group.max_k,
        0.0,
        True,
        False,
        **extra,
    )
    return out[0]


WHOLE_MIN = 1024  # shorter prompts: FlashAttention's varlen call (launch-bound sizes)


def bucket(n: int) -> int:
    """The padded length cuDNN plans for an ``n``-token prompt: a multiple of 256 up to 2k
    tokens, of 1,024 up to 16k, of 4,096 beyond (at most 33 plans up to 32k tokens)."""
    step = 256 if n <= 2048 else 1024 if n <= 16384 else 4096
    return -(-n // step) * step


def cudnn_whole(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    batch: Batch,
    group: GroupRows,
    window: int | None,
) -> torch.Tensor:
    """Every request a whole prompt from position 0 (module docstring): one cuDNN call
    each, over its rows padded to ``bucket``; ``[rows, heads, head_dim]``."""
    heads, kvh, hd = q.shape[1], keys.shape[1], q.shape[2]
    out = q.new_empty(q.shape)
    for i, n in enumerate(batch.lens):
        r0 = batch.q_starts[i]
        padded = bucket(n)
        qp = q.new_zeros(1, heads, padded, hd)
        kp, vp = qp.new_zeros(qp.shape), qp.new_zeros(qp.shape)
        qp[0, :, :n] = q[r0 : r0 + n].transpose(0, 1)
        for src, dst in ((keys, kp), (vals, vp)):  # each KV head once per query head it serves
            part = src[group.k_starts[i] : group.k_starts[i] + n].transpose(0, 1)
            dst[0, :, :n].view(kvh, heads // kvh, n, hd).copy_(part[:, None])
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
        out[r0 : r0 + n] = o[0, :, :n].transpose(0, 1)
    return out


def _whole(batch: Batch, group: GroupRows, window: int | None) -> bool:
    """Whether every request of the batch is a whole prompt ``cudnn_whole`` serves."""
    return window is None and all(
        s == 0 and lo == 0 and n >= WHOLE_MIN
        for s, lo, n in zip(batch.starts, group.lo, batch.lens, strict=True)
    )


class Attention:
    """The kernel one engine uses (module docstring): ``name`` and, when the batched kernel
    was wanted and not taken, ``reason``. ``exact``: per request, always."""

    def __init__(self, device: str, dtype: torch.dtype, exact: bool, windows: bool) -> None:
        self.reason = ""
        self.whole_reason = "needs flash-varlen"  # why whole prompts do not take cuDNN
        self.fn = per_request
        self.name = "per-request"
        if exact:
            return
        if not device.startswith("cuda") or dtype not in (torch.float16, torch.bfloat16):
            self.reason = "flash-varlen needs CUDA and float16/bfloat16"
            return
        try:
            self.reason = _probe(torch.device(device), dtype, windows)
        except Exception as exc:  # a build without the kernel, or other arguments
            self.reason = f"flash-varlen failed its probe: {type(exc).__name__}: {exc}"
        if not self.reason:
            self.fn, self.name = flash_varlen, "flash-varlen"
            try:
                self.whole_reason = _probe_whole(torch.device(device), dtype)
            except Exception as exc:  # no cuDNN attention in this build, or other arguments
                self.whole_reason = f"cudnn-whole failed its probe: {type(exc).__name__}: {exc}"
            if not self.whole_reason:
                self.name = "flash-varlen + cudnn-whole"

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        vals: torch.Tensor,
        batch: Batch,
        group: GroupRows,
        window: int | None,
    ) -> torch.Tensor:
        if not self.whole_reason and _whole(batch, group, window):
            return cudnn_whole(q, keys, vals, batch, group, window)
        return self.fn(q, keys, vals, batch, group, window)

    @property
    def batched(self) -> bool:
        """Whether the batch's attention is one call (not the per-request loop)."""
        return self.fn is flash_varlen


def _ragged(
    device: torch.device,
    dtype: torch.dtype,
    spans: list[tuple[int, int]],
    window: int | None,
    g: torch.Generator,
) -> tuple[Batch, GroupRows, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A probe's batch of ``(start, n)`` spans (keys from 0, or the window) and random
    q (the query heads of a ``[rows, heads + kv_heads, hd]`` tensor, as the model hands
    it over), k and v: 8 query heads over 2 KV heads of 64."""
    heads, kv_heads, hd = 8, 2, 64
    starts, lens = [s for s, _ in spans], [n for _, n in spans]
    lo = [0 if window is None else max(0, s - window + 1) for s in starts]
    q_starts = [0, *accumulate(lens)]
    k_starts = [0, *accumulate(s + n - b for (s, n), b in zip(spans, lo, strict=True))]
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device=device) for x in (q_starts, k_starts))
    none = torch.empty(0)
    batch = Batch(starts, lens, [None] * len(spans), none, none, q_starts, cu_q, max(lens), [])
    group = GroupRows(
        none, none, lo, k_starts, cu_k, max(b - a for a, b in zip(k_starts, k_starts[1:]))
    )
    q = torch.randn(q_starts[-1], heads + kv_heads, hd, generator=g).to(device, dtype)[:, :heads]
    k = torch.randn(k_starts[-1], kv_heads, hd, generator=g).to(device, dtype)
    v = torch.randn(k_starts[-1], kv_heads, hd, generator=g).to(device, dtype)
    return batch, group, q, k, v


def _probe(device: torch.device, dtype: torch.dtype, windows: bool) -> str:
    """Run ``flash_varlen`` on a small ragged batch (a prompt, a chunk over cached keys, a
    decode step; GQA; a sliding window if the model has one) against ``per_request``:
    ``""`` if they agree, else why not."""
    g = torch.Generator(device="cpu").manual_seed(0)
    for window in [None, 48] if windows else [None]:
        batch, group, q, k, v = _ragged(device, dtype, [(0, 37), (64, 19), (150, 1)], window, g)
        got = flash_varlen(q, k, v, batch, group, window).float()
        want = per_request(q, k, v, batch, group, window).float()
        err = (got - want).abs().max().item()
        if not err < 2e-2:
            return f"flash-varlen differs from per-request attention by {err:.3g} (window {window})"
    return ""


def _probe_whole(device: torch.device, dtype: torch.dtype) -> str:
    """``cudnn_whole`` on two whole prompts (one a bucket's exact length, one padded)
    against ``flash_varlen``: ``""`` if they agree, else why not."""
    g = torch.Generator(device="cpu").manual_seed(1)
    spans = [(0, WHOLE_MIN), (0, WHOLE_MIN + 37)]
    batch, group, q, k, v = _ragged(device, dtype, spans, None, g)
    got = cudnn_whole(q, k, v, batch, group, None).float()
    want = flash_varlen(q, k, v, batch, group, None).float()
    err = (got - want).abs().max().item()
    if not err < 2e-2:
        return f"cudnn-whole differs from flash-varlen by {err:.3g}"
    return ""
