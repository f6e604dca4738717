"""A ``disagg`` command (``disagg serve ...``) as a child of a fork server that has imported
numpy and torch once (not every child: seconds of CPU each), its output in a log file,
optionally one protocol version ahead of this tree.

This module imports nothing of disagg, and children are plain ``ForkServerProcess``es: a
child unpickles nothing that imports disagg before ``run``, so ``ahead`` can change the
protocol version before any module reads it.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any


def context() -> Any:
    """The multiprocessing context to start ``run`` in."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "torch"])
    return ctx


def speak_next_version() -> None:
    """Make every module of this process see ``PROTOCOL_VERSION + 1`` (a release that
    changed the wire): each message it sends says so, and each one from a peer of this
    tree's version is refused (BAD_VERSION), as between two releases. Call before anything
    imports ``disagg.protocol``."""
    assert "disagg.protocol" not in sys.modules, "the protocol is imported already"
    import disagg  # the package alone: its __init__ imports nothing

    path = Path(disagg.__file__).parent / "protocol" / "version.py"
    spec = importlib.util.spec_from_file_location("disagg.protocol.version", path)
    assert spec is not None and spec.loader is not None
    version = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(version)
    version.PROTOCOL_VERSION += 1
    sys.modules["disagg.protocol.version"] = version


def run(argv: list[str], log: str, env: dict[str, str], ahead: bool = False) -> None:
    """Child: ``disagg ARGV`` with stdout and stderr appended to ``log``, in the parent's
    environment ``env`` (the fork server's is the one it started with)."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    for name in ("DISAGG_CONFIG", "TRTLLM_DISAGG_CONFIG"):
        os.environ.pop(name, None)
    if ahead:
        speak_next_version()
    from disagg.cli import main

    raise SystemExit(main(argv))
