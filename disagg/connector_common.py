"""What both connector roles need from the engine's world: their config and a request's tokens."""

from __future__ import annotations

from typing import Any

from . import tuning
from .config import ConfigError, DisaggConfig, load_config


def resolve_config(llm_args: Any, role: str) -> DisaggConfig:
    """The instance's config: ``llm_args.disagg_config`` or ``llm_args.disagg["config"]`` (a
    DisaggConfig, dict or path: how the reference engine passes it), else the file named by ``TRTLLM_DISAGG_CONFIG``
    / ``DISAGG_CONFIG`` (TensorRT-LLM forwards only ``TRTLLM*`` variables to its workers).
    Its ``tuning:`` section becomes this process's switches (``tuning.install``)."""
    extra = getattr(llm_args, "disagg", None) or {}
    given = getattr(llm_args, "disagg_config", None) or extra.get("config")
    if isinstance(given, DisaggConfig):
        cfg = given
    elif isinstance(given, dict):
        cfg = DisaggConfig.from_dict(given)
    elif given:
        cfg = load_config(str(given))
    else:
        cfg = load_config()
    if cfg.role != role:
        raise ConfigError(
            f"role: this is the {role} connector but the config says role={cfg.role!r}; point "
            f"TRTLLM_DISAGG_CONFIG at a {role} config or load the {cfg.role} connector classes"
        )
    tuning.install(cfg.tuning)
    tuning.current()  # a bad DISAGG_* value fails the connector here, by name
    return cfg


def request_tokens(request: Any) -> list[int]:
    """The prompt tokens of an engine request (beam 0)."""
    tokens = request.get_tokens(0)
    prompt_len = getattr(request, "prompt_len", None)
    return list(tokens if prompt_len is None else tokens[:prompt_len])
