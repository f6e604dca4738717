"""Every control and data-plane header message, and their MessagePack encoding.

Messages are frozen msgspec Structs in one tagged union (``kind`` names the type), each
with a protocol version ``v`` (defaulted to ours when constructing). ``decode`` validates
types and ranges natively while decoding and returns a fully built message or raises
ProtocolError; it never returns a partial message. Unknown *fields* are ignored (so a
later minor addition does not break older peers); unknown *kinds* are refused.
Range constraints (``Meta``) are enforced by ``decode`` only, i.e. on every received
frame; ``__post_init__`` checks cross-field rules on both construction and decode.

Incarnations: every producer and consumer process picks a random ``incarnation`` (``U64``,
non-zero) at start and names it in ``Hello``/``HelloOk``. Every request that touches a
producer's state (``Lookup``, ``Claim``, ``Renew``, ``Release``, ``ReleaseRange``,
``Push``) names the producer incarnation the sender means, ``ClaimOk`` the one that granted
the lease, and events and snapshots the one that published them. A producer refuses a
request naming another incarnation (``STALE_INCARNATION``) before it reads anything else,
so a lease id of a dead process never reaches the live one's table. ``0`` means "not
named" (an older peer): accepted, and lease ids start at a random base per incarnation.

The keys of ``Lookup`` and ``Claim`` travel packed: one ``bin`` of ``16 * n`` bytes (a
``KeyBlob`` in Python), not a list of ``n`` objects; anything but a bin, a blob that is not
a whole number of keys, or one longer than ``MAX_KEYS`` keys, is refused as ``BAD_FIELD``
naming ``$.keys``.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection
from typing import TYPE_CHECKING, Annotated, Any, Union

import msgspec

from .errors import ErrorCode, ProtocolError
from .fingerprint import Fingerprint
from .keys import KEY_BYTES, KeyBlob
from .version import (
    MAX_CONTROL_FRAME,
    MAX_DATA_META,
    MAX_GROUPS,
    MAX_KEYS,
    MAX_STR,
    PROTOCOL_VERSION,
)

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Pos = Annotated[int, msgspec.Meta(ge=1)]
U64 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # ids: non-negative int64
Str = Annotated[str, msgspec.Meta(max_length=MAX_STR)]
Key = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
if TYPE_CHECKING:
    PackedKeys = KeyBlob
else:  # the decoder checks a bin natively (type, size); __post_init__ makes it a KeyBlob
    PackedKeys = Annotated[bytes, msgspec.Meta(max_length=MAX_KEYS * KEY_BYTES)]
# A process's incarnation: random, non-zero; 0 on the wire means "not named" (older peer).
Incarnation = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Slot = Annotated[int, msgspec.Meta(ge=-1)]  # -1: skip this group's page of the block
Ttl = Annotated[float, msgspec.Meta(gt=0, le=86400)]
MAX_CLAIM_WAIT_S = 60.0  # the longest a Claim may wait for its blocks (Claim.wait_s)
Token = Annotated[bytes, msgspec.Meta(max_length=64)]


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of all messages; ``v`` is on the wire in every one."""

    v: int = PROTOCOL_VERSION


# --- handshake -------------------------------------------------------------------------


class DataCaps(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a receiver's data plane takes, beyond the plane's base behaviour. The consumer
    sends its plane's ``capabilities`` in ``Hello`` and in every ``Push``; the producer's
    plane reads them from the Push (``post_push(caps=...)``), never from the address.
    The producer sends its plane's ``source_caps`` in ``HelloOk`` (what a consumer needs
    to read from it). A field a plane does not use stays at its default."""

    parts: bool = False  # ipc: takes a push in several parts (the first lands early)
    tcp_segment_bytes: NonNeg = 0  # ucx tcp: packed host batches may come cut this big
    tcp_rx_segment_bytes: NonNeg = 0  # ucx tcp: UCX's tcp receive segment here (0: unsaid)
    iov_recv: bool = False  # ucx tcp: receives packed segments straight into host slots
    direct: bool = False  # ucx shm: runs may land in the rows as they are read
    rma: NonNeg = 0  # ucx: reads store rows itself from RMA headers of this version
    # nixl: this side's NIXL agent metadata (a consumer's: connection information only; a
    # producer's: with its store's memory keys)
    nixl: Annotated[bytes, msgspec.Meta(max_length=MAX_DATA_META)] = b""


class Hello(Message, frozen=True, tag="hello"):
    """``incarnation``: the sender's (consumer process's) incarnation."""

    instance_id: Str
    role: Str
    fingerprint: Fingerprint
    data_endpoint: Str = ""
    transport: Str = "tcp"
    incarnation: Incarnation = 0
    data_caps: DataCaps = DataCaps()


class HelloOk(Message, frozen=True, tag="hello_ok"):
    """``features``: the optional requests this producer serves, by name (``FEATURES``).
    An older producer sends none (the field is new; unknown fields are ignored both
    ways), so a consumer never sends it a request it would misread or refuse."""

    instance_id: Str
    fingerprint: Fingerprint
    data_endpoint: Str = ""
    transport: Str = "tcp"
    features: Annotated[list[Str], msgspec.Meta(max_length=64)] = []
    incarnation: Incarnation = 0  # the producer process's
    data_caps: DataCaps = DataCaps()  # what a consumer needs to read from this producer
    # the layer whose save reserves a pass's blocks (a Lookup or Claim finds them from
    # then on); 0: the pass's end, after its first token is sent. An older producer names
    # none: read as 1 (held while the pass runs)
    reserves_at_layer: NonNeg = 1


# --- generic replies -------------------------------------------------------------------


class Ok(Message, frozen=True, tag="ok"):
    pass


class Error(Message, frozen=True, tag="error"):
    code: int
    message: Annotated[str, msgspec.Meta(max_length=65536)] = ""


# --- index and leases ------------------------------------------------------------------


def _pack_keys(msg: Message) -> None:
    """Lookup/Claim keys become a KeyBlob: from the bin a frame carried (refused unless it
    is a whole number of keys), or on construction from packed bytes or any sequence of
    16-byte keys (a list: each is checked)."""
    keys = msg.keys  # type: ignore[attr-defined]
    if isinstance(keys, KeyBlob):
        return
    if isinstance(keys, (bytes, bytearray, memoryview)):
        try:
            keys = KeyBlob(keys)
        except ValueError as e:  # decode() reports it as BAD_FIELD
            raise ValueError(f"{e} - at `$.keys`") from None
    else:
        keys = KeyBlob.of(keys)
    msgspec.structs.force_setattr(msg, "keys", keys)


class Lookup(Message, frozen=True, tag="lookup"):
    """How many leading ``keys`` does the producer hold (in every layer group)?"""

    owner: Str
    keys: PackedKeys
    incarnation: Incarnation = 0

    def __post_init__(self) -> None:
        _pack_keys(self)


class LookupOk(Message, frozen=True, tag="lookup_ok"):
    num_blocks: NonNeg


class Claim(Message, frozen=True, tag="claim"):
    """Pin the longest held prefix of ``keys`` for ``request_id`` for ``ttl_s``.

    ``wait_s`` > 0 (to a producer announcing ``claim_wait``): if not every key is held,
    the answer waits until they are (a lease of all of them) or ``wait_s`` has passed (a
    miss); never a part. An older producer ignores it and answers at once."""

    owner: Str
    request_id: Str
    keys: PackedKeys
    ttl_s: Ttl = 30.0
    incarnation: Incarnation = 0
    wait_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_CLAIM_WAIT_S)] = 0.0

    def __post_init__(self) -> None:
        _pack_keys(self)


class ClaimOk(Message, frozen=True, tag="claim_ok"):
    lease_id: U64
    num_blocks: NonNeg
    ttl_s: Ttl
    incarnation: Incarnation = 0  # the producer's that granted it


class Renew(Message, frozen=True, tag="renew"):
    owner: Str
    lease_ids: Annotated[list[U64], msgspec.Meta(max_length=MAX_KEYS)]
    incarnation: Incarnation = 0


class RenewOk(Message, frozen=True, tag="renew_ok"):
    unknown: Annotated[list[U64], msgspec.Meta(max_length=MAX_KEYS)] = []


class Release(Message, frozen=True, tag="release"):
    owner: Str
    lease_id: U64
    incarnation: Incarnation = 0


class ReleaseRange(Message, frozen=True, tag="release_range"):
    """Release blocks ``[first_block, first_block + num_blocks)`` of a lease (relative to
    the lease), keeping the rest leased; the lease ends once none is left. Feature
    ``release_range`` (``HelloOk.features``). A new *kind*, not new fields on ``Release``:
    an older producer ignores unknown fields and would free the whole lease, where an
    unknown kind is refused by name (``UNKNOWN_KIND``: "unknown message kind
    'release_range'")."""

    owner: Str
    lease_id: U64
    first_block: NonNeg
    num_blocks: Pos
    incarnation: Incarnation = 0


# Optional requests a producer may serve, by name (HelloOk.features).
FEATURE_RELEASE_RANGE = "release_range"
FEATURE_CLAIM_WAIT = "claim_wait"  # Claim.wait_s
FEATURES = (FEATURE_RELEASE_RANGE, FEATURE_CLAIM_WAIT)


class Push(Message, frozen=True, tag="push"):
    """Push blocks ``[first_block, first_block + num_blocks)`` of the lease to
    ``data_endpoint``; ``dst_slots[g][i]`` is group g's slot for block first_block+i."""

    owner: Str
    lease_id: U64
    transfer_id: U64
    data_endpoint: Str
    first_block: NonNeg
    num_blocks: NonNeg
    dst_slots: Annotated[
        list[Annotated[list[Slot], msgspec.Meta(max_length=MAX_KEYS)]],
        msgspec.Meta(max_length=MAX_GROUPS),
    ]
    token: Token = b""
    # Send layer by layer (ascending layer ids) into the receiver's per-layer groups, so a
    # synchronous consumer can compute layer i while later layers are still in flight.
    layerwise: bool = False
    incarnation: Incarnation = 0
    data_caps: DataCaps = DataCaps()  # what the receiver at data_endpoint takes
    # TP sizes that differ (``engine.heads``): only KV heads ``[heads[0], heads[1])`` of
    # each page (empty: the whole page), each buffer's run in page order; the receiver's
    # group indices start at ``group_base`` (its groups for exactly those heads)
    heads: Annotated[list[NonNeg], msgspec.Meta(max_length=2)] = []
    group_base: Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)] = 0

    def __post_init__(self) -> None:
        if self.heads and (len(self.heads) != 2 or self.heads[0] >= self.heads[1]):
            raise ValueError(f"heads {self.heads} must be [first, end) with first < end")
        for g, slots in enumerate(self.dst_slots):
            if len(slots) != self.num_blocks:
                raise ValueError(
                    f"dst_slots[{g}] has {len(slots)} slots but num_blocks is {self.num_blocks}"
                )


class PushOk(Message, frozen=True, tag="push_ok"):
    transfer_id: U64


class Heartbeat(Message, frozen=True, tag="heartbeat"):
    owner: Str


# --- events ----------------------------------------------------------------------------


class Stored(Message, frozen=True, tag="stored"):
    """``seq`` counts from 1 per publisher ``incarnation``: a new incarnation's stream is a
    new stream, whatever its numbers."""

    producer: Str
    seq: Pos
    keys: Keys
    incarnation: Incarnation = 0


class Removed(Message, frozen=True, tag="removed"):
    producer: Str
    seq: Pos
    keys: Keys
    incarnation: Incarnation = 0


class SnapshotRequest(Message, frozen=True, tag="snapshot"):
    pass


class SnapshotOk(Message, frozen=True, tag="snapshot_ok"):
    """Every key held at event sequence ``seq`` (events with seq <= this are included)."""

    producer: Str
    seq: NonNeg
    keys: Keys
    incarnation: Incarnation = 0


# --- data plane headers ----------------------------------------------------------------


class PageBatch(Message, frozen=True, tag="pages"):
    """Header of one data message; the payload frames that follow hold, run after run,
    ``count * page_bytes`` bytes per run in slot order. A run never shares a frame with
    another run, and frames are at most 1 MiB."""

    transfer_id: U64
    lease_id: U64
    token: Token
    group: Annotated[int, msgspec.Meta(ge=0, lt=MAX_GROUPS)]
    runs: Annotated[
        list[tuple[NonNeg, Pos]], msgspec.Meta(min_length=1, max_length=MAX_KEYS)
    ]  # (dst_start_slot, count)
    page_bytes: Pos
    last: bool = False


class TransferDone(Message, frozen=True, tag="done"):
    """Last message of a transfer. ``checksum`` is xxh3-64 of all payload bytes in send
    order, or 0 when the sender did not compute one."""

    transfer_id: U64
    lease_id: U64 = 0
    token: Token = b""
    ok: bool = True
    message: Annotated[str, msgspec.Meta(max_length=65536)] = ""
    checksum: NonNeg = 0  # uint64


AnyMessage = Union[  # noqa: UP007 - msgspec needs a runtime Union object
    Hello,
    HelloOk,
    Ok,
    Error,
    Lookup,
    LookupOk,
    Claim,
    ClaimOk,
    Renew,
    RenewOk,
    Release,
    ReleaseRange,
    Push,
    PushOk,
    Heartbeat,
    Stored,
    Removed,
    SnapshotRequest,
    SnapshotOk,
    PageBatch,
    TransferDone,
]

ALL_MESSAGES: tuple[type[Message], ...] = AnyMessage.__args__  # type: ignore[attr-defined]
KINDS = {cls.__struct_config__.tag: cls for cls in ALL_MESSAGES}


def new_incarnation() -> int:
    """A fresh process incarnation: random, non-zero, fits an int64."""
    return secrets.randbits(63) or 1


def check_incarnation(msg: Message, mine: int) -> None:
    """Refuse ``msg`` (STALE_INCARNATION) if it names an incarnation other than ``mine``;
    a message naming none (``0``, an older peer) passes."""
    named = getattr(msg, "incarnation", 0)
    if named and named != mine:
        raise ProtocolError(
            ErrorCode.STALE_INCARNATION,
            f"{type(msg).__name__} names incarnation {named:#x}, but this process is "
            f"incarnation {mine:#x} (the peer restarted): say Hello again",
        )


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, KeyBlob):  # Lookup/Claim keys: one bin
        return obj.blob
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(AnyMessage)


class _Head(msgspec.Struct):
    """Just enough of a frame to say why a full decode failed."""

    kind: Any = None
    v: Any = None


_head_decoder = msgspec.msgpack.Decoder(_Head)


def encode(msg: Message) -> bytes:
    """MessagePack bytes of ``msg`` (a map with ``kind`` first)."""
    return _encoder.encode(msg)


def decode(data: bytes | memoryview, max_bytes: int = MAX_CONTROL_FRAME) -> Message:
    """Decode one frame into a message, or raise ProtocolError with code TOO_LARGE,
    BAD_FRAME, BAD_VERSION, UNKNOWN_KIND or BAD_FIELD and a message naming the problem."""
    return decode_with(_decoder, KINDS, data, max_bytes)


def decode_with(
    decoder: msgspec.msgpack.Decoder[Any],
    kinds: Collection[Any],
    data: bytes | memoryview,
    max_bytes: int,
) -> Any:
    """``decode`` for another union of messages (``decoder``, whose tags are ``kinds``):
    the same limits, version check and error classification."""
    if len(data) > max_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"frame of {len(data)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        msg = decoder.decode(data)
    except msgspec.ValidationError as e:
        raise _classify(data, str(e), kinds) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"undecodable frame: {e}") from None
    except RecursionError:  # e.g. thousands of nested arrays in a field we skip
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame nests too deeply") from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version {msg.v} is not ours ({PROTOCOL_VERSION}); upgrade the older peer",
        )
    return msg


def _classify(data: bytes | memoryview, detail: str, kinds: Collection[Any]) -> ProtocolError:
    """A validation failure: decide whether the version, the kind or a field is to blame."""
    try:
        head = _head_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return ProtocolError(ErrorCode.BAD_FRAME, f"frame is not a message map: {detail}")
    except RecursionError:  # `kind`/`v` decode as anything: deeply nested arrays
        return ProtocolError(ErrorCode.BAD_FRAME, f"frame nests too deeply: {detail}")
    if head.v is not None and head.v != PROTOCOL_VERSION:
        return ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version {head.v!r} is not ours ({PROTOCOL_VERSION}); upgrade the older peer",
        )
    if head.kind is None:
        return ProtocolError(ErrorCode.BAD_FRAME, f"frame has no `kind`: {detail}")
    if not isinstance(head.kind, str):  # a map or list as `kind` cannot name a message
        return ProtocolError(ErrorCode.BAD_FRAME, f"`kind` is not a string: {detail}")
    if head.kind not in kinds:
        return ProtocolError(ErrorCode.UNKNOWN_KIND, f"unknown message kind {head.kind!r}")
    return ProtocolError(ErrorCode.BAD_FIELD, f"bad {head.kind!r} message: {detail}")


def error_reply(exc: BaseException) -> Error:
    """The Error message answering ``exc`` (INTERNAL for anything not a ProtocolError)."""
    if isinstance(exc, ProtocolError):
        return Error(code=int(exc.code), message=exc.message)
    return Error(code=int(ErrorCode.INTERNAL), message=f"{type(exc).__name__}: {exc}")


def raise_if_error(msg: Message) -> Message:
    """Return ``msg`` unless it is an Error, which is raised as ProtocolError."""
    if isinstance(msg, Error):
        raise ProtocolError(msg.code, msg.message)
    return msg
