"""The proxy's aiohttp application: prefill on a producer, decode on a consumer.

For each ``POST /v1/completions`` (and ``/v1/chat/completions``, whose messages become
the prompt through the reference chat template, :mod:`disagg.serve.chat`, for routing;
both upstreams get the chat request itself):

0. read and validate the body fully (:mod:`disagg.serve.bodies`: size, nesting, prompt,
   ``max_tokens``, ``stream``, ``cache_salt``): a bad request is a JSON 400 before any
   upstream sees it;
1. pick producers (:func:`disagg.proxy.routing.choose`: those not down, then longest held
   prefix, then fewest in flight) and send the request with ``max_tokens: 1, stream:
   false``; an unreachable producer, a 5xx or an expired prefill deadline moves on to the
   next one; a 4xx is the client's error and is returned as is;
   as the prefill goes out, the consumer first in line is told of the prompt
   (``POST /disagg/prefetch``: it leases the prompt's blocks meanwhile; ``--no-prefetch``);
2. send the original request to the least-loaded consumer that is not down and stream its
   answer back (SSE passthrough) or return its JSON. A consumer that is unreachable,
   answers 5xx or misses its decode deadline *before the first byte reaches the client*
   is retried on the next consumer; once bytes have been sent, an upstream failure ends
   the stream with an error event.

Deadlines come from the request (:mod:`disagg.proxy.limits`); a background heartbeat
(``GET /health`` of every upstream every ``heartbeat_s``) marks upstreams down and up, and
resyncs the routing index from a snapshot when a producer's incarnation changes (it
restarted, even if no event of the new process arrived yet).

Errors name the upstream: ``{"error": {"message": "consumer http://... : ...", "type":
"upstream_error", "code": 502, "upstream": URL, "upstream_status": 503}}``; 502 when every
upstream of a role is down or failing.

``GET /health``: 200 when at least one producer and one consumer are up, 503 otherwise;
answered from the heartbeats' state without probing (each upstream: 200, or why it is down,
never an empty reason; a consumer whose producers all refuse it, as its own /health says,
is ``"degraded: <reason>"``: still up, tried after the others, and ``"status":
"degraded"`` when every consumer up is). ``GET /metrics``: Prometheus text. ``GET /v1/models``: the first
consumer's answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..serve.bodies import (
    MAX_BODY_BYTES,
    BadRequest,
    json_errors,
    parse_completion,
    read_json,
)
from ..serve.chat import parse_chat
from . import first_token, timeline
from .errors import (
    _err_json,
    _json_dict,
    _upstream_message,
    _why,
)
from .forward import Forwarding
from .limits import ProxyLimits
from .routing import EventFeeds, PrefixIndex, Upstream, advertised

log = logging.getLogger("disagg.proxy")

STATE_KEY = web.AppKey("proxy_state", object)


def _in_flight(up: Upstream) -> float:
    return float(up.in_flight)


class ProxyState(Forwarding):
    """Upstreams, routing index, HTTP client and metrics of one proxy."""

    def __init__(
        self,
        producers: list[str],
        consumers: list[str],
        producer_events: list[str] | None = None,
        request_timeout_s: float | None = None,
        events_curve: object | None = None,
        limits: ProxyLimits | None = None,
        prefetch: bool = True,
    ) -> None:
        limits = limits or ProxyLimits()
        self.prefetch = prefetch  # tell the consumer about a prompt as its prefill goes out
        if request_timeout_s is not None:
            limits = dataclasses.replace(limits, request_timeout_s=request_timeout_s)
        self.limits = limits
        self.producers = [Upstream(u.rstrip("/")) for u in producers]
        self.consumers = [Upstream(u.rstrip("/")) for u in consumers]
        self.explicit_events = list(producer_events or [])
        self.index = PrefixIndex()
        self.feeds = EventFeeds(self.index, curve=events_curve)
        self.timeout = aiohttp.ClientTimeout(total=limits.request_timeout_s, sock_connect=5)
        self.http: aiohttp.ClientSession | None = None
        self._discovery: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._first_beat = asyncio.Event()
        self._seed_tasks: dict[tuple[str, str | None], asyncio.Task[None]] = {}
        self._prefetches: set[asyncio.Task[None]] = set()
        self.registry = reg = CollectorRegistry()
        self.m_requests = Counter(
            "disagg_proxy_requests", "Requests by outcome", ["outcome"], registry=reg
        )
        self.m_upstream_errors = Counter(
            "disagg_proxy_upstream_errors",
            "Upstream failures by role and kind",
            ["role", "kind"],
            registry=reg,
        )
        self.m_down = Counter(
            "disagg_proxy_upstream_down",
            "Times an upstream was marked down, by role and cause",
            ["role", "cause"],
            registry=reg,
        )
        self.m_resyncs = Counter(
            "disagg_proxy_index_resyncs",
            "Routing index reloads after a producer changed incarnation or its events were missed",
            registry=reg,
        )
        self.m_retries = Counter(
            "disagg_proxy_consumer_retries", "Requests retried on another consumer", registry=reg
        )
        self.m_route = Counter(
            "disagg_proxy_routing",
            "Producer choices: prefix (held a prefix) or least_loaded",
            ["reason"],
            registry=reg,
        )
        self.m_matched = Counter(
            "disagg_proxy_matched_blocks", "Prefix blocks the chosen producer held", registry=reg
        )
        self.m_latency = Histogram(
            "disagg_proxy_request_seconds",
            "End-to-end latency",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=reg,
        )
        self.m_first_token = Counter(
            "disagg_proxy_first_token",
            "Where the client's first token came from: producer (the consumer continued "
            "after it), or a plain path's reason (the consumer computed it again)",
            ["source"],
            registry=reg,
        )
        self.m_prefill = Histogram(
            "disagg_proxy_prefill_seconds",
            "Producer (max_tokens=1) latency",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=reg,
        )
        g = Gauge(
            "disagg_proxy_in_flight",
            "Requests in flight per upstream",
            ["role", "url"],
            registry=reg,
        )
        for role, ups in (("producer", self.producers), ("consumer", self.consumers)):
            for up in ups:
                g.labels(role, up.url).set_function(partial(_in_flight, up))
        held = Gauge(
            "disagg_proxy_producer_known_blocks",
            "Blocks the proxy believes each producer holds",
            ["url"],
            registry=reg,
        )
        for up in self.producers:
            held.labels(up.url).set_function(partial(self._known_blocks, up))

    def _known_blocks(self, up: Upstream) -> float:
        return float(self.index.held(up.instance_id)) if up.instance_id else 0.0

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        self.http = aiohttp.ClientSession(timeout=self.timeout)
        self._discovery = asyncio.create_task(self._discover())
        self._heartbeat = asyncio.create_task(self._heartbeats())

    async def stop(self, app: web.Application) -> None:
        tasks = (*self._seed_tasks.values(), *self._prefetches)
        for task in (self._discovery, self._heartbeat, *tasks):
            if task is not None:
                task.cancel()
        if self.http is not None:
            await self.http.close()
        await asyncio.to_thread(self.feeds.close)

    async def _discover(self) -> None:
        """Learn each producer's instance id, block size, seed and events endpoint (retrying
        until it answers), then subscribe to its events."""
        pending = list(self.producers)
        while pending:
            for up in list(pending):
                try:
                    info = await self._info(up)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                    log.debug(
                        "producer info not yet available",
                        extra={"upstream": up.url, "error": str(e)},
                    )
                    continue
                if not info.get("namespace_seed"):
                    continue  # not attached yet
                up.instance_id = info["instance_id"]
                up.tokens_per_block = int(info["tokens_per_block"])
                up.seeds[None] = bytes.fromhex(info["namespace_seed"])
                events = [advertised(e, up.url) for e in self.explicit_events]
                if info.get("events"):
                    events.append(advertised(info["events"], up.url))
                for ep in dict.fromkeys(events):
                    try:
                        await asyncio.to_thread(self.feeds.add, ep, up.instance_id, up.url)
                    except Exception as e:  # routing falls back; serving goes on
                        log.warning("cannot subscribe", extra={"endpoint": ep, "error": str(e)})
                up.events = events[0] if events else None
                pending.remove(up)
                log.info(
                    "producer discovered",
                    extra={"upstream": up.url, "producer": up.instance_id, "events": events},
                )
            if pending:
                await asyncio.sleep(1.0)

    async def _heartbeats(self) -> None:
        """Every ``heartbeat_s``: ``GET /health`` of every upstream, at once."""
        while True:
            t0 = time.monotonic()
            ups = [*self.producers, *self.consumers]
            await asyncio.gather(*(self._beat(u, u in self.producers) for u in ups))
            self._first_beat.set()
            await asyncio.sleep(max(0.0, self.limits.heartbeat_s - (time.monotonic() - t0)))

    async def _beat(self, up: Upstream, producer: bool) -> None:
        assert self.http is not None
        timeout = self.limits.heartbeat_s
        role = "producer" if producer else "consumer"
        try:
            async with self.http.get(
                f"{up.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                status = r.status
                body = await r.read()
        except asyncio.TimeoutError as e:  # a stopped process still accepts connections
            up.misses += 1
            if up.misses >= self.limits.missed_heartbeats:
                self._down(
                    up, role, "heartbeat", f"missed {up.misses} heartbeats ({_why(e, timeout)})"
                )
            up.beaten = True
            return
        except aiohttp.ClientError as e:
            self._down(up, role, "unreachable", f"unreachable: {_why(e)}")
            up.beaten = True
            return
        up.misses, up.beaten = 0, True
        info = _json_dict(body)
        if status != 200:
            reasons = info.get("reasons") if isinstance(info.get("reasons"), list) else None
            detail = "; ".join(map(str, reasons)) if reasons else _upstream_message(body)
            self._down(up, role, "unhealthy", f"/health answered {status}: {detail or 'no reason'}")
            return
        if producer:
            await self._check_incarnation(up, info.get("incarnation"), info.get("events_seq"))
        else:
            self._degraded(up, info.get("degraded"))
        if up.down_reason is not None and time.monotonic() >= up.down_until:
            log.info("upstream up", extra={"upstream": up.url, "was": up.down_reason})
            up.down_reason = None

    def _degraded(self, up: Upstream, why: Any) -> None:
        """A consumer's /health says whether every producer refuses it (it still serves)."""
        why = why if isinstance(why, str) and why else None
        if why != up.degraded:
            if why is not None:
                log.warning("consumer degraded", extra={"upstream": up.url, "reason": why})
            else:
                log.info("consumer no longer degraded", extra={"upstream": up.url})
        up.degraded = why

    async def _check_incarnation(self, up: Upstream, inc: Any, seq: Any = None) -> None:
        """A producer answering with a new incarnation restarted: reload its keys. So does
        one whose last event (``seq``) the index has still not applied one heartbeat
        later: events published before our subscription (re)connected are lost without a
        gap to show it, until the producer's next event."""
        if not isinstance(inc, int) or isinstance(inc, bool):
            return
        before, up.incarnation = up.incarnation, inc
        if up.instance_id is None:
            return
        synced = await asyncio.to_thread(self.feeds.synced, up.instance_id)
        if (before is not None and before != inc) or (synced is not None and synced[0] != inc):
            log.warning("producer restarted: resyncing its keys", extra={"upstream": up.url})
            self.m_resyncs.inc()
            up.behind_at = None
            await asyncio.to_thread(self.feeds.resync, up.instance_id)
            return
        if synced is None or not isinstance(seq, int) or synced[1] >= seq:
            up.behind_at = None
            return
        if up.behind_at is not None and synced[1] <= up.behind_at:
            log.info("events of a producer missed: resyncing its keys", extra={"upstream": up.url})
            self.m_resyncs.inc()
            up.behind_at = None
            await asyncio.to_thread(self.feeds.resync, up.instance_id)
            return
        up.behind_at = synced[1]

    async def models(self) -> web.Response:
        """``GET /v1/models``: the first consumer that answers (they serve the same model)."""
        assert self.http is not None
        last = "no consumer configured"
        for up in sorted(self.consumers, key=lambda u: u.known_down()):
            try:
                async with self.http.get(
                    f"{up.url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)
                ) as r:
                    data = await r.read()
                    if r.status == 200:
                        return web.Response(body=data, content_type="application/json")
                    last = f"consumer {up.url} answered {r.status}: {_upstream_message(data)}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"consumer {up.url}: unreachable: {_why(e, 10)}"
        return _err_json(f"no consumer listed its models; last: {last}", 502, "upstream_error")

    # -- health --------------------------------------------------------------------------
    async def health(self) -> tuple[bool, dict[str, Any]]:
        """From the heartbeats' state (waiting for the first round at most one heartbeat):
        each upstream is 200 or the reason it is down."""
        if not self._first_beat.is_set():
            try:
                await asyncio.wait_for(self._first_beat.wait(), 2 * self.limits.heartbeat_s)
            except asyncio.TimeoutError:
                pass

        def state(up: Upstream) -> int | str:
            if not up.beaten:
                return "no heartbeat answered yet"
            if up.down_reason is None and up.degraded is not None:
                return f"degraded: {up.degraded}"
            return 200 if up.down_reason is None else up.down_reason or "down"

        def up_(u: Upstream) -> bool:
            return u.beaten and u.down_reason is None

        prod = {u.url: state(u) for u in self.producers}
        cons = {u.url: state(u) for u in self.consumers}
        ok = any(map(up_, self.producers)) and any(map(up_, self.consumers))
        plain = {
            why: int(self.m_first_token.labels(why)._value.get())
            for why in (first_token.NO_TOKEN_IDS, first_token.NO_CONTINUATION)
        }
        details: dict[str, Any] = {
            "producers": prod,
            "consumers": cons,
            "first_token_plain_path": plain,
        }
        if ok and all(u.degraded is not None for u in self.consumers if up_(u)):
            details["degraded"] = "every consumer that is up computes every prompt itself"
        return ok, details


async def _template(body: dict[str, Any]) -> first_token.Template:
    return first_token.Template.of(body)


def build_app(state: ProxyState) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_errors])
    app[STATE_KEY] = state
    app.on_startup.append(state.start)
    app.on_cleanup.append(state.stop)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await handle(request, "/v1/completions")

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await handle(request, "/v1/chat/completions")

    async def handle(request: web.Request, path: str) -> web.StreamResponse:
        is_chat = path == "/v1/chat/completions"
        prefix = "chatcmpl" if is_chat else "cmpl"
        rid = request.headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex[:16]}"
        t0 = time.monotonic()
        timeline.begin()
        try:
            body = await read_json(request)
            # the chat template gives the tokens the upstreams will see: routing needs them
            tokens, max_tokens, stream, salt, _ = (parse_chat if is_chat else parse_completion)(
                body
            )
        except BadRequest as e:  # before any upstream sees it
            state.m_requests.labels("bad_request").inc()
            bad = _err_json(str(e), 400, "invalid_request_error")
            bad.headers["X-Request-Id"] = rid
            return bad
        try:
            timeline.defer(
                partial(log.info, "request", extra={"request_id": rid, "stream": stream})
            )
            early: dict[str, Any] = {}

            def on_send() -> None:  # while the producer prefills: the consumer's side
                if max_tokens > 1:
                    early["told"] = state.start_prefetch(body, path, rid)
                    early["template"] = asyncio.create_task(_template(body))

            try:
                pre = await state.prefill(body, tokens, salt, rid, path, stream, on_send)
            except BaseException:
                if "template" in early:
                    early["template"].cancel()
                raise
            if isinstance(pre, web.Response):
                state.m_requests.labels("prefill_failed").inc()
                pre.headers["X-Request-Id"] = rid
                return pre
            deadline = state.limits.decode_s(len(tokens), max_tokens)
            try:
                resp = await state.answer(
                    request,
                    body,
                    pre,
                    max_tokens,
                    stream,
                    rid,
                    deadline,
                    path,
                    prefer=early.get("told"),
                    template=early.get("template"),
                )
            except ConnectionResetError:  # the client went away mid-answer: not an error
                # ours; the consumer's stream is closed with it (its request cancelled)
                resp = web.Response(status=499)  # aiohttp drops it on the closed transport
            timeline.run(timeline.take_deferred())  # before "done": the lines keep their order
            outcome = {200: "ok", 499: "client_gone"}.get(resp.status, "decode_failed")
            state.m_requests.labels(outcome).inc()
            state.m_latency.observe(time.monotonic() - t0)
            log.info(
                "done",
                extra={
                    "request_id": rid,
                    "status": resp.status,
                    "seconds": round(time.monotonic() - t0, 4),
                    "marks": timeline.marks(),  # monotonic seconds (proxy/timeline.py)
                },
            )
            return resp
        finally:  # a failed request still owes its log lines and routing note
            timeline.run(timeline.take_deferred())

    async def health(request: web.Request) -> web.Response:
        ok, details = await state.health()
        status = "unhealthy" if not ok else "degraded" if "degraded" in details else "ok"
        return web.json_response({"status": status, **details}, status=200 if ok else 503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(state.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def models(request: web.Request) -> web.Response:
        return await state.models()

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
