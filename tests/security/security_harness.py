"""Shared helpers for the security tests: in-process producer/consumer reference engines
(as in tests/e2e) whose configs may carry a ``security`` section, and CURVE key files."""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any

import zmq

from disagg.consumer.service import _services as consumer_services
from disagg.engine.reference import ConnectorSpec, Engine, EngineConfig
from disagg.producer.service import _services as producer_services

_ids = itertools.count()

SHAPE = dict(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    tokens_per_block=16,
    num_blocks=256,
)


def prompts(n: int = 3, length: int = 200, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(512) for _ in range(length // 2)]
    return [shared + [rng.randrange(512) for _ in range(length - len(shared))] for _ in range(n)]


def close_all_services() -> None:
    for svc in [*producer_services.values(), *consumer_services.values()]:
        svc.close()


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


def make_producer(
    cfg: EngineConfig, security: dict[str, Any] | None = None, **section: Any
) -> tuple[Engine, Any]:
    name = f"sp{next(_ids)}"
    conf: dict[str, Any] = {
        "role": "producer",
        "instance_id": name,
        "producer": {"control": "tcp://127.0.0.1:0", "store_size": "64MiB", **section},
    }
    if security is not None:
        conf["security"] = security
    eng = Engine(
        cfg,
        ConnectorSpec(
            "disagg.producer", "ProducerScheduler", "ProducerWorker", extra={"config": conf}
        ),
    )
    return eng, producer_services[name]


def make_consumer(
    cfg: EngineConfig,
    endpoints: list[str],
    security: dict[str, Any] | None = None,
    **section: Any,
) -> tuple[Engine, Any]:
    name = f"sc{next(_ids)}"
    conf: dict[str, Any] = {
        "role": "consumer",
        "instance_id": name,
        "consumer": {"producers": list(endpoints), "claim_timeout_s": 0.5, **section},
    }
    if security is not None:
        conf["security"] = security
    eng = Engine(
        cfg,
        ConnectorSpec(
            "disagg.consumer", "ConsumerScheduler", "ConsumerWorker", extra={"config": conf}
        ),
    )
    return eng, consumer_services[name]


def run(eng: Engine, ps: list[list[int]], max_tokens: int, salt: str | None = None) -> list[Any]:
    ids = [eng.add_request(p, max_tokens, cache_salt=salt) for p in ps]
    while eng.has_work():
        eng.step()
    return [eng.results[i] for i in ids]


def wait_for(cond: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())
