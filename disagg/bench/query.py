"""``disagg bench query``: ``get_num_new_matched_tokens`` latency, end to end.

What is timed per call is what the consumer scheduler does (consumer/connector.py):
``block_key_blob`` over the prompt as the engine hands it over (a Python list of ints,
``request_tokens``), then ``ConsumerService.claim`` (a
Claim round trip over the ZMQ control channel to a real ``ProducerService`` in another
process on loopback, whose BlockStore holds every block of the prompt, saved as an engine
saves them: passes of at most ``PASS_TOKENS`` tokens, each taking the next chunk of every
prompt). The lease is released after each call, outside the timed section, and the next
call starts only once the producer has answered that Release (so a claim is never timed
waiting behind a release on the link). Each prompt is a fresh random token sequence. The
first ``--warmup`` calls per prompt are not timed; p50/p99 are over ``--iters`` timed
calls (default 200).

In the same run, for each prompt size: the **floor**, a raw ZMQ DEALER->ROUTER round trip
carrying a frame of the Claim's encoded size to a bare echo loop in another process (what
the claim round trip costs with no work on either side), and a local breakdown: the
Claim's MessagePack encode+decode, a ``BlockStore.pin`` of that many blocks, and the keys
of the same prompt from an int64 array (what the list's conversion costs is the
difference to the timed keys).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cliargs import Parser, int_list, non_negative_int, positive_int
from .units import percentile

_NS = "bench-model"
# Tokens per forward pass when the producer saves the prompts (TensorRT-LLM's default
# max_num_tokens): a long prompt's blocks come from several passes, each shared with the
# other prompts' chunks, as chunked prefill of concurrent requests stores them.
PASS_TOKENS = 8192


def _config(role: str, tpb: int, producers: str | None = None, store_blocks: int = 0) -> Any:
    from ..config import DisaggConfig

    d: dict[str, Any] = {"role": role, "instance_id": f"bench-{role}", "model_id": _NS}
    if role == "producer":
        d["producer"] = {"control": "tcp://127.0.0.1:0", "store_size": store_blocks * 64 * 2}
    else:
        d["consumer"] = {"producers": [producers], "claim_timeout_s": 5.0}
    return DisaggConfig.from_dict(d)


def _pool(tpb: int) -> Any:
    import torch

    from ..pages import PagePool

    # Tiny pages (64 B/block): the benchmark is about the control path, not bytes.
    kv = torch.zeros(64, 1, 2, 16, dtype=torch.float16)
    return PagePool.from_v1_tensor(kv, tpb)


def _producer(tpb: int, prompts: list[np.ndarray], conn: Any) -> None:
    from ..producer.service import ProducerService
    from ..protocol.keys import block_key_blob

    blocks = sum(len(p) // tpb for p in prompts)
    svc = ProducerService(_config("producer", tpb, store_blocks=blocks + 16), None)
    svc.attach(_pool(tpb))
    _save(svc.store, [block_key_blob(svc.namespace_seed(None), p, tpb) for p in prompts], tpb)
    conn.send(svc.endpoint)
    conn.recv()  # until told to stop
    svc.close()


def _save(store: Any, prompts_keys: list[Any], tpb: int) -> None:
    """Store every prompt's blocks in passes of ``PASS_TOKENS`` tokens: pass j plans the
    j-th chunk of every prompt still going, in prompt order (one ``plan`` per pass)."""
    chunk = max(1, PASS_TOKENS // tpb)
    for j in range(max(len(k) for k in prompts_keys) // chunk + 1):
        keys = [k for pk in prompts_keys for k in pk[j * chunk : (j + 1) * chunk]]
        if not keys:
            continue
        rows = store.plan(keys)
        assert (rows >= 0).all(), "store too small for the benchmark prompts"
        store.mark_staging(keys)
        store.commit(keys)


def _echo(conn: Any) -> None:
    """The floor's server: a bare ROUTER echoing a short reply, nothing else running."""
    import zmq

    sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    reply = b"x" * 32  # about a ClaimOk
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == b"stop":
            break
        sock.send_multipart([frames[0], frames[1], reply])
    sock.close()


def _floor_ms(endpoint: str, nbytes: int, iters: int, warmup: int) -> list[float]:
    import zmq

    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    body = b"k" * nbytes
    out = []
    try:
        for i in range(iters + warmup):
            t = time.perf_counter()
            sock.send_multipart([b"corr-id!", body])
            if not sock.poll(5000, zmq.POLLIN):
                raise RuntimeError("floor echo server did not answer")
            sock.recv_multipart()
            if i >= warmup:
                out.append((time.perf_counter() - t) * 1e3)
    finally:
        sock.close()
    return out


def _local_breakdown(seed: bytes, prompt: np.ndarray, tpb: int, iters: int) -> dict[str, float]:
    """Encode+decode of the Claim, pin+unpin on a local store of its blocks, and the keys
    of the prompt from an int64 array (p50 ms)."""
    from ..producer.store import BlockStore
    from ..protocol import messages as m
    from ..protocol.keys import block_key_blob

    keys = block_key_blob(seed, prompt, tpb)
    store = BlockStore(64, 64 * (len(keys) + 1))
    _save(store, [keys], tpb)
    codec, pin, unpin, array_keys = [], [], [], []
    for i in range(min(iters, 100) + 3):
        t0 = time.perf_counter()
        m.decode(m.encode(m.Claim(owner="bench-consumer", request_id=str(i), keys=keys)))
        t1 = time.perf_counter()
        entries = store.pin(keys)
        t2 = time.perf_counter()
        store.unpin(keys, entries)
        t3 = time.perf_counter()
        block_key_blob(seed, prompt, tpb)
        t4 = time.perf_counter()
        if i >= 3:
            codec.append((t1 - t0) * 1e3)
            pin.append((t2 - t1) * 1e3)
            unpin.append((t3 - t2) * 1e3)
            array_keys.append((t4 - t3) * 1e3)
    return {
        "codec_p50_ms": percentile(codec, 50),
        "pin_p50_ms": percentile(pin, 50),
        "unpin_p50_ms": percentile(unpin, 50),
        "array_keys_p50_ms": percentile(array_keys, 50),
    }


def _drain_releases(svc: Any) -> None:
    """Wait until the keepalive thread has sent every queued Release and had its answer."""
    deadline = time.monotonic() + 5
    while svc.keepalive.pending() and time.monotonic() < deadline:
        time.sleep(0.0001)
    for link in svc.links:  # an in-flight Release holds its channel's lock
        if link.bg.lock.acquire(timeout=5):
            link.bg.lock.release()


def run(
    prompt_lens: Sequence[int], tpb: int, iters: int, log: Any = None, warmup: int = 20
) -> dict[str, Any]:
    from ..consumer.service import ConsumerService
    from ..protocol import messages as m
    from ..protocol.keys import block_key_blob

    log = log or sys.stderr
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, n, dtype=np.int64) for n in prompt_lens]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    prod = ctx.Process(target=_producer, args=(tpb, prompts, b), daemon=True)
    prod.start()
    ea, eb = ctx.Pipe()
    echo = ctx.Process(target=_echo, args=(eb,), daemon=True)
    echo.start()
    rows = []
    try:
        if not a.poll(120) or not ea.poll(120):
            raise RuntimeError("producer (or the floor's echo server) did not start")
        endpoint = a.recv()
        echo_endpoint = ea.recv()
        svc = ConsumerService(_config("consumer", tpb, producers=endpoint), None)
        svc.attach(_pool(tpb))
        seed = svc.namespace_seed(None)
        for n, prompt in zip(prompt_lens, prompts, strict=True):
            tot, keyt, claimt = [], [], []
            as_list = prompt.tolist()  # request_tokens() hands the connector a list
            for i in range(iters + warmup):
                t0 = time.perf_counter()
                keys = block_key_blob(seed, as_list, tpb)
                t1 = time.perf_counter()
                claimed = svc.claim(i, keys)
                t2 = time.perf_counter()
                if claimed is None or claimed.num_blocks != len(keys):
                    raise RuntimeError(
                        f"claim for {n} tokens matched {claimed and claimed.num_blocks} of {len(keys)} blocks"
                    )
                svc.release(claimed)
                _drain_releases(svc)
                if i >= warmup:
                    tot.append((t2 - t0) * 1e3)
                    keyt.append((t1 - t0) * 1e3)
                    claimt.append((t2 - t1) * 1e3)
            claim_bytes = len(m.encode(m.Claim(owner=svc.owner, request_id="0", keys=keys)))
            floor = _floor_ms(echo_endpoint, claim_bytes, iters, warmup)
            row = {
                "prompt_tokens": n,
                "blocks": n // tpb,
                "iters": len(tot),
                "p50_ms": percentile(tot, 50),
                "p99_ms": percentile(tot, 99),
                "keys_p50_ms": percentile(keyt, 50),
                "keys_p99_ms": percentile(keyt, 99),
                "claim_p50_ms": percentile(claimt, 50),
                "claim_p99_ms": percentile(claimt, 99),
                "claim_bytes": claim_bytes,
                "floor_p50_ms": percentile(floor, 50),
                "floor_p99_ms": percentile(floor, 99),
                **_local_breakdown(seed, prompt, tpb, iters),
            }
            rows.append(row)
            print(
                f"  {n:7d} tokens: p50 {row['p50_ms']:.3f} ms, p99 {row['p99_ms']:.3f} ms "
                f"(keys {row['keys_p50_ms']:.3f}, claim {row['claim_p50_ms']:.3f} p50; "
                f"raw zmq round trip of {claim_bytes} B: p50 {row['floor_p50_ms']:.3f}, "
                f"p99 {row['floor_p99_ms']:.3f})",
                file=log,
                flush=True,
            )
        svc.close()
    finally:
        a.send("stop")
        _stop_echo(echo_endpoint if "echo_endpoint" in locals() else None)
        for p in (prod, echo):
            p.join(10)
            if p.is_alive():
                p.kill()
    return {
        "bench": "query",
        "tokens_per_block": tpb,
        "iters": iters,
        "warmup": warmup,
        "cpus": os.cpu_count(),
        "results": rows,
    }


def _stop_echo(endpoint: str | None) -> None:
    if endpoint is None:
        return
    import zmq

    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    sock.send_multipart([b"corr-id!", b"stop"])
    sock.close()


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{'prompt':>8s} {'blocks':>7s} {'p50 ms':>8s} {'p99 ms':>8s} {'keys p50':>9s} "
        f"{'claim p50':>10s} {'claim p99':>10s} {'floor p50':>10s} {'floor p99':>10s} "
        f"{'codec p50':>10s} {'pin p50':>8s} {'keys(array) p50':>16s}"
    ]
    for r in report["results"]:
        lines.append(
            f"{r['prompt_tokens']:8d} {r['blocks']:7d} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} "
            f"{r['keys_p50_ms']:9.3f} {r['claim_p50_ms']:10.3f} {r['claim_p99_ms']:10.3f} "
            f"{r['floor_p50_ms']:10.3f} {r['floor_p99_ms']:10.3f} {r['codec_p50_ms']:10.3f} "
            f"{r['pin_p50_ms']:8.3f} {r['array_keys_p50_ms']:16.3f}"
        )
    lines.append(
        f"(ms; {report['iters']} timed calls per prompt after {report['warmup']} warm-up; "
        "floor: raw ZMQ round trip of the Claim's size to a bare echo process; codec: Claim "
        "encode+decode; pin: BlockStore.pin of the prompt's blocks; keys(array): the keys "
        "of the prompt from an int64 array instead of the engine's list; all three local)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    ap = Parser(prog="disagg bench query", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--prompt-lens",
        type=int_list,
        default="1024,8192,32768,131072",
        help="prompt lengths in tokens, comma-separated whole numbers",
    )
    ap.add_argument("--tokens-per-block", type=positive_int, default=16)
    ap.add_argument("--iters", type=positive_int, default=200, help="timed calls per prompt")
    ap.add_argument(
        "--warmup", type=non_negative_int, default=20, help="untimed calls per prompt first"
    )
    ap.add_argument("--json", action="store_true", help="one JSON object on the last stdout line")
    ap.add_argument("--plot", help="write a PNG of latency against prompt length")
    a = ap.parse_args(list(argv))
    short = [n for n in a.prompt_lens if n < a.tokens_per_block]
    if short:
        ap.error(
            f"argument --prompt-lens: {short[0]} is shorter than one block "
            f"(--tokens-per-block {a.tokens_per_block}): nothing to claim"
        )
    report = run(a.prompt_lens, a.tokens_per_block, a.iters, warmup=a.warmup)
    print(table(report))
    if a.plot:
        from .plot import plot_query

        err = plot_query(report, a.plot)
        print(err or f"plot written to {a.plot}", file=sys.stderr)
    if a.json:
        print(json.dumps(report))
    return 0
