"""The TensorRT-LLM boundary.

Re-exports TensorRT-LLM's connector base classes and layout types when TensorRT-LLM is
importable (the ``connectors/`` package of 1.3+, then the 1.2-era flat module), and our
contract-faithful definitions otherwise. Connectors import from here and run unchanged on
either. ``TRTLLM_SOURCE`` says which was taken. ``DISAGG_TRTLLM_SRC=path`` first loads
TensorRT-LLM's connector package from a source tree (``trtllm_src``). ``FEATURES`` says
what the runtime behind these classes does (``runtime.RuntimeFeatures``).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from . import _contract, layout, runtime

if os.environ.get("DISAGG_TRTLLM_SRC"):
    from . import trtllm_src

    trtllm_src.install(os.environ["DISAGG_TRTLLM_SRC"])

_NEW = "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"
_NEW_LAYOUT = "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout"
_OLD = "tensorrt_llm._torch.pyexecutor.kv_cache_connector"


def _try(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception:  # ImportError, or a broken install raising anything at import
        return None


_conn = _try(_NEW) or _try(_OLD)
_lay = _try(_NEW_LAYOUT) if _conn is not None else None

if _conn is not None:
    TRTLLM_SOURCE: str = _conn.__name__
    KvCacheConnectorScheduler: Any = _conn.KvCacheConnectorScheduler
    KvCacheConnectorWorker: Any = _conn.KvCacheConnectorWorker
    RequestData: Any = _conn.RequestData
    SchedulerOutput: Any = _conn.SchedulerOutput
    PrefixLoad: Any = getattr(_conn, "PrefixLoad", _contract.PrefixLoad)
else:
    TRTLLM_SOURCE = "disagg.engine._contract"
    KvCacheConnectorScheduler = _contract.KvCacheConnectorScheduler
    KvCacheConnectorWorker = _contract.KvCacheConnectorWorker
    RequestData = _contract.RequestData
    SchedulerOutput = _contract.SchedulerOutput
    PrefixLoad = _contract.PrefixLoad

# 1.2.x has no layout module: our layout types then describe our own caches only.
_L: Any = _lay if _lay is not None and hasattr(_lay, "KvCacheLayout") else layout
KvCacheLayout: Any = _L.KvCacheLayout
KvCacheLayerGroupLayout: Any = _L.KvCacheLayerGroupLayout
KvCacheRegion: Any = _L.KvCacheRegion
KvCacheBufferRef: Any = _L.KvCacheBufferRef
# one line's layout module has no valid_page_slots: ours is the same contract
valid_page_slots: Any = getattr(_L, "valid_page_slots", layout.valid_page_slots)
BAD_PAGE_INDEX: int = getattr(_L, "BAD_PAGE_INDEX", -1)
USING_TRTLLM: bool = _conn is not None
FEATURES: runtime.RuntimeFeatures = runtime.bind(_conn)  # at import; runtime.current() later

__all__ = [
    "BAD_PAGE_INDEX",
    "FEATURES",
    "TRTLLM_SOURCE",
    "USING_TRTLLM",
    "KvCacheBufferRef",
    "KvCacheConnectorScheduler",
    "KvCacheConnectorWorker",
    "KvCacheLayerGroupLayout",
    "KvCacheLayout",
    "KvCacheRegion",
    "PrefixLoad",
    "RequestData",
    "SchedulerOutput",
    "valid_page_slots",
]
