"""Producer and consumer reference engines with ``transport: ucx``: tokens equal a
monolithic run and the loaded pages equal the producer's byte for byte. Skipped without
ucxx."""

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

pytest.importorskip(
    "disagg.transport.ucx.plane", reason="ucxx is not installed (pip install disagg[ucx])"
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


@pytest.mark.parametrize("kv_manager", ["v1", "v2"])
def test_ucx_tokens_and_pages_match_monolithic(kv_manager):
    cfg = EngineConfig(**SHAPE, kv_manager=kv_manager, capture_pages=True)
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=6)

    prod, psvc = make_producer(cfg, transport="ucx")
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], transport="ucx")
    consumed = run(cons, ps, max_tokens=6)
    assert type(psvc.data).__name__ == type(csvc.data).__name__ == "UcxDataPlane"
    assert csvc.data.endpoint.startswith("ucx+")

    check_against_monolithic(produced, consumed, mono)
    assert csvc.metrics["pages_loaded"] > 0
    assert wait_for(lambda: psvc.metrics["pages_pushed"] > 0)  # counted after the sender drains
    assert wait_for(lambda: psvc.leases.active() == 0)


def test_ucx_shm_channel_from_config():
    """``ucx_channel: shm`` + ``ucx_rma_readers`` in the config reach both services' UCX
    planes: the consumer reads the producer's store one-sided (where the C loop is built),
    from its mapping (the store comes from ``register_source``), and tokens still equal
    the monolithic run."""
    from disagg.transport.ucx import native_rma

    cfg = EngineConfig(**SHAPE, capture_pages=True)
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=6)
    top = {"ucx_channel": "shm", "ucx_rma_readers": 2}
    prod, psvc = make_producer(cfg, transport="ucx", top=top)
    produced = run(prod, ps, max_tokens=1)
    cons, csvc = make_consumer(cfg, [psvc.endpoint], transport="ucx", top=top)
    consumed = run(cons, ps, max_tokens=6)
    assert psvc.data.channel == csvc.data.channel == "shm"
    assert csvc.data.rma_readers == 2
    assert csvc.data.endpoint.startswith("ucx+shm://")
    assert csvc.data.capabilities.rma == (2 if native_rma.available() else 0)
    check_against_monolithic(produced, consumed, mono)
    assert csvc.metrics["pages_loaded"] > 0
    if native_rma.available():
        # the producer's store came from register_source: the consumer maps it and copies
        # (ucx/mapped.py); no get is posted
        assert psvc.data.stats["rma_mem_alloc"] == 1
        assert csvc.data.stats["rma_mapped_batches"] > 0
        assert csvc.data.stats.get("rma_reads", 0) == 0
    assert wait_for(lambda: psvc.leases.active() == 0)


def test_factory_refuses_ucx_settings_for_other_planes():
    from disagg.transport.factory import make_data_plane

    with pytest.raises(ValueError, match="UCX data plane settings"):
        make_data_plane("tcp", ucx_channel="shm")
