import time

import numpy as np
import pytest

from disagg.protocol import KeyBlob, Namespace, block_key_blob, block_keys, page_key

NS = Namespace("llama-x", "bf16", 16, (4096, 2048))


def test_deterministic_and_full_blocks_only():
    toks = list(range(100))
    a = block_keys(NS, toks)
    assert len(a) == 6 and all(len(k) == 16 for k in a)
    assert a == block_keys(NS, np.array(toks, dtype=np.int32))
    assert a == block_keys(NS.seed(), toks, 16)
    assert len(set(a)) == 6
    assert block_keys(NS, toks[:15]) == []


def test_chaining():
    toks = np.arange(160)
    base = block_keys(NS, toks)
    changed = toks.copy()
    changed[37] += 1  # block 2
    other = block_keys(NS, changed)
    assert other[:2] == base[:2]
    assert all(x != y for x, y in zip(other[2:], base[2:], strict=True))


def test_incremental_equals_whole():
    toks = np.arange(160)
    whole = block_keys(NS, toks)
    tail = block_keys(NS, toks, start_block=4, prev=whole[3])
    assert tail == whole[4:]
    with pytest.raises(ValueError):
        block_keys(NS, toks, start_block=4)


def test_namespace_separation():
    toks = list(range(64))
    base = block_keys(NS, toks)
    variants = [
        Namespace("llama-x", "bf16", 16, (4096, 2048), cache_salt="s"),
        Namespace("llama-x", "bf16", 16, (4096, 2048), lora_id=3),
        Namespace("llama-x", "fp8", 16, (4096, 2048)),
        Namespace("llama-x", "bf16", 16, (4096, 1024)),
        Namespace("llama-x", "bf16", 16, (4096, 2048), tp_size=2, tp_rank=1),
        Namespace("llama-y", "bf16", 16, (4096, 2048)),
    ]
    seen = {base[0]}
    for ns in variants:
        k = block_keys(ns, toks)[0]
        assert k not in seen
        seen.add(k)
    assert Namespace("llama-x", "bf16", 16, [4096, 2048]).seed() == NS.seed()


def test_page_key():
    k = block_keys(NS, range(16))[0]
    assert page_key(k, 0) != page_key(k, 1)
    assert len(page_key(k, 1)) == 16 and page_key(k, 1) == page_key(k, 1)
    with pytest.raises(ValueError):
        page_key(b"x", 0)


def test_fast():
    toks = np.random.default_rng(0).integers(0, 128000, 131072)
    block_keys(NS, toks)
    t = time.perf_counter()
    keys = block_keys(NS, toks)
    assert len(keys) == 8192
    assert time.perf_counter() - t < 0.05  # a few ms normally; generous for noisy CI


def test_tokens_as_list_array_or_tuple_give_the_same_keys():
    toks = np.random.default_rng(1).integers(0, 1 << 40, 333)
    want = block_keys(NS, toks)
    assert len(want) == 20
    assert block_keys(NS, toks.tolist()) == want  # engines pass lists of ints
    assert block_keys(NS, tuple(toks.tolist())) == want
    assert block_keys(NS, [np.int64(t) for t in toks]) == want
    assert block_keys(NS, toks.astype(np.uint64)) == want
    assert block_keys(NS, toks.tolist(), start_block=7, prev=want[6]) == want[7:]
    # values a C int64 cannot hold, or floats, go through numpy as before
    assert block_keys(NS, [float(t) for t in toks[:32]]) == want[:2]
    with pytest.raises(ValueError, match="1-D"):
        block_keys(NS, np.zeros((2, 32), dtype=np.int64))
    assert block_keys(NS, []) == [] and block_keys(NS, list(range(15))) == []


def test_block_key_blob_packs_block_keys():
    toks = list(range(200))
    blob = block_key_blob(NS, toks)
    assert isinstance(blob, KeyBlob) and blob == block_keys(NS, toks)
    assert blob.blob == b"".join(block_keys(NS, toks)) and len(blob) == 12
    assert block_key_blob(NS, toks[:10]) == KeyBlob()
    assert block_key_blob(NS, toks)[3:5] == block_keys(NS, toks)[3:5]


def test_tokens_array_converts_once_and_keys_agree():
    from disagg.protocol.keys import block_key_blob, tokens_array

    ns = b"\x01" * 16
    toks = list(range(1000, 1000 + 16 * 9 + 5))
    arr = tokens_array(toks)
    assert arr.dtype.kind == "i" and arr.tolist() == toks
    assert tokens_array(arr) is arr
    assert block_key_blob(ns, arr, 16) == block_key_blob(ns, toks, 16)
    assert len(block_key_blob(ns, arr, 16)) == 9
