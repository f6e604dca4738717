"""The producer's side of the nixl plane: its store registered once, a push turned into
read plans for the consumer, and the consumer's answer turned into the push's state.

- ``register``: the store slab (host or CUDA; contiguous, 2-D uint8) is registered with
  NIXL once; its keys reach consumers in the producer's metadata (``HelloOk``). What
  that exposes: a consumer holding them may read the whole slab, read-only, while the
  producer runs (NIXL's trust model, and that of the ipc plane and UCX's one-sided path).
  Nothing of the consumer is exposed to the producer: its metadata carries connection
  information only, so no producer can write into a consumer.
- ``plan`` (the producer's push threads): checks the sources (``StoreRows`` of the
  registered slab, or a 2-D view of its rows), loads the consumer's connection metadata
  from the Push's ``DataCaps`` (its agent is named by the endpoint ``nixl://NAME``), and
  cuts the push into ``ReadPlan`` parts of at most ``wire.PART_PAGES`` pages. ValueError
  at once for anything malformed.
- ``plan``'s caller sends the parts itself (``send``: NIXL's agent is thread-safe in the
  plane's sync mode), so the plan leaves without waiting for the plane's thread to wake;
  that thread sends what a caller left queued (failure reports) and waits for the
  consumer's ``ReadDone``, checked against the push's token: DONE when it says every page
  landed, FAILED with its reason otherwise, or at the push's deadline when none came. A
  push is final only then, so the rows it names stay pinned while the consumer may read
  them.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from ...protocol import messages as m
from ..dataplane import RowsSource, StoreRows, TransferState, TransferStatus, check_store_rows
from . import agent as nx
from . import wire

ENDPOINT_PREFIX = "nixl://"


@dataclass(eq=False)
class PushHandle:
    """A push: the consumer agent it reads for, and its state (any thread reads it)."""

    agent: str
    transfer_id: int
    token: bytes
    deadline: float
    plans: list[wire.ReadPlan]
    pages: int
    nbytes: int
    state: TransferState = TransferState.PENDING
    error: str | None = None

    def status(self) -> TransferStatus:
        if not self.state.final and time.monotonic() > self.deadline:
            self.end(False, f"no answer from consumer agent {self.agent} by the push deadline")
        pages = self.pages if self.state is TransferState.DONE else 0
        return TransferStatus(self.state, self.error, pages, self.nbytes if pages else 0)

    def end(self, ok: bool, error: str | None = None) -> None:
        if not self.state.final:
            self.error = None if ok else error
            self.state = TransferState.DONE if ok else TransferState.FAILED


@dataclass(frozen=True)
class Source:
    tensor: torch.Tensor
    slab: wire.Slab


class Sender:
    """The producer's side (module docstring)."""

    def __init__(self, agent: Any, registry: nx.Registry, stats: Counter[str]) -> None:
        self.agent, self.registry, self.stats = agent, registry, stats
        self.sources: dict[int, Source] = {}  # slab data_ptr -> its description
        self.consumers: dict[str, bytes] = {}  # consumer agent -> the metadata loaded
        self.todo: deque[PushHandle | tuple[str, bytes]] = deque()
        self.waiting: dict[tuple[str, int], PushHandle] = {}
        self.lock = threading.Lock()  # todo, waiting and consumers change under it
        self._sending = threading.Lock()  # one sender at a time: a push's parts in order

    @property
    def busy(self) -> bool:
        return bool(self.todo or self.waiting)

    def register(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 2 or not tensor.is_contiguous():
            raise ValueError("register_source needs a contiguous 2-D uint8 tensor (a store slab)")
        mem, dev = nx.mem_of(tensor)
        self.registry.cover([tensor])
        rows, width = int(tensor.shape[0]), int(tensor.shape[1])
        slab = wire.Slab(int(tensor.data_ptr()), width, width, rows, mem, dev)  # type: ignore[arg-type]
        with self.lock:
            self.sources[int(tensor.data_ptr())] = Source(tensor, slab)

    # ------------------------------------------------------------- caller side
    def plan(
        self,
        endpoint: str,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        pages: Sequence[RowsSource],
        deadline_s: float,
        caps: m.DataCaps | None,
    ) -> PushHandle:
        if not endpoint.startswith(ENDPOINT_PREFIX) or len(endpoint) == len(ENDPOINT_PREFIX):
            raise ValueError(f"not a nixl data endpoint: {endpoint!r} (nixl://AGENT)")
        name = endpoint[len(ENDPOINT_PREFIX) :]
        meta = caps.nixl if caps is not None else b""
        if not meta:
            raise ValueError(
                f"the receiver at {endpoint} sent no NIXL metadata in its DataCaps: it runs "
                "another transport or an older disagg (set transport: nixl on both sides)"
            )
        self._consumer(name, meta)
        src: Source | None = None
        batches: list[wire.Batch] = []
        count = nbytes = 0
        for group, rows_src, dst in pages:
            s, rows, cols = self._rows(group, rows_src, dst)
            if src is not None and s is not src:
                raise ValueError("one push reads from one registered slab")
            src = s
            d = np.asarray(dst, dtype=np.int64).reshape(-1)
            if d.size and int(d.min()) < -1:
                raise ValueError(f"group {group}: destination slots below -1")
            keep = d >= 0
            rows, d = rows[keep], d[keep]
            page_bytes = sum(c for _, c in cols)
            for i in range(0, rows.size, wire.PART_PAGES):
                batches.append(
                    wire.Batch(
                        int(group), page_bytes, list(cols),
                        wire.int64_bytes(rows[i : i + wire.PART_PAGES]),
                        wire.int64_bytes(d[i : i + wire.PART_PAGES]),
                    )
                )  # fmt: skip
            count += int(rows.size)
            nbytes += int(rows.size) * page_bytes
        if src is None:
            src = next(iter(self.sources.values()), None)
            if src is None:
                raise ValueError("the nixl plane pushes rows of a slab given to register_source")
        plans = _parts(transfer_id, lease_id, bytes(token), src.slab, batches)
        handle = PushHandle(
            name, transfer_id, bytes(token), time.monotonic() + deadline_s, plans, count, nbytes
        )
        with self.lock:
            self.todo.append(handle)
        return handle

    def _consumer(self, name: str, meta: bytes) -> None:
        """Load the consumer agent's metadata (once per agent and metadata)."""
        with self.lock:
            if self.consumers.get(name) == meta:
                return
            if name in self.consumers:
                self.agent.remove_remote_agent(name)
                del self.consumers[name]
            got = self.agent.add_remote_agent(meta)
            if isinstance(got, bytes):
                got = got.decode()
            if got != name:
                self.agent.remove_remote_agent(got)
                raise ValueError(f"the receiver's NIXL metadata names agent {got!r}, not {name!r}")
            self.consumers[name] = meta

    def _rows(
        self, group: int, rows_src: Any, dst: Any
    ) -> tuple[Source, np.ndarray, tuple[tuple[int, int], ...]]:
        """(registered slab, int64 source rows, columns) of one group's source."""
        n = len(dst)
        if isinstance(rows_src, StoreRows):
            src = self.sources.get(int(rows_src.slab.data_ptr()))
            if src is None:
                raise ValueError(f"group {group}: its rows' slab was not given to register_source")
            rows, cols = check_store_rows(group, rows_src, n, src.slab.width)
            return src, rows, cols
        t = rows_src
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(f"group {group}: pages must be StoreRows or a 2-D uint8 tensor")
        if int(t.shape[0]) != n:
            raise ValueError(f"group {group}: {int(t.shape[0])} pages for {n} destination slots")
        for src in self.sources.values():
            s = src.slab
            off = int(t.data_ptr()) - s.base
            if (
                src.tensor.device == t.device
                and 0 <= off
                and (n <= 1 or int(t.stride(0)) == s.stride)
                and off // s.stride + n <= s.nrows
                and off % s.stride + int(t.shape[1]) <= s.width
            ):
                row0, col0 = divmod(off, s.stride)
                rows = np.arange(row0, row0 + n, dtype=np.int64)
                return src, rows, ((col0, int(t.shape[1])),)
        raise ValueError(
            f"group {group}: the nixl plane reads pages where they lie: pass rows of a slab "
            "given to register_source"
        )

    def report(self, endpoint: str, transfer_id: int, token: bytes, why: str) -> None:
        """The producer gave up on a push: tell its consumer (best effort)."""
        name = endpoint[len(ENDPOINT_PREFIX) :]
        msg = wire.PushFailed(transfer_id=transfer_id, token=bytes(token), error=why[:4000])
        with self.lock:
            if name in self.consumers:
                self.todo.append((name, wire.encode(msg)))

    # ------------------------------------------------------------- plane thread
    def send(self, block: bool = True) -> bool:
        """Send what is queued (``plan``'s caller, or the plane's thread with ``block``
        False: it leaves the queue to a caller sending it); True when anything was."""
        if not self._sending.acquire(blocking=block):
            return False
        try:
            return self._send()
        finally:
            self._sending.release()

    def _send(self) -> bool:
        moved = False
        while True:
            with self.lock:
                if not self.todo:
                    return moved
                job = self.todo.popleft()
                if isinstance(job, PushHandle):
                    self.waiting[(job.agent, job.transfer_id)] = job
            moved = True
            if isinstance(job, tuple):
                self._notify(*job)
                continue
            left_ms = int(max(0.0, job.deadline - time.monotonic()) * 1000)
            why = "the push deadline passed before it was sent" if left_ms == 0 else None
            for plan in job.plans if why is None else ():
                data = wire.encode(msgspec.structs.replace(plan, deadline_ms=left_ms))
                why = self._notify(job.agent, data)
                if why is not None:
                    break
                self.stats["nixl_plans"] += 1
            if why is not None:
                job.end(False, why)
                with self.lock:
                    self.waiting.pop((job.agent, job.transfer_id), None)

    def _notify(self, name: str, data: bytes) -> str | None:
        try:
            self.agent.send_notif(name, data)
        except Exception as exc:
            self.stats["nixl_notify_failed"] += 1
            return f"notifying consumer agent {name} failed: {type(exc).__name__}: {exc}"
        return None

    def on_done(self, sender: str, msg: wire.ReadDone) -> None:
        with self.lock:
            job = self.waiting.get((sender, msg.transfer_id))
            if job is None or not hmac.compare_digest(job.token, msg.token):
                self.stats["rejected_ack"] += 1
                return
            del self.waiting[(sender, msg.transfer_id)]
        job.end(msg.ok, None if msg.ok else f"consumer: {msg.error}")
        self.stats["pushes_done" if msg.ok else "pushes_failed"] += 1

    def sweep(self, now: float) -> None:
        with self.lock:
            for key, job in list(self.waiting.items()):
                if job.state.final or now > job.deadline:
                    job.status()  # ends it at its deadline
                    del self.waiting[key]

    def fail_all(self, why: str) -> None:
        with self.lock:
            jobs = [j for j in self.todo if isinstance(j, PushHandle)]
            jobs += self.waiting.values()
            self.todo.clear()
            self.waiting.clear()
        for job in jobs:
            job.end(False, why)


def _parts(
    tid: int, lease: int, token: bytes, slab: wire.Slab, batches: list[wire.Batch]
) -> list[wire.ReadPlan]:
    """The push as ReadPlans of at most ``wire.PART_PAGES`` pages each (at least one)."""
    parts: list[list[wire.Batch]] = [[]]
    n = 0
    for b in batches:
        pages = len(b.rows) // 8
        if parts[-1] and n + pages > wire.PART_PAGES:
            parts.append([])
            n = 0
        parts[-1].append(b)
        n += pages
    return [
        wire.ReadPlan(
            transfer_id=tid, lease_id=lease, token=token, part=i, last=i == len(parts) - 1,
            deadline_ms=0, slab=slab, batches=bs,
        )
        for i, bs in enumerate(parts)
    ]  # fmt: skip
