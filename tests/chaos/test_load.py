"""Load: 2 producers x 2 consumers, 300 concurrent requests of mixed lengths sharing some
prefixes, each producer's store much smaller than the working set.

Checks (issue 5, Load): the store stays within its fixed slab (``used_blocks() <=
capacity``) and evicts; back-pressure shows as counted misses, evictions, dropped saves
and engine queueing, never as a hang (bounded loop) or a crash; every request's tokens
equal the monolithic run's. The counts are printed (``pytest -m load -s``).
"""

from __future__ import annotations

import itertools
import random
import time

import pytest
from harness import SHAPE

from disagg.consumer.service import _services as consumer_services
from disagg.engine.reference import ConnectorSpec, Engine, EngineConfig
from disagg.producer.service import _services as producer_services

pytestmark = [pytest.mark.load, pytest.mark.timeout(180)]

CFG = EngineConfig(**SHAPE)
N_REQUESTS = 300
STORE_SIZE = "1MiB"  # 256 blocks of 4 KiB per producer; the working set is ~20x that
DEADLINE_S = 120.0
_ids = itertools.count()


def workload(seed: int = 11) -> list[list[int]]:
    """Prompts of 32..600 tokens; most start with one of 8 shared prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(512) for _ in range(rng.randrange(16, 256))] for _ in range(8)]
    out = []
    for _ in range(N_REQUESTS):
        n = rng.randrange(32, 601)
        head = rng.choice(prefixes)[:n] if rng.random() < 0.8 else []
        out.append(head + [rng.randrange(512) for _ in range(n - len(head))])
    return out


@pytest.fixture(autouse=True)
def _close_services():
    yield
    for svc in [*producer_services.values(), *consumer_services.values()]:
        svc.close()


def engine(role: str, section: dict) -> tuple[Engine, object]:
    name = f"load-{role[0]}{next(_ids)}"
    conf = {"role": role, "instance_id": name, role: section}
    eng = Engine(
        CFG,
        ConnectorSpec(
            f"disagg.{role}",
            f"{role.capitalize()}Scheduler",
            f"{role.capitalize()}Worker",
            extra={"config": conf},
        ),
    )
    services = producer_services if role == "producer" else consumer_services
    return eng, services[name]


def test_two_by_two_under_memory_pressure():
    prompts = workload()
    t0 = time.monotonic()
    mono = Engine(CFG).generate(prompts, max_tokens=2)
    t_mono = time.monotonic() - t0

    producers = [
        engine("producer", {"control": "tcp://127.0.0.1:0", "store_size": STORE_SIZE})
        for _ in range(2)
    ]
    endpoints = [svc.endpoint for _, svc in producers]
    consumers = [
        engine("consumer", {"producers": endpoints, "claim_timeout_s": 1.0, "load_timeout_s": 20})
        for _ in range(2)
    ]
    # producers prefill their half; each consumer serves a mix of both halves, added in
    # waves so some claims find the prefix stored, some find it evicted or not yet saved
    for i, p in enumerate(prompts):
        producers[i % 2][0].add_request(p, 1)
    waves = [list(range(k, min(k + 60, N_REQUESTS))) for k in range(0, N_REQUESTS, 60)]
    ids: dict[int, tuple[Engine, int]] = {}
    t0 = time.monotonic()
    rounds = 0
    peak_used = [0, 0]
    while True:
        if waves and rounds % 3 == 0:
            for i in waves.pop(0):
                eng = consumers[(i // 2) % 2][0]
                ids[i] = (eng, eng.add_request(prompts[i], 2))
        busy = [e for e, _ in [*producers, *consumers] if e.has_work()]
        if not busy and not waves:
            break
        assert time.monotonic() - t0 < DEADLINE_S, "the 2x2 deployment hangs"
        for e in busy:
            e.step()
        for k, (_, svc) in enumerate(producers):
            used = svc.store.used_blocks()
            assert used <= svc.store.capacity  # the slab is fixed; the index never outgrows it
            peak_used[k] = max(peak_used[k], used)
        rounds += 1
    took = time.monotonic() - t0

    results = [ids[i][0].results[ids[i][1]] for i in range(N_REQUESTS)]
    errors = [(i, r.error) for i, r in enumerate(results) if r.error]
    assert errors == []
    wrong = [i for i, r in enumerate(results) if r.tokens != mono[i]]
    assert wrong == [], f"{len(wrong)} request(s) differ from monolithic"

    for _, svc in producers:
        end = time.monotonic() + 10
        while svc.leases.active() and time.monotonic() < end:
            time.sleep(0.05)
        assert svc.leases.active() == 0 and svc.store.pinned_blocks() == 0
        assert svc.store.verify() == 0
    stats = [svc.store.stats for _, svc in producers]
    assert sum(s.evictions for s in stats) > 0, "the store never filled: not a pressure test"

    c_metrics = [svc.metrics for _, svc in consumers]
    p_metrics = [svc.metrics for _, svc in producers]
    report = {
        "requests": N_REQUESTS,
        "seconds": round(took, 1),
        "monolithic_seconds": round(t_mono, 1),
        "rounds": rounds,
        "store_capacity_blocks": [svc.store.capacity for _, svc in producers],
        "store_peak_used_blocks": peak_used,
        "evictions": [s.evictions for s in stats],
        "saves_dropped_full": [s.saves_dropped_full for s in stats],
        "saves_deduplicated": [s.saves_deduplicated for s in stats],
        "producer_claims_hit": [m["claims_hit"] for m in p_metrics],
        "producer_claims_miss": [m["claims_miss"] for m in p_metrics],
        "pushes_done": [m["pushes_done"] for m in p_metrics],
        "pushes_failed": [m["pushes_failed"] for m in p_metrics],
        "consumer_claims_hit": [m["claims_hit"] for m in c_metrics],
        "consumer_claims_miss": [m["claims_miss"] for m in c_metrics],
        "loads_done": [m["loads_done"] for m in c_metrics],
        "loads_failed": [m["loads_failed"] for m in c_metrics],
        "connector_matched_tokens": sum(r.connector_matched_tokens for r in results),
        "engine_iterations_consumers": [e.stats.iterations for e, _ in consumers],
    }
    print("\nload report:", report)
    assert sum(m["claims_miss"] for m in c_metrics) > 0  # pressure shows as counted misses
    assert sum(m["loads_done"] for m in c_metrics) > 0  # and the hits still load
    assert sum(m["loads_failed"] for m in c_metrics) == 0
