"""One dead consumer must not stall the producer's pushes to every other consumer (the
peer bug, TensorRT-LLM issue #12640: one dead decode instance stalls transfers to all).

Consumer A runs in its own process: it claims ``N_DEAD`` prompts and asks for their
pushes, but its data receiver is gone (closed before any push, then the process is
killed), so each push to it can only end at the producer's push deadline. That is more
pushes in flight than the producer has push workers. Consumer B then loads from the same
producer: its loads must complete at once (far below ``push_timeout_s``) with the
monolithic run's tokens and pages, while A's pushes keep their rows pinned until they are
final (never unpinned early: the data plane may still read them), and everything returns
to baseline once they fail at their deadline.

The same holds for pushes that wait for blocks still being saved (they wait without a push
worker, and go once the saves land), for a push whose blocks are never saved (it fails at
push_timeout_s), and for close() (every push in flight ends, failed and unpinned).
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest
from harness import (
    SHAPE,
    check_against_monolithic,
    close_all_services,
    make_consumer,
    make_producer,
    prompts,
    run,
    wait_for,
)
from test_chaos import Child

from disagg.engine.reference import Engine, EngineConfig

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]

CFG = EngineConfig(**SHAPE, capture_pages=True)
N_DEAD = 20  # pushes in flight to the dead consumer: more than the producer's 16 workers
PUSH_TIMEOUT_S = 6.0
LOAD_WITHIN_S = 2.5  # each of consumer B's loads, dispatch to landed: far below the timeout
LEASE_TTL_S = 1.0
OWNER_DEAD_S = 0.6
MAX_TOKENS = 4
PROMPTS_B = prompts(n=3, length=300, seed=7)
_ids = itertools.count()


def dead_prompts(n: int = N_DEAD, length: int = 64, seed: int = 13) -> list[list[int]]:
    """Prompts sharing no block (so each is claimed and pushed on its own)."""
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(length)] for _ in range(n)]


def timed_loads(csvc: Any) -> dict[int, float]:
    """Seconds from each load's dispatch (the consumer asks for its push) until the engine
    sees it landed, by request id (filled in as the consumer's engine runs)."""
    started: dict[int, float] = {}
    took: dict[int, float] = {}
    dispatch, poll = csvc.dispatch, csvc.poll

    def timed_dispatch(load: Any, layerwise: bool = False) -> None:
        started[load.request_id] = time.monotonic()
        dispatch(load, layerwise)

    def timed_poll(load: Any) -> bool:
        done = poll(load)
        if done and load.request_id in started and load.request_id not in took:
            took[load.request_id] = time.monotonic() - started[load.request_id]
        return done

    csvc.dispatch, csvc.poll = timed_dispatch, timed_poll
    return took


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


@pytest.fixture
def children():
    made: list[Child] = []

    def spawn(spec: dict[str, Any]) -> Child:
        made.append(Child(spec))
        return made[-1]

    yield spawn
    for c in made:
        c.close()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_dead_consumer_does_not_stall_pushes_to_others(children, transport):
    prod, psvc = make_producer(
        CFG,
        transport=transport,
        lease_ttl_s=LEASE_TTL_S,
        owner_dead_after_s=OWNER_DEAD_S,
        push_timeout_s=PUSH_TIMEOUT_S,
    )
    produced = run(prod, PROMPTS_B, 1)
    run(prod, dead_prompts(), 1)
    used = psvc.store.used_blocks()
    mono = Engine(CFG).generate(PROMPTS_B, max_tokens=MAX_TOKENS)

    # A: claims every prompt and asks for its pushes, with nobody receiving them
    conf = {
        "role": "consumer",
        "instance_id": f"dead{next(_ids)}",
        "transport": transport,
        "consumer": {
            "producers": [psvc.endpoint],
            "claim_timeout_s": 3.0,
            "load_timeout_s": 2 * PUSH_TIMEOUT_S,
            "heartbeat_s": 0.2,
            "lease_ttl_s": LEASE_TTL_S,
        },
    }
    a = children({"role": "consumer", "config": conf, "prompts": dead_prompts(), "dead_data": 1})
    a.expect("ready")
    a.send("run")
    assert wait_for(lambda: psvc.metrics["control_Push"] >= N_DEAD, 20), (
        f"consumer A asked for {psvc.metrics['control_Push']} pushes, not {N_DEAD}"
    )
    pushed_at = time.monotonic()
    a.kill()

    # B: a healthy consumer of the same producer
    cons, csvc = make_consumer(
        CFG,
        [psvc.endpoint],
        transport=transport,
        load_timeout_s=3 * PUSH_TIMEOUT_S,  # generous: a stall shows as time, not an error
        heartbeat_s=0.2,
        lease_ttl_s=LEASE_TTL_S,
    )
    loads = timed_loads(csvc)
    consumed = run(cons, PROMPTS_B, MAX_TOKENS)
    print(f"{transport}: consumer B's loads took {sorted(round(t, 3) for t in loads.values())}s")
    check_against_monolithic(produced, consumed, mono)
    assert len(loads) == len(PROMPTS_B)
    assert max(loads.values()) < LOAD_WITHIN_S, (
        f"consumer B's loads took {max(loads.values()):.2f}s behind {N_DEAD} pushes to a "
        f"dead consumer (push_timeout_s={PUSH_TIMEOUT_S})"
    )
    # (the producer learns of B's pushes' end just after B does: ipc acks its copies)
    assert wait_for(lambda: psvc.metrics["pushes_done"] == len(PROMPTS_B), 2.0)

    # A's pushes are not final yet: they still pin their rows, none failed early
    assert psvc.metrics["pushes_failed"] == 0
    assert psvc.store.pinned_blocks() > 0

    # ... until they fail at their deadline; then every lease and pin is gone
    assert wait_for(
        lambda: psvc.store.pinned_blocks() == 0 and psvc.leases.active() == 0,
        PUSH_TIMEOUT_S + 2.0 + 5.0,
    ), f"leases {psvc.leases.active()}, pinned {psvc.store.pinned_blocks()}"
    assert time.monotonic() - pushed_at >= PUSH_TIMEOUT_S - 1.0, "unpinned before final"
    assert psvc.metrics["pushes_failed"] == psvc.metrics["control_Push"] - len(PROMPTS_B)
    assert psvc.store.used_blocks() == used
    assert psvc.store.verify() == 0
    assert psvc.health() == (True, "")


def test_pushes_waiting_for_saves_do_not_hold_the_push_workers():
    """Pushes of blocks still being saved wait (for the commit, or push_timeout_s) without
    a push worker each: with more of them than workers, another consumer's pushes of
    stored blocks still go at once; once the saves land, the waiting pushes go too."""
    prod, psvc = make_producer(CFG, push_timeout_s=PUSH_TIMEOUT_S, save_timeout_s=60.0)
    produced = run(prod, PROMPTS_B, 1)
    held: list[list[bytes]] = []
    commit = psvc.store.commit
    psvc.store.commit = lambda keys: held.append(list(keys))  # saved, never committed
    slow = dead_prompts()
    produced_a = run(prod, slow, 1)
    assert held

    # A claims blocks that are still being saved and asks for their pushes
    cons_a, _ = make_consumer(CFG, [psvc.endpoint], load_timeout_s=3 * PUSH_TIMEOUT_S)
    ids_a = [cons_a.add_request(p, 2) for p in slow]
    cons_a.step()
    assert wait_for(lambda: psvc.metrics["control_Push"] >= N_DEAD, 10)

    cons_b, csvc_b = make_consumer(CFG, [psvc.endpoint], load_timeout_s=3 * PUSH_TIMEOUT_S)
    loads = timed_loads(csvc_b)
    consumed = run(cons_b, PROMPTS_B, MAX_TOKENS)
    print(f"consumer B's loads took {sorted(round(t, 3) for t in loads.values())}s")
    check_against_monolithic(produced, consumed, Engine(CFG).generate(PROMPTS_B, MAX_TOKENS))
    assert len(loads) == len(PROMPTS_B)
    assert max(loads.values()) < LOAD_WITHIN_S, (
        f"consumer B's loads took {max(loads.values()):.2f}s behind {N_DEAD} waiting pushes"
    )
    assert psvc.metrics["pushes_failed"] == 0

    # the saves land: A's pushes are posted at once, with the right pages
    psvc.store.commit = commit
    t0 = time.monotonic()
    for keys in held:
        commit(keys)
    while cons_a.has_work():
        assert time.monotonic() - t0 < PUSH_TIMEOUT_S / 2, "A's pushes did not go once saved"
        cons_a.step()
    check_against_monolithic(
        produced_a, [cons_a.results[i] for i in ids_a], Engine(CFG).generate(slow, 2)
    )
    assert wait_for(lambda: psvc.metrics["pushes_done"] == N_DEAD + len(PROMPTS_B), 2.0)
    assert wait_for(lambda: psvc.store.pinned_blocks() == 0 and psvc.leases.active() == 0)


def test_push_of_blocks_never_saved_fails_at_push_timeout():
    """The watcher ends a push whose blocks are never saved at push_timeout_s (TimeoutError,
    counted, its pins given back); the consumer's load fails by name, never silently."""
    prod, psvc = make_producer(CFG, push_timeout_s=1.0, save_timeout_s=60.0)
    psvc.store.commit = lambda keys: None  # saved, never committed
    ps = PROMPTS_B[:1]
    run(prod, ps, 1)
    cons, _ = make_consumer(
        CFG, [psvc.endpoint], load_timeout_s=3.0, on_load_failure="fail_request"
    )
    t0 = time.monotonic()
    (res,) = run(cons, ps, MAX_TOKENS)
    assert psvc.metrics["pushes_failed"] == 1 and psvc.metrics["pushes_done"] == 0
    assert res.error is not None and "KV cache load failed" in res.error, res.error
    assert time.monotonic() - t0 < 3.0 + 2.0
    assert wait_for(lambda: psvc.store.pinned_blocks() == 0 and psvc.leases.active() == 0)


def test_close_ends_every_push_in_flight():
    """close(): a push posted to a dead receiver and one waiting for its blocks both end
    (failed, unpinned) at once, and the push watcher stops."""
    prod, psvc = make_producer(CFG, push_timeout_s=30.0, save_timeout_s=60.0)
    run(prod, PROMPTS_B[:1], 1)
    commit = psvc.store.commit
    psvc.store.commit = lambda keys: None  # the second prompt's blocks are never saved
    run(prod, PROMPTS_B[1:2], 1)
    dead, dead_svc = make_consumer(CFG, [psvc.endpoint], load_timeout_s=60.0)
    dead_svc.data.close()  # its pushes are posted, never delivered
    dead.add_request(PROMPTS_B[0], MAX_TOKENS)
    dead.step()
    waits, _ = make_consumer(CFG, [psvc.endpoint], load_timeout_s=60.0)
    waits.add_request(PROMPTS_B[1], MAX_TOKENS)
    waits.step()
    assert wait_for(lambda: psvc.metrics["control_Push"] == 2)
    assert wait_for(lambda: len(psvc._push_posted) == 1 and len(psvc._push_waiting) == 1)
    psvc.store.commit = commit
    watcher = psvc._watcher
    psvc.close()
    assert wait_for(lambda: psvc.metrics["pushes_failed"] == 2, 2.0)
    assert psvc._push_jobs == set()
    watcher.join(2.0)
    assert not watcher.is_alive()
