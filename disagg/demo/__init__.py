"""``disagg demo``: producers and consumers of the reference engine on this machine,
checked token for token and page for page against a monolithic run.

The parent (:mod:`disagg.demo.parent`) starts each instance in its own process
(:mod:`disagg.demo.nodes`): producers prefill their prompts (``max_tokens=1``) and keep
their block stores serving; consumers generate from the same prompts, claiming and loading
the producers' pages over the real control and data planes. Prompt k prefills on producer
k mod P and decodes on consumer (k div P) mod C, so every consumer loads from every
producer. The summary (:mod:`disagg.demo.report`) gives per prompt and in total the
tokens served remotely, pages and bytes moved, transfer time and GB/s, and time to first
token disaggregated and local.

Exit status: 0 when every request's tokens equal the monolithic run's, every loaded page
equals the page computed locally, tokens moved and every consumer/producer pair was
used; 1 otherwise; 2 for a bad option (one line naming it).
"""

from __future__ import annotations

import json
import sys

from ..cliargs import UsageError, usage
from .args import build_parser, check

PROG = "disagg demo"


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        kw = check(a)
    except UsageError as e:
        return usage(PROG, str(e))
    from . import parent, report

    out = sys.stderr if a.json else sys.stdout
    try:
        rep = parent.run(a, kw, out)
    except report.DemoFailed as e:
        if a.debug:
            for log in e.logs:
                sys.stderr.write(log)
        print(f"{PROG}: {e} (--debug shows every process's log)", file=sys.stderr)
        return 1
    except Exception as e:  # one line for the operator; the traceback with --debug
        if a.debug:
            raise
        print(
            f"{PROG}: failed: {type(e).__name__}: {e} (--debug for the traceback)", file=sys.stderr
        )
        return 1
    print(report.table(rep), file=out, flush=True)
    if a.json:
        print(json.dumps(rep), flush=True)
    return 0 if rep["ok"] else 1
