"""Who we are to a peer: the key namespace and compatibility fingerprint of an engine's cache.

Both sides derive them from the same facts (model id, KV dtype, tokens per block, every
layer group's window and page bytes, TP shard), so a mismatch reads as a miss or a refused
handshake, never as garbage.
"""

from __future__ import annotations

from typing import Any

from .pages import PagePool
from .protocol.fingerprint import Fingerprint, GroupGeometry
from .protocol.keys import Namespace


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def model_id_of(llm_args: Any, configured: str | None) -> str:
    """The configured ``model_id``, else ``llm_args.model`` (path or name)."""
    if configured:
        return configured
    model = getattr(llm_args, "model", None)
    if model is None:
        raise ValueError(
            "cannot tell which model this engine serves: set model_id in the disagg config"
        )
    return str(model)


def tp_of(llm_args: Any) -> tuple[int, int]:
    """``(tp_size, tp_rank)``: ``tensor_parallel_size``, and the rank from ``tp_rank`` or,
    failing that, ``rank`` (the reference engine's per-worker stand-in for ``mpi_rank()``;
    with TP only, the global rank is the TP rank)."""
    size = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
    rank = getattr(llm_args, "tp_rank", None)
    if rank is None:
        rank = getattr(llm_args, "rank", 0)
    return size, int(rank or 0)


def fingerprint_of(pool: PagePool, model_id: str, tp_size: int, tp_rank: int) -> Fingerprint:
    return Fingerprint(
        model=model_id,
        dtype=dtype_name(pool.dtype),
        tokens_per_block=pool.tokens_per_block,
        groups=[
            GroupGeometry(
                group_id=g.group_id,
                window=g.window,
                bytes_per_page=g.page_bytes,
                num_layers=len(g.layer_ids),
            )
            for g in pool.groups
        ],
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def namespace_of(fp: Fingerprint, cache_salt: str | None, lora_id: int | None = None) -> Namespace:
    return Namespace(
        model_fingerprint=fp.model,
        dtype=fp.dtype,
        tokens_per_block=fp.tokens_per_block,
        group_page_bytes=tuple(g.bytes_per_page for g in fp.groups),
        tp_size=fp.tp_size,
        tp_rank=fp.tp_rank,
        cache_salt=cache_salt,
        lora_id=lora_id,
    )
