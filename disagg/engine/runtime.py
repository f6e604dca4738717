"""What the runtime behind the connector classes does, and which rank this process is.

TensorRT-LLM's lines differ in behaviour a connector must match, and the connector base
classes are the only thing a connector is handed. ``features_of(module)`` reads it off the
imported connector module (TensorRT-LLM's, or None for our fallback copies). What no class
tells is left out on purpose: whether the executor keeps a cancelled request's pages while
a transfer of it is pending (a manager's ``has_pending_transfers`` says nothing of whether
the executor asks it, and no stored one does), so the consumer assumes it does not:

- ``cancel_load``: the scheduler hears a short honour or a dropped offer as
  ``cancel_load(request, start, end)``.
- ``failed_load_reports``: the worker reports failed loads
  (``take_failed_load_requests``/``take_failed_async_load_requests``) and the executor
  restarts only those requests, instead of the connector raising in a layer hook (which
  fails every active request of the instance).
- ``grouped``: how layer groups are passed: ``None`` (flat block ids only), ``"list"``
  (``List[List[int]]``, index = group id) or ``"dict"`` (``Dict[int, List[int]]``).

Our fallback copies describe the reference engine, which follows one of these lines
(``use_features``, called by the engine before it builds a connector).

``runtime_rank()``: TensorRT-LLM's ``tensorrt_llm._utils.mpi_rank()`` when that runtime is
present (``llm_args`` carries no rank: it is one object for every rank), else the rank the
reference engine set for the calling thread (``set_rank``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class RuntimeFeatures:
    line: str
    cancel_load: bool = False
    failed_load_reports: bool = False
    grouped: str | None = "list"


def features_of(conn: Any) -> RuntimeFeatures:
    """The features of a TensorRT-LLM connector module (None: our fallback copies)."""
    if conn is None:
        return _fallback
    mgr = getattr(conn, "KvCacheConnectorManager", None)
    sched = conn.KvCacheConnectorScheduler
    worker = conn.KvCacheConnectorWorker
    grouped: str | None = None
    if hasattr(sched, "update_state_after_alloc_by_layer_group"):
        fields = getattr(conn.RequestData, "__dataclass_fields__", {})
        kind = str(getattr(fields.get("new_block_ids_by_layer_group"), "type", ""))
        grouped = "dict" if "Dict" in kind or "dict" in kind else "list"
    return RuntimeFeatures(
        line=conn.__name__,
        cancel_load=hasattr(sched, "cancel_load") and hasattr(mgr, "cancel_load"),
        failed_load_reports=hasattr(worker, "take_failed_load_requests"),
        grouped=grouped,
    )


_fallback = RuntimeFeatures(line="disagg.engine._contract")
_current = _fallback
_using_trtllm = False


def bind(conn: Any) -> RuntimeFeatures:
    """``disagg.engine`` at import: the connector module it took (None: our fallback
    copies). Returns its features, ``current()`` from now on."""
    global _current, _using_trtllm
    _using_trtllm = conn is not None
    _current = features_of(conn)
    return _current


def use_features(**changes: Any) -> RuntimeFeatures:
    """The reference engine declares how it behaves (fallback copies only; with
    TensorRT-LLM's classes their line's features stand)."""
    global _fallback, _current
    if _using_trtllm:
        return _current
    _fallback = _current = replace(_fallback, **changes)
    return _current


def current() -> RuntimeFeatures:
    return _current


_local = threading.local()


def set_rank(rank: int) -> None:
    """The calling thread is TP rank ``rank`` (the reference engine's ranks)."""
    _local.rank = int(rank)
    from . import trtllm_src  # a source tree's stand-in mpi_rank() answers the same

    trtllm_src.set_rank(rank)


def runtime_rank() -> int:
    if _using_trtllm:
        try:
            from tensorrt_llm._utils import mpi_rank  # type: ignore[import-not-found]

            return int(mpi_rank())
        except Exception:  # a runtime without MPI helpers: a single rank
            return 0
    return int(getattr(_local, "rank", 0))
