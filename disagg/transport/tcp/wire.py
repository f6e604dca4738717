"""The stream plane's wire: the hello, and messages of header plus payload.

One connection per (sender plane, receiver endpoint), opened by the sender:

- Hello: ``PREAMBLE`` (``b"DGSTRM\\0"`` and one version byte) and one payload mode byte:
  ``MODE_INLINE`` (payloads on the stream) or ``MODE_PIPE`` (AF_UNIX only: the read end
  of a pipe comes with the hello as SCM_RIGHTS ancillary data). The receiver answers
  ``PREAMBLE`` and the mode it takes (``MODE_PIPE`` only when offered a pipe it may
  use). Anything else is refused: a ZMTP greeting, another version or garbage counts
  ``rejected_BAD_VERSION``; an unknown mode, a pipe over TCP, no or several descriptors,
  one that is not a pipe's read end counts ``rejected_BAD_HELLO``. A refusal writes the
  bare ``PREAMBLE`` back (so the sender can name the version that refused it) and
  closes that connection only; descriptors that came along are closed.
- Messages: ``<u32 header length><u64 payload length>`` (``PREFIX``), the msgpack
  header (``PageBatch`` or ``TransferDone``), then the payload: a batch's pages in run
  order, exactly ``len(slots) * page_bytes`` bytes (any other length fails the
  transfer). With the length's top bit (``PIPED``) set the payload travels in the pipe
  instead of on the stream; a ``PIPED`` message on a connection without a pipe closes it
  (``rejected_framing``). Explicit lengths keep stream and pipe in step past a refused
  header: its payload is read and dropped and the connection serves on.
- ``TransferDone`` carries no payload; it is sent only once every payload byte left the
  sender (and the pipe was read empty), with the xxh3-64 of the payload when the
  plane's checksum is on.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from ...protocol.version import MAX_CONTROL_FRAME
from .. import framed

STREAM_MAGIC = b"DGSTRM\x00"
STREAM_VERSION = 2
PREAMBLE = STREAM_MAGIC + bytes([STREAM_VERSION])
MODE_INLINE = 0  # each payload follows its header on the stream
MODE_PIPE = 1  # payloads travel on a pipe whose read end comes with the hello (AF_UNIX)
HELLO = PREAMBLE + bytes([MODE_INLINE])  # what StreamPush (tests, tools) says
PREFIX = struct.Struct("<IQ")  # header length, payload length
PIPED = 1 << 63  # payload length flag: this payload travels in the pipe (MODE_PIPE only)
MAX_HEADER = MAX_CONTROL_FRAME  # a longer header is skipped unread and counted TOO_LARGE
HELLO_TIMEOUT_S = 10.0  # the hello, and the receiver's answer to it, must come by then


def frame(header: bytes, payload_len: int, piped: bool = False) -> bytes:
    """A message's length prefix and header (its payload follows on the stream)."""
    return PREFIX.pack(len(header), payload_len | (PIPED if piped else 0)) + header


class StreamPush:
    """A blocking client of the stream wire, for tests and tools that hand-make (or
    forge) messages: ``send_multipart([header, *payload])`` sends one message, its
    payload the concatenation of the rest."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0, preamble: bytes = HELLO):
        family, addr = framed.sockaddr(endpoint)
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(addr)
        if preamble:
            self.sock.sendall(preamble)

    def send_multipart(self, frames: Sequence[bytes]) -> None:
        head, payload = bytes(frames[0]), b"".join(bytes(f) for f in frames[1:])
        self.sock.sendall(frame(head, len(payload)) + payload)

    def send(self, data: bytes) -> None:
        self.send_multipart([data])

    def close(self) -> None:
        self.sock.close()


def answer_refused(got: bytes) -> str:
    """Why a receiver refused the hello, from what it answered."""
    if got[: len(STREAM_MAGIC)] == STREAM_MAGIC and len(got) >= len(PREAMBLE):
        v = got[len(STREAM_MAGIC)]
        if v != STREAM_VERSION:
            return (
                f"the receiver refused this stream: it speaks stream version {v}, this "
                f"sender {STREAM_VERSION} (upgrade both ends together)"
            )
        return "the receiver refused this stream's hello (its log says why)"
    return f"the receiver answered the hello with {got[:16]!r}, not a disagg data stream"


def bad_preamble(got: bytes) -> str:
    """Why a connection's first bytes are not this version's ``PREAMBLE``."""
    if got[: len(STREAM_MAGIC)] == STREAM_MAGIC:
        return f"stream protocol version {got[-1]}, this receiver speaks {STREAM_VERSION}"
    if got[:1] == b"\xff":
        return "the peer speaks ZMTP (a ZMQ socket): this endpoint takes the tcp data stream"
    return f"not a disagg data stream (preamble {got!r})"
