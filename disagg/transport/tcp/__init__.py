"""The stream data plane (``transport: tcp``): KV pages over plain TCP or Unix stream
sockets; control stays on ZMQ. ``TcpDataPlane`` (``plane``) is the entry point; see
its module for the contract and docs/design/tcp-plane.md for the measured decisions."""

from .plane import TcpDataPlane
from .sender import PushHandle
from .wire import StreamPush

__all__ = ["PushHandle", "StreamPush", "TcpDataPlane"]
