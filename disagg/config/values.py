"""Values with a syntax of their own: sizes, endpoints, CURVE keys, host names.

Each parsed type of the schema (:class:`Size`, :class:`BindEndpoint`...) is a subclass of the
plain type it holds, with ``what`` (how the reference and the errors name it) and
``parse(value, field)``, which returns the normalised value or raises a
:class:`~disagg.config.errors.ConfigError` naming ``field``. A loaded config holds the plain
value (``int``, ``str``, ``tuple``); the subclass only tells msgspec which parser to run.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from .errors import ConfigError, err

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
        raise err(field, f"must be a size such as 4GiB or a number of bytes, got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise err(field, f"must be > 0 bytes, got {text}")
        return int(text)
    if not isinstance(text, str):
        raise err(field, f"must be a size such as 4GiB or a number of bytes, got {text!r}")
    m = _SIZE_RE.match(text)
    if not m:
        raise err(field, f"cannot parse size {text!r}; write e.g. 4GiB, 512MiB or 1048576 (bytes)")
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
        raise err(
            field, f"unknown size unit {m.group(2)!r} in {text!r}; use B, KiB, MiB, GiB or TiB"
        )
    scale = _BINARY_UNITS[unit]
    value = float(number) * scale if "." in number else int(number) * scale
    if value != int(value):
        raise err(field, f"{text!r} is not a whole number of bytes")
    if int(value) <= 0:
        raise err(field, f"must be > 0 bytes, got {text!r}")
    return int(value)


class Endpoint(msgspec.Struct, frozen=True):
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
    bad = f"bad endpoint {text!r}"
    if not isinstance(text, str) or "://" not in text:
        spellings = " or ".join(s + "://..." for s in schemes)
        raise err(field, f"{bad}: write {spellings}, e.g. {example}")
    scheme, rest = text.split("://", 1)
    if scheme not in schemes:
        raise err(
            field, f"{bad}: scheme '{scheme}' is not one of {', '.join(schemes)}; e.g. {example}"
        )
    if scheme in ("ipc", "inproc"):
        if not rest:
            raise err(field, f"{bad}: {scheme}:// needs a path or name")
        return Endpoint(scheme=scheme, path=rest)
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0 or rest[close + 1 : close + 2] != ":":
            raise err(field, f"{bad}: write tcp://[ipv6]:port")
        host, port_text = rest[1:close], rest[close + 2 :]
        if not _is_ip(host) or ":" not in host:
            raise err(field, f"{bad}: '{host}' is not an IPv6 address")
    else:
        if ":" not in rest:
            raise err(field, f"{bad}: tcp needs host:port, e.g. {example}")
        host, port_text = rest.rsplit(":", 1)
        if not host or not _HOST_RE.match(host):
            raise err(field, f"{bad}: '{host}' is not a valid host, e.g. {example}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise err(field, f"{bad}: port '{port_text}' must be a number 0-65535")
    port = int(port_text)
    if connect and host in ("*", "0.0.0.0", "::"):
        raise err(
            field, f"{bad}: cannot connect to the wildcard host '{host}'; write the peer's address"
        )
    if connect and port == 0:
        raise err(field, f"{bad}: port 0 cannot be connected to; write the peer's actual port")
    return Endpoint(scheme="tcp", host=host, port=port)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- CURVE keys

_Z85_RE = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_ZPL_KEY_RE = re.compile(r"^\s*(public|secret)-key\s*=\s*\"?([^\"\s]+)\"?\s*$", re.M)


def looks_like_z85(text: str) -> bool:
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


def public_key(ref: str) -> bytes:
    """A checked key reference (Z85 text or a key file) as the key."""
    return read_curve_key(ref, "public") if os.path.isfile(ref) else ref.encode("ascii")


def _key_file(value: Any, field: str, kind: str) -> str:
    if not isinstance(value, str) or not value:
        raise err(field, f"must be a file path, got {value!r}")
    if not os.path.isfile(value):
        raise err(
            field,
            f"file {value!r} does not exist; create a key pair with `disagg keys NAME --dir DIR`",
        )
    try:
        read_curve_key(value, kind)
    except (ConfigError, OSError, UnicodeDecodeError) as e:
        raise err(field, str(e)) from None
    return value


# --------------------------------------------------------------------------- schema types


class Size(int):
    what = "a size: 4GiB, 512MiB or a number of bytes (4GB is refused as ambiguous)"

    @classmethod
    def parse(cls, value: Any, field: str) -> Size:
        return cls(parse_size(value, field))


class BindEndpoint(str):
    what = "an endpoint to bind: tcp://host:port, ipc://path or inproc://name"

    @classmethod
    def parse(cls, value: Any, field: str) -> BindEndpoint:
        return cls(parse_endpoint(value, field).url)


class Producers(tuple[str | tuple[str, ...], ...]):
    what = (
        "a list of producer control endpoints to connect to (tcp://host:port or ipc://path; "
        "no wildcard host, no port 0, each once); an entry may be a list of one producer's "
        "rank endpoints in rank order"
    )

    @classmethod
    def parse(cls, value: Any, field: str) -> Producers:
        entries = (value,) if isinstance(value, str) else value
        if not isinstance(entries, (list, tuple)) or not entries:
            raise err(
                field,
                "needs at least one producer control endpoint, "
                "e.g. producers: [tcp://prefill-0:5557]",
            )
        out: list[str | tuple[str, ...]] = []
        flat: list[str] = []
        for i, entry in enumerate(entries):
            ranks = entry if isinstance(entry, (list, tuple)) else None
            if ranks is not None and not ranks:
                raise err(
                    f"{field}[{i}]",
                    "an empty list: list the producer's rank endpoints in rank order",
                )
            urls = [
                parse_endpoint(ep, name, schemes=("tcp", "ipc"), connect=True).url
                for name, ep in (
                    [(f"{field}[{i}][{r}]", ep) for r, ep in enumerate(ranks)]
                    if ranks is not None
                    else [(f"{field}[{i}]", entry)]
                )
            ]
            out.append(tuple(urls) if ranks is not None else urls[0])
            flat += urls
        dup = next((u for u in flat if flat.count(u) > 1), None)
        if dup is not None:
            raise err(field, f"{dup!r} is listed twice; list each producer once")
        return cls(out)


class HostName(str):
    what = "an IP address or host name to bind (not *)"

    @classmethod
    def parse(cls, value: Any, field: str) -> HostName:
        if (
            not isinstance(value, str)
            or not (_HOST_RE.match(value) or _is_ip(value))
            or value == "*"
        ):
            raise err(
                field,
                f"must be an IP address or host name to bind, got {value!r}; e.g. 127.0.0.1 "
                "(this host only) or 0.0.0.0 (every interface)",
            )
        return cls(value)


class SecretKeyFile(str):
    what = "a path: this instance's NAME.key from `disagg keys NAME`"

    @classmethod
    def parse(cls, value: Any, field: str) -> SecretKeyFile:
        return cls(_key_file(value, field, "secret"))


class PublicKeyFile(str):
    what = "a path: this instance's NAME.key.pub from `disagg keys NAME`"

    @classmethod
    def parse(cls, value: Any, field: str) -> PublicKeyFile:
        return cls(_key_file(value, field, "public"))


class KeyRef(str):
    what = "a Z85 public key (40 characters) or a .pub file"

    @classmethod
    def parse(cls, value: Any, field: str) -> KeyRef:
        if not isinstance(value, str) or not value:
            raise err(field, f"must be a Z85 public key or a .pub file path, got {value!r}")
        if not os.path.isfile(value):
            if looks_like_z85(value):
                return cls(value)
            raise err(field, f"{value!r} is neither a 40-character Z85 key nor an existing file")
        try:
            read_curve_key(value, "public")
        except (ConfigError, OSError, UnicodeDecodeError) as e:
            raise err(field, str(e)) from None
        return cls(value)


def plain(value: Any) -> Any:
    """A parsed type's value as the plain type it holds (tuples of them too)."""
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    for base in (str, int):
        if isinstance(value, base) and type(value) is not base and not isinstance(value, bool):
            return base(value)
    return value


def resolve_key_paths(section: dict[str, Any], base_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``security:`` mapping with relative key-file references made absolute against
    ``base_dir``. A reference is a file when one exists there; else it stays as written (a
    Z85 key, or a missing file that validation reports)."""

    def resolve(v: Any) -> Any:
        if not isinstance(v, str) or not v:
            return v
        candidate = Path(os.path.expanduser(v))
        if not candidate.is_absolute():
            candidate = Path(base_dir) / candidate
        if candidate.is_file() or not looks_like_z85(v):
            return str(candidate)
        return v

    out = dict(section)
    for key in ("curve_secret_key_file", "curve_public_key_file", "server_public_key"):
        if key in out:
            out[key] = resolve(out[key])
    if isinstance(out.get("allowed_client_keys"), (list, tuple)):
        out["allowed_client_keys"] = [resolve(v) for v in out["allowed_client_keys"]]
    return out


_STORE_DEVICE_RE = re.compile(r"^(cpu|pinned|cuda|cuda:\d+)$")


class StoreDeviceName(str):
    what = "cpu, pinned, cuda (the engine's GPU) or cuda:N"

    @classmethod
    def parse(cls, value: Any, field: str) -> StoreDeviceName:
        if not isinstance(value, str) or not _STORE_DEVICE_RE.match(value):
            raise err(
                field,
                f"unknown value {value!r}; valid values: cpu, pinned, cuda (the engine's GPU), "
                "cuda:N (GPU N, the one the engine's KV cache is on)",
            )
        return cls(value)


def store_device_for(value: str, pool_device: Any, field: str = "producer.store_device") -> str:
    """The torch device string of the producer's store for ``store_device: value`` next to
    an engine whose KV cache is on ``pool_device`` (a torch.device or its name): ``cuda``
    is the KV cache's GPU (not the calling thread's current one); ``cuda:N`` must name it
    (the save path copies pages on one GPU), exist and be visible. Raises ConfigError
    naming ``field`` and the fix otherwise."""
    pool = str(pool_device)
    if value in ("cpu", "pinned"):
        return value
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda is not None
        why = "no CUDA device is visible" if built else "this torch is a CPU-only build"
        raise err(field, f"is {value} but {why}; use store_device: cpu or pinned")
    count = torch.cuda.device_count()
    if value.startswith("cuda:") and int(value[5:]) >= count:
        raise err(
            field,
            f"is {value} but only {count} CUDA device(s) are visible here (cuda:0..cuda:"
            f"{count - 1}; CUDA_VISIBLE_DEVICES renumbers them); use cuda (the engine's GPU)",
        )
    if not pool.startswith("cuda"):
        if value == "cuda":
            return f"cuda:{torch.cuda.current_device()}"
        return value
    index = pool[5:] if pool.startswith("cuda:") else str(torch.cuda.current_device())
    if value == "cuda":
        return f"cuda:{index}"
    if value[5:] != index:
        raise err(
            field,
            f"is {value} but the engine's KV cache is on cuda:{index}; the store must be on "
            f"the engine's GPU: use store_device: cuda (or cuda:{index})",
        )
    return value
