"""Request bodies on the hot path (``disagg.serve.bodies``, the proxy's encodings): long
prompts are checked without a per-token loop and still refused item by item, the depth
limit holds whatever skips its scan, and what the proxy encodes decodes to the body."""

from __future__ import annotations

import json
import random
import re

import pytest

from disagg.proxy import first_token
from disagg.serve import bodies, chat
from disagg.serve.bodies import BadRequest, encode_json, parse_completion, parse_json

N = 12288


def _ids(n: int = N, seed: int = 3) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(512) for _ in range(n)]


@pytest.mark.parametrize(
    "bad, shown",
    [(True, "true"), (False, "false"), (-1, "-1"), (1.0, "1.0"), ("7", '"7"'), (None, "null")],
)
@pytest.mark.parametrize("batch", [False, True], ids=["list", "batch-of-one"])
def test_a_bad_id_deep_in_a_long_prompt_is_refused_by_position(
    bad: object, shown: str, batch: bool
) -> None:
    ids: list[object] = list(_ids())
    at = N - 5
    ids[at] = bad
    body = parse_json(json.dumps({"prompt": [ids] if batch else ids}).encode())
    where = "prompt[0]" if batch else "prompt"
    with pytest.raises(
        BadRequest, match=rf"^prompt: give .*; {re.escape(where)}\[{at}\] is {shown}$"
    ):
        parse_completion(body)


def test_a_long_prompt_of_ids_is_taken_as_a_new_list() -> None:
    ids = _ids()
    body = parse_json(encode_json({"prompt": ids, "max_tokens": 3, "stream": True}))
    tokens, max_tokens, stream, salt, was_text = parse_completion(body)
    assert tokens == ids and tokens is not body["prompt"]
    assert (max_tokens, stream, salt, was_text) == (3, True, None, False)
    assert parse_completion({"prompt": [[2**70, 0]]})[0] == [2**70, 0]  # the engine's to refuse
    assert parse_completion({"prompt": ["hi"]})[0] == [104, 105]


def _nested(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"prompt": ' + b"[" * (depth - 1) + inner + b"]" * (depth - 1) + b"}"


def test_the_depth_limit_holds_with_and_without_the_scan() -> None:
    limit = bodies.MAX_JSON_DEPTH
    assert parse_json(_nested(limit)) is not None
    for depth in (limit + 1, 5000):
        with pytest.raises(BadRequest, match=f"nests {depth} levels deep"):
            parse_json(_nested(depth))
    with pytest.raises(BadRequest, match="nests 33 levels deep"):
        parse_json(b"[" * 33 + b"]" * 33)
    # brackets inside strings nest nothing, however many
    flat = json.dumps({"prompt": "[" * 3000 + "{" * 3000, "x": ["]", "[["] * 50}).encode()
    assert parse_json(flat)["prompt"].startswith("[[[")
    # many brackets, shallow: a long chat
    talk = [{"role": "user", "content": [{"type": "text", "text": "a"}]} for _ in range(100)]
    assert chat.parse_chat(parse_json(encode_json({"messages": talk})))[0]


@pytest.mark.parametrize(
    "data", [b'{"prompt": [1, 2', b"\xff\xfe", b"", b'{"prompt": [NaN]}', b'{"a": "\xff"}']
)
def test_invalid_json_is_named(data: bytes) -> None:
    with pytest.raises(BadRequest, match="^the body is not valid JSON: "):
        parse_json(data)


def test_a_byte_order_mark_is_skipped() -> None:
    assert parse_json(b'\xef\xbb\xbf{"prompt": [1]}') == {"prompt": [1]}


def test_the_proxys_encodings_decode_to_the_body() -> None:
    body = {"prompt": _ids(), "max_tokens": 4, "user": "é\u2028\x00", "n": 2**70, "f": 0.1}
    assert json.loads(encode_json(body)) == body
    got = json.loads(first_token.Template.of(body).fill([5]))
    assert got == first_token.continuation(body, [5])


def test_an_upstream_event_the_strict_parser_refuses_is_still_read() -> None:
    """Python's encoder writes NaN; a producer's token must not be lost to it."""
    event = b'{"choices": [{"token_ids": [7], "finish_reason": null, "logprob": NaN}]}'
    assert first_token.from_json(event).tokens == [7]
    assert first_token.from_json(b"[" * 100_000).tokens == []
