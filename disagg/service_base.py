"""What the producer and consumer services share: who they are (model, TP shard, key
namespace, fingerprint), one service per instance id and process, metrics."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Generic, TypeVar

from .config import DisaggConfig
from .identity import fingerprint_of, model_id_of, namespace_of, tp_of
from .pages import PagePool
from .protocol.fingerprint import Fingerprint

log = logging.getLogger("disagg")

S = TypeVar("S", bound="ConnectorService")


class Registry(Generic[S]):
    """One live service per instance id in this process. The scheduler and the worker of
    an instance are built concurrently and must find the same one."""

    def __init__(self) -> None:
        self.services: dict[str, S] = {}
        self._lock = threading.Lock()

    def get(self, cls: type[S], config: DisaggConfig, llm_args: Any) -> S:
        with self._lock:
            svc = self.services.get(str(config.instance_id))
            if svc is None or svc.closed:
                svc = cls(config, llm_args)
                self.services[svc.name] = svc
            return svc

    def live(self) -> list[S]:
        """A snapshot of the open services (safe from any thread)."""
        with self._lock:
            return [s for s in self.services.values() if not s.closed]

    def forget(self, svc: S) -> None:
        with self._lock:
            if self.services.get(svc.name) is svc:
                del self.services[svc.name]


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
        if self.tp_size != 1:
            raise NotImplementedError(
                f"disagg {self.role}: tensor_parallel_size={self.tp_size} is not supported "
                f"yet; run {self.shard_hint} with TP=1"
            )
        self.pool: PagePool | None = None
        self.fingerprint: Fingerprint | None = None
        self.metrics: Counter[str] = Counter()
        self.closed = False
        self._seeds: dict[str | None, bytes] = {}

    def _attach_pool(self, pool: PagePool) -> None:
        """Registration: remember the engine's pages and who that makes us."""
        if self.pool is not None:
            raise RuntimeError(f"disagg {self.role}: KV caches were registered twice")
        self.pool = pool
        self.fingerprint = fingerprint_of(pool, self.model_id, self.tp_size, self.tp_rank)
        if self.config.metrics.port:  # inside trtllm-serve there is no other /metrics to use
            from .metrics import serve_metrics

            try:
                serve_metrics(self.config.metrics.port)
            except OSError as exc:  # a busy port must not take the connector down
                log.warning("metrics.port %s: %s", self.config.metrics.port, exc)

    def namespace_seed(self, cache_salt: str | None) -> bytes:
        """The key-chain seed for this cache and ``cache_salt`` (cached per salt)."""
        seed = self._seeds.get(cache_salt)
        if seed is None:
            assert self.fingerprint is not None, "no KV cache registered yet"
            seed = self._seeds[cache_salt] = namespace_of(self.fingerprint, cache_salt).seed()
        return seed
