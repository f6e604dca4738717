"""One request's way through the upstreams: the prefill on a producer (longest held
prefix first), the first token's hand-over (:mod:`disagg.proxy.first_token`) and the
decode on a consumer, each attempt bounded by its deadline and retried on the next upstream
until bytes of that role reach the client. ``ProxyState`` (:mod:`disagg.proxy.app`) is
built on it and owns what it reads: the HTTP client, upstreams, routing index, limits and
metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Histogram

from ..serve.bodies import encode_json
from . import first_token, timeline
from .errors import UpstreamError, _all_failed, _err_json, _upstream_message, _why
from .first_token import Prefilled
from .limits import SEED_WAIT_S, ProxyLimits
from .routing import PrefixIndex, Upstream, choose, prompt_keys

log = logging.getLogger("disagg.proxy")

# the consumer answers a prefetch at once (its work runs in the background); past this
# the proxy stops waiting for that answer, which costs only the prefetch
PREFETCH_POST_S = 2.0


async def _end(resp: web.StreamResponse) -> None:
    """End a client's stream, its last event (``[DONE]``) written. A client may close its
    connection as soon as it reads ``[DONE]``, before the chunked encoding's end reaches
    it: it has the whole answer, so the request still ends as answered (its outcome
    counted, its ``done`` line and moments logged) instead of failing here."""
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()


class Superseded(Exception):
    """The producer's stream said, after the continuation was sent, that its answer is the
    whole one (a stop condition met by the first token): the consumer's is not used."""


class Forwarding:
    """The request path of a proxy (see the module docstring)."""

    http: aiohttp.ClientSession | None
    producers: list[Upstream]
    consumers: list[Upstream]
    index: PrefixIndex
    limits: ProxyLimits
    _seed_tasks: dict[tuple[str, str | None], asyncio.Task[None]]
    _prefetches: set[asyncio.Task[None]]
    prefetch: bool
    m_down: Counter
    m_route: Counter
    m_matched: Counter
    m_upstream_errors: Counter
    m_retries: Counter
    m_first_token: Counter
    m_prefill: Histogram

    async def _info(self, up: Upstream) -> dict[str, Any]:
        assert self.http is not None
        async with self.http.get(
            f"{up.url}/disagg/info", timeout=aiohttp.ClientTimeout(total=3)
        ) as r:
            if r.status != 200:
                raise ValueError(f"status {r.status}")
            return dict(await r.json())

    async def seed_for(self, up: Upstream, salt: str | None) -> None:
        """Fetch ``up``'s namespace seed for ``salt`` once (a miss only costs routing)."""
        if salt in up.seeds or up.instance_id is None:
            return
        assert self.http is not None
        timeout = self.limits.heartbeat_s
        try:
            async with self.http.get(
                f"{up.url}/disagg/seed",
                params={"cache_salt": salt or ""},
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as r:
                if r.status == 200:
                    up.seeds[salt] = bytes.fromhex((await r.json())["namespace_seed"])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
            pass

    async def seeds_for(self, salt: str | None) -> None:
        """The seeds of ``salt`` from every producer that is up, waiting at most
        ``SEED_WAIT_S``: a stopped producer never adds seconds to a request; the fetches
        go on in the background and later requests route with what they learn."""
        tasks = []
        for up in self.producers:
            if salt in up.seeds or up.instance_id is None or up.known_down():
                continue
            key = (up.url, salt)
            task = self._seed_tasks.get(key)
            if task is None:
                task = asyncio.create_task(self.seed_for(up, salt))
                self._seed_tasks[key] = task
                task.add_done_callback(partial(self._seed_done, key))
            tasks.append(task)
        if tasks:
            await asyncio.wait(tasks, timeout=SEED_WAIT_S)

    def _seed_done(self, key: tuple[str, str | None], _task: asyncio.Task[None]) -> None:
        self._seed_tasks.pop(key, None)

    # -- health: heartbeats ------------------------------------------------------------
    def _down(self, up: Upstream, role: str, cause: str, reason: str, hold_s: float = 0.0) -> None:
        """Mark ``up`` down for ``reason`` (kept at least ``hold_s``)."""
        if up.down_reason is None:
            self.m_down.labels(role, cause).inc()
            log.warning("upstream down", extra={"upstream": up.url, "reason": reason})
        up.down_reason = reason
        up.down_until = max(up.down_until, time.monotonic() + hold_s)

    # -- one request ---------------------------------------------------------------------
    async def prefill(
        self,
        body: dict[str, Any],
        tokens: list[int],
        salt: str | None,
        rid: str,
        path: str = "/v1/completions",
        stream: bool = False,
        on_send: Callable[[], None] | None = None,
    ) -> web.Response | Prefilled:
        """Run the prefill (one token, streamed if the client streams) on a producer: its
        answer, or the error response. ``on_send`` is called once, as the first attempt is
        sent: what it schedules runs while the producer prefills, never before the send."""
        assert self.http is not None
        if salt is not None:
            await self.seeds_for(salt)
        if len(self.producers) == 1:  # no choice to make: the prefix is counted later
            order, matched = list(self.producers), None
        else:
            order, matched = choose(
                self.producers, self.index, tokens, salt, self.limits.prefix_load_skew
            )
            self._count_route(matched)
        pbody = encode_json({**body, "max_tokens": 1, "stream": stream})  # once for every try
        deadline = self.limits.prefill_s(len(tokens))
        last: UpstreamError | None = None
        for up in order:
            t0 = time.monotonic()
            up.in_flight += 1
            timeline.mark("prefill_sent")
            try:
                ctx = self.http.post(
                    f"{up.url}{path}",
                    data=pbody,
                    headers={"X-Request-Id": rid, "Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=deadline, sock_connect=5),
                )
                if on_send is not None:  # its tasks run at the first wait, after the send
                    on_send()
                    on_send = None
                r = await ctx.__aenter__()
                owned: Any = ctx  # closed here unless a stream's reader took it over
                try:
                    status = r.status
                    pre: Prefilled | None = None
                    if status == 200 and r.content_type == "text/event-stream":
                        pre, data = await self._until_token(r, ctx), b""
                        owned = None if pre.rest is not None else ctx
                    else:
                        data = await r.read()
                finally:
                    if owned is not None:
                        await owned.__aexit__(None, None, None)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                up.failures += 1
                if isinstance(e, asyncio.TimeoutError):
                    kind, why = "deadline", f"prefill deadline of {deadline:.3g} s expired"
                    self._down(up, "producer", kind, why, self.limits.down_after_s)
                else:
                    kind, why = "unreachable", f"unreachable: {_why(e)}"
                    self._down(up, "producer", kind, why)
                self.m_upstream_errors.labels("producer", kind).inc()
                last = UpstreamError(up.url, None, why, True)
                log.warning(
                    "producer failed; trying the next",
                    extra={"request_id": rid, "upstream": up.url, "error": why},
                )
                continue
            finally:
                up.in_flight -= 1
            self.m_prefill.observe(time.monotonic() - t0)
            if status == 200:
                timeline.defer(partial(self._routed, up, tokens, salt, rid, matched))
                return pre if pre is not None else first_token.from_json(data)
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

    def _count_route(self, matched: int) -> None:
        self.m_route.labels("prefix" if matched else "least_loaded").inc()
        self.m_matched.inc(matched)

    def _routed(
        self, up: Upstream, tokens: list[int], salt: str | None, rid: str, matched: int | None
    ) -> None:
        """After a prefill on ``up`` (off the first token's path): the routing index notes
        the prompt's blocks there; ``matched`` None: the route was not chosen by prefix,
        its count is taken here."""
        inst = up.instance_id
        keys = prompt_keys(up, tokens, salt) if inst is not None else []
        if matched is None:
            matched = self.index.longest_prefix(inst, keys) if inst is not None and keys else 0
            self._count_route(matched)
        log.info(
            "prefilled", extra={"request_id": rid, "upstream": up.url, "matched_blocks": matched}
        )
        if inst is not None and keys:
            self.index.note_routed(inst, keys)

    async def _until_token(self, r: aiohttp.ClientResponse, ctx: Any) -> Prefilled:
        """Read a streamed prefill until its token event; the rest is read by a task
        (``Prefilled.rest``) that then closes ``ctx``. A stream that ends or fails before
        the token is read whole here (its failure raises: the next producer is tried)."""
        pre = Prefilled()
        got = asyncio.Event()
        reader = asyncio.create_task(first_token.read_events(r.content, pre, got.set))
        waiter = asyncio.create_task(got.wait())
        try:
            await asyncio.wait({reader, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            reader.cancel()
            raise
        finally:
            waiter.cancel()
        if not got.is_set():
            reader.result()  # raises what broke the stream before its token
            timeline.mark("producer_done")
            return pre
        timeline.mark("producer_token")

        async def rest() -> None:
            try:
                await first_token.drain(pre, reader)
                timeline.mark("producer_done")
            finally:
                await ctx.__aexit__(None, None, None)

        pre.rest = asyncio.create_task(rest())
        return pre

    def start_prefetch(self, body: dict[str, Any], path: str, rid: str) -> Upstream | None:
        """Tell the consumer first in line about the prompt now, while the producer
        prefills (``POST /disagg/prefetch``: it leases the prompt's blocks as the producer
        plans them, so the continuation skips its claim). Fire and forget: the consumer,
        or None if none is configured. Only one that advertises ``prefetch`` is told."""
        order = self.consumer_order()
        if not self.prefetch or not order or order[0].prefetch is False:
            return None
        up = order[0]
        task = asyncio.create_task(self._prefetch(up, body, path, rid))
        self._prefetches.add(task)
        task.add_done_callback(self._prefetches.discard)
        return up

    async def _prefetch(self, up: Upstream, body: dict[str, Any], path: str, rid: str) -> None:
        assert self.http is not None
        if not await self.continues(up) or not up.prefetch:
            return
        query = "?chat=1" if path == "/v1/chat/completions" else ""
        timeline.mark("prefetch_sent")
        try:
            async with self.http.post(
                f"{up.url}/disagg/prefetch{query}",
                data=encode_json(body),
                headers={"X-Request-Id": rid, "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=PREFETCH_POST_S),
            ) as r:
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # it only costs the claim
            log.debug("prefetch not taken", extra={"upstream": up.url, "error": _why(e)})

    async def decode(
        self,
        request: web.Request,
        body: dict[str, Any] | bytes,
        rid: str,
        deadline: float,
        path: str = "/v1/completions",
        resp: web.StreamResponse | None = None,
        order: list[Upstream] | None = None,
        gate: Callable[[], Awaitable[bool]] | None = None,
    ) -> web.StreamResponse:
        """Run the request on a consumer, retrying others until the consumer's bytes reach
        the client; each attempt bounded by ``deadline`` seconds. ``resp``: a stream
        already begun (the producer's first token sent): the consumer's events follow,
        and a failure of every consumer ends it with an error event. ``order``: the
        consumers to try (default: every one, best first). ``gate``: awaited before the
        consumer's first bytes go to the client; False raises ``Superseded``."""
        assert self.http is not None
        order = self.consumer_order() if order is None else order
        last: UpstreamError | None = None
        for attempt, up in enumerate(order):
            if attempt:
                self.m_retries.inc()
            up.in_flight += 1
            try:
                return await self._decode_on(request, up, body, rid, deadline, path, resp, gate)
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
        if resp is not None:  # the client has its first token: end the stream by name
            who = f"every consumer failed; last: consumer {last.url}: {last.message}"
            err = {"error": {"message": who, "type": "upstream_error", "code": 502}}
            await resp.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
            await _end(resp)
            return resp
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
        self,
        request: web.Request,
        up: Upstream,
        body: dict[str, Any] | bytes,
        rid: str,
        deadline: float,
        path: str,
        begun: web.StreamResponse | None = None,
        gate: Callable[[], Awaitable[bool]] | None = None,
    ) -> web.StreamResponse:
        assert self.http is not None
        timeline.mark("consumer_sent")
        try:
            encoded = body if isinstance(body, bytes) else encode_json(body)
            ctx = self.http.post(
                f"{up.url}{path}",
                data=encoded,
                headers={"X-Request-Id": rid, "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=deadline, sock_connect=5),
            )
            # the request's deferred work runs while the consumer computes (at the
            # loop's first wait, once the request is written)
            asyncio.get_running_loop().call_soon(timeline.run, timeline.take_deferred())
            r = await ctx.__aenter__()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise self._decode_failed(up, e, deadline, "") from e
        try:
            if r.status != 200:
                try:
                    data = await r.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    raise self._decode_failed(up, e, deadline, "") from e
                kind = "client_error" if r.status < 500 else "server_error"
                self.m_upstream_errors.labels("consumer", kind).inc()
                raise UpstreamError(up.url, r.status, _upstream_message(data), r.status >= 500)
            ctype = r.headers.get("Content-Type", "")
            if not ctype.startswith("text/event-stream"):
                try:
                    data = await r.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    raise self._decode_failed(up, e, deadline, "") from e
                if begun is not None:
                    raise UpstreamError(up.url, 200, "answered JSON to a streamed request", True)
                return web.Response(
                    body=data,
                    status=200,
                    content_type="application/json",
                    headers={"X-Request-Id": rid},
                )
            # Wait for the first bytes before answering: a failure until then can retry.
            try:
                first = await r.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise self._decode_failed(up, e, deadline, "stream broke before any data: ") from e
            if not first:
                raise UpstreamError(up.url, 200, "stream ended before any data", True)
            timeline.mark("consumer_first")
            if gate is not None and not await gate():
                raise Superseded()
            resp = begun if begun is not None else await self.begin_stream(request, rid)
            await resp.write(first)
            try:
                async for data in r.content.iter_any():
                    await resp.write(data)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.m_upstream_errors.labels("consumer", "stream_broken").inc()
                why = _why(e, deadline)
                if isinstance(e, asyncio.TimeoutError):
                    why = f"decode deadline of {deadline:.3g} s expired"
                    self._down(up, "consumer", "deadline", why, self.limits.down_after_s)
                log.warning(
                    "consumer stream broke",
                    extra={"request_id": rid, "upstream": up.url, "error": why},
                )
                err = {
                    "error": {
                        "message": f"consumer {up.url}: stream broke: {why}",
                        "type": "upstream_error",
                        "code": 502,
                    }
                }
                await resp.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
            await _end(resp)
            return resp
        finally:
            await ctx.__aexit__(None, None, None)

    async def answer(
        self,
        request: web.Request,
        body: dict[str, Any],
        pre: Prefilled,
        max_tokens: int,
        stream: bool,
        rid: str,
        deadline: float,
        path: str,
        prefer: Upstream | None = None,
        template: asyncio.Task[first_token.Template] | None = None,
    ) -> web.StreamResponse:
        """The client's answer after the producer's prefill (``first_token``): the
        producer's own when it is the whole answer; else its first token at once and the
        consumer's continuation after it (``prefer`` first: the consumer told of the
        prompt; ``template``: its request, encoded meanwhile); else (a plain path,
        counted) the consumer's."""
        if pre.rest is not None and (max_tokens == 1 or not pre.tokens):
            await pre.rest  # the producer's answer is needed whole
        if pre.tokens and (max_tokens == 1 or pre.whole):
            return await self._producer_answer(request, pre, stream, rid)
        # only consumers known to take the continuation get it: another would generate
        # from the prompt alone and repeat the first token
        able = [up for up in self.consumer_order() if await self.continues(up)]
        if prefer is not None and prefer in able and not prefer.known_down():
            able.remove(prefer)
            able.insert(0, prefer)
        why = None
        if not pre.tokens or (stream and pre.first_event is None):
            why = first_token.NO_TOKEN_IDS
        elif not able:
            why = first_token.NO_CONTINUATION
        if why is not None:
            self.m_first_token.labels(why).inc()
            return await self.decode(request, body, rid, deadline, path)
        cbody: dict[str, Any] | bytes
        if template is not None:  # encoded while the producer prefilled
            cbody = (await template).fill(pre.tokens)
        else:
            cbody = first_token.continuation(body, pre.tokens)
        if not stream:
            self.m_first_token.labels("producer").inc()
            return await self.decode(request, cbody, rid, deadline, path, order=able)
        resp = await self.begin_stream(request, rid)
        assert pre.first_event is not None
        timeline.mark("client_token")  # before the write: the client may read it first
        await resp.write(pre.first_event)

        async def gate() -> bool:  # the producer's stream read to its end
            if pre.rest is not None:
                await pre.rest
            return not pre.whole

        try:
            out = await self.decode(request, cbody, rid, deadline, path, resp, able, gate)
        except Superseded:  # its first token ended the answer: the rest of its stream
            self.m_first_token.labels("producer").inc()
            for event in pre.events[pre.events.index(pre.first_event) + 1 :]:
                await resp.write(event)
            await _end(resp)
            return resp
        self.m_first_token.labels("producer").inc()
        return out

    async def _producer_answer(
        self, request: web.Request, pre: Prefilled, stream: bool, rid: str
    ) -> web.StreamResponse:
        """The producer's answer is the whole answer: sent as is."""
        self.m_first_token.labels("producer").inc()
        if not stream:
            return web.Response(
                body=pre.body, content_type="application/json", headers={"X-Request-Id": rid}
            )
        resp = await self.begin_stream(request, rid)
        for event in pre.events:
            await resp.write(event)
        await _end(resp)
        return resp

    async def begin_stream(self, request: web.Request, rid: str) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": rid,
            }
        )
        await resp.prepare(request)
        return resp

    def consumer_order(self) -> list[Upstream]:
        """Consumers to try, best first: those not known down, then those not degraded
        (every producer refuses it: it computes every prompt itself), then fewest in
        flight."""
        return sorted(
            self.consumers, key=lambda u: (u.known_down(), u.degraded is not None, u.in_flight)
        )

    async def continues(self, up: Upstream) -> bool:
        """Whether consumer ``up`` takes ``disagg.first_tokens`` (its ``/disagg/info`` says
        ``continuation: true``), asked once; one that cannot be asked now counts as not
        taking them this time (asked again next time)."""
        if up.continuation is None:
            try:
                info = await self._info(up)
                up.continuation = bool(info.get("continuation"))
                up.prefetch = bool(info.get("prefetch"))
            except ValueError:  # it answered, without that route: it never will
                up.continuation = up.prefetch = False
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False
        return up.continuation

    def _decode_failed(
        self, up: Upstream, e: BaseException, deadline: float, prefix: str
    ) -> UpstreamError:
        """A decode attempt failed before any byte reached the client: mark the consumer
        down (an expired deadline holds it down a while) and say how, to retry elsewhere."""
        if isinstance(e, asyncio.TimeoutError):
            kind, why = "deadline", f"{prefix}decode deadline of {deadline:.3g} s expired"
            self._down(up, "consumer", kind, why, self.limits.down_after_s)
        elif prefix:  # it answered, then broke: not known to be down
            kind, why = "stream_broken", f"{prefix}{_why(e)}"
        else:
            kind, why = "unreachable", f"unreachable: {_why(e)}"
            self._down(up, "consumer", kind, why)
        self.m_upstream_errors.labels("consumer", kind).inc()
        return UpstreamError(up.url, None, why, True)
