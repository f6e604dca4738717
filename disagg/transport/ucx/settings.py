"""How each UCX plane configures its UCX context, and the switches that follow from it.

Contract: every UCX setting the plane chooses goes into the context's own config dict
(``UCXContext(config_dict=...)``, applied by UCX after it read the environment), never
into ``os.environ``: the plane changes nothing for the rest of the process or for its
children. The environment is only read, as the operator's word, and wins where the
operator set something (``UCX_TLS``, ``UCX_NET_DEVICES``, any of ``TCP_HARDENING``'s
settings, ``UCX_TCP_MAX_IOV``, ``UCX_WARN_UNUSED_ENV_VARS``).

What a plane asks for (``context_config``):

- every channel: the rendezvous scheme (``RNDV_SCHEME``, put_zcopy: UCX's default
  collapses to ~0.5 GB/s over tcp with ucxx) and no warning about unused ``UCX_*``
  variables;
- ``shm``: no tcp transport at all (``TLS=^tcp``): worker-address endpoints on one host
  need none, and UCX's tcp transport executes any peer's put at any address; messages
  up to 128 KiB eager where the plane is not a CUDA one (``SHM_TUNING``: an RMA batch
  header must not wait on a rendezvous);
- ``tcp``: tcp only on the device that owns the bind address (``NET_DEVICES``), the put
  refused and large messages as active-message rendezvous in 2 MiB socket segments
  (``TCP_HARDENING``), up to 64 iov entries per ``writev`` (``TCP_TUNING``);
- CUDA planes under an explicit ``UCX_TLS`` list: that list plus ``cuda_ipc`` and
  ``cuda_copy`` (without them UCX stages device memory through host at ~0.5 GB/s).

What follows from the context (``decide``, once per plane, as UCX read it): whether the
plane reads store rows one-sidedly (``rma``: shm channel, the native RMA helper usable,
``tuning.ucx_rma`` not False), its tcp send and receive segment sizes, and whether it
sends and receives scattered rows as iov messages over tcp (on under the hardened
settings, where UCX moves an iov zero-copy; ``tuning.ucx_tcp_iov`` /
``ucx_tcp_iov_recv`` force either way). ``docs/design/ucx-plane.md`` has the measurements.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from ... import tuning
from . import iov, native_rma, wire
from .environ import OPERATOR_ENV

log = logging.getLogger(__name__)

RNDV_SCHEME = "put_zcopy"
# A tcp plane's protocol: UCX's tcp transport refuses peers' puts, large messages go by
# active-message rendezvous, in 2 MiB socket segments (8 KiB ones hold that scheme at
# ~1 GB/s).
TCP_HARDENING = {
    "TCP_PUT_ENABLE": "n",
    "RNDV_SCHEME": "am",
    "TCP_TX_SEG_SIZE": "2m",
    "TCP_RX_SEG_SIZE": "2m",
}
# Not part of the protocol (either side may set it alone): up to 64 iov entries per tcp
# writev instead of UCX's 6, so an iov send of scattered store rows writes ~60 rows a call
TCP_TUNING = {"TCP_MAX_IOV": "64"}
# Not part of the protocol either (a sender's choice): on shm, messages up to 128 KiB go
# eager. An RMA batch header (16 bytes a page: up to 4096 pages, ~65 KiB) sent by
# rendezvous waits for the producer's progress thread to answer the consumer's request
# (put_zcopy), and nothing wakes that thread for it: it sleeps out its poll. Timed
# with stamps on both sides (64 KiB pages, 2048 a push): a push's second header landed
# 2.5-3 ms after it was posted by rendezvous, 0.4 ms eager (the consumer copying the first
# batch meanwhile), a fixed cost per push of ~16 ms transfers.
SHM_TUNING = {"RNDV_THRESH": "128k"}
# What ucxx writes into os.environ when imported, where unset (``ucxx/__init__.py``)
UCXX_SETS = {"UCX_RNDV_THRESH": "8192"}
UCX_TCP_SEG_DEFAULT = 8 << 10  # UCX 1.21's tcp TX/RX_SEG_SIZE
_SIOCGIFADDR = 0x8915


def exposure_config(channel: str, bind_host: str | None) -> dict[str, str]:
    """The settings that keep a plane's tcp transport off networks it was not asked to
    serve and refuse peers' writes: ``shm`` planes load no tcp transport, ``tcp`` planes
    only on the device that owns their bind address (loopback by default) and run
    ``TCP_HARDENING`` (CUDA ones too: whether a process has CUDA must not change its wire
    protocol). An operator's ``UCX_TLS`` / ``UCX_NET_DEVICES`` win, and any of
    ``TCP_HARDENING``'s settings in the environment means the operator chose the protocol:
    none of them is set here then (a mix of theirs and ours could run the put rendezvous
    with the put refused: 0.14-0.35 of raw TCP)."""
    out: dict[str, str] = {}
    operator_protocol = any(f"UCX_{k}" in os.environ for k in TCP_HARDENING)
    if not operator_protocol:
        out["RNDV_SCHEME"] = RNDV_SCHEME
    if channel == "shm" and not os.environ.get("UCX_TLS"):
        out["TLS"] = "^tcp"
    if channel == "tcp":
        if not os.environ.get("UCX_NET_DEVICES"):
            device = net_device(bind_host or "127.0.0.1")
            if device is not None:
                out["NET_DEVICES"] = device
        if not operator_protocol:
            out.update(TCP_HARDENING)
        out.update({k: v for k, v in TCP_TUNING.items() if f"UCX_{k}" not in os.environ})
    return out


def cuda_transports() -> dict[str, str]:
    """For a CUDA plane: an operator's explicit ``UCX_TLS`` list with ``cuda_ipc`` (same
    node) and ``cuda_copy`` added where it lacks them, as the context's ``TLS``; nothing
    when ``UCX_TLS`` is unset, ``all`` or an exclusion list (those include them)."""
    tls = os.environ.get("UCX_TLS")
    if not tls or tls.startswith("^") or tls == "all":
        return {}
    names = [t.strip() for t in tls.split(",") if t.strip()]
    missing = [t for t in ("cuda_ipc", "cuda_copy") if t not in names and "cuda" not in names]
    if not missing:
        return {}
    log.info("UCX_TLS=%s lacks %s for CUDA memory: this plane adds them", tls, ",".join(missing))
    return {"TLS": ",".join(names + missing)}


def context_config(channel: str, bind_host: str | None, cuda: bool) -> dict[str, str]:
    """The whole config dict of a plane's UCX context (module docstring)."""
    out = exposure_config(channel, bind_host)
    if "UCX_WARN_UNUSED_ENV_VARS" not in os.environ:
        out["WARN_UNUSED_ENV_VARS"] = "n"
    if cuda:
        out.update(cuda_transports())
    elif channel == "shm":  # a CUDA plane's loop spins while requests are in flight
        out.update({k: v for k, v in SHM_TUNING.items() if not operator_set(f"UCX_{k}")})
    return out


def operator_set(name: str) -> bool:
    """Whether the operator set the environment variable ``name``: it is set, and either
    was before ucxx was imported or holds another value than the one ucxx writes."""
    value = os.environ.get(name)
    if value is None:
        return False
    return name in OPERATOR_ENV or value != UCXX_SETS.get(name)


def ucx_setting(name: str, config: Mapping[str, str]) -> str | None:
    """The value UCX takes for its setting ``name`` (without ``UCX_``) in a context made
    with ``config``: the dict's (applied after the environment is read), else the
    ``UCX_<name>`` environment variable, else None."""
    if name in config:
        return config[name]
    return os.environ.get("UCX_" + name)


def ucx_bytes(text: str | None) -> int | None:
    """A UCX memory-units value (``2m``, ``2M``, ``2MB``, ``65536``, ``inf``) in bytes;
    None when absent or unreadable."""
    if text is None:
        return None
    t = text.strip().lower().removesuffix("b")
    if t in ("inf", "infinity", "auto"):
        return None if t == "auto" else 1 << 62
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        return int(float(t) * scale)
    except ValueError:
        return None


def tcp_seg(name: str, config: Mapping[str, str]) -> int:
    """UCX's tcp segment setting ``name`` (``TCP_TX_SEG_SIZE`` / ``TCP_RX_SEG_SIZE``) in a
    context made with ``config``, in bytes."""
    return ucx_bytes(ucx_setting(name, config)) or UCX_TCP_SEG_DEFAULT


def tcp_large_segments(config: Mapping[str, str]) -> bool:
    """Whether a context made with ``config`` sends large tcp messages as active messages
    in large segments: rendezvous scheme ``am`` and a tcp send segment of at least
    ``TCP_SEG_BYTES`` (the hardened setting). Only then does UCX 1.21 move an iov message
    zero-copy ("rendezvous data send from iov[32] ... zero-copy"); under its defaults an
    iov goes "fragmented copy-in copy-out" in 8 KiB pieces."""
    if (ucx_setting("RNDV_SCHEME", config) or "").strip().lower() != "am":
        return False
    seg = ucx_bytes(ucx_setting("TCP_TX_SEG_SIZE", config))
    return seg is not None and seg >= wire.TCP_SEG_BYTES


def tcp_iov_default(config: Mapping[str, str]) -> bool:
    """Whether a tcp plane with this context sends scattered StoreRows segments as iov
    messages (else gathers them into its send ring): ``tuning.ucx_tcp_iov`` when set,
    else ``tcp_large_segments(config)``. ``iov.available()`` must also hold."""
    forced = tuning.current().ucx_tcp_iov
    return tcp_large_segments(config) if forced is None else forced


def tcp_iov_recv_default(config: Mapping[str, str]) -> bool:
    """Whether a tcp plane with this context receives packed segments for host slots as
    iov receives straight into the slots (else into scratch and a row copy):
    ``tuning.ucx_tcp_iov_recv`` when set, else ``tcp_large_segments(config)`` (UCX then
    unpacks each fragment into the posted iov). Safe by default since ``abort`` severs
    producers' connections when such receives outlive its wait."""
    forced = tuning.current().ucx_tcp_iov_recv
    return tcp_large_segments(config) if forced is None else forced


def net_device(host: str) -> str | None:
    """The network device that owns IPv4 ``host`` (a name or address): ``lo`` for
    loopback. None for a wildcard bind (every device, as asked) or an address no device
    here holds (then UCX keeps its default, every device, and a warning says so)."""
    if host in ("", "*", "0.0.0.0", "::", "[::]"):
        return None
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = ""
    if addr.startswith("127."):
        return "lo"
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sk:
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(sk.fileno(), _SIOCGIFADDR, req)
            except OSError:  # no IPv4 address on that device
                continue
        if addr and socket.inet_ntoa(got[20:24]) == addr:
            return name
    log.warning(
        "UCX tcp plane bound to %s: no network device here holds that IPv4 address, so "
        "UCX's tcp transport serves every device (set UCX_NET_DEVICES to restrict it)",
        host,
    )
    return None


def default_rma_readers() -> int:
    """Threads that copy an RMA batch on a consumer (the progress thread plus ``n - 1``
    reader lanes, each with its own UCX worker): ``tuning.ucx_rma_readers`` when set,
    else 2 where this process may run on 2 or more CPUs, 1 otherwise."""
    n = tuning.current().ucx_rma_readers
    if n is not None:
        return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return 2 if cpus >= 2 else 1


@dataclass(frozen=True)
class Settings:
    """A plane's UCX context settings and what follows from them (``decide``)."""

    config: dict[str, str]
    rma: bool  # the context has the RMA feature: one-sided reads of store rows (shm)
    tcp_rx_seg: int  # UCX tcp receive segment, bytes
    tcp_tx_seg: int  # UCX tcp send segment, bytes
    tcp_iov_sends: bool  # scattered StoreRows segments leave as iov messages (tcp)
    tcp_iov_recvs: bool  # packed segments for host slots arrive as iov receives (tcp)


def decide(channel: str, bind_host: str | None, cuda: bool) -> Settings:
    """The settings of a plane on ``channel``, decided from the environment now (as UCX
    will read it when the context is made) and the config dict chosen here."""
    config = context_config(channel, bind_host, cuda)
    return Settings(
        config=config,
        rma=channel == "shm" and native_rma.available(),
        tcp_rx_seg=tcp_seg("TCP_RX_SEG_SIZE", config),
        tcp_tx_seg=tcp_seg("TCP_TX_SEG_SIZE", config),
        tcp_iov_sends=channel != "shm" and tcp_iov_default(config),
        tcp_iov_recvs=channel == "tcp" and tcp_iov_recv_default(config) and iov.available(),
    )
