"""The demo's parent: starts the instances, routes the prompts, runs the monolithic
reference and hands everything to :mod:`disagg.demo.report`."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any, TextIO

from . import report
from .nodes import page_digests, run_requests, warm_up

STORE_MIN_BYTES = 64 << 20


class NodeFailed(RuntimeError):
    pass


class Node:
    """One instance process (:mod:`disagg.demo.nodes`); its stderr goes to a file, shown
    when it fails."""

    def __init__(self, role: str, index: int) -> None:
        self.name = f"{role} {index}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.demo.nodes"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def send(self, msg: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((msg if isinstance(msg, str) else json.dumps(msg)) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise NodeFailed(self._died()) from None

    def read(self, key: str, say: Any = None) -> Any:
        """The next message carrying ``key``, whole (progress messages go to ``say``)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if key in msg:
                return msg
            if "progress" in msg and say is not None:
                say(f"  {self.name}: {msg['progress']}")
        raise NodeFailed(self._died())

    def _died(self) -> str:
        rc = self.proc.wait(timeout=30)
        lines = [ln for ln in self.stderr().splitlines() if ln.strip()]
        return f"the {self.name} process exited (rc={rc}): {lines[-1] if lines else 'no output'}"

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def make_prompts(n: int, length: int, seed: int, vocab: int = 512) -> list[list[int]]:
    """``n`` prompts whose first half is shared (a common system prompt)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(length // 2)]
    return [shared + [rng.randrange(vocab) for _ in range(length - len(shared))] for _ in range(n)]


def route(n: int, producers: int, consumers: int) -> list[tuple[int, int]]:
    """(producer, consumer) of each prompt: prompt k prefills on k mod P and decodes on
    (k div P) mod C, so the first P x C prompts use every pair once."""
    return [(k % producers, (k // producers) % consumers) for k in range(n)]


def _store_size(kw: dict[str, Any], prompts: int, prompt_len: int) -> int:
    from ..engine.reference import EngineConfig

    cfg = EngineConfig(**kw)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V
    blocks = -(-prompt_len // cfg.tokens_per_block) * prompts
    return max(STORE_MIN_BYTES, 2 * blocks * cfg.tokens_per_block * per_token)


def run(a: argparse.Namespace, kw: dict[str, Any], out: TextIO) -> dict[str, Any]:
    def say(text: str) -> None:
        print(text, file=out, flush=True)

    prompts = make_prompts(a.prompts, a.prompt_len, a.seed)
    routes = route(a.prompts, a.producers, a.consumers)
    say(
        f"disagg demo: {a.producers} producer(s) x {a.consumers} consumer(s), TP "
        f"{a.tp_producer} -> {a.tp_consumer} ({a.kv_heads} KV heads), "
        f"{a.prompts} prompts of {a.prompt_len} tokens (half shared), {a.max_tokens} new "
        f"tokens; {a.layers} layers, {a.tokens_per_block} tokens per block, kv {a.kv_manager}, "
        f"windows {a.windows}, chunk {a.chunk_size or 'off'}, transport {a.transport}, "
        f"load mode {a.load_mode}"
    )
    common = {
        "engine": dict(kw, windows=list(kw["windows"])),
        "transport": a.transport,
        "cache_salt": a.cache_salt,
        "max_tokens": a.max_tokens,
    }
    mine = {
        role: [[k for k, r in enumerate(routes) if r[j] == i] for i in range(n)]
        for role, j, n in (("producer", 0, a.producers), ("consumer", 1, a.consumers))
    }
    say(f"  starting {a.producers + a.consumers} processes ...")
    producers = [Node("producer", i) for i in range(a.producers)]
    consumers = [Node("consumer", i) for i in range(a.consumers)]
    prod_results: list[dict[str, Any]] = []
    cons_results: list[dict[str, Any]] = []
    finals: list[dict[str, Any]] = []
    try:
        for node in producers + consumers:
            node.read("imported")
        store_size = _store_size(kw, a.prompts, a.prompt_len)
        for i, node in enumerate(producers):
            node.send(
                {
                    **common,
                    "role": "producer",
                    "engine": dict(common["engine"], tp=a.tp_producer),
                    "index": i,
                    "store_size": store_size,
                    "store_device": a.store_device,
                    "prompts": [prompts[k] for k in mine["producer"][i]],
                }
            )
        endpoints = [node.read("ready")["endpoints"] for node in producers]
        # one at a time, and consumers are created only once the producers are done: the
        # timings do not compete with another instance's threads
        for i, node in enumerate(producers):
            node.send("go")
            res = node.read("result", say)["result"]
            prod_results.append(res)
            say(
                f"  producer {i}: prefilled prompts {mine['producer'][i]} in "
                f"{res['seconds']:.2f} s; its store holds {res['stored_blocks']} blocks, "
                f"control {endpoints[i][0]}"
            )
        # each consumer is created only when its turn comes: an idle consumer's threads
        # would take CPU from the instance being timed
        for i, node in enumerate(consumers):
            node.send(
                {
                    **common,
                    "role": "consumer",
                    "index": i,
                    "load_mode": a.load_mode,
                    # every rank listed where there are several (the producers' TP size)
                    "producers": [
                        eps[0] if a.tp_producer == a.tp_consumer == 1 else eps for eps in endpoints
                    ],
                    "producer_ranks": endpoints,
                    "prompts": [prompts[k] for k in mine["consumer"][i]],
                }
            )
            node.read("ready")
            node.send("go")
            res = node.read("result", say)["result"]
            cons_results.append(res)
            served = sorted({r["producer"] for r in res["requests"] if r["producer"] is not None})
            say(
                f"  consumer {i}: decoded prompts {mine['consumer'][i]} in "
                f"{res['seconds']:.2f} s, loading from producer(s) {served}"
            )
        for node in producers:
            node.send("stop")
            finals.append(node.read("final")["final"])
    except NodeFailed as e:
        raise report.DemoFailed(str(e), [n.stderr() for n in producers + consumers]) from None
    finally:
        for node in producers + consumers:
            node.close()

    say(f"  monolithic: the same {a.prompts} prompts on one engine without a connector ...")
    from ..engine.reference import Engine, EngineConfig

    warm_up()
    mono = Engine(EngineConfig(**kw, capture_pages=True))
    t = time.perf_counter()
    ids, mono_ttft, _ = run_requests(
        mono, prompts, a.max_tokens, a.cache_salt, lambda s: say(f"  monolithic: {s}")
    )
    say(f"  monolithic: done in {time.perf_counter() - t:.2f} s")
    local = [
        {
            "tokens": mono.results[i].tokens,
            "ttft_s": mono_ttft[n],
            "computed_pages": page_digests(mono.results[i].computed_pages, mono.config),
        }
        for n, i in enumerate(ids)
    ]
    return report.build(a, prompts, routes, mine, prod_results, cons_results, finals, local)
