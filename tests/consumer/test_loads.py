"""A load's state machine (``disagg.consumer.loads``): the table refuses every transition it
does not list, every waiting state names its bound, and each way a load can time out ends
in a failure state with its transfer aborted and its lease released."""

from __future__ import annotations

import pickle
import random
import time
from typing import Any

import pytest
from harness import SHAPE, close_all_services, make_consumer, make_producer, wait_for

from disagg.consumer import loads
from disagg.consumer.loads import (
    FAILURES,
    OVER,
    TIMEOUTS,
    TRANSITIONS,
    Claimed,
    Load,
    LoadState,
    LoadStateError,
)
from disagg.consumer.metadata import (
    BusAddress,
    ConsumerMeta,
    LoadFailure,
    LoadPlan,
    LoadStart,
    PrefixFailure,
    PrefixPlan,
    PrefixStart,
)
from disagg.consumer.rank_bus import RankBus, RankState
from disagg.engine import SchedulerOutput
from disagg.engine.reference import EngineConfig
from disagg.protocol import messages as m
from disagg.transport.dataplane import TransferState

S = LoadState
CFG = EngineConfig(**{**SHAPE, "num_blocks": 128})
ILLEGAL = [(a, b) for a in S for b in S if b not in TRANSITIONS[a]]


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


def _load(state: LoadState = S.CLAIMED) -> Load:
    load = Load(7, Claimed(None, 1, 3), first_block=0)  # type: ignore[arg-type]
    load.state = state  # placed directly: only the table is under test here
    return load


# -- the table ------------------------------------------------------------------------------
@pytest.mark.parametrize("src,dst", ILLEGAL, ids=lambda s: s.name)
def test_a_transition_the_table_does_not_list_is_refused_loudly(src, dst):
    load = _load(src)
    with pytest.raises(LoadStateError, match=f"{src.name} -> {dst.name}"):
        load.transition(dst, "why")
    assert load.state is src  # unchanged


def test_every_state_has_a_row_and_final_states_lead_nowhere():
    assert set(TRANSITIONS) == set(S)
    assert TRANSITIONS[S.AGREED] == TRANSITIONS[S.REJECTED] == frozenset()
    # once over, a load never goes back to a state that may write into its pages
    for state in OVER:
        assert not TRANSITIONS[state] - OVER, state


def test_a_failure_state_needs_its_reason():
    for state in FAILURES:
        src = next(a for a in S if state in TRANSITIONS[a])
        with pytest.raises(LoadStateError, match="needs why"):
            _load(src).transition(state)
    load = _load(S.DISPATCHED)
    load.transition(S.FAILED, "no pages within load_timeout_s=1")
    assert load.over and load.error == "no pages within load_timeout_s=1"


def test_every_waiting_state_names_what_bounds_it():
    waiting = {a for a in S if a not in OVER} | {S.LANDED}  # LANDED waits for the ranks (TP)
    assert set(TIMEOUTS) == waiting
    head = "\n".join((loads.__doc__ or "").splitlines()[:40])
    for state in S:
        assert state.name in head, f"{state.name} missing from the state diagram"
    assert "load_timeout_s" in head and "PEER_GRACE_S" in head and "ORPHAN_AFTER" in head


def test_a_plan_starts_planned():
    load = Load(7, Claimed(None, 1, 3), 0, [[1, 2, 3]])  # type: ignore[arg-type]
    assert load.state is S.PLANNED and not load.started and not load.over


# -- timeouts, against a real producer ----------------------------------------------------
class _Req:
    def __init__(self, rid: int, tokens: list[int]):
        self.request_id, self._t, self.prompt_len, self.cache_salt = rid, tokens, len(tokens), None

    def get_tokens(self, beam: int = 0) -> list[int]:
        return self._t


def _claim(rid: int, **consumer: Any) -> tuple[Any, Any, Any, _Req, Load]:
    """A producer holding a prompt, and a consumer that claimed it (CLAIMED)."""
    prompt = [random.Random(rid).randrange(512) for _ in range(96)]
    prod, psvc = make_producer(CFG, store_size="4MiB")
    prod.generate([prompt], max_tokens=1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint], **consumer)
    sched = cons.driver.scheduler
    req = _Req(rid, prompt)
    assert sched.get_num_new_matched_tokens(req, 0)[0] > 0 and psvc.leases.active() == 1
    load = csvc.loads[rid]
    assert load.state is S.CLAIMED
    return psvc, csvc, sched, req, load


def _claimed_load(monkeypatch: Any, rid: int, **consumer: Any) -> tuple[Any, Any, Any, Load]:
    """``_claim``, then allocated (PLANNED: slots known), with a control channel that never
    delivers a Push: the producer sends no page, ever."""
    psvc, csvc, sched, req, load = _claim(rid, **consumer)
    sched.update_state_after_alloc(req, list(range(10, 10 + len(req._t) // CFG.tokens_per_block)))
    assert load.state is S.PLANNED
    real = csvc._call

    def no_push(link: Any, msg: Any, *a: Any, **k: Any) -> Any:
        return None if isinstance(msg, m.Push) else real(link, msg, *a, **k)

    monkeypatch.setattr(csvc, "_call", no_push)
    return psvc, csvc, sched, load


class _Shorter:
    """A config section with some settings changed (whatever type the section is)."""

    def __init__(self, base: Any, **changed: Any):
        self._base, self._changed = base, changed

    def __getattr__(self, name: str) -> Any:
        return self._changed[name] if name in self._changed else getattr(self._base, name)


def _ends_failed_and_released(psvc: Any, csvc: Any, load: Load) -> None:
    assert load.state is S.FAILED and load.error
    assert csvc.metrics["loads_failed"] == 1
    # aborted: the plane holds it failed, and nothing of it may land any more
    assert csvc.data.poll(load.transfer_id).state is TransferState.FAILED
    assert csvc.health() == (True, "")
    csvc.settle(load)  # the worker took the outcome: the lease goes back
    assert load.claimed.released and load.request_id not in csvc.loads
    assert wait_for(lambda: psvc.leases.active() == 0), "the lease was not released"


def test_async_load_past_its_deadline_ends_failed_and_released(monkeypatch):
    psvc, csvc, _, load = _claimed_load(monkeypatch, 61_001, load_timeout_s=0.5)
    csvc.dispatch(load)
    assert load.state is S.DISPATCHED and load.started
    assert wait_for(lambda: csvc.poll(load), 10), "the plane's deadline never ended the load"
    _ends_failed_and_released(psvc, csvc, load)


def test_sync_wait_past_its_deadline_ends_failed_and_released(monkeypatch):
    psvc, csvc, _, load = _claimed_load(monkeypatch, 61_002, load_timeout_s=30.0)
    csvc.dispatch(load)
    # the synchronous wait's own bound, shorter than the plane's deadline set at dispatch
    monkeypatch.setattr(csvc, "ccfg", _Shorter(csvc.ccfg, load_timeout_s=0.3))
    t0 = time.monotonic()
    csvc.wait(load)  # bounded by load_timeout_s, not the plane's (longer) deadline
    assert time.monotonic() - t0 < 5
    assert "no pages within load_timeout_s=0.3" in (load.error or "")
    _ends_failed_and_released(psvc, csvc, load)


def test_layerwise_wait_past_its_deadline_ends_failed_and_released(monkeypatch):
    psvc, csvc, _, load = _claimed_load(monkeypatch, 61_003, load_timeout_s=30.0)
    csvc.dispatch(load, layerwise=True)
    assert load.layer_marks is not None
    load.deadline = time.monotonic() + 0.3
    csvc.wait_layer(load, max(load.layer_marks))  # the last layer never comes
    assert "no pages within load_timeout_s" in (load.error or "")
    _ends_failed_and_released(psvc, csvc, load)


def test_a_request_ending_while_its_load_lands_abandons_it(monkeypatch):
    psvc, csvc, sched, load = _claimed_load(monkeypatch, 61_004, load_timeout_s=30.0)
    csvc.dispatch(load)
    sched.request_reset(_Req(61_004, []))  # e.g. a replay: the pages are freed at once
    assert load.state is S.ABANDONED and "ended before its pages landed" in (load.error or "")
    assert csvc.data.poll(load.transfer_id).state is TransferState.FAILED  # aborted
    assert csvc.metrics["loads_abandoned"] == 1
    assert wait_for(lambda: psvc.leases.active() == 0), "the lease was not released"


def test_a_claim_never_allocated_is_orphaned_and_released():
    psvc, csvc, sched, _, load = _claim(61_005)
    for _ in range(loads.ORPHAN_AFTER):
        sched.build_connector_meta(SchedulerOutput())
        assert load.state is S.CLAIMED and 61_005 in csvc.loads
    sched.build_connector_meta(SchedulerOutput())
    assert 61_005 not in csvc.loads and load.claimed.released
    assert csvc.metrics["claims_orphaned"] == 1
    assert wait_for(lambda: psvc.leases.active() == 0), "the lease was not released"


def test_no_page_allocated_is_refused_and_told_once():
    psvc, csvc, sched, req, load = _claim(61_006)
    sched.update_state_after_alloc(req, [-1] * len(req._t))
    assert load.state is S.REFUSED and not load.started and load.over
    meta = sched.build_connector_meta(SchedulerOutput())
    why = "the engine allocated no page for the claimed blocks"
    assert meta.failed == [LoadFailure(61_006, why)] and meta.loads == []
    assert sched.build_connector_meta(SchedulerOutput()).failed == []  # once
    sched.request_finished(req, [])
    assert wait_for(lambda: psvc.leases.active() == 0), "the lease was not released"


def test_a_rank_silent_past_the_grace_rejects_a_landed_load(monkeypatch):
    """TP > 1: LANDED here waits for every rank's outcome until load_timeout_s +
    PEER_GRACE_S; a rank silent past it makes the verdict REJECTED (final, counted once)."""
    cons, csvc = make_consumer(CFG, ["tcp://127.0.0.1:9"])
    bus = RankBus(0, 2, lambda: False)
    try:
        monkeypatch.setattr(csvc, "bus", bus)
        load = Load(8, Claimed(csvc.links[0], 1, 3), 0, [[1, 2, 3]], uid=99)
        load.state = S.LANDED
        bus.record(99, 0, "")  # our rank landed it
        load.deadline = time.monotonic() - 10  # and the grace is over
        err = csvc.rank_decision(load, None, wait=True)
        assert err and "rank(s) [1] reported no outcome" in err
        assert load.state is S.REJECTED and load.error == err
        assert csvc.rank_decision(load, None, wait=False) == err  # decided: not counted again
        assert csvc.metrics["rank_outcome_timeouts"] == 1
        csvc.settle(load)
        assert load.claimed.released
    finally:
        bus.close()


def test_every_rank_landed_is_agreed():
    cons, csvc = make_consumer(CFG, ["tcp://127.0.0.1:9"])
    bus = RankBus(0, 2, lambda: False)
    try:
        csvc.bus = bus
        load = Load(9, Claimed(csvc.links[0], 1, 3), 0, [[1, 2, 3]], uid=100)
        load.state = S.LANDED
        load.deadline = time.monotonic() + 5
        bus.record(100, 0, "")
        assert csvc.rank_decision(load, None, wait=False) is None  # rank 1 not heard yet
        with bus.cond:  # rank 1's state, as the hub would merge it
            bus._table[100][1] = RankState(0, "")
        assert csvc.rank_decision(load, None, wait=False) == ""
        assert load.state is S.AGREED
    finally:
        csvc.bus = None
        bus.close()


# -- the metadata ----------------------------------------------------------------------------
def test_the_metadata_survives_a_pickle_round_trip():
    meta = ConsumerMeta(
        scheduled=[1, 2],
        loads=[LoadStart(1), LoadStart(2, LoadPlan(0, [5, 6], 3, 0, [[1, 2, 3]], 77, [1, 2]))],
        failed=[LoadFailure(3, "no page")],
        dropped=[4],
        prefix_loads=[
            PrefixStart(10, True),
            PrefixStart(11, False, PrefixPlan(5, 0, [7, 8], 4, 1, 0, 2, [[9, 10]], 78, [1, 2])),
        ],
        prefix_failed=[PrefixFailure(12, 6, "refused")],
        prefix_dropped=[13],
        bus=BusAddress("tcp://127.0.0.1:1", b"\x00" * 16),
    )
    assert pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)) == meta
    assert ConsumerMeta().loads == [] and ConsumerMeta().loads is not ConsumerMeta().loads
