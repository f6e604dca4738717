"""Chaos matrix: a peer killed with SIGKILL (or its network cut) at each point of a load.

The killed role runs in its own process (``chaos_role.py``); the surviving role runs in
this process so its state can be inspected directly. Every case checks the consumer's
rules: each request returns the monolithic tokens or fails with an error naming a request,
within its deadline; no wrong token; the survivor's leases and store return to baseline.

Short timeouts keep each case within a few seconds: leases 1 s, heartbeats 0.2 s, an owner
declared dead after 0.6 s of silence, loads and pushes bounded at 3 s.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from harness import SHAPE, close_all_services, prompts

from disagg.consumer.service import _services as consumer_services
from disagg.engine.reference import ConnectorSpec, Engine, EngineConfig
from disagg.producer.service import _services as producer_services

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]

ROLE = str(Path(__file__).with_name("chaos_role.py"))
# The child imports this checkout's disagg (a worktree's), not whichever one is installed.
_CHILD_PATH = os.pathsep.join(
    p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p
)
CFG = EngineConfig(**SHAPE)
MAX_TOKENS = 4
LEASE_TTL_S = 1.0
OWNER_DEAD_S = 0.6
LOAD_TIMEOUT_S = 3.0
PUSH_TIMEOUT_S = 3.0
# Longest a survivor may take to return to baseline after its peer died: the owner-dead
# timeout, the TTL, a bounded push and its grace, and sweep periods, with slack for CI.
BASELINE_WITHIN_S = OWNER_DEAD_S + LEASE_TTL_S + PUSH_TIMEOUT_S + 4.0
_ids = itertools.count()


PROMPTS = prompts(n=3, length=300, seed=5)


@pytest.fixture(scope="module")
def mono() -> list[list[int]]:
    return Engine(CFG).generate(PROMPTS, max_tokens=MAX_TOKENS)


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


def producer_conf(name: str, control: str = "tcp://127.0.0.1:0") -> dict[str, Any]:
    return {
        "role": "producer",
        "instance_id": name,
        "producer": {
            "control": control,
            "store_size": "16MiB",
            "lease_ttl_s": LEASE_TTL_S,
            "owner_dead_after_s": OWNER_DEAD_S,
            "push_timeout_s": PUSH_TIMEOUT_S,
            "save_timeout_s": 5.0,
        },
    }


def consumer_conf(name: str, endpoints: list[str], data: str | None = None) -> dict[str, Any]:
    section: dict[str, Any] = {
        "producers": endpoints,
        "claim_timeout_s": 0.5,
        "load_timeout_s": LOAD_TIMEOUT_S,
        # about naming the failed request and cleaning up: the default would stop the
        # (V1, reuse on) engine instead (tests/e2e/test_disaggregated.py)
        "on_load_failure": "fail_request",
        "heartbeat_s": 0.2,
        "lease_ttl_s": LEASE_TTL_S,
    }
    if data:
        section["data"] = data
    return {"role": "consumer", "instance_id": name, "consumer": section}


def in_process(conf: dict[str, Any]) -> tuple[Engine, Any]:
    role = conf["role"]
    eng = Engine(
        CFG,
        ConnectorSpec(
            f"disagg.{role}",
            f"{role.capitalize()}Scheduler",
            f"{role.capitalize()}Worker",
            extra={"config": conf},
        ),
    )
    services = producer_services if role == "producer" else consumer_services
    return eng, services[conf["instance_id"]]


class Child:
    """A role process: JSON lines out (read by a thread into a queue), commands in."""

    def __init__(self, spec: dict[str, Any], prefix: list[str] | None = None):
        spec = {"engine": SHAPE, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, **spec}
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, ROLE, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=_CHILD_PATH),
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put({"event": "exited"})

    def expect(self, event: str, timeout: float = 20.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {event!r} event from the child within {timeout}s")
            msg = self.events.get(timeout=left)
            if msg["event"] == event:
                return msg
            if msg["event"] == "exited":
                raise AssertionError(f"child exited (rc={self.proc.wait()}) before {event!r}")

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL, and wait until the process is gone (its sockets closed by the OS)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def children():
    made: list[Child] = []

    def spawn(spec: dict[str, Any], prefix: list[str] | None = None) -> Child:
        made.append(Child(spec, prefix))
        return made[-1]

    yield spawn
    for c in made:
        c.close()


def wait_for(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def run_consumer(eng: Engine, deadline_s: float, on_step=None) -> tuple[list[Any], float]:
    t0 = time.monotonic()
    ids = [eng.add_request(p, MAX_TOKENS) for p in PROMPTS]
    while eng.has_work():
        assert time.monotonic() - t0 < deadline_s, "the consumer engine hangs past its deadline"
        eng.step()
        if on_step is not None:
            on_step()
    return [(rid, eng.results[rid].tokens, eng.results[rid].error) for rid in ids], (
        time.monotonic() - t0
    )


def check_outcomes(results: list[Any], mono: list[list[int]]) -> int:
    """Right tokens or a clear error naming a request; never a wrong token. Returns the
    number of failed requests."""
    failed = 0
    for (rid, tokens, error), want in zip(results, mono):
        assert tokens == want[: len(tokens)], f"request {rid}: wrong tokens {tokens} vs {want}"
        if error is None:
            assert tokens == want, f"request {rid} finished short: {tokens} vs {want}"
            continue
        failed += 1
        assert "KV cache load failed" in error and "request " in error, error
    return failed


def consumer_at_baseline(eng: Engine, csvc: Any) -> None:
    assert not eng.has_work(), "requests are stuck in the consumer engine"
    assert csvc.loads == {}, f"the consumer still holds leases: {list(csvc.loads)}"


def producer_at_baseline(psvc: Any, used_before: int) -> None:
    ok = wait_for(
        lambda: psvc.leases.active() == 0 and psvc.store.pinned_blocks() == 0, BASELINE_WITHIN_S
    )
    assert ok, f"leases {psvc.leases.active()}, pinned {psvc.store.pinned_blocks()}"
    assert psvc.store.used_blocks() == used_before
    assert psvc.store.verify() == 0


# -- the producer dies -----------------------------------------------------------------


def start_producer(children, **hooks: Any) -> tuple[Child, str]:
    p = children({"role": "producer", "config": producer_conf(f"cp{next(_ids)}"), **hooks})
    ready = p.expect("ready")
    assert ready["used"] > 0
    return p, ready["endpoint"]


def test_producer_killed_before_claim_is_a_miss(children, mono):
    p, ep = start_producer(children)
    p.kill()
    eng, csvc = in_process(consumer_conf(f"cc{next(_ids)}", [ep]))
    results, took = run_consumer(eng, deadline_s=15)
    assert check_outcomes(results, mono) == 0  # a miss: the engine recomputed
    assert csvc.metrics["claims_hit"] == 0
    consumer_at_baseline(eng, csvc)


def test_producer_killed_after_claim_fails_by_name(children, mono):
    p, ep = start_producer(children)
    eng, csvc = in_process(consumer_conf(f"cc{next(_ids)}", [ep]))
    dispatch = csvc.dispatch

    def kill_then_dispatch(load, layerwise=False):  # claims answered; the producer dies
        p.kill()
        dispatch(load, layerwise)

    csvc.dispatch = kill_then_dispatch
    results, took = run_consumer(eng, deadline_s=LOAD_TIMEOUT_S + 10)
    assert csvc.metrics["claims_hit"] > 0
    assert check_outcomes(results, mono) > 0
    consumer_at_baseline(eng, csvc)


def test_producer_killed_mid_push_fails_by_name(children, mono):
    p, ep = start_producer(children, slow_push_s=5.0)
    eng, csvc = in_process(consumer_conf(f"cc{next(_ids)}", [ep]))

    def killer():
        p.expect("push_started", timeout=20)
        p.kill()

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    results, took = run_consumer(eng, deadline_s=LOAD_TIMEOUT_S + 10)
    t.join(5)
    assert p.proc.returncode == -signal.SIGKILL, "the producer was not killed mid-push"
    assert check_outcomes(results, mono) > 0
    assert took < LOAD_TIMEOUT_S + 5
    consumer_at_baseline(eng, csvc)


def test_producer_killed_after_load_keeps_tokens(children, mono):
    p, ep = start_producer(children)
    eng, csvc = in_process(consumer_conf(f"cc{next(_ids)}", [ep]))

    def kill_once_loaded():
        if csvc.metrics["loads_done"] == len(PROMPTS) and p.proc.poll() is None:
            p.kill()

    results, took = run_consumer(eng, deadline_s=15, on_step=kill_once_loaded)
    assert p.proc.returncode == -signal.SIGKILL
    assert check_outcomes(results, mono) == 0
    assert all(eng.results[rid].connector_matched_tokens > 0 for rid, _, _ in results)
    consumer_at_baseline(eng, csvc)
    # every lease went back once its load landed, or (sent after the kill) could not be
    # delivered: counted, the dead producer's leases died with it
    assert wait_for(
        lambda: csvc.metrics["leases_released"] + csvc.metrics["release_failed"] == len(PROMPTS),
        10,
    ), dict(csvc.metrics)


# -- the same-host (ipc) plane: the producer's store is mapped by the consumer ---------


def ipc(conf: dict[str, Any]) -> dict[str, Any]:
    return {**conf, "transport": "ipc"}


def test_ipc_producer_in_another_process_tokens_match(children, mono):
    """The consumer copies pages out of another process's /dev/shm store."""
    p = children({"role": "producer", "config": ipc(producer_conf(f"cp{next(_ids)}"))})
    ep = p.expect("ready")["endpoint"]
    eng, csvc = in_process(ipc(consumer_conf(f"cc{next(_ids)}", [ep])))
    results, took = run_consumer(eng, deadline_s=15)
    assert check_outcomes(results, mono) == 0
    assert all(eng.results[rid].connector_matched_tokens > 0 for rid, _, _ in results)
    assert csvc.metrics["pages_loaded"] > 0 and csvc.data.stats["done"] == len(PROMPTS)
    consumer_at_baseline(eng, csvc)


def test_ipc_producer_killed_after_claim_fails_by_name(children, mono):
    p = children({"role": "producer", "config": ipc(producer_conf(f"cp{next(_ids)}"))})
    ep = p.expect("ready")["endpoint"]
    eng, csvc = in_process(ipc(consumer_conf(f"cc{next(_ids)}", [ep])))
    dispatch = csvc.dispatch

    def kill_then_dispatch(load, layerwise=False):
        p.kill()
        dispatch(load, layerwise)

    csvc.dispatch = kill_then_dispatch
    results, took = run_consumer(eng, deadline_s=LOAD_TIMEOUT_S + 10)
    assert csvc.metrics["claims_hit"] > 0
    assert check_outcomes(results, mono) > 0
    consumer_at_baseline(eng, csvc)


# -- the consumer dies -----------------------------------------------------------------


def prefilled_producer(transport: str = "tcp") -> tuple[Any, int]:
    prod, psvc = in_process({**producer_conf(f"sp{next(_ids)}"), "transport": transport})
    prod.generate(PROMPTS, max_tokens=1)
    return psvc, psvc.store.used_blocks()


def test_consumer_killed_holding_leases_frees_them(children):
    psvc, used = prefilled_producer()
    c = children(
        {"role": "consumer", "config": consumer_conf(f"kc{next(_ids)}", [psvc.endpoint]), "hold": 1}
    )
    c.expect("ready")
    c.send("claim")
    assert c.expect("claimed")["loads"] == len(PROMPTS)
    assert psvc.leases.active() == len(PROMPTS)
    # a live owner keeps its leases past their TTL by heartbeating (renewing)
    time.sleep(3 * LEASE_TTL_S)
    assert psvc.leases.active() == len(PROMPTS), "a live owner's leases expired"
    assert psvc.store.pinned_blocks() > 0
    c.kill()
    t0 = time.monotonic()
    producer_at_baseline(psvc, used)
    assert time.monotonic() - t0 < OWNER_DEAD_S + LEASE_TTL_S + 1.5
    assert psvc.leases.stats.freed_dead_owner + psvc.leases.stats.expired >= len(PROMPTS)


def test_consumer_killed_while_receiving_frees_everything(children, monkeypatch):
    from chaos_role import slow_pushes

    from disagg.transport import tcp

    monkeypatch.setattr(tcp.plan, "MSG_BYTES", tcp.plan.MSG_BYTES)  # slow_pushes changes it
    psvc, used = prefilled_producer()
    started = threading.Event()
    slow_pushes(psvc, 2.0, on_start=lambda tid: started.set())
    c = children({"role": "consumer", "config": consumer_conf(f"kc{next(_ids)}", [psvc.endpoint])})
    c.expect("ready")
    c.send("run")
    assert started.wait(20), "no push started"
    c.kill()
    producer_at_baseline(psvc, used)
    assert psvc.metrics["pushes_done"] + psvc.metrics["pushes_failed"] >= 1


def test_ipc_consumer_killed_while_copying_frees_everything(children):
    """The ipc consumer dies with a push of the producer's rows announced to it: the push
    fails at its deadline (no ack), and the rows are unpinned only after the grace."""
    psvc, used = prefilled_producer("ipc")
    started = threading.Event()
    post = psvc.data.post_push

    def announce(*args, **kw):
        started.set()
        return post(*args, **kw)

    psvc.data.post_push = announce
    conf = ipc(consumer_conf(f"kc{next(_ids)}", [psvc.endpoint]))
    c = children({"role": "consumer", "config": conf})
    c.expect("ready")
    c.send("run")
    assert started.wait(20), "no push started"
    c.kill()
    producer_at_baseline(psvc, used)
    assert psvc.metrics["pushes_done"] + psvc.metrics["pushes_failed"] >= 1


# -- the network is cut ----------------------------------------------------------------


def _netns_ok() -> str | None:
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"ip netns unavailable: {r.stderr.strip()}"


@pytest.fixture
def netns_pair():
    """Two namespaces joined by a veth pair (10.213.N.1 <-> 10.213.N.2), no route out."""
    why = _netns_ok()
    if why:
        pytest.skip(why)
    n = (os.getpid() + next(_ids)) % 250 + 1
    tag = f"dgc{os.getpid() % 100000}{n}"
    ns_p, ns_c, dev_p, dev_c = f"{tag}p", f"{tag}c", f"{tag}a"[:15], f"{tag}b"[:15]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("netns", "add", ns_p)
    ip("netns", "add", ns_c)
    try:
        ip("link", "add", dev_p, "type", "veth", "peer", "name", dev_c)
        ip("link", "set", dev_p, "netns", ns_p)
        ip("link", "set", dev_c, "netns", ns_c)
        ip("-n", ns_p, "addr", "add", f"10.213.{n}.1/24", "dev", dev_p)
        ip("-n", ns_c, "addr", "add", f"10.213.{n}.2/24", "dev", dev_c)
        for ns, dev in ((ns_p, dev_p), (ns_c, dev_c)):
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield {
            "ns_p": ns_p,
            "ns_c": ns_c,
            "dev_p": dev_p,
            "dev_c": dev_c,
            "ip_p": f"10.213.{n}.1",
            "ip_c": f"10.213.{n}.2",
        }
    finally:
        subprocess.run(["ip", "netns", "del", ns_p], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns_c], capture_output=True)


@pytest.mark.netns
def test_network_cut_mid_push(children, netns_pair, mono):
    nsp = netns_pair
    control = f"tcp://{nsp['ip_p']}:5555"
    p = children(
        {
            "role": "producer",
            "config": producer_conf(f"np{next(_ids)}", control=control),
            "slow_push_s": 1.5,
        },
        prefix=["ip", "netns", "exec", nsp["ns_p"]],
    )
    used = p.expect("ready")["used"]
    c = children(
        {
            "role": "consumer",
            "config": consumer_conf(f"nc{next(_ids)}", [control], data=f"tcp://{nsp['ip_c']}:0"),
            "deadline_s": 30,
        },
        prefix=["ip", "netns", "exec", nsp["ns_c"]],
    )
    c.expect("ready")
    c.send("run")
    p.expect("push_started")
    subprocess.run(["ip", "-n", nsp["ns_p"], "link", "set", nsp["dev_p"], "down"], check=True)
    t0 = time.monotonic()
    out = c.expect("results", timeout=LOAD_TIMEOUT_S + 10)
    assert time.monotonic() - t0 < LOAD_TIMEOUT_S + 5
    results = [(r["rid"], r["tokens"], r["error"]) for r in out["results"]]
    assert check_outcomes(results, mono) > 0
    c.send("state")
    st = c.expect("state")
    assert st["loads"] == 0 and not st["has_work"]
    # the producer's side: the silent owner is declared dead, everything returns
    end = time.monotonic() + BASELINE_WITHIN_S
    while True:
        p.send("state")
        ps = p.expect("state")
        if ps["leases"] == 0 and ps["pinned"] == 0 or time.monotonic() > end:
            break
        time.sleep(0.3)
    assert (ps["leases"], ps["pinned"], ps["used"], ps["corrupt"]) == (0, 0, used, 0), ps
