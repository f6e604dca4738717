"""``disagg bench engine``: one reference-engine instance's own throughput (no connector, no
HTTP), against the device's ceilings measured in the same run.

    disagg bench engine [--streams 1,8,32,64] [--context 2048] [--steps 32]
                        [--prefill-lens 4096,12288] [--mixed-prompt 4096] [--repeats 3]
                        [--layers 4 --hidden-size 128 ... --max-num-tokens 8192
                         --max-batch-size 2048 --dtype float32 --device cpu|cuda[:N]]
                        [--quick] [--json]

Rows:

- **decode S**: S requests of ``--context`` fresh random prompt tokens, prefilled first (not
  timed), then ``--steps`` decode steps timed one by one (each one forward over S
  tokens): step ms (median), output tokens/s (S x steps / their total time), peak device
  memory in the row and what the forward added to it (peak minus what was allocated
  before: activations, gathered keys, indices);
- **prefill N**: a fresh N-token prompt to its first token (median of ``--repeats``, after
  one warm-up of the same length), and how many forwards the token budget cut it into;
- **mixed**: ``min(32, max S)`` streams decoding while one ``--mixed-prompt`` prompt arrives:
  the median step with a chunk of that prompt in it against the median step without, the
  delay a long prompt adds to the decode steps batched with it (what disaggregation
  removes).

Ceilings, measured here first: the device's copy bandwidth (GB/s counting bytes read and
written) and its matrix rate (TFLOP/s of a ``[4096, hidden] x [hidden, intermediate]``
product in the engine's dtype). ``roofline`` = the row's minimal time at those rates (a
decode step: every weight and the KV it attends read once; a prefill: its matrix FLOPs and
causal attention) over its measured time. ``target``: the issue's figures for README's 1B
bf16 shape on CUDA (one stream's step <= 8 ms, 32 streams >= 2,000 tokens/s, a 12k prefill
<= 80 ms), shown for that shape only. ``--kernels``: one layer's attention each way it
could be computed (``disagg.bench.attention``), ms per call. ``--quick``: a 2-layer shape, 1 and 4 streams of 64
tokens, 4 steps, prefills of 128 and 256 (CI's form, seconds on a CPU). ``--json``: one
object on the last line of stdout, ``{"results": [...], "ceilings": {...}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..serve import SHAPE_FLAGS, add_shape_args, shape_error, shape_kwargs
from .reuse import OneLineParser

QUICK = {
    "layers": 2,
    "hidden_size": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
}
# README's 1B bf16 shape (EngineConfig fields) and the targets for it on CUDA
TARGET_SHAPE = {
    "num_layers": 16,
    "hidden_size": 2048,
    "num_heads": 16,
    "num_kv_heads": 8,
    "head_dim": 128,
    "intermediate_size": 8192,
    "dtype": "bfloat16",
}
TARGETS = {("decode", 1): ("step_ms", "<=", 8.0), ("decode", 32): ("tokens_s", ">=", 2000.0)}
PREFILL_TARGETS = {12288: ("ms", "<=", 80.0)}


def _ints(text: str, flag: str, low: int) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < low:
        raise ValueError(f"{flag} {text!r}: expected comma-separated counts >= {low}, e.g. 1,8")
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def ceilings(device: str, dtype: Any, hidden: int, inter: int) -> dict[str, float]:
    """Copy GB/s (read + written) and matrix TFLOP/s on ``device``, medians of 5 after a
    warm-up."""
    import torch

    dev = torch.device(device)
    n = (1 << 28) if dev.type == "cuda" else (1 << 25)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    a = torch.randn(4096, hidden, device=dev).to(dtype)
    b = torch.randn(hidden, inter, device=dev).to(dtype)

    def timed(fn: Any) -> float:
        fn()
        _sync(device)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    copy_s = timed(lambda: dst.copy_(src))
    mm_s = timed(lambda: a @ b)
    return {
        "copy_gbps": 2 * n / copy_s / 1e9,
        "matmul_tflops": 2 * 4096 * hidden * inter / mm_s / 1e12,
    }


class Bench:
    """One engine reused by every row (fresh random prompts, so no prefix is reused)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from ..engine.reference import Engine, EngineConfig

        kw = shape_kwargs(args)
        tpb = kw["tokens_per_block"]
        streams = max(args.streams)
        per_stream = args.context + self.decode_tokens(streams, args, kw["max_num_tokens"])
        longest = max(per_stream, max(args.prefill) + 2, args.mixed_prompt + 64)
        need = streams * -(-per_stream // tpb) + 2 * -(-longest // tpb)
        kw["num_blocks"] = max(kw["num_blocks"], need)
        kw["max_seq_len"] = max(kw["max_seq_len"], longest)
        self.cfg = EngineConfig(kv_manager="v2", **kw)
        self.eng = Engine(self.cfg)
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        self.cuda = self.cfg.device.startswith("cuda")
        self.torch = torch
        c = self.cfg
        per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        per_layer += (
            c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        )
        self.matrix_params = c.num_layers * per_layer
        self.elt = torch.tensor([], dtype=c.torch_dtype).element_size()

    @staticmethod
    def decode_tokens(streams: int, args: argparse.Namespace, budget: int) -> int:
        """Tokens a decode row's stream asks for: enough to decode through the steps in
        which the others still prefill (the budget cuts their prompts into several
        forwards), the warm-up and the timed steps; the rest is cancelled."""
        prefill_steps = -(-streams * args.context // max(1, budget - streams)) + 2
        return prefill_steps + 2 + args.steps + 1

    def prompt(self, n: int) -> list[int]:
        return self.rng.integers(0, self.cfg.vocab_size, size=n).tolist()

    def decode(self, streams: int, ceil: dict[str, float]) -> dict[str, Any]:
        a, eng, torch = self.args, self.eng, self.torch
        warm = 2
        want = self.decode_tokens(streams, a, self.cfg.max_num_tokens)
        ids = [eng.add_request(self.prompt(a.context), want) for _ in range(streams)]
        while any(not eng.results[i].tokens for i in ids):
            eng.step()
        for _ in range(warm):
            eng.step()
        if self.cuda:
            _sync(self.cfg.device)
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if self.cuda else None
        bad = [eng.results[i].error for i in ids if eng.results[i].error]
        for i in ids:
            eng.cancel(i)
        while eng.has_work():
            eng.step()
        if bad:
            raise RuntimeError(f"a decode request failed: {bad[0]}")
        step = statistics.median(times)
        c = self.cfg
        kv = streams * (a.context + warm + a.steps // 2) * c.num_layers * 2
        kv_bytes = kv * c.num_kv_heads * c.head_dim * self.elt
        floor = (self.matrix_params * self.elt + kv_bytes) / (ceil["copy_gbps"] * 1e9)
        row = {
            "kind": "decode",
            "streams": streams,
            "context": a.context,
            "step_ms": step * 1e3,
            "tokens_s": streams * len(times) / sum(times),
            "roofline": floor / step,
        }
        if peak is not None:
            row["peak_gib"] = peak / 2**30
            row["forward_gib"] = (peak - base) / 2**30
        return row

    def prefill(self, n: int, ceil: dict[str, float]) -> dict[str, Any]:
        eng, times, passes = self.eng, [], 0
        for rep in range(self.args.repeats + 1):  # the first is a warm-up
            before = eng.stats.forward_passes
            t0 = time.perf_counter()
            rid = eng.add_request(self.prompt(n), 1)
            while not eng.results[rid].finished:
                eng.step()
            if rep:
                times.append(time.perf_counter() - t0)
                passes = eng.stats.forward_passes - before
            while eng.has_work():
                eng.step()
            if eng.results[rid].error:
                raise RuntimeError(f"the {n}-token prefill failed: {eng.results[rid].error}")
        ms = statistics.median(times) * 1e3
        c = self.cfg
        flops = 2 * n * self.matrix_params + 2 * n * n * c.num_heads * c.head_dim * c.num_layers
        return {
            "kind": "prefill",
            "tokens": n,
            "ms": ms,
            "forwards": passes,
            "tokens_s": n / ms * 1e3,
            "roofline": flops / (ceil["matmul_tflops"] * 1e12) / (ms / 1e3),
        }

    def mixed(self) -> dict[str, Any]:
        a, eng = self.args, self.eng
        streams = min(32, max(a.streams))
        long_steps = -(-a.mixed_prompt // self.cfg.max_num_tokens) + 8
        ids = [eng.add_request(self.prompt(a.context), long_steps + 8) for _ in range(streams)]
        while any(not eng.results[i].tokens for i in ids):
            eng.step()
        plain: list[float] = []
        with_chunk: list[float] = []
        long_id = -1
        for k in range(long_steps + 4):
            if k == 3:
                long_id = eng.add_request(self.prompt(a.mixed_prompt), 1)
            t0 = time.perf_counter()
            had = k >= 3 and not eng.results[long_id].tokens
            eng.step()
            (with_chunk if had else plain).append(time.perf_counter() - t0)
        for i in ids:
            eng.cancel(i)
        while eng.has_work():
            eng.step()
        return {
            "kind": "mixed",
            "streams": streams,
            "prompt": a.mixed_prompt,
            "plain_step_ms": statistics.median(plain) * 1e3,
            "chunk_step_ms": statistics.median(with_chunk) * 1e3,
            "chunk_steps": len(with_chunk),
        }


def _target(row: dict[str, Any], shape_ok: bool) -> str:
    if not shape_ok:
        return ""
    if row["kind"] == "decode":
        t = TARGETS.get(("decode", row["streams"]))
    elif row["kind"] == "prefill":
        t = PREFILL_TARGETS.get(row["tokens"])
    else:
        t = None
    if t is None:
        return ""
    field, op, value = t
    ok = row[field] <= value if op == "<=" else row[field] >= value
    return f"{'met' if ok else 'MISSED'} ({field} {op} {value:g})"


def table(rep: dict[str, Any]) -> str:
    c = rep["ceilings"]
    lines = [
        f"{rep['model']} {rep['dtype']} on {rep['device']}; attention {rep['attention']}"
        + (f" ({rep['attention_reason']})" if rep["attention_reason"] else "")
        + (
            f"; spans of <= {rep['paged_max_n']} tokens over the pages"
            if rep["paged_max_n"]
            else f"; no paged attention ({rep['paged_reason']})"
        )
        + f"; max_num_tokens {rep['max_num_tokens']}, max_batch_size {rep['max_batch_size']}",
        f"ceilings: copy {c['copy_gbps']:.0f} GB/s, matrix {c['matmul_tflops']:.3g} TFLOP/s",
        f"{'row':<22} {'step/TTFT ms':>12} {'tokens/s':>10} {'roofline':>8} {'peak GiB':>9} "
        f"{'fwd GiB':>8}  target",
    ]
    for r in rep["results"]:
        if r["kind"] == "decode":
            name, ms = f"decode {r['streams']} x {r['context']}", r["step_ms"]
        elif r["kind"] == "prefill":
            name, ms = f"prefill {r['tokens']} ({r['forwards']} fwd)", r["ms"]
        else:
            lines.append(
                f"{'mixed ' + str(r['streams']) + ' + ' + str(r['prompt']):<22} "
                f"decode step {r['plain_step_ms']:.2f} ms alone, {r['chunk_step_ms']:.2f} ms "
                f"with a prompt chunk ({r['chunk_steps']} steps)"
            )
            continue
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        fwd = f"{r['forward_gib']:.2f}" if "forward_gib" in r else "-"
        lines.append(
            f"{name:<22} {ms:>12.2f} {r['tokens_s']:>10.0f} {r['roofline']:>8.2f} {peak:>9} "
            f"{fwd:>8}  {r.get('target', '')}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="disagg bench engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default=None, help="decode rows: concurrent streams")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens of each stream")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per row")
    ap.add_argument("--prefill-lens", default=None, help="prefill rows: prompt tokens")
    ap.add_argument("--mixed-prompt", type=int, default=None, help="the mixed row's prompt")
    ap.add_argument("--repeats", type=int, default=None, help="timed prefills per length")
    add_shape_args(ap, defaults=False)
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="also time one layer's attention each way it could be computed (CUDA)",
    )
    ap.add_argument("--quick", action="store_true", help="CI's size (see the module help)")
    ap.add_argument("--json", action="store_true", help="one JSON object on the last line")
    return ap


def _resolve(args: argparse.Namespace) -> None:
    q = args.quick
    for name, full, quick in (
        ("streams", "1,8,32,64", "1,4"),
        ("prefill_lens", "4096,12288", "128,256"),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    counts: tuple[tuple[str, int, int], ...] = (
        ("context", 2048, 64),
        ("steps", 32, 4),
        ("mixed_prompt", 4096, 128),
        ("repeats", 3, 1),
    )
    for name, full_n, quick_n in counts:
        if getattr(args, name) is None:
            setattr(args, name, quick_n if q else full_n)
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {getattr(args, name)}: expected a count >= 1")
    if q:
        for field, value in QUICK.items():
            if getattr(args, field) is None:
                setattr(args, field, value)
    args.streams = _ints(args.streams, "--streams", 1)
    args.prefill = _ints(args.prefill_lens, "--prefill-lens", 1)
    for flag, (_, default) in SHAPE_FLAGS.items():
        attr = flag[2:].replace("-", "_")
        if getattr(args, attr) is None:
            setattr(args, attr, default)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        _resolve(args)
        from ..engine.reference import EngineConfig

        EngineConfig(kv_manager="v2", **shape_kwargs(args))
    except ValueError as e:
        print(f"disagg bench engine: {shape_error(e)}", file=sys.stderr)
        return 2
    from ..cliargs import cuda_problem

    why = cuda_problem(args.device) if args.device != "cpu" else None
    if why is not None:
        print(f"disagg bench engine: argument --device: {args.device!r}: {why}", file=sys.stderr)
        return 2
    b = Bench(args)
    cfg = b.cfg
    ceil = ceilings(cfg.device, cfg.torch_dtype, cfg.hidden_size, cfg.intermediate_size)
    shape_ok = cfg.device.startswith("cuda") and all(
        getattr(cfg, k) == v for k, v in TARGET_SHAPE.items()
    )
    rows = [b.decode(s, ceil) for s in args.streams]
    rows += [b.prefill(n, ceil) for n in args.prefill]
    rows.append(b.mixed())
    for r in rows:
        r["target"] = _target(r, shape_ok)
    att = b.eng.model.attention
    rep = {
        "results": rows,
        "ceilings": ceil,
        "model": cfg.model_name,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "attention": att.name,
        "attention_reason": att.reason,
        "paged_max_n": b.eng.model.paged_max_n(b.eng.kv),
        "paged_reason": b.eng.model.paged_reason,
        "batch_invariant": cfg.exact_batching,
        "max_num_tokens": cfg.max_num_tokens,
        "max_batch_size": cfg.max_batch_size,
        "num_blocks": cfg.num_blocks,
    }
    print(table(rep), flush=True)
    if args.kernels:
        from .attention import compare

        kernels = compare(b.eng, args.streams, args.context, args.prefill, args.mixed_prompt)
        rep["kernels"] = kernels
        print("one layer's attention, ms per call:")
        for k in kernels:
            cells = [f"{n} {v:.3f}" if isinstance(v, float) else f"{n} {v}" for n, v in k.items()]
            print("  ".join(cells))
    if args.json:
        print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
