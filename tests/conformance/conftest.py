"""The conformance suite runs against TensorRT-LLM's own connector package when one is
given (``DISAGG_TRTLLM_SRC=<tree>``, loaded by ``disagg.engine`` with only the C++ parts
stood in for; or an installed ``tensorrt_llm``), else against our fallback copies.

``.ci/run`` runs it once per tree under ``$DISAGG_TRTLLM_TREES`` (each its own process:
``disagg.engine`` binds one line per process) and once on the fallback copies.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# the chaos folder's helpers (stalled pushes) serve the cancellation cases here too
sys.path.insert(0, str(Path(__file__).parent.parent / "chaos"))


def pytest_report_header(config: pytest.Config) -> str:
    from disagg.engine import FEATURES, TRTLLM_SOURCE

    src = os.environ.get("DISAGG_TRTLLM_SRC")
    where = f"{Path(src).name} ({TRTLLM_SOURCE})" if src else TRTLLM_SOURCE
    return f"conformance: connector classes from {where}; runtime features {FEATURES}"
