"""HTTP request bodies and errors shared by ``disagg serve`` and ``disagg proxy``.

Every error either server answers is OpenAI-style JSON, ``{"error": {"message", "type",
"code"}}``, never aiohttp's plain text: ``json_errors`` (a middleware) turns an HTTP
exception (404, 405, 413) into that shape and any uncaught exception into a JSON 500 that
names its type (logged with its traceback).

A body is read once and parsed under two limits before anything else sees it:

- size: ``MAX_BODY_BYTES`` (the application's ``client_max_size``), else 413;
- nesting: at most ``MAX_JSON_DEPTH`` levels of arrays/objects, else 400. Python's json
  parser recurses per level, so a body of a few thousand ``[`` would raise RecursionError
  deep in the parser; the depth is counted first, outside strings, in one pass.

``parse_completion`` validates a completions body field by field (``BadRequest`` names the
field); the proxy runs it before any upstream sees the request, the server before the
engine does.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import numpy as np
from aiohttp import web

from . import tokenizer

log = logging.getLogger("disagg.serve")

# 128k-token prompts as JSON id lists are ~1 MiB; leave room for text prompts and fields.
MAX_BODY_BYTES = 32 << 20
MAX_JSON_DEPTH = 32
# A JSON string (escapes included): its brackets do not nest anything.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


class BadRequest(ValueError):
    pass


def error_body(message: str, type_: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


def json_error(message: str, status: int, type_: str | None = None, **extra: Any) -> web.Response:
    """An OpenAI-style JSON error; ``type_`` defaults by status (4xx: the client's)."""
    if type_ is None:
        type_ = "invalid_request_error" if status < 500 else "server_error"
    body = error_body(message, type_, status)
    body["error"].update(extra)
    return web.json_response(body, status=status)


def json_depth(data: bytes) -> int:
    """How deeply ``data``'s arrays and objects nest (brackets inside strings skipped)."""
    if data.count(b"[") + data.count(b"{") <= 1:  # the usual body: no scan needed
        return int(b"[" in data or b"{" in data)
    steps = _OPEN[np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``data`` as JSON, or BadRequest saying why not (never RecursionError)."""
    depth = json_depth(data)
    if depth > max_depth:
        raise BadRequest(f"the body nests {depth} levels deep; at most {max_depth} are allowed")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None


async def read_json(request: web.Request, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The request's JSON body under the size (``client_max_size``: 413) and depth limits."""
    return parse_json(await request.read(), max_depth)


def parse_completion(body: Any) -> tuple[list[int], int, bool, str | None, bool]:
    """Validate a completions body -> (tokens, max_tokens, stream, cache_salt, was_text).
    Raises :class:`BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI allows a batch; we serve a batch of one
    was_text = isinstance(prompt, str)
    if isinstance(prompt, str):
        tokens = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        tokens = list(prompt)
    else:
        raise BadRequest(
            "prompt: give a string, a list of token ids (integers >= 0), or a list of one of those"
        )
    if not tokens:
        raise BadRequest("prompt: must not be empty")
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(f"max_tokens: must be an integer >= 1, got {max_tokens!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream: must be true or false, got {stream!r}")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest(f"cache_salt: must be a string, got {salt!r}")
    return tokens, max_tokens, stream, salt, was_text


def parse_continuation(body: dict[str, Any], max_tokens: int, vocab_size: int) -> list[int]:
    """``disagg.first_tokens``: tokens of the answer already generated elsewhere (the
    producer's first token, sent by the proxy); the answer continues after them and
    counts them. ``[]`` when absent. Raises :class:`BadRequest` naming the field."""
    ext = body.get("disagg")
    if ext is None:
        return []
    if not isinstance(ext, dict):
        raise BadRequest("disagg: must be an object")
    first = ext.get("first_tokens", [])
    if not isinstance(first, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in first
    ):
        raise BadRequest(f"disagg.first_tokens: must be a list of token ids in [0, {vocab_size})")
    if len(first) >= max_tokens:
        raise BadRequest(
            f"disagg.first_tokens: {len(first)} token(s) leave nothing of max_tokens="
            f"{max_tokens} to generate; answer from them directly"
        )
    return list(first)


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error answered as JSON: HTTP exceptions keep their status, anything uncaught
    is a 500 naming its type."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400 or e.content_type == "application/json":
            raise
        if isinstance(e, web.HTTPRequestEntityTooLarge):
            msg = f"the body is larger than the limit of {request.client_max_size} bytes"
        else:
            msg = f"{e.reason}: {request.method} {request.path}"
        return json_error(msg, e.status)
    except Exception as e:  # a handler bug must still answer JSON, and be logged
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(f"internal error ({type(e).__name__}): {e}"[:500], 500)
