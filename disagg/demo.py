"""``disagg demo``: a producer process and a consumer process on the reference engine.

The producer prefills the prompts (``max_tokens=1``) and keeps its block store serving;
the consumer generates from the same prompts, claiming and loading the producer's pages
over the real control and data planes. The parent runs the same prompts monolithically
and checks the tokens match, token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompts(n: int, length: int, seed: int, vocab: int = 512) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(length // 2)]  # a common system prompt
    return [shared + [rng.randrange(vocab) for _ in range(length - len(shared))] for _ in range(n)]


def _engine(args: argparse.Namespace, role: str | None, endpoint: str) -> Any:
    from .engine.reference import ConnectorSpec, Engine, EngineConfig, parse_windows

    cfg = EngineConfig(
        num_layers=4,
        tokens_per_block=32,
        num_blocks=1024,
        kv_manager=args.kv_manager,
        windows=parse_windows(args.windows),
        seed=args.seed,
        device=args.device,
    )
    if role is None:
        return Engine(cfg)
    section: dict[str, Any]
    if role == "producer":
        section = {"control": endpoint, "store_size": "256MiB", "store_device": args.store_device}
    else:
        section = {"producers": [endpoint], "load_mode": args.load_mode}
    config = {
        "role": role,
        "instance_id": f"demo-{role}",
        "transport": args.transport,
        role: section,
    }
    spec = ConnectorSpec(
        f"disagg.{role}",
        f"{role.capitalize()}Scheduler",
        f"{role.capitalize()}Worker",
        extra={"config": config},
    )
    return Engine(cfg, connector=spec)


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def run_producer(args: argparse.Namespace) -> None:
    from .producer.service import _services

    eng = _engine(args, "producer", args.endpoint)
    prompts = _prompts(args.prompts, args.prompt_len, args.seed)
    t0 = time.perf_counter()
    eng.generate(prompts, max_tokens=1)
    svc = next(iter(_services.values()))
    _emit(
        {
            "ready": True,
            "prefill_s": time.perf_counter() - t0,
            "stored_blocks": len(svc.store.keys()),
            "block_bytes": svc.store.block_bytes,
        }
    )
    sys.stdin.read()  # serve until the parent closes our stdin
    _emit(
        {
            "metrics": dict(svc.metrics),
            "leases_active": svc.leases.active(),
            "pinned_blocks": svc.store.pinned_blocks(),
        }
    )
    svc.close()


def run_consumer(args: argparse.Namespace) -> None:
    from .consumer.service import _services

    eng = _engine(args, "consumer", args.endpoint)
    prompts = _prompts(args.prompts, args.prompt_len, args.seed)
    t0 = time.perf_counter()
    outputs = eng.generate(prompts, max_tokens=args.max_tokens)
    svc = next(iter(_services.values()))
    svc.close()
    _emit(
        {
            "outputs": outputs,
            "generate_s": time.perf_counter() - t0,
            "metrics": dict(svc.metrics),
            "connector_matched_tokens": eng.stats.connector_matched_tokens,
            "computed_tokens": eng.stats.computed_tokens,
        }
    )


def _child(role: str, args: argparse.Namespace, endpoint: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "disagg.demo",
        "--role",
        role,
        "--endpoint",
        endpoint,
        "--prompts",
        str(args.prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--max-tokens",
        str(args.max_tokens),
        "--seed",
        str(args.seed),
        "--transport",
        args.transport,
        "--kv-manager",
        args.kv_manager,
        "--windows",
        args.windows,
        "--load-mode",
        args.load_mode,
    ]
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def _read_json(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"demo: the {what} process exited (rc={proc.wait()}) before reporting")


def run_parent(args: argparse.Namespace) -> int:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    print(
        f"disagg demo: reference engine, {args.prompts} prompts of {args.prompt_len} tokens, "
        f"{args.max_tokens} new tokens, transport={args.transport}, kv={args.kv_manager}, "
        f"windows={args.windows}"
    )
    producer = _child("producer", args, endpoint)
    try:
        ready = _read_json(producer, "producer")
        print(
            f"  producer  prefilled in {ready['prefill_s']:.2f}s; store holds "
            f"{ready['stored_blocks']} blocks of {ready['block_bytes']} B, serving {endpoint}"
        )
        consumer = _child("consumer", args, endpoint)
        result = _read_json(consumer, "consumer")
        consumer.wait(timeout=60)
    finally:
        if producer.stdin:
            producer.stdin.close()
    final = _read_json(producer, "producer")
    producer.wait(timeout=60)

    mono = _engine(args, None, "").generate(
        _prompts(args.prompts, args.prompt_len, args.seed), max_tokens=args.max_tokens
    )
    cm, pm = result["metrics"], final["metrics"]
    mb = pm.get("bytes_pushed", 0) / 1e6
    print(
        f"  consumer  claimed {cm.get('claims_hit', 0)} prefixes, loaded "
        f"{cm.get('pages_loaded', 0)} pages ({result['connector_matched_tokens']} prompt "
        f"tokens) and computed {result['computed_tokens']} tokens itself, "
        f"in {result['generate_s']:.2f}s"
    )
    print(
        f"  moved     {pm.get('pages_pushed', 0)} pages, {mb:.1f} MB over {args.transport}; "
        f"leases left {final['leases_active']}, pinned blocks left {final['pinned_blocks']}"
    )
    same = result["outputs"] == mono
    for i, (a, b) in enumerate(zip(result["outputs"], mono)):
        print(
            f"  prompt {i}: disaggregated {a[:8]}... monolithic {b[:8]}... "
            f"{'match' if a == b else 'MISMATCH'}"
        )
    moved = result["connector_matched_tokens"] > 0
    print(f"tokens match monolithic: {same}; pages moved: {moved}")
    return 0 if same and moved else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="disagg demo", description=__doc__)
    p.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transport", choices=["zmq", "ucx", "ipc"], default="zmq")
    p.add_argument("--kv-manager", choices=["v1", "v2"], default="v2")
    p.add_argument(
        "--windows",
        default="full",
        help="per-layer windows, e.g. 'full' or '64,full' (VSWA, needs v2)",
    )
    p.add_argument("--load-mode", choices=["async", "sync"], default="async")
    p.add_argument("--device", default="cpu", help="reference engine device: cpu or cuda")
    p.add_argument(
        "--store-device",
        choices=["cpu", "pinned", "cuda"],
        default="cpu",
        help="where the producer's block store lives",
    )
    args = p.parse_args(argv)
    if args.role == "producer":
        run_producer(args)
        return 0
    if args.role == "consumer":
        run_consumer(args)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
