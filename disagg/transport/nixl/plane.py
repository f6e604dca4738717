"""``NixlDataPlane`` (``transport: nixl``): the consumer reads the pages it was promised
straight out of the producer's store with NIXL (``pip install -e ".[nixl]"``), over
whatever NIXL's backend finds between the two: with UCX, InfiniBand or RoCE (GPUDirect
RDMA for device memory), cuda_ipc or shared memory on one node, TCP otherwise.

Contract: both DataPlane sides (dataplane.py), with the receiver rules of the shared
``ReceiverBook``: every slot of a batch checked before any byte of it is read; only
expected transfers with matching lease and token; ``abort`` fails the transfer and waits
for its reads under way.

Flow of one push:

1. Handshake (control channel, authenticated): the producer's ``HelloOk`` carries its
   agent metadata (``source_caps``: connection information and its store's memory keys);
   the consumer loads it (``add_source``). The consumer's ``Hello`` and every ``Push``
   carry its connection information only (``capabilities``); its endpoint is
   ``nixl://AGENT``.
2. The producer's ``post_push`` sends ``ReadPlan`` notifications naming source rows and
   destination slots (push.py, wire.py); the consumer checks them and READs (reads.py).
3. The consumer answers ``ReadDone`` once nothing of the transfer is read any more; the
   push is final then (or at its deadline).

``abort_complete`` is False: NIXL cannot stop a read it has posted, so ``abort`` can only
wait for the chunks in flight, which a stalled producer may hold (reads.py). The memory
is registered once (agent.py); one thread per plane makes the NIXL calls of both sides,
polling every ``POLL_S`` while reads are in flight and for ``PLAN_FAST_S`` after an
``expect``, backing off to ``WAIT_S`` while transfers wait for plans or pushes for
answers, and sleeping otherwise;
NIXL's own progress thread moves the bytes. docs/design/nixl-plane.md has the
measurements behind each choice.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence

import torch

from ...protocol import messages as m
from ..dataplane import DataPlane, RegionSpec, RowsSource, TransferStatus
from ..receiver import BookedReceiver, ReceiverBook, build_groups
from . import agent as nx
from . import wire
from .push import ENDPOINT_PREFIX, PushHandle, Sender
from .reads import NixlRx, Reader

log = logging.getLogger(__name__)

POLL_S = 0.0002  # between polls of NIXL while reads are in flight
WAIT_S = 0.001  # ... while transfers wait for a plan or pushes for an answer (backing off
# from POLL_S: 13% of a core polled every POLL_S while a transfer waited, 3 s measured)
PLAN_FAST_S = 0.005  # after an expect, polled every POLL_S this long: its plan follows
# the Push within a few ms when the producer holds the pages, and a 1 ms nap costs half
# of it on average (docs/design/nixl-plane.md)
IDLE_S = 0.05  # ... while nothing is (woken at once by expect / post_push)
SWEEP_S = 0.01


class NixlDataPlane(BookedReceiver, DataPlane):
    """Both DataPlane sides over NIXL (module docstring). ``backend``: the NIXL backend
    (``UCX``); ``devices``: its devices (UCX: ``mlx5_0:1,...``, as UCX_NET_DEVICES);
    ``transports``: UCX's transport list for this plane only (tests pick ``tcp,self``);
    ``telemetry``: count the descriptors NIXL posts (``stats['nixl_descs']``);
    ``error_handling``: UCX's peer error handling (``peer`` or ``none``, ``open_agent``)."""

    accepts_store_rows = True  # producers hand StoreRows: read where they lie
    abort_complete = False  # a posted NIXL read cannot be stopped (module docstring)
    close_wait_s = 5.0

    def __init__(
        self,
        *,
        backend: str = "UCX",
        devices: str | None = None,
        transports: str | None = None,
        telemetry: bool = False,
        error_handling: str = "peer",
    ) -> None:
        self.stats: Counter[str] = Counter()
        host = socket.gethostname().split(".")[0][:32]
        self.name = f"disagg-{host}-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent = nx.open_agent(
            self.name, backend, devices, transports, telemetry, error_handling
        )
        api = nx.nixl_api()
        empty = api.nixlBind.nixlRegDList(api.nixlBind.DRAM_SEG)
        self._conn_meta = bytes(self._agent.get_partial_agent_metadata(empty, True))
        self._registry = nx.Registry(self._agent)
        self._book = ReceiverBook(self.stats, rx_factory=NixlRx)
        self._reader = Reader(self._agent, self._book, self.stats, self._notify, telemetry)
        self._sender = Sender(self._agent, self._registry, self.stats)
        self._source_meta = b""
        self._open: set[int] = set()  # expected transfers not seen final yet
        self._expected_at = 0.0  # the last expect
        self._cuda: int | None = None  # device to make current on this plane's thread
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._died: str | None = None
        self._thread = threading.Thread(target=self._run, name="disagg-nixl", daemon=True)
        self._thread.start()

    # ================================ handshake =========================================
    @property
    def endpoint(self) -> str:
        return ENDPOINT_PREFIX + self.name

    @property
    def capabilities(self) -> m.DataCaps:
        """What a consumer sends in Hello and Push: its agent's connection information
        (no memory keys: nothing of the consumer is exposed)."""
        return m.DataCaps(nixl=self._conn_meta)

    @property
    def source_caps(self) -> m.DataCaps:
        """What a producer sends in HelloOk: its agent's metadata with its store's keys."""
        if not self._source_meta:
            self._source_meta = bytes(self._agent.get_agent_metadata())
        return m.DataCaps(nixl=self._source_meta)

    def add_source(self, caps: m.DataCaps) -> None:
        """A producer's HelloOk: load its agent's metadata (once per metadata). ValueError
        when it carries none (a producer on another transport or an older disagg)."""
        meta = bytes(caps.nixl)
        if not meta:
            raise ValueError(
                "the producer's HelloOk carries no NIXL metadata: it runs another transport "
                "or an older disagg (set transport: nixl on both sides)"
            )
        with self._reader.sources_lock:
            if meta in self._reader.sources.values():
                return
            name = self._agent.add_remote_agent(meta)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name in self._reader.sources:  # the same agent, new memory: prepared again
                self._reader.forget_source(name)
            self._reader.sources[name] = meta
            self.stats["nixl_sources"] += 1

    # ================================ receiver ==========================================
    def register_regions(
        self, group_regions: Sequence[Sequence[RegionSpec | torch.Tensor]]
    ) -> None:
        specs = [
            [r if isinstance(r, RegionSpec) else RegionSpec(r) for r in g] for g in group_regions
        ]
        groups = build_groups(specs)
        tensors = [r.tensor for g in specs for r in g]
        for g in specs:
            if len({nx.mem_of(r.tensor) for r in g}) > 1:
                raise ValueError("a layer group's regions must live on one device")
        self._registry.cover(tensors)
        self._note_cuda(tensors)
        with self._book.lock:
            self._book.groups = groups
            self._reader.forget_lists()

    def expect(
        self,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        total_pages_by_group: Sequence[int],
        deadline_s: float,
        slots_by_group: Sequence[Sequence[int]] | None = None,
    ) -> None:
        super().expect(
            transfer_id, lease_id, token, total_pages_by_group, deadline_s, slots_by_group
        )
        self._open.add(transfer_id)
        self._expected_at = time.monotonic()
        self._wake.set()

    # ================================= sender ===========================================
    def register_source(self, tensor: torch.Tensor) -> torch.Tensor:
        """Producer: register the store slab with NIXL (once, at start-up); its keys go
        to consumers in ``source_caps``. Returns the same tensor."""
        self._sender.register(tensor)
        self._note_cuda([tensor])
        self._source_meta = b""
        return tensor

    def post_push(
        self,
        endpoint: str,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        pages: Sequence[RowsSource],
        deadline_s: float = 30.0,
        caps: m.DataCaps | None = None,
    ) -> PushHandle:
        """Send read plans to the consumer at ``endpoint`` from this thread (push.py);
        returns once they are sent, the push's answer left to the plane's thread. ``caps``
        must carry the consumer's NIXL metadata (its ``capabilities``)."""
        handle = self._sender.plan(endpoint, transfer_id, lease_id, token, pages, deadline_s, caps)
        if self._stop.is_set():  # the thread has failed or will fail what is queued
            self._wake.set()
            return handle
        self._sender.send()  # here: a wake-up of the plane's thread costs ~0.25 ms
        self._wake.set()  # it waits for the answer
        return handle

    def poll_push(self, handle: PushHandle) -> TransferStatus:
        return handle.status()

    def post_failure(self, endpoint: str, transfer_id: int, token: bytes, why: str) -> None:
        """The producer gave up on a push: its consumer fails the transfer at once."""
        self._sender.report(endpoint, transfer_id, token, why)
        self._wake.set()

    # ================================= common ===========================================
    def health(self) -> tuple[bool, str]:
        if self._died is not None:
            return False, self._died
        if self._stop.is_set():
            return False, "data plane closed"
        return True, ""

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(self.close_wait_s + 5.0)

    def _note_cuda(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type == "cuda" and self._cuda is None:
                self._cuda = int(t.device.index or 0)

    def _notify(self, agent_name: str, data: bytes) -> None:
        try:
            self._agent.send_notif(agent_name, data)
        except Exception as exc:
            self.stats["nixl_notify_failed"] += 1
            log.debug("notifying %s failed: %s", agent_name, exc)

    # ================================= thread ===========================================
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:
            self._died = f"nixl data plane thread died: {type(exc).__name__}: {exc}"
            log.exception("nixl data plane thread died")
        finally:
            self._teardown()

    def _loop(self) -> None:
        reader, sender, book = self._reader, self._sender, self._book
        cuda_set = None
        last_sweep = 0.0
        nap = POLL_S
        while not self._stop.is_set():
            if self._cuda is not None and cuda_set != self._cuda:
                torch.cuda.set_device(self._cuda)  # UCX's cuda transports want it current
                cuda_set = self._cuda
            moved = sender.send(block=False)
            for who, msgs in self._agent.get_new_notifs().items():
                who = who.decode() if isinstance(who, bytes) else str(who)
                for raw in msgs:
                    moved = True
                    self._on_notice(who, bytes(raw))
            moved = reader.pump() or moved
            now = time.monotonic()
            if now - last_sweep > SWEEP_S:
                last_sweep = now
                with book.cond:
                    book.sweep(now)
                    self._open = {
                        t for t in self._open if t in book.rx and not book.rx[t].state.final
                    }
                    book.cond.notify_all()
                sender.sweep(now)
            if moved:
                nap = POLL_S
                continue
            if reader.posted or (self._open and now - self._expected_at < PLAN_FAST_S):
                nap = POLL_S
            elif self._open or reader.busy or sender.busy:
                nap = min(nap * 2, WAIT_S)
            else:
                nap = IDLE_S
            if self._wake.wait(nap):
                nap = POLL_S
            self._wake.clear()

    def _on_notice(self, who: str, raw: bytes) -> None:
        msg = wire.decode(raw)
        if isinstance(msg, wire.ReadPlan):
            self._reader.on_plan(who, msg)
        elif isinstance(msg, wire.ReadDone):
            self._sender.on_done(who, msg)
        elif isinstance(msg, wire.PushFailed):
            self._reader.on_failed(who, msg)
        elif isinstance(msg, wire.Probe):
            pass
        else:
            self.stats["rejected_BAD_FRAME"] += 1

    def _teardown(self) -> None:
        with self._book.cond:
            self._book.fail_all("data plane closed")
        self._sender.fail_all("data plane closed")
        left = self._reader.close(self.close_wait_s)
        with self._book.cond:
            for rx in self._book.rx.values():
                rx.inflight = 0 if not left else rx.inflight
            self._book.cond.notify_all()
        if left:  # deregistering memory a read still targets would be unsafe: kept
            log.warning("nixl plane closed with %d reads in flight: memory stays registered", left)
            return
        self._reader.pump()  # the producers hear that the transfers ended
        self._reader.release_lists()
        self._registry.release()
