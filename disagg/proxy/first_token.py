"""The producer's first token, handed to the client and continued by the consumer.

The proxy asks the producer for one token (``max_tokens: 1``, streamed when the client
streams). That token is the answer's first: the client gets it as soon as the producer has
it, and the consumer continues from prompt + that token (``disagg.first_tokens`` in its
request, :func:`disagg.serve.bodies.parse_continuation`): it claims the prompt's blocks,
computes only the tail and the first token's KV, and its answer counts the given token
(a non-streamed one carries it; a stream sends only what follows). The request is the
client's own, chat or completions, so a chat prompt is templated on the consumer as
before.

When the producer's answer is the whole answer (``max_tokens: 1``, or its finish reason
is not ``length``: a stop condition met by the first token), it goes to the client as is
and no consumer is asked. When the producer's answer carries no token ids, or the consumer
does not take continuations (its ``/disagg/info`` has no ``continuation: true``, as a
``trtllm-serve`` one), the request takes the plain path: the consumer computes the first
token again and its answer goes to the client; each such request is counted by reason.

Wire: a streamed prefill is read as SSE events; the event carrying the token
(``choices[0].token_ids``) is forwarded to the client byte for byte as soon as it is read,
so its text is the producer's (a UTF-8 character split across the first and second token
comes out whole in the consumer's next chunk). The rest of the producer's stream is read
in the background (:func:`drain`) while the consumer already continues; the consumer's
bytes reach the client only once it is read, so a stop condition it reports still makes
the producer's answer the whole one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from ..serve.bodies import encode_json

# why a request took the plain path (the proxy's metric label and /health)
NO_TOKEN_IDS = "producer_gave_no_token_ids"
NO_CONTINUATION = "consumer_takes_no_continuation"

_DECODER = msgspec.json.Decoder()


def _decode(data: bytes) -> Any:
    """An upstream's JSON; what msgspec refuses (``NaN``, a lone surrogate: Python's
    encoder writes them) is read by the stdlib's parser. ValueError if neither can."""
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        return json.loads(data)
    except (UnicodeDecodeError, RecursionError) as e:
        raise ValueError(str(e)) from None


@dataclass
class Prefilled:
    """What a producer answered for the prefill."""

    tokens: list[int] = field(default_factory=list)  # its token ids ([] if it gave none)
    finish: str | None = None  # the finish reason of its answer
    body: bytes = b""  # a JSON answer as received
    events: list[bytes] = field(default_factory=list)  # a stream's SSE events, raw
    first_event: bytes | None = None  # the streamed event carrying the tokens
    # a stream whose token event was read: the task reading the rest (None: read whole)
    rest: asyncio.Task[None] | None = None
    rest_error: str | None = None  # why the rest could not be read (the token stands)

    @property
    def whole(self) -> bool:
        """The producer's answer is the whole answer (a stop condition met)."""
        return self.finish is not None and self.finish != "length"


def _choice(d: Any) -> dict[str, Any]:
    if isinstance(d, dict) and isinstance(d.get("choices"), list) and d["choices"]:
        c = d["choices"][0]
        if isinstance(c, dict):
            return c
    return {}


def _ids(choice: dict[str, Any]) -> list[int]:
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return list(ids)
    return []


def from_json(data: bytes) -> Prefilled:
    """A non-streamed prefill answer."""
    try:
        c = _choice(_decode(data))
    except ValueError:
        c = {}
    finish = c.get("finish_reason")
    return Prefilled(_ids(c), finish if isinstance(finish, str) else None, body=data)


async def from_stream(content: aiohttp.StreamReader) -> Prefilled:
    """A streamed prefill answer, read to its end (``[DONE]`` or the stream's close)."""
    out = Prefilled()
    await read_events(content, out, None)
    return out


async def read_events(
    content: aiohttp.StreamReader,
    out: Prefilled,
    on_token: Callable[[], None] | None,
) -> None:
    """Read SSE events into ``out`` until ``[DONE]`` or the stream's close; call
    ``on_token`` once, right after the event carrying the token ids (or a stop) is read."""
    buf = b""
    told = on_token is None
    async for line in content:
        buf += line
        if line not in (b"\n", b"\r\n"):
            continue
        event, buf = buf, b""
        data = b"".join(ln[5:].strip() for ln in event.splitlines() if ln.startswith(b"data:"))
        if not data:
            continue
        out.events.append(event)
        if data == b"[DONE]":
            break
        try:
            c = _choice(_decode(data))
        except ValueError:
            continue
        ids = _ids(c)
        if ids and out.first_event is None:
            out.tokens, out.first_event = ids, event
        finish = c.get("finish_reason")
        if isinstance(finish, str):
            out.finish = finish
        if not told and (out.first_event is not None or out.whole):
            told = True
            assert on_token is not None
            on_token()


async def drain(out: Prefilled, rest: Awaitable[None]) -> None:
    """Wait for the rest of a stream whose token was read; a failure there is recorded
    (``rest_error``), never raised: the client has the token, the consumer continues."""
    try:
        await rest
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.rest_error = f"{type(e).__name__}: {e}"


def continuation(body: dict[str, Any], tokens: list[int]) -> dict[str, Any]:
    """The consumer's request: the client's, continuing after ``tokens``."""
    ext = body.get("disagg")
    extra: dict[str, Any] = ext if isinstance(ext, dict) else {}
    return {**body, "disagg": {**extra, "first_tokens": list(tokens)}}


_SLOT = "\u0000first-tokens\u0000"  # stands for the ids while the body is encoded


@dataclass(frozen=True)
class Template:
    """The consumer's request encoded while the producer prefills (a 12k-token prompt's
    JSON costs ~0.05 ms, off the first-to-second-token gap this way): the ids go between
    ``head`` and ``tail``. ``disagg`` is the body's last key and ``first_tokens`` its
    last, so the slot is the encoding's last string, whatever the client's body holds."""

    head: bytes
    tail: bytes

    @classmethod
    def of(cls, body: dict[str, Any]) -> Template:
        ext = body.get("disagg")
        extra = {k: v for k, v in (ext if isinstance(ext, dict) else {}).items()}
        extra.pop("first_tokens", None)
        out = {k: v for k, v in body.items() if k != "disagg"}
        out["disagg"] = {**extra, "first_tokens": _SLOT}
        head, slot, tail = encode_json(out).rpartition(encode_json(_SLOT))
        assert slot, "the slot is in the encoding"
        return cls(head, tail)

    def fill(self, tokens: list[int]) -> bytes:
        return self.head + encode_json(list(tokens)) + self.tail
