"""Expert switches: every ``DISAGG_*`` tuning variable, read and checked in one place.

Each field of ``Tuning`` is one switch; ``None`` means "the built-in default" (what that
default is depends on the host; each field's description says it). A config file's
``tuning:`` section sets them (``install``); an environment variable named in ``ENV``
overrides the config for its field. ``current()`` is what the code reads: it is cheap
(cached per environment snapshot), so planes may read it per push, and a test may change
the environment between two planes. ``sources()`` says where each set value came from.

A bad value is one ``TuningError`` line naming the variable (or config field), what it
holds and what it takes. An empty variable counts as unset.
"""

from __future__ import annotations

import os
import sys
import threading
import typing
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

# A float switch must be finite: ``gt=0`` alone lets ``inf`` through, and msgspec's bounds
# must themselves be finite.
_FLOAT_MAX = sys.float_info.max


class TuningError(ValueError):
    """A tuning value that is not of its switch's type (the message names the switch)."""


class Tuning(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Expert switches for A/B runs and hosts the defaults do not fit; null: the default.
    Defaults are the measured best; each switch's environment variable overrides it."""

    require_native: (
        Annotated[
            bool,
            Meta(
                description="a C helper that is not built is an import error instead of a "
                "slower fallback (CI sets it); default off"
            ),
        ]
        | None
    ) = None
    spin_us: (
        Annotated[
            int,
            Meta(
                ge=0,
                description="ipc plane: microseconds to busy-poll, GIL "
                "released, before blocking; ipc_spin_us wins over it; default 2000 on 8+ CPUs, "
                "0 below",
            ),
        ]
        | None
    ) = None
    stream_pipe: (
        Annotated[
            bool,
            Meta(
                description="tcp data plane (transport: tcp) on ipc://: pages >= 64 KiB through a vmsplice'd pipe; "
                "false on either side keeps the plain AF_UNIX stream; default on"
            ),
        ]
        | None
    ) = None
    stream_tcp_msg_bytes: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="tcp data plane (transport: tcp) on tcp://: payload bytes per batch message (at "
                "most 8 MiB); default 2097152",
            ),
        ]
        | None
    ) = None
    stream_tcp_sndbuf: (
        Annotated[
            bool,
            Meta(
                description="tcp data plane (transport: tcp) on tcp://: the sender asks for a 4 MiB send buffer "
                "where net.core.wmem_max allows it; false keeps the kernel's autotuning; "
                "default on"
            ),
        ]
        | None
    ) = None
    ipc_parts: (
        Annotated[
            tuple[Annotated[int, Meta(ge=0)], ...],
            Meta(
                description="ipc plane sender: page counts of the leading parts a large device "
                "push is cut into (0: never cut); default: pushes of 12288+ pages leave as "
                "their first half (at most 8192 pages) and the rest",
                examples=[[4096]],
            ),
        ]
        | None
    ) = None
    ucx_iov: (
        Annotated[
            bool,
            Meta(
                description="UCX: scatter-gather (iov) sends and receives at all; false "
                "gathers into the send ring; default on"
            ),
        ]
        | None
    ) = None
    ucx_rma: (
        Annotated[
            bool,
            Meta(
                description="UCX on shm: the consumer reads the producer's store one-sided; "
                "false keeps tag messages; default on"
            ),
        ]
        | None
    ) = None
    ucx_rma_readers: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="UCX on shm: threads (each with its own UCX worker) that copy "
                "a consumer's one-sided reads; the config key ucx_rma_readers wins over it; "
                "default 2 on 2+ CPUs, else 1",
            ),
        ]
        | None
    ) = None
    ucx_mapped: (
        Annotated[
            bool,
            Meta(
                description="UCX on shm: the consumer copies from a mapping of the producer's "
                "UCX-allocated store; false (either side) keeps the one-sided reads; default on"
            ),
        ]
        | None
    ) = None
    ucx_cma_guard: (
        Annotated[
            bool,
            Meta(
                description="UCX: a failed cma read or write (the peer died) fails that request "
                "instead of UCX aborting this process; false restores UCX's abort; default on"
            ),
        ]
        | None
    ) = None
    ucx_tcp_iov: (
        Annotated[
            bool,
            Meta(
                description="UCX tcp sender: scattered store rows leave as one iov message per "
                "2 MiB segment; default: on where the context has large tcp segments (the "
                "hardened tcp settings)"
            ),
        ]
        | None
    ) = None
    ucx_tcp_iov_recv: (
        Annotated[
            bool,
            Meta(
                description="UCX tcp receiver: each packed segment for host slots is one iov "
                "receive straight into the slots; default: on under the hardened tcp settings"
            ),
        ]
        | None
    ) = None
    gil_switch_us: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=1_000_000,
                description="a connector lowers Python's thread switch interval to this many "
                "microseconds (never raises it) when it registers the KV cache, so the data "
                "plane's threads get the GIL from an engine loop that polls for loads; 0 "
                "leaves the interpreter's (5000); default 500",
            ),
        ]
        | None
    ) = None
    save_stream: (
        Annotated[
            bool,
            Meta(
                description="producer on CUDA: a pass's save copies run on a stream of their "
                "own, each layer's after that layer's compute, so sampling and the next "
                "layers do not wait behind them; false enqueues them on the forward stream; "
                "default on"
            ),
        ]
        | None
    ) = None
    save_plan_layers: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=4096,
                description="producer: a pass's save copies are planned (copy indices placed) at "
                "the save of this many layers, the layers before copied right after it and "
                "each later one as it is saved (never before the rows are reserved: "
                "save_reserve_layers); default 0: every layer's copy after the pass's last "
                "layer (least host work between layers)",
            ),
        ]
        | None
    ) = None
    save_reserve_layers: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=4096,
                description="producer: a pass's store rows are reserved (dedup, evict, drop) "
                "at the save of this many layers, so a prefetch's lease can be granted while "
                "the pass runs; default 0: at the pass's end (with save_after_responses, "
                "after the first token is sent)",
            ),
        ]
        | None
    ) = None
    save_after_responses: (
        Annotated[
            bool,
            Meta(
                description="producer: a pass's store copies (and its reservation, with "
                "save_reserve_layers 0) are enqueued in get_finished, after the iteration's "
                "responses, so the first token is not sent behind their host work; false: "
                "in wait_for_save, before sampling; default on",
            ),
        ]
        | None
    ) = None
    save_whole_pass: (
        Annotated[
            bool,
            Meta(
                description="producer: a pass copied at its end, every layer saved, is "
                "copied whole (one indexed copy per region, one kernel on CUDA); false: a "
                "layer at a time (a gather and a copy per buffer span and layer); default on",
            ),
        ]
        | None
    ) = None
    engine_idle_wait_us: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=100_000,
                description="reference engine: an iteration that ran no forward and ended "
                "nothing (every request waits on the connector) sleeps this many "
                "microseconds, so the connector's threads get the GIL at once instead of "
                "after the thread switch interval; 0 spins; default 100",
            ),
        ]
        | None
    ) = None
    uvloop: (
        Annotated[
            bool,
            Meta(
                description="HTTP servers (serve, proxy) run on uvloop's event loop where it "
                "is installed (a dependency off Windows): each hop of a request costs less loop time "
                "than on asyncio's; false: asyncio's; default on",
            ),
        ]
        | None
    ) = None
    gc_freeze: (
        Annotated[
            bool,
            Meta(
                description="HTTP servers (serve, proxy): once started, collect and freeze "
                "the heap (``gc.freeze``), so a full collection no longer walks the "
                "start-up's objects (torch, the model: 80-130 ms a collection, GIL held, on "
                "the H200's host); false: Python's default; default on",
            ),
        ]
        | None
    ) = None
    tp_hang_timeout_s: (
        Annotated[
            float,
            Meta(
                gt=0,
                le=_FLOAT_MAX,
                extra={"unit": "seconds"},
                description="reference engine, MPI mode: a rank waiting this long on the others "
                "raises RankHangError; read when the rank's communicator is made, before a "
                "connector loads its config, so set it by its variable; default 120",
            ),
        ]
        | None
    ) = None


# field -> environment variable that overrides it
ENV: dict[str, str] = {name: "DISAGG_" + name.upper() for name in Tuning.__struct_fields__}

_HINTS: dict[str, Any] = {
    name: hint
    for name, hint in typing.get_type_hints(Tuning, include_extras=True).items()
    if name in ENV
}

_lock = threading.Lock()
_installed = Tuning()
_cache: tuple[tuple[Any, ...], Tuning] | None = None


def _type(name: str) -> mi.Type:
    """The schema type of switch ``name`` without its ``None``."""
    t = mi.type_info(_HINTS[name])
    assert isinstance(t, mi.UnionType)
    return next(x for x in t.types if not isinstance(x, mi.NoneType))


def _bare(name: str) -> mi.Type:
    t = _type(name)
    return t.type if isinstance(t, mi.Metadata) else t


def takes(name: str) -> str:
    """What the environment variable of switch ``name`` takes, in words."""
    from .config.errors import describe  # disagg.config imports this module

    bare = _bare(name)
    if isinstance(bare, mi.BoolType):
        return "0 or 1"
    if isinstance(bare, mi.VarTupleType):
        return f"comma-separated page counts, each {describe(bare.item_type)}, e.g. 2048,4096"
    return describe(_type(name))


def _checked(name: str, value: Any, shown: str) -> Any:
    try:
        return msgspec.convert(value, _HINTS[name])
    except msgspec.ValidationError:
        raise TuningError(f"{shown}: expected {takes(name)}") from None


def _parse(name: str, raw: str) -> Any:
    """One environment value for field ``name``; TuningError names the variable."""
    text = raw.strip()
    if text == "":
        return None
    bare = _bare(name)
    value: Any = text  # what does not parse stays text, which _checked refuses by name
    try:
        if isinstance(bare, mi.BoolType):
            value = {"0": False, "1": True}.get(text, text)
        elif isinstance(bare, mi.IntType):
            value = int(text)
        elif isinstance(bare, mi.FloatType):
            value = float(text)
        elif isinstance(bare, mi.VarTupleType):
            value = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        pass
    return _checked(name, value, f"{ENV[name]}={raw!r}")


def check(section: Tuning) -> Tuning:
    """``section`` with every switch checked (a ``Tuning`` built in code is not)."""
    for name in ENV:
        value = getattr(section, name)
        if value is not None:
            _checked(name, value, f"tuning.{name}={value!r}")
    return section


def from_env(environ: Mapping[str, str] | None = None, base: Tuning | None = None) -> Tuning:
    """``base`` (default: no switches set) with every ``DISAGG_*`` variable applied."""
    env = os.environ if environ is None else environ
    base = Tuning() if base is None else base
    changes = {name: _parse(name, env[var]) for name, var in ENV.items() if var in env}
    changes = {k: v for k, v in changes.items() if v is not None}
    return msgspec.structs.replace(base, **changes)


def install(section: Tuning) -> None:
    """Make a config's ``tuning:`` section the base under the environment's overrides."""
    global _installed, _cache
    check(section)
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
