"""Transport: control RPC (ZMQ ROUTER/DEALER), block events (PUB/SUB) and the data
plane (DataPlane interface, ZMQ implementation). Knows nothing of engines or keys."""

from .control import ControlClient, ControlServer
from .dataplane import DataPlane, PageSource, RegionSpec, TransferState, TransferStatus
from .events import EventPublisher, EventSubscriber
from .zmq_plane import PushHandle, ZmqDataPlane

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
    "TransferStatus",
    "ZmqDataPlane",
]
