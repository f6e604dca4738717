"""Shared helpers for the security tests: in-process producer/consumer reference engines
(as in tests/e2e) whose configs may carry a ``security`` section, and CURVE key files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq
from harness import (  # noqa: F401  (re-exported for the security tests)
    SHAPE,
    close_all_services,
    make_consumer,
    make_producer,
    prompts,
    run,
    wait_for,
)

from disagg.bench.ports import free_port  # noqa: F401  (re-exported for the security tests)


class KeyPair:
    """A CURVE key pair written to ``DIR/NAME.key`` / ``DIR/NAME.key.pub`` (bare Z85)."""

    def __init__(self, directory: Path, name: str) -> None:
        self.public, self.secret = zmq.curve_keypair()
        self.secret_file = directory / f"{name}.key"
        self.public_file = directory / f"{name}.key.pub"
        self.secret_file.write_text(self.secret.decode() + "\n")
        self.secret_file.chmod(0o600)
        self.public_file.write_text(self.public.decode() + "\n")

    def section(self, **extra: Any) -> dict[str, Any]:
        return {
            "curve_secret_key_file": str(self.secret_file),
            "curve_public_key_file": str(self.public_file),
            **extra,
        }
