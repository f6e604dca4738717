"""Finding and reading an instance's config file.

``load_config(path)`` reads ``path`` when given; otherwise the file named by
``$TRTLLM_DISAGG_CONFIG``, then ``$DISAGG_CONFIG`` (an empty variable counts as unset).
TensorRT-LLM forwards only ``TRTLLM*``/``TLLM*`` variables to the MPI workers it spawns, so
a connector inside ``trtllm-serve`` is pointed at its file through ``TRTLLM_DISAGG_CONFIG``.
The format is picked by extension: ``.yaml``/``.yml`` or ``.toml``. Every error is a
:class:`ConfigError` whose message starts with the file, then the field's dotted path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .schema import DisaggConfig

ENV_VARS: tuple[str, ...] = ("TRTLLM_DISAGG_CONFIG", "DISAGG_CONFIG")


def find_config_path(path: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """Return ``(path, where it came from)``: the argument, else ``$TRTLLM_DISAGG_CONFIG``,
    else ``$DISAGG_CONFIG``."""
    if path is not None:
        return Path(path), "argument"
    for var in ENV_VARS:
        value = os.environ.get(var)
        if value:
            return Path(value), f"${var}"
    raise ConfigError(
        "no config file: pass a path or set TRTLLM_DISAGG_CONFIG (inside trtllm-serve, only "
        "TRTLLM*/TLLM* variables reach the workers) or DISAGG_CONFIG"
    )


def read_file(path: Path, origin: str) -> Any:
    """The parsed contents of a YAML or TOML config file (not yet validated)."""
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError(
            f"{path} (from {origin}): unknown config format '{suffix or '(none)'}'; "
            "name the file *.yaml, *.yml or *.toml"
        )
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path} (from {origin}): file not found; check the path") from None
    except OSError as e:
        raise ConfigError(f"{path} (from {origin}): cannot read: {e}") from None
    if suffix == ".toml":
        try:
            import tomllib  # type: ignore[import-not-found]
        except ModuleNotFoundError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ModuleNotFoundError:
                raise ConfigError(
                    f"{path}: reading TOML needs Python 3.11+ or `pip install tomli`; "
                    "or write the file as YAML"
                ) from None
        try:
            return tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    import yaml

    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty; it needs at least role: and its section")
    return data


def load_config(path: str | os.PathLike[str] | None = None) -> DisaggConfig:
    """Find, read and validate the instance's config file (see the module docstring)."""
    p, origin = find_config_path(path)
    data = read_file(p, origin)
    try:
        return DisaggConfig.from_dict(data, base_dir=p.resolve().parent, source=str(p))
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}", e.field) from None
