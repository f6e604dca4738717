"""Load TensorRT-LLM's own connector package from a source tree, without its C++.

``install(path)`` makes ``tensorrt_llm`` importable from a checkout (or a partial copy
holding ``tensorrt_llm/_torch/pyexecutor/[connectors/]kv_cache_*.py``): the connector and
layout modules and ``KvCacheConnectorManager`` run as written; only what they import from
compiled or heavyweight parts is stood in for here:

- ``tensorrt_llm._utils``: ``mpi_rank``/``mpi_world_size``/``mpi_broadcast``/
  ``mpi_allgather``/``mpi_comm`` over ``RankWorld`` (ranks as threads of this process, the
  rank of the calling thread from ``set_rank``), ``TensorWrapper`` and
  ``convert_to_torch_tensor`` over raw host or device addresses, ``binding_to_torch_dtype``;
- ``tensorrt_llm.bindings``: ``LlmRequestState``; ``bindings.internal.batch_manager``:
  ``KvCacheConnectorManager`` (the nanobind trampoline's Python side: an empty base) and
  ``LlmRequest`` (a type name);
- ``tensorrt_llm.llmapi.llm_args.TorchLlmArgs``, ``tensorrt_llm.logger.logger``;
- ``pyexecutor.llm_request.get_draft_token_length``, ``pyexecutor.scheduler.
  ScheduledRequests``, and the V2 manager class ``KVCacheManagerV2`` (both import paths
  the variants use) for ``isinstance`` checks: an engine passes an instance of a subclass.

An installed ``tensorrt_llm`` is never shadowed: ``install`` refuses when one is imported.
Call it before anything imports ``disagg.engine`` (``DISAGG_TRTLLM_SRC`` does it then).
"""

from __future__ import annotations

import enum
import logging
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .layout import _raw_view

_PYEXEC = "tensorrt_llm._torch.pyexecutor"


class LlmRequestState(enum.IntEnum):
    UNKNOWN = 0
    ENCODER_INIT = 1
    CONTEXT_INIT = 2
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 3
    GENERATION_IN_PROGRESS = 4
    GENERATION_TO_COMPLETE = 5
    GENERATION_COMPLETE = 6
    DISAGG_GENERATION_INIT = 7
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 8
    DISAGG_CONTEXT_COMPLETE = 9


class RankWorld:
    """Ranks as threads: each rank's thread calls ``set_rank(r)`` first; collectives meet
    at a barrier (every rank must make the same collective calls in the same order, as
    MPI processes must)."""

    def __init__(self, size: int, timeout_s: float = 30.0):
        self.size = size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(size, timeout=timeout_s) if size > 1 else None
        self._slots: list[Any] = [None] * size

    def exchange(self, rank: int, value: Any) -> list[Any]:
        if self._barrier is None:
            return [value]
        self._slots[rank] = value
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank has read
        return out


_state = threading.local()
_world = RankWorld(1)


def set_world(world: RankWorld) -> None:
    global _world
    _world = world


def set_rank(rank: int) -> None:
    """This thread is rank ``rank`` (what ``mpi_rank()`` answers here)."""
    _state.rank = rank


def mpi_rank() -> int:
    return int(getattr(_state, "rank", 0))


def mpi_world_size() -> int:
    return _world.size


def mpi_broadcast(obj: Any, root: int = 0) -> Any:
    return _world.exchange(mpi_rank(), obj)[root]


def mpi_allgather(obj: Any) -> list[Any]:
    return _world.exchange(mpi_rank(), obj)


def mpi_comm() -> Any:
    return None


@dataclass
class TensorWrapper:
    data_ptr: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    device: str | None = None


#: where raw addresses live for ``convert_to_torch_tensor`` (an engine over CUDA sets it)
ADDRESS_DEVICE = {"device": "cpu"}


def convert_to_torch_tensor(w: TensorWrapper) -> torch.Tensor:
    item = torch.empty(0, dtype=w.dtype).element_size()
    strides = w.strides or tuple(
        int(torch.tensor(w.shape[i + 1 :]).prod()) if i + 1 < len(w.shape) else 1
        for i in range(len(w.shape))
    )
    span = 0 if 0 in w.shape else 1 + sum((n - 1) * s for n, s in zip(w.shape, strides))
    nbytes = span * item
    device = w.device or ADDRESS_DEVICE["device"]
    if nbytes == 0:
        return torch.empty(w.shape, dtype=w.dtype, device=device)
    flat = _raw_view(w.data_ptr, nbytes, device)
    return flat.view(w.dtype).as_strided(w.shape, strides)


def binding_to_torch_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    raise KeyError(f"no torch dtype for binding {dtype!r}")


class _Logger:
    def __init__(self) -> None:
        self._log = logging.getLogger("tensorrt_llm")
        self._once: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)

    def warning_once(self, msg: str, *args: Any, key: str | None = None) -> None:
        k = key or msg
        if k not in self._once:
            self._once.add(k)
            self._log.warning(msg, *args)


class KvCacheConnectorManagerCpp:
    """The nanobind trampoline's Python side: C++ calls ``get_num_new_matched_tokens``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class LlmRequest:
    """A type name only: engines pass their own request objects."""


class TorchLlmArgs:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class KVCacheManagerV2:
    """Base for ``isinstance`` checks: a V2-style engine's cache manager subclasses it."""


class KVCacheManager:
    """Base for ``isinstance`` checks of a V1-style cache manager."""


@dataclass
class ScheduledRequests:
    context_requests_chunking: list[Any] = field(default_factory=list)
    context_requests_last_chunk: list[Any] = field(default_factory=list)
    generation_requests: list[Any] = field(default_factory=list)
    paused_requests: list[Any] = field(default_factory=list)

    @property
    def context_requests(self) -> list[Any]:
        return [*self.context_requests_chunking, *self.context_requests_last_chunk]

    @context_requests.setter
    def context_requests(self, reqs: list[Any]) -> None:  # the 1.1-era API assigns it
        self.context_requests_chunking, self.context_requests_last_chunk = [], list(reqs)

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    def all_requests(self) -> list[Any]:
        return [*self.context_requests, *self.generation_requests]


def get_draft_token_length(request: Any) -> int:
    return len(getattr(request, "py_draft_tokens", None) or [])


def _module(name: str, path: Path | None = None, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    if path is not None:
        mod.__path__ = [str(path)]  # a package: real files below it import normally
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


def layout_of(src: Path) -> Path:
    """The ``tensorrt_llm/_torch/pyexecutor`` folder of a variant tree (refusing others)."""
    pyexec = src / "tensorrt_llm" / "_torch" / "pyexecutor"
    flat = pyexec / "kv_cache_connector.py"
    pkg = pyexec / "connectors" / "kv_cache_connector.py"
    if not flat.is_file() and not pkg.is_file():
        raise FileNotFoundError(
            f"DISAGG_TRTLLM_SRC={src}: no tensorrt_llm/_torch/pyexecutor/[connectors/]"
            "kv_cache_connector.py below it; point it at a TensorRT-LLM checkout (its root)"
        )
    return pyexec


def install(src: str | Path) -> str:
    """Make ``tensorrt_llm`` importable from ``src`` with the stand-ins above; returns the
    connector module's name. Idempotent for the same tree."""
    root = Path(src).resolve()
    pyexec = layout_of(root)
    existing = sys.modules.get("tensorrt_llm")
    if existing is not None:
        if getattr(existing, "__disagg_src__", None) == str(root):
            return _connector_module(pyexec)
        raise RuntimeError(
            f"tensorrt_llm is already imported from {getattr(existing, '__file__', '?')}; "
            "load a source tree only in a process that has not imported it"
        )
    top = _module("tensorrt_llm", root / "tensorrt_llm", __disagg_src__=str(root))
    top.__file__ = str(root / "tensorrt_llm" / "__init__.py")
    _module(
        "tensorrt_llm._utils",
        mpi_rank=mpi_rank,
        mpi_world_size=mpi_world_size,
        mpi_broadcast=mpi_broadcast,
        mpi_allgather=mpi_allgather,
        mpi_comm=mpi_comm,
        TensorWrapper=TensorWrapper,
        convert_to_torch_tensor=convert_to_torch_tensor,
        binding_to_torch_dtype=binding_to_torch_dtype,
    )
    _module("tensorrt_llm.bindings", LlmRequestState=LlmRequestState)
    _module("tensorrt_llm.bindings.internal")
    _module(
        "tensorrt_llm.bindings.internal.batch_manager",
        KvCacheConnectorManager=KvCacheConnectorManagerCpp,
        LlmRequest=LlmRequest,
    )
    _module("tensorrt_llm.llmapi")
    _module("tensorrt_llm.llmapi.llm_args", TorchLlmArgs=TorchLlmArgs)
    _module("tensorrt_llm.logger", logger=_Logger())
    _module("tensorrt_llm._torch", root / "tensorrt_llm" / "_torch")
    _module(_PYEXEC, pyexec)
    _module(f"{_PYEXEC}.llm_request", get_draft_token_length=get_draft_token_length)
    _module(f"{_PYEXEC}.scheduler", ScheduledRequests=ScheduledRequests)
    _module(f"{_PYEXEC}.resource_manager", KVCacheManager=KVCacheManager)
    _module(f"{_PYEXEC}.kv_cache_manager_v2", KVCacheManagerV2=KVCacheManagerV2)
    _module(f"{_PYEXEC}.kv_cache", pyexec / "kv_cache")
    _module(f"{_PYEXEC}.kv_cache.kv_cache_manager_v2", KVCacheManagerV2=KVCacheManagerV2)
    return _connector_module(pyexec)


def _connector_module(pyexec: Path) -> str:
    if (pyexec / "connectors" / "kv_cache_connector.py").is_file():
        return f"{_PYEXEC}.connectors.kv_cache_connector"
    return f"{_PYEXEC}.kv_cache_connector"
