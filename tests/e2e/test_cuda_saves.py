"""Producer and consumer engines on a CUDA device (skipped elsewhere; run on the lent
H200): with the save copies on their own stream and on the forward stream alike
(``tuning.save_stream``), tokens equal the monolithic run's and every loaded page equals
the producer's computed page, byte for byte, for a device store and a host store."""

from __future__ import annotations

import pytest
import torch
from harness import (
    SHAPE,
    check_against_monolithic,
    close_all_services,
    make_consumer,
    make_producer,
    prompts,
    run,
)

from disagg.engine.reference import Engine, EngineConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _cleanup():
    yield
    close_all_services()


@pytest.mark.parametrize("store_device", ["cuda", "pinned"])
@pytest.mark.parametrize("save_stream", ["1", "0"], ids=["save-stream", "forward-stream"])
def test_cuda_saves_match_monolithic(monkeypatch, store_device, save_stream):
    monkeypatch.setenv("DISAGG_SAVE_STREAM", save_stream)
    cfg = EngineConfig(**dict(SHAPE, device="cuda"), capture_pages=True, chunk_size=96)
    ps = prompts(n=3, length=400)
    mono = Engine(cfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(cfg, store_device=store_device)
    produced = run(prod, ps, 1)
    cons, _ = make_consumer(cfg, [psvc.endpoint])
    check_against_monolithic(produced, run(cons, ps, 4), mono)


@pytest.mark.parametrize("plan", ["0", "1"], ids=["after-the-pass", "layer-wise"])
@pytest.mark.parametrize("store_device", ["cuda", "pinned"])
@pytest.mark.parametrize("save_stream", ["1", "0"], ids=["save-stream", "forward-stream"])
def test_save_hooks_never_wait_for_the_device(monkeypatch, store_device, save_stream, plan):
    """The producer's hooks on the engine thread (planning, each layer's copy, queueing
    the commit) enqueue only: CUDA's sync debug mode raises on any call that makes the
    host wait for the device (a pageable index copy did, once per layer)."""
    from disagg.producer.connector import ProducerWorker

    monkeypatch.setenv("DISAGG_SAVE_STREAM", save_stream)
    monkeypatch.setenv("DISAGG_SAVE_PLAN_LAYERS", plan)
    calls = []
    for name in ("bind_connector_meta", "save_kv_layer", "wait_for_save"):
        hook = getattr(ProducerWorker, name)

        def strict(self, *a, _hook=hook, _name=name):
            calls.append(_name)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _hook(self, *a)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        monkeypatch.setattr(ProducerWorker, name, strict)
    cfg = EngineConfig(**dict(SHAPE, device="cuda"), capture_pages=True, chunk_size=96)
    ps = prompts(n=2, length=400)
    mono = Engine(cfg).generate(ps, max_tokens=4)
    prod, psvc = make_producer(cfg, store_device=store_device)
    produced = run(prod, ps, 1)
    assert calls.count("save_kv_layer") >= SHAPE["num_layers"]
    assert psvc.drain_commits() and psvc.metrics["passes_committed"] > 0
    cons, _ = make_consumer(cfg, [psvc.endpoint])
    check_against_monolithic(produced, run(cons, ps, 4), mono)
