"""Hostile bytes on the ipc plane's framed control connection, from a sender that holds
valid tokens (so the index checks are reached): random frames and mutated pushes (index
widths, blob lengths, rows, slots, strides out of range) write only slots promised to
the sender's own transfers, never kill the receiver, and leave other transfers intact."""

from __future__ import annotations

import random
import socket
import struct

import msgspec
import numpy as np
import pytest
import torch

from disagg.protocol import ipc as wire
from disagg.transport import framed
from disagg.transport.dataplane import StoreRows
from disagg.transport.ipc import IpcDataPlane

pytestmark = pytest.mark.timeout(120)
FRAMES = 400


def _dial(endpoint: str) -> socket.socket:
    family, addr = framed.sockaddr(endpoint)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(addr)
    sock.sendall(framed.MAGIC)
    return sock


def _mutants(rng: random.Random, good: wire.IpcPush, tid: int) -> bytes:
    """One hostile frame: a valid push with fields bent, or raw garbage."""
    b = good.batches[0]
    r = rng.random()
    if r < 0.15:
        return rng.randbytes(rng.randint(0, 64))
    width = rng.choice([4, 8])
    n = rng.randint(1, 6)
    big = rng.choice([0, 7, 63, 64, 1 << 20, (1 << 31) - 1, -1, -(1 << 31)])
    rows = [rng.choice([0, 1, big]) for _ in range(n)]
    slots = [rng.choice([0, 5, big]) for _ in range(n + rng.choice([0, 0, 1, -1]))]
    dt = f"<i{width}"

    def blob(xs: list[int]) -> bytes:
        raw = np.asarray(xs, dtype=np.int64).astype(dt).tobytes()
        cut = rng.choice([0, 0, 0, 1, 3])  # a length that is no multiple of the width
        return raw[: len(raw) - cut] or raw

    batch = msgspec.structs.replace(
        b,
        rows=blob(rows),
        slots=blob(slots),
        index_bytes=width,
        row_stride=rng.choice([b.row_stride, 1, 1 << 40]),
        base=rng.choice([0, 0, 1 << 30]),
    )
    msg = msgspec.structs.replace(good, batches=[batch], transfer_id=tid)
    frame = wire.encode(msg)
    if r < 0.3:  # flip a byte: often an undecodable or out-of-range field
        i = rng.randrange(len(frame))
        frame = frame[:i] + bytes([rng.randrange(256)]) + frame[i + 1 :]
    return frame


def test_hostile_frames_write_nothing_and_the_plane_keeps_serving():
    rx, tx = IpcDataPlane(), IpcDataPlane()
    try:
        slab = tx.register_source(torch.randint(0, 256, (64, 96), dtype=torch.uint8))
        pool = torch.zeros((8, 96), dtype=torch.uint8)
        rx.register_regions([[pool]])
        rx.expect(1, 1, b"secret", [2], 60.0, [[5, 6]])  # the fuzzer never holds this token
        good = tx.post_push(
            "tcp://127.0.0.1:9", 1, 1, b"guess", [(0, StoreRows(slab, [0, 1], ((0, 96),)), [5, 6])]
        ).msg
        assert isinstance(good, wire.IpcPush)
        rng = random.Random(1234)
        sock = _dial(rx.endpoint)
        for i in range(FRAMES):
            # each mutant authenticates for a transfer of its own, promised slots 0-4
            rx.expect(100 + i, 1, b"guess", [5], 60.0, [[0, 1, 2, 3, 4]])
            frame = _mutants(rng, good, 100 + i)
            sock.sendall(struct.pack("<I", len(frame)) + frame)
        # an unknown transfer last: its answer means every frame before it was handled
        last = wire.encode(msgspec.structs.replace(good, transfer_id=99))
        sock.sendall(struct.pack("<I", len(last)) + last)
        buf = b""
        while True:
            chunk = sock.recv(1 << 16)
            assert chunk, "the receiver closed the connection"
            buf += chunk
            acks = []
            while len(buf) >= 4 and len(buf) >= 4 + (n := struct.unpack_from("<I", buf)[0]):
                acks.append(wire.decode(buf[4 : 4 + n]))
                buf = buf[4 + n :]
            if any(a.transfer_id == 99 for a in acks):
                break
        sock.close()
        stats = dict(rx.stats)
        assert stats.get("internal_error", 0) == 0, stats
        assert stats.get("rejected_batch", 0) > FRAMES // 4, stats  # the checks were reached
        assert not pool[5:].any(), "a hostile frame wrote outside its promised slots"
        assert rx.poll(1).state.value == "pending"  # the real transfer is unharmed
        pool.zero_()
        h = tx.post_push(
            rx.endpoint, 1, 1, b"secret", [(0, StoreRows(slab, [3, 9], ((0, 96),)), [5, 6])]
        )
        assert tx.wait_push(h, 10).done and rx.wait(1, 10).done
        assert torch.equal(pool[[5, 6]], slab[[3, 9]]) and not pool[[0, 1, 2, 3, 4, 7]].any()
        assert rx.health() == (True, "")
    finally:
        rx.close()
        tx.close()
