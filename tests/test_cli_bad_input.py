"""Every command line answers bad input the same way: exit status 2 and ONE line on
stderr naming the argument (and the value), never a traceback. One case of each command
runs the real command in a subprocess, as an operator would; the others call the same
``main(argv)`` in this process (the entry point only turns its return value into the exit
status), which spares each an interpreter start and a torch import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ENGINE = ["-m", "disagg.engine.reference"]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("cli")
    good = d / "producer.yaml"
    good.write_text("role: producer\nproducer:\n  store_size: 64MiB\n")
    bad_host = d / "metrics.yaml"
    bad_host.write_text(
        "role: producer\nproducer:\n  store_size: 64MiB\nmetrics:\n  port: 9100\n"
        "  host: every interface\n"
    )
    renamed = d / "zmq.yaml"
    renamed.write_text("role: producer\ntransport: zmq\nproducer:\n  store_size: 64MiB\n")
    return {
        "GOOD": str(good),
        "BADHOST": str(bad_host),
        "ZMQ": str(renamed),
        "MISSING": str(d / "nope.yaml"),
    }


# (argv after `python -m disagg` (or ENGINE ...), what the line must name)
CASES: list[tuple[list[str], list[str]]] = [
    # disagg demo: the inputs of issue 23's point 2, and more
    (["demo", "--device", "cuda"], ["--device", "cuda"]),
    (["demo", "--windows", "64,full", "--kv-manager", "v1"], ["--windows", "64,full", "v2"]),
    (["demo", "--prompt-len", "8192"], ["--prompt-len", "8192", "8176"]),
    (["demo", "--prompt-len", "10"], ["--prompt-len", "10", "block"]),
    (["demo", "--prompts", "0"], ["--prompts", "0"]),
    (["demo", "--num-prompts", "two"], ["--num-prompts", "two"]),
    (["demo", "--producers", "2", "--consumers", "2", "--prompts", "3"], ["--prompts", "4"]),
    (["demo", "--tp", "3"], ["--tp", "3"]),
    (["demo", "--windows", "sixty"], ["--windows", "sixty"]),
    (["demo", "--kv-manager", "v3"], ["--kv-manager", "v3"]),
    (["demo", "--layers", "0"], ["--layers", "0"]),
    (["demo", "--chunk-size", "-4"], ["--chunk-size", "-4"]),
    (["demo", "--store-device", "cuda"], ["--store-device", "cuda"]),
    (["demo", "--nope"], ["--nope"]),
    (["demo", "--transport", "zmq"], ["--transport", "'zmq' was renamed", "'tcp'"]),
    # disagg bench
    (["bench", "transfer", "--page-sizes", "64KB"], ["--page-sizes", "64KB", "64KiB"]),
    (["bench", "transfer", "--transports", "tcp,rdma"], ["--transports", "rdma", "tcp-tcp"]),
    (["bench", "transfer", "--transports", "zmq-tcp"], ["--transports", "renamed", "tcp-tcp"]),
    (["bench", "transfer", "--total", "0"], ["--total", "0"]),
    (["bench", "transfer", "--repeats", "0"], ["--repeats", "0"]),
    (["bench", "query", "--prompt-lens", "1k"], ["--prompt-lens", "1k"]),
    (["bench", "query", "--prompt-lens", "8"], ["--prompt-lens", "8", "block"]),
    (["bench", "gpu", "--total", "1GB"], ["--total", "1GB"]),
    (["bench", "gpu", "--ipc-control", "udp"], ["--ipc-control", "udp"]),
    (["bench", "warp"], ["warp"]),
    # disagg serve
    (["serve", "--role", "prefill"], ["--role", "prefill"]),
    (["serve", "--port", "99999"], ["--port", "99999"]),
    (["serve", "--engine", "vllm"], ["--engine", "vllm"]),
    (["serve", "--layers", "0", "--config", "GOOD"], ["--layers", "0"]),
    (["serve", "--device", "cuda", "--config", "GOOD"], ["--device", "cuda"]),
    (["serve", "--windows", "64,full", "--kv-manager", "v1", "--config", "GOOD"], ["--windows"]),
    (["serve", "--role", "consumer", "--config", "GOOD"], ["role", "consumer", "producer"]),
    (["serve", "--config", "MISSING"], ["nope.yaml", "not found"]),
    (["serve", "--config", "ZMQ"], ["transport", "'zmq' was renamed; use 'tcp'"]),
    (["serve", "--config", "GOOD", "--tensor-parallel"], ["--tensor-parallel"]),
    # disagg proxy
    (["proxy"], ["--producers"]),
    (["proxy", "--producers", "localhost:8100", "--consumers", "http://x:1"], ["--producers"]),
    (["proxy", "--port", "-1"], ["--port", "-1"]),
    (["proxy", "--heartbeat-s", "0"], ["--heartbeat-s", "0"]),
    (["proxy", "--missed-heartbeats", "none"], ["--missed-heartbeats", "none"]),
    (["proxy", "--log-level", "loud"], ["--log-level", "loud"]),
    # disagg config / keys
    (["config", "check", "BADHOST"], ["metrics.host", "every interface"]),
    (["config", "check", "MISSING"], ["nope.yaml", "not found"]),
    (["config", "check", "ZMQ"], ["transport", "'zmq' was renamed; use 'tcp'"]),
    (["config", "lint"], ["lint"]),
    (["keys", "../evil"], ["../evil"]),
    (["keys"], ["name"]),
    (["launch"], ["launch"]),
    # the reference engine's own command line
    ([*ENGINE, "--layers", "0"], ["--layers"]),
    ([*ENGINE, "--tp", "3"], ["--tp", "3"]),
    ([*ENGINE, "--device", "cuda"], ["--device", "cuda"]),
    ([*ENGINE, "--prompt-len", "9000"], ["--prompt-len", "9000", "8192"]),
    ([*ENGINE, "--windows", "x,y"], ["--windows", "x,y"]),
    ([*ENGINE, "--connector-extra", "{"], ["--connector-extra"]),
    ([*ENGINE, "--num-prompts", "0"], ["--num-prompts", "0"]),
    ([*ENGINE, "--dtype", "int8"], ["--dtype", "float32"]),
    ([*ENGINE, "--kv-manager", "v9"], ["--kv-manager", "v9"]),
    ([*ENGINE, "--max-num-tokens", "8"], ["--max-num-tokens", "tokens_per_block 32"]),
]


def _id(case: tuple[list[str], list[str]]) -> str:
    argv = case[0][2:] if case[0][:2] == ENGINE else case[0]
    return ("engine " if case[0][:2] == ENGINE else "") + " ".join(argv)


# The cases run through the real entry point in a subprocess: one per command (for demo,
# serve and the engine one whose checks import torch, so the whole import chain of the
# command is in it).
SUBPROCESS = {
    "demo --windows sixty",
    "bench transfer --page-sizes 64KB",
    "serve --config ZMQ",
    "proxy",
    "config check BADHOST",
    "keys ../evil",
    "launch",
    "engine --layers 0",
}
assert SUBPROCESS <= {_id(c) for c in CASES}


def _run_subprocess(argv: list[str]) -> tuple[int, str, str]:
    cmd = [sys.executable, *argv] if argv[:2] == ENGINE else [sys.executable, "-m", "disagg", *argv]
    env = {k: v for k, v in os.environ.items() if "DISAGG_CONFIG" not in k}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env, cwd=Path.cwd())
    return r.returncode, r.stdout, r.stderr


def _run_in_process(
    argv: list[str], capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    """The command's ``main(argv)``, as ``python -m disagg`` (or the engine's
    ``__main__``) calls it: its return value or ``SystemExit`` code is the exit status.
    Captured at the file descriptors, so output from any layer counts."""
    from disagg.cli import main
    from disagg.engine.reference.__main__ import main as engine_main

    for k in [k for k in os.environ if "DISAGG_CONFIG" in k]:
        monkeypatch.delenv(k)
    capfd.readouterr()
    try:
        rc = engine_main(argv[2:]) if argv[:2] == ENGINE else main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capfd.readouterr()
    return rc, out, err


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_is_one_line_exit_2(
    case: tuple[list[str], list[str]], files, capfd, monkeypatch
) -> None:
    argv, names = case
    if "cuda" in argv and _cuda():
        pytest.skip("CUDA is available here: the value is good")
    real = _id(case) in SUBPROCESS
    argv = [files.get(a, a) for a in argv]
    if real:
        rc, stdout, stderr = _run_subprocess(argv)
    else:
        rc, stdout, stderr = _run_in_process(argv, capfd, monkeypatch)
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert rc == 2, (rc, stderr)
    assert "Traceback" not in stderr and "Traceback" not in stdout
    assert len(lines) == 1, stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert not stdout.strip(), stdout
