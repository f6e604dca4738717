"""``disagg bench reuse``: prefix hit ratio of the block stores over a whole request trace.

    disagg bench reuse --trace T.jsonl [--capacities 1e5,1e6,3e6,1e7,1e8] [--producers 1,4]
                       [--placements least-load,prefix,pooled] [--limit N] [--jobs J]
                       [--prefill-tps 20000] [--json] [--plot PNG]
    disagg bench reuse --synthetic N [--seed S] ...     (a generated trace instead)

Model-free: no engine, no pages. Each request of the trace (arrival order) goes through
the real code, keys only: its full-block keys (:func:`disagg.bench.traces.block_keys_of`,
the connectors' key chain), :func:`disagg.proxy.routing.choose` over ``Upstream``s whose
:class:`~disagg.proxy.routing.PrefixIndex` is fed by the stores' stored/removed callbacks
(as a producer's event stream feeds the proxy), and one real
:class:`~disagg.producer.store.BlockStore` per producer (``capacity / block_tokens`` blocks of 1 byte, then no slab and no checksums: there
are no page bytes). Per request:

1. route: ``choose`` with the prompt (``prefix``, the proxy's default load bound) or
   without it (``least-load`` and ``pooled``); ties go round-robin, and ``in_flight`` comes from a FIFO prefill model
   (``--prefill-tps`` tokens/s per producer, computing what the claim did not cover);
2. claim: the longest prefix held by the chosen producer (``least-load``, ``prefix``: each
   producer's store on its own) or by any producer (``pooled``: every consumer reaches
   every store, as the consumers' parallel lookups do), pinned and released as a lease
   would (the release makes those blocks the most recently used);
3. save: the chosen producer plans and commits every full block (dedup, LRU eviction).

Reported per (producers, capacity per producer, placement): ``hit_ratio`` = prompt tokens
in claimed blocks / all prompt tokens; ``theoretical`` = the same for an unbounded cache
over the same request order (:func:`~disagg.bench.traces.unbounded_hit_blocks`);
``busiest_share`` = the busiest producer's share of computed prefill tokens (1/P is even);
``seconds`` = the replay's wall time. One producer has one placement (``single``).
``--json`` prints ``{"results": [...], "theoretical": ..., "paper": {...}, ...}`` on the
last line of stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import numpy as np

from .traces import Trace, TraceError, block_keys_of, load_trace, synthetic_trace
from .traces import unbounded_hit_blocks as _unbounded

PLACEMENTS = ("least-load", "prefix", "pooled")
DEFAULT_CAPACITIES = (100_000, 1_000_000, 3_000_000, 10_000_000, 100_000_000)
DEFAULT_PRODUCERS = (1, 4)
DEFAULT_PREFILL_TPS = 20_000.0
SEED = b"disagg/bench/reuse"[:16]
# The Mooncake FAST'25 paper on its conversation trace (docs/design/traces.md).
PAPER = {
    "theoretical": 0.40,
    "pooled_vs_per_node_max": 2.36,
    "per_node_capacity_tokens": 3_000_000,
}


@dataclass
class Result:
    producers: int
    capacity_tokens: int
    placement: str
    hit_ratio: float
    theoretical: float
    hit_tokens: int
    prompt_tokens: int
    busiest_share: float
    evictions: int
    seconds: float


class _NoPages:
    """A store's slab in a keys-only replay: a row is nothing (``commit`` hands it to the
    checksum, which :func:`keys_only` turns off)."""

    def __getitem__(self, row: object) -> None:
        return None


_NO_PAGES: Any = _NoPages()


@contextlib.contextmanager
def keys_only() -> Iterator[None]:
    """BlockStores of this block have no page bytes: skip their checksums while it runs."""
    from ..producer import store as store_mod

    real = store_mod._checksum
    store_mod._checksum = lambda row: 0
    try:
        yield
    finally:
        store_mod._checksum = real


class _Replay:
    """A trace's keys, shared by every replay (built once per process)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.keys, self.key_offsets = block_keys_of(trace, SEED)
        full = trace.full_blocks()
        self.full = full
        # the routing "tokens": one id per full block (choose keys them with tokens_per_block 1)
        self.tokens = [
            trace.ids[int(a) : int(a) + int(k)].tolist()
            for a, k in zip(trace.offsets[:-1].tolist(), full.tolist())
        ]
        self.prompt_tokens = int(trace.input_length.sum())
        hits = _unbounded(self.keys, self.key_offsets)
        self.theoretical = float(hits.sum()) * trace.block_tokens / max(1, self.prompt_tokens)

    def run(self, placement: str, producers: int, capacity_tokens: int, tps: float) -> Result:
        from ..producer.store import BlockStore
        from ..protocol import messages as m
        from ..protocol.keys import KEY_BYTES, KeyBlob
        from ..protocol.version import PROTOCOL_VERSION as V
        from ..proxy.limits import ProxyLimits
        from ..proxy.routing import PrefixIndex, Upstream, choose

        t0 = time.perf_counter()
        bt = self.trace.block_tokens
        cap_blocks = max(1, capacity_tokens // bt)
        index = PrefixIndex()
        stores: list[BlockStore] = []
        ups: list[Upstream] = []
        for p in range(producers):
            name = f"producer-{p}"
            index.on_event(m.SnapshotOk(v=V, producer=name, seq=0, keys=[]))

            def stored(keys: list[bytes], name: str = name) -> None:
                index.on_event(m.Stored(v=V, producer=name, seq=1, keys=keys))

            def removed(keys: list[bytes], name: str = name) -> None:
                index.on_event(m.Removed(v=V, producer=name, seq=1, keys=keys))

            store = BlockStore(1, cap_blocks, on_stored=stored, on_removed=removed)
            store.slab = _NO_PAGES  # keys only: no row to index
            stores.append(store)
            up = Upstream(f"bench://{p}", instance_id=name, tokens_per_block=1)
            up.seeds[None] = SEED
            ups.append(up)
        pos = {id(u): p for p, u in enumerate(ups)}
        finish: list[deque[float]] = [deque() for _ in range(producers)]
        last_end = [0.0] * producers
        computed = np.zeros(producers, dtype=np.float64)
        ts = (self.trace.timestamp_ms / 1000.0).tolist()
        ins = self.trace.input_length.tolist()
        offs = self.key_offsets.tolist()
        keys = self.keys
        hit_blocks = 0
        use_prompt = placement == "prefix"
        for i in range(len(self.trace)):
            now = ts[i]
            for p in range(producers):
                q = finish[p]
                while q and q[0] <= now:
                    q.popleft()
                ups[p].in_flight = len(q)
            r = i % producers
            order, _ = choose(
                ups[r:] + ups[:r],
                index,
                self.tokens[i] if use_prompt else None,
                None,
                ProxyLimits().prefix_load_skew,  # as the proxy routes by default
            )
            dest = pos[id(order[0])]
            blob = KeyBlob(keys[offs[i] * KEY_BYTES : offs[i + 1] * KEY_BYTES])
            src = dest
            if placement == "pooled" and producers > 1:
                held = [s.longest_prefix(blob) for s in stores]
                src = int(np.argmax(held))
            store = stores[src]
            entries, rows, unique = store.pin_rows(blob)
            h = len(entries)
            if h:
                store.unpin(blob[:h], entries, rows, unique)
            hit_blocks += h
            dstore = stores[dest]
            klist = blob.tolist()
            planned = dstore.plan(klist)
            dstore.commit([k for k, row in zip(klist, planned.tolist()) if row >= 0])
            work = max(0, ins[i] - h * bt)
            computed[dest] += work
            end = max(now, last_end[dest]) + work / tps
            last_end[dest] = end
            finish[dest].append(end)
        hit_tokens = hit_blocks * bt
        total = float(computed.sum())
        return Result(
            producers=producers,
            capacity_tokens=capacity_tokens,
            placement=placement if producers > 1 else "single",
            hit_ratio=hit_tokens / max(1, self.prompt_tokens),
            theoretical=self.theoretical,
            hit_tokens=hit_tokens,
            prompt_tokens=self.prompt_tokens,
            busiest_share=float(computed.max() / total) if total else 0.0,
            evictions=sum(s.stats.evictions for s in stores),
            seconds=time.perf_counter() - t0,
        )


_WORKER: _Replay | None = None


def _init_worker(trace: Trace) -> None:
    global _WORKER
    _WORKER = _Replay(trace)


def _run_task(task: tuple[str, int, int, float]) -> Result:
    assert _WORKER is not None
    with keys_only():
        return _WORKER.run(*task)


def tasks_for(
    capacities: Sequence[int], producers: Sequence[int], placements: Sequence[str], tps: float
) -> list[tuple[str, int, int, float]]:
    """One replay per (producers, capacity, placement); one producer: one replay."""
    out: list[tuple[str, int, int, float]] = []
    for p in producers:
        for c in capacities:
            for pl in placements if p > 1 else placements[:1]:
                out.append((pl, p, c, tps))
    return out


def run_all(
    trace: Trace,
    capacities: Sequence[int],
    producers: Sequence[int],
    placements: Sequence[str] = PLACEMENTS,
    tps: float = DEFAULT_PREFILL_TPS,
    jobs: int = 1,
) -> tuple[list[Result], float]:
    """Every replay (in ``jobs`` processes when > 1); returns the results in task order and
    the theoretical maximum."""
    tasks = tasks_for(capacities, producers, placements, tps)
    if jobs <= 1 or len(tasks) <= 1:
        rep = _Replay(trace)
        with keys_only():
            return [rep.run(*t) for t in tasks], rep.theoretical
    import multiprocessing as mp

    # Longest first (more producers, then more placements' worth of stores) packs better.
    order = sorted(range(len(tasks)), key=lambda k: -tasks[k][1])
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(
        jobs, mp_context=ctx, initializer=_init_worker, initargs=(trace,)
    ) as ex:
        done = dict(zip(order, ex.map(_run_task, [tasks[k] for k in order])))
    results = [done[k] for k in range(len(tasks))]
    return results, results[0].theoretical if results else 0.0


# --------------------------------------------------------------------------- report


def _fmt_tokens(n: int) -> str:
    for unit, f in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= f:
            v = n / f
            return f"{v:g}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return str(n)


def comparisons(results: list[Result]) -> list[dict[str, Any]]:
    """Per (producers > 1, capacity): pooled / per-node hit ratio (per node = prefix-aware
    routing, the paper's per-node baseline; and least-load)."""
    by = {(r.producers, r.capacity_tokens, r.placement): r for r in results}
    out = []
    for (p, c, pl), r in by.items():
        if pl != "pooled":
            continue
        row: dict[str, Any] = {"producers": p, "capacity_tokens": c}
        for base in ("prefix", "least-load"):
            b = by.get((p, c, base))
            row[f"pooled_vs_{base}"] = r.hit_ratio / b.hit_ratio if b and b.hit_ratio else None
        out.append(row)
    return out


def table(results: list[Result], theoretical: float, wall_s: float, trace: Trace) -> str:
    lines = [
        f"disagg bench reuse: {trace.source}, {len(trace)} requests, "
        f"{int(trace.input_length.sum()):,} prompt tokens, {trace.block_tokens}-token blocks",
        f"theoretical maximum (unbounded cache, same order): {theoretical:.1%}   "
        f"(Mooncake paper, conversation trace: ~{PAPER['theoretical']:.0%})",
        "",
        f"{'producers':>9} {'capacity/producer':>17} {'placement':>10} {'hit ratio':>9} "
        f"{'of max':>7} {'busiest':>8} {'evictions':>10} {'time s':>7}",
    ]
    for r in results:
        lines.append(
            f"{r.producers:>9} {_fmt_tokens(r.capacity_tokens):>17} {r.placement:>10} "
            f"{r.hit_ratio:>9.1%} {r.hit_ratio / theoretical if theoretical else 0:>7.0%} "
            f"{r.busiest_share:>8.0%} {r.evictions:>10,} {r.seconds:>7.1f}"
        )
    comp = comparisons(results)
    if comp:
        lines += ["", "pooled vs per-node (paper: up to 2.36x at 3M tokens per node):"]
        for c in comp:
            vp, vl = c["pooled_vs_prefix"], c["pooled_vs_least-load"]
            lines.append(
                f"  {c['producers']} producers x {_fmt_tokens(c['capacity_tokens'])}: "
                f"{'n/a' if vp is None else f'{vp:.2f}x'} over prefix-aware, "
                f"{'n/a' if vl is None else f'{vl:.2f}x'} over least-load"
            )
    lines.append(
        f"busiest = the busiest producer's share of computed prefill tokens; wall {wall_s:.1f} s"
    )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> str | None:
    """Hit ratio against capacity per producer: one line per (producers, placement)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is not installed ({exc}); pip install matplotlib"
    fig, ax = plt.subplots(figsize=(8, 5))
    lines: dict[tuple[int, str], list[tuple[int, float]]] = {}
    for r in report["results"]:
        lines.setdefault((r["producers"], r["placement"]), []).append(
            (r["capacity_tokens"], r["hit_ratio"])
        )
    styles = {"single": "-", "least-load": ":", "prefix": "--", "pooled": "-"}
    colors = {p: f"C{k}" for k, p in enumerate(sorted({p for p, _ in lines}))}
    for (p, placement), pts in sorted(lines.items()):
        pts.sort()
        ax.plot(
            [c for c, _ in pts],
            [h * 100 for _, h in pts],
            styles.get(placement, "-"),
            color=colors[p],
            marker="o" if placement in ("single", "pooled") else ".",
            label=f"{p} producer{'s' if p > 1 else ''}: {placement}",
        )
    ax.axhline(report["theoretical"] * 100, ls="--", color="k", lw=1, label="theoretical (ours)")
    ax.axhline(PAPER["theoretical"] * 100, ls=":", color="grey", lw=1, label="paper: ~40%")
    ax.axvline(PAPER["per_node_capacity_tokens"], ls=":", color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("store capacity per producer (tokens)")
    ax.set_ylabel("prefix hit ratio (% of prompt tokens)")
    ax.set_title(f"disagg bench reuse: {os.path.basename(report['trace'])}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- CLI


class UsageError(ValueError):
    pass


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (``prog: message``), exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_count(text: str, flag: str) -> int:
    """``1e6``, ``3M``, ``100k``, ``250000`` -> int (>= 1)."""
    t = text.strip()
    mult = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    try:
        v = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        v = -1.0
    if not (v >= 1 and v == int(v)):
        raise UsageError(f"{flag} {text!r}: expected a positive whole number (e.g. 3e6, 3M, 512)")
    return int(v)


def _parse_list(text: str, flag: str) -> list[int]:
    vals = [parse_count(x, flag) for x in text.split(",") if x.strip()]
    if not vals:
        raise UsageError(f"{flag} {text!r}: expected a comma-separated list, e.g. 1e6,3e6")
    return vals


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="disagg bench reuse", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake-format JSONL trace")
    src.add_argument("--synthetic", type=int, metavar="N", help="generate N requests instead")
    ap.add_argument("--limit", type=int, help="only the first N requests")
    ap.add_argument("--seed", type=int, default=0, help="seed of --synthetic")
    ap.add_argument("--capacities", default=",".join(map(str, DEFAULT_CAPACITIES)))
    ap.add_argument("--producers", default=",".join(map(str, DEFAULT_PRODUCERS)))
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--prefill-tps", type=float, default=DEFAULT_PREFILL_TPS)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", action="store_true", help="one JSON object on the last line")
    ap.add_argument("--plot", metavar="PNG", help="write hit ratio vs capacity to PNG")
    return ap


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        caps = _parse_list(args.capacities, "--capacities")
        prods = _parse_list(args.producers, "--producers")
        places = [p.strip() for p in args.placements.split(",") if p.strip()]
        bad = [p for p in places if p not in PLACEMENTS]
        if bad or not places:
            raise UsageError(
                f"--placements {args.placements!r}: unknown {bad or 'empty'}; "
                f"use some of {','.join(PLACEMENTS)}"
            )
        if args.limit is not None and args.limit < 1:
            raise UsageError(f"--limit {args.limit}: expected a positive number of requests")
        if not args.prefill_tps > 0:
            raise UsageError(f"--prefill-tps {args.prefill_tps}: expected tokens/s > 0")
        if args.jobs < 1:
            raise UsageError(f"--jobs {args.jobs}: expected >= 1")
        if args.synthetic is not None:
            if args.synthetic < 1:
                raise UsageError(f"--synthetic {args.synthetic}: expected >= 1 requests")
            trace = synthetic_trace(args.synthetic, seed=args.seed)
        elif args.trace:
            trace = load_trace(args.trace, args.limit)
        else:
            raise UsageError("give --trace FILE (Mooncake JSONL) or --synthetic N")
    except (UsageError, TraceError) as e:
        print(f"disagg bench reuse: {e}", file=sys.stderr)
        return 2
    trace = trace.head(args.limit)
    t0 = time.perf_counter()
    results, theo = run_all(trace, caps, prods, places, args.prefill_tps, args.jobs)
    wall = time.perf_counter() - t0
    print(table(results, theo, wall, trace), flush=True)
    report = {
        "trace": trace.source,
        "requests": len(trace),
        "prompt_tokens": int(trace.input_length.sum()),
        "block_tokens": trace.block_tokens,
        "theoretical": theo,
        "results": [asdict(r) for r in results],
        "pooled_vs_per_node": comparisons(results),
        "paper": PAPER,
        "prefill_tps": args.prefill_tps,
        "jobs": args.jobs,
        "wall_s": wall,
        "cpus": os.cpu_count(),
    }
    if args.plot:
        err = plot(report, args.plot)
        print(err or f"plot: {args.plot}", file=sys.stderr if err else sys.stdout)
    if args.json:
        print(json.dumps(report))
    return 0
