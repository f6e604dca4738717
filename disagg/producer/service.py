"""The producer's engine-neutral core: block store, leases, control server, pushes.

One service per producer instance, TP rank and process; the scheduler (rank 0 only) and
rank 0's worker share rank 0's (they are built concurrently, so ``service_for`` is locked).

Tensor parallelism (TP=N, see ``service_base``): each rank's service holds its own shard:
its own store (its KV heads of each block, under the block's key; head-blind: keys
namespaced by its ``tp_rank``), lease table and control server, bound at
``rank_endpoint(producer.control, rank)`` (port + rank). The rank-0 scheduler plans every
rank's saves (``SaveOp.keys_by_rank``); each rank's worker stores its shard and accounts
its own saves in flight. Consumers claim on every rank; a Push names the KV heads it wants
(``heads``: this rank's whole pages when empty) and the receiver's groups for them
(``group_base``), so a consumer rank of another TP size takes exactly its heads. Only rank 0 publishes store events (``producer.events``): the ranks' stores hold
the same blocks, and one endpoint cannot be bound twice. Threads (per rank):

- the control server answers peers (handshake, lookup, claim, renew, release, push:
  ``control.py``; requests naming another incarnation of this process are refused);
- a push pool builds each push's pages and posts them on the data plane; it never waits;
- one push watcher waits (bounded) for every push's leased blocks to be STORED (woken by
  the store's commits) and for every posted push to be final, then accounts for it,
  reports a failure and unpins its blocks. So neither the engine, nor the control thread,
  nor a push worker ever waits on a transfer: a dead or stalled consumer holds only its
  own pushes (until their deadline), never the workers that serve other consumers;
- a committer commits each saved pass once its copies completed (``commits.py``), so
  the engine thread only queues it between the last layer and the first token;
- a sweeper enforces every named timeout: LEASE_TTL, OWNER_DEAD_AFTER, SAVE_TIMEOUT. It
  judges by its own clock: after a gap in its own loop of ``max(1 s, 4 periods)`` (this
  process was stopped or starved) nobody is judged within STALL_GRACE (leases.py).

Every waiting state and the named timeout that ends it (config ``producer.*``):

    state                                   ends by                 timeout (config)
    lease granted, never renewed            expiry, blocks unpinned LEASE_TTL (lease_ttl_s,
                                                                    capped per lease)
    owner silent (no Hello/Renew/Claim)     all its leases freed    OWNER_DEAD_AFTER
                                                                    (owner_dead_after_s)
    claim whose pages are never pushed      lease expiry            LEASE_TTL
    push waiting for PLANNED/STAGING blocks TimeoutError, reported  push_timeout_s
    push the consumer never drains/acks     sender FAILED, unpinned push_timeout_s (+2 s
                                                                    grace before unpin)
    save planned, never committed           aborted, row freed      SAVE_TIMEOUT
                                                                    (save_timeout_s)

The sweeper runs every ``min(0.5, lease_ttl_s / 4)`` s. A push pins its own blocks until
its transfer is final (a lease freed mid-push never lets those rows be rewritten); its
``push_timeout_s`` runs from its Push's arrival.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..config import DisaggConfig, store_device_for
from ..engine.heads import store_columns
from ..metrics import list_services
from ..pages import PagePool
from ..protocol import messages as m
from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.version import PROTOCOL_VERSION
from ..service_base import ConnectorService, Registry, rank_endpoint
from ..transport.control import ControlServer
from ..transport.dataplane import DataPlane, TransferStatus, push_source
from ..transport.events import EventPublisher
from ..transport.factory import make_data_plane
from ..transport.security import server_keys_from
from .commits import Committer, PendingPass
from .control import ControlPlane
from .leases import LeaseTable
from .parked import ParkedClaims
from .saving import PassCopy, land, warm_pass_copy
from .store import BlockStore

log = logging.getLogger("disagg.producer")

_registry: Registry[ProducerService] = Registry()
list_services("producer", _registry.live)
# instance id -> its lowest rank's live service here (serve reads it); every rank's:
# ``_registry.by_rank`` ((instance id, rank) -> service) and ``_registry.live()``
_services = _registry.services


# A posted push the plane has not reported final this long after its deadline is failed
# and unpinned anyway (the sender fails its own push at the deadline; the grace lets that
# land, so the rows are unpinned only once nothing references them any more).
PUSH_GRACE_S = 2.0
# The push watcher polls the pushes in flight every 0.2 ms, backing off to 5 ms (reset
# whenever a push is posted); pushes that only wait for their blocks are woken by the
# store's commits and looked at every 50 ms besides (aborted blocks, deadlines).
_WATCH_MIN_S = 0.0002
_WATCH_MAX_S = 0.005
_WATCH_STORED_S = 0.05


def _stall_after(period: float) -> float:
    """A gap between two sweeps this long means the producer itself was stalled (its own
    loop missed several periods): owners get a fresh grace instead of being judged."""
    return max(1.0, 4 * period)


@dataclass(eq=False)
class _PushJob:
    """One accepted Push, from the control thread's PushOk until it is final and unpinned:
    in the push pool (``busy``), waiting for its blocks (watcher), or posted (``handle``,
    watcher). ``ended`` is set once, under the service's push lock, by whoever ends it."""

    lease: Any
    msg: Any
    deadline: float  # push_timeout_s from the Push's arrival
    entries: list[Any] = field(default_factory=list)
    busy: bool = False
    queued: bool = False  # handed back to the pool by the watcher
    handle: Any = None
    pages: int = 0
    ended: bool = False


def service_for(config: DisaggConfig, llm_args: Any) -> ProducerService:
    """The process's service for this instance id, created on first use."""
    return _registry.get(ProducerService, config, llm_args)


class ProducerService(ControlPlane, ConnectorService):
    role = "producer"
    shard_hint = "prefill instances"

    def __init__(self, config: DisaggConfig, llm_args: Any):
        super().__init__(config, llm_args)
        assert config.producer is not None  # validated: role producer has the section
        self.pcfg = config.producer
        # optional requests served, announced by name in HelloOk (tests of an older
        # producer empty it)
        self.features: tuple[str, ...] = m.FEATURES
        self.store: BlockStore = None  # type: ignore[assignment]  # set by attach()
        self.leases: LeaseTable = None  # type: ignore[assignment]
        self.parked: ParkedClaims = None  # type: ignore[assignment]  # set by attach()
        self._in_flight: Counter[int] = Counter()
        self._in_flight_lock = threading.Lock()
        self._committer: Committer = None  # type: ignore[assignment]  # set by attach()
        self._peers: dict[bytes, str] = {}  # control identity -> owner that said Hello
        # store columns of KV head ranges pushed (``_head_columns``), by range
        self._head_cols: dict[range, Any] = {}
        # With CURVE on: owner name -> the client key that first said Hello as it. A Hello
        # (or any request) from another key cannot act as that owner, so one consumer
        # cannot touch another's leases by claiming its name or reusing its identity.
        self._owner_keys: dict[str, bytes] = {}
        self._curve = server_keys_from(config.security)
        # This process's incarnation (HelloOk, ClaimOk, events): a request naming another
        # one was meant for a process that is gone and is refused before it touches state.
        self.incarnation = m.new_incarnation()
        # TP=1 owner -> the consumer incarnation that last said Hello as it: a Hello from a
        # new one means that consumer restarted, and the old process's leases are freed.
        self._owner_incarnations: dict[str, int] = {}
        self.server: ControlServer | None = None
        self.events: EventPublisher | None = None
        self.data: DataPlane | None = None
        # Push workers only build pages and post them (CPU work, never a wait): the waits,
        # for saves to land and for a peer to drain, are the push watcher's, so a dead
        # consumer cannot occupy the workers while healthy consumers wait behind it.
        self._pushes = ThreadPoolExecutor(16, thread_name_prefix="disagg-push")
        self._push_cv = threading.Condition()  # guards the push jobs' lists and flags
        self._push_jobs: set[_PushJob] = set()  # accepted, not yet ended
        self._push_waiting: list[_PushJob] = []  # for their blocks to be STORED
        self._push_posted: list[_PushJob] = []  # posted, not yet final
        self._push_kick = False  # something for the watcher to look at now
        self._push_fresh = False  # a push was posted: poll fast again
        self._push_closed = False
        self._watcher: threading.Thread | None = None  # started with the first push
        self._stop = threading.Event()

    # -- bring-up ---------------------------------------------------------------------
    def attach(self, pool: PagePool) -> None:
        """Called by the worker's registration: size the store and start serving."""
        store_device = store_device_for(self.pcfg.store_device, pool.device)  # or ConfigError
        self._attach_pool(pool)
        if self.pcfg.events and self.tp_rank == 0:
            self.events = EventPublisher(
                self.pcfg.events,
                producer=self.name,
                curve=self._curve,
                incarnation=self.incarnation,
            )
        self.store = BlockStore(
            pool.block_bytes,
            self.pcfg.store_size,
            device=store_device,
            save_timeout_s=self.pcfg.save_timeout_s,
            on_stored=self._published("stored"),
            on_removed=self._published("removed"),
        )
        self.leases = LeaseTable(
            self.store,
            max_ttl_s=self.pcfg.lease_ttl_s,
            owner_dead_after_s=self.pcfg.owner_dead_after_s or 15.0,
            max_hold_s=self.pcfg.lease_max_hold_s,
            # a random base per incarnation: even a peer that names no incarnation (an
            # older one) cannot hit a live lease with an id of the process before
            first_id=secrets.randbits(40) + 1,
            stall_after_s=_stall_after(self._sweep_period()),
        )
        self.parked = ParkedClaims(self.leases, self.metrics, self.incarnation)
        warm_pass_copy(pool, self.store.slab)
        self.data = make_data_plane(
            self.config.transport,
            checksum=self.config.transport_checksum,
            ucx_channel=self.config.ucx_channel,
            ucx_rma_readers=self.config.ucx_rma_readers,
            ipc_spin_us=self.config.ipc_spin_us,
            nixl_backend=self.config.nixl_backend,
            nixl_devices=self.config.nixl_devices,
            nixl_error_handling=self.config.nixl_error_handling,
        )
        register = getattr(self.data, "register_source", None)
        if register is not None:  # a plane that reads the store where it lies (ipc)
            self.store.slab = register(self.store.slab)
        control = rank_endpoint(self.pcfg.control, self.tp_rank)
        self.server = ControlServer(
            control,
            self._handle,
            curve=self._curve,
            name=f"producer {self.name} control",
            refusal_counts=self.metrics,  # refused_<reason>, exported per reason
        )
        self.parked.server = self.server
        self.server.every_poll = self.parked.expire
        self.server.start()
        self._committer = Committer(self._commit_pass, self._abort_pass)
        self._sweeper = threading.Thread(target=self._sweep_loop, name="disagg-sweep", daemon=True)
        self._sweeper.start()
        log.info(
            "producer %s rank %d/%d serving on %s: store %d blocks of %d B",
            self.name,
            self.tp_rank,
            self.tp_size,
            self.server.endpoint,
            self.store.capacity,
            pool.block_bytes,
        )

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return self.server.endpoint

    def _published(self, what: str):
        def publish(keys: list[bytes]) -> None:
            self.metrics[f"blocks_{what}"] += len(keys)
            if what == "stored" and self._watcher is not None:
                self._kick_pushes()  # pushes may be waiting for these blocks
            if self.events is not None:
                (self.events.publish_stored if what == "stored" else self.events.publish_removed)(
                    keys
                )

        return publish

    # -- save bookkeeping (engine thread) -----------------------------------------------
    def note_saving(self, request_id: int, n: int) -> None:
        with self._in_flight_lock:
            self._in_flight[request_id] += n

    def note_planned(self, saves: list[Any], kept: dict[int, int]) -> None:
        """Saves the store deduplicated or dropped are not in flight. Rank 0's scheduler
        counted every planned save already (``note_saving``); the other ranks have no
        scheduler, so their worker counts only what its store kept."""
        self.parked.held()  # claims waiting for these blocks are answered now
        if self.tp_rank != 0:
            with self._in_flight_lock:
                self._in_flight.update({rid: n for rid, n in kept.items() if n > 0})
            return
        planned: Counter[int] = Counter()
        for op in saves:
            planned[op.request_id] += len(op.keys)
        with self._in_flight_lock:
            for rid, n in planned.items():
                self._in_flight[rid] -= n - kept.get(rid, 0)
                if self._in_flight[rid] <= 0:
                    del self._in_flight[rid]

    def saves_in_flight(self, request_id: int) -> bool:
        with self._in_flight_lock:
            return self._in_flight.get(request_id, 0) > 0

    def finish_pass(
        self, keys: list[bytes], counts: dict[int, int], stream: Any, copy: PassCopy | None = None
    ) -> None:
        """End of a forward pass (engine thread): queue its commit for the committer thread
        (``commits.py``), after an event recorded on the copies' stream on CUDA."""
        event = None
        if self.pool is not None and self.pool.device.type == "cuda":
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        if not isinstance(stream, torch.cuda.Stream):
            stream = None
        self._committer.submit(PendingPass(keys, counts, event, stream, copy))

    def abandon_pass(self, keys: list[bytes], counts: dict[int, int]) -> None:
        """A pass whose forward failed: its blocks are dropped from the store (never
        served half written) and stop counting as in flight for their requests. Its
        copies, if any were queued on the engine's stream, end before any later pass's
        (same stream), so a row handed out again is rewritten after them."""
        self.metrics["passes_abandoned"] += 1
        self.store.abort(keys)
        self._settle(counts)

    def _commit_pass(self, p: PendingPass) -> None:
        """Committer thread: the pass's copies have completed."""
        ctx = torch.cuda.stream(p.stream) if p.stream is not None else contextlib.nullcontext()
        with ctx:  # the checksums are ordered before any later copy into these rows
            if p.copy is not None:
                land(p.copy, self.store.slab)
            self.store.commit(p.keys)
        self._settle(p.counts)
        self.metrics["passes_committed"] += 1
        self.metrics["commit_lag_seconds"] += time.perf_counter() - p.queued_at

    def _abort_pass(self, p: PendingPass) -> None:
        self.store.abort(p.keys)
        self._settle(p.counts)

    def _settle(self, counts: dict[int, int]) -> None:
        with self._in_flight_lock:
            for rid, n in counts.items():
                self._in_flight[rid] -= n
                if self._in_flight[rid] <= 0:
                    del self._in_flight[rid]

    def drain_commits(self, timeout_s: float = 10.0) -> bool:
        """Wait until every pass saved so far is committed (tests, benchmarks)."""
        return self._committer is None or self._committer.drain(timeout_s)

    def commit_lags_s(self) -> list[float]:
        """The last passes' lags from the end of their forward to their commit."""
        return [] if self._committer is None else list(self._committer.lags_s)

    def _push(self, owner: str, msg: Any) -> Any:
        lease = self.leases.get(owner, msg.lease_id)
        groups = len(self.pool.groups) if self.pool else 0
        end = msg.first_block + msg.num_blocks
        if end > len(lease.keys):
            raise ProtocolError(
                ErrorCode.OUT_OF_RANGE,
                f"push of blocks [{msg.first_block}, {end}) is larger than lease "
                f"{lease.lease_id}, which holds {len(lease.keys)} block(s)",
            )
        if len(msg.dst_slots) != groups or any(len(s) != msg.num_blocks for s in msg.dst_slots):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"dst_slots must be {groups} list(s) of {msg.num_blocks} slot(s), one per group",
            )
        if msg.heads:
            self._head_columns(range(*msg.heads))  # refused before anything is pinned
        # The push pins its own blocks: if the lease is freed mid-push (TTL, dead owner),
        # its rows must not be evicted and rewritten while the data plane still reads them.
        lease = self.leases.pin_for_push(owner, msg.lease_id, msg.first_block, msg.num_blocks)
        lease.pushes += 1
        job = _PushJob(
            lease,
            msg,
            time.monotonic() + self.pcfg.push_timeout_s,
            lease.entries[msg.first_block : end],
        )
        with self._push_cv:
            self._push_jobs.add(job)
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=self._watch_pushes, name="disagg-push-watch", daemon=True
                )
                self._watcher.start()
        try:
            self._pushes.submit(self._start_push, job, None)
        except RuntimeError:  # the pool is shut down (closing): nothing will read them
            with self._push_cv:
                forget = not job.ended
                job.ended = True
                self._push_jobs.discard(job)
            if forget:
                self._unpin_push(lease, msg)
            raise
        return m.PushOk(v=PROTOCOL_VERSION, transfer_id=msg.transfer_id)

    def _unpin_push(self, lease: Any, msg: Any) -> None:
        end = msg.first_block + msg.num_blocks
        self.store.unpin(lease.keys[msg.first_block : end], lease.entries[msg.first_block : end])

    def _start_push(self, job: _PushJob, rows: np.ndarray | None) -> None:
        """Push pool: post the push, its blocks being STORED (``rows``, or checked here
        without waiting); blocks still being saved go to the watcher, which waits for them
        and brings the push back here. Never waits on a save or a receiver."""
        assert self.pool is not None and self.data is not None
        msg = job.msg
        with self._push_cv:
            if job.ended or self._push_closed:
                return  # close() ends every push no worker holds
            job.busy, job.queued = True, False
        try:
            if rows is None:
                rows = self._stored_rows(job, time.monotonic())
                if rows is None:  # still being saved: the watcher waits for the blocks
                    with self._push_cv:
                        job.busy = False
                        if not self._push_closed:  # else close() has ended it (or will)
                            self._push_waiting.append(job)
                            self._push_kick = True
                            self._push_cv.notify_all()
                            return
                    raise RuntimeError("the producer closed")
            pages = self._layer_pages(rows, msg) if msg.layerwise else self._group_pages(rows, msg)
            job.pages = sum(len(p[2]) for p in pages)
            handle = self.data.post_push(
                msg.data_endpoint,
                msg.transfer_id,
                job.lease.lease_id,
                msg.token,
                pages,
                deadline_s=max(0.001, job.deadline - time.monotonic()),
                caps=msg.data_caps,
            )
        except Exception as exc:  # the consumer's transfer fails (deadline or report)
            with self._push_cv:
                job.busy = False
            self._end_push(job, exc)
            return
        with self._push_cv:  # the watcher waits for it to be final
            job.busy = False
            job.handle = handle
            self._push_posted.append(job)
            self._push_kick = self._push_fresh = True
            self._push_cv.notify_all()

    def _stored_rows(self, job: _PushJob, now: float) -> np.ndarray | None:
        """The push's store rows once every block is STORED, ``None`` while some are still
        being saved; raises TimeoutError past the push's deadline, KeyError if a block was
        aborted. Never waits."""
        try:
            return self.store.wait_stored(job.entries, 0.0)  # a deadline passed: no wait
        except TimeoutError:
            if now >= job.deadline:
                raise
            return None

    def _kick_pushes(self) -> None:
        with self._push_cv:
            self._push_kick = True
            self._push_cv.notify_all()

    def _watch_pushes(self) -> None:
        """The push watcher (one thread): every push waiting for its blocks, or posted and
        not yet final, is looked at here, so none holds a push worker while it waits."""
        delay = _WATCH_MIN_S
        while True:
            with self._push_cv:
                if self._push_closed and not self._push_jobs:
                    return
                if not self._push_kick:
                    if self._push_posted:
                        timeout = delay
                    elif self._push_waiting:
                        timeout = _WATCH_STORED_S
                    else:
                        timeout = 1.0
                    self._push_cv.wait(timeout)
                delay = _WATCH_MIN_S if self._push_fresh else min(delay * 2, _WATCH_MAX_S)
                self._push_kick = self._push_fresh = False
                waiting, self._push_waiting = self._push_waiting, []
                posted, self._push_posted = self._push_posted, []
            try:
                waiting, posted = self._watch_once(waiting, posted)
            except Exception:  # not expected (each push is handled on its own): keep them
                log.exception("push watcher failed")
                waiting = [j for j in waiting if not j.queued]  # the pool has the others
                time.sleep(_WATCH_STORED_S)
            with self._push_cv:
                self._push_waiting.extend(j for j in waiting if not j.ended)
                self._push_posted.extend(j for j in posted if not j.ended)

    def _watch_once(
        self, waiting: list[_PushJob], posted: list[_PushJob]
    ) -> tuple[list[_PushJob], list[_PushJob]]:
        """One look at every push the watcher holds; returns those still not final."""
        assert self.data is not None  # pushes were accepted: the plane exists
        now = time.monotonic()
        still_waiting: list[_PushJob] = []
        for job in waiting:
            if job.ended:  # close() ended it
                continue
            try:
                rows = self._stored_rows(job, now)
                if rows is None:
                    still_waiting.append(job)
                    continue
                job.queued = True  # STORED: back to the pool, to build and post its pages
                self._pushes.submit(self._start_push, job, rows)
            except Exception as exc:  # deadline, aborted blocks, or the pool shut down
                self._end_push(job, exc)
        still_posted: list[_PushJob] = []
        for job in posted:
            try:
                state: TransferStatus | None = self.data.poll_push(job.handle)
            except Exception:
                log.exception("polling push %d failed", job.msg.transfer_id)
                state = None
            if state is not None and state.final:
                self._end_push(job, state)
            elif now > job.deadline + PUSH_GRACE_S:  # not final yet: failed, unpinned
                why = state.error if state is not None else None
                self._end_push(job, RuntimeError(why or "push deadline passed"))
            else:
                still_posted.append(job)
        return still_waiting, still_posted

    def _end_push(self, job: _PushJob, result: TransferStatus | BaseException) -> None:
        """A push is over (``result``: the plane's final status, or why it failed before
        or while posting): account for it, report a failure to the consumer, and only then
        unpin its blocks. Once per push, whoever gets here first; never raises."""
        with self._push_cv:
            if job.ended:
                return
            job.ended = True
            self._push_jobs.discard(job)
            if self._push_closed and not self._push_jobs:
                self._push_cv.notify_all()  # the watcher may exit
        msg, lease = job.msg, job.lease
        try:
            if isinstance(result, TransferStatus) and result.done:
                self.metrics["pushes_done"] += 1
                self.metrics["pushes_layerwise"] += int(msg.layerwise)
                self.metrics["pages_pushed"] += job.pages
                self.metrics["bytes_pushed"] += result.nbytes
                return
            why = str(result) if isinstance(result, BaseException) else result.error
            why = why or "push deadline passed"
            self.metrics["pushes_failed"] += 1
            log.warning("push %d for lease %d failed: %s", msg.transfer_id, lease.lease_id, why)
            report = getattr(self.data, "post_failure", None)
            if report is not None:
                report(msg.data_endpoint, msg.transfer_id, msg.token, why)
        except Exception:
            log.exception("ending push %d failed", msg.transfer_id)
        finally:
            try:
                self._unpin_push(lease, msg)
            except Exception:
                log.exception("unpinning push %d failed", msg.transfer_id)

    def _close_pushes(self) -> None:
        """close(), after the data plane's: every push that is neither posted nor held by a
        worker ends now (failed, unpinned); a posted one ends when the closed plane reports
        it final (or at its grace), and so does one a worker is posting (or it fails)."""
        with self._push_cv:
            self._push_closed = True
            idle = [j for j in self._push_jobs if not j.busy and j.handle is None]
            self._push_kick = True
            self._push_cv.notify_all()
        for job in idle:
            self._end_push(job, RuntimeError("the producer closed"))

    def _head_columns(
        self, want: range
    ) -> tuple[list[tuple[tuple[int, int], ...]], dict[int, tuple[tuple[int, int], ...]]]:
        """Store columns of KV heads ``want`` (a Push's ``heads``): per group, per layer
        (``engine.heads.store_columns`` placed at each group's page offset). BAD_FIELD when
        this rank does not hold them all."""
        assert self.pool is not None
        cached = self._head_cols.get(want)
        if cached is not None:
            return cached
        held = self.heads.held if self.heads is not None else None
        if held is None or want.start < held.start or want.stop > held.stop:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"push of KV heads [{want.start}, {want.stop}): this producer rank holds "
                + ("no located heads" if held is None else f"[{held.start}, {held.stop})"),
            )
        assert self.heads is not None
        per_group, per_layer = store_columns(self.pool.layout, self.heads, want)
        offs = self.pool.page_offsets
        out = (
            [tuple((offs[g] + o, n) for o, n in cols) for g, cols in enumerate(per_group)],
            {
                layer: tuple((offs[self.pool.group_of_layer(layer)] + o, n) for o, n in cols)
                for layer, cols in per_layer.items()
            },
        )
        self._head_cols[want] = out
        return out

    def _group_pages(self, rows: np.ndarray, msg: Any) -> list[Any]:
        """Whole group pages (or their ``msg.heads`` slices), one entry per layer group
        (``-1`` destinations skipped: the consumer has no page there, outside its window),
        at the receiver's groups from ``msg.group_base``."""
        assert self.pool is not None
        slab = self.store.slab
        sliced = self._head_columns(range(*msg.heads))[0] if msg.heads else None
        pages = []
        for g, geo in enumerate(self.pool.groups):
            dst = np.asarray(msg.dst_slots[g], dtype=np.int64)
            keep = dst >= 0
            if keep.any():
                cols = sliced[g] if sliced else ((self.pool.page_offsets[g], geo.page_bytes),)
                src = push_source(self.data, slab, rows[keep], cols, dst[keep])
                pages.append((msg.group_base + g, *src))
        return pages

    def _layer_pages(self, rows: np.ndarray, msg: Any) -> list[Any]:
        """Layer by layer in the order the engine runs them, into the receiver's per-layer
        groups (``PagePool.data_plane_groups``, from ``msg.group_base``): layer i's bytes
        arrive before layer i+1's."""
        assert self.pool is not None
        slab = self.store.slab
        sliced = self._head_columns(range(*msg.heads))[1] if msg.heads else None
        pages, base = [], msg.group_base + len(self.pool.groups)
        for i, layer in enumerate(self.pool.layers):
            g = self.pool.group_of_layer(layer)
            dst = np.asarray(msg.dst_slots[g], dtype=np.int64)
            keep = dst >= 0
            if keep.any():
                cols = sliced[layer] if sliced else tuple(self.pool.layer_store_columns(layer))
                pages.append((base + i, *push_source(self.data, slab, rows[keep], cols, dst[keep])))
        return pages

    # -- timeouts -----------------------------------------------------------------------
    def _sweep_period(self) -> float:
        return min(0.5, self.pcfg.lease_ttl_s / 4)

    def _sweep_loop(self) -> None:
        period = self._sweep_period()
        while not self._stop.wait(period):
            try:
                stalls = self.leases.stats.stalls_forgiven
                self.metrics["leases_expired"] += self.leases.sweep()
                if self.leases.stats.stalls_forgiven != stalls:
                    self.metrics["sweeper_stalls"] += 1
                    log.warning(
                        "the lease sweeper was stalled past %.1f s: every owner gets a fresh "
                        "grace period before any is declared dead",
                        self.leases.stall_after_s,
                    )
                self.metrics["saves_timed_out"] += self.store.sweep_stale_saves()
            except Exception:  # the sweeper must outlive any one bad pass
                log.exception("sweep failed")

    def health(self) -> tuple[bool, str]:
        """``(healthy, why not)``: unhealthy when a part that guards memory or answers peers
        has stopped (then leases cannot expire, or pushes cannot be proven finished)."""
        if self.closed:
            return False, "the producer service is closed"
        if self.pool is None:
            return False, "no KV cache registered yet"
        if not self._committer.alive():
            return False, "the save committer stopped: saved blocks are not published"
        if not self._sweeper.is_alive():
            return False, "the lease/save sweeper stopped: timeouts are not enforced"
        if self._watcher is not None and not self._watcher.is_alive():
            return False, "the push watcher stopped: pushes are not ended nor unpinned"
        if self.server is not None and not self.server.alive():
            return False, "the control server stopped"
        return self.data.health() if self.data is not None else (False, "no data plane")

    def close(self) -> None:
        self._stop.set()
        self.closed = True
        if self._committer is not None:
            self._committer.close()
        if self.server is not None:
            self.server.close()
        if self.events is not None:
            self.events.close()
        if self.data is not None:
            self.data.close()
        self._pushes.shutdown(wait=False, cancel_futures=True)
        self._close_pushes()
        _registry.forget(self)
