"""TP > 1: the consumer ranks' side channel for load outcomes, so that every rank reaches
the same decision about a request's load before any rank computes on it.

Why: each TP rank loads its own KV-head shard, so a load can fail on one rank only (its
producer rank died, a deadline). If only that rank then raised in ``wait_for_layer_load``,
it alone would fail the batch (``_handle_errors`` is per rank) while the others ran the
layer and waited forever in its all-reduce: a hang. So every rank decides from the same
facts: each rank's outcome of each load, shared through this bus.

Facts. Per load (``uid``, chosen by the leader and carried in the metadata) and rank: a
state ``(progress, final)``: ``progress`` counts the leading layers whose pages landed on
that rank (layer-wise loads; the last layer counts only with ``final``), ``final`` is None
while the load runs, ``""`` when it landed whole, or the error. A state only grows
(``progress`` up, ``final`` set once, with the progress it failed at), so merging states in
any order gives the same result, and a decision read from them is the same on every rank:

    need = layers that must have landed (a layer-wise wait before layer i: i + 1, the
           last layer and async loads: all, i.e. ``final == ""``)
    rank r ok      if final == "" or progress >= need      (a fact that never changes)
    rank r failed  if final is an error and progress < need (likewise)
    decision       "fail" if any rank failed, "ok" if every rank is ok, else not yet

Wiring. Rank 0's service binds a ROUTER (the hub) on the host of ``consumer.data`` (any free
port; ``advertise_host`` when set), and the leader's metadata carries its address and a
random secret to the other ranks every pass (no new config). Every rank > 0 connects a
DEALER, says hello, gets the hub's whole table (so a rank that connects late misses
nothing), then sends its own states and receives everyone else's, forwarded by the hub in
arrival order. A message without the secret is dropped (a stray peer can neither fail
requests nor fake a rank's outcome; the bus carries no bytes of KV).

One thread per rank owns the sockets. Each pass it also runs the service's ``tick``, which
polls the rank's in-flight loads on the data plane and records their states: outcomes are
published from where the service learns them, never from an engine hook, so a rank waiting
in its hook for the others does not depend on their hooks being called (the one-process
simulation calls the ranks' hooks one after another on one thread).

No wait is unbounded: a rank waits for a peer's state at most until its own load's deadline
(``load_timeout_s`` from dispatch) plus ``PEER_GRACE_S``; a peer that has not reported by
then counts as failed on this rank, logged naming the rank.

Its cost, measured across real rank processes: docs/design/consumer.md ("The TP rank bus").
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

log = logging.getLogger("disagg.consumer")

# A peer's state may arrive this long after our own load's deadline (its deadline started
# at its own dispatch, slightly later than ours, and the state still has to travel).
PEER_GRACE_S = 2.0
# A rank's table keeps a load's states this long after the last news of it (then the
# load is long over on every rank: every wait on it is bounded by its deadline).
FORGET_AFTER_S = 120.0

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


@dataclass
class RankState:
    """One rank's state of one load (see the module docstring)."""

    progress: int = 0
    final: str | None = None

    def merge(self, progress: int, final: str | None) -> bool:
        changed = False
        if self.final is None:
            if progress > self.progress:
                self.progress, changed = progress, True
            if final is not None:
                self.final, changed = final, True
        return changed


def decide(states: dict[int, RankState], size: int, need: int | None) -> tuple[str, int] | None:
    """The decision for ``need`` landed layers (None: the whole load) over ranks
    ``0..size-1``: ``("", -1)`` every rank ok, ``(error, rank)`` the first failed rank, None
    while some rank's state cannot tell yet."""
    pending = False
    for r in range(size):
        st = states.get(r)
        if st is None:
            pending = True
            continue
        if st.final == "" or (need is not None and st.progress >= need):
            continue
        if st.final is not None:
            return st.final, r
        pending = True
    return None if pending else ("", -1)


class RankBus:
    """One rank's end of the bus. Rank 0 binds the hub (``address``, ``secret``); ranks > 0
    ``connect`` once they know them (from the metadata). ``record`` our own states,
    ``states`` / ``wait`` read everyone's. ``tick()`` (the service's) runs on the bus thread
    every pass and returns True while loads are in flight (the thread then polls often)."""

    def __init__(
        self,
        rank: int,
        size: int,
        tick: Callable[[], bool],
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
    ):
        self.rank, self.size, self._tick = rank, size, tick
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._table: dict[int, dict[int, RankState]] = {}
        self._touched: dict[int, float] = {}
        self.cond = threading.Condition()
        self._outbox: list[tuple[int, int, int, str | None]] = []  # (uid, rank, prog, final)
        self._peers: dict[bytes, int] = {}  # hub: DEALER identity -> rank
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.address: str | None = None
        self.secret = b""
        self._sock: Any = None
        self._hello_sent = False
        if rank == 0:
            self.secret = secrets.token_bytes(16)
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # a dropped state would cost a request
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.bind(f"tcp://{bind_host}:0")
            port = sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
            host = advertise_host or ("127.0.0.1" if bind_host in ("0.0.0.0", "*") else bind_host)
            self.address = f"tcp://{host}:{port}"
            self._sock = sock
        self._thread = threading.Thread(
            target=self._run, name=f"disagg-rankbus-{rank}", daemon=True
        )
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------
    def connect(self, address: str, secret: bytes) -> None:
        """Ranks > 0: the hub's address and secret (from the leader's metadata); the bus
        thread connects. Later calls with the same values do nothing."""
        if self.rank == 0 or self.address is not None:
            return
        with self.cond:
            self.address, self.secret = address, bytes(secret)
        self.wake()

    def record(self, uid: int, progress: int, final: str | None) -> None:
        """Our own rank's state of load ``uid`` (merged; sent to the others if it grew)."""
        with self.cond:
            st = self._table.setdefault(uid, {}).setdefault(self.rank, RankState())
            self._touched[uid] = time.monotonic()
            if not st.merge(progress, final):
                return
            self._outbox.append((uid, self.rank, st.progress, st.final))
            self.cond.notify_all()
        self.wake()

    def decision(self, uid: int, need: int | None) -> tuple[str, int] | None:
        with self.cond:
            return decide(self._table.get(uid, {}), self.size, need)

    def wait(self, uid: int, need: int | None, deadline: float) -> tuple[str, int] | None:
        """``decision``, waiting for it until ``deadline`` (monotonic); None if it is
        still open then (see ``missing``)."""
        # The bus thread's tick is what polls our own loads; a load dispatched while the
        # thread sat in its idle poll (50 ms) would not be polled until that ended: wake
        # it now, so the wait costs the transfer and the peers' news, not the idle poll.
        self.wake()
        with self.cond:
            while True:
                got = decide(self._table.get(uid, {}), self.size, need)
                left = deadline - time.monotonic()
                if got is not None or left <= 0:
                    return got
                self.cond.wait(min(left, 0.5))

    def missing(self, uid: int, need: int | None) -> list[int]:
        """Ranks whose state of ``uid`` cannot tell the decision yet."""
        with self.cond:
            states = self._table.get(uid, {})
            return [
                r
                for r in range(self.size)
                if r not in states or decide({0: states[r]}, 1, need) is None
            ]

    def forget(self, uid: int) -> None:
        with self.cond:
            self._table.pop(uid, None)
            self._touched.pop(uid, None)

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake (the pipe is full) or closing

    def close(self) -> None:
        """Stop the thread and close the sockets (once: later calls do nothing)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.wake()
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():
            return  # a tick stuck past 2 s: leave the pipe to it rather than close under it
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the bus thread -----------------------------------------------------------------
    def _run(self) -> None:
        delay = 0.0
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._sock is not None:
            poller.register(self._sock, zmq.POLLIN)
        last_prune = time.monotonic()
        while not self._stop.is_set():
            try:
                if self._sock is None and self.address is not None:
                    self._sock = self._ctx.socket(zmq.DEALER)
                    self._sock.setsockopt(zmq.LINGER, 0)
                    self._sock.setsockopt(zmq.SNDHWM, 0)
                    self._sock.setsockopt(zmq.RCVHWM, 0)
                    self._sock.connect(self.address)
                    poller.register(self._sock, zmq.POLLIN)
                busy = self._tick()
                news = self._flush() + self._receive()
                if news:
                    delay = 0.0
                elif busy:  # loads in flight: poll the data plane again soon
                    delay = min(max(delay * 2, 0.0001), 0.001)
                else:
                    delay = 0.05
                if delay >= 0.001:
                    ready = dict(poller.poll(int(delay * 1000)))
                else:  # zmq polls whole milliseconds
                    ready = dict(poller.poll(0))
                    if not ready and delay:
                        time.sleep(delay)
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                if time.monotonic() - last_prune > 5.0:
                    last_prune = time.monotonic()
                    self._prune()
            except Exception:  # the bus must outlive one bad pass (waits are bounded)
                if self._stop.is_set():
                    break
                log.exception("rank %d: consumer rank bus pass failed", self.rank)
                time.sleep(0.01)
        if self._sock is not None:
            self._sock.close(0)

    def _flush(self) -> int:
        sock = self._sock
        if sock is None:
            return 0
        n = 0
        if self.rank != 0 and not self._hello_sent:
            sock.send(_enc.encode([self.secret, "h", self.rank]))
            self._hello_sent = True
        with self.cond:
            out, self._outbox = self._outbox, []
        for uid, rank, progress, final in out:
            msg = _enc.encode([self.secret, "s", uid, rank, progress, final])
            if self.rank == 0:
                self._fan_out(msg, skip=None)
            else:
                sock.send(msg)
            n += 1
        return n

    def _fan_out(self, msg: bytes, skip: int | None) -> None:
        for ident, r in self._peers.items():
            if r != skip:
                self._sock.send_multipart([ident, msg])

    def _receive(self) -> int:
        sock, n = self._sock, 0
        if sock is None:
            return 0
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1
            ident = frames[0] if self.rank == 0 else b""
            try:
                msg = _dec.decode(frames[-1])
                if not hmac.compare_digest(bytes(msg[0]), self.secret):
                    raise ValueError("wrong secret")
                kind = msg[1]
                if kind == "h" and self.rank == 0:
                    self._hello(ident, int(msg[2]))
                elif kind == "s":
                    uid, rank, progress, final = int(msg[2]), int(msg[3]), int(msg[4]), msg[5]
                    if not 0 <= rank < self.size or rank == self.rank:
                        raise ValueError(f"state of rank {rank}")
                    if final is not None and not isinstance(final, str):
                        raise ValueError("final is not a string")
                    self._merge(uid, rank, progress, final)
                    if self.rank == 0:
                        self._fan_out(frames[-1], skip=rank)
                else:
                    raise ValueError(f"unknown kind {kind!r}")
            except Exception as exc:
                log.warning("rank %d: dropped a bad rank-bus message: %s", self.rank, exc)

    def _hello(self, ident: bytes, rank: int) -> None:
        """Hub: a rank joined; send it the whole table (it may have missed states)."""
        if not 0 < rank < self.size:
            raise ValueError(f"hello from rank {rank} of {self.size}")
        self._peers[ident] = rank
        with self.cond:
            snap = [
                (uid, r, st.progress, st.final)
                for uid, states in self._table.items()
                for r, st in states.items()
                if r != rank
            ]
        for uid, r, progress, final in snap:
            self._sock.send_multipart(
                [ident, _enc.encode([self.secret, "s", uid, r, progress, final])]
            )

    def _merge(self, uid: int, rank: int, progress: int, final: str | None) -> None:
        with self.cond:
            st = self._table.setdefault(uid, {}).setdefault(rank, RankState())
            self._touched[uid] = time.monotonic()
            if st.merge(progress, final):
                self.cond.notify_all()

    def _prune(self) -> None:
        cut = time.monotonic() - FORGET_AFTER_S
        with self.cond:
            for uid in [u for u, t in self._touched.items() if t < cut]:
                self._table.pop(uid, None)
                self._touched.pop(uid, None)
