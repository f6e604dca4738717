"""Typed protocol errors. Every failure that crosses a socket carries one `ErrorCode`."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Wire error codes. Values are stable: append new members, never renumber."""

    BAD_FRAME = 1  # not decodable at all (truncated, not msgpack, wrong frame count)
    BAD_VERSION = 2  # `v` is not our PROTOCOL_VERSION
    UNKNOWN_KIND = 3  # `kind` names no message we know
    BAD_FIELD = 4  # a field is missing, of the wrong type, or out of range
    INCOMPATIBLE_PEER = 5  # fingerprints differ (model, dtype, geometry, TP)
    UNAUTHENTICATED = 6
    UNKNOWN_LEASE = 7
    FOREIGN_LEASE = 8  # the lease exists but belongs to another owner
    LEASE_EXPIRED = 9
    BAD_SLOT = 10  # a destination slot outside the registered regions
    OUT_OF_RANGE = 11
    WRONG_NAMESPACE = 12
    TOO_LARGE = 13
    NOT_READY = 14
    TIMEOUT = 15
    PEER_GONE = 16
    BUSY = 17
    INTERNAL = 18
    # the request names another incarnation of the peer (a process that has restarted):
    # refused before it touches anything, so a dead process's lease ids never act here
    STALE_INCARNATION = 19

    @classmethod
    def from_wire(cls, code: int) -> ErrorCode:
        """The member for `code`; INTERNAL for a code this version does not know."""
        try:
            return cls(code)
        except ValueError:
            return cls.INTERNAL


class ProtocolError(Exception):
    """An error with a typed `code` and a human `message`; str() is "CODE: message"."""

    def __init__(self, code: ErrorCode | int, message: str = "") -> None:
        self.code = ErrorCode.from_wire(int(code))
        self.message = message
        super().__init__(code, message)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}" if self.message else self.code.name

    def __repr__(self) -> str:
        return f"ProtocolError({self.code.name}, {self.message!r})"

    def __reduce__(self):  # picklable across processes with code and message intact
        return (type(self), (int(self.code), self.message))
