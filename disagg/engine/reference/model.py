"""A seeded tiny llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP).

The model owns no KV: each layer writes its new keys/values through a ``KvIO`` and reads
the keys/values it attends to back through it, so whatever a connector writes into the
pages is exactly what the model sees. Attention is computed per request in float32 over
the gathered KV (in float32 on the CPU; on CUDA with PyTorch's fused attention in the
model's dtype, with the same explicit mask for every chunk, so one kernel serves them all),
so a token's output does not depend on how its prompt was chunked or whether its prefix
was computed here or loaded (up to float rounding).

Tensor parallelism across processes (``tp``: a ``TpGroup``, the MPI mode): this process is
one rank; its pools hold only its KV-head shard, so it attends with its own query heads
(those of its KV heads) and the ranks' head outputs are all-gathered (in rank order, along
the heads) before the output projection, a real collective in every layer: a rank that
leaves a forward while the others go on leaves them waiting there. Everything else (the
projections, the MLP, sampling) is computed whole on every rank from the same inputs, so
the gathered heads are the same numbers as one process's and the tokens are identical.
"""

from __future__ import annotations

import hashlib
import math
from typing import Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import EngineConfig

_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


class TpGroup(Protocol):
    """This process's rank of a TP group, and the layers' collective."""

    rank: int
    size: int

    def allgather_heads(self, t: torch.Tensor, where: str) -> torch.Tensor:
        """Every rank's ``t`` ``[n, w]`` (same shape on every rank) concatenated in rank
        order along dim 1: ``[n, size * w]``. Blocks until every rank has called it."""


class KvIO(Protocol):
    """Per-request page access for one layer (implemented by ``kv_cache.RequestKv``)."""

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` for positions ``[start, start+n)``."""

    def read(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values ``[hi-lo, kv_heads, head_dim]`` for positions ``[lo, hi)``."""


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _mask(start: int, lo: int, n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[n, start + n - lo]``: which keys from position ``lo`` each query of positions
    ``[start, start+n)`` attends to. Built on the KV's device: built on the CPU, a
    12k-token prompt's mask took longer than the layer's matrix products on a GPU."""
    qpos = torch.arange(start, start + n, device=device)[:, None]
    kpos = torch.arange(lo, start + n, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


class TinyLlama:
    """Weights drawn from ``torch.Generator().manual_seed(seed)`` on CPU, then moved."""

    def __init__(self, cfg: EngineConfig, tp: TpGroup | None = None):
        self.cfg, self.tp = cfg, tp
        if tp is not None and tp.size != cfg.tp:
            raise ValueError(f"TinyLlama: TP group of {tp.size} ranks, config says tp={cfg.tp}")
        g = torch.Generator().manual_seed(cfg.seed)
        dt, dev = cfg.torch_dtype, torch.device(cfg.device)

        def w(*shape: int, scale: float | None = None) -> torch.Tensor:
            s = scale if scale is not None else 1.0 / math.sqrt(shape[0])
            return (torch.randn(*shape, generator=g) * s).to(device=dev, dtype=dt)

        h, hd = cfg.hidden_size, cfg.head_dim
        self.embed = w(cfg.vocab_size, h, scale=1.0)
        self.layers = []
        for _ in range(cfg.num_layers):
            self.layers.append(
                {
                    "attn_norm": torch.ones(h, device=dev, dtype=dt),
                    "wq": w(h, cfg.num_heads * hd),
                    "wk": w(h, cfg.num_kv_heads * hd),
                    "wv": w(h, cfg.num_kv_heads * hd),
                    "wo": w(cfg.num_heads * hd, h),
                    "mlp_norm": torch.ones(h, device=dev, dtype=dt),
                    "w_gate": w(h, cfg.intermediate_size),
                    "w_up": w(h, cfg.intermediate_size),
                    "w_down": w(cfg.intermediate_size, h),
                }
            )
        self.final_norm = torch.ones(h, device=dev, dtype=dt)
        self.lm_head = w(h, cfg.vocab_size)
        self._offsets: dict[str, torch.Tensor] = {}
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        self._rope_cache: tuple[tuple[int, int, torch.device], torch.Tensor, torch.Tensor] | None
        self._rope_cache = None

    def _rope_tables(
        self, start: int, n: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[n, 1, head_dim/2]`` of positions ``[start, start+n)`` on ``device``,
        built once per forward chunk (every layer's q and k use them): each build is a
        host computation and a copy that waits for the device."""
        cached = self._rope_cache
        if cached is not None and cached[0] == (start, n, device):
            return cached[1], cached[2]
        # from float64 positions: identical per position however the prompt is split
        pos = torch.arange(start, start + n, dtype=torch.float64)
        ang = pos[:, None] * self.inv_freq[None, :]
        cos = ang.cos().to(torch.float32).to(device)[:, None, :]
        sin = ang.sin().to(torch.float32).to(device)[:, None, :]
        self._rope_cache = ((start, n, device), cos, sin)
        return cos, sin

    def _rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        cos, sin = self._rope_tables(start, x.shape[0], x.device)
        xf = x.float()
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return out.to(x.dtype)

    def embed_tokens(self, tokens: list[int], adapter: str | None = None) -> torch.Tensor:
        """Embeddings of ``tokens``; ``adapter`` (a request's LoRA task and multimodal
        inputs) adds a fixed offset of its own, so its KV differs from the plain model's."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.embed.device)
        x = self.embed[ids]
        return x if adapter is None else x + self._offset(adapter)

    def _offset(self, adapter: str) -> torch.Tensor:
        off = self._offsets.get(adapter)
        if off is None:
            seed = int.from_bytes(hashlib.sha256(adapter.encode()).digest()[:8], "little")
            g = torch.Generator().manual_seed(seed)
            off = torch.randn(self.embed.shape[1], generator=g) * 0.5
            off = self._offsets[adapter] = off.to(device=self.embed.device, dtype=self.embed.dtype)
        return off

    def layer(self, i: int, x: torch.Tensor, start: int, kv: KvIO) -> torch.Tensor:
        """Run decoder layer ``i`` on hidden states ``x`` ``[n, hidden]`` at positions
        ``[start, start+n)``: write this chunk's KV, attend over the window, return ``x``.
        With a ``tp`` group: attend with this rank's query heads over the KV ``kv`` reads
        back (this rank's shard), then all-gather the heads (see the module docstring)."""
        cfg, p = self.cfg, self.layers[i]
        n, hd = x.shape[0], cfg.head_dim
        hn = _rms_norm(x, p["attn_norm"])
        q = self._rope((hn @ p["wq"]).view(n, cfg.num_heads, hd), start)
        k = self._rope((hn @ p["wk"]).view(n, cfg.num_kv_heads, hd), start)
        v = (hn @ p["wv"]).view(n, cfg.num_kv_heads, hd)
        kv.write(i, start, k, v)
        window = cfg.layer_windows[i]
        lo = 0 if window is None else max(0, start - window + 1)
        keys, vals = kv.read(i, lo, start + n)
        rep = cfg.num_heads // cfg.num_kv_heads
        if self.tp is not None:  # this rank's query heads: those of its KV heads
            per = cfg.num_heads // self.tp.size
            q = q[:, self.tp.rank * per : (self.tp.rank + 1) * per]
        if keys.is_cuda:
            # fused attention: a 12k-token prompt's 16 x 12k x 12k float32 score matrices
            # took most of a 1B model's prefill (973 ms against ~31 ms of matrix products)
            kh = keys.to(q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
            vh = vals.to(q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
            # not cuDNN's kernel: it builds a plan per new shape on the host, and every
            # decode step has a new key length (a consumer's steps took 0.9 s). A whole
            # prompt from position 0 is plain causal: the flash kernel, no mask.
            whole = start == lo == 0 and keys.shape[0] == n and window is None
            mask = None if whole else _mask(start, lo, n, window, keys.device)[None, None]
            with sdpa_kernel(_SDPA_BACKENDS):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], kh[None], vh[None], attn_mask=mask, is_causal=whole
                )
            attn = out[0].transpose(0, 1).reshape(n, -1)
        else:
            kf = keys.float().repeat_interleave(rep, dim=1)  # [m, H, hd]
            vf = vals.float().repeat_interleave(rep, dim=1)
            scores = torch.einsum("nhd,mhd->hnm", q.float(), kf) / math.sqrt(hd)
            mask = _mask(start, lo, n, window, keys.device)
            scores = scores.masked_fill(~mask[None], float("-inf"))
            attn = torch.einsum("hnm,mhd->nhd", scores.softmax(-1), vf).reshape(n, -1)
        if self.tp is not None:
            attn = self.tp.allgather_heads(attn, f"layer {i} attention heads")
        x = x + attn.to(x.dtype) @ p["wo"]
        hn = _rms_norm(x, p["mlp_norm"])
        mlp = torch.nn.functional.silu(hn @ p["w_gate"]) * (hn @ p["w_up"])
        return x + mlp @ p["w_down"]

    def sample(self, last_hidden: torch.Tensor) -> int:
        """Greedy: argmax of the logits of one position."""
        logits = _rms_norm(last_hidden[None], self.final_norm).float() @ self.lm_head.float()
        return int(logits[0].argmax().item())
