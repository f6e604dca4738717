"""One configuration file per disagg instance (YAML or TOML), validated on load.

Where the file is found
    ``load_config(path)`` reads ``path`` when given; otherwise the file named by the
    environment variable ``TRTLLM_DISAGG_CONFIG``, then ``DISAGG_CONFIG``. TensorRT-LLM
    forwards only ``TRTLLM*``/``TLLM*`` variables to the MPI workers it spawns, so a
    connector running inside ``trtllm-serve`` should be pointed at its file through
    ``TRTLLM_DISAGG_CONFIG``. The format is picked by extension: ``.yaml``/``.yml`` or
    ``.toml``. Relative file paths inside the file (key files) are resolved against the
    file's directory.

Schema (all sections are plain mappings; unknown keys are refused)::

    role: producer | consumer                # required
    instance_id: str                         # default "<role>-<hostname>-<pid>"
    model_id: str | null                     # overrides the model fingerprint source
    transport: zmq | ucx | ipc               # data plane, default zmq (ipc: one host only)
    transport_checksum: false                # zmq only: xxh3-64 over every payload, checked
                                             # at the receiver (both ends must set it)
    ucx_channel: tcp | shm | auto            # ucx only, default tcp; shm: producer and
                                             # consumer on one host (one-sided reads of the
                                             # producer's store; worker-address endpoints)
    ucx_rma_readers: int | null              # ucx shm consumer: threads copying its reads,
                                             # default $DISAGG_UCX_RMA_READERS, else 2 on 2+ CPUs
    ipc_spin_us: int | null                  # ipc only: microseconds its threads spin (GIL
                                             # released) for the next message before they
                                             # sleep; default $DISAGG_SPIN_US, else 2000 on
                                             # hosts with 8+ CPUs, 0 (off) below
    producer:                                # required when role = producer, refused otherwise
      control: endpoint to bind              # default tcp://127.0.0.1:0
      events: endpoint to bind | null        # stored/removed event stream (PUB), default off
      advertise_host: str | null             # host peers use to reach wildcard binds
      store_size: size                       # required: 4GiB, 512MiB, 1048576 (bytes)
      store_device: cpu | pinned | cuda      # default cpu
      lease_ttl_s: 30
      owner_dead_after_s: 15                 # default 3 x the default heartbeat (5 s)
      lease_max_hold_s: 600                  # no lease outlives this, renewed or not
      save_timeout_s: 30
      push_timeout_s: 30
    consumer:                                # required when role = consumer, refused otherwise
      producers: [endpoint, ...]             # required, >= 1, tcp://host:port or ipc://path;
                                             # TP > 1: rank r of a producer is at port + r,
                                             # or list its ranks: [[rank0_ep, rank1_ep], ...]
      data: endpoint to bind                 # incoming pages, default tcp://127.0.0.1:0
      advertise_host: str | null             # host producers use to reach a wildcard bind
      load_mode: auto | async | sync         # default auto (async where safe, see below)
      on_load_failure: auto | fail_request | stop_instance   # default auto (see below)
      claim_timeout_s: 1.0
      load_timeout_s: 30
      heartbeat_s: 5                         # must be < lease_ttl_s
      lease_ttl_s: 30
    security:                                # optional, ZMQ CURVE (files from `disagg keys`)
      curve_secret_key_file: path            # this instance's key pair (both or neither)
      curve_public_key_file: path
      server_public_key: Z85 key | path      # consumer: the producers' public key
      allowed_client_keys: [Z85 key | path]  # producer: consumers allowed to connect
    metrics:
      port: int | null                       # Prometheus port for the connector, default off
      host: str                              # its bind address, default 127.0.0.1 (loopback);
                                             # 0.0.0.0 for every interface

Every error is a :class:`ConfigError` (a ``ValueError``) whose message starts with the
dotted path of the field (``consumer.claim_timeout_s``) and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ENV_VARS",
    "ROLES",
    "TRANSPORTS",
    "UCX_CHANNELS",
    "STORE_DEVICES",
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
    "find_config_path",
    "load_config",
    "parse_size",
    "parse_endpoint",
    "read_curve_key",
    "trtllm_llm_api_options",
    "check_llm_api_options",
]

ENV_VARS: tuple[str, ...] = ("TRTLLM_DISAGG_CONFIG", "DISAGG_CONFIG")
ROLES: tuple[str, ...] = ("producer", "consumer")
TRANSPORTS: tuple[str, ...] = ("zmq", "ucx", "ipc")
UCX_CHANNELS: tuple[str, ...] = ("tcp", "shm", "auto")
STORE_DEVICES: tuple[str, ...] = ("cpu", "pinned", "cuda")
# auto: async where the runtime keeps a cancelled request's pages while its load is
# pending (TensorRT-LLM lines with has_pending_transfers), else sync (layer by layer)
LOAD_MODES: tuple[str, ...] = ("auto", "async", "sync")
# What a failed load does (after the claim: the tokens were already offered). fail_request:
# that request ends with an error naming it. stop_instance: the engine stops (an error
# TensorRT-LLM treats as fatal). auto: stop_instance where the engine would keep the
# request's unfilled pages for reuse (V1 KV cache manager with block reuse on: its
# releaseBlocks stores every prompt block of a released request), else fail_request.
LOAD_FAILURE_POLICIES: tuple[str, ...] = ("auto", "fail_request", "stop_instance")
DEFAULT_HEARTBEAT_S = 5.0


class ConfigError(ValueError):
    """A configuration problem; the message names the field (dotted path) and the fix."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


# --------------------------------------------------------------------------- helpers


def _err(field_: str, message: str) -> ConfigError:
    return ConfigError(f"{field_}: {message}", field_)


def _unknown_keys(data: Mapping[str, Any], valid: list[str], prefix: str) -> None:
    for key in data:
        if key in valid:
            continue
        name = f"{prefix}{key}"
        if not isinstance(key, str):
            raise _err(name, f"keys must be strings; valid keys here: {', '.join(valid)}")
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = (
            f"did you mean '{close[0]}'?"
            if close
            else f"valid keys here: {', '.join(sorted(valid))}"
        )
        raise _err(name, f"unknown key '{key}'; {hint}")


def _choice(value: Any, choices: tuple[str, ...], field_: str) -> str:
    if not isinstance(value, str) or value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise _err(
            field_,
            f"unknown value {value!r}{hint}; valid values: {', '.join(choices)}",
        )
    return value


def _seconds(value: Any, field_: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(
            field_, f"must be a number of seconds > 0, got {value!r}; write e.g. {field_} = 30"
        )
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise _err(field_, f"must be a number of seconds > 0, got {value!r}")
    return value


def _opt_str(value: Any, field_: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _err(field_, f"must be a non-empty string, got {value!r}")
    return value


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_BINARY_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_AMBIGUOUS_UNITS = {
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
}


def parse_size(text: Any, field: str = "size") -> int:
    """Parse a byte size: an int, ``"1048576"``, or a binary unit (``KiB``, ``MiB``, ``GiB``,
    ``TiB``; case-insensitive, ``"1.5GiB"`` allowed when it is a whole number of bytes).

    ``"4GB"``/``"4G"`` are refused as ambiguous (decimal or binary?); the message names
    both spellings that mean something exact.
    """
    if isinstance(text, bool):
        raise _err(field, f"must be a size such as 4GiB or a number of bytes, got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise _err(field, f"must be > 0 bytes, got {text}")
        return text
    if not isinstance(text, str):
        raise _err(field, f"must be a size such as 4GiB or a number of bytes, got {text!r}")
    m = _SIZE_RE.match(text)
    if not m:
        raise _err(
            field,
            f"cannot parse size {text!r}; write e.g. 4GiB, 512MiB or 1048576 (bytes)",
        )
    number, unit = m.group(1), m.group(2).lower()
    if unit in _AMBIGUOUS_UNITS:
        binary = f"{number}{unit[0].upper()}iB"
        decimal = float(number) * _AMBIGUOUS_UNITS[unit]
        dec_text = str(int(decimal)) if decimal == int(decimal) else str(decimal)
        raise ConfigError(
            f"{field} {text!r} is ambiguous: write {binary} (binary) or {dec_text} (bytes)",
            field,
        )
    if unit not in _BINARY_UNITS:
        raise _err(
            field,
            f"unknown size unit {m.group(2)!r} in {text!r}; use B, KiB, MiB, GiB or TiB",
        )
    value = (
        float(number) * _BINARY_UNITS[unit] if "." in number else int(number) * _BINARY_UNITS[unit]
    )
    if value != int(value):
        raise _err(field, f"{text!r} is not a whole number of bytes")
    value = int(value)
    if value <= 0:
        raise _err(field, f"must be > 0 bytes, got {text!r}")
    return value


@dataclass(frozen=True)
class Endpoint:
    """A parsed ZMQ-style endpoint: ``tcp://host:port``, ``ipc://path``, ``inproc://name``."""

    scheme: str
    host: str | None = None
    port: int | None = None
    path: str | None = None

    @property
    def url(self) -> str:
        if self.scheme == "tcp":
            host = f"[{self.host}]" if self.host and ":" in self.host else self.host
            return f"tcp://{host}:{self.port}"
        return f"{self.scheme}://{self.path}"

    def __str__(self) -> str:
        return self.url


_HOST_RE = re.compile(r"^(\*|[A-Za-z0-9_]([A-Za-z0-9_.\-]*[A-Za-z0-9_])?)$")


def parse_endpoint(
    text: Any,
    field: str = "endpoint",
    *,
    schemes: tuple[str, ...] = ("tcp", "ipc", "inproc"),
    connect: bool = False,
) -> Endpoint:
    """Parse and check an endpoint. ``connect=True`` also refuses what cannot be connected
    to (a wildcard host, port 0)."""
    example = "tcp://10.0.0.1:5557" if connect else "tcp://0.0.0.0:5557"
    if not isinstance(text, str) or "://" not in text:
        raise _err(
            field,
            f"bad endpoint {text!r}: write {' or '.join(s + '://...' for s in schemes)}, "
            f"e.g. {example}",
        )
    scheme, rest = text.split("://", 1)
    if scheme not in schemes:
        raise _err(
            field,
            f"bad endpoint {text!r}: scheme '{scheme}' is not one of {', '.join(schemes)}; "
            f"e.g. {example}",
        )
    if scheme in ("ipc", "inproc"):
        if not rest:
            raise _err(field, f"bad endpoint {text!r}: {scheme}:// needs a path or name")
        return Endpoint(scheme=scheme, path=rest)
    # tcp
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0 or rest[close + 1 : close + 2] != ":":
            raise _err(field, f"bad endpoint {text!r}: write tcp://[ipv6]:port")
        host, port_text = rest[1:close], rest[close + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _err(field, f"bad endpoint {text!r}: '{host}' is not an IPv6 address") from None
    else:
        if ":" not in rest:
            raise _err(field, f"bad endpoint {text!r}: tcp needs host:port, e.g. {example}")
        host, port_text = rest.rsplit(":", 1)
        if not host or not _HOST_RE.match(host):
            raise _err(
                field, f"bad endpoint {text!r}: '{host}' is not a valid host, e.g. {example}"
            )
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise _err(field, f"bad endpoint {text!r}: port '{port_text}' must be a number 0-65535")
    port = int(port_text)
    if connect:
        if host in ("*", "0.0.0.0", "::"):
            raise _err(
                field,
                f"bad endpoint {text!r}: cannot connect to the wildcard host '{host}'; "
                "write the peer's address",
            )
        if port == 0:
            raise _err(
                field,
                f"bad endpoint {text!r}: port 0 cannot be connected to; write the peer's "
                "actual port",
            )
    return Endpoint(scheme="tcp", host=host, port=port)


# --------------------------------------------------------------------------- CURVE keys

_Z85_RE = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_ZPL_KEY_RE = re.compile(r"^\s*(public|secret)-key\s*=\s*\"?([^\"\s]+)\"?\s*$", re.M)


def _looks_like_z85(text: str) -> bool:
    return bool(_Z85_RE.match(text))


def read_curve_key(path: str | os.PathLike[str], kind: str = "public") -> bytes:
    """Read a Z85 CURVE key from a file written by ``disagg keys`` (or by
    ``zmq.auth.create_certificates``: ZPL ``public-key = "..."`` lines), or a file that holds
    only the 40-character key. ``kind`` is ``"public"`` or ``"secret"``."""
    text = Path(path).read_text()
    found = dict((k, v) for k, v in _ZPL_KEY_RE.findall(text))
    if found:
        if kind not in found:
            raise ConfigError(f"{path}: no {kind}-key line in this key file")
        key = found[kind]
    else:
        key = text.strip()
    if not _Z85_RE.match(key):
        raise ConfigError(
            f"{path}: not a Z85 CURVE key (40 characters); make one with `disagg keys`"
        )
    return key.encode("ascii")


# --------------------------------------------------------------------------- sections


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class ProducerConfig:
    """Section ``producer`` (role = producer)."""

    store_size: int
    control: str = "tcp://127.0.0.1:0"
    events: str | None = None
    advertise_host: str | None = None
    store_device: str = "cpu"
    lease_ttl_s: float = 30.0
    owner_dead_after_s: float | None = None  # resolved to 3 x DEFAULT_HEARTBEAT_S
    lease_max_hold_s: float = 600.0
    save_timeout_s: float = 30.0
    push_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        p = "producer."
        _set(self, "store_size", parse_size(self.store_size, p + "store_size"))
        _set(self, "control", parse_endpoint(self.control, p + "control").url)
        if self.events is not None:
            _set(self, "events", parse_endpoint(self.events, p + "events").url)
        _set(self, "advertise_host", _opt_str(self.advertise_host, p + "advertise_host"))
        _choice(self.store_device, STORE_DEVICES, p + "store_device")
        for name in ("lease_ttl_s", "lease_max_hold_s", "save_timeout_s", "push_timeout_s"):
            _set(self, name, _seconds(getattr(self, name), p + name))
        if self.lease_max_hold_s < self.lease_ttl_s:
            raise _err(
                p + "lease_max_hold_s",
                f"{self.lease_max_hold_s} s is shorter than {p}lease_ttl_s "
                f"({self.lease_ttl_s} s): raise it (default 600) or lower lease_ttl_s",
            )
        if self.owner_dead_after_s is None:
            _set(self, "owner_dead_after_s", 3 * DEFAULT_HEARTBEAT_S)
        else:
            _set(
                self,
                "owner_dead_after_s",
                _seconds(self.owner_dead_after_s, p + "owner_dead_after_s"),
            )


@dataclass(frozen=True)
class ConsumerConfig:
    """Section ``consumer`` (role = consumer)."""

    # One entry per producer instance: its rank-0 control endpoint (rank r at port + r,
    # ``service_base.rank_endpoint``), or a tuple of its ranks' endpoints in rank order.
    producers: tuple[str | tuple[str, ...], ...]
    data: str = "tcp://127.0.0.1:0"
    advertise_host: str | None = None
    load_mode: str = "auto"
    on_load_failure: str = "auto"
    claim_timeout_s: float = 1.0
    load_timeout_s: float = 30.0
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    lease_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        p = "consumer."
        producers = self.producers
        if isinstance(producers, str):
            producers = (producers,)
        if not isinstance(producers, (list, tuple)) or not producers:
            raise _err(
                p + "producers",
                "needs at least one producer control endpoint, "
                "e.g. producers: [tcp://prefill-0:5557]",
            )
        urls: list[str | tuple[str, ...]] = []
        flat: list[str] = []
        for i, ep in enumerate(producers):
            if isinstance(ep, (list, tuple)):  # one producer's TP ranks, in rank order
                if not ep:
                    raise _err(
                        f"{p}producers[{i}]",
                        "an empty list: list the producer's rank endpoints in rank order",
                    )
                ranks = tuple(
                    parse_endpoint(
                        e, f"{p}producers[{i}][{r}]", schemes=("tcp", "ipc"), connect=True
                    ).url
                    for r, e in enumerate(ep)
                )
                urls.append(ranks)
                flat.extend(ranks)
            else:
                url = parse_endpoint(
                    ep, f"{p}producers[{i}]", schemes=("tcp", "ipc"), connect=True
                ).url
                urls.append(url)
                flat.append(url)
        if len(set(flat)) != len(flat):
            dup = next(u for u in flat if flat.count(u) > 1)
            raise _err(p + "producers", f"{dup!r} is listed twice; list each producer once")
        _set(self, "producers", tuple(urls))
        _set(self, "data", parse_endpoint(self.data, p + "data").url)
        _set(self, "advertise_host", _opt_str(self.advertise_host, p + "advertise_host"))
        _choice(self.load_mode, LOAD_MODES, p + "load_mode")
        _choice(self.on_load_failure, LOAD_FAILURE_POLICIES, p + "on_load_failure")
        for name in ("claim_timeout_s", "load_timeout_s", "heartbeat_s", "lease_ttl_s"):
            _set(self, name, _seconds(getattr(self, name), p + name))
        if self.heartbeat_s >= self.lease_ttl_s:
            raise _err(
                p + "heartbeat_s",
                f"{self.heartbeat_s} s must be shorter than consumer.lease_ttl_s "
                f"({self.lease_ttl_s} s), or leases expire between heartbeats; "
                f"e.g. heartbeat_s = {self.lease_ttl_s / 6:g}",
            )


@dataclass(frozen=True)
class SecurityConfig:
    """Section ``security``: ZMQ CURVE settings. Files are checked to exist and to hold keys;
    the keys are used by the transport. Paths are absolute after loading."""

    curve_secret_key_file: str | None = None
    curve_public_key_file: str | None = None
    server_public_key: str | None = None
    allowed_client_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        p = "security."
        for name, kind in (
            ("curve_secret_key_file", "secret"),
            ("curve_public_key_file", "public"),
        ):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise _err(p + name, f"must be a file path, got {value!r}")
            if not os.path.isfile(value):
                raise _err(
                    p + name,
                    f"file {value!r} does not exist; create a key pair with "
                    "`disagg keys NAME --dir DIR`",
                )
            try:
                read_curve_key(value, kind)
            except (ConfigError, OSError, UnicodeDecodeError) as e:
                raise _err(p + name, str(e)) from None
        if (self.curve_secret_key_file is None) != (self.curve_public_key_file is None):
            missing = (
                "curve_public_key_file"
                if self.curve_public_key_file is None
                else "curve_secret_key_file"
            )
            raise _err(
                p + missing,
                "CURVE needs both curve_secret_key_file and curve_public_key_file "
                "(NAME.key and NAME.key.pub from `disagg keys`)",
            )
        if self.server_public_key is not None:
            self._check_key_ref(self.server_public_key, p + "server_public_key")
        keys = self.allowed_client_keys
        if isinstance(keys, str) or not isinstance(keys, (list, tuple)):
            raise _err(
                p + "allowed_client_keys",
                f"must be a list of Z85 public keys or .pub files, got {keys!r}",
            )
        for i, k in enumerate(keys):
            self._check_key_ref(k, f"{p}allowed_client_keys[{i}]")
        _set(self, "allowed_client_keys", tuple(keys))
        if (self.server_public_key or self.allowed_client_keys) and not self.enabled:
            which = "server_public_key" if self.server_public_key else "allowed_client_keys"
            raise _err(
                p + which,
                "is set but this instance has no key pair; set curve_secret_key_file and "
                "curve_public_key_file too",
            )

    @staticmethod
    def _check_key_ref(value: Any, field_: str) -> None:
        if not isinstance(value, str) or not value:
            raise _err(field_, f"must be a Z85 public key or a .pub file path, got {value!r}")
        if not os.path.isfile(value):
            if _looks_like_z85(value):
                return
            raise _err(
                field_,
                f"{value!r} is neither a 40-character Z85 key nor an existing file",
            )
        try:
            read_curve_key(value, "public")
        except (ConfigError, OSError, UnicodeDecodeError) as e:
            raise _err(field_, str(e)) from None

    @property
    def enabled(self) -> bool:
        return self.curve_secret_key_file is not None

    def secret_key(self) -> bytes:
        assert self.curve_secret_key_file is not None
        return read_curve_key(self.curve_secret_key_file, "secret")

    def public_key(self) -> bytes:
        assert self.curve_public_key_file is not None
        return read_curve_key(self.curve_public_key_file, "public")

    @staticmethod
    def _resolve_key(ref: str) -> bytes:
        if os.path.isfile(ref):
            return read_curve_key(ref, "public")
        return ref.encode("ascii")

    def server_key(self) -> bytes | None:
        return None if self.server_public_key is None else self._resolve_key(self.server_public_key)

    def client_keys(self) -> list[bytes]:
        return [self._resolve_key(k) for k in self.allowed_client_keys]


@dataclass(frozen=True)
class MetricsConfig:
    """Section ``metrics``: the connector's own Prometheus port (inside ``trtllm-serve``)
    and the address it binds (loopback unless told otherwise)."""

    port: int | None = None
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        host = self.host
        if not isinstance(host, str) or not (_HOST_RE.match(host) or _is_ip(host)) or host == "*":
            raise _err(
                "metrics.host",
                f"must be an IP address or host name to bind, got {host!r}; e.g. 127.0.0.1 "
                "(this host only) or 0.0.0.0 (every interface)",
            )
        if self.port is None:
            return
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise _err(
                "metrics.port", f"must be an integer port 0-65535 or null, got {self.port!r}"
            )
        if not 0 <= self.port <= 65535:
            raise _err("metrics.port", f"port {self.port} out of range; use 0-65535")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- top level


def _default_instance_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class DisaggConfig:
    """The whole file. ``producer`` is set iff role = producer, ``consumer`` iff consumer."""

    role: str
    instance_id: str | None = None
    model_id: str | None = None
    transport: str = "zmq"
    transport_checksum: bool = False
    ucx_channel: str | None = None
    ucx_rma_readers: int | None = None
    ipc_spin_us: int | None = None
    producer: ProducerConfig | None = None
    consumer: ConsumerConfig | None = None
    security: SecurityConfig | None = None
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    source: str | None = field(default=None, compare=False)  # file it was loaded from

    def __post_init__(self) -> None:
        if self.role is None:
            raise _err("role", "is required; write role: producer or role: consumer")
        _choice(self.role, ROLES, "role")
        if self.instance_id is None:
            _set(self, "instance_id", _default_instance_id(self.role))
        elif not isinstance(self.instance_id, str) or not self.instance_id.strip():
            raise _err("instance_id", f"must be a non-empty string, got {self.instance_id!r}")
        _set(self, "model_id", _opt_str(self.model_id, "model_id"))
        _choice(self.transport, TRANSPORTS, "transport")
        if not isinstance(self.transport_checksum, bool):
            raise _err(
                "transport_checksum",
                f"must be true or false, got {self.transport_checksum!r}",
            )
        if self.transport_checksum and self.transport != "zmq":
            raise _err(
                "transport_checksum",
                f"only the zmq data plane checksums payloads; transport is "
                f"'{self.transport}' (remove transport_checksum or set transport: zmq)",
            )
        for name in ("ucx_channel", "ucx_rma_readers"):
            if getattr(self, name) is not None and self.transport != "ucx":
                raise _err(
                    name,
                    f"is a UCX data plane setting; transport is '{self.transport}' "
                    f"(remove {name} or set transport: ucx)",
                )
        if self.ucx_channel is not None:
            _choice(self.ucx_channel, UCX_CHANNELS, "ucx_channel")
        r = self.ucx_rma_readers
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise _err(
                "ucx_rma_readers",
                f"must be an integer >= 1 (threads copying a UCX shm consumer's reads), got {r!r}",
            )
        if self.ipc_spin_us is not None and self.transport != "ipc":
            raise _err(
                "ipc_spin_us",
                f"is an ipc data plane setting; transport is '{self.transport}' "
                "(remove ipc_spin_us or set transport: ipc)",
            )
        w = self.ipc_spin_us
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise _err(
                "ipc_spin_us",
                f"must be an integer >= 0 (microseconds; 0 turns spinning off), got {w!r}",
            )
        other = "consumer" if self.role == "producer" else "producer"
        if getattr(self, other) is not None:
            raise _err(
                other,
                f"section given but role is '{self.role}'; remove it or set role: {other} "
                "(one file per instance)",
            )
        if self.role == "producer" and self.producer is None:
            raise _err(
                "producer.store_size",
                "is required for role producer; add a producer: section with e.g. store_size: 4GiB",
            )
        if self.role == "consumer" and self.consumer is None:
            raise _err(
                "consumer.producers",
                "is required for role consumer; add a consumer: section with e.g. "
                "producers: [tcp://prefill-0:5557]",
            )
        if self.security is not None:
            if self.role == "producer" and self.security.server_public_key is not None:
                raise _err(
                    "security.server_public_key",
                    "is a consumer setting; a producer lists allowed_client_keys instead",
                )
            if self.role == "consumer" and self.security.allowed_client_keys:
                raise _err(
                    "security.allowed_client_keys",
                    "is a producer setting; a consumer sets server_public_key instead",
                )
            if (
                self.role == "consumer"
                and self.security.enabled
                and self.security.server_public_key is None
            ):
                raise _err(
                    "security.server_public_key",
                    "is required when a consumer uses CURVE; set it to the producers' "
                    "public key (Z85 or NAME.key.pub)",
                )

    # ---- construction from data

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        base_dir: str | os.PathLike[str] | None = None,
        source: str | None = None,
    ) -> DisaggConfig:
        """Build and validate from a parsed mapping. Relative key-file paths are resolved
        against ``base_dir`` (the config file's directory when loaded from a file)."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"(top level): must be a mapping of keys to values, got {type(data).__name__}"
            )
        top = [f.name for f in dataclasses.fields(cls) if f.name != "source"]
        _unknown_keys(data, top, "")
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k not in _SECTIONS}
        if "role" not in data:
            raise _err("role", "is required; write role: producer or role: consumer")
        for name, section_cls in _SECTIONS.items():
            if name not in data or data[name] is None:
                continue
            sub = data[name]
            if not isinstance(sub, Mapping):
                raise _err(name, f"must be a mapping (a section), got {type(sub).__name__}")
            valid = [f.name for f in dataclasses.fields(section_cls)]
            _unknown_keys(sub, valid, f"{name}.")
            sub = dict(sub)
            if name == "security":
                sub = _resolve_security_paths(sub, base_dir)
            if name == "producer" and "store_size" not in sub:
                raise _err(
                    "producer.store_size",
                    "is required: the store's byte budget, e.g. store_size: 4GiB",
                )
            if name == "consumer" and "producers" not in sub:
                raise _err(
                    "consumer.producers",
                    "is required: a list of producer control endpoints, "
                    "e.g. producers: [tcp://prefill-0:5557]",
                )
            if name == "consumer" and isinstance(sub.get("producers"), list):
                sub["producers"] = tuple(sub["producers"])
            if name == "security" and isinstance(sub.get("allowed_client_keys"), list):
                sub["allowed_client_keys"] = tuple(sub["allowed_client_keys"])
            kwargs[name] = section_cls(**sub)
        return cls(**kwargs, source=source)

    def to_dict(self) -> dict[str, Any]:
        """Normalised plain data (sizes in bytes, endpoints canonical, defaults filled in);
        ``from_dict(to_dict())`` gives an equal config. Unused sections are left out."""
        out: dict[str, Any] = {
            "role": self.role,
            "instance_id": self.instance_id,
            "model_id": self.model_id,
            "transport": self.transport,
            "transport_checksum": self.transport_checksum,
        }
        if self.transport == "ucx":
            out["ucx_channel"] = self.ucx_channel
            out["ucx_rma_readers"] = self.ucx_rma_readers
        if self.transport == "ipc":
            out["ipc_spin_us"] = self.ipc_spin_us
        for name in _SECTIONS:
            sec = getattr(self, name)
            if sec is None:
                continue
            d = dataclasses.asdict(sec)
            out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
        return out

    @property
    def section(self) -> ProducerConfig | ConsumerConfig:
        """The role's own section."""
        sec = self.producer if self.role == "producer" else self.consumer
        assert sec is not None
        return sec


_SECTIONS: dict[str, type] = {
    "producer": ProducerConfig,
    "consumer": ConsumerConfig,
    "security": SecurityConfig,
    "metrics": MetricsConfig,
}


def _resolve_security_paths(sub: dict[str, Any], base_dir: Any) -> dict[str, Any]:
    if base_dir is None:
        return sub

    def resolve(v: Any) -> Any:
        # A reference is a file when one exists there; else it stays as written (a Z85 key,
        # or a missing file that validation reports).
        if not isinstance(v, str) or not v:
            return v
        candidate = Path(os.path.expanduser(v))
        if not candidate.is_absolute():
            candidate = Path(base_dir) / candidate
        if candidate.is_file() or not _looks_like_z85(v):
            return str(candidate)
        return v

    for key in ("curve_secret_key_file", "curve_public_key_file", "server_public_key"):
        if key in sub:
            sub[key] = resolve(sub[key])
    if isinstance(sub.get("allowed_client_keys"), (list, tuple)):
        sub["allowed_client_keys"] = [resolve(v) for v in sub["allowed_client_keys"]]
    return sub


# --------------------------------------------------------------------------- loading


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


def _read_file(path: Path, origin: str) -> Any:
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
    data = _read_file(p, origin)
    try:
        return DisaggConfig.from_dict(data, base_dir=p.resolve().parent, source=str(p))
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}", e.field) from None


# --------------------------------------------------------------------------- TensorRT-LLM


_CONNECTOR_CLASSES = {
    "producer": ("disagg.producer", "ProducerScheduler", "ProducerWorker"),
    "consumer": ("disagg.consumer", "ConsumerScheduler", "ConsumerWorker"),
}


def trtllm_llm_api_options(role: str) -> dict[str, Any]:
    """The ``--extra_llm_api_options`` mapping for ``trtllm-serve`` in ``role``: our connector
    plus the settings TensorRT-LLM's connector bring-up requires (contract §9-§10). The files
    in ``deploy/trtllm/`` hold the same keys, with comments."""
    module, sched, worker = _CONNECTOR_CLASSES[_choice(role, ROLES, "role")]
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
