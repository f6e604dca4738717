"""Expert switches: every ``DISAGG_*`` tuning variable, read and checked in one place.

Each field of ``Tuning`` is one switch; ``None`` means "the built-in default" (what that
default is depends on the host and is documented where the switch is used). A config
file's ``tuning:`` section sets them (``install``); an environment variable named in
``ENV`` overrides the config for its field. ``current()`` is what the code reads: it is
cheap (cached per environment snapshot), so planes may read it per push, and a test may
change the environment between two planes.

A bad value is one ``TuningError`` line naming the variable (or config field), what it
holds and what it takes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import msgspec


class TuningError(ValueError):
    """A tuning value that is not of its switch's type (the message names the switch)."""


class Tuning(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Expert switches for A/B runs and hosts the defaults do not fit. ``None``: default."""

    require_native: bool | None = None  # fail at import when a C helper is not built
    spin_us: int | None = None  # ipc/stream receivers: busy-poll this long before blocking
    stream_pipe: bool | None = None  # tcp plane, same host: offer and accept the pipe
    stream_tcp_msg_bytes: int | None = None  # tcp plane: payload per batch over TCP
    stream_tcp_sndbuf: bool | None = None  # tcp plane: ask for a 4 MiB TCP send buffer
    ipc_parts: tuple[int, ...] | None = None  # ipc plane: leading part sizes in pages
    ucx_iov: bool | None = None  # UCX: scatter-gather (iov) sends and receives at all
    ucx_rma: bool | None = None  # UCX: one-sided reads of store rows
    ucx_rma_readers: int | None = None  # UCX: threads reading one RMA batch
    ucx_mapped: bool | None = None  # UCX shm: copy from a mapped producer store
    ucx_cma_guard: bool | None = None  # UCX: turn UCX's abort on a failed CMA copy into an error
    ucx_tcp_iov: bool | None = None  # UCX tcp: iov sends of store rows
    ucx_tcp_iov_recv: bool | None = None  # UCX tcp: iov receives straight into host slots
    tp_hang_timeout_s: float | None = None  # reference engine MPI: a rank waits this long


# field -> environment variable that overrides it
ENV: dict[str, str] = {name: "DISAGG_" + name.upper() for name in Tuning.__struct_fields__}

_MINIMUM: dict[str, float] = {
    "spin_us": 0,
    "stream_tcp_msg_bytes": 1,
    "ucx_rma_readers": 1,
    "tp_hang_timeout_s": 1e-9,
}

_lock = threading.Lock()
_installed = Tuning()
_cache: tuple[tuple[Any, ...], Tuning] | None = None


def _kind(name: str) -> str:
    hint = Tuning.__annotations__[name]
    for kind in ("tuple", "bool", "int", "float"):
        if kind in str(hint):
            return kind
    raise AssertionError(name)


def _parse(name: str, raw: str) -> Any:
    """One environment value for field ``name``; TuningError names the variable."""
    var, text, kind = ENV[name], raw.strip(), _kind(name)
    if text == "":
        return None
    try:
        if kind == "bool":
            if text not in ("0", "1"):
                raise ValueError
            return text == "1"
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        takes = {
            "bool": "0 or 1",
            "int": "an integer",
            "float": "a number",
            "tuple": "comma-separated page counts, e.g. 2048,4096",
        }[kind]
        raise TuningError(f"{var}={raw!r}: expected {takes}") from None


def _check(t: Tuning, where: Mapping[str, str]) -> Tuning:
    for name, low in _MINIMUM.items():
        value = getattr(t, name)
        if value is not None and value < low:
            raise TuningError(f"{where[name]}={value!r}: must be >= {low:g}")
    if t.ipc_parts is not None and any(n < 0 for n in t.ipc_parts):
        raise TuningError(f"{where['ipc_parts']}={t.ipc_parts!r}: page counts must be >= 0")
    return t


def from_env(environ: Mapping[str, str] | None = None, base: Tuning | None = None) -> Tuning:
    """``base`` (default: no switches set) with every ``DISAGG_*`` variable applied."""
    env = os.environ if environ is None else environ
    base = Tuning() if base is None else base
    changes = {name: _parse(name, env[var]) for name, var in ENV.items() if var in env}
    changes = {k: v for k, v in changes.items() if v is not None}
    where = {name: ENV[name] if name in changes else f"tuning.{name}" for name in ENV}
    return _check(msgspec.structs.replace(base, **changes), where)


def install(section: Tuning) -> None:
    """Make a config's ``tuning:`` section the base under the environment's overrides."""
    global _installed, _cache
    _check(section, {name: f"tuning.{name}" for name in ENV})
    with _lock:
        _installed, _cache = section, None


def current() -> Tuning:
    """The switches in force: the installed config section, overridden by the environment."""
    global _cache
    snapshot = (_installed, *(os.environ.get(var) for var in ENV.values()))
    cached = _cache
    if cached is not None and cached[0] == snapshot:
        return cached[1]
    value = from_env(base=_installed)
    with _lock:
        _cache = (snapshot, value)
    return value


def sources() -> dict[str, tuple[Any, str]]:
    """Each set switch's value and where it came from (``config`` or the variable)."""
    now = current()
    out: dict[str, tuple[Any, str]] = {}
    for name, var in ENV.items():
        value = getattr(now, name)
        if value is not None:
            out[name] = (value, var if os.environ.get(var, "").strip() else "config")
    return out
