"""Content keys of blocks and pages.

Key of block i: ``h_i = xxh3_128(h_{i-1} || int64-LE tokens of block i)`` with
``h_{-1} = Namespace.seed()``. Everything that changes what a page's bytes mean is in the
seed, so a mismatch reads as a miss, never as garbage. Only full blocks get keys.
"""

from __future__ import annotations

import itertools
import json
import struct
import sys
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import overload

import numpy as np
import xxhash

from ..native import load
from .version import MAX_KEYS

_native: types.ModuleType | None
# the C loops (_keyhash.c); absent when built without a compiler
_native = load("disagg.protocol._keyhash", strict=False)
if sys.byteorder != "little":  # pack_int64 writes native order; keys are little-endian
    _native = None

KEY_BYTES = 16
_DOMAIN = b"disagg/ns/v1"  # changes every key if the scheme ever changes


@dataclass(frozen=True)
class Namespace:
    """The seed inputs; equal namespaces give equal keys for equal tokens."""

    model_fingerprint: str
    dtype: str
    tokens_per_block: int
    group_page_bytes: tuple[int, ...]
    tp_size: int = 1  # 0: keys of every TP shard (pages located by KV head)
    tp_rank: int = 0
    cache_salt: str | None = None
    lora_id: int | None = None
    mm_digest: str | None = None  # digest of the request's multimodal inputs

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")
        object.__setattr__(self, "group_page_bytes", tuple(int(b) for b in self.group_page_bytes))

    def seed(self) -> bytes:
        """16 bytes, deterministic across processes and machines (canonical JSON)."""
        fields = asdict(self)
        if fields["mm_digest"] is None:  # text-only namespaces keep the keys they always had
            del fields["mm_digest"]
        canon = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return xxhash.xxh3_128_digest(_DOMAIN + canon)


def block_keys(
    ns_or_seed: Namespace | bytes,
    tokens: Sequence[int] | np.ndarray,
    tokens_per_block: int | None = None,
    start_block: int = 0,
    prev: bytes | None = None,
) -> list[bytes]:
    """Keys of the full blocks ``start_block, start_block+1, ...`` of ``tokens``.

    ``tokens`` is the whole sequence from token 0. ``prev`` is the key of block
    ``start_block - 1`` (required when ``start_block > 0``; it lets callers extend a key
    list incrementally). ``tokens_per_block`` defaults to the namespace's.
    """
    return KeyBlob(
        _chain(tokens, *_start(ns_or_seed, tokens_per_block, start_block, prev))
    ).tolist()


def block_key_blob(
    ns_or_seed: Namespace | bytes,
    tokens: Sequence[int] | np.ndarray,
    tokens_per_block: int | None = None,
    start_block: int = 0,
    prev: bytes | None = None,
) -> KeyBlob:
    """``block_keys`` packed into one ``KeyBlob`` (what Claim and Lookup carry), built
    without a list of per-key objects."""
    return KeyBlob(_chain(tokens, *_start(ns_or_seed, tokens_per_block, start_block, prev)))


def _start(
    ns_or_seed: Namespace | bytes,
    tokens_per_block: int | None,
    start_block: int,
    prev: bytes | None,
) -> tuple[bytes, int, int]:
    """Checked ``(key of block start_block - 1, tokens per block, start_block)``."""
    if isinstance(ns_or_seed, Namespace):
        seed = ns_or_seed.seed()
        tpb = tokens_per_block or ns_or_seed.tokens_per_block
    else:
        seed = bytes(ns_or_seed)
        if tokens_per_block is None:
            raise ValueError("tokens_per_block is required with a raw seed")
        tpb = tokens_per_block
    if len(seed) != KEY_BYTES:
        raise ValueError(f"seed must be {KEY_BYTES} bytes, got {len(seed)}")
    if tpb < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tpb}")
    if start_block < 0:
        raise ValueError(f"start_block must be >= 0, got {start_block}")
    if start_block > 0 and prev is None:
        raise ValueError("prev (key of block start_block-1) is required when start_block > 0")
    h = seed if start_block == 0 else bytes(prev)  # type: ignore[arg-type]
    if len(h) != KEY_BYTES:
        raise ValueError(f"prev must be {KEY_BYTES} bytes, got {len(h)}")
    return h, tpb, start_block


def _chain(tokens: Sequence[int] | np.ndarray, h: bytes, tpb: int, start_block: int) -> bytes:
    """The keys of blocks ``start_block..`` of ``tokens``, back to back, chained from ``h``."""
    if isinstance(tokens, (list, tuple)):
        n_full = len(tokens) // tpb
        if n_full <= start_block:
            return b""
        buf = _pack_int64(tokens, start_block * tpb, n_full * tpb)
    else:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        n_full = arr.shape[0] // tpb
        if n_full <= start_block:
            return b""
        buf = np.ascontiguousarray(arr[start_block * tpb : n_full * tpb], dtype="<i8").tobytes()
    if _native is not None:
        return _native.chain_digests(xxhash.xxh3_128_digest, h, buf, tpb * 8)
    # The chain is inherently sequential; accumulate (C) over a C-level split into per-block
    # byte strings keeps the per-block work to a concat and a call.
    chunks = np.frombuffer(buf, dtype=f"V{tpb * 8}").tolist()
    step = lambda prev, chunk, digest=xxhash.xxh3_128_digest: digest(prev + chunk)  # noqa: E731
    return b"".join(itertools.accumulate(chunks, step, initial=h))[KEY_BYTES:]


def _pack_int64(tokens: Sequence[int], start: int = 0, stop: int | None = None) -> bytes:
    """Little-endian int64 bytes of ``tokens[start:stop]``, a list of ints. Engines hand
    prompts over as lists; the C helper unboxes them 4x faster than ``struct.pack``, the
    fastest pure-Python route measured (numpy's, ``array``'s and ``np.fromiter``'s are
    slower)."""
    stop = len(tokens) if stop is None else stop
    if _native is not None and isinstance(tokens, (list, tuple)):
        try:
            return _native.pack_int64(tokens, start, stop)
        except (TypeError, OverflowError):
            pass  # not plain ints (bools, numpy scalars, floats): the routes below decide
    part = tokens[start:stop]
    try:
        return struct.pack(f"<{len(part)}q", *part)
    except struct.error:  # not plain ints (floats, out of range): numpy decides
        return np.asarray(part).astype("<i8").tobytes()


def tokens_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """``tokens`` as a 1-D int64 array, converted once (hash it for several namespaces,
    e.g. every TP rank, without converting the list each time)."""
    if isinstance(tokens, np.ndarray):
        return tokens
    return np.frombuffer(_pack_int64(tokens), dtype="<i8")


class KeyBlob(Sequence[bytes]):
    """Block keys packed back to back in one ``bytes`` (``KEY_BYTES`` each, in order).

    A read-only sequence of 16-byte keys (``len`` counts keys, indexing gives a key,
    slicing gives a ``KeyBlob``; it equals a list of the same keys), travelling on the wire
    as one MessagePack ``bin`` instead of one object per key, so a 2,048-key Claim costs a
    memcpy to encode and decode. ``array()`` is a zero-copy ``[n, 2]`` uint64 view
    (little-endian halves) for vectorised lookups. ``KeyBlob(blob)`` refuses a blob whose
    length is not a multiple of ``KEY_BYTES`` or that holds more than ``MAX_KEYS`` keys;
    ``KeyBlob.of(keys)`` packs an iterable of keys, refusing any that is not 16 bytes.
    """

    __slots__ = ("blob",)

    def __init__(self, blob: bytes | bytearray | memoryview = b"") -> None:
        blob = bytes(blob)  # no copy when it already is bytes
        if len(blob) % KEY_BYTES:
            raise ValueError(
                f"key blob of {len(blob)} bytes is not a whole number of "
                f"{KEY_BYTES}-byte keys ({len(blob) % KEY_BYTES} byte(s) left over)"
            )
        if len(blob) > MAX_KEYS * KEY_BYTES:
            raise ValueError(
                f"key blob holds {len(blob) // KEY_BYTES} keys, more than the limit of {MAX_KEYS}"
            )
        self.blob = blob

    @classmethod
    def of(cls, keys: Iterable[bytes]) -> KeyBlob:
        """Pack ``keys`` (a KeyBlob is returned as is)."""
        if isinstance(keys, KeyBlob):
            return keys
        if isinstance(keys, (bytes, bytearray, memoryview, str)):
            raise TypeError(
                "keys must be a sequence of 16-byte keys; wrap a packed blob in KeyBlob"
            )
        keys = list(keys)
        if set(map(len, keys)) - {KEY_BYTES}:
            i, k = next((i, k) for i, k in enumerate(keys) if len(k) != KEY_BYTES)
            raise ValueError(f"keys[{i}] is {len(k)} bytes, a block key is {KEY_BYTES}")
        return cls(b"".join(keys))

    def __len__(self) -> int:
        return len(self.blob) // KEY_BYTES

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> KeyBlob: ...

    def __getitem__(self, i: int | slice) -> bytes | KeyBlob:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1:
                return KeyBlob(self.blob[start * KEY_BYTES : max(start, stop) * KEY_BYTES])
            return KeyBlob(b"".join(self.tolist()[i]))
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"key index {i} out of range for {n} keys")
        return self.blob[j * KEY_BYTES : (j + 1) * KEY_BYTES]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.tolist())

    def tolist(self) -> list[bytes]:
        """The keys as a list of ``bytes`` (one C-level split)."""
        return np.frombuffer(self.blob, dtype=f"V{KEY_BYTES}").tolist()

    def array(self) -> np.ndarray:
        """Zero-copy read-only ``[n, 2]`` uint64 view: column 0 is each key's first 8
        bytes, column 1 its last 8, both little-endian."""
        return np.frombuffer(self.blob, dtype="<u8").reshape(-1, 2)

    def __bytes__(self) -> bytes:
        return self.blob

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeyBlob):
            return self.blob == other.blob
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.blob)

    def __repr__(self) -> str:
        return f"KeyBlob({len(self)} keys)"


def page_key(block_key: bytes, layer_group_id: int) -> bytes:
    """Key of one layer group's page of a block (the same tokens hold different KV in
    each group)."""
    if len(block_key) != KEY_BYTES:
        raise ValueError(f"block key must be {KEY_BYTES} bytes, got {len(block_key)}")
    if layer_group_id < 0:
        raise ValueError(f"layer_group_id must be >= 0, got {layer_group_id}")
    return xxhash.xxh3_128_digest(block_key + b"grp" + layer_group_id.to_bytes(4, "little"))
