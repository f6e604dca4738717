"""Content keys of blocks and pages (DESIGN §3).

Key of block i: ``h_i = xxh3_128(h_{i-1} || int64-LE tokens of block i)`` with
``h_{-1} = Namespace.seed()``. Everything that changes what a page's bytes mean is in the
seed, so a mismatch reads as a miss, never as garbage. Only full blocks get keys.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import xxhash

KEY_BYTES = 16
_DOMAIN = b"disagg/ns/v1"  # changes every key if the scheme ever changes


@dataclass(frozen=True)
class Namespace:
    """The seed inputs; equal namespaces give equal keys for equal tokens."""

    model_fingerprint: str
    dtype: str
    tokens_per_block: int
    group_page_bytes: tuple[int, ...]
    tp_size: int = 1
    tp_rank: int = 0
    cache_salt: str | None = None
    lora_id: int | None = None

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")
        object.__setattr__(self, "group_page_bytes", tuple(int(b) for b in self.group_page_bytes))

    def seed(self) -> bytes:
        """16 bytes, deterministic across processes and machines (canonical JSON)."""
        canon = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
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

    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    n_full = arr.shape[0] // tpb
    if n_full <= start_block:
        return []
    # One conversion to little-endian int64, then hash slices: no per-token Python work.
    buf = np.ascontiguousarray(arr[start_block * tpb : n_full * tpb], dtype="<i8").tobytes()
    step = tpb * 8
    digest = xxhash.xxh3_128_digest
    out = []
    for off in range(0, len(buf), step):
        h = digest(h + buf[off : off + step])
        out.append(h)
    return out


def page_key(block_key: bytes, layer_group_id: int) -> bytes:
    """Key of one layer group's page of a block (the same tokens hold different KV in
    each group)."""
    if len(block_key) != KEY_BYTES:
        raise ValueError(f"block key must be {KEY_BYTES} bytes, got {len(block_key)}")
    if layer_group_id < 0:
        raise ValueError(f"layer_group_id must be >= 0, got {layer_group_id}")
    return xxhash.xxh3_128_digest(block_key + b"grp" + layer_group_id.to_bytes(4, "little"))
