"""The chaos matrix's peer deaths on ``transport: nixl`` (helpers and timeouts from
test_chaos.py): a producer in another process serves matching tokens, also from another
network namespace over TCP on the device ``nixl_devices`` names; a producer killed
while the consumer reads its store fails those loads by name, the consumer survives and
holds nothing (``nixl_error_handling`` peer and none); a consumer killed while it reads
leaves the producer at its baseline (the push ends at its deadline, its rows are
unpinned). Skipped without NIXL."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import test_chaos as chaos
from test_chaos import (
    LOAD_TIMEOUT_S,
    PROMPTS,
    _ids,
    check_outcomes,
    consumer_at_baseline,
    consumer_conf,
    in_process,
    prefilled_producer,
    producer_at_baseline,
    producer_conf,
    run_consumer,
    wait_for,
)

pytest.importorskip("disagg.transport.nixl.plane", reason="NIXL is not installed (disagg[nixl])")

pytestmark = [pytest.mark.nixl, pytest.mark.chaos, pytest.mark.timeout(90)]
children, mono, netns_pair = chaos.children, chaos.mono, chaos.netns_pair  # fixtures


def nixl(conf: dict[str, Any], error_handling: str | None = None) -> dict[str, Any]:
    out = {**conf, "transport": "nixl"}
    if error_handling is not None:
        out["nixl_error_handling"] = error_handling
    return out


def test_nixl_producer_in_another_process_tokens_match(children, mono):
    p = children({"role": "producer", "config": nixl(producer_conf(f"np{next(_ids)}"))})
    ep = p.expect("ready")["endpoint"]
    eng, csvc = in_process(nixl(consumer_conf(f"nc{next(_ids)}", [ep])))
    results, took = run_consumer(eng, deadline_s=20)
    assert check_outcomes(results, mono) == 0
    assert all(eng.results[rid].connector_matched_tokens > 0 for rid, _, _ in results)
    assert csvc.metrics["pages_loaded"] > 0 and csvc.data.stats["done"] == len(PROMPTS)
    consumer_at_baseline(eng, csvc)


@pytest.mark.parametrize("mode", ["peer", "none"])
def test_nixl_producer_killed_while_its_store_is_read_fails_by_name(children, mono, mode):
    """The producer dies between the plan it sent and the consumer's reads: the reads
    meet a dead process, the loads fail by name, the consumer goes on (no abort of this
    process, nothing held), with UCX's peer error handling and without it."""
    pconf = nixl(producer_conf(f"np{next(_ids)}"), mode)
    p = children({"role": "producer", "config": pconf})
    ep = p.expect("ready")["endpoint"]
    eng, csvc = in_process(nixl(consumer_conf(f"nc{next(_ids)}", [ep]), mode))
    reader = csvc.data._reader
    on_plan = reader.on_plan

    def kill_then_read(sender, plan):
        if p.proc.poll() is None:
            p.kill()  # waits until it is gone: no memory left to read
        on_plan(sender, plan)

    reader.on_plan = kill_then_read
    results, took = run_consumer(eng, deadline_s=LOAD_TIMEOUT_S + 10)
    assert csvc.metrics["claims_hit"] > 0
    assert check_outcomes(results, mono) > 0
    assert all("NIXL read from" in err for _, _, err in results if err), results
    assert took < LOAD_TIMEOUT_S + 5
    consumer_at_baseline(eng, csvc)
    assert csvc.health()[0], csvc.health()


def test_nixl_consumer_killed_while_reading_frees_everything(children):
    psvc, used = prefilled_producer("nixl")
    started = threading.Event()
    post = psvc.data.post_push

    def announce(*args, **kw):
        started.set()
        return post(*args, **kw)

    psvc.data.post_push = announce
    c = children(
        {"role": "consumer", "config": nixl(consumer_conf(f"nk{next(_ids)}", [psvc.endpoint]))}
    )
    c.expect("ready")
    c.send("run")
    assert started.wait(20), "no push started"
    c.kill()
    producer_at_baseline(psvc, used)
    assert wait_for(lambda: psvc.metrics["pushes_done"] + psvc.metrics["pushes_failed"] >= 1, 10)


@pytest.mark.netns
def test_nixl_across_network_namespaces_tokens_match(children, netns_pair, mono):
    """Producer and consumer in two namespaces joined by a veth pair: UCX over TCP only
    (``UCX_TLS``: the namespaces share this host's memory, which UCX would use instead),
    on the device each side's ``nixl_devices`` names."""
    nsp = netns_pair
    control = f"tcp://{nsp['ip_p']}:5555"
    env = ["env", "UCX_TLS=tcp,self"]
    pconf = nixl(producer_conf(f"np{next(_ids)}", control=control))
    p = children(
        {"role": "producer", "config": {**pconf, "nixl_devices": nsp["dev_p"]}},
        prefix=["ip", "netns", "exec", nsp["ns_p"], *env],
    )
    p.expect("ready")
    cconf = nixl(consumer_conf(f"nc{next(_ids)}", [control]))
    c = children(
        {"role": "consumer", "config": {**cconf, "nixl_devices": nsp["dev_c"]}},
        prefix=["ip", "netns", "exec", nsp["ns_c"], *env],
    )
    c.expect("ready")
    c.send("run")
    out = c.expect("results", timeout=60)
    results = [(r["rid"], r["tokens"], r["error"]) for r in out["results"]]
    assert check_outcomes(results, mono) == 0
    c.send("state")
    st = c.expect("state")
    assert st["loads"] == 0 and not st["has_work"]
    assert st["metrics"].get("pages_loaded", 0) > 0, st
