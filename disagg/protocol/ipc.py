"""Wire messages of the same-host (``ipc``) data plane.

The sender describes where its pages lie in memory the receiver can map (an ``Export``:
a POSIX shared-memory file or a CUDA IPC handle) and which rows of it go to which page
slots (``IpcBatch``); the receiver copies them itself and answers ``IpcAck``. Only
descriptions cross the socket, never page bytes. Decoded with the same rules as every
other message (``messages.decode``): version checked, ranges enforced while decoding,
errors as ProtocolError naming the field.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from .messages import U64, Message, NonNeg, Pos, Str, Token, decode_with
from .messages import encode as encode  # one encoder for every message
from .version import MAX_CONTROL_FRAME, MAX_GROUPS, MAX_KEYS

Handle = Annotated[bytes, msgspec.Meta(max_length=256)]
Blob = Annotated[bytes, msgspec.Meta(min_length=4, max_length=8 * MAX_KEYS)]
Spans = Annotated[list[tuple[NonNeg, Pos]], msgspec.Meta(min_length=1, max_length=1024)]


class Export(msgspec.Struct, frozen=True, kw_only=True):
    """Memory of the sender's that receivers on its host may map (read only).

    ``shm``: the file ``name`` under /dev/shm. ``cuda``: the fields of torch's CUDA IPC
    share of the storage (``device_uuid`` names the GPU, since device indices differ
    between processes with different CUDA_VISIBLE_DEVICES)."""

    export_id: U64
    kind: Literal["shm", "cuda"]
    host: Str  # boot id of the sender's host: an export is valid on that host only
    pid: Annotated[int, msgspec.Meta(ge=1)]
    nbytes: U64
    name: Str = ""
    device_uuid: Str = ""
    handle: Handle = b""
    offset: NonNeg = 0
    ref_handle: Handle = b""
    ref_offset: NonNeg = 0
    event_handle: Handle = b""
    event_sync: bool = False


class IpcBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Pages of one layer group: page ``i`` is the concatenation of ``spans`` (column,
    length) of source row ``rows[i]`` of export ``export_id``, whose row ``r`` starts at
    byte ``base + r * row_stride``; it lands in slot ``slots[i]``. ``rows`` and ``slots``
    are little-endian signed integer arrays of ``index_bytes`` each (one blob each:
    thousands of pages decode at once; 4 bytes whenever every index fits, which halves
    what crosses the socket and what the receiver stages for the GPU). The receiver
    refuses a blob whose length is not a multiple of ``index_bytes`` or differs between
    the two."""

    group: Annotated[int, msgspec.Meta(ge=0, lt=MAX_GROUPS)]
    export_id: U64
    base: NonNeg
    row_stride: Pos
    rows: Blob
    slots: Blob
    spans: Spans
    page_bytes: Pos
    index_bytes: Literal[4, 8] = 8


class IpcPush(Message, frozen=True, tag="ipc_push"):
    """One transfer, or one part of it: its exports (every time: the receiver may be new)
    and batches.
    ``not_after`` is the sender's CLOCK_MONOTONIC deadline (one clock per host): the
    receiver starts no copy after it, because the sender then reuses the rows."""

    transfer_id: U64
    lease_id: U64
    token: Token
    exports: Annotated[list[Export], msgspec.Meta(max_length=64)]
    batches: Annotated[list[IpcBatch], msgspec.Meta(max_length=4 * MAX_GROUPS)]
    not_after: float
    # A large device push travels as several messages ("parts", numbered from 0) so the
    # receiver starts copying the first while the rest are still on their way; only the
    # message with ``last`` finishes the transfer (and is answered when it went well).
    part: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] = 0
    last: bool = True


class IpcAck(Message, frozen=True, tag="ipc_ack"):
    """The receiver's answer: the copy is over (``ok``) or refused/failed (``message``)."""

    transfer_id: U64
    ok: bool = True
    message: Annotated[str, msgspec.Meta(max_length=65536)] = ""


class IpcFail(Message, frozen=True, tag="ipc_fail"):
    """The sender gives up on a transfer it announced (or never could start it)."""

    transfer_id: U64
    token: Token
    message: Annotated[str, msgspec.Meta(max_length=65536)] = ""


AnyIpc = Union[IpcPush, IpcAck, IpcFail]  # noqa: UP007 - msgspec needs a runtime Union
_KINDS = {"ipc_push", "ipc_ack", "ipc_fail"}
_decoder = msgspec.msgpack.Decoder(AnyIpc)


def decode(
    data: bytes | memoryview, max_bytes: int = MAX_CONTROL_FRAME
) -> IpcPush | IpcAck | IpcFail:
    """One ipc-plane frame, or ProtocolError (TOO_LARGE, BAD_FRAME, BAD_VERSION,
    UNKNOWN_KIND, BAD_FIELD) with a message naming what was wrong (``messages.decode``'s
    rules)."""
    msg: IpcPush | IpcAck | IpcFail = decode_with(_decoder, _KINDS, data, max_bytes)
    return msg
