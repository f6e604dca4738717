"""Attention over the pages for short spans (``paged.py``) against the gathered keys'
per-request attention (CUDA with Triton only), and the engine taking it."""

import random

import pytest
import torch

from disagg.engine.reference import attention, paged
from disagg.engine.reference.batch import build
from disagg.engine.reference.config import EngineConfig
from disagg.engine.reference.executor import Engine
from disagg.engine.reference.kv_cache import KvCacheManager

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and paged.triton is not None), reason="needs CUDA and Triton"
)


class _Req:
    def __init__(self, rid, end, pages):
        self.request_id, self.tokens, self.pages, self.adapter = rid, [0] * end, pages, None


@pytest.mark.parametrize(
    "heads,kv_heads,windows",
    [(16, 8, (None,)), (8, 2, (None, 40)), (4, 4, (None,)), (32, 2, (None,))],
)
def test_probe_agrees(heads, kv_heads, windows):
    cfg = EngineConfig(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        hidden_size=heads * 128,
        tokens_per_block=32,
        windows=windows,
        dtype="bfloat16",
        device="cuda",
    )
    assert paged.probe(cfg, heads) == ""


def test_a_mixed_batch_matches_the_gathered_path():
    """Decode tokens, a short chunk and long chunks in one batch, two layer groups (one
    windowed), pages scattered: each row's output as the per-request attention's."""
    cfg = EngineConfig(
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        hidden_size=512,
        tokens_per_block=16,
        windows=(None, 48),
        num_blocks=256,
        dtype="bfloat16",
        device="cuda",
    )
    kv = KvCacheManager(cfg)
    g = torch.Generator().manual_seed(0)
    for group in kv.groups:
        group.pools[0].copy_(torch.randn(group.pools[0].shape, generator=g))
    slots = list(range(cfg.num_blocks))
    random.Random(1).shuffle(slots)
    spans = [(300, 1), (17, 40), (95, 3), (0, 1), (64, 100), (200, 4), (31, 1)]
    taken = iter(slots)
    reqs = []
    for i, (s, n) in enumerate(spans):
        pages = [[next(taken) for _ in range(-(-(s + n) // 16))] for _ in kv.groups]
        reqs.append((_Req(i, s + n, pages), s, n))
    short = paged.max_rows(8, 2)
    whole, part = build(reqs, kv), build(reqs, kv, short)
    assert part.short.tolist() == [i for i, (_, n) in enumerate(spans) if n <= short]
    assert part.long is not None and part.long.lens == [n for _, n in spans if n > short]
    q = torch.randn(whole.rows, 8, 64, generator=g).to("cuda", torch.bfloat16)
    for layer in range(2):
        gid, li = kv.layer_group[layer], kv.layer_index[layer]
        window = cfg.layer_windows[layer]
        keys, vals = kv.read_layer(whole.groups[gid].read[li], layer)
        want = attention.per_request(q, keys, vals, whole, whole.groups[gid], window).float()
        got = torch.full_like(q, float("nan"))
        pg = part.groups[gid]
        k2, v2 = kv.read_layer(pg.read[li], layer)
        got[part.long_rows] = attention.per_request(
            q[part.long_rows], k2, v2, part.long, pg, window
        )
        base, stride = kv.layer_rows(layer)
        paged.attend(
            q, got, kv.head_rows(gid)[0], base, stride, kv.heads_per_pool, kv.tpb, pg.table,
            pg.offsets, pg.lo_t, part.start_t, part.len_t, part.cu_q, part.short, window,
        )  # fmt: skip
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_the_engine_decodes_over_the_pages():
    cfg = EngineConfig(
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        hidden_size=512,
        tokens_per_block=16,
        dtype="bfloat16",
        device="cuda",
    )
    eng = Engine(cfg)
    assert eng.model.paged_reason == ""
    assert eng.model.paged_max_n(eng.kv) == paged.max_rows(8, 4)


def _generate(monkeypatch, graphs: str, windows=(None,)):
    monkeypatch.setenv("DISAGG_CUDA_GRAPHS", graphs)
    cfg = EngineConfig(
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        hidden_size=512,
        tokens_per_block=16,
        windows=windows,
        kv_manager="v2",
        dtype="bfloat16",
        device="cuda",
    )
    eng = Engine(cfg)
    rnd = random.Random(5)
    prompts = [[rnd.randrange(cfg.vocab_size) for _ in range(n)] for n in (150, 33, 7, 64, 90)]
    # different lengths: the decode batch shrinks as requests finish (a capture per size)
    return eng, eng.generate(prompts, [40, 12, 25, 3, 30])


@pytest.mark.parametrize("windows", [(None,), (None, 40)])
def test_decode_graphs_give_the_eager_tokens(monkeypatch, windows):
    eng, replayed = _generate(monkeypatch, "1", windows)
    assert eng.model.graphs is not None and eng.model.graphs.reason == ""
    assert len(eng.model.graphs._sizes) >= 3
    eager_eng, eager = _generate(monkeypatch, "0", windows)
    assert eager_eng.model.graphs is None
    assert replayed == eager


def test_whole_prompts_take_cudnn_padded_to_their_bucket():
    att = attention.Attention("cuda", torch.bfloat16, exact=False, windows=False)
    assert att.whole_reason == "" and att.batched
    lens = [3000, attention.WHOLE_MIN]
    q_starts = [0, lens[0], sum(lens)]
    cu = torch.tensor(q_starts, dtype=torch.int32, device="cuda")
    b = attention.Batch([0, 0], lens, [None] * 2, None, None, q_starts, cu, max(lens), [])
    g = attention.GroupRows(None, None, [0, 0], q_starts, cu, max(lens))
    q = torch.randn(sum(lens), 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    assert attention._whole(b, g, None) and not attention._whole(b, g, 64)
    got = att(q, k, v, b, g, None).float()
    torch.testing.assert_close(
        got, attention.flash_varlen(q, k, v, b, g, None).float(), atol=2e-2, rtol=2e-2
    )
    assert attention.bucket(3000) == 3072 and attention.bucket(1000) == 1024
