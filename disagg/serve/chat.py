"""``/v1/chat/completions`` for the reference engine: messages -> one prompt, and the
OpenAI chat response shapes.

The reference tokenizer (:mod:`disagg.serve.tokenizer`, one token per UTF-8 byte) has no
chat template of its own, so it gets this one, fixed and plain; a producer and a consumer
(and the proxy, which routes by the prompt's blocks) turn the same messages into the same
tokens::

    <|system|>\\nYou are terse.\\n<|user|>\\nHello\\n<|assistant|>\\n

Each message is ``<|ROLE|>\\n`` + its text + ``\\n``; the prompt ends with
``<|assistant|>\\n`` (the generation prompt). ``content`` is a string or a list of
``{"type": "text", "text": ...}`` parts (joined). ``max_completion_tokens`` is accepted as
``max_tokens``; ``stream`` and ``cache_salt`` are as in completions.
"""

from __future__ import annotations

from typing import Any

from . import tokenizer
from .bodies import BadRequest, parse_completion

ROLES = ("system", "user", "assistant", "developer", "tool")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise BadRequest(f"{where}[{i}]: only text parts are served here")
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"{where}[{i}].text: must be a string")
            parts.append(text)
        return "".join(parts)
    raise BadRequest(f"{where}: must be a string or a list of text parts")


def render(messages: Any) -> str:
    """The chat template (module docstring) applied to ``messages``."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: must be a non-empty list of {role, content} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}]: must be an object with role and content")
        role = msg.get("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role: {role!r}; use one of {', '.join(ROLES)}")
        out.append(f"<|{role}|>\n{_text(msg.get('content'), f'messages[{i}].content')}\n")
    return "".join(out) + "<|assistant|>\n"


def parse_chat(body: Any) -> tuple[list[int], int, bool, str | None, bool]:
    """Validate a chat body -> what :func:`disagg.serve.bodies.parse_completion` returns
    for the rendered prompt (``BadRequest`` names the field)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    as_completion: dict[str, Any] = {"prompt": tokenizer.encode(render(body.get("messages")))}
    for key in ("stream", "cache_salt"):
        if key in body:
            as_completion[key] = body[key]
    if "max_tokens" in body or "max_completion_tokens" in body:
        as_completion["max_tokens"] = body.get("max_tokens", body.get("max_completion_tokens"))
    return parse_completion(as_completion)


def choice(
    new: list[int], finish: str | None, stream: bool, first: bool, text: str | None = None
) -> dict[str, Any]:
    """One chat choice: a ``delta`` when streaming (the first carries the role), else the
    whole ``message``; ``token_ids`` as in completions; ``text`` (default: ``new`` decoded
    alone) is what a stream's decoder gives for them."""
    text = tokenizer.decode(new) if text is None else text
    body: dict[str, Any] = {"index": 0, "token_ids": new, "finish_reason": finish}
    if stream:
        body["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        body["message"] = {"role": "assistant", "content": text}
    body["logprobs"] = None
    return body
