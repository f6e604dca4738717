"""Engine configuration, connector spec and the ``TorchLlmArgs``-like object connectors see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import USING_TRTLLM, runtime
from ..runtime import RuntimeFeatures

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_windows(text: str) -> tuple[int | None, ...]:
    """``"64,full"`` -> ``(64, None)``; one entry per layer, repeated cyclically."""
    out: list[int | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        out.append(None if item in ("full", "none", "0") else int(item))
    if not out:
        raise ValueError("windows: empty list")
    return tuple(out)


# How each TensorRT-LLM line's executor treats a connector where the lines differ (the
# connector package variants of that line; see disagg.engine.runtime.RuntimeFeatures).
RUNTIMES: dict[str, dict[str, Any]] = {
    # 1.1/1.2-era flat module: flat block ids only
    "flat": dict(cancel_load=False, failed_load_reports=False, grouped=None),
    "saltid": dict(cancel_load=False, failed_load_reports=False, grouped=None),
    "groups": dict(cancel_load=False, failed_load_reports=False, grouped="list"),
    "main": dict(cancel_load=False, failed_load_reports=False, grouped="list"),
    "reservations": dict(cancel_load=False, failed_load_reports=False, grouped="list"),
    "cancel": dict(cancel_load=True, failed_load_reports=True, grouped="dict"),
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the reference engine needs. Validated on construction (``ValueError``).

    ``windows``: per-layer attention windows repeated cyclically over ``num_layers``;
    ``None`` is full attention, an int a sliding window in tokens (a window at or above
    ``max_seq_len`` is full attention, as in TensorRT-LLM). ``num_blocks`` is the number of
    page slots of *each* layer-group pool.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    windows: tuple[int | None, ...] = (None,)
    tokens_per_block: int = 32
    kv_manager: str = "v1"
    chunk_size: int | None = None
    tp: int = 1
    # TensorRT-LLM runs the overlap scheduler unless told otherwise
    overlap: bool = True
    # Which TensorRT-LLM line's executor this engine behaves as where the lines differ
    # (cancellation, failed loads, how layer groups are passed: ``RUNTIMES``); None: the
    # line of the TensorRT-LLM connector package in use, else "main".
    runtime: str | None = None
    # Whether the executor keeps a cancelled request's pages while its manager reports a
    # transfer of it pending (``has_pending_transfers``). No stored ``py_executor.py``
    # asks: it frees them at once (False), and the consumer fences a load still landing
    # in them itself. True stands for an executor that asks.
    cancel_waits_for_transfers: bool = False
    # V2: the runtime honours at most this many of a connector's offered tokens
    # (``commit_new_matched_tokens``), standing for a chunked allocation that cannot
    # reserve pages for the whole offer; None honours all of it.
    honour_cap_tokens: int | None = None
    # Describe each layer group's last layer as a replicated region (a layout field of
    # one TensorRT-LLM line: buffers equal on every TP rank, listed apart from regions).
    replicated_regions: bool = False
    # "reference": our own manager-side bookkeeping; "trtllm": TensorRT-LLM's own
    # KvCacheConnectorManager of the loaded line (trtllm_driver), in py_executor's order.
    connector_manager: str = "reference"
    # Forwards that may fail (a connector hook raising fails every active request) before
    # the executor shuts down, as TensorRT-LLM's error budget; None: never.
    error_budget: int | None = None
    num_blocks: int = 512
    max_seq_len: int = 8192
    # TensorRT-LLM's scheduler limits (same names and defaults): the tokens one iteration's
    # forward computes (context chunk tokens + one per generation request) and the
    # requests it holds; they bound the forward's working memory.
    max_num_tokens: int = 8192
    max_batch_size: int = 2048
    # Each request's numbers independent of what else is batched with it (row tiles of a
    # fixed shape, attention per request; docs/design/reference-engine.md). None: on the
    # CPU (where the token-for-token tests run), not on CUDA (one fused call per layer).
    batch_invariant: bool | None = None
    device: str = "cpu"
    seed: int = 0
    dtype: str = "float32"
    enable_block_reuse: bool = True
    # V1 with block reuse: a released request's full blocks (all its tokens but the last)
    # are stored for reuse whatever it computed, as TensorRT-LLM's releaseBlocks does,
    # so a request that failed mid-prefill publishes pages it never filled.
    store_blocks_on_release: bool = True
    # TensorRT-LLM main's SchedulerConfig.enable_prefix_aware_scheduling (V2 only): a
    # connector offering the three reservation hooks is asked ``reserve_prefix`` at
    # admission and loads through ``SchedulerOutput.prefix_loads``
    # (docs/design/prefix-reservations.md).
    prefix_aware_scheduling: bool = False
    # Caps an accepted reservation at this many tokens (block-aligned down): stands for the
    # token-budget / KV-capacity limits that make TensorRT-LLM accept a shorter range.
    prefix_load_cap_tokens: int | None = None
    # Snapshot page bytes as they are loaded by a connector and as blocks complete, for
    # byte comparisons in tests (costs memory; off by default).
    capture_pages: bool = False
    # Stand for TensorRT-LLM serving a model given by hub name: ``llm_args.model`` is this
    # name and ``llm_args`` carries no model config, so a connector cannot read the KV head
    # count from it (only the disagg config's ``num_kv_heads`` says it). None: the engine's
    # own name and config.
    hub_model: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "windows", tuple(self.windows))

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"EngineConfig: {msg}")

        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "tokens_per_block",
            "tp",
            "num_blocks",
            "max_seq_len",
            "max_num_tokens",
            "max_batch_size",
        ):
            need(int(getattr(self, name)) > 0, f"{name} must be > 0")
        need(
            self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        )
        need(
            self.num_kv_heads % self.tp == 0 or self.tp % self.num_kv_heads == 0,
            f"tp {self.tp} neither divides num_kv_heads {self.num_kv_heads} nor is a multiple "
            "of it",
        )
        need(self.num_heads % self.tp == 0, f"num_heads {self.num_heads} not divisible by tp")
        need(self.head_dim % 2 == 0, "head_dim must be even (RoPE)")
        need(
            self.kv_manager in ("v1", "v2"),
            f"kv_manager must be 'v1' or 'v2', not {self.kv_manager!r}",
        )
        need(self.chunk_size is None or self.chunk_size > 0, "chunk_size must be > 0 or None")
        need(
            self.max_num_tokens >= self.tokens_per_block,
            f"max_num_tokens {self.max_num_tokens} must be at least tokens_per_block "
            f"{self.tokens_per_block} (a chunk cut to the budget is whole blocks)",
        )
        need(
            not self.prefix_aware_scheduling or self.kv_manager == "v2",
            "prefix_aware_scheduling needs kv_manager='v2' (TensorRT-LLM enables prefix "
            "reservations on KVCacheManagerV2 only)",
        )
        need(
            self.prefix_load_cap_tokens is None or self.prefix_load_cap_tokens >= 0,
            "prefix_load_cap_tokens must be >= 0 or None",
        )
        need(
            self.runtime is None or self.runtime in RUNTIMES,
            f"runtime must be one of {sorted(RUNTIMES)} or None, not {self.runtime!r}",
        )
        need(
            self.connector_manager in ("reference", "trtllm"),
            f"connector_manager must be 'reference' or 'trtllm', not {self.connector_manager!r}",
        )
        need(
            self.honour_cap_tokens is None or self.honour_cap_tokens >= 0,
            "honour_cap_tokens must be >= 0 or None",
        )
        need(self.dtype in _DTYPES, f"dtype must be one of {sorted(_DTYPES)}")
        need(len(self.windows) > 0, "windows must not be empty")
        for w in self.windows:
            need(w is None or int(w) > 0, f"window {w!r} must be a positive token count or None")
        need(
            self.device == "cpu" or self.device.startswith("cuda"), "device must be cpu or cuda[:N]"
        )

    @property
    def model_name(self) -> str:
        """Names the weights: shape and seed (what a checkpoint path names for a real model),
        so two engines agree on a model only when their KV bytes can agree."""
        return (
            f"disagg-reference-tiny-llama:v{self.vocab_size}-h{self.hidden_size}"
            f"-l{self.num_layers}-a{self.num_heads}-kv{self.num_kv_heads}-d{self.head_dim}"
            f"-i{self.intermediate_size}-rope{self.rope_theta:g}-seed{self.seed}"
        )

    @property
    def exact_batching(self) -> bool:
        """``batch_invariant`` resolved: True on the CPU unless set."""
        return self.device == "cpu" if self.batch_invariant is None else self.batch_invariant

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Effective window per layer (``None`` = full)."""
        out = []
        for i in range(self.num_layers):
            w = self.windows[i % len(self.windows)]
            out.append(None if w is None or w >= self.max_seq_len else int(w))
        return tuple(out)

    @property
    def layer_groups(self) -> list[tuple[int | None, tuple[int, ...]]]:
        """``[(window, layer_ids)]``, one per distinct window in first-appearance order."""
        order: list[int | None] = []
        for w in self.layer_windows:
            if w not in order:
                order.append(w)
        return [(w, tuple(i for i, lw in enumerate(self.layer_windows) if lw == w)) for w in order]

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads each rank holds: one, replicated, when ``tp > num_kv_heads``."""
        return max(1, self.num_kv_heads // self.tp)


@dataclass(frozen=True)
class ConnectorSpec:
    """Module and class names, imported like ``KvCacheConnectorConfig``; ``extra`` is passed
    to the connector as ``llm_args.disagg`` (a dict)."""

    module: str
    scheduler_class: str
    worker_class: str
    extra: dict[str, Any] = field(default_factory=dict)


class _Obj:
    """Attribute bag (repr shows fields) standing in for pydantic config objects."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__!r})"


class KvCacheConfigLike(_Obj):
    pass


class KvCacheConnectorConfigLike(_Obj):
    pass


class LlmArgs(_Obj):
    """What a connector's ``llm_args`` exposes (the subset of ``TorchLlmArgs`` connectors
    read), plus ``disagg`` (the spec's ``extra`` dict). One object for every rank, as in
    TensorRT-LLM: the rank comes from the runtime (``disagg.engine.runtime``)."""


def build_llm_args(cfg: EngineConfig, spec: ConnectorSpec | None) -> LlmArgs:
    windows = [cfg.max_seq_len if w is None else w for w in cfg.layer_windows]
    return LlmArgs(
        model=cfg.hub_model or cfg.model_name,
        backend="pytorch",
        kv_cache_config=KvCacheConfigLike(
            tokens_per_block=cfg.tokens_per_block,
            max_attention_window=windows,
            enable_block_reuse=cfg.enable_block_reuse,
            use_kv_cache_manager_v2=cfg.kv_manager == "v2",
            host_cache_size=None,
            disk_cache_size=None,
            enable_partial_reuse=False,
        ),
        kv_connector_config=None
        if spec is None
        else KvCacheConnectorConfigLike(
            connector_module=spec.module,
            connector_scheduler_class=spec.scheduler_class,
            connector_worker_class=spec.worker_class,
        ),
        max_seq_len=cfg.max_seq_len,
        max_num_tokens=cfg.max_num_tokens,
        max_batch_size=cfg.max_batch_size,
        max_beam_width=1,
        tensor_parallel_size=cfg.tp,
        pipeline_parallel_size=1,
        context_parallel_size=1,
        enable_attention_dp=False,
        speculative_config=None,
        cuda_graph_config=None,
        disable_overlap_scheduler=not cfg.overlap,
        dtype=cfg.dtype,
        disagg=dict(spec.extra) if spec is not None else {},
        engine_config=None if cfg.hub_model else cfg,
    )


def features_for(cfg: EngineConfig) -> RuntimeFeatures:
    """The TensorRT-LLM line this engine behaves as: the loaded connector package's own
    when TensorRT-LLM (or a source tree of it) is in use, else ``cfg.runtime``."""
    if USING_TRTLLM:
        feats = runtime.current()
    else:
        name = cfg.runtime or "main"
        feats = runtime.use_features(line=f"reference:{name}", **RUNTIMES[name])
    if cfg.kv_manager == "v2" and feats.grouped is None:
        raise ValueError(
            f"EngineConfig: the TensorRT-LLM line {feats.line} has no KV cache manager V2 "
            "connector path (no layer groups): use kv_manager='v1'"
        )
    return feats
