"""The UCX data plane (``pip install disagg[ucx]``): ``UcxDataPlane`` in plane.py.

Start at plane.py: its docstring maps the package (which file receives, sends, reads
one-sidedly, configures UCX, frames the wire). docs/design/ucx-plane.md records why the
plane works as it does, with the measurement behind each decision. Importing this
package needs nothing; importing ``UcxDataPlane`` (or any module that talks to UCX)
needs ucxx.
"""

from __future__ import annotations

import os
from typing import Any

# The UCX_* variables the environment held before ucxx was imported: ucxx sets some in
# os.environ when imported, where unset (UCX_RNDV_THRESH=8192 among them), and the plane
# tells the operator's settings from ucxx's by this (``settings.operator_set``). Taken
# here, before any module of this package imports ucxx.
OPERATOR_ENV = frozenset(k for k in os.environ if k.startswith("UCX_"))


def __getattr__(name: str) -> Any:  # ucx.UcxDataPlane, importing ucxx only when asked
    if name == "UcxDataPlane":
        from .plane import UcxDataPlane

        return UcxDataPlane
    raise AttributeError(name)
