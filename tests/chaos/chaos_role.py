"""One disagg role (producer or consumer) on the reference engine, in its own process, for
chaos tests. Test-only: the parent kills it with SIGKILL at chosen points.

Usage: ``python chaos_role.py SPEC_JSON``. The spec holds ``role``, ``engine`` (EngineConfig
keyword arguments), ``config`` (the disagg config mapping), ``prompts``, ``max_tokens`` and
optional test hooks:

- ``slow_push_s`` (producer): pages go out in small messages and the sender pauses this
  long after the first one, printing ``{"event": "push_started"}`` first, so a kill or a
  link cut lands *in the middle* of a push;
- ``hold`` (consumer): claims are made but no push is ever requested, so the consumer
  holds its leases (its keepalive keeps renewing them) until told otherwise;
- ``dead_data`` (consumer): its data-plane receiver is closed before any push, so it claims
  and asks for pushes that can never be delivered (a decode instance whose receiver died):
  each such push ends only at the producer's push deadline.

Control is line based: the child prints one JSON object per line on stdout (events and
replies), and reads commands on stdin: ``state``, ``run`` (consumer: run every prompt to
completion), ``claim`` (consumer: schedule every prompt once, so claims are made), ``quit``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

_out_lock = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    with _out_lock:
        print(json.dumps(obj), flush=True)


def build(spec: dict[str, Any]) -> tuple[Any, Any]:
    from disagg.engine.reference import ConnectorSpec, Engine, EngineConfig

    role = spec["role"]
    eng_kw = dict(spec["engine"])
    if "windows" in eng_kw:
        eng_kw["windows"] = tuple(eng_kw["windows"])
    conn = ConnectorSpec(
        f"disagg.{role}",
        f"{role.capitalize()}Scheduler",
        f"{role.capitalize()}Worker",
        extra={"config": spec["config"]},
    )
    eng = Engine(EngineConfig(**eng_kw), conn)
    if role == "producer":
        from disagg.producer.service import _services as ps
    else:
        from disagg.consumer.service import _services as cs  # noqa: F401

        ps = cs
    return eng, ps[spec["config"]["instance_id"]]


def slow_pushes(svc: Any, pause_s: float, on_start: Any = None) -> None:
    """Many small messages, and a pause after the first one of each push (tcp plane);
    ``on_start(transfer_id)`` runs at the pause (default: print a ``push_started`` event)."""
    from disagg.transport import tcp

    tcp.plan.MSG_BYTES = 16 << 10
    plane = svc.data
    original = plane._wait_writable
    seen: dict[int, int] = {}

    def wait_writable(sock: Any, h: Any) -> bool:
        n = seen[h.transfer_id] = seen.get(h.transfer_id, 0) + 1
        if n == 2:  # the first message is out: the push is now in the middle
            if on_start is not None:
                on_start(h.transfer_id)
            else:
                emit({"event": "push_started", "transfer_id": h.transfer_id})
            time.sleep(pause_s)
        return bool(original(sock, h))

    plane._wait_writable = wait_writable


def producer_state(svc: Any) -> dict[str, Any]:
    return {
        "event": "state",
        "leases": svc.leases.active(),
        "pinned": svc.store.pinned_blocks(),
        "used": svc.store.used_blocks(),
        "corrupt": svc.store.verify(),
        "metrics": dict(svc.metrics),
        "lease_stats": {k: v for k, v in vars(svc.leases.stats).items() if isinstance(v, int)},
        "control": dict(svc.server.stats) if svc.server is not None else {},
        "incarnation": svc.incarnation,
    }


def consumer_state(eng: Any, svc: Any) -> dict[str, Any]:
    return {
        "event": "state",
        "loads": len(svc.loads),
        "has_work": eng.has_work(),
        "metrics": dict(svc.metrics),
    }


def run_producer(spec: dict[str, Any]) -> None:
    eng, svc = build(spec)
    eng.generate(spec["prompts"], max_tokens=1)
    if spec.get("slow_push_s"):
        slow_pushes(svc, float(spec["slow_push_s"]))
    emit({**producer_state(svc), "event": "ready", "endpoint": svc.endpoint})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "state":
            emit(producer_state(svc))
        elif cmd == "quit":
            break
    svc.close()


def run_consumer(spec: dict[str, Any]) -> None:
    eng, svc = build(spec)
    if spec.get("hold"):
        svc.dispatch = lambda load, layerwise=False: None  # claim, never ask for the pages
    if spec.get("dead_data"):
        svc.data.close()  # nothing receives at its data endpoint any more
    emit({"event": "ready"})
    ids: list[int] = []
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "claim":
            ids = [eng.add_request(p, spec["max_tokens"]) for p in spec["prompts"]]
            eng.step()
            emit({"event": "claimed", "loads": len(svc.loads), "metrics": dict(svc.metrics)})
        elif cmd == "run":
            t0 = time.monotonic()
            ids = ids or [eng.add_request(p, spec["max_tokens"]) for p in spec["prompts"]]
            while eng.has_work() and time.monotonic() - t0 < spec.get("deadline_s", 60):
                eng.step()
            res = [
                {"rid": i, "tokens": eng.results[i].tokens, "error": eng.results[i].error}
                for i in ids
            ]
            emit({"event": "results", "results": res, "elapsed_s": time.monotonic() - t0})
        elif cmd == "state":
            emit(consumer_state(eng, svc))
        elif cmd == "quit":
            break
    svc.close()


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec["role"] == "producer":
        run_producer(spec)
    else:
        run_consumer(spec)


if __name__ == "__main__":
    main()
