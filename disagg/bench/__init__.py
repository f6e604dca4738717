"""``disagg bench``: transfer throughput against the machine's ceilings, query latency, the
prefix stores' hit ratio over a request trace, serving latency on a trace, and the
reference engine's own throughput.

    disagg bench transfer [--page-sizes ...] [--total ...] [--transports ...] [--json] [--plot F]
    disagg bench query [--prompt-lens ...] [--tokens-per-block N] [--json]
    disagg bench gpu [--page-sizes ...] [--total ...] [--json]   (CUDA only)
    disagg bench reuse --trace T.jsonl [--capacities ...] [--producers ...] [--json] [--plot F]
    disagg bench serve --trace T.jsonl | --rate R [--quick] [--json] [--plot F]
    disagg bench overhead [--prompt-lens 1024,4096] [--repeats N] [--json]
    disagg bench engine [--streams 1,8,32,64] [--context 2048] [--prefill-lens ...] [--quick]

``--json`` prints one JSON object on the last line of stdout (``{"results": [...], ...}``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

USAGE = (
    "usage: disagg bench {transfer|query|gpu|reuse|serve|overhead|engine} [options]"
    "  (--help on each)"
)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    run: Callable[[list[str]], int]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "transfer":
        from .transfer import main as run
    elif cmd == "query":
        from .query import main as run
    elif cmd == "gpu":
        from .gpu import main as run
    elif cmd == "reuse":
        from .reuse import main as run
    elif cmd == "serve":
        from .serve import main as run
    elif cmd == "overhead":
        from .overhead import main as run
    elif cmd == "engine":
        from .engine import main as run
    else:
        print(f"disagg bench: unknown benchmark {cmd!r}; {USAGE}", file=sys.stderr)
        return 2
    return run(rest)
