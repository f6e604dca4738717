"""The trivial tokenizer of the reference engine's HTTP server.

Contract: a text prompt becomes its UTF-8 bytes, one token per byte (ids 0..255, all inside
the reference model's 512-token vocabulary). Decoding maps each id to ``id % 256`` and
decodes the bytes as UTF-8 with replacement characters. It is deterministic across
processes and machines, so a producer and a consumer agree on the tokens of a text prompt
without sharing a vocabulary file. It is not meant to produce readable text: the reference
model's weights are random.
"""

from __future__ import annotations

import codecs


def encode(text: str) -> list[int]:
    """``text`` -> one token id per UTF-8 byte."""
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    """Token ids -> text (``id % 256`` as a byte; invalid UTF-8 becomes U+FFFD)."""
    return bytes(int(t) % 256 for t in tokens).decode("utf-8", errors="replace")


class StreamDecoder:
    """Text of a token stream chunk by chunk: a UTF-8 character whose bytes span two chunks
    comes out whole with the later one (decoding each chunk alone would give two U+FFFD).
    ``seed`` feeds tokens whose text someone else already sent (a continuation)."""

    def __init__(self, seed: list[int] | None = None) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if seed:
            self.feed(seed)

    def feed(self, tokens: list[int]) -> str:
        return self._dec.decode(bytes(int(t) % 256 for t in tokens))

    def flush(self) -> str:
        """What is held back at the end (an incomplete character: U+FFFD)."""
        return self._dec.decode(b"", final=True)
