"""What the producer and consumer services share: who they are (model, TP shard, key
namespace, fingerprint), one service per (instance id, TP rank) and process, metrics.

Tensor parallelism. Every rank of an instance has its own service: its own page pool (the
rank's KV heads), and on a producer its own store, lease table and control server. Where
the model's KV head count is known (``engine.heads.num_kv_heads_of``) and the rank's heads
are located in its pages, keys do not depend on the shard: every rank of every TP size
stores its heads of a block under the block's one key, the fingerprint states the head
count and a handshake compares no TP size or rank, so a consumer of any TP size pulls each
rank's heads from the producer ranks holding them (docs/design/unequal-tp.md). Otherwise
(head-blind) rank r's fingerprint and namespace carry ``tp_rank=r``, and a handshake pairing
consumer rank r with producer rank s != r, or another TP size, is refused (``INCOMPATIBLE_PEER``
naming the field). The leader-only scheduler of rank 0 derives every rank's fingerprint and
key seed from its own (``fingerprint_for``, ``namespace_seed(..., tp_rank=r)``).

Control endpoints per rank (``rank_endpoint``): rank 0 binds the configured endpoint, rank r
binds the same host with port + r (``ipc://path`` becomes ``ipc://path.r``); port 0 means any
free port on every rank, so consumers then list the ranks' endpoints explicitly.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter
from typing import Any, Generic, TypeVar

import msgspec

from . import tuning
from .config import DisaggConfig
from .engine.heads import HeadGeometry, geometry_of, num_kv_heads_of
from .identity import (
    RequestIdentity,
    cache_salt_id,
    fingerprint_of,
    model_id_of,
    namespace_of,
    tp_of,
)
from .pages import PagePool
from .protocol.fingerprint import Fingerprint

log = logging.getLogger("disagg")

S = TypeVar("S", bound="ConnectorService")


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Rank ``rank``'s control endpoint, given rank 0's: ``tcp://host:port`` -> port + rank
    (port 0 stays 0: any free port), ``ipc://path`` -> ``ipc://path.rank``. Rank 0 is the
    endpoint itself."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        p = int(port)
        return f"tcp://{host}:{p + rank if p else 0}"
    return f"{endpoint}.{rank}"


class Registry(Generic[S]):
    """One live service per (instance id, TP rank) in this process (``by_rank``). The
    scheduler (rank 0) and the workers of an instance are built concurrently and must find
    their rank's one. ``services`` maps an instance id to its lowest rank's service here (a
    real TP deployment runs one rank per process, so that is the process's only one)."""

    def __init__(self) -> None:
        self.by_rank: dict[tuple[str, int], S] = {}
        self.services: dict[str, S] = {}
        self._lock = threading.Lock()

    def get(self, cls: type[S], config: DisaggConfig, llm_args: Any) -> S:
        key = (str(config.instance_id), tp_of(llm_args)[1])
        with self._lock:
            svc = self.by_rank.get(key)
            if svc is None or svc.closed:
                svc = cls(config, llm_args)
                self.by_rank[svc.key] = svc
                first = self.services.get(svc.name)
                if first is None or first.closed or svc.tp_rank < first.tp_rank:
                    self.services[svc.name] = svc
            return svc

    def ranks(self, name: str) -> list[S]:
        """Every rank's service of instance ``name`` in this process, rank order."""
        with self._lock:
            return sorted(
                (s for (n, _), s in self.by_rank.items() if n == name), key=lambda s: s.tp_rank
            )

    def live(self) -> list[S]:
        """A snapshot of the open services, every rank (safe from any thread)."""
        with self._lock:
            return [s for s in self.by_rank.values() if not s.closed]

    def forget(self, svc: S) -> None:
        with self._lock:
            if self.by_rank.get(svc.key) is svc:
                del self.by_rank[svc.key]
            if self.services.get(svc.name) is svc:
                del self.services[svc.name]
                rest = [s for (n, _), s in self.by_rank.items() if n == svc.name and not s.closed]
                if rest:
                    self.services[svc.name] = min(rest, key=lambda s: s.tp_rank)


# Python's own thread switch interval: a thread waiting for the GIL waits up to this long
# for a thread that never blocks (an engine loop polling for loads) to hand it over.
DEFAULT_GIL_SWITCH_US = 500


def lower_switch_interval() -> None:
    """Lower the interpreter's thread switch interval to ``tuning.gil_switch_us`` (never
    raise it). The data plane's receive and send threads need the GIL a few times per
    transfer; at Python's 5 ms, each time waited for the engine thread's loop. On the H200
    (``disagg bench overhead``, 1B model, ipc) a load took 35-43 ms for 1-2 ms of wire; at
    0.5 ms, 5-6 ms (docs/design/consumer.md)."""
    want = tuning.current().gil_switch_us
    want = DEFAULT_GIL_SWITCH_US if want is None else want
    if want and sys.getswitchinterval() > want / 1e6:
        sys.setswitchinterval(want / 1e6)
        log.info("thread switch interval set to %d us (tuning.gil_switch_us)", want)


def _kv_heads(llm_args: Any, configured: int | None) -> int | None:
    """The model's KV heads: the config's ``num_kv_heads`` where set (checked against the
    engine's model config where that says it too), else the engine's (None: unknown)."""
    engine = num_kv_heads_of(llm_args)
    if configured is not None and engine is not None and configured != engine:
        raise ValueError(
            f"num_kv_heads: the disagg config says {configured} but the model config says "
            f"{engine}: set it to {engine} or remove it"
        )
    return configured if configured is not None else engine


class ConnectorService:
    """Identity and bookkeeping common to both roles; ``role`` names the subclass's."""

    role = "connector"
    shard_hint = "instances"

    def __init__(self, config: DisaggConfig, llm_args: Any):
        assert config.instance_id is not None  # filled in by DisaggConfig
        self.config = config
        self.name: str = config.instance_id
        self.model_id = model_id_of(llm_args, config.model_id)
        self.tp_size, self.tp_rank = tp_of(llm_args)
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"disagg {self.role}: tp rank {self.tp_rank} is outside "
                f"tensor_parallel_size={self.tp_size}"
            )
        want_tp = config.tensor_parallel_size
        if want_tp is not None and want_tp != self.tp_size:
            raise ValueError(
                f"tensor_parallel_size: the disagg config says {want_tp} but the engine runs "
                f"tensor_parallel_size={self.tp_size}: set it to {self.tp_size} or remove it"
            )
        self.key = (self.name, self.tp_rank)  # the registry's key
        self.pool: PagePool | None = None
        self.fingerprint: Fingerprint | None = None
        self.metrics: Counter[str] = Counter()
        self.closed = False
        self._seeds: dict[tuple[RequestIdentity, int], bytes] = {}
        # the model's KV heads (None: unknown, pages then pair by TP rank) and, once the
        # cache is registered, where this rank's sit in its pages (``engine.heads``)
        self.num_kv_heads = _kv_heads(llm_args, config.num_kv_heads)
        self.heads: HeadGeometry | None = None

    def _attach_pool(self, pool: PagePool) -> None:
        """Registration: remember the engine's pages and who that makes us."""
        if self.pool is not None:
            raise RuntimeError(f"disagg {self.role}: KV caches were registered twice")
        self.pool = pool
        lower_switch_interval()
        if self.num_kv_heads:
            try:
                self.heads = geometry_of(pool.layout, self.num_kv_heads, self.tp_size, self.tp_rank)
            except ValueError as exc:
                log.warning(
                    "disagg %s: KV heads not located in the pages (%s; num_kv_heads in the "
                    "disagg config, where set, must be the model's): pages move only between "
                    "equal TP sizes",
                    self.role,
                    exc,
                )
        self.fingerprint = fingerprint_of(
            pool, self.model_id, self.tp_size, self.tp_rank, self.heads
        )
        if self.config.metrics.port:  # inside trtllm-serve there is no other /metrics to use
            from .metrics import serve_metrics

            try:
                serve_metrics(self.config.metrics.port, self.config.metrics.host)
            except OSError as exc:  # a busy port must not take the connector down
                log.warning("metrics.port %s: %s", self.config.metrics.port, exc)

    def fingerprint_for(self, tp_rank: int) -> Fingerprint:
        """Rank ``tp_rank``'s fingerprint: ours with that rank (one TP size: every shard
        has the same geometry). The leader uses it to speak for every rank."""
        assert self.fingerprint is not None, "no KV cache registered yet"
        if tp_rank == self.fingerprint.tp_rank:
            return self.fingerprint
        return msgspec.structs.replace(self.fingerprint, tp_rank=tp_rank)

    def namespace_seed(
        self, ident: RequestIdentity | str | None, tp_rank: int | None = None
    ) -> bytes:
        """The key-chain seed of requests of identity ``ident`` (a bare string is a cache
        salt) on rank ``tp_rank`` (default: ours). Keys differ per rank and per identity
        (rank and identity are in the seed). Cached, except for multimodal identities (one per request)."""
        if not isinstance(ident, RequestIdentity):
            token = None if ident is None else str(cache_salt_id(ident))
            ident = RequestIdentity(cache_salt=token)
        rank = self.tp_rank if tp_rank is None else tp_rank
        seed = self._seeds.get((ident, rank))
        if seed is None:
            seed = namespace_of(self.fingerprint_for(rank), ident).seed()
            if ident.mm_digest is None:
                self._seeds[(ident, rank)] = seed
        return seed
