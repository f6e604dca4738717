"""A seeded tiny llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP)
that runs one forward over a whole batch (``batch.Batch``: every request's new positions
as rows of one tensor).

The model owns no KV: each layer stores its new keys/values into the pages
(``KvCacheManager.write_layer``, one copy for the batch) and reads back every key it
attends to (``read_layer``, one gather), so whatever a connector writes into the pages is
exactly what the model sees. The projections, norms, RoPE, MLP and sampling run over the
batch's rows; attention is ``attention.Attention``.

Batch-invariant numerics (``EngineConfig.exact_batching``, the CPU's default): every
row-wise step runs on tiles of ``ROW_TILE`` rows (the last one zero-padded), each a call of
the same shapes whatever the batch, and attention runs per request, so a request's KV
bytes and tokens are the same bits whatever else is batched with it and wherever its rows
fall (``tests/engine/test_batching.py``). Without it (CUDA's default) each step is one call
over all rows, whose rounding may depend on the batch, as a production engine's does.
Either way a token's output does not depend on how its prompt was chunked or whether its
prefix was computed here or loaded, up to float rounding.

Tensor parallelism across processes (``tp``: a ``TpGroup``, the MPI mode): this process is
one rank; its pools hold only its KV-head shard, so it attends with its own query heads
(those of its KV heads) and the ranks' head outputs are all-gathered (in rank order, along
the heads) before the output projection, one collective per layer for the whole batch: a
rank that leaves a forward while the others go on leaves them waiting there. Everything
else is computed whole on every rank from the same inputs, so the gathered heads are the
same numbers as one process's and the tokens are identical.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from . import fused, graphs, paged
from .attention import Attention
from .batch import Batch, build
from .config import EngineConfig
from .kv_cache import KvCacheManager

ROW_TILE = 32  # rows per tile on the batch-invariant path
# Below this many rows a forward is launch-bound and Triton's launcher (tens of us a call)
# costs more than the passes it saves: decode steps keep PyTorch's ops.
FUSED_MIN_ROWS = 1024


class TpGroup(Protocol):
    """This process's rank of a TP group, and the layers' collective."""

    rank: int
    size: int

    def allgather_heads(self, t: torch.Tensor, where: str) -> torch.Tensor:
        """Every rank's ``t`` ``[n, w]`` (same shape on every rank) concatenated in rank
        order along dim 1: ``[n, size * w]``. Blocks until every rank has called it."""


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


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
            # drawn in this order (the weights a model name stands for), stored fused: the
            # q/k/v and gate/up projections are one matrix product each
            wq, wk, wv = (w(h, n * hd) for n in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads))
            wo = w(cfg.num_heads * hd, h)
            w_gate, w_up = w(h, cfg.intermediate_size), w(h, cfg.intermediate_size)
            self.layers.append(
                {
                    "attn_norm": torch.ones(h, device=dev, dtype=dt),
                    "wqkv": torch.cat([wq, wk, wv], dim=1),
                    "wo": wo,
                    "mlp_norm": torch.ones(h, device=dev, dtype=dt),
                    "w_gate_up": torch.cat([w_gate, w_up], dim=1),
                    "w_down": w(cfg.intermediate_size, h),
                }
            )
            del wq, wk, wv, w_gate, w_up
        self.final_norm = torch.ones(h, device=dev, dtype=dt)
        self.lm_head = w(h, cfg.vocab_size).float()
        self._offsets: dict[str, torch.Tensor] = {}
        # RoPE of every position as unit complex numbers, from float64 angles: identical per
        # position however the prompt is split
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.rope = torch.polar(torch.ones_like(ang), ang).to(torch.complex64).to(dev)
        self.exact = cfg.exact_batching
        # one pass each for RoPE and SwiGLU on CUDA (fused.py); the batch-invariant path
        # keeps PyTorch's ops, whose tiles are the same calls whatever the batch
        self.fused = not self.exact and fused.available(dev, hd)
        if self.fused:
            self.rope_cos = self.rope.real.float().contiguous()
            self.rope_sin = self.rope.imag.float().contiguous()
        self.attention = Attention(
            cfg.device, dt, self.exact, any(w is not None for w in cfg.layer_windows)
        )
        # decode spans attend over the pages (paged.py) where the batched kernel runs
        self._paged_n, self.paged_reason = 0, ""
        local_heads = cfg.num_heads // (tp.size if tp is not None else 1)
        if os.environ.get("DISAGG_PAGED_ATTENTION", "1") == "0":
            self.paged_reason = "DISAGG_PAGED_ATTENTION=0"
        elif not self.attention.batched:
            self.paged_reason = "needs the batched attention (flash-varlen)"
        elif not paged.available(dev, hd, cfg.tokens_per_block):
            self.paged_reason = "needs Triton on CUDA, head_dim and tokens_per_block powers of 2"
        elif not paged.max_rows(local_heads, cfg.kv_heads_per_rank):
            self.paged_reason = "more than 16 query heads per KV head"
        else:
            try:
                self.paged_reason = paged.probe(cfg, local_heads)
            except Exception as exc:  # a Triton that cannot build the kernel here
                self.paged_reason = f"failed its probe: {type(exc).__name__}: {exc}"
            if not self.paged_reason:
                self._paged_n = paged.max_rows(local_heads, cfg.kv_heads_per_rank)
        # decode steps over the pages replay CUDA graphs (graphs.py); not across processes
        self.graphs: graphs.DecodeGraphs | None = None
        if self._paged_n and tp is None and os.environ.get("DISAGG_CUDA_GRAPHS", "1") != "0":
            self.graphs = graphs.DecodeGraphs(
                self.layer, cfg.num_layers, cfg.max_seq_len, cfg.tokens_per_block, dt
            )

    def _rows(self, fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
        """``fn`` over the rows of ``xs`` (same row count), returning a tensor or a tuple of
        them: one call, or on the batch-invariant path one call per tile of ``ROW_TILE``
        rows (module docstring)."""
        n = xs[0].shape[0]
        if not self.exact:
            return fn(*xs)
        pad = -n % ROW_TILE
        if pad:
            xs = tuple(torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in xs)
        outs = [fn(*(x[i : i + ROW_TILE] for x in xs)) for i in range(0, n + pad, ROW_TILE)]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts)[:n] for parts in zip(*outs, strict=True))
        return torch.cat(outs)[:n]

    def embed_batch(self, batch: Batch) -> torch.Tensor:
        """Embeddings of the batch's rows; a request's adapter (its LoRA task and multimodal
        inputs) adds a fixed offset of its own, so its KV differs from the plain model's."""
        x = self.embed[batch.ids]
        for i, adapter in enumerate(batch.adapters):
            if adapter is not None:
                x[batch.q_starts[i] : batch.q_starts[i + 1]] += self._offset(adapter)
        return x

    def _offset(self, adapter: str) -> torch.Tensor:
        off = self._offsets.get(adapter)
        if off is None:
            seed = int.from_bytes(hashlib.sha256(adapter.encode()).digest()[:8], "little")
            g = torch.Generator().manual_seed(seed)
            off = torch.randn(self.embed.shape[1], generator=g) * 0.5
            off = self._offsets[adapter] = off.to(device=self.embed.device, dtype=self.embed.dtype)
        return off

    def rope_tables(self, batch: Batch) -> torch.Tensor:
        """RoPE rotations ``[rows, 1, head_dim/2]`` of the batch's positions (once per
        forward); for a forward large enough for the fused kernels, the positions
        themselves (the kernel looks the angles up)."""
        if self.fused and batch.positions.shape[0] >= FUSED_MIN_ROWS:
            return batch.positions
        return self.rope[batch.positions][:, None]

    def layer_runner(
        self, batch: Batch, x: torch.Tensor, rope: torch.Tensor, kv: KvCacheManager
    ) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """How this forward runs its layers: ``fn(i, x)`` is layer ``i``'s output, called
        for i = 0, 1, ... in order (a decode step's replayed graphs, or ``layer``)."""
        bound = self.graphs.bind(batch, x, rope, kv) if self.graphs is not None else None
        if bound is not None:
            return bound
        return lambda i, xi: self.layer(i, xi, batch, rope, kv)

    def layer(
        self, i: int, x: torch.Tensor, batch: Batch, rope: torch.Tensor, kv: KvCacheManager
    ) -> torch.Tensor:
        """Decoder layer ``i`` over the batch's rows ``x`` ``[rows, hidden]``: store the new
        keys/values, attend, return the new ``x``. With a ``tp`` group: attend with this
        rank's query heads over this rank's shard, then all-gather the heads."""
        cfg, p = self.cfg, self.layers[i]
        n, hd, heads, kvh = x.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        qk = (heads + kvh) * hd

        fuse = self.fused and n >= FUSED_MIN_ROWS

        def qkv(xt: torch.Tensor, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = _rms_norm(xt, p["attn_norm"]) @ p["wqkv"]
            if fuse:
                fused.rope_(out, heads + kvh, hd, self.rope_cos, self.rope_sin, rot)
                return out[:, :qk].view(xt.shape[0], heads + kvh, hd), out[:, qk:]
            pairs = out[:, :qk].float().view(xt.shape[0], heads + kvh, hd // 2, 2)
            roped = torch.view_as_real(torch.view_as_complex(pairs) * rot).to(out.dtype)
            return roped.view(xt.shape[0], heads + kvh, hd), out[:, qk:]

        roped, v = self._rows(qkv, x, rope)
        group = batch.groups[kv.layer_group[i]]
        li = kv.layer_index[i]
        kv.write_layer(i, group.write[li], roped[:, heads:].reshape(n, kvh * hd), v)
        q = roped[:, :heads]
        if self.tp is not None:  # this rank's query heads: those of its KV heads
            per = heads // self.tp.size
            q = q[:, self.tp.rank * per : (self.tp.rank + 1) * per]
        attn = self.attend(i, q, batch, kv).reshape(n, -1)
        if self.tp is not None:
            attn = self.tp.allgather_heads(attn, f"layer {i} attention heads")

        def rest(xt: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
            xt = torch.addmm(xt, at, p["wo"])
            gate_up = _rms_norm(xt, p["mlp_norm"]) @ p["w_gate_up"]
            if fuse:
                return torch.addmm(xt, fused.silu_mul(gate_up), p["w_down"])
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.addmm(xt, F.silu(gate) * up, p["w_down"])

        return self._rows(rest, x, attn)

    def attend(self, i: int, q: torch.Tensor, batch: Batch, kv: KvCacheManager) -> torch.Tensor:
        """Layer ``i``'s attention ``[rows, q heads, head_dim]``: the gathered keys through
        ``self.attention``; with short spans (``batch.short``) those over the pages
        (``paged``) and the rest gathered."""
        gid, window = kv.layer_group[i], self.cfg.layer_windows[i]
        group, li = batch.groups[gid], kv.layer_index[i]
        if batch.short is None:
            keys, vals = kv.read_layer(group.read[li], i)
            return self.attention(q, keys, vals, batch, group, window)
        out = q.new_empty(q.shape)
        if batch.long is not None:
            keys, vals = kv.read_layer(group.read[li], i)
            rows = batch.long_rows
            out[rows] = self.attention(q[rows], keys, vals, batch.long, group, window)
        base, stride = kv.layer_rows(i)
        assert group.table is not None and group.offsets is not None and group.lo_t is not None
        assert batch.start_t is not None and batch.len_t is not None
        paged.attend(
            q,
            out,
            kv.head_rows(gid)[0],
            base,
            stride,
            kv.heads_per_pool,
            kv.tpb,
            group.table,
            group.offsets,
            group.lo_t,
            batch.start_t,
            batch.len_t,
            batch.cu_q,
            batch.short,
            window,
        )
        return out

    def plan(self, spans: list[tuple[Any, int, int]], kv: KvCacheManager) -> Batch:
        """One forward's batch of ``spans`` (``batch.build``), its short spans marked for
        attention over the pages where this model runs it."""
        return build(spans, kv, self.paged_max_n(kv))

    def paged_max_n(self, kv: KvCacheManager) -> int:
        """Spans of at most this many tokens attend over the pages (``paged``; 0: none):
        CUDA with Triton, the batched attention, one pool (not the one-process TP
        simulation)."""
        return self._paged_n if len(kv.ranks) == 1 else 0

    def sample(self, x: torch.Tensor, rows: list[int]) -> list[int]:
        """Greedy: the argmax of the logits of each of ``rows`` (one host sync)."""
        if not rows:
            return []
        last = x[torch.tensor(rows, device=x.device)]

        def logits(h: torch.Tensor) -> torch.Tensor:
            return _rms_norm(h, self.final_norm).float() @ self.lm_head

        return self._rows(logits, last).argmax(-1).tolist()
