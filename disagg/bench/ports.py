"""Free loopback ports for processes about to start (benchmark deployments, tests).

A port is picked below the kernel's ephemeral range (``ip_local_port_range``): a socket
bound to port 0, or connecting out, takes its port from that range, so no other process
can take a picked port between the pick and the child's bind (a port found free by
binding port 0 can be handed, meanwhile, to the next socket that does the same). Each
pick is checked bindable and not handed out before by this process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOW = 10_000  # above the ports services commonly listen on
_handed: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive free loopback ports below the ephemeral range;
    where that range leaves no room, the kernel's pick (``count`` 1 only)."""
    top = _ephemeral_low() - count
    with _lock:
        for _ in range(200) if top > _LOW + 1000 else ():
            base = random.randrange(_LOW, top)
            ports = range(base, base + count)
            if _handed.intersection(ports) or not all(_bindable(p) for p in ports):
                continue
            _handed.update(ports)
            return base
    if count != 1:
        raise RuntimeError(f"no {count} consecutive free ports below the ephemeral range")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
