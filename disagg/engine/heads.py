"""Where a TP rank's KV heads sit in its pages, engine-neutral.

Head sharding (TensorRT-LLM's): with ``tp <= num_kv_heads`` rank ``r`` holds the
``num_kv_heads // tp`` heads from ``r * num_kv_heads // tp``; with ``tp > num_kv_heads``
each rank holds one head, ``r // (tp // num_kv_heads)`` (heads replicated over
``tp // num_kv_heads`` ranks). Either size must divide the other.

Page layout (TensorRT-LLM's, and the reference engine's): a page of one layer group is a
run of ``(layer, role)`` buffers (``layout.KvCacheRegion.buffers``, each region a run of
equal buffers), and one buffer is ``[heads held, tokens_per_block, head_dim]``: heads
outside tokens. So heads ``[a, b)`` of a rank holding ``[h0, h1)`` are, in every buffer,
one contiguous run at ``(a - h0) * head_bytes`` of ``(b - a) * head_bytes`` bytes
(``head_bytes = tokens_per_block * head_dim * itemsize``).

``slice_layout`` turns a rank's ``KvCacheLayout`` into the layout of a head range only:
every buffer's run becomes a region of its own (slot ``i`` at the buffer's run of slot
``i``), even where the range is every head held, so two ranks' slices of the same head
range have equal geometry whatever their TP sizes, and a page moves
between them as between two equal-TP ranks: straight from the producer's slots into the
consumer's, with no intermediate copy.

Geometry from the runtime (``geometry_of``): the total KV heads come from the model config
(``num_kv_heads`` in the disagg config, the reference engine's config, or the checkpoint's
``config.json`` ``num_key_value_heads``); the heads held from TP size and rank; the head
size from the layout's buffer bytes, so a layout that does not split into whole heads is
refused with the reason.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from .layout import KvCacheBufferRef, KvCacheLayerGroupLayout, KvCacheLayout, KvCacheRegion


def rank_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads rank ``tp_rank`` of ``tp_size`` holds (module docstring)."""
    if num_kv_heads < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(
            f"no head shard for rank {tp_rank} of tp={tp_size} with {num_kv_heads} KV heads"
        )
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"{num_kv_heads} KV heads do not split over tp={tp_size}: use a TP size that "
                "divides the KV head count (or a multiple of it)"
            )
        per = num_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tp={tp_size} is not a multiple of {num_kv_heads} KV heads: use a TP size that "
            "divides the KV head count (or a multiple of it)"
        )
    head = tp_rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def overlap(a: range, b: range) -> range:
    """The heads both ranges hold (empty when none)."""
    return range(max(a.start, b.start), max(max(a.start, b.start), min(a.stop, b.stop)))


def sources(num_kv_heads: int, tp_from: int, want: range) -> list[tuple[int, range]]:
    """``[(rank, heads)]``: the ranks of a ``tp_from`` instance to take ``want`` from, one
    per distinct head run, in head order. Replicated heads are taken from the first rank
    holding them; ranks are visited in order so every range is covered exactly once."""
    out: list[tuple[int, range]] = []
    covered = want.start
    for rank in range(tp_from):
        part = overlap(rank_heads(num_kv_heads, tp_from, rank), range(covered, want.stop))
        if len(part) and part.start == covered:
            out.append((rank, part))
            covered = part.stop
    if covered != want.stop:
        raise ValueError(f"heads {want} are not all held by a tp={tp_from} instance")
    return out


@dataclass(frozen=True)
class HeadGeometry:
    """One rank's heads: ``held`` (absolute KV head indices) and each head's bytes in a
    buffer (``tokens_per_block * head_dim * itemsize``)."""

    num_kv_heads: int
    held: range
    head_bytes: int

    def run(self, want: range) -> tuple[int, int]:
        """``(offset, nbytes)`` of heads ``want`` inside one buffer of this rank."""
        if not len(want) or want.start < self.held.start or want.stop > self.held.stop:
            raise ValueError(f"heads {want} are not within the heads held here {self.held}")
        return (want.start - self.held.start) * self.head_bytes, len(want) * self.head_bytes


def _buffer_bytes(region: KvCacheRegion) -> int:
    n = len(region.buffers)
    if n == 0 or region.size % n or any(b.expansion != 1 for b in region.buffers):
        raise ValueError(
            f"a region of {region.size} bytes with buffers {region.buffers} does not split "
            "into equal (layer, role) buffers: cannot locate KV heads in it"
        )
    return region.size // n


def head_bytes_of(layout: KvCacheLayout, heads_held: int) -> int:
    """Each head's bytes per buffer, checked equal across every region of ``layout``."""
    sizes = {_buffer_bytes(r) for g in layout.groups for r in _regions(g)}
    if len(sizes) != 1:
        raise ValueError(f"the layout's buffers differ in size ({sorted(sizes)} bytes)")
    (size,) = sizes
    dtype = getattr(layout, "dtype", None) or torch.uint8  # one line's layout has none
    item = torch.empty(0, dtype=dtype).element_size()
    if size % (heads_held * layout.tokens_per_block * item):
        raise ValueError(
            f"a {size}-byte buffer is not {heads_held} heads x {layout.tokens_per_block} tokens "
            f"of {dtype}: the model config's KV head count does not match the cache"
        )
    return size // heads_held


def num_kv_heads_of(llm_args: Any, configured: int | None = None) -> int | None:
    """The model's total KV heads: ``configured``, else the reference engine's config, else
    the checkpoint's ``config.json`` (``num_key_value_heads``, else ``num_attention_heads``);
    None when nothing says (then only equal TP sizes are served)."""
    if configured:
        return int(configured)
    eng = getattr(llm_args, "engine_config", None)
    if eng is not None and getattr(eng, "num_kv_heads", None):
        return int(eng.num_kv_heads)
    model = getattr(llm_args, "model", None)
    path = os.path.join(str(model), "config.json") if model is not None else ""
    if path and os.path.isfile(path):
        with open(path) as f:
            hf = json.load(f)
        hf = hf.get("text_config", hf)
        n = hf.get("num_key_value_heads") or hf.get("num_attention_heads")
        return int(n) if n else None
    return None


def geometry_of(
    layout: KvCacheLayout, num_kv_heads: int, tp_size: int, tp_rank: int
) -> HeadGeometry:
    held = rank_heads(num_kv_heads, tp_size, tp_rank)
    return HeadGeometry(num_kv_heads, held, head_bytes_of(layout, len(held)))


def _slice_region(
    region: KvCacheRegion, offset: int, nbytes: int, device: str
) -> list[KvCacheRegion]:
    size = _buffer_bytes(region)
    return [
        KvCacheRegion(
            region.base + i * size + offset,
            nbytes,
            region.stride,
            region.num_slots,
            (KvCacheBufferRef(buf.layer_id, buf.role, buf.expansion),),
            device=getattr(region, "device", None) or device,
        )
        for i, buf in enumerate(region.buffers)
    ]


def slice_layout(
    layout: KvCacheLayout, geom: HeadGeometry, want: range, device: str = "cpu"
) -> KvCacheLayout:
    """``layout`` restricted to heads ``want`` (module docstring), in this package's layout
    classes: same groups, slots and buffer order; each group's regions are the runs of
    ``want`` in its buffers, replicated regions included (as regions: a slice is moved
    whole). ``device``: the regions' where the layout's classes do not say."""
    offset, nbytes = geom.run(want)
    groups = []
    for g in layout.groups:
        regions = [part for r in _regions(g) for part in _slice_region(r, offset, nbytes, device)]
        groups.append(
            KvCacheLayerGroupLayout(g.layer_group_id, g.layer_ids, g.window_size, tuple(regions))
        )
    dtype = getattr(layout, "dtype", None) or torch.uint8
    return KvCacheLayout(layout.tokens_per_block, tuple(groups), dtype)


def _regions(group: Any) -> tuple[Any, ...]:
    """A group's regions in page order (``pages.PagePool``'s): replicated ones last."""
    return (*group.regions, *(getattr(group, "replicated_regions", ()) or ()))


def store_columns(
    layout: KvCacheLayout, geom: HeadGeometry, want: range
) -> tuple[list[list[tuple[int, int]]], dict[int, list[tuple[int, int]]]]:
    """Where heads ``want`` sit inside each group page: ``(per group [(offset, length)],
    per layer [(offset in its group's page, length)])``, each list in page order and
    adjacent runs merged (every head held: one run per region). A slice's group page is
    the concatenation of its group's columns, a slice's layer page of its layer's."""
    offset, nbytes = geom.run(want)
    groups: list[list[tuple[int, int]]] = []
    layers: dict[int, list[tuple[int, int]]] = {}
    for g in layout.groups:
        cols: list[tuple[int, int]] = []
        at = 0
        for r in _regions(g):
            size = _buffer_bytes(r)
            for i, buf in enumerate(r.buffers):
                run = (at + i * size + offset, nbytes)
                _append(cols, run)
                _append(layers.setdefault(buf.layer_id, []), run)
            at += r.size
        groups.append(cols)
    return groups, layers


def _append(cols: list[tuple[int, int]], run: tuple[int, int]) -> None:
    if cols and cols[-1][0] + cols[-1][1] == run[0]:
        cols[-1] = (cols[-1][0], cols[-1][1] + run[1])
    else:
        cols.append(run)
