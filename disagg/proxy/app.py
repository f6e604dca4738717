"""The proxy's aiohttp application: prefill on a producer, decode on a consumer.

For each ``POST /v1/completions``:

1. pick producers (:func:`disagg.proxy.routing.choose`: longest held prefix, else fewest
   in flight) and send the request with ``max_tokens: 1, stream: false``; an unreachable
   producer or a 5xx is skipped for the next one; a 4xx is the client's error and is
   returned as is;
2. send the original request to the least-loaded consumer and stream its answer back
   (SSE passthrough) or return its JSON. A consumer that is unreachable or answers 5xx
   *before the first byte reaches the client* is retried on the next consumer; once
   bytes have been sent, an upstream failure ends the stream with an error event.

Errors name the upstream: ``{"error": {"message": "consumer http://... : ...", "type":
"upstream_error", "code": 502, "upstream": URL, "upstream_status": 503}}``; 502 when every
upstream of a role is down or failing.

``GET /health``: 200 when at least one producer and one consumer answer their ``/health``
with 200; 503 otherwise, with every upstream's status. ``GET /metrics``: Prometheus text.
"""

from __future__ import annotations

import asyncio
import json
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

from ..serve import tokenizer
from .routing import EventFeeds, PrefixIndex, Upstream, advertised, choose, prompt_keys

log = logging.getLogger("disagg.proxy")

STATE_KEY = web.AppKey("proxy_state", object)


class UpstreamError(Exception):
    def __init__(self, url: str, status: int | None, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.url, self.status, self.message, self.retryable = url, status, message, retryable


def _all_failed(role: str, last: UpstreamError) -> web.Response:
    """502 naming the last upstream of ``role`` that failed, and how."""
    return _err_json(
        f"every {role} failed; last: {role} {last.url}"
        + (f" answered {last.status}" if last.status else "")
        + f": {last.message}",
        502,
        "upstream_error",
        upstream=last.url,
        upstream_status=last.status,
    )


def _err_json(message: str, status: int, type_: str, **extra: Any) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": type_, "code": status, **extra}}, status=status
    )


def _upstream_message(body: bytes) -> str:
    try:
        d = json.loads(body)
        if isinstance(d, dict) and isinstance(d.get("error"), dict):
            return str(d["error"].get("message"))
    except (ValueError, UnicodeDecodeError):
        pass
    return body[:500].decode("utf-8", errors="replace")


def _prompt_tokens(body: dict[str, Any]) -> list[int] | None:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return tokenizer.encode(p)
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    return None


def _in_flight(up: Upstream) -> float:
    return float(up.in_flight)


class ProxyState:
    """Upstreams, routing index, HTTP client and metrics of one proxy."""

    def __init__(
        self,
        producers: list[str],
        consumers: list[str],
        producer_events: list[str] | None = None,
        request_timeout_s: float = 600.0,
        events_curve: object | None = None,
    ) -> None:
        self.producers = [Upstream(u.rstrip("/")) for u in producers]
        self.consumers = [Upstream(u.rstrip("/")) for u in consumers]
        self.explicit_events = list(producer_events or [])
        self.index = PrefixIndex()
        self.feeds = EventFeeds(self.index, curve=events_curve)
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=5)
        self.session: aiohttp.ClientSession | None = None
        self._discovery: asyncio.Task[None] | None = None
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
        self.session = aiohttp.ClientSession(timeout=self.timeout)
        self._discovery = asyncio.create_task(self._discover())

    async def stop(self, app: web.Application) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        if self.session is not None:
            await self.session.close()
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

    async def _info(self, up: Upstream) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.get(
            f"{up.url}/disagg/info", timeout=aiohttp.ClientTimeout(total=3)
        ) as r:
            if r.status != 200:
                raise ValueError(f"status {r.status}")
            return dict(await r.json())

    async def seed_for(self, up: Upstream, salt: str | None) -> None:
        """Fetch ``up``'s namespace seed for ``salt`` once (a miss only costs routing)."""
        if salt in up.seeds or up.instance_id is None:
            return
        assert self.session is not None
        try:
            async with self.session.get(
                f"{up.url}/disagg/seed",
                params={"cache_salt": salt or ""},
                timeout=aiohttp.ClientTimeout(total=2),
            ) as r:
                if r.status == 200:
                    up.seeds[salt] = bytes.fromhex((await r.json())["namespace_seed"])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
            pass

    # -- one request ---------------------------------------------------------------------
    async def prefill(self, body: dict[str, Any], rid: str) -> web.Response | None:
        """Run the prefill on a producer; ``None`` on success, else the error response."""
        assert self.session is not None
        tokens = _prompt_tokens(body)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        if tokens is not None and salt is not None:
            await asyncio.gather(*(self.seed_for(up, salt) for up in self.producers))
        order, matched = choose(self.producers, self.index, tokens, salt)
        self.m_route.labels("prefix" if matched else "least_loaded").inc()
        self.m_matched.inc(matched)
        pbody = {**body, "max_tokens": 1, "stream": False}
        last: UpstreamError | None = None
        for up in order:
            t0 = time.monotonic()
            up.in_flight += 1
            try:
                async with self.session.post(
                    f"{up.url}/v1/completions", json=pbody, headers={"X-Request-Id": rid}
                ) as r:
                    data = await r.read()
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                up.failures += 1
                self.m_upstream_errors.labels("producer", "unreachable").inc()
                last = UpstreamError(up.url, None, f"unreachable: {e or type(e).__name__}", True)
                log.warning(
                    "producer unreachable",
                    extra={"request_id": rid, "upstream": up.url, "error": str(e)},
                )
                continue
            finally:
                up.in_flight -= 1
            self.m_prefill.observe(time.monotonic() - t0)
            if status == 200:
                log.info(
                    "prefilled",
                    extra={"request_id": rid, "upstream": up.url, "matched_blocks": matched},
                )
                if tokens is not None and up.instance_id is not None:
                    self.index.note_routed(up.instance_id, prompt_keys(up, tokens, salt))
                return None
            msg = _upstream_message(data)
            if 400 <= status < 500:
                self.m_upstream_errors.labels("producer", "client_error").inc()
                return _err_json(
                    f"producer {up.url}: {msg}",
                    status,
                    "invalid_request_error",
                    upstream=up.url,
                    upstream_status=status,
                )
            self.m_upstream_errors.labels("producer", "server_error").inc()
            last = UpstreamError(up.url, status, msg, True)
            log.warning(
                "producer failed",
                extra={"request_id": rid, "upstream": up.url, "status": status, "error": msg},
            )
        assert last is not None
        return _all_failed("producer", last)

    async def decode(
        self, request: web.Request, body: dict[str, Any], rid: str
    ) -> web.StreamResponse:
        """Run the request on a consumer, retrying others until bytes reach the client."""
        assert self.session is not None
        order = sorted(self.consumers, key=lambda u: u.in_flight)
        last: UpstreamError | None = None
        for attempt, up in enumerate(order):
            if attempt:
                self.m_retries.inc()
            up.in_flight += 1
            try:
                return await self._decode_on(request, up, body, rid)
            except UpstreamError as e:
                up.failures += 1
                last = e
                log.warning(
                    "consumer failed before the first byte; trying the next",
                    extra={
                        "request_id": rid,
                        "upstream": up.url,
                        "status": e.status,
                        "error": e.message,
                    },
                )
                if not e.retryable:
                    break
            finally:
                up.in_flight -= 1
        assert last is not None
        if last.status is not None and 400 <= last.status < 500:
            return _err_json(
                f"consumer {last.url}: {last.message}",
                last.status,
                "invalid_request_error",
                upstream=last.url,
                upstream_status=last.status,
            )
        return _all_failed("consumer", last)

    async def _decode_on(
        self, request: web.Request, up: Upstream, body: dict[str, Any], rid: str
    ) -> web.StreamResponse:
        assert self.session is not None
        try:
            ctx = self.session.post(
                f"{up.url}/v1/completions", json=body, headers={"X-Request-Id": rid}
            )
            r = await ctx.__aenter__()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.m_upstream_errors.labels("consumer", "unreachable").inc()
            raise UpstreamError(up.url, None, f"unreachable: {e or type(e).__name__}", True) from e
        try:
            if r.status != 200:
                data = await r.read()
                kind = "client_error" if r.status < 500 else "server_error"
                self.m_upstream_errors.labels("consumer", kind).inc()
                raise UpstreamError(up.url, r.status, _upstream_message(data), r.status >= 500)
            ctype = r.headers.get("Content-Type", "")
            if not ctype.startswith("text/event-stream"):
                data = await r.read()
                return web.Response(
                    body=data,
                    status=200,
                    content_type="application/json",
                    headers={"X-Request-Id": rid},
                )
            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Request-Id": rid,
                }
            )
            # Wait for the first bytes before answering: a failure until then can retry.
            try:
                first = await r.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.m_upstream_errors.labels("consumer", "stream_broken").inc()
                raise UpstreamError(up.url, None, f"stream broke before any data: {e}", True) from e
            await resp.prepare(request)
            await resp.write(first)
            try:
                async for data in r.content.iter_any():
                    await resp.write(data)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.m_upstream_errors.labels("consumer", "stream_broken").inc()
                log.warning(
                    "consumer stream broke",
                    extra={"request_id": rid, "upstream": up.url, "error": str(e)},
                )
                err = {
                    "error": {
                        "message": f"consumer {up.url}: stream broke: {e}",
                        "type": "upstream_error",
                        "code": 502,
                    }
                }
                await resp.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        finally:
            await ctx.__aexit__(None, None, None)

    # -- health --------------------------------------------------------------------------
    async def health(self) -> tuple[bool, dict[str, Any]]:
        assert self.session is not None

        async def one(up: Upstream) -> tuple[str, int | str]:
            try:
                async with self.session.get(  # type: ignore[union-attr]
                    f"{up.url}/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    return up.url, r.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return up.url, f"unreachable: {e or type(e).__name__}"

        prod = dict(await asyncio.gather(*(one(u) for u in self.producers)))
        cons = dict(await asyncio.gather(*(one(u) for u in self.consumers)))
        ok = any(s == 200 for s in prod.values()) and any(s == 200 for s in cons.values())
        return ok, {"producers": prod, "consumers": cons}


def build_app(state: ProxyState) -> web.Application:
    app = web.Application()
    app[STATE_KEY] = state
    app.on_startup.append(state.start)
    app.on_cleanup.append(state.stop)

    async def completions(request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or f"cmpl-{uuid.uuid4().hex[:16]}"
        t0 = time.monotonic()
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            state.m_requests.labels("bad_request").inc()
            return _err_json("the body is not valid JSON", 400, "invalid_request_error")
        if not isinstance(body, dict):
            state.m_requests.labels("bad_request").inc()
            return _err_json("the body must be a JSON object", 400, "invalid_request_error")
        log.info("request", extra={"request_id": rid, "stream": bool(body.get("stream"))})
        failed = await state.prefill(body, rid)
        if failed is not None:
            state.m_requests.labels("prefill_failed").inc()
            failed.headers["X-Request-Id"] = rid
            return failed
        resp = await state.decode(request, body, rid)
        state.m_requests.labels("ok" if resp.status == 200 else "decode_failed").inc()
        state.m_latency.observe(time.monotonic() - t0)
        log.info(
            "done",
            extra={
                "request_id": rid,
                "status": resp.status,
                "seconds": round(time.monotonic() - t0, 4),
            },
        )
        return resp

    async def health(request: web.Request) -> web.Response:
        ok, details = await state.health()
        return web.json_response(
            {"status": "ok" if ok else "unhealthy", **details}, status=200 if ok else 503
        )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(state.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
