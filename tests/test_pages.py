"""Page geometry and the batched gather/scatter helpers (byte-exact in every layout)."""

import numpy as np
import pytest
import torch

from disagg.engine.layout import (
    KvCacheBufferRef,
    KvCacheLayerGroupLayout,
    KvCacheLayout,
    KvCacheRegion,
)
from disagg.pages import PagePool, copy_rows, gather_rows, scatter_rows, wide
from disagg.producer.saving import (
    copy_layer_to_store,
    copy_pass_to_store,
    flush_pass,
    land,
    plan_pass,
)


@pytest.mark.parametrize("width", [64, 13])  # 8-byte elements, and the byte fallback
def test_gather_scatter_copy_byte_exact(width):
    g = torch.Generator().manual_seed(width)
    src = torch.randint(0, 256, (10, width), dtype=torch.uint8, generator=g)
    idx = torch.tensor([7, 2, 9])
    assert torch.equal(gather_rows(src, idx), src[idx])
    dst = torch.zeros(10, width, dtype=torch.uint8)
    scatter_rows(dst, idx, src[:3])
    assert torch.equal(dst[idx], src[:3]) and int(dst[[0, 1, 3, 4, 5, 6, 8]].sum()) == 0
    run = torch.tensor([4, 5, 6])  # a run is a slice copy
    scatter_rows(dst, run, src[3:6])
    assert torch.equal(dst[4:7], src[3:6])
    cols = torch.zeros(3, 2 * width, dtype=torch.uint8)
    copy_rows(cols[:, width:], src[:3])  # strided destination rows
    assert torch.equal(cols[:, width:], src[:3]) and int(cols[:, :width].sum()) == 0
    assert (wide(src).dtype == torch.int64) == (width % 8 == 0)


@pytest.mark.parametrize("whole", [False, True], ids=["layerwise", "whole-pass"])
@pytest.mark.parametrize("rows", [[3, 0], [1, 2]])  # one index copy a layer; a slice copy
def test_save_path_into_store_rows_multi_group_multi_region(rows, whole):
    """Two groups, the second with two regions; layer bytes land at the page offsets,
    copied a layer at a time or the whole pass's pages at once."""
    tensors = [torch.randint(0, 256, (6, 2, 2, 8), dtype=torch.uint8) for _ in range(3)]

    def region(t, layers):
        bufs = tuple(KvCacheBufferRef(la, r) for la in layers for r in ("key", "value"))
        n = t[0].numel()
        return KvCacheRegion(t.data_ptr(), n, n, t.shape[0], bufs)

    layout = KvCacheLayout(
        16,
        (
            KvCacheLayerGroupLayout(0, (0, 1), 32, (region(tensors[0], (0, 1)),)),
            KvCacheLayerGroupLayout(
                1, (2, 3), None, (region(tensors[1], (2, 3)), region(tensors[2], (2, 3)))
            ),
        ),
    )
    pool = PagePool(layout)
    assert pool.block_bytes == 32 + 64
    slots = [torch.tensor([5, 1]), torch.tensor([0, 4])]
    slab = torch.zeros(4, pool.block_bytes, dtype=torch.uint8)
    copy = plan_pass(pool, slab, np.array(rows), [s.numpy() for s in slots])
    assert (copy.run is None) == (rows == [3, 0])
    if whole:
        assert copy_pass_to_store(pool, copy, slab)
    else:
        for layer in range(4):
            copy_layer_to_store(pool, layer, copy, slab)
    flush_pass(copy, slab)
    land(copy, slab)
    for i, row in enumerate(rows):
        g0 = pool.read_pages(0, slots[0][i : i + 1])[0]
        g1 = pool.read_pages(1, slots[1][i : i + 1])[0]
        assert torch.equal(slab[row], torch.cat([g0, g1]))
    assert int(slab[[r for r in range(4) if r not in rows]].sum()) == 0
    with pytest.raises(IndexError, match="BAD_PAGE_INDEX"):
        pool.read_pages(0, torch.tensor([-1]))
