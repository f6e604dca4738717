"""Transport: control RPC (ZMQ ROUTER/DEALER), block events (PUB/SUB) and the data
plane (DataPlane interface; the tcp plane here, ``ipc`` and UCX by ``factory``). Knows
nothing of engines or keys.

Names are imported on first use: the proxy needs the event subscriber only, and importing
the data plane (torch) in a serving process holds the GIL for seconds."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .control import ControlClient, ControlServer
    from .dataplane import DataPlane, PageSource, RegionSpec, TransferState, TransferStatus
    from .events import EventPublisher, EventSubscriber
    from .tcp import PushHandle, TcpDataPlane

_WHERE = {
    "ControlClient": ".control",
    "ControlServer": ".control",
    "DataPlane": ".dataplane",
    "PageSource": ".dataplane",
    "RegionSpec": ".dataplane",
    "TransferState": ".dataplane",
    "TransferStatus": ".dataplane",
    "EventPublisher": ".events",
    "EventSubscriber": ".events",
    "PushHandle": ".tcp",
    "TcpDataPlane": ".tcp",
}

__all__ = [
    "ControlClient",
    "ControlServer",
    "DataPlane",
    "EventPublisher",
    "EventSubscriber",
    "PageSource",
    "PushHandle",
    "RegionSpec",
    "TcpDataPlane",
    "TransferState",
    "TransferStatus",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)
