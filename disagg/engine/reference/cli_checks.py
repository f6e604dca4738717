"""Up-front checks of ``python -m disagg.engine.reference``'s arguments: a bad value is
one line naming the option and what is accepted (exit status 2), never a traceback from
deep inside the engine."""

from __future__ import annotations

import argparse
import json

from ...cliargs import cuda_problem
from .config import EngineConfig, parse_windows

# EngineConfig field (as its ValueError names it) -> the option that sets it
_FLAGS = {
    "vocab_size": "--vocab",
    "hidden_size": "--hidden",
    "num_layers": "--layers",
    "num_kv_heads": "--kv-heads",
    "num_heads": "--heads",
    "head_dim": "--head-dim",
    "intermediate_size": "--hidden",
    "tokens_per_block": "--tokens-per-block",
    "num_blocks": "--num-blocks",
    "max_seq_len": "--max-seq-len",
    "max_num_tokens": "--max-num-tokens",
    "max_batch_size": "--max-batch-size",
    "chunk_size": "--chunk-size",
    "dtype": "--dtype",
    "window": "--windows",
    "device": "--device",
    "tp": "--tp",
}


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The engine configuration the arguments describe (``ValueError`` naming the field)."""
    return EngineConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        windows=parse_windows(a.windows),
        tokens_per_block=a.tokens_per_block,
        kv_manager=a.kv_manager,
        chunk_size=a.chunk_size,
        tp=a.tp,
        overlap=a.overlap,
        runtime=a.runtime,
        connector_manager=a.connector_manager,
        num_blocks=a.num_blocks,
        max_seq_len=a.max_seq_len,
        max_num_tokens=a.max_num_tokens,
        max_batch_size=a.max_batch_size,
        device=a.device,
        seed=a.seed,
        dtype=a.dtype,
        enable_block_reuse=not a.no_block_reuse,
        capture_pages=a.dump_pages is not None,
    )


def problem(a: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, as one line, or None."""
    for flag, value, low in (
        ("--num-prompts", a.num_prompts, 1),
        ("--max-tokens", a.max_tokens, 1),
        ("--prompt-len", a.prompt_len, 1),
    ):
        if value < low:
            return f"argument {flag}: {value}: give an integer >= {low}"
    try:
        parse_windows(a.windows)
    except ValueError:
        return (
            f"argument --windows: {a.windows!r}: give 'full' or token counts, comma-separated, "
            "e.g. 64,full"
        )
    try:
        extra = json.loads(a.connector_extra)
    except ValueError as e:
        return f"argument --connector-extra: not JSON ({e}); give a JSON object, e.g. '{{}}'"
    if not isinstance(extra, dict):
        return 'argument --connector-extra: give a JSON object, e.g. \'{"config": "p.yaml"}\''
    if a.prompt:
        try:
            tokens = [int(t) for t in a.prompt.split(",") if t.strip()]
        except ValueError:
            return f"argument --prompt: {a.prompt!r}: give token ids, comma-separated, e.g. 1,2,3"
        if not tokens or any(not 0 <= t < a.vocab for t in tokens):
            return f"argument --prompt: token ids must be in [0, {a.vocab}) and not empty"
    why = cuda_problem(a.device)
    if why is not None:
        return f"argument --device: {a.device!r}: {why}"
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        msg = str(e).removeprefix("EngineConfig: ")
        names = [n for n in _FLAGS if msg.startswith(n)] or [n for n in _FLAGS if n in msg]
        flag = "--tp" if "by tp" in msg else _FLAGS[names[0]] if names else "an engine option"
        return f"argument {flag}: {msg}"
    length = len(tokens) if a.prompt else a.prompt_len
    if length + a.max_tokens > cfg.max_seq_len:
        return (
            f"argument --prompt-len: {length}: prompt + --max-tokens ({a.max_tokens}) must be "
            f"at most --max-seq-len {cfg.max_seq_len}"
        )
    if a.connector_module and cfg.kv_manager == "v1" and len(cfg.layer_groups) > 1:
        return (
            f"argument --windows: {a.windows!r}: more than one distinct window (VSWA) with a "
            "connector needs --kv-manager v2"
        )
    return None
