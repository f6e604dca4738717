"""The same-host data plane (``transport: ipc``): the consumer copies pages straight
out of the producer's store (CUDA IPC or /dev/shm). ``IpcDataPlane`` (``plane``) is the
entry point; see its module for the contract and docs/design/ipc-plane.md for the
measured decisions."""

from .plane import IpcDataPlane
from .sender import PushHandle

__all__ = ["IpcDataPlane", "PushHandle"]
