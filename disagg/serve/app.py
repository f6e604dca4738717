"""The OpenAI-compatible HTTP server in front of the reference engine (aiohttp).

Routes
    ``POST /v1/completions``  body: ``prompt`` (a string, a list of token ids, or a list
        holding one of those), ``max_tokens`` (default 16), ``stream`` (default false),
        ``cache_salt`` (optional string), ``model`` (echoed). Text goes through
        :mod:`disagg.serve.tokenizer`. The answer carries the ids in
        ``choices[0].token_ids`` besides ``text``; streaming sends SSE ``data: {...}``
        chunks (one per engine step that produced tokens), a last chunk with
        ``finish_reason``, ``usage`` and ``disagg`` (``connector_matched_tokens``...,
        as a whole answer carries), then ``data: [DONE]``. ``disagg.first_tokens`` (token
        ids) continues an answer another server began (the proxy's prefill): the engine
        computes after prompt + those tokens, the answer's ``token_ids``, ``text`` and
        ``usage`` count them, and a stream sends only what follows them (its text decoded
        as if they had been streamed: a character split across them comes out whole).
        Errors are OpenAI-style
        ``{"error": {"message", "type", "code"}}`` with 400 (bad request), 413 (body over
        32 MiB) or 500/503; every error, 404 and uncaught ones included, is JSON
        (:mod:`disagg.serve.bodies`, which also bounds the body's nesting).
    ``POST /v1/chat/completions``  the same for ``messages`` (the reference chat template,
        :mod:`disagg.serve.chat`); ``chat.completion`` / ``chat.completion.chunk`` shapes.
    ``GET /v1/models``  the one model served.
    ``GET /health``  200 ``{"status": "ok"}`` when the engine thread runs and the
        connector service is healthy, else 503 with the reasons. A consumer lists the
        producers refusing it (``refused_by``: endpoint, reason, message, fix, since) and,
        when every producer does, answers ``"status": "degraded"`` (still 200: it serves,
        computing every prompt) with the reason in ``degraded``.
    ``GET /metrics``  Prometheus text: :class:`disagg.metrics.DisaggCollector` plus
        request counters and a latency histogram.
    ``POST /disagg/prefetch``  (consumer) the proxy's word that a prompt is being
        prefilled: its blocks are leased meanwhile (:mod:`disagg.consumer.prefetch`); 202.
    ``GET /disagg/info``, ``GET /disagg/seed``, ``GET /disagg/snapshot``  what the proxy
        needs to route by stored prefix (producer only; see :mod:`disagg.proxy.routing`),
        ``continuation: true`` (this server takes ``disagg.first_tokens``), ``prefetch``;
        ``/disagg/info`` also carries ``engine``: the engine's shape (its ``model`` name,
        ``dtype``, ``device``, ``num_blocks``, ``tokens_per_block``, ``max_seq_len``, ``tp``,
        ``num_kv_heads``), ``tp`` (the instance's TP size: every rank runs in this
        process), ``num_kv_heads`` (what the connector pairs TP sizes by; null: equal TP
        only), a producer's ``controls`` (every rank's control endpoint, rank order: a
        consumer of another TP size lists them) and a consumer's ``producer_tps``.

Every request gets an id (the ``X-Request-Id`` header, or a new one), echoed in the answer's
header and in the structured log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from ..metrics import DisaggCollector
from . import chat, tokenizer
from .bodies import (
    MAX_BODY_BYTES,
    BadRequest,
    encode_json,
    error_body,
    json_errors,
    parse_completion,
    parse_continuation,
    read_json,
)
from .engine_loop import EngineLoop, Job

log = logging.getLogger("disagg.serve")

LOOP_KEY = web.AppKey("engine_loop", EngineLoop)
STATE_KEY = web.AppKey("state", dict)
# After a request is queued to an engine thread with no request in flight the handler
# sleeps this long, GIL released, so that thread (waiting on the queue, or between idle
# iterations) adds it at once instead of after the handler's log line and response set-up
# have held the GIL for a switch interval.
ADMIT_HANDOFF_S = 100e-6


def _error(message: str, status: int, type_: str = "invalid_request_error") -> web.Response:
    return web.json_response(error_body(message, type_, status), status=status)


def build_app(
    engine_loop: EngineLoop,
    role: str,
    instance_id: str,
    model_name: str = "disagg-reference",
) -> web.Application:
    """The aiohttp application; ``engine_loop`` must be started."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_errors])
    app[LOOP_KEY] = engine_loop
    registry = CollectorRegistry()
    registry.register(DisaggCollector(engine_stats=lambda: engine_loop.stats))
    requests_total = Counter(
        "disagg_requests",
        "Completion requests served, by outcome",
        ["outcome"],
        registry=registry,
    )
    latency = Histogram(
        "disagg_request_seconds",
        "Completion latency (enqueue to last token)",
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        registry=registry,
    )
    ttft = Histogram(
        "disagg_time_to_first_token_seconds",
        "Enqueue to first token",
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        registry=registry,
    )
    app[STATE_KEY] = {"role": role, "instance_id": instance_id, "model": model_name}

    async def completions(request: web.Request) -> web.StreamResponse:
        return await serve(request, is_chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await serve(request, is_chat=True)

    async def serve(request: web.Request, is_chat: bool) -> web.StreamResponse:
        arrived = time.monotonic()
        prefix = "chatcmpl" if is_chat else "cmpl"
        rid = request.headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex[:16]}"
        try:
            body = await read_json(request)
            parse = chat.parse_chat if is_chat else parse_completion
            tokens, max_tokens, stream, salt, _ = parse(body)
            cfg = getattr(engine_loop.engine, "config", None)
            first = parse_continuation(body, max_tokens, getattr(cfg, "vocab_size", 1 << 31))
        except BadRequest as e:
            requests_total.labels("bad_request").inc()
            log.info("bad request", extra={"request_id": rid, "error": str(e)})
            return _error(str(e), 400)
        if first and role == "consumer":  # while the engine admits it: lease confirmed
            confirm_prefetch(_service(role), tokens, salt)
        model = body.get("model") or model_name
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any, Any]] = asyncio.Queue()

        def post(*item: Any) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop closed under us (shutdown)
                pass

        job = Job(
            request_id=rid,
            prompt=tokens + first,  # a continuation computes only after the given tokens
            max_tokens=max_tokens - len(first),
            cache_salt=salt,
            on_tokens=lambda new: post("tokens", new, None),
            on_done=lambda err, info: post("done", err, info),
        )
        job.marks.update(arrived=arrived, parsed=job.t0)
        try:
            engine_loop.submit(job)
        except RuntimeError as e:
            requests_total.labels("unavailable").inc()
            return _error(str(e), 503, "server_error")
        if not engine_loop.in_flight:  # else it is running forwards: it takes the job after one
            time.sleep(ADMIT_HANDOFF_S)
        log.info(
            "completion",
            extra={
                "request_id": rid,
                "prompt_tokens": len(tokens),
                "max_tokens": max_tokens,
                "stream": stream,
                "cache_salt": salt is not None,
                "first_tokens": len(first),
            },
        )
        created = int(time.time())
        out: list[int] = list(first)  # a continuation's answer counts the given tokens
        text = tokenizer.StreamDecoder(first)  # whose text the client has already had
        headers = {"X-Request-Id": rid}

        def chunk(new: list[int], finish: str | None, usage: bool) -> dict[str, Any]:
            said = (text.feed(new) + (text.flush() if finish else "")) if stream else None
            if is_chat:
                kind = "chat.completion.chunk" if stream else "chat.completion"
                lead = len(out) == len(new)  # the first delta carries the role
                choice = chat.choice(new, finish, stream, lead, said)
            else:
                kind = "text_completion"
                choice = {
                    "index": 0,
                    "text": tokenizer.decode(new) if said is None else said,
                    "token_ids": new,
                    "logprobs": None,
                    "finish_reason": finish,
                }
            d: dict[str, Any] = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if usage:
                d["usage"] = {
                    "prompt_tokens": len(tokens),
                    "completion_tokens": len(out),
                    "total_tokens": len(tokens) + len(out),
                }
            return d

        resp: web.StreamResponse | None = None
        while True:
            kind, a, info = await events.get()
            if kind == "tokens":
                if len(out) == len(first):
                    ttft.observe(time.monotonic() - job.t0)
                out.extend(a)
                if stream:
                    if resp is None:
                        resp = await _start_sse(request, headers)
                    await resp.write(b"data: " + encode_json(chunk(a, None, False)) + b"\n\n")
                continue
            err: str | None = a
            latency.observe(time.monotonic() - job.t0)
            extra = {"request_id": rid, "completion_tokens": len(out), **(info or {})}
            if err is not None:
                client = bool((info or {}).get("client_error"))
                requests_total.labels("bad_request" if client else "failed").inc()
                log.warning("completion failed", extra={**extra, "error": err})
                status = 400 if client else 500
                if resp is None and not stream:
                    return web.json_response(
                        error_body(
                            err, "invalid_request_error" if client else "server_error", status
                        ),
                        status=status,
                        headers=headers,
                    )
                if resp is None:
                    # Nothing sent yet: a plain error status lets a proxy retry elsewhere.
                    return web.json_response(
                        error_body(err, "server_error", status), status=status, headers=headers
                    )
                await resp.write(
                    f"data: {json.dumps(error_body(err, 'server_error', status))}\n\n".encode()
                )
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            requests_total.labels("ok").inc()
            svc = _service(role) if role == "consumer" else None
            loads = svc.timeline.pop(job.rid, {}) if svc is not None else {}
            extra["marks"] = {**job.marks, **loads}  # monotonic s: where its time went
            log.info("completion done", extra=extra)
            if not stream:
                body_out = chunk(out, "length", True)
                body_out["disagg"] = info or {}
                return web.Response(
                    body=encode_json(body_out), content_type="application/json", headers=headers
                )
            if resp is None:
                resp = await _start_sse(request, headers)
            last = chunk([], "length", True)
            last["disagg"] = info or {}  # connector_matched_tokens, as a whole answer has
            await resp.write(b"data: " + encode_json(last) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

    async def health(request: web.Request) -> web.Response:
        ok, details = health_of(engine_loop, role)
        svc = _service(role)
        if role == "producer" and svc is not None:
            details["incarnation"] = svc.incarnation  # a proxy notices a restart by it
            # and events it missed (a subscriber that joined late never sees a gap)
            details["events_seq"] = svc.events.seq if svc.events is not None else 0
        if role == "consumer" and svc is not None:
            details.update(svc.refusals.report())  # producers refusing us: still serving
        status = "unhealthy" if not ok else "degraded" if "degraded" in details else "ok"
        return web.json_response(
            {"status": status, "role": role, **details}, status=200 if ok else 503
        )

    async def metrics(request: web.Request) -> web.Response:
        data = generate_latest(registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def info(request: web.Request) -> web.Response:
        svc = _service(role)
        ranks = rank_services(role)
        out: dict[str, Any] = {
            "role": role,
            "instance_id": instance_id,
            "model": model_name,
            "continuation": True,
            "prefetch": role == "consumer" and svc is not None and svc.prefetches.why_not is None,
            # the TP size this instance runs (every rank in this process) and the model's
            # KV head count its connector pairs TP sizes by (None: head-blind, equal TP only)
            "tp": svc.tp_size if svc is not None else None,
            "num_kv_heads": svc.num_kv_heads if svc is not None and svc.heads else None,
        }
        cfg = getattr(engine_loop.engine, "config", None)
        if cfg is not None and hasattr(cfg, "model_name"):
            shape = ("dtype", "device", "num_blocks", "tokens_per_block", "max_seq_len", "tp")
            out["engine"] = {
                "model": cfg.model_name,
                "num_kv_heads": cfg.num_kv_heads,
                **{k: getattr(cfg, k) for k in shape},
            }
        if role == "producer" and ranks:
            out["controls"] = [s.endpoint for s in ranks]  # rank order
        if role == "consumer" and svc is not None:
            out["producer_tps"] = svc.producer_tps
        if svc is not None and role == "producer" and svc.store is not None:
            events = svc.events.endpoint if svc.events is not None else None
            out.update(
                tokens_per_block=svc.pool.tokens_per_block if svc.pool is not None else None,
                events=events,
                control=svc.endpoint,
                namespace_seed=svc.namespace_seed(None).hex(),
                incarnation=svc.incarnation,
            )
        return web.json_response(out)

    async def prefetch(request: web.Request) -> web.Response:
        """The proxy's word that this prompt is being prefilled (its continuation will come
        here): lease its blocks as the producer plans them (:mod:`disagg.consumer.prefetch`).
        Answers at once (202), saying whether a prefetch started."""
        svc = _service(role)
        if role != "consumer" or svc is None:
            return _error("only a consumer prefetches", 404)
        try:
            body = await read_json(request)
            parse = chat.parse_chat if request.query.get("chat") == "1" else parse_completion
            tokens, _, _, salt, _ = parse(body)
        except BadRequest as e:
            return _error(str(e), 400)
        why = await asyncio.to_thread(start_prefetch, svc, tokens, salt)
        out: dict[str, Any] = {"prefetch": why is None}
        if why is not None:
            out["why"] = why
        return web.json_response(out, status=202)

    async def seed(request: web.Request) -> web.Response:
        svc = _service(role)
        if role != "producer" or svc is None or svc.fingerprint is None:
            return _error("only an attached producer has a namespace", 404)
        salt = request.query.get("cache_salt")
        return web.json_response({"namespace_seed": svc.namespace_seed(salt).hex()})

    async def snapshot(request: web.Request) -> web.Response:
        svc = _service(role)
        if role != "producer" or svc is None or svc.store is None:
            return _error("only an attached producer has a store", 404)
        # seq first, then keys: every event <= seq is in the keys; later events re-apply
        # idempotently (set semantics), so nothing is lost.
        seq = svc.events.seq if svc.events is not None else 0
        keys = [k.hex() for k in svc.store.keys()]
        return web.json_response(
            {"producer": instance_id, "seq": seq, "keys": keys, "incarnation": svc.incarnation}
        )

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", _models(model_name))
    app.router.add_get("/disagg/info", info)
    app.router.add_get("/disagg/seed", seed)
    app.router.add_post("/disagg/prefetch", prefetch)
    app.router.add_get("/disagg/snapshot", snapshot)
    return app


def _models(model_name: str) -> Any:
    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": model_name, "object": "model", "owned_by": "disagg"}],
            }
        )

    return models


async def _start_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    return resp


def start_prefetch(svc: Any, tokens: list[int], salt: str | None) -> str | None:
    """Prefetch the whole blocks of ``tokens`` (every one is offerable to a continuation,
    which has at least one token more); None when started, else why not."""
    from ..protocol.keys import block_key_blob

    pool = svc.pool
    if pool is None or svc.fingerprint is None:
        return "no KV cache registered yet"
    tpb = pool.tokens_per_block
    n = len(tokens) // tpb
    if n == 0:
        return "the prompt has no whole block"
    keys = block_key_blob(svc.namespace_seed(salt), tokens[: n * tpb], tpb)
    why: str | None = svc.prefetches.start(keys)
    return why


def confirm_prefetch(svc: Any, tokens: list[int], salt: str | None) -> bool:
    """A continuation of ``tokens`` arrived: have its prefetched lease, if any, confirmed
    ahead of the engine's take (``Prefetches.confirm_ahead``); whether one was asked."""
    from ..protocol.keys import KEY_BYTES, block_key_blob

    pool = None if svc is None else svc.pool
    if pool is None or svc.fingerprint is None or len(tokens) < pool.tokens_per_block:
        return False
    tpb = pool.tokens_per_block
    first = block_key_blob(svc.namespace_seed(salt), tokens[:tpb], tpb).blob[:KEY_BYTES]
    ok: bool = svc.prefetches.confirm_ahead(first)
    return ok


def _service(role: str) -> Any:
    """This process's service of ``role``: its instance's rank 0 (``disagg serve`` runs one
    instance, every TP rank of it in this process)."""
    if role == "producer":
        from ..producer.service import _services as ps

        return next(iter(ps.values()), None)
    from ..consumer.service import _services as cs

    return next(iter(cs.values()), None)


def rank_services(role: str) -> list[Any]:
    """Every open service of ``role`` in this process (every TP rank), rank order."""
    if role == "producer":
        from ..producer.service import _registry as reg
    else:
        from ..consumer.service import _registry as reg  # type: ignore[assignment]
    return sorted(reg.live(), key=lambda s: s.tp_rank)


def health_of(engine_loop: EngineLoop, role: str) -> tuple[bool, dict[str, Any]]:
    """(healthy, details). Unhealthy when the engine thread is dead, the connector service
    is missing or closed, a producer's control server stopped, or the service's own
    ``health()`` (if it has one) says so."""
    reasons: list[str] = []
    if not engine_loop.alive:
        reasons.append(f"engine loop not running: {engine_loop.fatal or 'stopped'}")
    ranks = rank_services(role)
    details: dict[str, Any] = {"in_flight": engine_loop.in_flight}
    if not ranks:
        reasons.append(f"no {role} connector service in this process")
    for svc in ranks:
        ok, why = svc.health()
        if not ok:
            where = f" (TP rank {svc.tp_rank})" if len(ranks) > 1 else ""
            reasons.append(f"connector{where}: {why}")
    if reasons:
        details["reasons"] = reasons
    return not reasons, details
