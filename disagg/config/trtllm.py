"""The ``--extra_llm_api_options`` TensorRT-LLM needs to run disagg's connectors, and a check
of a given options mapping against what its connector bring-up refuses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import choice_error
from .schema import ROLES

_CONNECTOR_CLASSES = {
    "producer": ("disagg.producer", "ProducerScheduler", "ProducerWorker"),
    "consumer": ("disagg.consumer", "ConsumerScheduler", "ConsumerWorker"),
}


def trtllm_llm_api_options(role: str) -> dict[str, Any]:
    """The ``--extra_llm_api_options`` mapping for ``trtllm-serve`` in ``role``: our connector
    plus the settings TensorRT-LLM's connector bring-up requires. The files
    in ``deploy/trtllm/`` hold the same keys, with comments."""
    if role not in ROLES:
        raise choice_error(role, ROLES, "role")
    module, sched, worker = _CONNECTOR_CLASSES[role]
    return {
        "kv_connector_config": {
            "connector_module": module,
            "connector_scheduler_class": sched,
            "connector_worker_class": worker,
        },
        "kv_cache_config": {"enable_block_reuse": True, "enable_partial_reuse": False},
        "cuda_graph_config": None,
        "max_beam_width": 1,
        "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"},
        "enable_attention_dp": False,
    }


def check_llm_api_options(options: Mapping[str, Any]) -> list[str]:
    """Problems (one line each) that TensorRT-LLM's connector bring-up would reject or that
    silently defeat the connector, for an ``--extra_llm_api_options`` mapping. Empty = fine."""
    problems: list[str] = []
    kcc = options.get("kv_connector_config")
    allowed = {"connector_module", "connector_scheduler_class", "connector_worker_class"}
    if not isinstance(kcc, Mapping):
        problems.append("kv_connector_config: missing; name our module and classes")
    else:
        extra = set(kcc) - allowed
        missing = allowed - set(kcc)
        if extra:
            problems.append(f"kv_connector_config: unexpected keys {sorted(extra)}")
        if missing:
            problems.append(f"kv_connector_config: missing keys {sorted(missing)}")
    kv = options.get("kv_cache_config") or {}
    if not isinstance(kv, Mapping):
        problems.append("kv_cache_config: must be a mapping")
        kv = {}
    if kv.get("enable_block_reuse") is not True:
        problems.append("kv_cache_config.enable_block_reuse: must be true (connector prefixes)")
    if kv.get("enable_partial_reuse") not in (None, False):
        problems.append(
            "kv_cache_config.enable_partial_reuse: must be false (non-block-aligned matches "
            "are declined)"
        )
    for key in ("host_cache_size", "disk_cache_size"):
        if (kv.get(key) or 0) > 0:
            problems.append(f"kv_cache_config.{key}: must be 0/unset with a KV connector")
    if "cuda_graph_config" not in options or options["cuda_graph_config"] is not None:
        problems.append("cuda_graph_config: must be null (layer hooks do not fire in graphs)")
    if (options.get("max_beam_width") or 1) > 1:
        problems.append("max_beam_width: must be 1 (connectors do not support beams)")
    if options.get("speculative_config") is not None:
        problems.append("speculative_config: speculative decoding is refused with a connector")
    for key in ("pipeline_parallel_size", "pp_size", "context_parallel_size", "cp_size"):
        if (options.get(key) or 1) > 1:
            problems.append(f"{key}: must be 1 (PP/CP are refused with a connector)")
    policy = (options.get("scheduler_config") or {}).get("capacity_scheduler_policy")
    if policy not in (None, "GUARANTEED_NO_EVICT"):
        problems.append(
            "scheduler_config.capacity_scheduler_policy: must be GUARANTEED_NO_EVICT "
            "(V1 KV manager)"
        )
    if options.get("enable_attention_dp"):
        problems.append("enable_attention_dp: not supported by disagg's connectors")
    return problems
