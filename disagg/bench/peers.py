"""Peers moving the same pages process to process with their own APIs: NIXL (UCX
backend, one-sided WRITE of every page from its source row into its destination slot, completion by
notification) and the Mooncake transfer engine (TCP, batch write). Optional: they are
imported here only, and a failure becomes the row's error string. Their pushes are paired
with the row's ceiling like the planes' (the consumer times one ceiling run before each
push; Mooncake's raw TCP stream is served by ``transfer._producer`` before it gets here)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

MOONCAKE_BATCH = 1024  # requests per batch_transfer_sync_write (see _mooncake_producer)


def producer(name: str, store: np.ndarray, conn: Any) -> None:
    if name == "nixl":
        _nixl_producer(store, conn)
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
    if name == "nixl":
        return _nixl_consumer(pool, n, repeats, conn, rng, ready, ceiling)
    return _mooncake_consumer(pool, n, repeats, conn, rng, ceiling)


def _nixl_api() -> Any:
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
    return nixl_agent, nixl_agent_config


def _nixl_producer(store: np.ndarray, conn: Any) -> None:
    nixl_agent, cfg = _nixl_api()
    agent = nixl_agent("bench-producer", cfg(backends=["UCX"]))
    agent.register_memory([(store.ctypes.data, store.nbytes, 0, "")], "DRAM")
    conn.send(("ready", agent.get_agent_metadata()))
    pb = store.shape[1]
    src = np.empty((store.shape[0], 3), dtype=np.int64)
    src[:, 0] = store.ctypes.data + np.arange(store.shape[0]) * pb
    src[:, 1], src[:, 2] = pb, 0
    remote_name = None
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, meta, base, tid, rows, dst = msg
        if remote_name is None:
            remote_name = agent.add_remote_agent(meta)
        local = agent.get_xfer_descs(src[rows], "DRAM")
        d = np.empty((len(dst), 3), dtype=np.int64)
        d[:, 0] = base + np.asarray(dst, dtype=np.int64) * pb
        d[:, 1], d[:, 2] = pb, 0
        remote = agent.get_xfer_descs(d, "DRAM")
        h = agent.initialize_xfer("WRITE", local, remote, remote_name, str(tid).encode())
        state = agent.transfer(h)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(h)
        agent.release_xfer_handle(h)
        conn.send(("pushed", None if state == "DONE" else "nixl transfer error"))


def _nixl_consumer(
    pool: np.ndarray,
    n: int,
    repeats: int,
    conn: Any,
    rng: Any,
    ready: Any,
    ceiling: Callable[[], float],
) -> Times:
    nixl_agent, cfg = _nixl_api()
    agent = nixl_agent("bench-consumer", cfg(backends=["UCX"]))
    agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    meta = agent.get_agent_metadata()
    agent.add_remote_agent(ready[1])
    times, ctimes = [], []
    from .transfer import draw

    for rep in range(repeats + 1):
        rows, dst = draw(rng, pool.shape[0], n)
        tid = str(rep + 1).encode()
        c = ceiling()
        t = time.perf_counter()
        conn.send(("push", meta, pool.ctypes.data, rep + 1, rows, dst))
        got = False
        while not got:
            for msgs in agent.get_new_notifs().values():
                got = got or tid in msgs
        dt = time.perf_counter() - t
        reply = conn.recv()
        if reply[1]:
            raise RuntimeError(reply[1])
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
    from .transfer import draw

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
