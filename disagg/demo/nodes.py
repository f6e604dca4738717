"""One producer or consumer instance of ``disagg demo``, in its own process
(``python -m disagg.demo.nodes``), driven by the parent over stdin/stdout, one JSON object
per line:

    node -> parent: {"imported": true} once its imports are done (the parent starts no
                    timed work while another process is still importing torch)
    parent -> node: the spec (role, engine shape, prompts, endpoints ...), later "go",
                    and for a producer "stop"
    node -> parent: {"ready": ...} once its engine and connector are up, {"progress": ...}
                    every couple of seconds of work, {"result": ...}, and a producer's
                    {"final": ...} metrics after "stop"

The parent runs the instances one at a time, so that their timings do not compete for
the machine's cores. Pages are reported as digests (blake2b-128 of their bytes): the
parent compares them with the pages computed elsewhere without moving them again.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

PROGRESS_EVERY_S = 2.0


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def page_digests(pages: dict[tuple[int, int], bytes], cfg: Any) -> dict[str, list[Any]]:
    """``{"group:ordinal": [digest, bytes]}``: the digest of the page by KV head
    (``page_by_head``: equal across TP sizes), the bytes as held on ``cfg``'s ranks."""
    from ..engine.reference.kv_cache import page_by_head

    return {
        f"{g}:{o}": [digest(page_by_head(cfg, g, b)), len(b)] for (g, o), b in sorted(pages.items())
    }


def run_requests(
    eng: Any,
    prompts: list[list[int]],
    max_tokens: int,
    salt: str | None,
    progress: Callable[[str], None],
) -> tuple[list[int], list[float], float]:
    """Submit every prompt at once and step until the engine is idle (its saves done);
    returns (request ids, each one's time to first token, total seconds)."""
    t0 = time.perf_counter()
    ids = [eng.add_request(p, max_tokens, salt) for p in prompts]
    first: dict[int, float] = {}
    last = t0
    want = sum(len(p) for p in prompts)
    while eng.has_work() or any(not eng.results[i].finished for i in ids):
        eng.step()
        now = time.perf_counter()
        for i in ids:
            if i not in first and eng.results[i].tokens:
                first[i] = now - t0
        if now - last >= PROGRESS_EVERY_S:
            last = now
            done = sum(eng.results[i].finished for i in ids)
            made = sum(len(eng.results[i].tokens) for i in ids)
            progress(
                f"{done}/{len(ids)} requests finished, {made}/{len(ids) * max_tokens} tokens "
                f"generated, {eng.stats.computed_tokens} of {want} prompt tokens computed here "
                f"({now - t0:.0f} s)"
            )
    for i in ids:
        err = eng.results[i].error
        if err:
            raise RuntimeError(f"request {i} failed: {err}")
    return ids, [first.get(i, float("nan")) for i in ids], time.perf_counter() - t0


def warm_up() -> None:
    """One tiny request: a process's first forward pays torch's lazy start-up, which would
    otherwise land in the first timed request's TTFT."""
    from ..engine.reference import Engine, EngineConfig

    Engine(EngineConfig(num_layers=1, tokens_per_block=16, num_blocks=16)).generate(
        [[1] * 40], max_tokens=2
    )


def _engine(spec: dict[str, Any]) -> Any:
    from ..engine.reference import ConnectorSpec, Engine, EngineConfig

    role, index = spec["role"], spec["index"]
    kw = dict(spec["engine"], windows=tuple(spec["engine"]["windows"]), capture_pages=True)
    section: dict[str, Any]
    if role == "producer":
        section = {
            "control": "tcp://127.0.0.1:0",
            "store_size": spec["store_size"],
            "store_device": spec["store_device"],
        }
    else:
        # a claim is a hit only if answered in time: generous, on a loaded 2-core machine
        section = {"producers": spec["producers"], "load_mode": spec["load_mode"]}
        section["claim_timeout_s"] = 5.0
    config = {
        "role": role,
        "instance_id": f"demo-{role}-{index}",
        "transport": spec["transport"],
        role: section,
    }
    cls = role.capitalize()
    connector = ConnectorSpec(
        f"disagg.{role}", f"{cls}Scheduler", f"{cls}Worker", extra={"config": config}
    )
    return Engine(EngineConfig(**kw), connector=connector)


def _summed(services: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in services:
        for k, v in s.metrics.items():
            out[k] = out.get(k, 0) + int(v)
    return out


class ServedBy:
    """Which producer served each request and which transfers carried its pages, seen
    from outside the consumer service: its public ``claim`` and ``dispatch`` are wrapped
    on the instances (every TP rank's); nothing inside them changes."""

    def __init__(self, services: list[Any], producer_of: dict[str, int]) -> None:
        self.producer: dict[int, int] = {}
        self.transfers: dict[int, list[list[Any]]] = {}
        for svc in services:
            self._wrap(svc, producer_of)

    def _wrap(self, svc: Any, producer_of: dict[str, int]) -> None:
        claim, dispatch = svc.claim, svc.dispatch

        def claim_(request_id: int, *a: Any, **kw: Any) -> Any:
            got = claim(request_id, *a, **kw)
            if got is not None:
                self.producer[request_id] = producer_of.get(got.link.endpoint, -1)
            return got

        def dispatch_(load: Any, *a: Any, **kw: Any) -> Any:
            out = dispatch(load, *a, **kw)
            if load.transfer_id:
                entry = [svc.data.endpoint, load.transfer_id]
                self.transfers.setdefault(load.request_id, []).append(entry)
            return out

        svc.claim, svc.dispatch = claim_, dispatch_


class PushTimes:
    """Each push's span on a producer's data plane, from ``post_push`` to the first
    ``poll_push`` that finds it final (the service's watcher polls every 0.2-5 ms),
    keyed by the consumer's data endpoint and transfer id. ``time.monotonic`` is one
    clock for every process of the machine, so the parent can merge the spans."""

    def __init__(self, services: list[Any]) -> None:
        self.spans: dict[str, list[float]] = {}
        for svc in services:
            self._wrap(svc.data)

    def _wrap(self, plane: Any) -> None:
        post, poll = plane.post_push, plane.poll_push
        keys: dict[int, str] = {}

        def post_(endpoint: str, transfer_id: int, *a: Any, **kw: Any) -> Any:
            t = time.monotonic()
            handle = post(endpoint, transfer_id, *a, **kw)
            key = f"{endpoint} {transfer_id}"
            keys[id(handle)] = key
            self.spans[key] = [t, math.nan]
            return handle

        def poll_(handle: Any) -> Any:
            st = poll(handle)
            key = keys.get(id(handle))
            if key is not None and st is not None and st.final:
                keys.pop(id(handle), None)
                if st.done:
                    self.spans[key][1] = time.monotonic()
            return st

        plane.post_push, plane.poll_push = post_, poll_


def run_producer(spec: dict[str, Any], progress: Callable[[str], None]) -> None:
    from ..producer.service import _registry

    eng = _engine(spec)
    ranks = _registry.ranks(f"demo-producer-{spec['index']}")
    pushes = PushTimes(ranks)
    emit({"ready": True, "endpoints": [s.endpoint for s in ranks]})
    if sys.stdin.readline().strip() != "go":
        return
    ids, ttft, secs = run_requests(eng, spec["prompts"], 1, spec["cache_salt"], progress)
    store = ranks[0].store
    emit(
        {
            "result": {
                "seconds": secs,
                "ttft_s": ttft,
                "stored_blocks": len(store.keys()),
                "computed_pages": [
                    page_digests(eng.results[i].computed_pages, eng.config) for i in ids
                ],
            }
        }
    )
    sys.stdin.readline()  # serve the consumers until the parent says stop (or goes away)
    emit(
        {
            "final": {
                "metrics": _summed(ranks),
                "push_spans": {k: v for k, v in pushes.spans.items() if not math.isnan(v[1])},
                "leases_active": sum(s.leases.active() for s in ranks),
                "pinned_blocks": sum(s.store.pinned_blocks() for s in ranks),
            }
        }
    )
    for s in ranks:
        s.close()


def run_consumer(spec: dict[str, Any], progress: Callable[[str], None]) -> None:
    from ..consumer.service import _registry

    eng = _engine(spec)
    ranks = _registry.ranks(f"demo-consumer-{spec['index']}")
    producer_of = {ep: p for p, eps in enumerate(spec["producer_ranks"]) for ep in eps}
    emit({"ready": True})
    if sys.stdin.readline().strip() != "go":
        return
    served = ServedBy(ranks, producer_of)
    ids, ttft, secs = run_requests(
        eng, spec["prompts"], spec["max_tokens"], spec["cache_salt"], progress
    )
    for s in ranks:
        s.close()
    requests = []
    for i, rid in enumerate(ids):
        res = eng.results[rid]
        requests.append(
            {
                "tokens": res.tokens,
                "ttft_s": ttft[i],
                "remote_tokens": res.connector_matched_tokens,
                "device_matched_tokens": res.device_matched_tokens,
                "producer": served.producer.get(rid),
                "transfers": [f"{ep} {tid}" for ep, tid in served.transfers.get(rid, [])],
                "loaded_pages": page_digests(res.loaded_pages, eng.config),
            }
        )
    emit({"result": {"seconds": secs, "requests": requests, "metrics": _summed(ranks)}})


def main() -> int:
    warm_up()
    emit({"imported": True})
    spec = json.loads(sys.stdin.readline())

    def progress(text: str) -> None:
        emit({"progress": text})

    if spec["role"] == "producer":
        run_producer(spec, progress)
    else:
        run_consumer(spec, progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
