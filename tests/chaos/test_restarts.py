"""A producer restarted (kill -9, then started again on the same endpoint) or paused
(SIGSTOP) while two consumers hold leases on it (issue 25).

- Lease ids and incarnations: a restarted producer is a new incarnation; whatever the
  consumers held with the old one is dropped on their side and refused by name on the
  producer's (STALE_INCARNATION), so no release or push of the dead process's leases ever
  frees or reads a lease of the live one;
- the first call on each consumer channel after the restart succeeds (re-Hello and one
  retry within the call's deadline): a claim is a hit, not a miss;
- a producer that was itself stopped gives its owners a fresh grace period on resume, so
  their live leases survive its pause.

Timeouts as in test_chaos.py (leases 1 s, owner dead after 0.6 s, heartbeats 0.2 s), but
for the own pause (see PAUSE_TTL_S).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from test_chaos import (
    PROMPTS,
    _ids,
    check_outcomes,
    children,  # noqa: F401 - the fixture
    consumer_conf,
    in_process,
    mono,  # noqa: F401 - the fixture
    producer_conf,
    run_consumer,
    wait_for,
)

from disagg.bench.ports import free_port
from disagg.protocol import messages as m
from disagg.protocol.errors import ErrorCode, ProtocolError
from disagg.transport import ControlClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(90)]


class _Req:
    """What the consumer scheduler reads of a request."""

    def __init__(self, rid: int, tokens: list[int]):
        self.request_id, self._t, self.prompt_len, self.cache_salt = rid, tokens, len(tokens), None

    def get_tokens(self, beam: int = 0) -> list[int]:
        return self._t


def _hold(eng: Any, rid: int, tokens: list[int]) -> _Req:
    """Claim ``tokens`` (a lease, renewed by the keepalive; no push is ever asked)."""
    req = _Req(rid, tokens)
    n, _ = eng.driver.scheduler.get_num_new_matched_tokens(req, 0)
    assert n > 0, f"request {rid} missed"
    return req


def _state(child: Any) -> dict[str, Any]:
    child.send("state")
    return child.expect("state")


def test_restart_with_leases_held_by_two_consumers(children, mono):  # noqa: F811
    control = f"tcp://127.0.0.1:{free_port()}"
    name = f"rp{next(_ids)}"
    p1 = children({"role": "producer", "config": producer_conf(name, control)})
    inc1 = p1.expect("ready")["incarnation"]
    eng_a, a = in_process(consumer_conf(f"ra{next(_ids)}", [control]))
    eng_b, b = in_process(consumer_conf(f"rb{next(_ids)}", [control]))
    req_a, req_b = _hold(eng_a, 1, PROMPTS[0]), _hold(eng_b, 2, PROMPTS[0])
    old_a, old_b = a.loads[1].claimed, b.loads[2].claimed
    assert old_a.incarnation == old_b.incarnation == inc1
    assert _state(p1)["leases"] == 2

    p1.kill()
    p2 = children({"role": "producer", "config": producer_conf(name, control)})
    ready = p2.expect("ready")
    inc2 = ready["incarnation"]
    assert inc2 != inc1 and ready["leases"] == 0

    # B's first claim on the new process is a hit (re-Hello + one retry, no miss). Its
    # keepalive's renewals timed out while no producer ran: the link's backoff ends first.
    assert wait_for(lambda: all(lk.usable() for lk in b.links), 5)
    failed = b.metrics["claims_failed"]
    req_b2 = _hold(eng_b, 3, PROMPTS[1])
    assert b.metrics["claims_failed"] == failed
    new_b = b.loads[3].claimed
    assert new_b.incarnation == inc2
    assert _state(p2)["leases"] == 1

    # Both consumers end their old requests: those releases are never sent to the new
    # process (or refused there by name); B's live lease there is untouched.
    eng_a.driver.scheduler.request_finished(req_a, [])
    eng_b.driver.scheduler.request_finished(req_b, [])
    assert wait_for(
        lambda: a.metrics["releases_dropped_restart"] + b.metrics["releases_dropped_restart"] == 2,
        5,
    ), (dict(a.metrics), dict(b.metrics))
    time.sleep(3 * 0.2)  # a few keepalive passes: renewals of the old leases are dropped too
    st = _state(p2)
    assert st["leases"] == 1, st
    assert st["lease_stats"]["released"] == 0

    # A stale release that does reach the new process (B's own connection, B's live lease
    # id, the old incarnation) is refused by name and frees nothing.
    raw = ControlClient(control, default_timeout_s=5.0)
    try:
        raw.call(
            m.Hello(
                instance_id=b.owner,
                role="consumer",
                fingerprint=b.fingerprint,
                incarnation=b.incarnation,
            )
        )
        with pytest.raises(ProtocolError) as e:
            raw.call(m.Release(owner=b.owner, lease_id=new_b.lease_id, incarnation=inc1))
        assert e.value.code is ErrorCode.STALE_INCARNATION
    finally:
        raw.close()
    st = _state(p2)
    assert st["leases"] == 1 and st["control"].get("STALE_INCARNATION", 0) >= 1, st

    # B's live lease is released as usual; A serves real requests against the new process
    eng_b.driver.scheduler.request_finished(req_b2, [])
    assert wait_for(lambda: _state(p2)["leases"] == 0, 5)
    results, _ = run_consumer(eng_a, deadline_s=30)
    assert check_outcomes(results, mono) == 0
    assert a.metrics["claims_hit"] >= 1 + len(PROMPTS)  # the held one, then every prompt
    st = _state(p2)
    assert (st["leases"], st["corrupt"]) == (0, 0) or wait_for(lambda: _state(p2)["leases"] == 0, 5)


# The own pause runs with longer timeouts than the rest of the file: STALL_GRACE must be
# several of the consumer's call timeouts (0.5 s), as it is with the defaults (75 s), or a
# loaded box's scheduling alone would decide the case.
PAUSE_TTL_S, PAUSE_OWNER_DEAD_S = 2.0, 1.0


def test_producer_own_pause_does_not_free_live_leases(children):  # noqa: F811
    control = f"tcp://127.0.0.1:{free_port()}"
    pconf = producer_conf(f"sp{next(_ids)}", control)
    pconf["producer"].update(lease_ttl_s=PAUSE_TTL_S, owner_dead_after_s=PAUSE_OWNER_DEAD_S)
    p = children({"role": "producer", "config": pconf})
    p.expect("ready")
    cconf = consumer_conf(f"sc{next(_ids)}", [control])
    cconf["consumer"]["lease_ttl_s"] = PAUSE_TTL_S
    eng, c = in_process(cconf)
    reqs = [_hold(eng, i + 1, tokens) for i, tokens in enumerate(PROMPTS[:2])]
    assert _state(p)["leases"] == 2
    # live owners: their keepalive has renewed with this producer before it is paused
    assert wait_for(lambda: c.metrics["leases_renewed"] >= 2, 5)
    pause_s = PAUSE_OWNER_DEAD_S + PAUSE_TTL_S + 1.0  # past both: every judge would fire
    os.kill(p.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(pause_s)
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    renewed = c.metrics["leases_renewed"]
    # the consumer reaches the resumed producer again and renews within STALL_GRACE ...
    grace_s = PAUSE_OWNER_DEAD_S + 2 * PAUSE_TTL_S
    assert wait_for(lambda: c.metrics["leases_renewed"] >= renewed + 2, grace_s), (
        dict(c.metrics),
        _state(p),
    )
    # ... and from then on its renewals alone keep the leases: judged past the grace's end
    time.sleep(max(0.0, resumed + grace_s + PAUSE_TTL_S - time.monotonic()))
    st = _state(p)
    assert st["leases"] == 2, (st, dict(c.metrics))
    assert st["lease_stats"]["freed_dead_owner"] == 0 and st["lease_stats"]["expired"] == 0
    assert st["metrics"].get("sweeper_stalls", 0) >= 1, st
    for r in reqs:
        eng.driver.scheduler.request_finished(r, [])
    assert wait_for(lambda: _state(p)["leases"] == 0, 5)
