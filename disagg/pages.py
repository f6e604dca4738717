"""Page geometry over an engine's KV pools, engine-neutral.

An engine hands its cache over either as the V1 single-pool tensor
``[num_blocks, num_layers, kv_factor, block_size]`` or as a ``KvCacheLayout``. ``PagePool``
turns both into the same picture, which producer, consumer and data planes share:

- a *group page* is the concatenation of a layer group's region slot bytes, region order;
- a *store block* is the concatenation of every group's page, group order;
- a layer's bytes inside a group page are the spans of its buffers (equal-sized buffers
  per region, in memory order), so a layer can be copied on its own (layer-wise saves).

All moves are batched tensor ops over slot index vectors: no per-page Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine.layout import KvCacheBufferRef, KvCacheLayout, KvCacheRegion


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``src_off`` inside one region's slot, landing at ``page_off``
    inside the group page."""

    region: int
    src_off: int
    page_off: int
    length: int


@dataclass(frozen=True)
class GroupGeometry:
    group_id: int
    layer_ids: tuple[int, ...]
    window: int | None
    region_sizes: tuple[int, ...]
    num_slots: int

    @property
    def page_bytes(self) -> int:
        return sum(self.region_sizes)


class PagePool:
    """Byte views of an engine's page pools, one list of region tensors per layer group."""

    def __init__(self, layout: KvCacheLayout):
        self.keepalive: object = None
        self.layout = layout
        self.tokens_per_block = layout.tokens_per_block
        # one TensorRT-LLM line's layout has no dtype: pages are bytes either way
        self.dtype = getattr(layout, "dtype", None) or torch.uint8
        # a group page covers every region of the group, replicated ones too (roles equal
        # on every TP rank, described apart where the layout has them: each rank moves
        # its own copy, or the model runs on missing KV)
        self._group_regions = [_regions_of(g) for g in layout.groups]
        # [num_slots, size] uint8 views, one per region, per group.
        self.regions: list[list[torch.Tensor]] = [
            [r.as_tensor(torch.uint8) for r in regions] for regions in self._group_regions
        ]
        self.groups: list[GroupGeometry] = [
            GroupGeometry(
                group_id=g.layer_group_id,
                layer_ids=tuple(g.layer_ids),
                window=g.window_size,
                region_sizes=tuple(r.size for r in regions),
                # the layout states slots per region only (its group has no count)
                num_slots=min((int(r.num_slots) for r in regions), default=0),
            )
            for g, regions in zip(layout.groups, self._group_regions, strict=True)
        ]
        self.page_offsets = _offsets([g.page_bytes for g in self.groups])
        self.block_bytes = sum(g.page_bytes for g in self.groups)
        self._layer_spans = {
            layer: self._spans_of(layer) for g in self.groups for layer in g.layer_ids
        }

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_v1_tensor(cls, kv: torch.Tensor, tokens_per_block: int) -> PagePool:
        """Describe the V1 ``[num_blocks, num_layers, kv_factor, block_size]`` pool."""
        if kv.dim() != 4:
            raise ValueError(
                f"register_kv_caches expects [num_blocks, num_layers, kv_factor, block_size], "
                f"got shape {tuple(kv.shape)}"
            )
        if not kv.is_contiguous():
            raise ValueError("the V1 KV pool tensor must be contiguous")
        num_blocks, num_layers, kv_factor, _ = kv.shape
        slot_bytes = kv[0].numel() * kv.element_size() if num_blocks else 0
        roles = ("key", "value") if kv_factor == 2 else tuple(f"kv{i}" for i in range(kv_factor))
        region = KvCacheRegion(
            base=kv.data_ptr(),
            size=slot_bytes,
            stride=slot_bytes,
            num_slots=num_blocks,
            buffers=tuple(
                KvCacheBufferRef(layer, role) for layer in range(num_layers) for role in roles
            ),
            device=str(kv.device),
        )
        from .engine.layout import KvCacheLayerGroupLayout

        group = KvCacheLayerGroupLayout(0, tuple(range(num_layers)), None, (region,))
        pool = cls(KvCacheLayout(tokens_per_block, (group,), dtype=kv.dtype))
        pool.keepalive = kv  # the region aliases kv's memory
        return pool

    def _spans_of(self, layer: int) -> list[tuple[int, list[Span]]]:
        """[(group index, spans)] of one layer's buffers."""
        out = []
        for gi, g in enumerate(self.layout.groups):
            if layer not in g.layer_ids:
                continue
            spans, region_off = [], 0
            for ri, r in enumerate(self._group_regions[gi]):
                if r.buffers:
                    each = r.size // len(r.buffers)
                    for bi, b in enumerate(r.buffers):
                        if b.layer_id == layer:
                            spans.append(Span(ri, bi * each, region_off + bi * each, each))
                region_off += r.size
            out.append((gi, _merge(spans)))
        return out

    # -- layer-wise views (synchronous, layer-by-layer loads) --------------------------
    @property
    def layers(self) -> list[int]:
        """Every layer id the pools cover, ascending (the order the engine runs them)."""
        return sorted(self._layer_spans)

    def group_of_layer(self, layer: int) -> int:
        return self._layer_spans[layer][0][0]

    def layer_regions(self, layer: int) -> list[torch.Tensor]:
        """Destination views of one layer: ``[num_slots, span]`` column slices of its
        group's regions (a *layer page* is their concatenation, span order)."""
        gi, spans = self._layer_spans[layer][0]
        return [self.regions[gi][s.region][:, s.src_off : s.src_off + s.length] for s in spans]

    def layer_store_columns(self, layer: int) -> list[tuple[int, int]]:
        """Where one layer's bytes sit inside a store block: ``[(column, length)]``."""
        gi, spans = self._layer_spans[layer][0]
        base = self.page_offsets[gi]
        return [(base + s.page_off, s.length) for s in spans]

    def data_plane_groups(self) -> list[list[torch.Tensor]]:
        """What a receiver registers: the layer groups' whole pages (groups ``0..G-1``),
        then one group per layer (``G + i`` for the i-th layer of ``layers``)."""
        return [*self.regions, *(self.layer_regions(layer) for layer in self.layers)]

    # -- description ------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def device(self) -> torch.device:
        return self.regions[0][0].device

    def check_slots(self, group: int, slots: torch.Tensor) -> None:
        """Refuse any slot outside ``[0, num_slots)`` (``-1`` included) before a byte moves."""
        if slots.numel() == 0:
            return
        n = self.groups[group].num_slots
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise IndexError(
                f"page slot {bad} of layer group {group} is outside [0, {n})"
                + (" (-1 is BAD_PAGE_INDEX: filter with valid_page_slots)" if bad == -1 else "")
            )

    # -- batched moves ----------------------------------------------------------------
    def read_pages(self, group: int, slots: torch.Tensor) -> torch.Tensor:
        """Gather whole group pages: ``[len(slots), page_bytes]`` uint8 (one copy)."""
        self.check_slots(group, slots)
        idx = slots.to(self.device)
        parts = [gather_rows(r, idx) for r in self.regions[group]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def write_pages(self, group: int, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Scatter whole group pages ``[len(slots), page_bytes]`` into ``slots``."""
        self.check_slots(group, slots)
        off = 0
        for r in self.regions[group]:
            size = r.shape[1]
            scatter_rows(r, slots, pages[:, off : off + size].to(r.device, non_blocking=True))
            off += size

    def gather_layer(
        self, layer: int, slots_by_group: list[torch.Tensor]
    ) -> list[tuple[int, torch.Tensor]]:
        """One layer's bytes of ``slots_by_group[g]``: ``[(store column, [n, length])]``,
        gathered on the pool's device (a batched index_select per buffer span, enqueued on
        the current stream: ordered after the layer that wrote them)."""
        out = []
        for gi, spans in self._layer_spans.get(layer, ()):
            slots = slots_by_group[gi]
            if slots.numel() == 0:
                continue
            idx = slots.to(self.device)
            base = self.page_offsets[gi]
            for s in spans:
                src = self.regions[gi][s.region][:, s.src_off : s.src_off + s.length]
                out.append((base + s.page_off, gather_rows(src, idx)))
        return out


def wide(t: torch.Tensor) -> torch.Tensor:
    """A uint8 ``[n, len]`` view as 8-byte elements when alignment allows: gather/scatter
    kernels work per element, so byte elements make them several times slower."""
    if (
        t.dim() == 2
        and t.shape[1] % 8 == 0
        and (t.shape[0] <= 1 or t.stride(0) % 8 == 0)
        and (t.shape[1] <= 1 or t.stride(1) == 1)
        and t.data_ptr() % 8 == 0
    ):
        try:
            return t.view(torch.int64)
        except RuntimeError:  # a layout view() cannot reinterpret
            pass
    return t


def gather_rows(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]`` for a uint8 ``[n, len]`` view, as uint8, through 8-byte elements."""
    w = wide(src)
    out = w.index_select(0, idx)
    return out.view(torch.uint8) if w is not src else out


def scatter_rows(dst: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[idx] = rows`` for uint8 ``[n, len]`` views, through 8-byte elements when both
    allow it. A run of consecutive indices is a plain slice copy (no index kernel).
    ``idx`` should be a host tensor: the run test then never waits for a device."""
    n = idx.numel()
    if n and idx.device.type == "cpu" and _is_run(idx):
        start = int(idx[0])
        copy_rows(dst[start : start + n], rows)
        return
    idx = idx.to(dst.device, non_blocking=True)
    wd, wr = wide(dst), wide(rows.contiguous())
    if wd is not dst and wr.dtype == wd.dtype:
        wd.index_copy_(0, idx, wr)
    else:
        dst.index_copy_(0, idx, rows)


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for uint8 ``[n, len]`` views (strided rows allowed), through
    8-byte elements when both allow it: a strided copy kernel works per element."""
    wd, ws = wide(dst), wide(src)
    if wd is not dst and ws is not src:
        wd.copy_(ws, non_blocking=True)
    else:
        dst.copy_(src, non_blocking=True)


def _is_run(idx: torch.Tensor) -> bool:
    return idx.numel() < 2 or bool((idx[1:] - idx[:-1] == 1).all())


def _regions_of(group: object) -> tuple[KvCacheRegion, ...]:
    regions = tuple(getattr(group, "regions", ()))
    return regions + tuple(getattr(group, "replicated_regions", ()) or ())


def _offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _merge(spans: list[Span]) -> list[Span]:
    """Merge spans adjacent in both source and page (a layer's K and V sit side by side)."""
    merged: list[Span] = []
    for s in spans:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.region == s.region
            and last.src_off + last.length == s.src_off
            and last.page_off + last.length == s.page_off
        ):
            merged[-1] = Span(last.region, last.src_off, last.page_off, last.length + s.length)
        else:
            merged.append(s)
    return merged
