"""The reference engine: a seeded tiny llama-style model with a paged KV cache and an
executor loop that drives a TensorRT-LLM KV cache connector as the real executor does.

Public API (used by serve/bench/tests)::

    from disagg.engine.reference import Engine, EngineConfig, ConnectorSpec
    eng = Engine(EngineConfig(kv_manager="v2", windows=(64, None)),
                 connector=ConnectorSpec("mod", "SchedCls", "WorkerCls", extra={}))
    rid = eng.add_request([1, 2, 3], max_tokens=8, cache_salt=None)
    while eng.has_work():
        eng.step()
    eng.results[rid].tokens, eng.results[rid].error, eng.stats.as_dict()
    eng.generate([[1, 2, 3]], max_tokens=8)  # -> [[...]]; raises RuntimeError on failure

TP ranks (``EngineConfig(tp=N)``) run in one process, but are judged as separate ones: a
forward hook that raises on some ranks and not on others raises ``RankDivergenceError``
(fatal), where a real multi-process engine would hang in the layer's all-reduce.

Or each TP rank is its own process (the MPI mode, ``disagg.engine.reference.mpi``:
``Engine(cfg, spec, comm=MpiComm())`` in every rank's process under ``mpirun``): the leader's
answers are broadcast, ``get_finished`` is all-gathered, every layer all-gathers the ranks'
attention heads, and a rank that left while the others went on leaves them waiting there
(``RankHangError`` after ``hang_timeout_s``). Tokens are the same as in one process.
"""

from .config import ConnectorSpec, EngineConfig, LlmArgs, parse_windows
from .connector_driver import CpuStream, RankDivergenceError, RankHangError, TpComm
from .executor import Engine, EngineStats, Request, RequestResult

__all__ = [
    "ConnectorSpec",
    "CpuStream",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "LlmArgs",
    "RankDivergenceError",
    "RankHangError",
    "Request",
    "RequestResult",
    "TpComm",
    "parse_windows",
]
