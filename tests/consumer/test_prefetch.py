"""Prefetch (disagg/consumer/prefetch.py): a consumer told of a prompt while the producer
prefills it leases the prompt's blocks; the continuation (prompt + the producer's first
token) takes that lease instead of claiming. In-process producer and consumer engines:
tokens equal the monolithic run's; a lease no continuation takes is released by its named
timeout; a producer that dies while the consumer prefetches costs a recompute, never a
wrong token or a failed request."""

from __future__ import annotations

import time

import pytest
from harness import (
    SHAPE,
    close_all_services,
    continue_after,
    make_consumer,
    make_producer,
    random_prompt,
    rank_endpoints,
    rank_services,
    run_one,
    wait_for,
)

from disagg.consumer import links, prefetch
from disagg.engine.reference import Engine, EngineConfig
from disagg.protocol import messages as m
from disagg.serve.app import confirm_prefetch, start_prefetch

CFG = EngineConfig(**{**SHAPE, "num_blocks": 128, "capture_pages": True, "kv_manager": "v2"})
TPB = CFG.tokens_per_block


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


@pytest.mark.parametrize("length", [96, 100], ids=["whole-blocks", "partial-block"])
def test_the_continuation_takes_the_prefetched_lease(length: int):
    prompt = random_prompt(1, length)
    mono = Engine(CFG).generate([prompt], max_tokens=6)[0]
    prod, psvc = make_producer(CFG)
    cons, csvc = make_consumer(CFG, [psvc.endpoint])
    assert start_prefetch(csvc, prompt, None) is None  # told before the prefill ran
    rid = prod.add_request(prompt, 1)
    while not prod.results[rid].finished or prod.has_work():
        prod.step()
    produced = prod.results[rid]
    assert produced.tokens == mono[:1]
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    assert psvc.leases.active() == 1
    got = continue_after(cons, prompt, produced.tokens[0], 6)
    assert got.error is None and [produced.tokens[0], *got.tokens] == mono
    assert csvc.metrics["prefetch_taken"] == 1
    assert csvc.metrics["claims_hit"] == 0, "the engine thread claimed despite the prefetch"
    assert got.connector_matched_tokens == length // TPB * TPB
    for where, data in got.loaded_pages.items():  # page for page the producer's bytes
        assert data == produced.computed_pages[where], f"page {where} differs"
    assert wait_for(lambda: psvc.leases.active() == 0 and psvc.store.pinned_blocks() == 0)


@pytest.mark.parametrize("told", [True, False], ids=["woken-on-arrival", "woken-by-the-take"])
def test_a_continuation_before_the_grant_wakes_the_prefetch_and_takes_its_lease(
    monkeypatch, told: bool
):
    """The prefetch polls while the producer has not planned the prompt yet; its next
    poll is seconds away when the continuation comes. The continuation wakes it (its
    HTTP handler, or the take itself) and the take waits for the grant instead of
    claiming the same blocks again."""
    monkeypatch.setattr(prefetch, "POLL_MIN_S", 30.0)
    prompt = random_prompt(13)
    mono = Engine(CFG).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(CFG)
    cons, csvc = make_consumer(CFG, [psvc.endpoint], claim_timeout_s=5.0)
    lookups = _count_lookups(csvc, monkeypatch)
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: lookups[0] == 1)  # a miss: then a sleep of POLL_MIN_S
    prod.generate([prompt], max_tokens=1)  # the producer holds the blocks now
    t0 = time.monotonic()
    if told:
        assert not confirm_prefetch(csvc, prompt, None)  # nothing granted to confirm yet
        assert csvc.metrics["prefetch_woken"] == 1
    got = continue_after(cons, prompt, mono[0], 4)
    assert time.monotonic() - t0 < 10.0
    assert got.error is None and [mono[0], *got.tokens] == mono
    assert csvc.metrics["prefetch_taken"] == 1 and csvc.metrics["prefetch_late"] == 0
    assert csvc.metrics["claims_hit"] == 0, "the engine thread claimed the same blocks"
    assert lookups[0] == 1, "woken, the prefetch claims without looking up first"
    assert got.connector_matched_tokens == len(prompt) // TPB * TPB
    assert wait_for(lambda: psvc.leases.active() == 0 and psvc.store.pinned_blocks() == 0)


@pytest.mark.parametrize("reserve", [0, 1], ids=["at-the-pass-end", "at-the-first-layer"])
def test_a_producer_is_polled_while_it_prefills_only_if_it_holds_blocks_then(
    monkeypatch, reserve: int
):
    """A producer that does not serve waiting claims names where its passes reserve
    their blocks (``HelloOk``). One that reserves at the pass's end holds none of the
    prompt's while it prefills: the prefetch asks it once, then waits for the
    continuation's wake, which it then answers with a claim. One that reserves at a
    layer's save is polled while it prefills."""
    monkeypatch.setenv("DISAGG_SAVE_RESERVE_LAYERS", str(reserve))
    monkeypatch.setattr(prefetch, "POLL_AFTER_PASS_S", 30.0)
    prompt = random_prompt(15)
    mono = Engine(CFG).generate([prompt], max_tokens=3)[0]
    prod, psvc = make_producer(CFG)
    psvc.features = (m.FEATURE_RELEASE_RANGE,)  # no Claim.wait_s
    cons, csvc = make_consumer(CFG, [psvc.endpoint], claim_timeout_s=5.0)
    lookups = _count_lookups(csvc, monkeypatch)
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: lookups[0] >= 1)
    assert csvc.links[0].reserves_at_layer == reserve
    if reserve:
        assert wait_for(lambda: lookups[0] >= 3), "a producer holding blocks mid-pass is polled"
    else:
        time.sleep(0.3)  # the backoff alone would have polled ~10 times by now
        assert lookups[0] == 1
    prod.generate([prompt], max_tokens=1)
    asked = lookups[0]
    if reserve:  # its polls find the blocks
        assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    else:  # only the continuation's arrival can wake it
        assert not confirm_prefetch(csvc, prompt, None)
        assert csvc.metrics["prefetch_woken"] == 1
    got = continue_after(cons, prompt, mono[0], 3)
    assert got.error is None and [mono[0], *got.tokens] == mono
    assert csvc.metrics["prefetch_taken"] == 1 and csvc.metrics["claims_hit"] == 0
    if not reserve:
        assert lookups[0] == asked == 1, "woken, the prefetch claims without a lookup"
    assert wait_for(lambda: psvc.leases.active() == 0 and psvc.store.pinned_blocks() == 0)


def test_a_waiting_claim_is_granted_as_the_producer_reserves_the_blocks(monkeypatch):
    """A consumer of one producer serving ``Claim.wait_s`` asks for the prompt's blocks
    once: the producer answers when its pass reserves them, with no continuation and no
    wake, and the continuation takes that lease; nothing is claimed on the engine's
    thread and no lookup polls the producer while it prefills."""
    prompt = random_prompt(16)
    mono = Engine(CFG).generate([prompt], max_tokens=3)[0]
    prod, psvc = make_producer(CFG)
    cons, csvc = make_consumer(CFG, [psvc.endpoint])
    lookups = _count_lookups(csvc, monkeypatch)
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: psvc.metrics["claims_parked"] == 1)
    time.sleep(0.2)  # polling would have asked again by now
    assert lookups[0] <= 1 and psvc.metrics["claims_parked"] == 1
    produced = prod.generate([prompt], max_tokens=1)[0]
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    assert psvc.metrics["claims_parked_granted"] == 1
    assert csvc.metrics["prefetch_parked_granted"] == 1 and csvc.metrics["prefetch_woken"] == 0
    got = continue_after(cons, prompt, produced[0], 3)
    assert got.error is None and [produced[0], *got.tokens] == mono
    assert csvc.metrics["prefetch_taken"] == 1 and csvc.metrics["claims_hit"] == 0
    assert got.connector_matched_tokens == len(prompt) // TPB * TPB
    assert wait_for(lambda: psvc.leases.active() == 0 and psvc.store.pinned_blocks() == 0)


def test_prefetches_wait_at_once_up_to_the_links_channels_and_the_rest_poll(monkeypatch):
    """Each waiting claim holds one of the link's ``WAIT_CHANNELS``; a prefetch that
    finds none free polls instead. Every one is granted once its blocks are held."""
    monkeypatch.setattr(links, "WAIT_CHANNELS", 2)
    prompts = [random_prompt(20 + i) for i in range(3)]
    prod, psvc = make_producer(CFG)
    cons, csvc = make_consumer(CFG, [psvc.endpoint])
    lookups = _count_lookups(csvc, monkeypatch)
    for p in prompts:
        assert start_prefetch(csvc, p, None) is None
    assert wait_for(lambda: psvc.metrics["claims_parked"] == 2 and lookups[0] >= 2)
    prod.generate(prompts, max_tokens=1)
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 3)
    assert csvc.metrics["prefetch_parked_granted"] >= 2
    assert psvc.leases.active() == 3
    csvc.close()  # gives every prefetched lease back
    assert wait_for(lambda: psvc.leases.active() == 0)


def test_a_waiting_claim_misses_at_its_deadline_and_is_asked_again(monkeypatch):
    """A claim waits at the producer at most ``PARK_S``: then it is answered with a miss
    (never a part of the keys: the blocks a shorter prompt left are not leased) and the
    prefetch asks again; a producer that never holds the blocks costs no lease."""
    monkeypatch.setattr(prefetch, "PARK_S", 0.2)
    prompt = random_prompt(17)
    prod, psvc = make_producer(CFG)
    prod.generate([prompt[: 2 * TPB]], max_tokens=1)  # the first two blocks only
    cons, csvc = make_consumer(CFG, [psvc.endpoint])
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: psvc.metrics["claims_parked"] >= 3)
    assert psvc.leases.active() == 0 and csvc.metrics["prefetch_granted"] == 0
    prod.generate([prompt], max_tokens=1)
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    assert psvc.leases.active() == 1
    csvc.close()  # gives the prefetched lease back
    assert wait_for(lambda: psvc.leases.active() == 0)


def test_a_take_waits_for_a_prefetch_only_within_the_claims_budget(monkeypatch):
    """A prefetch that cannot answer (its lookups stall) is abandoned once the claim's
    budget is spent: the continuation claims as usual; the prefetch's lease, if it
    comes, is released."""
    prompt = random_prompt(14)
    mono = Engine(CFG).generate([prompt], max_tokens=3)[0]
    prod, psvc = make_producer(CFG)
    prod.generate([prompt], max_tokens=1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint], claim_timeout_s=0.3)
    call = csvc._call

    def stalled(link, msg, background=False, **kw):
        if isinstance(msg, m.Lookup) and background:
            time.sleep(1.0)
        return call(link, msg, background=background, **kw)

    monkeypatch.setattr(csvc, "_call", stalled)
    assert start_prefetch(csvc, prompt, None) is None
    got = continue_after(cons, prompt, mono[0], 3)
    assert got.error is None and [mono[0], *got.tokens] == mono
    assert csvc.metrics["prefetch_late"] == 1 and csvc.metrics["claims_hit"] == 1
    assert wait_for(lambda: csvc.metrics["prefetch_abandoned"] == 1)
    assert wait_for(lambda: psvc.leases.active() == 0 and psvc.store.pinned_blocks() == 0)


def _count_lookups(csvc, monkeypatch) -> list[int]:
    """How many lookups the prefetch has had answered (background channel)."""
    seen = [0]
    call = csvc._call

    def spy(link, msg, background=False, **kw):
        out = call(link, msg, background=background, **kw)
        if isinstance(msg, m.Lookup) and background:
            seen[0] += 1
        return out

    monkeypatch.setattr(csvc, "_call", spy)
    return seen


def test_a_prefetch_no_continuation_takes_is_released_after_its_hold(monkeypatch):
    monkeypatch.setattr(prefetch, "PREFETCH_HOLD_S", 0.4)
    prompt = random_prompt(2)
    prod, psvc = make_producer(CFG)
    prod.generate([prompt], max_tokens=1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint], heartbeat_s=0.1)
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    assert psvc.leases.active() == 1 and psvc.store.pinned_blocks() == len(prompt) // TPB
    assert wait_for(lambda: psvc.leases.active() == 0, timeout=5)
    assert psvc.store.pinned_blocks() == 0
    assert csvc.metrics["prefetch_expired"] == 1 and not csvc.prefetches.leases()
    # a continuation after the release claims as usual
    mono = Engine(CFG).generate([prompt], max_tokens=3)[0]
    got = continue_after(cons, prompt, mono[0], 3)
    assert got.error is None and [mono[0], *got.tokens] == mono
    assert csvc.metrics["prefetch_taken"] == 0 and csvc.metrics["claims_hit"] == 1


def test_a_producer_dying_mid_prefill_while_the_consumer_prefetches(monkeypatch):
    """Chunked prefill: the first chunk's blocks are saved, the rest not yet planned, when
    the producer stops. The prefetch gets no lease (bounded by its wait); the continuation
    finds no producer and computes the prompt itself: the monolithic tokens."""
    monkeypatch.setattr(prefetch, "PREFETCH_WAIT_S", 1.0)
    prompt = random_prompt(3)
    mono = Engine(CFG).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(EngineConfig(**{**CFG.__dict__, "chunk_size": 2 * TPB}))
    cons, csvc = make_consumer(CFG, [psvc.endpoint], claim_timeout_s=0.5)
    prod.add_request(prompt, 1)
    prod.step()  # the first chunk
    assert 0 < psvc.store.longest_prefix(_keys(csvc, prompt)) < len(prompt) // TPB
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_started"] == 1)
    psvc.close()  # the producer dies mid-prefill
    assert wait_for(lambda: csvc.metrics["prefetch_missed"] == 1, timeout=8)
    assert not csvc.prefetches.leases()
    got = continue_after(cons, prompt, mono[0], 4)
    assert got.error is None and [mono[0], *got.tokens] == mono
    assert got.connector_matched_tokens == 0  # computed here


@pytest.mark.parametrize("line", [None, "cancel"], ids=["no-failed-load-reports", "reports"])
def test_a_producer_dying_after_the_prefetch_leased_its_blocks(line: str | None):
    """The lease is granted, then the producer stops unnoticed before any push: taking the
    lease confirms it first, finds the producer gone and claims afresh, a miss: the request
    is computed here (the monolithic tokens), on a runtime with failed-load reports or
    without."""
    prompt = random_prompt(4)
    mono = Engine(CFG).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(CFG)
    prod.generate([prompt], max_tokens=1)
    ccfg = EngineConfig(**{**CFG.__dict__, "runtime": line})
    cons, csvc = make_consumer(ccfg, [psvc.endpoint], claim_timeout_s=0.5, load_timeout_s=2.0)
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    psvc.close()
    got = continue_after(cons, prompt, mono[0], 4)
    assert csvc.metrics["prefetch_taken"] == 0 and csvc.metrics["prefetch_dropped_down"] == 1
    assert got.error is None and [mono[0], *got.tokens] == mono
    assert got.connector_matched_tokens == 0  # computed here


def test_a_lease_whose_producer_is_known_down_is_claimed_afresh():
    prompt = random_prompt(6)
    mono = Engine(CFG).generate([prompt], max_tokens=3)[0]
    prod, psvc = make_producer(CFG)
    prod.generate([prompt], max_tokens=1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint])
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    link = csvc.links[0]
    link.down_until = time.monotonic() + 30  # a call to it failed meanwhile
    got = continue_after(cons, prompt, mono[0], 3)
    link.down_until = 0.0
    assert csvc.metrics["prefetch_dropped_down"] == 1 and csvc.metrics["prefetch_taken"] == 0
    assert got.error is None and [mono[0], *got.tokens] == mono
    assert got.connector_matched_tokens == 0  # its only producer is down: computed here
    assert wait_for(lambda: psvc.leases.active() == 0)


def test_prefetch_declines_what_it_cannot_serve():
    prod, psvc = make_producer(CFG)
    prod.generate([random_prompt(5)], max_tokens=1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint])
    assert start_prefetch(csvc, random_prompt(5, TPB - 1), None) == "the prompt has no whole block"
    assert start_prefetch(csvc, random_prompt(5), None) is None
    assert start_prefetch(csvc, random_prompt(5), None) == "this prompt is being prefetched already"
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    assert csvc.prefetches.sweep(time.monotonic() + prefetch.PREFETCH_HOLD_S) == 1
    assert wait_for(lambda: psvc.leases.active() == 0)  # given back while the producer lives


def _keys(csvc: object, prompt: list[int]) -> object:
    from disagg.protocol.keys import block_key_blob

    n = len(prompt) // TPB
    return block_key_blob(csvc.namespace_seed(None), prompt[: n * TPB], TPB)  # type: ignore[attr-defined]


def test_a_request_offering_fewer_blocks_than_the_prefetch_claims_as_usual():
    """The plain path (no first token): a prompt of whole blocks offers one block fewer
    than its prefetch leased (the last prompt token is computed here), so the lease is not
    taken; the request claims its own, shorter one."""
    prompt = random_prompt(7, 96)
    mono = Engine(CFG).generate([prompt], max_tokens=3)[0]
    prod, psvc = make_producer(CFG)
    prod.generate([prompt], max_tokens=1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint])
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    got = cons.generate([prompt], max_tokens=3)[0]
    assert got == mono
    assert csvc.metrics["prefetch_taken"] == 0 and csvc.metrics["claims_hit"] == 1
    assert csvc.prefetches.sweep(time.monotonic() + prefetch.PREFETCH_HOLD_S) == 1
    assert wait_for(lambda: psvc.leases.active() == 0)


TP_CFG = {**SHAPE, "num_blocks": 128, "kv_manager": "v2", "num_heads": 4, "num_kv_heads": 4}


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
def test_unequal_tp_prefetches_every_producer_rank(p: int, d: int):
    """Producer TP 2 into consumer TP 1 and the reverse (4 KV heads): the prefetch leases
    the prompt on every producer rank; the continuation takes them all and loads each
    consumer rank's heads, token for token; every rank's lease goes back."""
    prompt = random_prompt(11)
    mono = Engine(EngineConfig(**TP_CFG)).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(EngineConfig(**TP_CFG, tp=p))
    cons, csvc = make_consumer(EngineConfig(**TP_CFG, tp=d), [rank_endpoints(psvc)])
    assert start_prefetch(csvc, prompt, None) is None
    first = run_one(prod, prompt, 1).tokens[0]
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    assert [s.leases.active() for s in rank_services(psvc)] == [1] * p
    got = continue_after(cons, prompt, first, 4)
    assert got.error is None and [first, *got.tokens] == mono
    assert got.connector_matched_tokens == len(prompt) // TPB * TPB
    assert csvc.metrics["prefetch_taken"] == 1 and csvc.metrics["claims_hit"] == 0
    for svc in rank_services(psvc):
        assert wait_for(lambda s=svc: s.leases.active() == 0), f"rank {svc.tp_rank}"


def test_a_prefetched_lease_one_producer_rank_lost_is_claimed_afresh():
    """Producer TP 2 into consumer TP 1: rank 1 no longer knows its prefetched lease (freed
    there): the continuation gives both back and claims afresh, token for token."""
    prompt = random_prompt(12)
    mono = Engine(EngineConfig(**TP_CFG)).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(EngineConfig(**TP_CFG, tp=2))
    cons, csvc = make_consumer(EngineConfig(**TP_CFG), [rank_endpoints(psvc)])
    first = run_one(prod, prompt, 1).tokens[0]
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    rank1 = rank_services(psvc)[1]
    assert rank1.leases.free_owner(csvc.owner) == 1
    got = continue_after(cons, prompt, first, 4)
    assert got.error is None and [first, *got.tokens] == mono
    assert csvc.metrics["prefetch_dropped_down"] == 1 and csvc.metrics["prefetch_taken"] == 0
    assert csvc.metrics["claims_hit"] == 1  # claimed afresh, on both ranks
    assert got.connector_matched_tokens == len(prompt) // TPB * TPB
    for svc in rank_services(psvc):
        assert wait_for(lambda s=svc: s.leases.active() == 0), f"rank {svc.tp_rank}"


def test_head_blind_tp_is_not_prefetched_and_says_so(monkeypatch):
    """TP without the model's KV head count: each rank's keys differ, so the prefetch
    declines (counted) and the continuation claims every rank itself."""
    monkeypatch.setattr("disagg.service_base.num_kv_heads_of", lambda llm_args: None)
    cfg = EngineConfig(**TP_CFG, tp=2)
    prompt = random_prompt(13)
    mono = Engine(cfg).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(cfg)
    cons, csvc = make_consumer(cfg, [rank_endpoints(psvc)])
    assert csvc.routes is None
    assert "TP without the model's KV head count" in start_prefetch(csvc, prompt, None)
    assert csvc.metrics["prefetch_declined_tp"] == 1 and csvc.metrics["prefetch_started"] == 0
    first = run_one(prod, prompt, 1).tokens[0]
    got = continue_after(cons, prompt, first, 4)
    assert got.error is None and [first, *got.tokens] == mono
    assert got.connector_matched_tokens > 0 and csvc.metrics["claims_hit"] == 1


def _renews(csvc, monkeypatch) -> list[bool]:
    """Each Renew the consumer sends from now on, as whether it went on the background
    channel (False: the engine thread's own)."""
    sent: list[bool] = []
    call = csvc._call

    def spy(link, msg, timeout_s=None, background=False):
        if isinstance(msg, m.Renew):
            sent.append(background)
        return call(link, msg, timeout_s, background)

    monkeypatch.setattr(csvc, "_call", spy)
    return sent


@pytest.mark.parametrize("fresh_s", [None, 0.0], ids=["fresh", "stale"])
def test_a_continuation_has_its_lease_confirmed_as_it_arrives(monkeypatch, fresh_s):
    """The serve handler asks the confirmation as the continuation arrives: the take
    uses that answer (no round trip on the engine's thread), unless the answer is older
    than AHEAD_FRESH_S, when the take asks again."""
    if fresh_s is not None:
        monkeypatch.setattr(prefetch, "AHEAD_FRESH_S", fresh_s)
    prompt = random_prompt(11)
    mono = Engine(CFG).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(CFG)
    prod.generate([prompt], max_tokens=1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint])
    assert not confirm_prefetch(csvc, prompt, None)  # nothing prefetched yet
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    renews = _renews(csvc, monkeypatch)
    assert confirm_prefetch(csvc, prompt, None)
    assert not confirm_prefetch(csvc, prompt, None)  # asked once
    got = continue_after(cons, prompt, mono[0], 4)
    assert got.error is None and [mono[0], *got.tokens] == mono
    assert csvc.metrics["prefetch_taken"] == 1 and csvc.metrics["prefetch_confirmed_ahead"] == 1
    assert got.connector_matched_tokens == len(prompt) // TPB * TPB
    assert renews == ([True] if fresh_s is None else [True, False])


def test_a_lease_confirmed_ahead_whose_producer_died_is_claimed_afresh(monkeypatch):
    prompt = random_prompt(12)
    mono = Engine(CFG).generate([prompt], max_tokens=4)[0]
    prod, psvc = make_producer(CFG)
    prod.generate([prompt], max_tokens=1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint], claim_timeout_s=0.5, load_timeout_s=2.0)
    assert start_prefetch(csvc, prompt, None) is None
    assert wait_for(lambda: csvc.metrics["prefetch_granted"] == 1)
    psvc.close()
    renews = _renews(csvc, monkeypatch)
    assert confirm_prefetch(csvc, prompt, None)
    got = continue_after(cons, prompt, mono[0], 4)
    assert renews == [True]  # the answer asked ahead refused it: not asked again
    assert csvc.metrics["prefetch_taken"] == 0 and csvc.metrics["prefetch_dropped_down"] == 1
    assert got.error is None and [mono[0], *got.tokens] == mono
    assert got.connector_matched_tokens == 0  # computed here
