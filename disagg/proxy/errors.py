"""The proxy's error answers: OpenAI-style JSON naming the upstream that failed, and
how a failure reads in words."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web


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


def _why(e: BaseException, timeout_s: float | None = None) -> str:
    """A failure in words, never empty (a timeout's str() is)."""
    if isinstance(e, asyncio.TimeoutError) and timeout_s is not None:
        return f"no answer within {timeout_s:.3g} s"
    return str(e) or type(e).__name__


def _json_dict(body: bytes) -> dict[str, Any]:
    try:
        d = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return d if isinstance(d, dict) else {}
