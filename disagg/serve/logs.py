"""Structured (JSON lines) logging for ``disagg serve`` and ``disagg proxy``.

Each record is one JSON object on stderr with ``ts``, ``level``, ``logger``, ``msg`` and any
``extra={...}`` fields a call passes (``request_id``, ``status``, ``upstream`` ...), so log
shippers can index requests without parsing free text.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "info") -> None:
    """Route the root logger to stderr as JSON lines (idempotent)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_disagg_json", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler._disagg_json = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # we log requests ourselves
