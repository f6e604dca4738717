"""CLI: ``python -m disagg.engine.reference [--connector-module M --connector-scheduler-class S
--connector-worker-class W] [model/cache/scheduling flags] [--json]``.

Without a connector it runs monolithic. ``--json`` prints one JSON object on the last line
of stdout: ``outputs`` (generated ids per prompt), ``errors``, ``connector_matched_tokens``,
``device_matched_tokens``, ``calls`` and the other ``EngineStats`` fields. ``--dump-pages F``
(with capture on) writes ``torch.save`` of ``[{"loaded": {"g:o": uint8 tensor},
"computed": {...}}]`` per prompt, for byte comparisons.

``--mpi`` (under ``mpirun -n TP``): every rank its own process (``mpi.MpiComm`` over
COMM_WORLD, whose size must be ``--tp``); rank 0 prints, rank r > 0 dumps pages to ``F.r``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from ...cliargs import Parser, usage
from .cli_checks import config_from_args, problem
from .config import RUNTIMES, ConnectorSpec
from .executor import Engine


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m disagg.engine.reference", description=__doc__)
    p.add_argument("--connector-module")
    p.add_argument("--connector-scheduler-class")
    p.add_argument("--connector-worker-class")
    p.add_argument("--connector-extra", default="{}", help="JSON dict passed as llm_args.disagg")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--windows", default="full", help="comma list per layer: full or a token count")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--kv-manager", choices=("v1", "v2"), default="v1")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the overlap scheduler (TensorRT-LLM's default: on)",
    )
    p.add_argument(
        "--runtime",
        choices=sorted(RUNTIMES),
        default=None,
        help="behave as this TensorRT-LLM line where lines differ (default: the loaded "
        "connector package's, else main)",
    )
    p.add_argument(
        "--connector-manager",
        choices=("reference", "trtllm"),
        default="reference",
        help="trtllm: drive the connector through TensorRT-LLM's own manager (needs "
        "tensorrt_llm or DISAGG_TRTLLM_SRC)",
    )
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument(
        "--max-num-tokens", type=int, default=8192, help="tokens one forward computes at most"
    )
    p.add_argument("--max-batch-size", type=int, default=2048, help="requests one forward holds")
    p.add_argument("--no-block-reuse", action="store_true")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--prompt", default=None, help="comma list of token ids")
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--cache-salt", default=None)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--dump-pages", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--mpi", action="store_true", help="one TP rank per process (mpirun -n TP)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    bad = problem(a)
    if bad is not None:
        return usage("python -m disagg.engine.reference", bad)
    names = (a.connector_module, a.connector_scheduler_class, a.connector_worker_class)
    if any(names) and not all(names):
        print("error: give all three --connector-* options or none", file=sys.stderr)
        return 2
    cfg = config_from_args(a)
    spec = (
        ConnectorSpec(names[0], names[1], names[2], json.loads(a.connector_extra))
        if all(names)
        else None
    )
    if a.prompt:
        prompts = [[int(t) for t in a.prompt.split(",") if t.strip()]] * a.num_prompts
    else:
        rng = random.Random(a.seed)
        prompts = [
            [rng.randrange(cfg.vocab_size) for _ in range(a.prompt_len)]
            for _ in range(a.num_prompts)
        ]
    comm = None
    if a.mpi:
        from .mpi import MpiComm

        comm = MpiComm()
        if comm.size != cfg.tp:
            print(f"error: mpirun -n {comm.size}, but --tp {cfg.tp}", file=sys.stderr)
            return 2
        if comm.rank and a.dump_pages:
            a.dump_pages = f"{a.dump_pages}.{comm.rank}"
    t0 = time.perf_counter()
    eng = Engine(cfg, spec, comm=comm)
    ids = [eng.add_request(p, a.max_tokens, a.cache_salt) for p in prompts]
    while eng.has_work():
        eng.step()
    elapsed = time.perf_counter() - t0
    outputs = [eng.results[i].tokens for i in ids]
    errors = [eng.results[i].error for i in ids]
    if a.dump_pages:
        import torch

        def conv(d: dict[tuple[int, int], bytes]) -> dict[str, torch.Tensor]:
            return {
                f"{g}:{o}": torch.frombuffer(bytearray(b), dtype=torch.uint8)
                for (g, o), b in d.items()
            }

        torch.save(
            [
                {
                    "loaded": conv(eng.results[i].loaded_pages),
                    "computed": conv(eng.results[i].computed_pages),
                }
                for i in ids
            ],
            a.dump_pages,
        )
    out = {
        "outputs": outputs,
        "errors": errors,
        "elapsed_s": round(elapsed, 4),
        "per_request_connector_matched": [eng.results[i].connector_matched_tokens for i in ids],
        **eng.stats.as_dict(),
    }
    if comm is not None and comm.rank != 0:
        pass  # rank 0 answers
    elif a.json:
        print(json.dumps(out))
    else:
        for i, (o, e) in enumerate(zip(outputs, errors, strict=True)):
            print(f"prompt {i}: {'ERROR ' + e if e else o}")
        print(
            f"connector_matched_tokens={out['connector_matched_tokens']} "
            f"device_matched_tokens={out['device_matched_tokens']} elapsed={elapsed:.3f}s"
        )
    return 1 if any(errors) else 0


if __name__ == "__main__":
    sys.exit(main())
