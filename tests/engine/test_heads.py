"""KV heads across TP sizes: which rank holds which heads, the reference engine's head-major
pages (a rank's page is exactly its heads' slice of the TP=1 page), and ``slice_layout``
(two TP sizes' slices of the same heads hold the same bytes, slot for slot)."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.heads import (
    geometry_of,
    num_kv_heads_of,
    overlap,
    rank_heads,
    slice_layout,
    sources,
)
from disagg.engine.reference import Engine, EngineConfig
from disagg.engine.reference.config import build_llm_args

SMALL = dict(
    num_layers=3,
    hidden_size=64,
    num_heads=8,
    head_dim=16,
    intermediate_size=64,
    tokens_per_block=8,
    num_blocks=24,
)


def test_rank_heads_split_and_replicate():
    assert [rank_heads(4, 2, r) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [rank_heads(4, 4, r) for r in range(4)] == [range(i, i + 1) for i in range(4)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(ValueError, match="do not split over tp=4"):
        rank_heads(6, 4, 0)
    with pytest.raises(ValueError, match="not a multiple of 4 KV heads"):
        rank_heads(4, 6, 0)


def test_sources_cover_each_head_once():
    assert sources(4, 2, range(0, 1)) == [(0, range(0, 1))]  # split: one producer rank
    assert sources(4, 4, range(0, 2)) == [(0, range(0, 1)), (1, range(1, 2))]  # merge
    assert sources(2, 4, range(1, 2)) == [(2, range(1, 2))]  # replicated: first holder
    assert sources(2, 1, range(0, 2)) == [(0, range(0, 2))]
    assert overlap(range(0, 2), range(2, 4)) == range(2, 2)


def _engine(tp: int, kv: int, kv_manager: str = "v1", **kw: object) -> Engine:
    cfg = EngineConfig(**SMALL, num_kv_heads=kv, tp=tp, kv_manager=kv_manager, **kw)  # type: ignore[arg-type]
    return Engine(cfg)


@pytest.mark.parametrize(("tp", "kv"), [(2, 4), (4, 4), (4, 2)])
def test_rank_pages_are_their_heads_of_the_whole_page(tp, kv):
    prompts = [[(i * 7 + 3) % 500 for i in range(37)], [(i * 11 + 1) % 500 for i in range(21)]]
    whole, ranked = _engine(1, kv), _engine(tp, kv)
    assert ranked.generate(prompts, 5) == whole.generate(prompts, 5)
    cfg = whole.config
    shape = (cfg.num_blocks, cfg.num_layers, 2, -1, cfg.tokens_per_block, cfg.head_dim)
    full = whole.kv.groups[0].pools[0].view(shape)
    assert full.abs().sum() > 0
    for r in range(tp):
        heads = rank_heads(kv, tp, r)
        mine = ranked.kv.groups[0].pools[r].view(shape)
        assert torch.equal(mine, full[:, :, :, heads.start : heads.stop])


@pytest.mark.parametrize("kv_manager", ["v1", "v2"])
@pytest.mark.parametrize(("tp_a", "tp_b", "kv"), [(1, 2, 4), (4, 2, 4), (2, 4, 2)])
def test_slices_of_the_same_heads_are_equal_slot_for_slot(kv_manager, tp_a, tp_b, kv):
    extra = dict(windows=(16, None, None), replicated_regions=True) if kv_manager == "v2" else {}
    prompt = [[(i * 5 + 2) % 500 for i in range(45)]]
    a, b = (_engine(tp, kv, kv_manager, **extra) for tp in (tp_a, tp_b))
    a.generate(prompt, 3)
    b.generate(prompt, 3)
    for rb in range(tp_b):
        lay_b = b.kv.layout(rb)
        geo_b = geometry_of(lay_b, kv, tp_b, rb)
        for ra, part in sources(kv, tp_a, geo_b.held):
            lay_a = a.kv.layout(ra)
            sa = slice_layout(lay_a, geometry_of(lay_a, kv, tp_a, ra), part)
            sb = slice_layout(lay_b, geo_b, part)
            assert len(sa.groups) == len(sb.groups) == len(lay_b.groups)
            for ga, gb in zip(sa.groups, sb.groups, strict=True):
                assert [r.size for r in ga.regions] == [r.size for r in gb.regions]
                for xa, xb in zip(ga.regions, gb.regions, strict=True):
                    assert xa.buffers == xb.buffers
                    assert torch.equal(xa.as_tensor(), xb.as_tensor())


def test_geometry_refuses_a_head_count_the_cache_does_not_have():
    eng = _engine(2, 4)
    lay = eng.kv.layout(0)
    assert geometry_of(lay, 4, 2, 1).head_bytes == 8 * 16 * 4
    assert num_kv_heads_of(build_llm_args(eng.config, None)) == 4
    with pytest.raises(ValueError, match="KV head count does not match"):
        geometry_of(lay, 12, 2, 0)  # 6 heads per rank claimed, 2 in the cache
