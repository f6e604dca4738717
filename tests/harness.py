"""Shared test helpers: in-process producer/consumer reference engines wired to disagg's
connectors, prompts with a shared prefix, and polling. Importable from any test folder
(tests/conftest.py puts this folder on sys.path)."""

from __future__ import annotations

import itertools
import multiprocessing.context
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from disagg.consumer.service import _registry as consumer_registry
from disagg.consumer.service import _services as consumer_services
from disagg.engine.reference import ConnectorSpec, Engine, EngineConfig
from disagg.producer.service import _registry as producer_registry
from disagg.producer.service import _services as producer_services
from disagg.protocol import messages as m
from disagg.protocol.errors import ErrorCode, ProtocolError

_ids = itertools.count()

# DISAGG_TEST_DEVICE=cuda runs the same cases on a GPU (CI has none: this is for the H200).
DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cpu")
SHAPE: dict[str, Any] = dict(
    device=DEVICE,
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    tokens_per_block=16,
    num_blocks=256,
)


def pattern_rows(rows: int, width: int, salt: int = 0) -> np.ndarray:
    """``rows`` x ``width`` bytes, byte c of row r being ``(r * 131 + c * 7 + salt) % 251``:
    every row differs, and every byte of a row. Row r is the sequence ``(j * 7) % 251``
    from j = k_r on, where ``k_r * 7 = r * 131 + salt (mod 251)`` (36 is 7's inverse), so
    the slab is one gather of windows: 0.05 s for 128 MiB, where the int64 formula took 14 s."""
    base = (np.arange(width + 251, dtype=np.int64) * 7 % 251).astype(np.uint8)
    shift = (np.arange(rows, dtype=np.int64) * 131 + salt) * 36 % 251
    return np.lib.stride_tricks.sliding_window_view(base, width)[shift]


class _EnvProcess(multiprocessing.context.ForkServerProcess):
    """Runs with the environment its parent had when making it (as a spawned child would),
    not the fork server's, which was taken when the server started."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._environ = dict(os.environ)

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class _SpawnContext(multiprocessing.context.ForkServerContext):
    Process = _EnvProcess  # type: ignore[assignment]


def spawn_context() -> Any:
    """A multiprocessing context for test children that start without the parent's state,
    as ``spawn`` does, but from a fork server that has imported numpy and torch once (1.6 s
    of every child's start otherwise). Nothing that reads the environment at import (UCX,
    DISAGG_* switches) is preloaded, and each child runs with its parent's environment of
    the moment it was made."""
    ctx = _SpawnContext()
    ctx.set_forkserver_preload(["numpy", "torch"])
    return ctx


def prompts(n: int = 3, length: int = 200, seed: int = 1) -> list[list[int]]:
    """``n`` prompts whose first half is shared (a common system prompt)."""
    rng = random.Random(seed)
    shared = [rng.randrange(512) for _ in range(length // 2)]
    return [shared + [rng.randrange(512) for _ in range(length - len(shared))] for _ in range(n)]


def close_all_services() -> None:
    for svc in [*producer_registry.live(), *consumer_registry.live()]:  # every TP rank
        svc.close()


def _engine(cfg: EngineConfig, role: str, conf: dict[str, Any]) -> Engine:
    cls = role.capitalize()
    spec = ConnectorSpec(
        f"disagg.{role}", f"{cls}Scheduler", f"{cls}Worker", extra={"config": conf}
    )
    return Engine(cfg, spec)


def make_producer(
    cfg: EngineConfig,
    security: dict[str, Any] | None = None,
    transport: str | None = None,
    top: dict[str, Any] | None = None,
    **section: Any,
) -> tuple[Engine, Any]:
    """A producer engine and its service (control on a free loopback port);
    ``transport`` sets the top-level data plane (``tcp``/``ucx``/``ipc``), ``top`` adds other
    top-level keys (``ucx_channel``...)."""
    name = f"p{next(_ids)}"
    conf: dict[str, Any] = {
        "role": "producer",
        "instance_id": name,
        "producer": {"control": "tcp://127.0.0.1:0", "store_size": "64MiB", **section},
    }
    if security is not None:
        conf["security"] = security
    if transport is not None:
        conf["transport"] = transport
    conf.update(top or {})
    return _engine(cfg, "producer", conf), producer_services[name]


def rank_services(svc: Any) -> list[Any]:
    """Every TP rank's service of ``svc``'s instance (rank order), ``svc`` being rank 0's."""
    reg = producer_registry if svc.role == "producer" else consumer_registry
    ranks = reg.ranks(svc.name)
    assert [s.tp_rank for s in ranks] == list(range(svc.tp_size))
    return ranks


def rank_endpoints(psvc: Any) -> list[str]:
    """A TP producer's control endpoints, rank order (for ``consumer.producers`` entries)."""
    return [s.endpoint for s in rank_services(psvc)]


def make_consumer(
    cfg: EngineConfig,
    endpoints: list[Any],
    model_id: str | None = None,
    security: dict[str, Any] | None = None,
    transport: str | None = None,
    top: dict[str, Any] | None = None,
    **section: Any,
) -> tuple[Engine, Any]:
    """A consumer engine claiming from ``endpoints`` (each an endpoint, or a TP producer's
    rank endpoints as a list), and its rank-0 service."""
    name = f"c{next(_ids)}"
    conf: dict[str, Any] = {
        "role": "consumer",
        "instance_id": name,
        "model_id": model_id,
        # generous: a claim that times out is a (correct) miss, but these tests want hits
        # even on a loaded 2-core CI machine; tests of the miss path pass their own value
        "consumer": {"producers": list(endpoints), "claim_timeout_s": 3.0, **section},
    }
    if security is not None:
        conf["security"] = security
    if transport is not None:
        conf["transport"] = transport
    conf.update(top or {})
    return _engine(cfg, "consumer", conf), consumer_services[name]


def run(eng: Engine, ps: list[list[int]], max_tokens: int, salt: str | None = None) -> list[Any]:
    """Add every prompt, step until idle, return the results in order."""
    ids = [eng.add_request(p, max_tokens, cache_salt=salt) for p in ps]
    while eng.has_work():
        eng.step()
    return [eng.results[i] for i in ids]


def random_prompt(seed: int, n: int = 96) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def run_one(eng: Engine, prompt: list[int], max_tokens: int) -> Any:
    """One request to its end, the engine stepped until idle: its result."""
    rid = eng.add_request(prompt, max_tokens)
    while not eng.results[rid].finished or eng.has_work():
        eng.step()
    return eng.results[rid]


def continue_after(cons: Engine, prompt: list[int], first: int, max_tokens: int) -> Any:
    """The continuation the proxy sends: prompt + the producer's token, the rest to go."""
    return run_one(cons, prompt + [first], max_tokens - 1)


def check_against_monolithic(produced: list[Any], consumed: list[Any], mono: list[Any]) -> None:
    """Every consumed request finished without error with the monolithic run's tokens,
    matched tokens through the connector, and loaded pages equal, byte for byte, to the
    pages the producer computed."""
    assert [r.error for r in consumed] == [None] * len(consumed)
    assert [r.tokens for r in consumed] == mono
    assert all(r.connector_matched_tokens > 0 for r in consumed)
    for p, c in zip(produced, consumed, strict=True):
        assert c.loaded_pages, "the consumer loaded no page"
        for where, data in c.loaded_pages.items():
            assert data == p.computed_pages[where], f"page {where} differs from the producer's"


def wait_for(cond: Callable[[], Any], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def fail_on_rank1(csvc1: Any, target: int, how: str = "transfer") -> list[int]:
    """Consumer rank 1's load of request ``target`` (legacy or a prefix reservation's)
    fails; rank 0's lands. ``transfer``:
    the data plane fails the transfer before a byte of it arrives (as when producer rank 1
    dies mid-push: learned by polling the plane); ``push``: producer rank 1 refuses the
    Push (its lease is gone: learned by ``dispatch`` on the engine thread). Returns the
    request ids hit."""
    hit: list[int] = []

    def load_of(rid: int) -> Any:  # a legacy load, or a prefix reservation's
        load = csvc1.loads.get(rid)
        if load is None:
            load = next((x for x in csvc1.prefix_loads.values() if x.request_id == rid), None)
        return load

    if how == "transfer":
        plane = csvc1.data
        expect = plane.expect

        def expect_then_fail(tid: int, *a: Any, **kw: Any) -> None:
            expect(tid, *a, **kw)
            load = load_of(target)
            if load is not None and load.transfer_id == tid:
                hit.append(target)
                plane.abort(tid, "injected: producer rank 1 died mid-push")

        plane.expect = expect_then_fail
    else:
        call = csvc1._call

        def refuse(link: Any, msg: Any, *a: Any, **kw: Any) -> Any:
            load = load_of(target)
            if (
                isinstance(msg, m.Push)
                and load is not None
                and msg.lease_id == load.claimed.lease_id
            ):
                hit.append(target)
                raise ProtocolError(ErrorCode.UNKNOWN_LEASE, "injected: lease lost on rank 1")
            return call(link, msg, *a, **kw)

        csvc1._call = refuse
    return hit


def stop_after_first_landing(q_out: Any) -> None:
    """For a child process of the UCX kill tests: once its first batch of pages has
    landed, put "stopping" on ``q_out`` (flushed) and stop the whole process (SIGSTOP),
    so the sender has work in flight when the test kills it."""
    import signal

    from disagg.transport import receiver

    orig = receiver.ReceiverBook.landed

    def landed(self: Any, *a: Any, **kw: Any) -> None:
        orig(self, *a, **kw)
        q_out.put("stopping")
        q_out.close()
        q_out.join_thread()  # flushed before the whole process stops
        os.kill(os.getpid(), signal.SIGSTOP)

    receiver.ReceiverBook.landed = landed  # type: ignore[method-assign]


def stop_processes(procs: list[Any]) -> None:
    """Join each process (15 s), killing one that is still alive."""
    for p in procs:
        if p is None:
            continue
        p.join(15)
        if p.is_alive():
            p.kill()


def hold_pushes(psvc: Any) -> tuple[threading.Event, threading.Event]:
    """Every push of ``psvc`` waits, on its push worker before the data plane sees it, until
    ``go`` is set (any plane); ``started`` is set when the first one is held."""
    started, go = threading.Event(), threading.Event()
    post = psvc.data.post_push

    def held(*args: Any, **kw: Any) -> Any:
        started.set()
        go.wait(30)
        return post(*args, **kw)

    psvc.data.post_push = held
    return started, go
