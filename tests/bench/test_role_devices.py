"""Per-role devices without a GPU: ``store_device: cuda:N`` (syntax at load, the GPU at the
producer's attach), the benches' ``--producer-device`` / ``--consumer-device`` (parsing,
one-line refusals) and that each role's device reaches its engine, store and plane row.
CUDA itself is faked only where the code asks torch what exists; cases that need a real
GPU (peer access, the cross-GPU kernel) run in ``disagg bench gpu`` on a lent H200."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg.bench import deploy, devices, main
from disagg.bench import overhead as ovh
from disagg.bench.transfer import Roles
from disagg.config import ConfigError, DisaggConfig, store_device_for
from disagg.transport import cuda_driver
from disagg.transport.page_copy import peer_reachable


def producer(store_device: str) -> dict[str, Any]:
    return {"role": "producer", "producer": {"store_size": "1MiB", "store_device": store_device}}


@pytest.mark.parametrize("value", ["cpu", "pinned", "cuda", "cuda:0", "cuda:7"])
def test_store_device_names_load_and_round_trip(value: str) -> None:
    cfg = DisaggConfig.from_dict(producer(value))
    assert cfg.producer is not None and cfg.producer.store_device == value
    assert DisaggConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "cuda0", "CUDA:1", 1])
def test_bad_store_device_names_the_field_and_the_choices(value: Any) -> None:
    with pytest.raises(ConfigError) as e:
        DisaggConfig.from_dict(producer(value))
    assert e.value.field == "producer.store_device"
    assert "cuda:N" in str(e.value) and "\n" not in str(e.value)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch says two GPUs exist, cuda:0 current (nothing is allocated on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.usefixtures("two_gpus")
@pytest.mark.parametrize(
    "value,pool,want",
    [
        ("cuda", "cuda:1", "cuda:1"),  # the KV cache's GPU, not the thread's current one
        ("cuda", "cuda:0", "cuda:0"),
        ("cuda:1", "cuda:1", "cuda:1"),
        ("pinned", "cuda:1", "pinned"),
        ("cpu", "cuda:1", "cpu"),
        ("cuda", "cpu", "cuda:0"),  # a host engine with a device store: the current GPU
    ],
)
def test_store_device_resolves_to_the_engines_gpu(value: str, pool: str, want: str) -> None:
    assert store_device_for(value, torch.device(pool)) == want


@pytest.mark.usefixtures("two_gpus")
@pytest.mark.parametrize(
    "value,pool,needle",
    [
        ("cuda:1", "cuda:0", "KV cache is on cuda:0"),
        ("cuda:2", "cuda:0", "only 2 CUDA device(s)"),
    ],
)
def test_store_device_on_another_or_missing_gpu_is_refused(
    value: str, pool: str, needle: str
) -> None:
    with pytest.raises(ConfigError) as e:
        store_device_for(value, torch.device(pool))
    assert e.value.field == "producer.store_device"
    assert needle in str(e.value) and "use" in str(e.value)


def test_store_device_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        store_device_for("cuda:0", "cpu")
    assert e.value.field == "producer.store_device" and "store_device: cpu or pinned" in str(
        e.value
    )


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["gpu", "--producer-device", "gpu1"], "'gpu1' is not a GPU; use cuda or cuda:N"),
        (["transfer", "--consumer-device", "cpu"], "'cpu' is not a GPU"),
        (["serve", "--quick", "--rate", "1", "--producer-device", "tpu"], "is not a device"),
        (["overhead", "--consumer-device", "cuda:x"], "is not a device"),
    ],
)
def test_bad_role_device_is_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
@pytest.mark.parametrize(
    "argv",
    [
        ["transfer", "--transports", "ipc-cuda", "--producer-device", "cuda:1"],
        ["serve", "--quick", "--rate", "1", "--consumer-device", "cuda:1"],
        ["overhead", "--producer-device", "cuda:1"],
    ],
)
def test_role_device_without_cuda_is_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code  # type: ignore[assignment]
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "'cuda:1'" in err and "device" in err and len(err.splitlines()) == 1, err


def test_role_devices_default_to_the_single_device() -> None:
    ap = argparse.ArgumentParser()
    devices.add_role_devices(ap, None, cpu=True)
    args = ap.parse_args(["--consumer-device", "cuda:1"])
    devices.resolve(args, "cuda:0")
    assert (args.producer_device, args.consumer_device) == ("cuda:0", "cuda:1")
    assert (
        devices.problem(argparse.Namespace(producer_device="cpu", consumer_device="cpu"), True)
        is None
    )


def _device_flag(cmd: list[str]) -> str:
    return cmd[cmd.index("--device") + 1]


def test_aggregated_puts_one_instance_per_device(tmp_path: Path) -> None:
    shape = deploy.Shape(device="cuda:0")
    d = deploy.aggregated(3, shape, tmp_path, ["cuda:0", "cuda:1"])
    assert [_device_flag(p.cmd) for p in d.procs] == ["cuda:0", "cuda:1", "cuda:0"]
    same = deploy.aggregated(2, shape, tmp_path, ["cuda:0", "cuda:0"])  # today's run
    assert [_device_flag(p.cmd) for p in same.procs] == ["cuda:0", "cuda:0"]
    assert same.layout == "2 instances"


def test_disaggregated_puts_each_role_on_its_device(tmp_path: Path) -> None:
    shape = deploy.Shape(device="cuda:0")
    d = deploy.disaggregated(
        1, 1, shape, tmp_path, "ipc", store_device="cuda", consumer_device="cuda:1"
    )
    by_name = {p.name: p.cmd for p in d.procs}
    assert _device_flag(by_name["producer-0"]) == "cuda:0"
    assert _device_flag(by_name["consumer-0"]) == "cuda:1"
    assert "store_device: cuda\n" in (tmp_path / "producer-0.yaml").read_text()


def test_overhead_engines_take_their_roles_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    import disagg.engine.reference as ref

    built: list[Any] = []
    monkeypatch.setattr(ref, "Engine", lambda cfg, connector=None: built.append(cfg) or cfg)
    monkeypatch.setattr(ref, "EngineConfig", lambda **kw: argparse.Namespace(**kw))
    args = argparse.Namespace(
        lens=[256], device="cpu", producer_device="cuda:0", consumer_device="cuda:1",
        transport="ipc", store_size="1GiB", store_device="cuda", dtype="float32", layers=2,
        seed=0, **{k.replace("-", "_"): v for k, v in ovh.SHAPE.items()},
    )  # fmt: skip
    ovh._engine(args, "producer", "tcp://127.0.0.1:1")
    ovh._engine(args, "consumer", "tcp://127.0.0.1:1")
    ovh._engine(args, None)
    assert [c.device for c in built] == ["cuda:0", "cuda:1", "cuda:1"]
    flags = ovh._shape_flags(args)  # what the producer process is started with
    assert flags[flags.index("--producer-device") + 1] == "cuda:0"


def test_transfer_roles_place_only_device_rows() -> None:
    assert Roles("cuda:0", "cuda:1").of("ipc-shm", "consumer") == "cpu"
    assert Roles().ceiling("shm") == "memcpy"
    assert Roles("cuda:0", "cuda:1").ceiling("tcp") == "raw_tcp"


@pytest.mark.usefixtures("two_gpus")
def test_transfer_ceiling_between_two_gpus_is_the_page_kernel() -> None:
    assert Roles("cuda:0", "cuda:1").ceiling("d2d") == "peer_pages"
    assert Roles("cuda:0", "cuda:0").ceiling("d2d") == "d2d"
    assert Roles("cuda", "cuda:0").ceiling("d2d") == "d2d"  # cuda: the current GPU
    assert devices.label("cuda:0", "cuda:0") == "cuda:0 (same device)"
    assert devices.label("cuda:0", "cuda:1") == "cuda:0 -> cuda:1"


def test_peer_access_on_one_gpu_or_the_host() -> None:
    assert cuda_driver.enable_peer_access(1, 1) is None  # one GPU: nothing to enable
    assert peer_reachable(torch.device("cpu"), torch.device("cpu"))
    assert not peer_reachable(torch.device("cuda:0"), torch.device("cpu"))


@pytest.mark.skipif(cuda_driver._lib() is not None, reason="libcuda is loadable here")
def test_peer_access_without_a_driver_says_why() -> None:
    why = cuda_driver.enable_peer_access(0, 1)
    assert why is not None and "libcuda" in why
    assert not peer_reachable(torch.device("cuda:0"), torch.device("cuda:1"))


def test_producer_attach_refuses_a_store_on_a_missing_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness import SHAPE, make_producer

    from disagg.engine.reference import EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as e:  # the connector's registration fails, by field
        make_producer(EngineConfig(**SHAPE), store_device="cuda:1")
    assert e.value.field == "producer.store_device" and "is cuda:1 but" in str(e.value)
