"""``disagg proxy``: an OpenAI-compatible proxy in front of producers and consumers.

::

    disagg proxy --producers http://127.0.0.1:8100 --consumers http://127.0.0.1:8200 --port 8000

It listens on 127.0.0.1 unless ``--host`` says otherwise (``--host 0.0.0.0``: every
interface, as a container needs).

``--producer URL`` / ``--consumer URL`` may be repeated instead of (or besides) the
comma-separated lists. ``--producer-events tcp://HOST:PORT`` adds event endpoints to
subscribe to; by default each producer's own (from ``GET /disagg/info``) is used. See
:mod:`disagg.proxy.app` for the request flow, :mod:`disagg.proxy.routing` for how a
producer is picked and :mod:`disagg.proxy.limits` for the deadlines (``--prefill-*``,
``--decode-*``, ``--heartbeat-s``, ``--missed-heartbeats``, ``--timeout``).
"""

from __future__ import annotations

import argparse
import sys
from urllib.parse import urlsplit

from ..cliargs import Parser, port, positive_float, positive_int
from .limits import ProxyLimits

EXIT_USAGE = 2


def _urls(values: list[str], flag: str) -> list[str]:
    out: list[str] = []
    for v in values:
        for u in v.split(","):
            u = u.strip()
            if not u:
                continue
            parts = urlsplit(u)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"{flag}: {u!r} is not an http(s) URL; write e.g. http://127.0.0.1:8100"
                )
            out.append(u)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="disagg proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--producers", "--producer", action="append", default=[], metavar="URL[,URL]")
    p.add_argument("--consumers", "--consumer", action="append", default=[], metavar="URL[,URL]")
    p.add_argument("--producer-events", action="append", default=[], metavar="tcp://HOST:PORT")
    p.add_argument(
        "--host", default="127.0.0.1", help="HTTP bind address (0.0.0.0: every interface)"
    )
    p.add_argument("--port", type=port, default=8000, help="HTTP port")
    p.add_argument(
        "--timeout", type=positive_float, default=600.0, help="cap on any one upstream call (s)"
    )
    d = ProxyLimits()
    p.add_argument(
        "--prefill-floor-s",
        type=positive_float,
        default=d.prefill_floor_s,
        help="prefill deadline per producer = this + prompt tokens x --prefill-per-token-s",
    )
    p.add_argument("--prefill-per-token-s", type=positive_float, default=d.prefill_per_token_s)
    p.add_argument(
        "--decode-floor-s",
        type=positive_float,
        default=d.decode_floor_s,
        help="decode deadline per consumer = this + prompt tokens x --prefill-per-token-s "
        "+ max_tokens x --decode-per-token-s",
    )
    p.add_argument("--decode-per-token-s", type=positive_float, default=d.decode_per_token_s)
    p.add_argument(
        "--heartbeat-s",
        type=positive_float,
        default=d.heartbeat_s,
        help="how often every upstream's /health is polled (and how long it may take)",
    )
    p.add_argument(
        "--missed-heartbeats",
        type=positive_int,
        default=d.missed_heartbeats,
        help="unanswered heartbeats in a row after which an upstream is down",
    )
    p.add_argument(
        "--prefix-load-skew",
        type=int,
        default=d.prefix_load_skew,
        help="a producer holding the longest prefix is preferred while it has at most this "
        "many more prefills in flight than the least loaded one",
    )
    p.add_argument(
        "--no-prefetch",
        action="store_true",
        help="do not tell the consumer about a prompt when its prefill is sent (it then "
        "claims the prompt's blocks only once the continuation arrives)",
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.add_argument(
        "--events-secret-key-file",
        help="CURVE: the proxy's NAME.key (from `disagg keys NAME`), for producers whose event "
        "stream is secured (config `security`); with --events-public-key-file and "
        "--events-server-key",
    )
    p.add_argument("--events-public-key-file", help="CURVE: the proxy's NAME.key.pub")
    p.add_argument("--events-server-key", help="CURVE: the producers' public key (Z85 or file)")
    return p


def _events_curve(args: argparse.Namespace) -> object | None:
    """Client keys for secured producer event streams, or None (plain)."""
    given = [args.events_secret_key_file, args.events_public_key_file, args.events_server_key]
    if not any(given):
        return None
    if not all(given):
        raise ValueError(
            "--events-secret-key-file, --events-public-key-file and --events-server-key go together"
        )
    from ..config import SecurityConfig
    from ..transport.security import client_keys_from

    return client_keys_from(
        SecurityConfig(
            curve_secret_key_file=args.events_secret_key_file,
            curve_public_key_file=args.events_public_key_file,
            server_public_key=args.events_server_key,
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        producers = _urls(args.producers, "--producers")
        consumers = _urls(args.consumers, "--consumers")
        events = [e.strip() for v in args.producer_events for e in v.split(",") if e.strip()]
        for e in events:
            if not e.startswith("tcp://"):
                raise ValueError(f"--producer-events: {e!r} must look like tcp://host:port")
        curve = _events_curve(args)
        limits = ProxyLimits(
            prefill_floor_s=args.prefill_floor_s,
            prefill_per_token_s=args.prefill_per_token_s,
            decode_floor_s=args.decode_floor_s,
            decode_per_token_s=args.decode_per_token_s,
            request_timeout_s=args.timeout,
            heartbeat_s=args.heartbeat_s,
            missed_heartbeats=args.missed_heartbeats,
            prefix_load_skew=args.prefix_load_skew,
        )
    except ValueError as e:
        print(f"disagg proxy: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not producers or not consumers:
        print(
            "disagg proxy: give at least one --producers URL and one --consumers URL, e.g. "
            "--producers http://127.0.0.1:8100 --consumers http://127.0.0.1:8200",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from ..serve import logs
    from ..serve.runner import run_app
    from .app import ProxyState, build_app

    logs.setup(args.log_level)
    state = ProxyState(
        producers,
        consumers,
        events,
        events_curve=curve,
        limits=limits,
        prefetch=not args.no_prefetch,
    )
    print(f"disagg proxy: on http://{args.host}:{args.port}", flush=True)
    run_app(build_app(state), host=args.host, port=args.port)
    return 0
