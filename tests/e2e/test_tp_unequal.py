"""Producer and consumer of different TP sizes (reference engines simulating every rank in
one process): each consumer rank loads exactly its KV heads from the producer rank(s)
holding them, split (one producer page serves several consumer ranks), merged (a consumer
page assembled from several producer ranks' slices) or replicated (more consumer ranks than
KV heads).

Judged against a monolithic TP=1 run: tokens equal, and every page the consumer loaded,
taken apart by KV head, equals the producer's computed page head for head, byte for byte
(a replicated head equal on every rank holding it).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from harness import (
    SHAPE,
    close_all_services,
    make_consumer,
    make_producer,
    prompts,
    rank_endpoints,
    rank_services,
    run,
    wait_for,
)

from disagg.engine.heads import rank_heads
from disagg.engine.reference import Engine, EngineConfig


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


def _shape(kv: int, **kw: object) -> dict[str, object]:
    return dict(SHAPE, num_heads=8, num_kv_heads=kv, **kw)


def _heads(cfg: EngineConfig, group: int, data: bytes) -> torch.Tensor:
    """A page of every rank (rank order) as ``[layers, 2, num_kv_heads, tokens, head_dim]``
    by absolute head; a replicated head must be equal on every rank holding it."""
    layers = len(cfg.layer_groups[group][1])
    per_rank = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(cfg.tp, layers, 2, -1)
    out: dict[int, torch.Tensor] = {}
    for r in range(cfg.tp):
        held = rank_heads(cfg.num_kv_heads, cfg.tp, r)
        mine = per_rank[r].reshape(layers, 2, len(held), -1)
        for i, h in enumerate(held):
            if h in out:
                assert torch.equal(out[h], mine[:, :, i]), f"replicas of head {h} differ"
            out[h] = mine[:, :, i]
    return torch.stack([out[h] for h in range(cfg.num_kv_heads)], dim=2)


def _assert_pages_match(pcfg, ccfg, produced, consumed):
    for p, c in zip(produced, consumed, strict=True):
        assert c.loaded_pages, "the consumer loaded no page"
        for (g, b), data in c.loaded_pages.items():
            want = _heads(pcfg, g, p.computed_pages[(g, b)])
            assert torch.equal(_heads(ccfg, g, data), want), f"page {(g, b)} differs by head"


def _served(p, d, kv, load_mode, kv_manager="v1", transport=None, **extra):
    pcfg = EngineConfig(**_shape(kv, tp=p, kv_manager=kv_manager, capture_pages=True, **extra))
    ccfg = EngineConfig(**_shape(kv, tp=d, kv_manager=kv_manager, capture_pages=True, **extra))
    ps = prompts(n=2, length=120)
    mono = Engine(EngineConfig(**_shape(kv, kv_manager=kv_manager, **extra))).generate(ps, 5)
    prod, psvc = make_producer(pcfg, transport=transport)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(
        ccfg, [rank_endpoints(psvc)], load_mode=load_mode, transport=transport
    )
    consumed = run(cons, ps, max_tokens=5)
    return pcfg, ccfg, psvc, csvc, mono, produced, consumed


@pytest.mark.parametrize(
    ("p", "d", "kv", "load_mode", "kv_manager", "transport"),
    [
        # split: one producer page serves both consumer ranks (on the same-host plane: each
        # rank's runs of every buffer in one pass)
        (1, 2, 4, "async", "v1", "ipc"),
        (2, 1, 4, "sync", "v1", "tcp"),  # merge: one consumer page from both producer ranks
        (2, 4, 4, "sync", "v2", "tcp"),
        (4, 2, 4, "async", "v2", "ipc"),  # the same-host plane lands slices in place too
        (2, 4, 2, "async", "v1", "tcp"),  # 4 consumer ranks, 2 KV heads: each on two ranks
    ],
)
def test_unequal_tp_tokens_and_heads_match_monolithic(p, d, kv, load_mode, kv_manager, transport):
    extra = {"windows": (32, None)} if kv_manager == "v2" else {}  # VSWA: two layer groups
    pcfg, ccfg, psvc, csvc, mono, produced, consumed = _served(
        p, d, kv, load_mode, kv_manager, transport, **extra
    )
    assert [r.error for r in consumed] == [None, None]
    assert all(r.connector_matched_tokens > 0 for r in consumed)
    assert [r.tokens for r in consumed] == mono
    _assert_pages_match(pcfg, ccfg, produced, consumed)
    pranks = rank_services(psvc)
    assert len({frozenset(s.store.keys()) for s in pranks}) == 1  # one key per block
    for svc in pranks:  # every producer rank pushed, and got every lease back
        assert wait_for(lambda s=svc: s.metrics["pages_pushed"] > 0), f"rank {svc.tp_rank}"
        assert wait_for(lambda s=svc: s.leases.active() == 0), f"rank {svc.tp_rank} leases"
        assert wait_for(lambda s=svc: s.store.pinned_blocks() == 0), f"rank {svc.tp_rank}"
    # a consumer rank talks only to the producer ranks holding its heads
    for svc in rank_services(csvc)[1:]:
        assert len(svc.rank_links[0]) == max(1, p // d)


@pytest.mark.parametrize(("p", "d", "load_mode"), [(2, 1, "async"), (4, 2, "sync")])
def test_a_producer_rank_failing_its_part_fails_the_load_on_every_consumer_rank(p, d, load_mode):
    cfg_p = EngineConfig(**_shape(4, tp=p))
    cfg_c = EngineConfig(**_shape(4, tp=d))
    ps = prompts(n=1, length=120)
    prod, psvc = make_producer(cfg_p)
    run(prod, ps, 1)
    rank_services(psvc)[-1].data.close()  # the last rank grants the claim, never pushes
    cons, csvc = make_consumer(
        cfg_c,
        [rank_endpoints(psvc)],
        load_timeout_s=1.0,
        load_mode=load_mode,
        on_load_failure="fail_request",
    )
    rid = cons.add_request(ps[0], 4)
    while cons.has_work():
        cons.step()
    res = cons.results[rid]
    assert res.error is not None and f"request {rid}" in res.error and res.tokens == []
    # the consumer rank loading from it failed its load; any other rank was told so
    assert [s.metrics["loads_failed"] for s in rank_services(csvc)] == [0] * (d - 1) + [1]
    for svc in rank_services(psvc):  # both producer ranks' leases given back together
        assert wait_for(lambda s=svc: s.leases.active() == 0), f"rank {svc.tp_rank} leases"


def test_consumer_listing_producer_ranks_out_of_order_is_refused(caplog):
    cfg_p = EngineConfig(**_shape(4, tp=2))
    ps = prompts(n=1, length=120)
    prod, psvc = make_producer(cfg_p)
    run(prod, ps, 1)
    cfg_c = EngineConfig(**_shape(4, tp=1))
    swapped = list(reversed(rank_endpoints(psvc)))  # rank 1 listed first: wrong heads
    cons, csvc = make_consumer(cfg_c, [swapped])
    with caplog.at_level(logging.WARNING, logger="disagg.consumer"):
        (res,) = run(cons, ps, 4)
    assert res.error is None and res.connector_matched_tokens == 0
    assert res.tokens == Engine(cfg_c).generate(ps, 4)[0]
    assert "is rank 1 of a TP=2 producer, but consumer.producers lists it as rank 0" in (
        caplog.text
    )


def test_a_producer_rank_dying_mid_load_fails_the_request_on_every_consumer_rank():
    """Producer TP 4, consumer TP 2, layer-wise loads: producer rank 3 sends its first
    layer's pages and then stops, its data plane closed. Consumer rank 1's pages, assembled
    from ranks 2 and 3, never complete: the request fails by name on both consumer ranks
    (no hang, no token computed on half a page), and the other producer ranks' leases go
    back."""
    cfg_p, cfg_c = EngineConfig(**_shape(4, tp=4)), EngineConfig(**_shape(4, tp=2))
    ps = prompts(n=1, length=120)
    prod, psvc = make_producer(cfg_p)
    run(prod, ps, 1)
    dying = rank_services(psvc)[3]
    post = dying.data.post_push

    def first_layer_then_die(endpoint, tid, lease, token, pages, **kw):
        handle = post(endpoint, tid, lease, token, pages[:1], **kw)
        threading.Timer(0.05, dying.data.close).start()
        return handle

    dying.data.post_push = first_layer_then_die
    cons, csvc = make_consumer(
        cfg_c,
        [rank_endpoints(psvc)],
        load_timeout_s=1.0,
        load_mode="sync",
        on_load_failure="fail_request",
    )
    rid = cons.add_request(ps[0], 4)
    while cons.has_work():
        cons.step()
    res = cons.results[rid]
    assert res.error is not None and f"request {rid}" in res.error and res.tokens == []
    first, second = rank_services(csvc)
    assert second.metrics["loads_failed"] == 1 and second.metrics["loads_failed_on_other_rank"] == 0
    # rank 0 fails the load for rank 1; its own part had landed by then, or is stopped
    assert first.metrics["loads_failed_on_other_rank"] == 1 and first.metrics["loads_failed"] <= 1
    for svc in rank_services(psvc)[:3]:
        assert wait_for(lambda s=svc: s.leases.active() == 0), f"rank {svc.tp_rank} leases"


@pytest.mark.parametrize(("p", "d", "load_mode"), [(4, 2, "sync"), (1, 2, "async")])
def test_prefix_reservations_across_tp_sizes(p, d, load_mode):
    """TensorRT-LLM main's prefix reservations, clipped by the runtime to 2 of a prompt's
    blocks: the tail is released on every producer rank's lease, and each consumer rank
    loads exactly the accepted blocks of its heads."""
    kw = dict(kv_manager="v2", prefix_aware_scheduling=True, capture_pages=True)
    cap = 2 * SHAPE["tokens_per_block"]
    pcfg = EngineConfig(**_shape(4, tp=p, **kw))
    ccfg = EngineConfig(**_shape(4, tp=d, prefix_load_cap_tokens=cap + 5, **kw))
    ps = prompts(n=2, length=120)
    mono = Engine(EngineConfig(**_shape(4, kv_manager="v2"))).generate(ps, 5)
    prod, psvc = make_producer(pcfg)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(ccfg, [rank_endpoints(psvc)], load_mode=load_mode)
    assert cons.prefix_reservations
    consumed = run(cons, ps, max_tokens=5)
    assert [r.tokens for r in consumed] == mono
    assert [r.connector_matched_tokens for r in consumed] == [cap, cap]
    _assert_pages_match(pcfg, ccfg, produced, consumed)
    assert cons.stats.calls["reserve_prefix"] == 2
    for svc in rank_services(psvc):
        assert wait_for(lambda s=svc: s.leases.active() == 0), f"rank {svc.tp_rank} leases"
        assert wait_for(lambda s=svc: s.store.pinned_blocks() == 0), f"rank {svc.tp_rank}"


def test_config_sizes_that_contradict_the_engine_refuse_to_start():
    """``tensor_parallel_size`` and ``num_kv_heads`` in the disagg config are checked
    against what the engine runs: a contradiction is one error naming the key and the fix."""
    cfg = EngineConfig(**_shape(4, tp=2))
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: the disagg config says 4 but"):
        make_producer(cfg, top={"tensor_parallel_size": 4})
    with pytest.raises(ValueError, match=r"^num_kv_heads: the disagg config says 8 but the model"):
        make_producer(cfg, top={"num_kv_heads": 8})
    _, psvc = make_producer(cfg, top={"tensor_parallel_size": 2, "num_kv_heads": 4})
    assert (psvc.tp_size, psvc.num_kv_heads, psvc.fingerprint.num_kv_heads) == (2, 4, 4)
