"""The UCX_* variables the environment held before ucxx was imported.

ucxx sets some in ``os.environ`` when imported, where unset (``UCX_RNDV_THRESH=8192``
among them); the plane tells the operator's settings from ucxx's by this snapshot
(``settings.operator_set``). The package imports this module first, before any of its
modules imports ucxx. It imports nothing of the package.
"""

from __future__ import annotations

import os

OPERATOR_ENV = frozenset(k for k in os.environ if k.startswith("UCX_"))
