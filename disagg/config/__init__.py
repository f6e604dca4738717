"""One configuration file per disagg instance (YAML or TOML), validated on load.

The schema is :mod:`disagg.config.schema` (msgspec Structs: each field's type, range and
description); ``docs/configuration.md`` is generated from it (``disagg config reference``).
Where the file is found and read: :mod:`disagg.config.load`. Unknown keys are refused, and
every error is a :class:`ConfigError` (a ``ValueError``) whose one-line message starts with
the field's dotted path (``consumer.claim_timeout_s``), says what is wrong, and how to fix
it (:mod:`disagg.config.errors`). ``disagg config check FILE`` validates a file and prints it
normalised with the tuning switches in force (:mod:`disagg.config.check`).

The ``tuning:`` section is :class:`disagg.tuning.Tuning`: a service that starts from a config
installs it (``tuning.install``) under the ``DISAGG_*`` environment overrides.
"""

from ..tuning import Tuning, TuningError
from .errors import ConfigError
from .load import ENV_VARS, find_config_path, load_config
from .schema import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_TRANSPORT,
    LOAD_FAILURE_POLICIES,
    LOAD_MODES,
    RENAMED_TRANSPORTS,
    ROLES,
    STORE_DEVICES,
    TRANSPORTS,
    UCX_CHANNELS,
    ConsumerConfig,
    DisaggConfig,
    MetricsConfig,
    ProducerConfig,
    SecurityConfig,
)
from .trtllm import check_llm_api_options, trtllm_llm_api_options
from .values import Endpoint, parse_endpoint, parse_size, read_curve_key, store_device_for

__all__ = [
    "ENV_VARS",
    "ROLES",
    "TRANSPORTS",
    "RENAMED_TRANSPORTS",
    "DEFAULT_TRANSPORT",
    "UCX_CHANNELS",
    "STORE_DEVICES",
    "store_device_for",
    "LOAD_FAILURE_POLICIES",
    "LOAD_MODES",
    "DEFAULT_HEARTBEAT_S",
    "ConfigError",
    "Endpoint",
    "ProducerConfig",
    "ConsumerConfig",
    "SecurityConfig",
    "MetricsConfig",
    "DisaggConfig",
    "Tuning",
    "TuningError",
    "find_config_path",
    "load_config",
    "parse_size",
    "parse_endpoint",
    "read_curve_key",
    "trtllm_llm_api_options",
    "check_llm_api_options",
]
