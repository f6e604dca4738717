"""The C helpers built at install (``setup.py``): ``disagg/protocol/_keyhash.c`` and the
``disagg/transport/_*.c`` loops. Each is optional: without a compiler at install time the
caller keeps its Python path.

``load(name)`` returns the extension module ``name`` (a full dotted name), or None where it
was not built. With ``tuning.require_native`` (``DISAGG_REQUIRE_NATIVE=1``, as CI runs) a
missing extension is an ImportError instead, unless the caller passes ``strict=False``
(helpers whose Python path is the reference, such as the key chain).
"""

from __future__ import annotations

import importlib
from typing import Any

from . import tuning


def load(name: str, strict: bool = True) -> Any:
    """The extension module ``name``, or None where it is not built (see above). Typed
    ``Any``: the extensions have no stubs."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if strict and tuning.current().require_native:
            raise
        return None
