"""Decode steps replayed as CUDA graphs, one graph per layer.

A decode step of a small batch is launch-bound: ~20 kernels a layer, each costing more time
to launch from Python than to run (docs/design/reference-engine.md). For a forward whose
every request decodes one token over the pages (``batch.Batch.short`` covers the batch),
each layer's kernels are captured once per batch size into a graph and replayed: one
launch a layer. The connector's hooks stay between the layers, outside the graphs, as the
executor calls them (``wait_for_layer_load`` before layer i's replay, ``save_kv_layer``
after it).

Capture: the first forward of a batch size copies its batch into static tensors (a page
table with room for ``max_seq_len`` tokens a request) and captures the layers in order on a
stream of the engine's, layer i's output the input of layer i+1 (each size its own memory
pool; no ``gc.collect`` or cache flush per capture, unlike ``torch.cuda.graph``); nothing
runs while capturing, the replays then run that forward. Every later forward of that size copies its
tensors into the static ones (a handful of device copies) and replays. Capture runs with
``capture_error_mode="thread_local"`` so the data planes' threads keep their CUDA calls.

Numerics: a replay launches the same kernels with the same shapes as the eager forward,
so its tokens are the eager path's. A capture that fails (an op that synchronises, a
library that refuses) turns the graphs off for the engine (``reason``), never the forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .batch import Batch
from .kv_cache import KvCacheManager

log = logging.getLogger("disagg.engine")

MAX_BATCH = 128  # decode batches up to this many requests are captured


class _Captured:
    """One batch size's static tensors and its layers' graphs."""

    def __init__(
        self, layer: Callable[..., torch.Tensor], layers: int, plan: Batch, x: torch.Tensor,
        rope: torch.Tensor, kv: KvCacheManager, table_rows: int, stream: torch.cuda.Stream,
    ) -> None:  # fmt: skip
        groups = []
        for rows in plan.groups:
            assert rows.table is not None
            table = torch.zeros(table_rows, dtype=rows.table.dtype, device=rows.table.device)
            table[: rows.table.numel()] = rows.table
            groups.append(replace(rows, write=rows.write.clone(), table=table, **_clones(rows)))
        self.batch = replace(plan, groups=groups, **_clones(plan))
        self.x, self.rope = x.clone(), rope.clone()
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outs: list[torch.Tensor] = []
        inp = self.x
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(layers):
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    out = layer(i, inp, self.batch, self.rope, kv)
                finally:
                    g.capture_end()
                self.graphs.append(g)
                self.outs.append(out)
                inp = out
        torch.cuda.current_stream().wait_stream(stream)

    def load(self, plan: Batch, x: torch.Tensor, rope: torch.Tensor) -> bool:
        """Copy this forward's tensors into the static ones (False: its page table does
        not fit)."""
        b = self.batch
        for mine, theirs in zip(b.groups, plan.groups, strict=True):
            assert mine.table is not None and theirs.table is not None
            if theirs.table.numel() > mine.table.numel():
                return False
        for mine, theirs in zip(b.groups, plan.groups, strict=True):
            assert mine.table is not None and theirs.table is not None
            mine.write.copy_(theirs.write)
            mine.table[: theirs.table.numel()].copy_(theirs.table)
            for name in _GROUP_TENSORS:
                getattr(mine, name).copy_(getattr(theirs, name))
        for name in _BATCH_TENSORS:
            getattr(b, name).copy_(getattr(plan, name))
        self.x.copy_(x)
        self.rope.copy_(rope)
        return True

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self.graphs[i].replay()
        return self.outs[i]


_GROUP_TENSORS = ("offsets", "lo_t")
_BATCH_TENSORS = ("positions", "cu_q", "start_t", "len_t", "short")


def _clones(obj: Any) -> dict[str, Any]:
    names = _GROUP_TENSORS if hasattr(obj, "table") else _BATCH_TENSORS
    return {n: getattr(obj, n).clone() for n in names}


class DecodeGraphs:
    """The captured decode steps of one engine (module docstring). ``layer`` is the
    model's ``layer(i, x, batch, rope, kv)``."""

    def __init__(
        self,
        layer: Callable[..., torch.Tensor],
        layers: int,
        max_seq_len: int,
        tpb: int,
        dtype: torch.dtype,
    ) -> None:
        self._layer, self._layers = layer, layers
        self._pages = -(-max_seq_len // tpb)  # page-table rows a request may need
        self._sizes: dict[int, _Captured] = {}
        self.reason = ""
        # captures run on a stream of their own (not the legacy default stream); a matrix
        # product there first creates its cuBLAS handle and workspace outside any capture
        self._stream = torch.cuda.Stream()
        with torch.cuda.stream(self._stream):
            a = torch.ones(16, 16, device="cuda", dtype=dtype)
            torch.mm(a, a)
        self._stream.synchronize()

    def bind(
        self, plan: Batch, x: torch.Tensor, rope: torch.Tensor, kv: KvCacheManager
    ) -> Callable[[int, torch.Tensor], torch.Tensor] | None:
        """The replaying ``fn(i, x)`` for this forward, or None where it runs eagerly (not
        every request decoding one token over the pages, too large a batch, graphs off)."""
        n = len(plan.lens)
        if self.reason or plan.short is None or plan.long is not None or plan.rows != n:
            return None
        if n > MAX_BATCH:
            return None
        got = self._sizes.get(n)
        if got is None:
            try:
                got = _Captured(
                    self._layer, self._layers, plan, x, rope, kv, n * self._pages, self._stream
                )
            except Exception as exc:  # a capture this build refuses: eager from now on
                self.reason = f"capture failed: {type(exc).__name__}: {exc}"
                log.warning("CUDA graphs of decode steps are off: %s", self.reason)
                return None
            self._sizes[n] = got
            return got
        return got if got.load(plan, x, rope) else None
