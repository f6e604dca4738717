"""Who we are to a peer: the key namespace and compatibility fingerprint of an engine's cache.

Both sides derive them from the same facts (model id, KV dtype, tokens per block, every
layer group's window and page bytes, TP shard), so a mismatch reads as a miss or a refused
handshake, never as garbage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xxhash

from .engine.heads import HeadGeometry
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
    """``(tp_size, tp_rank)``: ``tensor_parallel_size`` from ``llm_args``, the rank from the
    runtime (``engine.runtime.runtime_rank``: TensorRT-LLM's ``mpi_rank()``). ``llm_args``
    is one object for every rank, so it never says which rank this process is."""
    from .engine.runtime import runtime_rank

    size = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
    return size, runtime_rank()


def fingerprint_of(
    pool: PagePool, model_id: str, tp_size: int, tp_rank: int, heads: HeadGeometry | None = None
) -> Fingerprint:
    """Who ``pool`` makes us. With ``heads`` (the rank's KV heads, located in its pages)
    each group's page bytes are the whole model's, every KV head's (the same on every TP
    size), and the fingerprint states the model's KV head count."""
    scale = (1, 1) if heads is None else (heads.num_kv_heads, len(heads.held))
    return Fingerprint(
        model=model_id,
        dtype=dtype_name(pool.dtype),
        tokens_per_block=pool.tokens_per_block,
        groups=[
            GroupGeometry(
                group_id=g.group_id,
                window=g.window,
                bytes_per_page=g.page_bytes * scale[0] // scale[1],
                num_layers=len(g.layer_ids),
            )
            for g in pool.groups
        ],
        tp_size=tp_size,
        tp_rank=tp_rank,
        num_kv_heads=0 if heads is None else heads.num_kv_heads,
    )


@dataclass(frozen=True)
class RequestIdentity:
    """What besides its tokens decides a request's KV: its cache salt, its LoRA
    adapter, and its multimodal inputs (images whose placeholder tokens are equal give
    different KV). Requests whose identities differ never share block keys, so KV computed
    under one adapter or image is never loaded for another: that is a miss, not a wrong
    token. Coarse on purpose for multimodal requests: the digest covers every input of the
    request, so such requests share blocks only with requests of the same inputs."""

    cache_salt: str | None = None  # the salt's id (``salt_token``), decimal
    lora_id: int | None = None
    mm_digest: str | None = None


def cache_salt_id(salt: str) -> int:
    """TensorRT-LLM's id of a cache salt (``get_cache_salt_id``: the first 8 bytes of its
    BLAKE3 digest, little-endian). The C++-bound request a V1 engine hands the scheduler
    carries only this id; the Python request and ``RequestData`` carry the string."""
    import blake3

    return int.from_bytes(blake3.blake3(salt.encode("utf-8")).digest(length=8), "little")


def salt_token(request: Any) -> str | None:
    """The request's cache salt as its id (decimal), from ``cache_salt_id`` or
    ``cache_salt``, whichever the object carries: both forms key the same blocks."""
    sid = _attr(request, "cache_salt_id")
    if sid is None:
        salt = _attr(request, "cache_salt")
        if salt is None:
            return None
        sid = cache_salt_id(str(salt))
    return str(int(sid))


def request_identity(request: Any) -> RequestIdentity:
    """The identity of an engine request, from the attributes TensorRT-LLM's ``LlmRequest``
    binds (``cache_salt_id`` or ``cache_salt``, ``lora_task_id``, ``multimodal_hashes``/
    ``_positions``/``_lengths``); absent or None attributes count as "none"."""
    lora = _attr(request, "lora_task_id")
    return RequestIdentity(
        cache_salt=salt_token(request),
        lora_id=None if lora is None else int(lora),
        mm_digest=multimodal_digest(
            _attr(request, "multimodal_hashes"),
            _attr(request, "multimodal_positions"),
            _attr(request, "multimodal_lengths"),
        ),
    )


def multimodal_digest(hashes: Any, positions: Any = None, lengths: Any = None) -> str | None:
    """One digest of a request's multimodal inputs (their content hashes, and where they sit
    in the prompt), or None for a text-only request."""
    if hashes is None or len(hashes) == 0:
        return None
    canon = json.dumps(
        [_ints(hashes), _ints(positions), _ints(lengths)], separators=(",", ":")
    ).encode()
    return xxhash.xxh3_128_hexdigest(canon)


def _ints(x: Any) -> Any:
    """Nested lists of ints (tensors and tuples as lists), for a canonical JSON form."""
    if x is None:
        return None
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [_ints(v) for v in x]
    return int(x)


def _attr(request: Any, name: str) -> Any:
    try:  # a nanobind property may raise for a field the request does not carry
        return getattr(request, name, None)
    except Exception:
        return None


def namespace_of(fp: Fingerprint, ident: RequestIdentity | None = None) -> Namespace:
    """The key namespace of ``fp``'s pages. Where ``fp`` states the KV head count, keys do
    not depend on the TP shard (``tp_size`` 0 in the seed): every rank of every TP size
    stores its heads of a block under the block's one key."""
    ident = ident or RequestIdentity()
    by_heads = fp.num_kv_heads > 0
    return Namespace(
        model_fingerprint=fp.model,
        dtype=fp.dtype,
        tokens_per_block=fp.tokens_per_block,
        group_page_bytes=tuple(g.bytes_per_page for g in fp.groups),
        tp_size=0 if by_heads else fp.tp_size,
        tp_rank=0 if by_heads else fp.tp_rank,
        cache_salt=ident.cache_salt,
        lora_id=ident.lora_id,
        mm_digest=ident.mm_digest,
    )
