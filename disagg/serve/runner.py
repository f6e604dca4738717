"""Run an aiohttp application whose every answer, even to a malformed request, is JSON.

aiohttp answers a request it cannot parse (a bad request line, a bad header) before any
handler or middleware runs, in plain text. ``run_app`` serves the application as
``aiohttp.web.run_app`` does (SIGINT/SIGTERM end it gracefully), with a request handler
whose protocol-level errors are the same OpenAI-style JSON as ``bodies.json_error``.
"""

from __future__ import annotations

import asyncio
import gc
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from .. import tuning
from .bodies import json_error


class _JsonErrorHandler(RequestHandler):  # type: ignore[type-arg]
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; refuses a sent response
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
        text = message or (str(exc) if exc is not None and status < 500 else "") or phrase
        resp = json_error(" ".join((text or "error").split()), status)
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:  # type: ignore[type-arg]
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class _JsonErrorRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # same state, our handler factory
        return server


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed and ``tuning.uvloop`` is not off, else asyncio's."""
    if tuning.current().uvloop is not False:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def freeze_heap() -> None:
    """Collect once, then move every live object to the permanent generation
    (``tuning.gc_freeze``): a server's start-up heap (torch, the model, the engine) is
    never garbage, but every full collection walked it with the GIL held, stalling the
    engine thread, the connectors' threads and the event loop alike."""
    if tuning.current().gc_freeze is not False:
        gc.collect()
        gc.freeze()


def run_app(app: web.Application, *, host: str, port: int, shutdown_timeout: float = 5.0) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT/SIGTERM, then clean it up."""

    async def serve() -> None:
        runner = _JsonErrorRunner(app, shutdown_timeout=shutdown_timeout, handle_signals=True)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            freeze_heap()
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(serve())
    try:
        loop.run_until_complete(task)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        task.cancel()
        try:
            loop.run_until_complete(task)
        except (asyncio.CancelledError, web.GracefulExit, KeyboardInterrupt):
            pass
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


__all__: list[Any] = ["freeze_heap", "run_app"]
