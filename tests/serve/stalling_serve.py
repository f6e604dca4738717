"""``disagg serve`` with a test hook, for tests that SIGKILL a server at a known point.

Usage: ``python stalling_serve.py serve ARGS...`` with ``DISAGG_TEST_STALL_LAYER=L`` and
``DISAGG_TEST_STALL_FILE=PATH``: the reference engine's first forward that reaches layer
L's ``save_kv_layer`` hook writes this process's id to PATH and stops there for good (a
producer in the middle of its prefill, some layers' saves enqueued; a consumer in the
middle of its first forward, after its claim and load, before its first token). With
``DISAGG_TEST_STALL_HOOK=get_num_new_matched_tokens`` instead, the first scheduler query
stops (a consumer that has a continuation, before it claims), and with
``DISAGG_TEST_RESUME_FILE=PATH2`` the stop lasts until PATH2 exists. The test waits for
the file and kills this (or another) process. Test-only: nothing in disagg reads these.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from disagg.cli import main
from disagg.engine.reference.connector_driver import Driver

_LAYER = int(os.environ.get("DISAGG_TEST_STALL_LAYER", "1"))
_HOOK = os.environ.get("DISAGG_TEST_STALL_HOOK", "save_kv_layer")
_FILE = Path(os.environ["DISAGG_TEST_STALL_FILE"])
_RESUME = os.environ.get("DISAGG_TEST_RESUME_FILE")
_each_worker = Driver.each_worker
_sched = Driver.sched


def _stall() -> None:
    tmp = _FILE.with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.rename(_FILE)  # whole, at once
    while _RESUME is None or not Path(_RESUME).exists():
        time.sleep(0.02)


def _stalling_each_worker(self: Driver, name: str, *args: Any) -> None:
    _each_worker(self, name, *args)
    if name == _HOOK == "save_kv_layer" and args[0] == _LAYER and not _FILE.exists():
        _stall()


def _stalling_sched(self: Driver, name: str, *args: Any, broadcast: bool = True) -> Any:
    if name == _HOOK and not _FILE.exists():
        _stall()
    return _sched(self, name, *args, broadcast=broadcast)


Driver.sched = _stalling_sched  # type: ignore[method-assign]
Driver.each_worker = _stalling_each_worker  # type: ignore[method-assign]
raise SystemExit(main(sys.argv[1:]))
