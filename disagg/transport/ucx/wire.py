"""What travels between two UCX planes: tags, frames, how a batch is cut into payload
messages, and the RMA batch header. Everything here is a pure function of its inputs, so
sender and receiver agree without saying more.

Every message is a tagged message on the plane's one UCX worker. Tags (64 bits):

- 0-7, taken with one masked probe (so headers and TransferDone keep their order):
  ``HDR_RMA_TAG`` an RMA batch header (below); ``HDR_TAG`` a PageBatch whose payload
  follows in segments cut with the receiving channel's own rule, or a TransferDone;
  ``HDR_WHOLE_TAG`` a PageBatch whose payload follows as ONE message (CUDA rows);
  ``HDR_DIRECT_TAG`` / ``HDR_TCP_SEG_TAG`` / ``HDR_TCP_PACK_TAG`` a host PageBatch cut
  the way the receiver's capabilities allowed (``send_cut``; the receiver reads the cut
  from the tag alone, ``recv_cut``).
- payload segment ``k`` of a transfer: top bit set, 63 bits of BLAKE2b keyed with the
  transfer's token over (transfer id, k) (``data_tag``): nobody without the token can
  name a segment the receiver waits for.
- acknowledgement of RMA batch ``b``: bit 62 set, top bit clear, keyed likewise over
  (transfer id, b) (``ack_tag``); body ``b"\\x00"`` (read) or ``b"\\x01"`` + error text.

Header frame (``frame``): 4-byte little-endian length, then a msgpack ``PageBatch`` or
``TransferDone`` (protocol/messages.py).

Segments (``segments``): a batch's runs in page order; a run of at least ``direct_min``
bytes is its own segment(s) (split at ``seg_bytes``), smaller runs are packed together
up to ``seg_bytes``. Segment numbers continue across the batches of a transfer.

RMA header, version 2 (``rma_frame`` / ``rma_parse``): 4-byte length, then the fixed
block ``RMA_FIXED`` (magic ``b"RMA2"``, transfer, lease, group, page bytes, batch number,
page count, the slab's base address, rows, stride and readable width, and the lengths of
the next four fields), the token, the packed rkey, the producer's worker-address endpoint
(UTF-8), the column spans as (offset, length) u64 pairs, then the destination slot and
the slab row of every page as little-endian i64 arrays. No payload follows: the receiver
reads the rows itself and acknowledges the batch under ``ack_tag``. A header whose magic
names another version raises ``RmaVersionError``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...protocol import messages as m

# Largest payload message: few large messages beat many small.
SEG_BYTES = 16 << 20
# Packed segments over tcp when the receiver offers it: the sender's gather into a 2 MiB
# send buffer and the kernel's copy out of it (and the kernel's copy into a 2 MiB scratch
# and the scatter out of it) then meet in cache.
TCP_SEG_BYTES = 2 << 20
# Runs at least this big go zero-copy into the rows; smaller ones are packed. Over tcp,
# 256 KiB pages each sent as its own message moved 2.3-2.4 GB/s, packed 3.1-3.2.
DIRECT_MIN = 1 << 20
# ... to a tcp receiver that takes packed segments as iov receives (no copy either
# way), only runs longer than a segment go alone (1 MiB pages: +14-22%)
TCP_PACK_DIRECT_MIN = TCP_SEG_BYTES + 1
# ... and on shm every run is packed unless the receiver's rows are huge pages
SHM_DIRECT_MIN = 1 << 62
RUNS_PER_BATCH = 2048  # keeps headers ~<32 KiB
BATCH_BYTES = 256 << 20
HDR_MAX = 1 << 20  # a longer header frame is refused

HDR_RMA_TAG = 0
HDR_TAG = 1
HDR_WHOLE_TAG = 2
HDR_DIRECT_TAG = 3  # host batch cut with DIRECT_MIN on shm (receiver offered ``direct``)
HDR_TCP_SEG_TAG = 4  # host batch cut into TCP_SEG_BYTES segments
HDR_TCP_PACK_TAG = 5  # ... with runs up to a segment packed (receiver offered ``iov_recv``)
HDR_MASK_TAGS = 7
DATA_BIT = 1 << 63
ACK_BIT = 1 << 62
U64 = (1 << 64) - 1

RMA_VERSION = 2
RMA_MAGIC = b"RMA2"
RMA_FIXED = struct.Struct("<4sQQIQIIQQQQHHHH")


def tag_key(token: bytes) -> bytes:
    return token if len(token) <= 64 else hashlib.blake2b(token).digest()


def data_tag(key: bytes, transfer_id: int, seq: int) -> int:
    """The tag of payload segment ``seq`` of a transfer (``key``: ``tag_key(token)``)."""
    msg = struct.pack("<QQ", transfer_id & U64, seq & U64)
    digest = hashlib.blake2b(msg, key=key, digest_size=8).digest()
    return DATA_BIT | (int.from_bytes(digest, "little") & (DATA_BIT - 1))


def ack_tag(key: bytes, transfer_id: int, batch: int) -> int:
    """The tag of the consumer's acknowledgement of RMA batch ``batch``: keyed like
    ``data_tag``, so a stranger cannot make the producer release rows still being read."""
    msg = struct.pack("<QQQ", transfer_id & U64, batch & U64, 0xAC4)
    digest = hashlib.blake2b(msg, key=key, digest_size=8).digest()
    return ACK_BIT | (int.from_bytes(digest, "little") & (ACK_BIT - 1))


def frame(msg: m.Message) -> np.ndarray:
    """A header frame: 4-byte little-endian length + the encoded message."""
    body = m.encode(msg)
    return np.frombuffer(struct.pack("<I", len(body)) + body, dtype=np.uint8)


@dataclass(frozen=True)
class Segment:
    """One payload message: ``runs`` of (dst_start, count), ``first`` = index of its
    first page within the batch; ``direct`` when it is a single big run."""

    runs: tuple[tuple[int, int], ...]
    first: int
    pages: int
    direct: bool


def segments(
    runs: Sequence[tuple[int, int]],
    page_bytes: int,
    direct_min: int = DIRECT_MIN,
    seg_bytes: int | None = None,
) -> list[Segment]:
    """Cut a batch's runs into payload messages of at most ``seg_bytes`` (default
    ``SEG_BYTES``; or one page) each. Both sides call this on the header."""
    out: list[Segment] = []
    per_seg = max(1, (SEG_BYTES if seg_bytes is None else seg_bytes) // page_bytes)
    packed: list[tuple[int, int]] = []
    packed_first = packed_pages = 0
    page = 0

    def flush() -> None:
        nonlocal packed, packed_pages
        if packed:
            out.append(Segment(tuple(packed), packed_first, packed_pages, False))
        packed, packed_pages = [], 0

    for start, count in runs:
        if count * page_bytes >= direct_min:
            flush()
            done = 0
            while done < count:
                take = min(per_seg, count - done)
                out.append(Segment(((start + done, take),), page + done, take, True))
                done += take
        else:
            if packed_pages + count > per_seg:
                flush()
            done = 0
            while count - done > per_seg:  # a long run (shm packs them too): full pieces
                out.append(Segment(((start + done, per_seg),), page + done, per_seg, False))
                done += per_seg
            if not packed:
                packed_first = page + done
            packed.append((start + done, count - done))
            packed_pages += count - done
        page += count
    flush()
    return out


@dataclass(frozen=True)
class Cut:
    """How a host batch is cut into segments, and the header tag that tells the receiver."""

    hdr_tag: int
    direct_min: int
    seg_bytes: int


def send_cut(channel: str, endpoint: str, caps: m.DataCaps) -> Cut:
    """The cut a sender on ``channel`` uses for host batches to ``endpoint``, given what
    the receiver offered: on shm every run packed (``direct``: runs of ``DIRECT_MIN`` land
    in the rows); over tcp 2 MiB segments where the receiver takes them, with runs up to a
    segment packed where it also takes iov receives; else the base cut."""
    if endpoint.startswith("ucx+shm://"):
        if caps.direct:
            return Cut(HDR_DIRECT_TAG, DIRECT_MIN, SEG_BYTES)
        return Cut(HDR_TAG, SHM_DIRECT_MIN, SEG_BYTES)
    if channel == "tcp" and caps.tcp_segment_bytes == TCP_SEG_BYTES:
        if caps.iov_recv:
            return Cut(HDR_TCP_PACK_TAG, TCP_PACK_DIRECT_MIN, TCP_SEG_BYTES)
        return Cut(HDR_TCP_SEG_TAG, DIRECT_MIN, TCP_SEG_BYTES)
    return Cut(HDR_TAG, DIRECT_MIN, SEG_BYTES)


def recv_cut(hdr_tag: int, channel_direct_min: int) -> tuple[int, int]:
    """(direct_min, seg_bytes) of a host batch whose header came under ``hdr_tag``, on a
    receiver whose channel cuts with ``channel_direct_min`` where the tag says nothing."""
    direct_min = {HDR_DIRECT_TAG: DIRECT_MIN, HDR_TCP_PACK_TAG: TCP_PACK_DIRECT_MIN}.get(
        hdr_tag, channel_direct_min
    )
    small = hdr_tag in (HDR_TCP_SEG_TAG, HDR_TCP_PACK_TAG)
    return direct_min, TCP_SEG_BYTES if small else SEG_BYTES


class RmaVersionError(ValueError):
    """An RMA header of a version this plane does not read (``version``: the digit
    after b"RMA", or None when even that is not one)."""

    def __init__(self, version: int | None) -> None:
        self.version = version
        super().__init__(
            f"RMA header version {version if version is not None else '?'} is not "
            f"supported (this plane reads version {RMA_VERSION})"
        )


@dataclass(frozen=True)
class RmaHeader:
    """A parsed RMA batch header: the batch's identity (authenticated and checked like any
    other batch) and where its pages go and come from: page ``i`` lands in slot
    ``slots[i]`` and lies at the producer in row ``rows[i]`` of a slab of ``nrows`` rows
    of ``stride`` bytes at ``base`` (``width`` bytes of each readable), each page the
    column spans ``cols``; ``rkey`` packed by the producer; ``endpoint`` where to reach it
    (reads and the acknowledgement)."""

    transfer_id: int
    lease_id: int
    token: bytes
    group: int
    page_bytes: int
    batch: int
    base: int
    nrows: int
    stride: int
    width: int
    rkey: bytes
    endpoint: str
    cols: tuple[tuple[int, int], ...]
    slots: np.ndarray
    rows: np.ndarray

    def identity(self) -> m.PageBatch:
        """The batch as a PageBatch for the book's authentication (its slots travel in
        ``slots``, not as runs: left empty here)."""
        return m.PageBatch(
            transfer_id=self.transfer_id,
            lease_id=self.lease_id,
            token=self.token,
            group=self.group,
            runs=[],
            page_bytes=self.page_bytes,
        )


def rma_frame(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    page_bytes: int,
    batch: int,
    base: int,
    nrows: int,
    stride: int,
    width: int,
    rkey: bytes,
    endpoint: str,
    cols: tuple[tuple[int, int], ...],
    slots: np.ndarray,
    rows: np.ndarray,
) -> np.ndarray:
    """The length-prefixed header of one RMA batch (``RmaHeader``)."""
    ep = endpoint.encode()
    if len(slots) != len(rows):
        raise ValueError(f"{len(slots)} slots for {len(rows)} source rows")
    fixed = RMA_FIXED.pack(
        RMA_MAGIC, transfer_id, lease_id, group, page_bytes, batch, len(slots), base,
        nrows, stride, width, len(token), len(rkey), len(ep), len(cols),
    )  # fmt: skip
    body = b"".join(
        (
            fixed,
            token,
            rkey,
            ep,
            np.asarray(cols, dtype="<u8").tobytes(),
            np.ascontiguousarray(slots, dtype="<i8").tobytes(),
            np.ascontiguousarray(rows, dtype="<i8").tobytes(),
        )
    )
    return np.frombuffer(struct.pack("<I", len(body)) + body, dtype=np.uint8)


def rma_parse(body: bytes) -> RmaHeader:
    """Parse an RMA header body (after the length prefix): ``RmaVersionError`` for another
    version's, ValueError when malformed. The slots and rows are views of ``body``."""
    if len(body) < 4 or body[:3] != b"RMA":
        raise ValueError("not an RMA header")
    if body[:4] != RMA_MAGIC:
        v = body[3:4]
        raise RmaVersionError(int(v) if v.isdigit() else None)
    if len(body) < RMA_FIXED.size:
        raise ValueError("short RMA header")
    (_, tid, lease, group, pb, batch, n, base, nrows, stride, width, tlen, klen, elen, ncols) = (
        RMA_FIXED.unpack_from(body)
    )
    at = RMA_FIXED.size
    if len(body) != at + tlen + klen + elen + 16 * ncols + 16 * n:
        raise ValueError("RMA header lengths disagree")
    token = body[at : at + tlen]
    at += tlen
    rkey = body[at : at + klen]
    at += klen
    endpoint = body[at : at + elen].decode()
    at += elen
    colv = np.frombuffer(body, dtype="<u8", count=2 * ncols, offset=at).reshape(-1, 2)
    at += 16 * ncols
    slots = np.frombuffer(body, dtype="<i8", count=n, offset=at).astype(np.int64, copy=False)
    rows = np.frombuffer(body, dtype="<i8", count=n, offset=at + 8 * n).astype(np.int64, copy=False)
    cols = tuple((int(o), int(c)) for o, c in colv.tolist())
    return RmaHeader(
        tid, lease, token, group, pb, batch, base, nrows, stride, width, rkey, endpoint,
        cols, slots, rows,
    )  # fmt: skip
