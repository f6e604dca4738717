"""Transport: control RPC (ZMQ ROUTER/DEALER), block events (PUB/SUB) and the data
plane (DataPlane interface; the tcp plane here, ``ipc`` and UCX by ``factory``). Knows
nothing of engines or keys."""

from .control import ControlClient, ControlServer
from .dataplane import DataPlane, PageSource, RegionSpec, TransferState, TransferStatus
from .events import EventPublisher, EventSubscriber
from .tcp import PushHandle, TcpDataPlane

__all__ = [
    "ControlClient",
    "ControlServer",
    "DataPlane",
    "EventPublisher",
    "EventSubscriber",
    "PageSource",
    "PushHandle",
    "RegionSpec",
    "TransferState",
    "TcpDataPlane",
    "TransferStatus",
]
