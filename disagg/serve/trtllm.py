"""``disagg serve --engine trtllm``: write the ``--extra_llm_api_options`` YAML and exec
``trtllm-serve`` with ``TRTLLM_DISAGG_CONFIG`` pointing at the disagg config.

The YAML is :func:`disagg.config.trtllm_llm_api_options` (the same keys as
``deploy/trtllm/<role>.yaml``), checked with :func:`disagg.config.check_llm_api_options`
before anything starts. TensorRT-LLM forwards only ``TRTLLM*``/``TLLM*`` variables to its
MPI workers, hence ``TRTLLM_DISAGG_CONFIG``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from ..config import check_llm_api_options, trtllm_llm_api_options

EXIT_NOT_INSTALLED = 3

NOT_INSTALLED = (
    "disagg serve --engine trtllm: TensorRT-LLM is not installed here ({what}). Run it in the "
    "TensorRT-LLM release image (nvcr.io/nvidia/tensorrt-llm/release) with disagg installed "
    "(pip install --no-deps -e .), or use --engine reference to run on CPU."
)


def find_trtllm_serve() -> str | None:
    """Path of ``trtllm-serve`` when TensorRT-LLM is usable, else ``None``."""
    exe = shutil.which("trtllm-serve")
    if exe is None:
        return None
    return exe


def write_options(role: str, directory: str | None = None) -> Path:
    """Write the role's options YAML to a new file and return its path."""
    options = trtllm_llm_api_options(role)
    problems = check_llm_api_options(options)
    if problems:  # a bug in the generator, never the operator's fault
        raise RuntimeError("generated trtllm options break the contract: " + "; ".join(problems))
    fd, name = tempfile.mkstemp(prefix=f"disagg-{role}-", suffix=".yaml", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(f"# written by `disagg serve --role {role} --engine trtllm`\n")
        yaml.safe_dump(options, f, sort_keys=False)
    return Path(name)


def command(model: str, options: Path, host: str, port: int, extra: list[str]) -> list[str]:
    return [
        "trtllm-serve",
        model,
        "--extra_llm_api_options",
        str(options),
        "--host",
        host,
        "--port",
        str(port),
        *extra,
    ]


def run(
    role: str, config_path: str, model: str | None, host: str, port: int, extra: list[str]
) -> int:
    """Exec ``trtllm-serve`` (does not return on success); returns an exit code otherwise."""
    if not model:
        print(
            "disagg serve --engine trtllm: argument --model: name the model (a Hugging Face id or a "
            "path), e.g. --model meta-llama/Llama-3.1-8B-Instruct",
            file=sys.stderr,
        )
        return 2
    exe = find_trtllm_serve()
    if exe is None:
        what = "no trtllm-serve on PATH"
        if importlib.util.find_spec("tensorrt_llm") is None:
            what += " and no tensorrt_llm Python package"
        print(NOT_INSTALLED.format(what=what), file=sys.stderr)
        return EXIT_NOT_INSTALLED
    options = write_options(role)
    argv = command(model, options, host, port, extra)
    env = dict(os.environ, TRTLLM_DISAGG_CONFIG=str(Path(config_path).resolve()))
    print(
        f"disagg serve: exec {' '.join(argv)} (options in {options})", file=sys.stderr, flush=True
    )
    os.execvpe(exe, [exe, *argv[1:]], env)
    return 0  # not reached
