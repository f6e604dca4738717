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


def _by_formula(seed: bytes, toks: list[int], tpb: int) -> list[bytes]:
    """The key chain spelled out: h_i = xxh3_128(h_{i-1} || int64-LE tokens of block i)."""
    import struct

    import xxhash

    out, h = [], seed
    for b in range(len(toks) // tpb):
        h = xxhash.xxh3_128_digest(h + struct.pack(f"<{tpb}q", *toks[b * tpb : (b + 1) * tpb]))
        out.append(h)
    return out


@pytest.mark.parametrize("path", ["native", "python"])
def test_both_key_paths_follow_the_formula(path, monkeypatch):
    from disagg.protocol import keys

    if path == "native":
        if keys._native is None:
            pytest.skip("disagg.protocol._keyhash was not built (no C compiler at install)")
    else:
        monkeypatch.setattr(keys, "_native", None)
    rng = np.random.default_rng(7)
    toks = rng.integers(-(1 << 62), 1 << 62, 16 * 40 + 3).tolist()
    want = _by_formula(NS.seed(), toks, 16)
    assert block_keys(NS, toks) == want
    assert block_key_blob(NS, tuple(toks)).tolist() == want
    assert block_keys(NS, np.array(toks), start_block=5, prev=want[4]) == want[5:]
    assert block_keys(NS.seed(), toks[:64], 4) == _by_formula(NS.seed(), toks[:64], 4)
    # elements the C helper refuses (bools, numpy scalars) fall back to the same keys
    mixed = [True, False, np.int64(3), *toks[3:32]]
    assert block_keys(NS, mixed) == _by_formula(NS.seed(), [1, 0, 3, *toks[3:32]], 16)


def test_native_helper_is_built_where_ci_requires_it():
    import os

    from disagg.protocol import keys

    if os.environ.get("DISAGG_REQUIRE_NATIVE") != "1":
        pytest.skip("set DISAGG_REQUIRE_NATIVE=1 to require the C key loops (CI does)")
    assert keys._native is not None, "disagg.protocol._keyhash missing: pip install -e . with gcc"


def test_native_helper_refuses_bad_input_by_name():
    from disagg.protocol import keys

    if keys._native is None:
        pytest.skip("disagg.protocol._keyhash was not built")
    nat = keys._native
    with pytest.raises(TypeError, match="token 1 is float"):
        nat.pack_int64([1, 2.0], 0, 2)
    with pytest.raises(OverflowError, match="token 3 does not fit"):
        nat.pack_int64([0, 0, 0, 1 << 64], 2, 4)
    with pytest.raises(TypeError, match="list or tuple"):
        nat.pack_int64(range(3), 0, 3)
    with pytest.raises(IndexError, match="range 2:5 outside 4 tokens"):
        nat.pack_int64([1, 2, 3, 4], 2, 5)
    with pytest.raises(IndexError, match="range -1:2"):
        nat.pack_int64([1, 2, 3, 4], -1, 2)
    assert nat.pack_int64((5, -6, 7), 1, 3) == np.array([-6, 7], "<i8").tobytes()
    import xxhash

    d = xxhash.xxh3_128_digest
    with pytest.raises(ValueError, match="prev must be 16 bytes"):
        nat.chain_digests(d, b"x", b"\0" * 16, 8)
    with pytest.raises(ValueError, match="not whole blocks"):
        nat.chain_digests(d, b"x" * 16, b"\0" * 12, 8)
    with pytest.raises(ValueError, match="block_bytes must be > 0"):
        nat.chain_digests(d, b"x" * 16, b"", 0)
    with pytest.raises(ValueError, match="digest must return 16 bytes"):
        nat.chain_digests(lambda b: b"short", b"x" * 16, b"\0" * 8, 8)
    with pytest.raises(ZeroDivisionError):  # the digest's own error propagates
        nat.chain_digests(lambda b: 1 // 0, b"x" * 16, b"\0" * 8, 8)
    assert nat.chain_digests(d, b"x" * 16, b"", 8) == b""
