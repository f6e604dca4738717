"""Start-up failures of `disagg serve` / `disagg proxy`, the trtllm YAML, the tokenizer, the
routing rules and /health's failure path (no servers needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import serve_procs as sp
import yaml

from disagg.config import check_llm_api_options, trtllm_llm_api_options


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "disagg", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env or sp.env(),
    )


@pytest.fixture
def configs(tmp_path: Path) -> tuple[Path, Path]:
    return sp.write_configs(tmp_path)


def test_trtllm_missing_exits_nonzero_with_message(configs: tuple[Path, Path]) -> None:
    env = dict(sp.env(), PATH=str(Path(sys.executable).parent))  # no trtllm-serve there
    r = run_cli(
        "serve",
        "--role",
        "producer",
        "--config",
        str(configs[0]),
        "--engine",
        "trtllm",
        "--model",
        "m",
        env=env,
    )
    assert r.returncode == 3, r.stderr
    assert "TensorRT-LLM is not installed" in r.stderr and "--engine reference" in r.stderr


def test_trtllm_options_file_passes_contract(tmp_path: Path) -> None:
    from disagg.serve import trtllm

    for role in ("producer", "consumer"):
        path = trtllm.write_options(role, str(tmp_path))
        options = yaml.safe_load(path.read_text())
        assert options == trtllm_llm_api_options(role)
        assert check_llm_api_options(options) == []
        assert options["kv_connector_config"]["connector_module"] == f"disagg.{role}"
        cmd = trtllm.command("m", path, "0.0.0.0", 8100, [])
        assert cmd[:4] == ["trtllm-serve", "m", "--extra_llm_api_options", str(path)]


@pytest.mark.parametrize(
    "text, field",
    [
        ("role: producer\nproducer:\n  control: tcp://127.0.0.1:1\n", "producer.store_size"),
        ("role: producer\nproducer:\n  store_size: 4GB\n", "producer.store_size"),
        ("role: prefill\n", "role"),
        ("role: consumer\nconsumer:\n  producers: [http://x:1]\n", "consumer.producers"),
    ],
)
def test_config_errors_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    role = "consumer" if "consumer" in text else "producer"
    r = run_cli("serve", "--role", role, "--config", str(cfg), "--port", str(sp.free_port()))
    assert r.returncode == 2, r.stderr
    assert field in r.stderr, r.stderr


def test_role_mismatch_and_unknown_role(configs: tuple[Path, Path]) -> None:
    r = run_cli("serve", "--role", "consumer", "--config", str(configs[0]))
    assert r.returncode == 2 and "role:" in r.stderr and "--role producer" in r.stderr
    r = run_cli("serve", "--role", "decode", "--config", str(configs[1]))
    assert r.returncode == 2 and "--role" in r.stderr


def test_proxy_usage_errors() -> None:
    r = run_cli("proxy", "--producers", "http://127.0.0.1:1")
    assert r.returncode == 2 and "--consumers" in r.stderr
    r = run_cli("proxy", "--producers", "tcp://x:1", "--consumers", "http://127.0.0.1:2")
    assert r.returncode == 2 and "--producers" in r.stderr and "http" in r.stderr


def test_tokenizer_round_trip() -> None:
    from disagg.serve import tokenizer

    ids = tokenizer.encode("héllo")
    assert ids == list("héllo".encode()) and all(0 <= t < 256 for t in ids)
    assert tokenizer.decode(ids) == "héllo"
    assert tokenizer.decode([256 + 104, 105]) == "hi"


def test_parse_completion_errors_name_fields() -> None:
    from disagg.serve.app import BadRequest, parse_completion

    assert parse_completion({"prompt": [[1, 2]], "max_tokens": 3}) == (
        [1, 2],
        3,
        False,
        None,
        False,
    )
    for body, field in [
        ({"prompt": {}}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1], "max_tokens": "3"}, "max_tokens"),
        ({"prompt": [1], "stream": "yes"}, "stream"),
        ({"prompt": [1], "cache_salt": 5}, "cache_salt"),
    ]:
        with pytest.raises(BadRequest, match=field):
            parse_completion(body)


def test_routing_prefers_longest_prefix_then_least_loaded() -> None:
    from disagg.protocol import messages as m
    from disagg.protocol.version import PROTOCOL_VERSION
    from disagg.proxy.routing import PrefixIndex, Upstream, advertised, choose, prompt_keys

    assert advertised("tcp://0.0.0.0:5558", "http://prefill:8100") == "tcp://prefill:5558"
    assert advertised("tcp://10.0.0.1:5558", "http://prefill:8100") == "tcp://10.0.0.1:5558"
    seed = bytes(16)
    a, b = (
        Upstream(f"http://{n}", instance_id=n, tokens_per_block=4, seeds={None: seed}) for n in "ab"
    )
    idx = PrefixIndex()
    tokens = list(range(16))
    keys = prompt_keys(a, tokens, None)
    assert len(keys) == 4
    b.in_flight = 1
    order, matched = choose([a, b], idx, tokens, None)
    assert order[0] is a and matched == 0  # nothing held: least loaded
    idx.on_event(m.Stored(v=PROTOCOL_VERSION, producer="b", seq=1, keys=keys[:3]))
    order, matched = choose([a, b], idx, tokens, None)
    assert order[0] is b and matched == 3  # b holds 3 blocks, despite its load
    idx.on_event(m.Removed(v=PROTOCOL_VERSION, producer="b", seq=2, keys=keys[1:2]))
    idx.note_routed("a", keys[:2])  # a hint for a producer without events
    order, matched = choose([a, b], idx, tokens, None)
    assert order[0] is a and matched == 2
    idx.on_event(m.SnapshotOk(v=PROTOCOL_VERSION, producer="b", seq=5, keys=keys))
    assert choose([a, b], idx, tokens, None)[1] == 4
    assert choose([a, b], idx, tokens, "other-salt")[1] == 0  # unknown seed: no match
    # a prefix holder far busier than the least loaded producer loses its preference
    b.in_flight = 4
    assert choose([a, b], idx, tokens, None, max_skew=2)[0][0] is a
    assert choose([a, b], idx, tokens, None, max_skew=4)[0][0] is b
    assert choose([a, b], idx, tokens, None)[0][0] is b  # no bound: the prefix wins


class _DyingEngine:
    def __init__(self) -> None:
        from disagg.engine.reference import EngineStats

        self.stats = EngineStats()
        self.requests: dict = {}
        self.results: dict = {}

    def has_work(self) -> bool:
        return True

    def step(self) -> None:
        raise RuntimeError("boom")


def test_health_503_when_engine_loop_dies() -> None:
    import time

    from disagg.serve.app import health_of
    from disagg.serve.engine_loop import EngineLoop

    loop = EngineLoop(_DyingEngine)
    loop.start()
    for _ in range(100):
        if not loop.alive:
            break
        time.sleep(0.01)
    ok, details = health_of(loop, "producer")
    assert not ok and any("engine loop not running" in r for r in details["reasons"])
    with pytest.raises(RuntimeError, match="not running"):
        from disagg.serve.engine_loop import Job

        loop.submit(Job("r", [1], 1, None, lambda t: None, lambda e, i: None))


def test_proxy_event_stream_curve_keys(tmp_path: Path) -> None:
    """The proxy's keys for secured event streams go together and load from key files."""
    import argparse

    import zmq

    from disagg.cli import write_keypair
    from disagg.proxy import _events_curve

    write_keypair("proxy", tmp_path)
    server_public, _ = zmq.curve_keypair()
    ns = argparse.Namespace(
        events_secret_key_file=str(tmp_path / "proxy.key"),
        events_public_key_file=str(tmp_path / "proxy.key.pub"),
        events_server_key=server_public.decode(),
    )
    keys = _events_curve(ns)
    assert keys is not None
    ns.events_server_key = None
    with pytest.raises(ValueError, match="go together"):
        _events_curve(ns)
    assert (
        _events_curve(
            argparse.Namespace(
                events_secret_key_file=None, events_public_key_file=None, events_server_key=None
            )
        )
        is None
    )


def test_serve_defaults_to_loopback_and_the_configs_role(configs: tuple[Path, Path]) -> None:
    """Without --host it listens on 127.0.0.1 only; without --role it takes the file's."""
    port = sp.free_port()
    log = configs[0].parent / "serve-defaults.log"
    proc = sp.spawn(["serve", "--config", str(configs[0]), "--port", str(port)], log)
    try:
        sp.wait_healthy(f"http://127.0.0.1:{port}", proc, log)
        status, text = sp.get(f"http://127.0.0.1:{port}/health")
        assert status == 200 and '"role": "producer"' in text
        assert f"on http://127.0.0.1:{port}" in log.read_text()
    finally:
        sp.stop([proc])


def test_proxy_defaults_to_loopback() -> None:
    from disagg.proxy import build_parser

    assert build_parser().parse_args([]).host == "127.0.0.1"
    from disagg.serve import build_parser as serve_parser

    assert serve_parser().parse_args([]).host == "127.0.0.1"


def test_tp_size_from_the_flag_or_the_config_named_when_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--tp`` and ``tensor_parallel_size`` must agree where both are given; a size the KV
    heads cannot split over names the flag or the key that gave it; with ``--engine
    trtllm`` the size reaches trtllm-serve as ``--tp_size``."""
    from disagg import serve
    from disagg.serve import trtllm

    pcfg, _ = sp.write_configs(tmp_path)
    text = pcfg.read_text()
    two = tmp_path / "tp2.yaml"
    two.write_text(text.replace("role: producer\n", "role: producer\ntensor_parallel_size: 2\n"))
    three = tmp_path / "tp3.yaml"
    three.write_text(text.replace("role: producer\n", "role: producer\ntensor_parallel_size: 3\n"))
    for args, said in (
        (["--config", str(two), "--tp", "1"], f"argument --tp: 1 but {two} says tensor_par"),
        (["--config", str(pcfg), "--tp", "3"], "engine shape: argument --tp: tp 3 neither "),
        (["--config", str(three)], f"config error: tensor_parallel_size: 3 ({three}): tp 3 "),
    ):
        assert serve.main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"disagg serve: {said}") and "\n" not in err, err
    ran: list[list[str]] = []
    monkeypatch.setattr(trtllm, "run", lambda *a: ran.append(a[-1]) or 0)
    assert serve.main(["--config", str(two), "--engine", "trtllm", "--model", "m"]) == 0
    assert ran == [["--tp_size", "2"]]


@pytest.mark.parametrize(("env", "frozen"), [("", True), ("0", False)])
def test_a_started_server_freezes_its_heap_unless_told_not_to(env: str, frozen: bool) -> None:
    """``tuning.gc_freeze``: a server, once up, moves its start-up heap out of the
    collector's reach (``run_app`` calls ``freeze_heap`` after the site starts)."""
    code = (
        "import gc; from disagg.serve.runner import freeze_heap; "
        "n = gc.get_freeze_count(); freeze_heap(); print(n, gc.get_freeze_count())"
    )
    import os

    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "DISAGG_GC_FREEZE": env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert before == 0 and (after > 1000) == frozen
