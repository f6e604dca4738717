"""The nixl data plane (``pip install -e ".[nixl]"``): ``NixlDataPlane`` in plane.py.

Start at plane.py: its docstring gives the flow of a push. agent.py makes the NIXL
agent and registers memory; push.py is the producer's side, reads.py the consumer's;
wire.py the notifications between them. docs/design/nixl-plane.md records the
measurements behind the choices. Importing this package needs nothing; importing
``NixlDataPlane`` needs NIXL.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # nixl.NixlDataPlane, importing NIXL only when asked
    if name == "NixlDataPlane":
        from .plane import NixlDataPlane

        return NixlDataPlane
    raise AttributeError(name)
