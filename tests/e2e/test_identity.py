"""Same tokens, different KV: a LoRA adapter or a multimodal input changes what a prompt's
pages hold. A consumer must never load pages computed under another adapter or image (a
wrong token); equal identities must still share (a hit)."""

from __future__ import annotations

import pytest
from harness import (
    SHAPE,
    check_against_monolithic,
    close_all_services,
    make_consumer,
    make_producer,
    prompts,
)

from disagg.engine.reference import Engine, EngineConfig
from disagg.identity import RequestIdentity, cache_salt_id, multimodal_digest, request_identity
from disagg.protocol.keys import Namespace

CFG = EngineConfig(**SHAPE, capture_pages=True)
IMG_A = [[11, 12, 13, 14, 15, 16, 17, 18]]
IMG_B = [[21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.fixture(autouse=True)
def _cleanup():
    yield
    close_all_services()


def _run(eng: Engine, ps: list[list[int]], n: int, **ident) -> list:
    ids = [eng.add_request(p, n, **ident) for p in ps]
    while eng.has_work():
        eng.step()
    return [eng.results[i] for i in ids]


@pytest.mark.parametrize(
    "saved, asked",
    [
        ({"lora_task_id": 1}, {"lora_task_id": 2}),
        ({"lora_task_id": 1}, {}),
        ({}, {"lora_task_id": 1}),
        ({"multimodal_hashes": IMG_A}, {"multimodal_hashes": IMG_B}),
        ({"multimodal_hashes": IMG_A}, {}),
    ],
    ids=["lora1-lora2", "lora1-base", "base-lora1", "imageA-imageB", "imageA-text"],
)
def test_kv_of_another_adapter_or_image_is_never_loaded(saved, asked):
    ps = prompts(n=2, length=200)
    prod, psvc = make_producer(CFG)
    _run(prod, ps, 1, **saved)
    cons, _ = make_consumer(CFG, [psvc.endpoint])
    got = _run(cons, ps, 4, **asked)
    mono = Engine(CFG).generate(ps, 4, **asked)
    assert [r.error for r in got] == [None, None]
    assert [r.tokens for r in got] == mono
    assert all(r.connector_matched_tokens == 0 for r in got), "loaded another identity's KV"
    # and the identities really give different tokens, so a wrong load would have shown
    assert Engine(CFG).generate(ps, 4, **saved) != mono


@pytest.mark.parametrize(
    "ident",
    [{"lora_task_id": 7}, {"multimodal_hashes": IMG_A}],
    ids=["lora", "image"],
)
def test_equal_identities_share_blocks(ident):
    ps = prompts(n=2, length=200)
    prod, psvc = make_producer(CFG)
    produced = _run(prod, ps, 1, **ident)
    cons, _ = make_consumer(CFG, [psvc.endpoint])
    check_against_monolithic(
        produced, _run(cons, ps, 4, **ident), Engine(CFG).generate(ps, 4, **ident)
    )


def test_request_identity_reads_the_bound_attributes():
    class Req:  # what a nanobind LlmRequest exposes; one property raises
        cache_salt = "s"
        lora_task_id = 3
        multimodal_hashes = [[1, 2], [3, 4]]
        multimodal_positions = [0, 40]
        multimodal_lengths = (16, 16)

        @property
        def broken(self):
            raise RuntimeError("not bound")

    ident = request_identity(Req())
    mm = multimodal_digest([[1, 2], [3, 4]], [0, 40], [16, 16])
    assert ident == RequestIdentity(str(cache_salt_id("s")), 3, mm)

    class CppReq(Req):  # the C++-bound request of a V1 query: the salt's id, no string
        cache_salt = None
        cache_salt_id = cache_salt_id("s")

    assert request_identity(CppReq()) == ident  # both forms key the same blocks
    other = type("O", (Req,), {"cache_salt": "t"})()
    assert request_identity(other).cache_salt != ident.cache_salt
    assert request_identity(object()) == RequestIdentity()
    # where the images sit matters, and so does each image
    assert multimodal_digest([[1, 2]], [0], [16]) != multimodal_digest([[1, 2]], [8], [16])
    assert multimodal_digest([[1, 2]]) != multimodal_digest([[1, 3]])
    assert multimodal_digest(None) is None and multimodal_digest([]) is None


def test_text_only_namespaces_keep_their_keys():
    """Adding the multimodal field did not move any text-only key (a rolling upgrade of
    producers and consumers keeps hitting)."""
    ns = Namespace("m", "bf16", 16, (4096,))
    assert ns.seed().hex() == "c78c033489d5f96e05826ecd41efca64"
    assert Namespace("m", "bf16", 16, (4096,), mm_digest="ab").seed() != ns.seed()
