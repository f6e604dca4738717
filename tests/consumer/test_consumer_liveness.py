"""Consumer liveness: renewals follow the granted TTL, the keepalive outlives a bad pass,
request-level errors do not mark a producer down, and engine-thread calls are bounded."""

from __future__ import annotations

import random
import time

import pytest
from harness import SHAPE, close_all_services, make_consumer, make_producer

from disagg.consumer.service import _PEER_FAULTS, ProducerLink
from disagg.engine.reference import EngineConfig
from disagg.protocol.errors import ErrorCode, ProtocolError

CFG = EngineConfig(**{**SHAPE, "num_blocks": 128})


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


class _Req:
    def __init__(self, rid, tokens):
        self.request_id, self._t, self.prompt_len, self.cache_salt = rid, tokens, len(tokens), None

    def get_tokens(self, beam=0):
        return self._t


def _setup(producer_extra: dict, consumer_extra: dict):
    rng = random.Random(3)
    prompt = [rng.randrange(512) for _ in range(96)]
    prod, psvc = make_producer(CFG, **{"store_size": "4MiB", **producer_extra})
    prod.generate([prompt], max_tokens=1)
    cons, csvc = make_consumer(CFG, [psvc.endpoint], **{"claim_timeout_s": 0.5, **consumer_extra})
    return prompt, psvc, cons, csvc


def test_renewals_follow_the_ttl_the_producer_granted():
    """The producer caps leases at 0.6 s; the consumer's own settings (heartbeat 5 s) would
    let them expire between heartbeats. A live owner must keep its lease anyway."""
    prompt, psvc, cons, csvc = _setup({"lease_ttl_s": 0.6, "owner_dead_after_s": 5.0}, {})
    sched = cons.driver.scheduler
    req = _Req(50_001, prompt)
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    assert n > 0 and psvc.leases.active() == 1
    time.sleep(2.0)  # > 3 granted TTLs
    assert psvc.leases.active() == 1, "a live owner's lease expired"
    assert csvc.metrics["leases_renewed"] >= 3
    sched.request_finished(req, [])
    end = time.monotonic() + 3
    while psvc.leases.active() and time.monotonic() < end:
        time.sleep(0.02)
    assert psvc.leases.active() == 0 and psvc.store.pinned_blocks() == 0


def test_keepalive_outlives_a_failing_pass():
    prompt, psvc, cons, csvc = _setup(
        {"lease_ttl_s": 1.0, "owner_dead_after_s": 0.6}, {"heartbeat_s": 0.2, "lease_ttl_s": 1.0}
    )
    boom = {"n": 0}
    renew = csvc.keepalive.renew_held

    def flaky():
        boom["n"] += 1
        if boom["n"] <= 2:
            raise RuntimeError("injected keepalive failure")
        renew()

    csvc.keepalive.renew_held = flaky  # type: ignore[method-assign]
    req = _Req(50_002, prompt)
    assert cons.driver.scheduler.get_num_new_matched_tokens(req, 0)[0] > 0
    time.sleep(2.5)
    assert boom["n"] > 2 and psvc.leases.active() == 1


@pytest.mark.parametrize(
    "code,down",
    [
        (ErrorCode.TIMEOUT, True),
        (ErrorCode.PEER_GONE, True),
        (ErrorCode.UNKNOWN_LEASE, False),
        (ErrorCode.FOREIGN_LEASE, False),
        (ErrorCode.OUT_OF_RANGE, False),
        (ErrorCode.UNAUTHENTICATED, False),
    ],
)
def test_only_peer_faults_mark_a_producer_down(code, down):
    link = ProducerLink("tcp://127.0.0.1:9", "me", 0.1)
    link.fg.ready = True

    class Client:
        def call(self, msg, timeout_s=None):
            raise ProtocolError(code, "x")

    link.fg.client = Client()  # type: ignore[assignment]
    with pytest.raises(ProtocolError):
        link.call(link.fg, object(), None, "", 0.1)  # type: ignore[arg-type]
    assert link.usable() is (not down)
    assert link.fg.ready is (code not in _PEER_FAULTS and code is not ErrorCode.UNAUTHENTICATED)


def test_engine_thread_claim_is_bounded_while_the_link_is_busy():
    prompt, psvc, cons, csvc = _setup({}, {})
    link = csvc.links[0]
    link.fg.lock.acquire()  # e.g. a lookup thread stuck on a dying producer
    try:
        t0 = time.monotonic()
        n, _ = cons.driver.scheduler.get_num_new_matched_tokens(_Req(50_003, prompt), 0)
        took = time.monotonic() - t0
    finally:
        link.fg.lock.release()
    assert n == 0 and took < 1.5  # a miss within claim_timeout_s, never a hang
    assert csvc.metrics["claims_failed"] == 1
