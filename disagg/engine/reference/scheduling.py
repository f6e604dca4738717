"""The reference engine's scheduling policy, as TensorRT-LLM's capacity and micro-batch
schedulers apply it: how many blocks a request's lifetime needs, whether the pools can
admit it now (GUARANTEED_NO_EVICT), how large its next context chunk is (first come, first
served), and how much of a connector's offer the runtime consumes. Pure functions of the
engine's config and state; the executor (``executor.py``) calls them every iteration."""

from __future__ import annotations

from collections.abc import Iterable

from .config import EngineConfig
from .kv_cache import KvCacheManager
from .requests import Request


def lifetime_blocks(cfg: EngineConfig, req: Request) -> int:
    """Blocks per layer group that the request's prompt and every new token need."""
    return -(-(req.prompt_len + req.max_new_tokens) // cfg.tokens_per_block)


def fits(cfg: EngineConfig, kv: KvCacheManager, active: Iterable[Request], req: Request) -> bool:
    """Whether the pools can hold the request's whole lifetime now, counting what
    ``active`` requests may still grow into (GUARANTEED_NO_EVICT); one that never can
    was refused by ``add_request``."""
    need = lifetime_blocks(cfg, req)
    running = list(active)
    for gid, g in enumerate(kv.groups):
        outstanding = sum(max(0, lifetime_blocks(cfg, r) - len(r.pages[gid])) for r in running)
        if g.available() - outstanding < need:
            return False
    return True


def chunk(cfg: EngineConfig, req: Request, budget: int) -> int:
    """This iteration's context chunk: what is left of the prompt, at most ``chunk_size``;
    cut to whole blocks of what is left of the token budget if it does not fit
    (TensorRT-LLM's first-come-first-served chunking). 0: not this time."""
    size = req.context_remaining_length
    if cfg.chunk_size is not None:
        size = min(size, cfg.chunk_size)
    if size > budget:
        size = budget // cfg.tokens_per_block * cfg.tokens_per_block
    return size


def honoured(cfg: EngineConfig, offered: int) -> int:
    """How much of a connector's offer the runtime consumes: all of it, except V2 under
    ``honour_cap_tokens`` (block-aligned)."""
    cap, tpb = cfg.honour_cap_tokens, cfg.tokens_per_block
    if cap is None or cfg.kv_manager == "v1":
        return offered
    return min(offered, cap // tpb * tpb)
