"""``disagg demo``'s options and their checks: every bad value is refused here, in the
parent, before any process starts (one line naming the option; exit status 2)."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from ..cliargs import (
    Parser,
    UsageError,
    cuda_problem,
    non_negative_int,
    positive_int,
    transport,
)

MAX_SEQ_LEN = 8192  # the reference engine's default (EngineConfig.max_seq_len)
DESCRIPTION = """\
Runs N producer (prefill) and M consumer (decode) processes of the reference engine on
this machine, wired through the real control and data planes, and checks the result
against a monolithic run: every request's tokens, and every page a consumer loaded
against the page computed locally, byte for byte. No proxy: the demo routes each prompt
itself, so that every consumer loads from every producer.

examples:
  disagg demo
  disagg demo --producers 2 --consumers 2
  disagg demo --tp 2 --sync
  disagg demo --tp-producer 4 --tp-consumer 2 --kv-heads 4
  disagg demo --windows 64,64,full --kv-manager v2 --chunk-size 48
  disagg demo --layers 3 --tokens-per-block 16 --kv-manager v1 --num-prompts 3 --json
"""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="disagg demo", description=DESCRIPTION)
    shape = p.add_argument_group("deployment")
    shape.add_argument("--producers", type=positive_int, default=1, help="producer processes")
    shape.add_argument("--consumers", type=positive_int, default=1, help="consumer processes")
    shape.add_argument(
        "--tp", type=positive_int, default=1, help="tensor parallel ranks of every instance"
    )
    shape.add_argument(
        "--tp-producer",
        type=positive_int,
        default=None,
        help="tensor parallel ranks of the producers (default: --tp)",
    )
    shape.add_argument(
        "--tp-consumer",
        type=positive_int,
        default=None,
        help="tensor parallel ranks of the consumers (default: --tp)",
    )
    shape.add_argument(
        "--transport", type=transport, default="tcp", help="data plane: tcp, ucx, ipc or nixl"
    )
    shape.add_argument(
        "--sync",
        action="store_const",
        const="sync",
        dest="load_mode",
        default=argparse.SUPPRESS,
        help="layer-wise loads (consumer load_mode: sync); same as --load-mode sync",
    )
    shape.add_argument(
        "--load-mode",
        choices=["auto", "async", "sync"],
        default="auto",
        help="consumer load_mode: async loads whole pages, sync streams them layer by layer",
    )
    shape.add_argument(
        "--store-device",
        choices=["cpu", "pinned", "cuda"],
        default="cpu",
        help="where the producers' block stores live (pinned and cuda need CUDA)",
    )
    work = p.add_argument_group("prompts")
    work.add_argument(
        "--prompts",
        "--num-prompts",
        dest="prompts",
        type=positive_int,
        default=None,
        help="number of prompts (default: 4, or producers x consumers if more, so that "
        "every consumer loads from every producer)",
    )
    work.add_argument(
        "--prompt-len",
        type=positive_int,
        default=512,
        help=f"tokens per prompt; the first half is shared by all prompts. More than "
        f"--tokens-per-block, and prompt + --max-tokens at most {MAX_SEQ_LEN}",
    )
    work.add_argument("--max-tokens", type=positive_int, default=16, help="tokens to generate")
    work.add_argument(
        "--cache-salt", default=None, help="cache_salt of every request (a separate namespace)"
    )
    work.add_argument("--seed", type=non_negative_int, default=0, help="weights and prompts seed")
    eng = p.add_argument_group("reference engine (the same on every instance)")
    eng.add_argument("--layers", type=positive_int, default=4, help="model layers")
    eng.add_argument(
        "--kv-heads",
        type=positive_int,
        default=2,
        help="KV heads of the model (each TP size must divide it, or be a multiple of it)",
    )
    eng.add_argument("--tokens-per-block", type=positive_int, default=32, help="KV block size")
    eng.add_argument("--kv-manager", choices=["v1", "v2"], default="v2", help="KV cache manager")
    eng.add_argument(
        "--windows",
        default="full",
        help="attention window per layer, repeated over the layers: 'full' or a token "
        "count, e.g. 64,full (more than one distinct window is VSWA: needs --kv-manager v2)",
    )
    eng.add_argument(
        "--chunk-size",
        type=positive_int,
        default=None,
        help="chunked prefill: tokens per forward pass and request (default: whole prompt)",
    )
    eng.add_argument("--device", default="cpu", help="reference engine device: cpu, cuda or cuda:N")
    out = p.add_argument_group("output")
    out.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object as the last stdout line (the table goes to stderr)",
    )
    out.add_argument(
        "--debug", action="store_true", help="tracebacks and the processes' logs on failure"
    )
    return p


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields of every instance (and of the monolithic run)."""
    from ..engine.reference import parse_windows

    try:
        windows = parse_windows(a.windows)
    except ValueError:
        raise UsageError(
            "--windows", a.windows, "give 'full' or token counts, comma-separated, e.g. 64,full"
        ) from None
    blocks_per_req = -(-(a.prompt_len + a.max_tokens) // a.tokens_per_block) + 1
    return dict(
        num_layers=a.layers,
        tokens_per_block=a.tokens_per_block,
        # every request of a run in the cache at once, with room to spare
        num_blocks=max(256, 2 * blocks_per_req * a.prompts),
        kv_manager=a.kv_manager,
        windows=windows,
        chunk_size=a.chunk_size,
        num_kv_heads=a.kv_heads,
        # query heads: a multiple of the KV heads and of every TP size (powers of two)
        num_heads=max(4, a.kv_heads, a.tp_producer, a.tp_consumer),
        tp=a.tp_consumer,
        seed=a.seed,
        device=a.device,
        max_seq_len=MAX_SEQ_LEN,
    )


def check(a: argparse.Namespace) -> dict[str, Any]:
    """Refuse what cannot run (``UsageError``); returns the EngineConfig fields (those of
    the consumers and the monolithic run; producers differ by ``tp_producer`` only)."""
    a.tp_producer = a.tp_producer or a.tp
    a.tp_consumer = a.tp_consumer or a.tp
    pairs = a.producers * a.consumers
    if a.prompts is None:
        a.prompts = max(4, pairs)
    elif a.prompts < pairs:
        raise UsageError(
            "--prompts",
            a.prompts,
            f"at least producers x consumers = {pairs}, so that every consumer loads from "
            "every producer",
        )
    if a.prompt_len + a.max_tokens > MAX_SEQ_LEN:
        raise UsageError(
            "--prompt-len",
            a.prompt_len,
            f"prompt + --max-tokens ({a.max_tokens}) must be at most the engine's max_seq_len "
            f"{MAX_SEQ_LEN}: use --prompt-len {MAX_SEQ_LEN - a.max_tokens} or less",
        )
    if a.prompt_len <= a.tokens_per_block:
        raise UsageError(
            "--prompt-len",
            a.prompt_len,
            f"shorter than one KV block plus a token (--tokens-per-block {a.tokens_per_block}): "
            f"only whole blocks move, so nothing would; use --prompt-len "
            f"{a.tokens_per_block + 1} or more",
        )
    for opt, dev in (("--device", a.device), ("--store-device", a.store_device)):
        if opt == "--store-device" and dev in ("pinned", "cuda"):
            dev = "cuda"  # pinned host memory needs the CUDA runtime too
        why = cuda_problem(dev)
        if why is not None:
            raise UsageError(opt, getattr(a, opt[2:].replace("-", "_")), why)
    if a.transport == "ucx" and importlib.util.find_spec("ucxx") is None:
        raise UsageError(
            "--transport", "ucx", 'needs the ucxx package: pip install -e ".[ucx]"; or use tcp'
        )
    if a.transport == "nixl":
        from ..transport.nixl import agent

        if not agent.available():
            raise UsageError(
                "--transport", "nixl", 'needs NIXL: pip install -e ".[nixl]"; or use tcp'
            )
    from ..engine.reference import EngineConfig

    heads = a.kv_heads
    for opt, tp in (("--tp-producer", a.tp_producer), ("--tp-consumer", a.tp_consumer)):
        if heads % tp and tp % heads:
            ok = [t for t in (1, 2, 4, 8, 16) if heads % t == 0 or t % heads == 0]
            raise UsageError(
                opt if tp != a.tp else "--tp",
                tp,
                f"the model's {heads} KV heads (--kv-heads) must split evenly over the ranks, "
                f"or each head sit on as many ranks: use one of {ok}",
            )
    kw = engine_kwargs(a)

    try:
        cfg = EngineConfig(**kw)
    except ValueError as e:
        msg = str(e).removeprefix("EngineConfig: ")
        if "tp" in msg:
            raise UsageError("--tp", a.tp, msg) from None
        raise UsageError("--windows" if "window" in msg else "--layers", "", msg) from None
    if a.kv_manager == "v1" and len(cfg.layer_groups) > 1:
        raise UsageError(
            "--windows",
            a.windows,
            f"{len(cfg.layer_groups)} distinct attention windows (VSWA) need --kv-manager v2; "
            "the V1 manager describes one pool to a connector",
        )
    return kw
