"""deploy/: the trtllm-serve YAMLs against TensorRT-LLM's connector bring-up rules, the example
disagg configs, launch.sh, the Dockerfile and the docker-compose file."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from disagg.config import check_llm_api_options, load_config, trtllm_llm_api_options

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ROLES = ("producer", "consumer")
CLASSES = {
    "producer": ("disagg.producer", "ProducerScheduler", "ProducerWorker"),
    "consumer": ("disagg.consumer", "ConsumerScheduler", "ConsumerWorker"),
}
# KvCacheConnectorConfig is a StrictBaseModel: only these keys (the preset `connector` and
# `server_url` exist in newer releases only; we name module and classes explicitly).
KCC_KEYS = {"connector_module", "connector_scheduler_class", "connector_worker_class"}


def trtllm_yaml(role: str) -> dict:
    return yaml.safe_load((DEPLOY / "trtllm" / f"{role}.yaml").read_text())


@pytest.mark.parametrize("role", ROLES)
def test_kv_connector_config(role):
    kcc = trtllm_yaml(role)["kv_connector_config"]
    assert set(kcc) == KCC_KEYS
    module, sched, worker = CLASSES[role]
    assert kcc == {
        "connector_module": module,
        "connector_scheduler_class": sched,
        "connector_worker_class": worker,
    }


@pytest.mark.parametrize("role", ROLES)
def test_named_classes_exist(role):
    module_name, sched, worker = CLASSES[role]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        pytest.skip(f"{module_name} does not import yet ({e}); class names not checked")
    for name in (sched, worker):
        if not hasattr(module, name):
            pytest.skip(f"{module_name}.{name} does not exist yet; class names not checked")
    from disagg.engine import KvCacheConnectorScheduler, KvCacheConnectorWorker

    assert issubclass(getattr(module, sched), KvCacheConnectorScheduler)
    assert issubclass(getattr(module, worker), KvCacheConnectorWorker)


@pytest.mark.parametrize("role", ROLES)
def test_bring_up_rules(role):
    opts = trtllm_yaml(role)
    kv = opts["kv_cache_config"]
    assert kv["enable_block_reuse"] is True  # reuse off -> rejected / prefix ignored
    assert kv.get("enable_partial_reuse") is False  # non-aligned match declined
    assert "cuda_graph_config" in opts and opts["cuda_graph_config"] is None  # CUDA graphs
    for key in ("host_cache_size", "disk_cache_size"):  # secondary tier > 0 refused
        assert not kv.get(key), key
    assert opts.get("max_beam_width", 1) == 1  # beams refused
    assert opts.get("speculative_config") is None  # speculative decoding refused
    for key in ("pipeline_parallel_size", "pp_size", "context_parallel_size", "cp_size"):
        assert opts.get(key, 1) == 1, key  # PP/CP refused
    policy = opts.get("scheduler_config", {}).get("capacity_scheduler_policy")
    assert policy in (None, "GUARANTEED_NO_EVICT")  # V1 needs GUARANTEED_NO_EVICT
    assert not opts.get("enable_attention_dp")  # ADP needs supports_attention_dp
    assert check_llm_api_options(opts) == []


@pytest.mark.parametrize("role", ROLES)
def test_every_key_is_known(role):
    """No key outside the set we checked above, so nothing unreviewed slips in."""
    opts = trtllm_yaml(role)
    assert set(opts) <= {
        "kv_connector_config",
        "kv_cache_config",
        "cuda_graph_config",
        "max_beam_width",
        "scheduler_config",
        "enable_attention_dp",
    }
    assert set(opts["kv_cache_config"]) <= {"enable_block_reuse", "enable_partial_reuse"}
    assert set(opts.get("scheduler_config", {})) <= {"capacity_scheduler_policy"}


@pytest.mark.parametrize("role", ROLES)
def test_yaml_matches_generator(role):
    """`disagg serve --engine trtllm` writes trtllm_llm_api_options(role): same keys as the file."""
    assert trtllm_yaml(role) == trtllm_llm_api_options(role)


@pytest.mark.parametrize("role", ROLES)
def test_every_key_commented(role):
    text = (DEPLOY / "trtllm" / f"{role}.yaml").read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#"):  # a key, at any depth
            above = lines[i - 1].lstrip() if i else ""
            assert above.startswith("#") or "#" in line, f"key without a comment: {line}"


@pytest.mark.parametrize(
    "path",
    ["producer.yaml", "consumer.yaml", "compose/producer.yaml", "compose/consumer.yaml"],
)
def test_example_disagg_configs_load(path):
    cfg = load_config(DEPLOY / path)
    assert cfg.role == Path(path).stem


def test_compose_configs_point_at_each_other():
    prod = load_config(DEPLOY / "compose/producer.yaml")
    cons = load_config(DEPLOY / "compose/consumer.yaml")
    assert prod.producer is not None and cons.consumer is not None
    port = prod.producer.control.rsplit(":", 1)[1]
    assert cons.consumer.producers == (f"tcp://{prod.producer.advertise_host}:{port}",)


def test_launch_sh_syntax():
    script = DEPLOY / "launch.sh"
    assert os.access(script, os.X_OK), "launch.sh must be executable"
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_launch_sh_builds_serve_command(tmp_path):
    env = dict(os.environ, ROLE="consumer", DISAGG="echo", PORT="9999", MODEL="m")
    env.pop("DISAGG_CONFIG", None)
    r = subprocess.run(
        ["bash", str(DEPLOY / "launch.sh"), "--extra"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout.split() == [
        "serve",
        "--role",
        "consumer",
        "--engine",
        "reference",
        "--config",
        str(DEPLOY / "consumer.yaml"),
        "--port",
        "9999",
        "--model",
        "m",
        "--extra",
    ]
    bad = subprocess.run(
        ["bash", str(DEPLOY / "launch.sh")],
        env=dict(env, ROLE="prefill"),
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "ROLE=producer" in bad.stderr


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    froms = [ln.split()[1] for ln in text.splitlines() if ln.startswith("FROM")]
    assert froms == ["python:3.11-slim", "python:3.11-slim"]  # build stage, then the image
    torch_at = text.index('pip install "torch==${TORCH_VERSION}"')
    assert "TORCH_VERSION=2.13.0" in text and "whl/cpu" in text
    assert torch_at < text.index("RUN pip install /wheels/")  # torch first, never a CUDA pull


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_structure():
    c = compose()
    services = c["services"]
    assert {"prefill", "decode", "proxy"} <= set(services)
    assert services["prefill"]["profiles"] == ["cpu"]
    assert services["prefill"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert set(services["proxy"]["profiles"]) == {"cpu", "gpu"}
    gpu = [s for s in services.values() if "gpu" in s.get("profiles", []) and "image" in s]
    gpu_nodes = [s for s in gpu if "nvcr.io/nvidia/tensorrt-llm/release" in s["image"]]
    assert len(gpu_nodes) == 2
    for s in gpu_nodes:
        devices = s["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert s["environment"]["ENGINE"] == "trtllm"
    # compose-spec-only features docker-compose v1 does not know
    assert "include" not in c
    assert all("develop" not in s for s in services.values())


def test_compose_validates():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip(
            "docker-compose (v1) is not installed; .ci/run installs it with apt-get when it can "
            "(`docker compose` v2 needs a plugin this machine lacks)"
        )
    for profile in ("cpu", "gpu"):
        r = subprocess.run(
            [exe, "-f", str(DEPLOY / "docker-compose.yml"), "--profile", profile, "config", "-q"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr


def _copied(text: str) -> list[str]:
    """Sources of the Dockerfile's COPY lines that copy from the build context."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            out += [w.rstrip("/") for w in words[1:-1]]
    return out


def test_dockerfile_copies_what_builds_the_native_helpers():
    """The image builds from setup.py (the C helpers) and pyproject.toml (and the readme it
    names); every C source setup.py compiles is under a copied folder; a compiler is
    there; and every compiled helper is imported at build time, so a failed compile
    (setup.py marks them optional) fails the build instead of running the slow paths."""
    import re

    text = (DEPLOY / "Dockerfile").read_text()
    setup = (ROOT / "setup.py").read_text()
    copied = _copied(text)
    readme = re.search(r'^readme = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    needed = ["pyproject.toml", "setup.py", readme, *re.findall(r'"(disagg/[^"]+\.c)"', setup)]
    for path in needed:
        assert (ROOT / path).is_file(), path
        assert any(path == c or path.startswith(c + "/") for c in copied), (path, copied)
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert not set(needed) & set(ignored)
    assert "gcc" in text and "pip wheel" in text
    for module in re.findall(r'Extension\(\s*"([^"]+)"', setup):
        assert f"'{module}'" in text, f"{module} is not checked in the image"


def test_compose_servers_bind_every_interface_explicitly():
    """disagg serve/proxy bind 127.0.0.1 by default; in a container the other services and
    the published ports need 0.0.0.0, so each server in the compose file says so."""
    services = compose()["services"]
    for name, s in services.items():
        cmd = s.get("command") or []
        assert "--host" in cmd and cmd[cmd.index("--host") + 1] == "0.0.0.0", name
    for role in ROLES:
        cfg = load_config(DEPLOY / "compose" / f"{role}.yaml")
        assert cfg.metrics.port and cfg.metrics.host == "0.0.0.0"  # published, scraped
        local = load_config(DEPLOY / f"{role}.yaml")
        assert local.metrics.host == "127.0.0.1"


def test_compose_paths_and_defaults_work_as_written():
    """Relative paths in a compose file resolve against its folder (deploy/): the models
    folder is the repository's models/, and MODEL has a real default."""
    services = compose()["services"]
    gpu = [s for s in services.values() if s.get("environment", {}).get("ENGINE") == "trtllm"]
    assert gpu
    for s in gpu:
        model = s["environment"]["MODEL"]
        assert model.startswith("${MODEL:-") and len(model) > len("${MODEL:-}"), model
        volumes = dict(v.rsplit(":", 2)[:2] for v in s["volumes"] if ":ro" in v)
        models = volumes["${MODELS_DIR:-../models}"]
        assert models == "/models"
        assert (DEPLOY / "../models").resolve() == ROOT / "models"
        assert (DEPLOY / "..").resolve() == ROOT and "..:/opt/disagg" in s["volumes"]
