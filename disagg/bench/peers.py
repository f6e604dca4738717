"""Peers moving the same pages process to process with their own APIs: raw NIXL (the
consumer READs every page from its source row into its destination slot through
descriptor lists prepared once, ``RawNixl``: the descriptors the nixl plane posts, with
none of the plane around them) and the Mooncake transfer engine (TCP, batch write).
Optional: they are imported here only, and a failure becomes the row's error string.
Their pushes are paired with the row's ceiling like the planes' (the consumer times one
ceiling run before each push; Mooncake's raw TCP stream is served by
``transfer._producer`` before it gets here). ``RawNixl`` is also the nixl plane rows'
paired ceiling (``transfer._ceiling_timer``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MOONCAKE_BATCH = 1024  # requests per batch_transfer_sync_write (see _mooncake_producer)


def draw(rng: Any, rows: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` distinct random source rows of ``rows`` and ``n`` distinct random destination
    slots of ``rows`` (int64 arrays)."""
    return rng.permutation(rows)[:n].astype(np.int64), rng.permutation(rows)[:n].astype(np.int64)


def producer(name: str, store: np.ndarray, conn: Any) -> None:
    if name == "nixl-raw":
        agent = nixl_source(store)
        conn.send(("ready", (agent.get_agent_metadata(), store.ctypes.data)))
        while conn.recv()[0] != "stop":  # the consumer reads by itself
            pass
    else:
        _mooncake_producer(store, conn)


Times = tuple[list[float], list[float]]


def consumer(
    name: str,
    pool: np.ndarray,
    n: int,
    repeats: int,
    conn: Any,
    rng: Any,
    ready: Any,
    ceiling: Callable[[], float],
) -> Times:
    """(push seconds, ceiling seconds) of ``repeats`` pushes after one warm-up, each push
    timed right after one run of ``ceiling`` (the row's paired ceiling, transfer.py).
    ``ready``: the producer's ("ready", info) message, already read from ``conn``."""
    if name == "nixl-raw":
        return _nixl_consumer(pool, n, repeats, conn, rng, ready, ceiling)
    return _mooncake_consumer(pool, n, repeats, conn, rng, ceiling)


def nixl_source(store: np.ndarray, transports: str | None = None) -> Any:
    """A NIXL agent (the nixl plane's configuration) with ``store`` registered: what a raw
    reader reads from. Keep it alive while it is read."""
    from ..transport.nixl import agent as nx

    agent = nx.open_agent(f"bench-raw-source-{os.getpid()}", transports=transports)
    agent.register_memory([(store.ctypes.data, store.nbytes, 0, "")], "DRAM")
    return agent


class RawNixl:
    """Reads pages of a remote store (``nixl_source``'s metadata and base address; rows
    of ``pool``'s row size; ``remote_mem`` ``VRAM`` for a device store on device 0) into
    ``pool`` (a host numpy array or a torch tensor, host or device) with NIXL alone: both
    descriptor lists prepared once, one ``make_prepped_xfer`` READ per call, polled to
    completion (the nixl plane's descriptors and agent configuration; ``error_handling``
    as the plane's ``nixl_error_handling``)."""

    def __init__(
        self,
        pool: Any,
        meta: bytes,
        base: int,
        rows: int,
        transports: str | None = None,
        remote_mem: str = "DRAM",
        error_handling: str = "peer",
    ) -> None:
        from ..transport.nixl import agent as nx

        self.agent = nx.open_agent(
            f"bench-raw-reader-{os.getpid()}",
            transports=transports,
            error_handling=error_handling,
        )
        if isinstance(pool, np.ndarray):
            ptr, mem, dev = pool.ctypes.data, "DRAM", 0
        else:
            ptr, (mem, dev) = int(pool.data_ptr()), nx.mem_of(pool)
        pb, slots = int(pool.shape[1]), int(pool.shape[0])
        self.agent.register_memory([(ptr, pb * slots, dev, "")], mem)
        name = self.agent.add_remote_agent(meta)
        local = np.array([[ptr, pb, dev, pb, slots]], dtype=np.uint64)
        remote = np.array([[base, pb, 0, pb, rows]], dtype=np.uint64)
        self.local = self.agent.prep_xfer_dlist("", local, mem)
        self.remote = self.agent.prep_xfer_dlist(name, remote, remote_mem)

    def read(self, rows: np.ndarray, slots: np.ndarray) -> float:
        """Seconds to read ``rows`` into ``slots``; RuntimeError when NIXL fails it."""
        t = time.perf_counter()
        x = self.agent.make_prepped_xfer(
            "READ", self.local, slots.astype(np.int32), self.remote, rows.astype(np.int32)
        )
        state = self.agent.transfer(x)
        while state == "PROC":
            state = self.agent.check_xfer_state(x)
        dt = time.perf_counter() - t
        x.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read ended {state}")
        return dt


def _nixl_consumer(
    pool: np.ndarray,
    n: int,
    repeats: int,
    conn: Any,
    rng: Any,
    ready: Any,
    ceiling: Callable[[], float],
) -> Times:
    meta, base = ready[1]
    raw = RawNixl(pool, meta, base, pool.shape[0])
    times, ctimes = [], []

    for rep in range(repeats + 1):
        rows, dst = draw(rng, pool.shape[0], n)
        c = ceiling()
        dt = raw.read(rows, dst)
        if not np.array_equal(pool[dst, :8].copy().view(np.int64).reshape(-1), rows):
            raise RuntimeError("nixl pages landed wrong")
        if rep:
            times.append(dt)
            ctimes.append(c)
    conn.send(("stop",))
    return times, ctimes


def _mooncake_engine() -> Any:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake TransferEngine.initialize returned {rc}")
    return te


def _mooncake_producer(store: np.ndarray, conn: Any) -> None:
    te = _mooncake_engine()
    if te.register_memory(store.ctypes.data, store.nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    conn.send(("ready", None))
    pb = store.shape[1]
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, target, base, _tid, rows, dst = msg
        srcs = (store.ctypes.data + np.asarray(rows, dtype=np.int64) * pb).tolist()
        dsts = (base + np.asarray(dst, dtype=np.int64) * pb).tolist()
        rc = 0
        # Its TCP transport queues a batch's requests on per-connection lanes of bounded
        # depth: 4096 at once are refused ("TCP lane queue-full", rc -1), so batches of
        # MOONCAKE_BATCH requests, one after the other.
        for i in range(0, len(dsts), MOONCAKE_BATCH):
            part = dsts[i : i + MOONCAKE_BATCH]
            rc = te.batch_transfer_sync_write(
                target, srcs[i : i + len(part)], part, [pb] * len(part)
            )
            if rc != 0:
                break
        conn.send(("pushed", None if rc == 0 else f"mooncake batch write returned {rc}"))


def _mooncake_consumer(
    pool: np.ndarray, n: int, repeats: int, conn: Any, rng: Any, ceiling: Callable[[], float]
) -> Times:
    te = _mooncake_engine()
    if te.register_memory(pool.ctypes.data, pool.nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    target = f"127.0.0.1:{te.get_rpc_port()}"
    times, ctimes = [], []

    for rep in range(repeats + 1):
        rows, dst = draw(rng, pool.shape[0], n)
        c = ceiling()
        t = time.perf_counter()
        conn.send(("push", target, pool.ctypes.data, rep + 1, rows, dst))
        reply = conn.recv()  # the write is synchronous on the producer
        dt = time.perf_counter() - t
        if reply[1]:
            raise RuntimeError(reply[1])
        if not np.array_equal(pool[dst, :8].copy().view(np.int64).reshape(-1), rows):
            raise RuntimeError("mooncake pages landed wrong")
        if rep:
            times.append(dt)
            ctimes.append(c)
    conn.send(("stop",))
    return times, ctimes
