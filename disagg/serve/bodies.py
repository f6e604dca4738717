"""HTTP request bodies and errors shared by ``disagg serve`` and ``disagg proxy``.

Every error either server answers is OpenAI-style JSON, ``{"error": {"message", "type",
"code"}}``, never aiohttp's plain text: ``json_errors`` (a middleware) turns an HTTP
exception (404, 405, 413) into that shape and any uncaught exception into a JSON 500 that
names its type (logged with its traceback).

A body is read once and parsed under two limits before anything else sees it:

- size: ``MAX_BODY_BYTES`` (the application's ``client_max_size``), else 413;
- nesting: at most ``MAX_JSON_DEPTH`` levels of arrays/objects, else 400. A JSON parser
  recurses per level, so a body of a few thousand ``[`` would raise RecursionError deep
  in it; the depth is bounded first. A body with no more opening brackets than the limit
  (a prompt of token ids has two) cannot nest deeper, so it is not scanned; any other is
  counted exactly, outside strings, in one pass.

Bodies are decoded and encoded with msgspec (strict JSON, UTF-8: ``NaN`` and lone
surrogates are invalid), and a prompt's token ids are checked in one C-level pass: a
12k-token prompt costs ~0.4 ms on the 2-core box (docs/design/first-token.md).
``encode_json`` is what the proxy sends upstream with.

``parse_completion`` validates a completions body field by field (``BadRequest`` names the
field); the proxy runs it before any upstream sees the request, the server before the
engine does.
"""

from __future__ import annotations

import codecs
import logging
import re
from typing import Annotated, Any

import msgspec
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


def _plain(obj: Any) -> Any:
    """A numpy scalar as the Python number it holds (the stdlib encoder takes a float64)."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder(enc_hook=_plain)
# True is not an id (msgspec, unlike isinstance, keeps bool apart from int)
_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0)]]
PROMPT_HELP = (
    "prompt: give a string, a list of token ids (integers >= 0), or a list of one of those"
)


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
    steps = _OPEN[np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``data`` as JSON, or BadRequest saying why not (never RecursionError)."""
    # Each level opens a bracket, so their count bounds the depth (one inside a string
    # only over-counts): two byte counts clear the usual body without the exact scan.
    if data.count(b"[") + data.count(b"{") > max_depth:
        depth = json_depth(data)
        if depth > max_depth:
            raise BadRequest(f"the body nests {depth} levels deep; at most {max_depth} are allowed")
    if data.startswith(codecs.BOM_UTF8):  # allowed before JSON text; msgspec refuses it
        data = data[len(codecs.BOM_UTF8) :]
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None


def encode_json(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON (what a decoded body re-encodes to upstream)."""
    return _ENCODER.encode(obj)


def token_ids(prompt: list[Any], where: str = "prompt") -> list[int]:
    """``prompt`` checked as token ids (integers >= 0, no bools) in one C-level pass: a
    new list, or BadRequest naming the first item that is not one (``where[i]``)."""
    try:
        return msgspec.convert(prompt, _TOKEN_IDS)
    except msgspec.ValidationError:
        pass
    for i, t in enumerate(prompt):  # the refused body's slow path: name the item
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise BadRequest(f"{PROMPT_HELP}; {where}[{i}] is {_shown(t)}") from None
    raise BadRequest(PROMPT_HELP)


def _shown(value: Any, limit: int = 40) -> str:
    """``value`` as the client wrote it (JSON), cut to ``limit`` characters."""
    try:
        text = _ENCODER.encode(value).decode(errors="replace")
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def read_json(request: web.Request, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The request's JSON body under the size (``client_max_size``: 413) and depth limits."""
    return parse_json(await request.read(), max_depth)


def parse_completion(body: Any) -> tuple[list[int], int, bool, str | None, bool]:
    """Validate a completions body -> (tokens, max_tokens, stream, cache_salt, was_text).
    Raises :class:`BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt, where = body.get("prompt"), "prompt"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt, where = prompt[0], "prompt[0]"  # OpenAI allows a batch; we serve one
    was_text = isinstance(prompt, str)
    if isinstance(prompt, str):
        tokens = tokenizer.encode(prompt)
    elif isinstance(prompt, list):
        tokens = token_ids(prompt, where)
    else:
        raise BadRequest(PROMPT_HELP)
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
