"""The nixl plane's notifications: what a producer asks a consumer to read, and the
consumer's answer. They travel as NIXL notifications (UCX active messages between the two
agents), MessagePack behind a 5-byte prefix (``DGNX`` and a version byte); anything else
is dropped and counted.

- ``ReadPlan`` (producer -> consumer): transfer id, lease id and token (the consumer
  authenticates them against the transfer it expects), the source slab (its base address,
  row stride, row width, rows, memory kind and device: it must lie inside memory the
  producer registered, which NIXL checks against the metadata the producer sent in its
  ``HelloOk``), what the producer had left of its deadline, and the batches, each a group with its page size, the columns of a slab row
  that make a page, and the source rows and destination slots as little-endian int64
  arrays. A push larger than ``PART_PAGES`` pages comes in several plans (``part``
  counting from 0, ``last`` on the final one).
- ``ReadDone`` (consumer -> producer): sent once per transfer when nothing of it is read
  any more: ``ok`` with every page landed, else the reason. It carries the token, so only
  the consumer the producer pushed to can end a push (the producer reuses the rows after
  it).
- ``PushFailed`` (producer -> consumer): the producer gave up on a push before reading
  started (its rows are gone): the consumer fails the transfer at once.
- ``Probe`` (consumer -> producer): nothing; sent to learn whether NIXL still reaches the
  producer (reads.py), ignored on arrival.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
import numpy as np

PREFIX = b"DGNX\x01"
PART_PAGES = 1 << 16  # pages per ReadPlan: 1 MiB of row and slot arrays
MAX_NOTIF = 8 << 20  # a larger notification is dropped unread
MAX_PAGES = PART_PAGES

U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Token = Annotated[bytes, msgspec.Meta(max_length=64)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]


class Slab(msgspec.Struct, frozen=True, array_like=True):
    base: U63
    stride: U63
    width: U63
    nrows: U63
    mem: Literal["DRAM", "VRAM"]
    dev: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]


class Batch(msgspec.Struct, frozen=True, array_like=True):
    group: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    page_bytes: Annotated[int, msgspec.Meta(ge=1)]
    cols: Annotated[list[tuple[U63, U63]], msgspec.Meta(min_length=1, max_length=4096)]
    rows: Annotated[bytes, msgspec.Meta(max_length=8 * MAX_PAGES)]
    slots: Annotated[bytes, msgspec.Meta(max_length=8 * MAX_PAGES)]

    def arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, slots) as int64 arrays, or None when they do not pair up."""
        if len(self.rows) != len(self.slots) or len(self.rows) % 8:
            return None
        return np.frombuffer(self.rows, "<i8"), np.frombuffer(self.slots, "<i8")


class ReadPlan(msgspec.Struct, frozen=True, tag="plan"):
    transfer_id: U63
    lease_id: U63
    token: Token
    part: Annotated[int, msgspec.Meta(ge=0)]
    last: bool
    deadline_ms: U63  # what the producer had left of the push's deadline when it sent this
    slab: Slab
    batches: Annotated[list[Batch], msgspec.Meta(max_length=1 << 16)]


class ReadDone(msgspec.Struct, frozen=True, tag="done"):
    transfer_id: U63
    token: Token
    ok: bool
    error: Text = ""


class PushFailed(msgspec.Struct, frozen=True, tag="failed"):
    transfer_id: U63
    token: Token
    error: Text = ""


class Probe(msgspec.Struct, frozen=True, tag="probe"):
    pass


Notice = Union[ReadPlan, ReadDone, PushFailed, Probe]  # noqa: UP007 - msgspec needs the Union
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Notice)


def encode(msg: ReadPlan | ReadDone | PushFailed | Probe) -> bytes:
    return PREFIX + _enc.encode(msg)


def decode(data: bytes) -> ReadPlan | ReadDone | PushFailed | Probe | None:
    """The notification, or None for anything that is not one of ours (wrong prefix or
    version, too large, malformed)."""
    if len(data) > MAX_NOTIF or not data.startswith(PREFIX):
        return None
    try:
        return _dec.decode(memoryview(data)[len(PREFIX) :])  # type: ignore[no-any-return]
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None


def int64_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()
