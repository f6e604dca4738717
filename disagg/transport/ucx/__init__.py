"""The UCX data plane (``pip install disagg[ucx]``): ``UcxDataPlane`` in plane.py.

Start at plane.py: its docstring maps the package (which file receives, sends, reads
one-sidedly, configures UCX, frames the wire). docs/design/ucx-plane.md records why the
plane works as it does, with the measurement behind each decision. Importing this
package needs nothing; importing ``UcxDataPlane`` (or any module that talks to UCX)
needs ucxx.
"""

from __future__ import annotations

from typing import Any

from . import environ  # noqa: F401  (the environment's snapshot, before ucxx is imported)


def __getattr__(name: str) -> Any:  # ucx.UcxDataPlane, importing ucxx only when asked
    if name == "UcxDataPlane":
        from .plane import UcxDataPlane

        return UcxDataPlane
    raise AttributeError(name)
