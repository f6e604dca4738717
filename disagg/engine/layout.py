"""KV cache layout descriptions, written from TensorRT-LLM's ``KvCacheLayout`` API.

These mirror ``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout`` (the union of
the two stored variants) so a connector written against them runs unchanged on either.
All classes are frozen dataclasses; addresses are raw device (or host) addresses that stay
valid only while the engine keeps its pools alive.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

# A page index that names no page: a block outside a sliding window. Used as a slot it
# would index the pool's *last* slot, i.e. another request's KV, so it must be filtered.
BAD_PAGE_INDEX = -1


def valid_page_slots(page_indices: Iterable[int]) -> Iterator[tuple[int, int]]:
    """Yield ``(block_ordinal, page_slot)`` for every entry that names a real page.

    Entry ``i`` covers tokens ``[i * tokens_per_block, (i + 1) * tokens_per_block)``; the
    ordinal is kept so callers can still tell which tokens a slot holds.
    """
    for ordinal, slot in enumerate(page_indices):
        if slot >= 0:
            yield ordinal, int(slot)


def _raw_view(address: int, nbytes: int, device: str) -> torch.Tensor:
    """A flat uint8 tensor aliasing ``nbytes`` at ``address`` (no copy)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device == "cpu":
        buf = (ctypes.c_uint8 * nbytes).from_address(address)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)

    class _CudaArray:  # the __cuda_array_interface__ protocol torch understands
        __cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }

    return torch.as_tensor(_CudaArray(), device=device)


@dataclass(frozen=True)
class KvCacheBufferRef:
    """One ``(layer, role)`` buffer inside a region, in memory order.

    ``layer_id`` is the global model layer index (the hooks' ``layer_idx``); ``role`` is
    the manager's own string ("key", "value", ...); ``expansion`` a page expansion factor.
    """

    layer_id: int
    role: str
    expansion: int = 1


@dataclass(frozen=True)
class KvCacheRegion:
    """A byte range repeated once per page slot: slot ``i`` starts at ``base + stride*i``
    and spans ``size`` bytes (``size <= stride``).

    ``device`` is our addition (defaulted, so the contract's positional form still works):
    the real class holds device addresses only; ours also describes host pools.
    """

    base: int
    size: int
    stride: int
    num_slots: int
    buffers: tuple[KvCacheBufferRef, ...] = ()
    device: str = "cpu"

    def address_of(self, slot_id: int) -> int:
        if not 0 <= slot_id < self.num_slots:
            raise IndexError(
                f"page slot {slot_id} is outside this region's [0, {self.num_slots}) slots"
            )
        return self.base + self.stride * slot_id

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A strided ``[num_slots, size // itemsize]`` view; any subscript works, -1 too."""
        item = torch.empty(0, dtype=dtype).element_size()
        if self.size % item or self.stride % item:
            raise ValueError(
                f"region size {self.size} and stride {self.stride} must be multiples of "
                f"{dtype}'s itemsize {item}"
            )
        if self.num_slots == 0:
            return torch.empty((0, self.size // item), dtype=dtype, device=self.device)
        span = self.stride * (self.num_slots - 1) + self.size
        flat = _raw_view(self.base, span, self.device)
        if item != 1:
            pad = (-span) % item
            if pad:  # view() needs a whole number of elements; the tail is never addressed
                flat = _raw_view(self.base, span + pad, self.device)
            flat = flat.view(dtype)
        return flat.as_strided((self.num_slots, self.size // item), (self.stride // item, 1))

    def slot_tensor(self, slot_id: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A ``[size // itemsize]`` view of one slot; IndexError outside the region."""
        item = torch.empty(0, dtype=dtype).element_size()
        if self.size % item:
            raise ValueError(f"region size {self.size} is not a multiple of itemsize {item}")
        return _raw_view(self.address_of(slot_id), self.size, self.device).view(dtype)


@dataclass(frozen=True)
class KvCacheLayerGroupLayout:
    """The page regions of one layer group (one attention window)."""

    layer_group_id: int
    layer_ids: tuple[int, ...]
    window_size: int | None
    regions: tuple[KvCacheRegion, ...]
    replicated_regions: tuple[KvCacheRegion, ...] = ()

    @property
    def bytes_per_page(self) -> int:
        return sum(r.size for r in self.regions)

    @property
    def replicated_bytes_per_page(self) -> int:
        return sum(r.size for r in self.replicated_regions)

    @property
    def num_slots(self) -> int:
        return min((r.num_slots for r in self.regions), default=0)


@dataclass(frozen=True)
class KvCacheLayout:
    """Every layer group's pages, as the V2 manager describes its cache."""

    tokens_per_block: int
    groups: tuple[KvCacheLayerGroupLayout, ...]
    dtype: torch.dtype = torch.uint8
    gpu_pool_mapping_bytes: int | None = None
    _by_id: dict[int, KvCacheLayerGroupLayout] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self._by_id.update({g.layer_group_id: g for g in self.groups})

    def group(self, layer_group_id: int) -> KvCacheLayerGroupLayout:
        try:
            return self._by_id[layer_group_id]
        except KeyError:
            raise KeyError(
                f"layer group {layer_group_id} is not in this layout "
                f"(groups: {sorted(self._by_id)})"
            ) from None

    def group_of_layer(self, layer_id: int) -> KvCacheLayerGroupLayout:
        for g in self.groups:
            if layer_id in g.layer_ids:
                return g
        raise KeyError(f"layer {layer_id} is covered by no layer group of this layout")

    def as_single_pool_tensor(self) -> torch.Tensor | None:
        """The V1 view ``[num_slots, num_layers, kv_factor, block_size]`` in ``dtype``, or
        None when the cache is not one group with one region of uniform buffers."""
        if len(self.groups) != 1 or len(self.groups[0].regions) != 1:
            return None
        group, region = self.groups[0], self.groups[0].regions[0]
        num_layers = len(group.layer_ids)
        bufs = region.buffers
        if not bufs or num_layers == 0 or len(bufs) % num_layers:
            return None
        if any(b.expansion != 1 for b in bufs):
            return None
        kv_factor = len(bufs) // num_layers
        item = torch.empty(0, dtype=self.dtype).element_size()
        if region.size % (len(bufs) * item) or region.stride % item:
            return None
        block_size = region.size // len(bufs) // item
        view = region.as_tensor(self.dtype)
        return (
            view.reshape(region.num_slots, num_layers, kv_factor, block_size)
            if (region.stride == region.size)
            else view.unflatten(1, (num_layers, kv_factor, block_size))
        )
