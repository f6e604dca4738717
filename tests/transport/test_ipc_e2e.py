"""Producer and consumer reference engines with ``transport: ipc``: tokens equal a
monolithic run and the loaded pages equal the producer's byte for byte, for every KV
layout and both load modes. (In one process here; tests/chaos runs the producer in its
own process.)"""

from __future__ import annotations

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

from disagg.engine.reference import Engine, EngineConfig

pytestmark = pytest.mark.timeout(120)

CASES = {
    "v1": dict(kv_manager="v1"),
    "v2": dict(kv_manager="v2"),
    "v2-vswa-chunked": dict(kv_manager="v2", windows=(32, None), chunk_size=64),
}


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


@pytest.mark.parametrize("load_mode", ["async", "sync"])
@pytest.mark.parametrize("case", list(CASES))
def test_ipc_tokens_and_pages_match_monolithic(case, load_mode):
    cfg = EngineConfig(**SHAPE, **CASES[case], capture_pages=True)
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=6)

    prod, psvc = make_producer(cfg, transport="ipc")
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], transport="ipc", load_mode=load_mode)
    consumed = run(cons, ps, max_tokens=6)
    assert type(psvc.data).__name__ == type(csvc.data).__name__ == "IpcDataPlane"

    check_against_monolithic(produced, consumed, mono)
    assert csvc.metrics["pages_loaded"] > 0
    assert (psvc.metrics["pushes_layerwise"] > 0) == (load_mode == "sync")
    assert psvc.data.stats["push_done"] > 0 and psvc.data.stats["push_failed"] == 0
    assert wait_for(lambda: psvc.leases.active() == 0)
    assert psvc.store.pinned_blocks() == 0
