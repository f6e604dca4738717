"""Connector bring-up and the manager-side bookkeeping of TensorRT-LLM's
``KvCacheConnectorManager`` (bring-up, ``get_finished``, parallelism), for ``tp`` simulated
ranks.

Every call into the connector goes through ``Driver`` so ``stats`` counts it: scheduler
calls once (rank 0 only), worker calls once per rank (counts are rank 0's).

Ranks in one process, faithfully (failure paths under parallelism). In TensorRT-LLM each TP rank is its
own MPI process: an exception in a forward hook (``wait_for_layer_load``, ``save_kv_layer``,
the forward-pass callable, ``wait_for_save``) is caught by *that rank's* ``_forward_step``
and ``_handle_errors`` fails *that rank's* batch; a rank whose hook did not raise goes on
into the layer's collectives (all-reduce) and waits there forever for the rank that left.
So ``each_worker`` calls every rank's hook and compares: all ranks raised (the batch fails
everywhere, with rank 0's message: rank 0 answers the client) or none did are both
consistent; some but not all is ``RankDivergenceError``, fatal, standing in for the hang
(unless a raising rank's error is fatal by TensorRT-LLM's classification anyway: that rank's
executor stops and the job with it, and that error is raised).

Ranks as processes (``comm``: a ``TpComm``, the MPI mode, ``disagg.engine.reference.mpi``):
this process is rank ``comm.rank`` and holds only its own worker (and, on rank 0, the
scheduler), as TensorRT-LLM's ranks do. The calls are the same; what changes is where the
ranks meet, as in ``KvCacheConnectorManager``: ``_run_on_leader`` calls
(``get_num_new_matched_tokens``, ``build_connector_meta``, ``request_finished``) run on rank
0 and their answer is broadcast (pickled: every rank, rank 0 too, binds an unpickled copy);
``update_state_after_alloc`` runs on rank 0 only, with no broadcast; ``get_finished``
all-gathers every rank's locally finished ids and takes the intersection. A forward hook
that raises fails this rank's batch only; nothing here compares ranks: a rank that left
while the others went on leaves them in the layer's collective (``model.TpGroup``), which
fails with ``RankHangError`` once it waited ``hang_timeout_s`` (TensorRT-LLM would hang).
A scheduler call that raises on rank 0 is broadcast as that error (every rank raises it:
the job dies, where TensorRT-LLM's rank 0 would die and the others hang in the broadcast).
"""

from __future__ import annotations

import importlib
import pickle
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from .. import KvCacheConnectorScheduler, KvCacheConnectorWorker
from .._contract import prefix_reservation_capability, reject_flat_only_scheduler
from ..runtime import RuntimeFeatures, set_rank
from ..runtime import current as current_features
from .config import ConnectorSpec, EngineConfig, LlmArgs
from .kv_cache import KvCacheManager

# TensorRT-LLM's error classification (error_classification.py): an error whose message
# holds one of these stops the executor instead of failing the batch.
IMMEDIATE_FATAL_PATTERNS = (
    "cudaerrorillegaladdress",
    "cudaerrorlaunchfailure",
    "illegal memory access",
    "device-side assert",
    "unrecoverable",
)


def is_fatal(exc: BaseException) -> bool:
    """Would TensorRT-LLM stop the executor on ``exc`` (rather than fail the batch)?"""
    msg = f"{type(exc).__name__}: {exc}".lower()
    return any(p in msg for p in IMMEDIATE_FATAL_PATTERNS)


class RankDivergenceError(RuntimeError):
    """TP ranks disagreed in one forward pass: some ranks' connector hooks raised (their
    batch fails) and others' did not (they run the layer). In a real multi-process TP
    engine the ranks that went on block forever in the layer's all-reduce: a hang. The
    reference engine raises this instead; it is fatal (the engine is dead afterwards).

    ``hook``: where (e.g. ``wait_for_layer_load(layer 0)``); ``raised``: rank -> its error;
    ``clean``: ranks that did not raise; ``request_ids``: the batch (set by the executor)."""

    def __init__(
        self,
        hook: str,
        raised: dict[int, BaseException],
        clean: list[int],
        request_ids: list[int] | None = None,
    ):
        self.hook, self.raised, self.clean = hook, raised, clean
        self.request_ids = list(request_ids or [])
        errs = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(raised.items()))
        reqs = f" for request(s) {self.request_ids}" if self.request_ids else ""
        super().__init__(
            f"TP ranks diverged in {hook}{reqs}: rank(s) {sorted(raised)} raised and fail "
            f"the batch, rank(s) {clean} did not and would wait forever in the layer's "
            f"collectives (a hang in a real multi-process engine) -- {errs}"
        )

    def with_requests(self, request_ids: list[int]) -> RankDivergenceError:
        return RankDivergenceError(self.hook, self.raised, self.clean, request_ids)


class RankHangError(RankDivergenceError):
    """A collective waited past its ``hang_timeout_s`` (MPI mode): the other ranks are not
    coming (one left a forward, raised where this one did not, or died). TensorRT-LLM
    would hang here; the engine raises this instead, fatal. ``where``: the collective
    (e.g. ``layer 0 attention heads``, ``get_finished``); ``waited_s``: how long."""

    def __init__(
        self, where: str, rank: int, waited_s: float, request_ids: list[int] | None = None
    ):
        self.where, self.rank, self.waited_s = where, rank, waited_s
        self.hook, self.raised, self.clean = where, {}, [rank]
        self.request_ids = list(request_ids or [])
        reqs = f" for request(s) {self.request_ids}" if self.request_ids else ""
        RuntimeError.__init__(
            self,
            f"TP rank {rank} waited {waited_s:.1f} s in the collective of {where}{reqs} and the "
            "other rank(s) never joined: the ranks diverged (a rank left the forward, raised "
            "where this one did not, or died) -- a hang in a real multi-process engine",
        )

    def with_requests(self, request_ids: list[int]) -> RankHangError:
        return RankHangError(self.where, self.rank, self.waited_s, request_ids)


class TpComm(Protocol):
    """This process's rank of the TP group (MPI mode). ``bcast``/``allgather`` are the
    executor's (pickled objects, root 0); ``allgather_heads`` is the layers' collective on
    a communicator of its own (``model.TpGroup``). Each raises ``RankHangError`` naming
    ``where`` after waiting too long."""

    rank: int
    size: int

    def bcast(self, obj: Any, where: str) -> Any: ...

    def allgather(self, obj: Any, where: str) -> list[Any]: ...

    def allgather_heads(self, t: torch.Tensor, where: str) -> torch.Tensor: ...


class CpuStream:
    """Stands in for ``torch.cuda.current_stream()`` on CPU (all work is synchronous)."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event

    def __repr__(self) -> str:
        return "CpuStream()"


def current_stream(device: str) -> Any:
    return torch.cuda.current_stream() if device.startswith("cuda") else CpuStream()


class Driver:
    """Owns the scheduler (rank 0) and one worker per rank held here: every rank in the
    one-process simulation (``comm`` None), this process's own with ``comm``."""

    builds_scheduler_output = False  # the engine builds it (TrtllmDriver: the manager)

    def __init__(
        self,
        cfg: EngineConfig,
        spec: ConnectorSpec,
        llm_args: LlmArgs,
        kv: KvCacheManager,
        calls: Counter[str],
        comm: TpComm | None = None,
        features: RuntimeFeatures | None = None,
    ):
        self.cfg, self.spec, self.kv, self.calls, self.comm = cfg, spec, kv, calls, comm
        self.features = features or current_features()
        self.ranks: list[int] = list(kv.ranks)
        self.leader = 0 in self.ranks
        self.stream = current_stream(cfg.device)
        module = importlib.import_module(spec.module)
        sched_cls = getattr(module, spec.scheduler_class)
        worker_cls = getattr(module, spec.worker_class)
        # Construct concurrently (a worker and its scheduler may rendezvous in __init__);
        # scheduler on rank 0 only. Any exception aborts bring-up (on every rank).
        self.scheduler: Any = None
        self.workers: list[Any] = []
        try:
            with ThreadPoolExecutor(max_workers=2) as pool:
                # one llm_args for every rank, as TensorRT-LLM has: a connector learns its
                # rank from the runtime (set for the constructing thread here)
                sched_f = pool.submit(_on_rank, 0, sched_cls, llm_args) if self.leader else None
                worker_fs = [pool.submit(_on_rank, r, worker_cls, llm_args) for r in self.ranks]
                self.workers = [f.result() for f in worker_fs]
                self.scheduler = sched_f.result() if sched_f is not None else None
            err: BaseException | None = None
        except Exception as exc:
            err = exc
        self._everywhere(err, "connector construction")
        self.callables: list[Callable[..., Any] | None] = []
        for r, w in zip(self.ranks, self.workers, strict=True):
            self._count("register_forward_pass_callable", rank0=r == self.ranks[0])
            self.callables.append(w.register_forward_pass_callable() or None)
        self.n_groups = len(kv.groups)
        # Bring-up checks, then registration, then wait_for_initialization, as TensorRT-LLM
        # brings a connector up (the checks refuse what its bring-up refuses).
        if not cfg.enable_block_reuse:
            raise NotImplementedError("a KV connector requires enable_block_reuse=True")
        if cfg.kv_manager == "v1":
            if self.n_groups > 1:
                raise NotImplementedError(
                    f"VSWA ({self.n_groups} attention windows) is not supported with a KV "
                    "connector on the V1 KV cache manager; use kv_manager='v2'"
                )
            for r, w in zip(self.ranks, self.workers, strict=True):
                self._count("register_kv_caches", rank0=r == self.ranks[0])
                w.register_kv_caches(kv.v1_tensor(r))
        else:
            # the method-presence probe is the leader's, and collective
            self.leader_call(
                lambda: reject_flat_only_scheduler(
                    self.scheduler, self.n_groups, KvCacheConnectorScheduler
                ),
                "the scheduler's bring-up probe",
            )
            for r, w in zip(self.ranks, self.workers, strict=True):
                self._count("register_kv_cache_layout", rank0=r == self.ranks[0])
                w.register_kv_cache_layout(kv.layout(r))
        if self.leader and hasattr(self.scheduler, "wait_for_initialization"):
            self._count("wait_for_initialization")  # the 1.1-era ABC has no such hook
            self.scheduler.wait_for_initialization()
        # get_finished bookkeeping, per rank held here (as KvCacheConnectorManager does).
        # ids handed in and not yet returned, per rank; saving and loading apart, as the
        # manager keeps them in two dicts (a request parked on a load that ends while the
        # load lands is in both)
        n = len(self.ranks)
        self.pending_saving: list[set[int]] = [set() for _ in range(n)]
        self.pending_loading: list[set[int]] = [set() for _ in range(n)]
        self.local_saving: list[set[int]] = [set() for _ in range(n)]
        self.local_loading: list[set[int]] = [set() for _ in range(n)]

    # ----- the calls whose form depends on the TensorRT-LLM line (``features``) ---------
    def query(self, req: Any, num_computed: int) -> tuple[int, bool]:
        """The connector's offer: V1 asks with the C++-bound request (C++ ``addSequence``
        calls the manager), V2 with the Python one (``query_num_new_matched_tokens``)."""
        view = req.cpp_view() if self.cfg.kv_manager == "v1" else req
        n, is_async = self.sched("get_num_new_matched_tokens", view, num_computed)
        return int(n), bool(is_async)

    def commit(self, req: Any, start: int, offered: int, honoured: int) -> None:
        """``commit_new_matched_tokens``: the request carries what is honoured; a line with
        ``cancel_load`` hears the rest handed back as ``[start + honoured, start + offered)``."""
        req.py_num_connector_matched_tokens = req.num_connector_matched_tokens = honoured
        if honoured < offered and self.features.cancel_load:
            self.sched("cancel_load", req, start + honoured, start + offered, broadcast=False)

    def after_alloc(self, req: Any) -> None:
        """``update_state_after_alloc`` in the form the line passes the allocation: flat
        (V1, or a line without layer groups), a list per group, or (one line) the flat hook
        first (``[]`` for several groups) and then a dict keyed by group id."""
        pages = [list(p) for p in req.pages]
        grouped = self.features.grouped
        if self.cfg.kv_manager == "v1" or grouped is None:
            self.sched("update_state_after_alloc", req, pages[0], broadcast=False)
        elif grouped == "dict":
            flat = pages[0] if len(pages) == 1 else []
            self.sched("update_state_after_alloc", req, flat, broadcast=False)
            self.sched(
                "update_state_after_alloc_by_layer_group",
                req,
                dict(enumerate(pages)),
                broadcast=False,
            )
        else:
            self.sched("update_state_after_alloc_by_layer_group", req, pages, broadcast=False)

    def finish(self, req: Any) -> bool:
        """``request_finished`` in the line's form; True keeps the pages for a save."""
        pages = [list(p) for p in req.pages]
        if self.cfg.kv_manager == "v2" and self.features.grouped == "list":
            return bool(self.sched("request_finished_by_layer_group", req, pages))
        return bool(self.sched("request_finished", req, pages[0] if len(pages) == 1 else []))

    def reset(self, req: Any) -> None:
        """The allocation was dropped and the request starts again (``forget_request`` /
        ``reset_request_state``): lines with ``request_reset`` tell the scheduler."""
        if self.features.cancel_load:
            self.sched("request_reset", req, broadcast=False)

    def pending_transfer(self, request_id: int) -> bool:
        """``has_pending_transfers``: a load or save of it handed in and not yet reported
        by every rank."""
        return any(
            request_id in s
            for sets in (
                self.pending_saving,
                self.pending_loading,
                self.local_saving,
                self.local_loading,
            )
            for s in sets
        )

    def take_failed_loads(self, parked: bool) -> set[int]:
        """Lines with failed-load reports: the requests whose load failed (this pass's, or
        parked ones'), any rank's."""
        if not self.features.failed_load_reports:
            return set()
        name = "take_failed_async_load_requests" if parked else "take_failed_load_requests"
        out: set[int] = set()
        for r, w in zip(self.ranks, self.workers, strict=True):
            self._count(name, rank0=r == self.ranks[0])
            take = getattr(w, name, None)  # a base class without it reports nothing
            out |= {int(i) for i in (take() if take is not None else ())}
        if self.comm is not None:
            out = set().union(*self.comm.allgather(out, name))
        return out

    def _count(self, name: str, rank0: bool = True) -> None:
        if rank0:
            self.calls[name] += 1

    def _everywhere(self, err: BaseException | None, where: str) -> None:
        """Raise ``err`` here, and (MPI mode) on every rank if any rank has one: bring-up
        fails on every rank alike (one rank failing it would leave the others waiting)."""
        if self.comm is not None:
            errs = self.comm.allgather(_portable(err), where)
            err = next((e for e in errs if e is not None), None)
        if err is not None:
            raise err

    # ----- leader calls (the answer is broadcast) -------------------------------------
    def leader_call(self, fn: Callable[[], Any], where: str, broadcast: bool = True) -> Any:
        """``fn()`` on rank 0 (the scheduler's process); with ``broadcast`` every rank gets
        its answer (or raises its error), as ``_run_on_leader`` + ``mpi_broadcast`` do.
        Without, ranks other than 0 get None."""
        if self.comm is None:
            return fn()  # rank 0 is here; the answer is shared by every simulated rank
        env: tuple[str, Any] | None = None
        if self.leader:
            try:
                env = ("ok", fn())
            except Exception as exc:
                if not broadcast:
                    raise
                env = ("err", _portable(exc))
        if broadcast:
            env = self.comm.bcast(env, where)
        if env is None:
            return None
        if env[0] == "err":
            raise env[1]
        return env[1]

    def sched(self, name: str, *args: Any, broadcast: bool = True) -> Any:
        """A scheduler call (rank 0), counted; see ``leader_call``."""
        if self.leader:
            self._count(name)
        return self.leader_call(lambda: getattr(self.scheduler, name)(*args), name, broadcast)

    # ----- per-iteration worker calls ---------------------------------------------------
    def bind_and_start(self, meta: object) -> None:
        """Pickle round-trip of the leader's metadata to every rank, bind, start_load_kv.
        (MPI mode: ``meta`` came through the broadcast already, unpickled on every rank.)
        Exceptions propagate (fatal for the executor)."""
        blob = pickle.dumps(meta) if self.comm is None else None
        for r, w in zip(self.ranks, self.workers, strict=True):
            self._count("bind_connector_meta", rank0=r == self.ranks[0])
            w.bind_connector_meta(pickle.loads(blob) if blob is not None else meta)
        for r, w in zip(self.ranks, self.workers, strict=True):
            self._count("start_load_kv", rank0=r == self.ranks[0])
            w.start_load_kv(self.stream)

    def each_worker(self, name: str, *args: Any) -> None:
        """A forward hook on every rank held here (see the module docstring): every rank's
        hook runs (each rank is its own process, its own ``try``); then all ranks raised
        (rank 0's error is raised), none did, or ``RankDivergenceError``. In the MPI mode
        that is this rank's hook alone: its error fails this rank's batch."""
        raised: dict[int, BaseException] = {}
        for r, w in zip(self.ranks, self.workers, strict=True):
            self._count(name, rank0=r == self.ranks[0])
            try:
                getattr(w, name)(*args)
            except Exception as exc:
                raised[r] = exc
        where = f"{name}(layer {args[0]})" if name != "wait_for_save" else name
        self._agree(where, raised)

    def forward_callables(self) -> None:
        if self.callables and self.callables[0] is not None:
            self.calls["forward_pass_callable"] += 1
        raised: dict[int, BaseException] = {}
        for r, c in zip(self.ranks, self.callables, strict=True):
            if c is not None:
                try:
                    c()
                except Exception as exc:
                    raised[r] = exc
        self._agree("the forward-pass callable", raised)

    def _agree(self, where: str, raised: dict[int, BaseException]) -> None:
        if not raised:
            return
        if len(raised) == len(self.workers):
            raise raised[min(raised)]  # every rank fails the batch; rank 0 answers the client
        fatal = [e for e in raised.values() if is_fatal(e)]
        if fatal:  # that rank's executor stops, and the MPI job with it
            raise fatal[0]
        clean = [r for r in self.ranks if r not in raised]
        raise RankDivergenceError(where, raised, clean)

    def prefix_capability(self) -> bool:
        """Bring-up, prefix-aware scheduling on: does the connector take reservations (all
        three hooks: True; none: False, the legacy query path)? A partial implementation
        raises ``ValueError`` on every rank, as ``configure_prefix_reservations`` does."""
        caps: set[bool] = set()
        err: BaseException | None = None
        try:
            for r, w in zip(self.ranks, self.workers, strict=True):
                sched = self.scheduler if r == 0 else None
                caps.add(
                    prefix_reservation_capability(
                        sched, w, KvCacheConnectorScheduler, KvCacheConnectorWorker
                    )
                )
        except ValueError as exc:
            err = exc
        self._everywhere(err, "the prefix-reservation probe")
        cap = caps == {True}
        if self.comm is not None:
            cap = all(self.comm.allgather(cap, "the prefix-reservation probe"))
        return cap

    def get_finished_prefix_loads(self) -> list[set[int]]:
        """Every iteration (reservations on): each rank's newly reported reservation ids,
        rank order. TensorRT-LLM sends them to rank 0 without a collective
        (``PrefixLoadCompletionTracker``: isend/improbe) and publishes rank 0's decision
        through the ordered request queue; the MPI mode all-gathers them instead (same
        decision, applied by every rank before the next scheduling pass)."""
        mine: list[set[int]] = []
        for r, w in zip(self.ranks, self.workers, strict=True):
            self._count("get_finished_prefix_loads", rank0=r == self.ranks[0])
            mine.append({int(i) for i in w.get_finished_prefix_loads()})
        if self.comm is not None:
            return [set(s) for s in self.comm.allgather(mine[0], "get_finished_prefix_loads")]
        return mine

    def get_finished(self, saving: list[int], loading: list[int]) -> tuple[set[int], set[int]]:
        """Hand each id in once per rank; return the ids every rank has reported
        ``(finished_saving, finished_loading)`` (MPI mode: the ranks' reports are
        all-gathered). An id never handed in (or returned twice) raises ``KeyError``, as
        the manager's direct dict indexing does."""
        for i, (r, w) in enumerate(zip(self.ranks, self.workers, strict=True)):
            self.pending_saving[i].update(saving)
            self.pending_loading[i].update(loading)
            self._count("get_finished", rank0=r == self.ranks[0])
            done_save, done_load = w.get_finished(list(saving), list(loading))
            for ids, local, pending, what in (
                (done_save, self.local_saving[i], self.pending_saving[i], "saving"),
                (done_load, self.local_loading[i], self.pending_loading[i], "loading"),
            ):
                for rid in ids:
                    if rid not in pending:
                        raise KeyError(
                            f"rank {r} connector worker get_finished returned request id {rid!r} "
                            f"as finished {what}, which is not outstanding (never handed in, "
                            "or already returned)"
                        )
                    pending.discard(rid)
                    local.add(rid)
        saving_sets, loading_sets = self.local_saving, self.local_loading
        if self.comm is not None:  # mpi_allgather of every rank's (saving, loading)
            got = self.comm.allgather((saving_sets[0], loading_sets[0]), "get_finished")
            saving_sets, loading_sets = [g[0] for g in got], [g[1] for g in got]
        fin_save = set.intersection(*saving_sets)
        fin_load = set.intersection(*loading_sets)
        for i in range(len(self.ranks)):
            self.local_saving[i] -= fin_save
            self.local_loading[i] -= fin_load
        return fin_save, fin_load


def _on_rank(rank: int, cls: Any, llm_args: Any) -> Any:
    set_rank(rank)
    return cls(llm_args)


def _portable(exc: BaseException | None) -> BaseException | None:
    """``exc`` if it survives pickling (to travel to the other ranks), else a
    ``RuntimeError`` carrying its type and message."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
