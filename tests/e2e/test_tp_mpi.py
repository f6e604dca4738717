"""TP=2 with every rank its own process (the reference engine's MPI mode): a TP=2 producer
instance (2 rank processes) and a TP=2 consumer instance (2 rank processes) in one
``mpirun -n 4`` job, the world split into the two instances' communicators.

Per rank process, as in TensorRT-LLM: rank 0 owns the connector scheduler and broadcasts
its answers, every rank owns its worker, its KV-head-shard pool and its own
producer/consumer service, and every layer all-gathers the ranks' attention heads (a real
collective: a rank that left a forward leaves the others waiting there).

Judged as the one-process versions (test_tp.py, test_tp_failure.py): tokens equal a
monolithic run, each consumer rank's loaded pages equal its producer rank's computed shard
byte for byte; a load that fails on one rank only fails its request on both ranks (decided
through ``rank_bus`` across the processes) with no hang and no wrong token. A job that
hangs fails the test on ``JOB_TIMEOUT_S`` (the process group is killed).

This file is also the rank processes' script: ``mpirun -n 4 python tests/e2e/test_tp_mpi.py
CASE_JSON OUTDIR`` (see ``_main``); ``bench`` cases print the rank-bus measurements quoted
in ``disagg/consumer/rank_bus.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 120  # the whole mpirun job; a hang fails the test here
HANG_S = 20.0  # a rank waiting this long in one collective raises RankHangError


# --------------------------------------------------------------------------------------
# the rank processes
# --------------------------------------------------------------------------------------
def _poll(req: Any, what: str, timeout: float = 90.0) -> None:
    """Wait for a non-blocking world collective without spinning (the producer ranks wait
    here while their services' threads serve the consumer)."""
    end = time.monotonic() + timeout
    while not req.Test():
        if time.monotonic() > end:
            raise TimeoutError(f"world {what}: the other instance's ranks never joined")
        time.sleep(0.002)


def _spec(role: str, conf: dict[str, Any]) -> Any:
    from disagg.engine.reference import ConnectorSpec

    cls = role.capitalize()
    return ConnectorSpec(
        f"disagg.{role}", f"{cls}Scheduler", f"{cls}Worker", extra={"config": conf}
    )


def _run_phase(i: int, ph: dict[str, Any], role: str, comm: Any, world: Any) -> dict[str, Any]:
    from harness import SHAPE, prompts, wait_for

    from disagg.consumer.service import _services as consumer_services
    from disagg.engine.reference import Engine, EngineConfig
    from disagg.producer.service import _services as producer_services

    cfg = EngineConfig(
        **dict(SHAPE, device="cpu"),
        tp=comm.size,
        kv_manager=ph["kv_manager"],
        capture_pages=True,
        prefix_aware_scheduling=ph.get("prefix", False),
    )
    ps = prompts(n=ph.get("n", 3))
    name = f"{role[0]}mpi{i}"
    out: dict[str, Any] = {}
    eng: Any = None
    svc: Any = None
    if role == "producer":
        conf = {
            "role": "producer",
            "instance_id": name,
            "transport": "tcp",
            "producer": {"control": "tcp://127.0.0.1:0", "store_size": "64MiB"},
        }
        eng = Engine(cfg, _spec("producer", conf), comm=comm)
        svc = producer_services[name]
    mine = (role, comm.rank, svc.endpoint if svc is not None else None)
    everyone = world.allgather(mine)
    endpoints = [e for ro, _, e in sorted(everyone) if ro == "producer"]

    if role == "producer":
        ids = [eng.add_request(p, 1) for p in ps]
        while eng.has_work():
            eng.step()
        out["computed"] = [eng.results[r].computed_pages for r in ids]
        if ph.get("producer_rank1_plane_closed") and comm.rank == 1:
            svc.data.close()  # producer rank 1 answers claims but can never push
    _poll(world.Ibarrier(), "barrier (produced)")

    if role == "consumer" and ph.get("consume", True):
        conf = {
            "role": "consumer",
            "instance_id": name,
            "transport": "tcp",
            "consumer": {
                "producers": [endpoints],
                "claim_timeout_s": 3.0,
                "load_mode": ph["load_mode"],
                **ph.get("consumer", {}),
            },
        }
        eng = Engine(cfg, _spec("consumer", conf), comm=comm)
        svc = consumer_services[name]
        timing = _instrument(eng, svc) if ph.get("bench") else None
        res: list[Any] = []
        took: list[float] = []
        hit: list[int] = []
        for group in ph.get("batches", [list(range(len(ps)))]):
            ids = [eng.add_request(ps[k], ph.get("max_tokens", 6)) for k in group]
            if ph.get("fail_rank1") is not None and comm.rank == 1:
                target = ph["fail_rank1"]
                if target in group:
                    from harness import fail_on_rank1

                    hit = fail_on_rank1(svc, ids[group.index(target)], ph.get("how", "transfer"))
            t0 = time.monotonic()
            while eng.has_work():
                eng.step()
            took += [time.monotonic() - t0] * len(group)
            res += [eng.results[r] for r in ids]
            if timing is not None:
                timing["per_request"].append(
                    (timing.pop("wfll", 0.0), timing.pop("decide", 0.0), took[-1])
                )
        out.update(
            tokens=[r.tokens for r in res],
            errors=[r.error for r in res],
            matched=[r.connector_matched_tokens for r in res],
            loaded=[r.loaded_pages for r in res],
            took=took,
            hit=hit,
            ids=[sorted(eng.results)],
        )
    _poll(world.Ibarrier(), "barrier (consumed)")

    if svc is not None:
        if role == "producer":
            out["leases_back"] = wait_for(lambda: svc.leases.active() == 0)
            out["pins_back"] = wait_for(lambda: svc.store.pinned_blocks() == 0)
        else:
            out["loads_drained"] = wait_for(lambda: not svc.loads)
        out["metrics"] = dict(svc.metrics)
        out["calls"] = dict(eng.stats.calls)
    out["comm"] = {k: (comm.counts[k], comm.waits[k]) for k in comm.counts}
    if role == "consumer" and ph.get("bench"):
        _report(ph, comm, out, timing)
    _poll(world.Ibarrier(), "barrier (collected)")
    if svc is not None:
        svc.close()
    return out


def _instrument(eng: Any, svc: Any) -> dict[str, Any]:
    """Bench: time this rank's ``wait_for_layer_load`` and rank decisions per request, and
    stamp the bus's states as published here and as they arrive from the other rank
    (``time.monotonic`` is one clock for every process of the host)."""
    timing: dict[str, Any] = {"per_request": [], "sent": {}, "got": {}}
    worker = eng.driver.workers[0]

    def timed(fn: Any, key: str) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0

        return call

    worker.wait_for_layer_load = timed(worker.wait_for_layer_load, "wfll")
    if svc.bus is not None:
        svc.rank_decision = timed(svc.rank_decision, "decide")
        bus, record, merge = svc.bus, svc.bus.record, svc.bus._merge

        def stamp_record(uid: int, progress: int, final: str | None) -> None:
            timing["sent"].setdefault((uid, progress, final), time.monotonic())
            record(uid, progress, final)

        def stamp_merge(uid: int, rank: int, progress: int, final: str | None) -> None:
            timing["got"].setdefault((uid, progress, final), time.monotonic())
            merge(uid, rank, progress, final)

        bus.record, bus._merge = stamp_record, stamp_merge
    return timing


def _report(ph: dict[str, Any], comm: Any, out: dict[str, Any], timing: Any) -> None:
    """Bench: print this instance's numbers (consumer rank 0)."""
    import statistics as st

    stamps = comm.allgather((timing["sent"], timing["got"]), "bench stamps")
    hops = [  # a state published on one rank -> merged on the other
        got[k] - sent[k]
        for r, (sent, _) in enumerate(stamps)
        for o, (_, got) in enumerate(stamps)
        if o != r
        for k in sent
        if k in got
    ]
    if comm.rank != 0:
        return
    per = timing["per_request"][1:]  # the first request warms up connections
    ms = 1000.0

    def med(xs: list[float]) -> str:
        return f"{st.median(xs) * ms:.2f}" if xs else "-"

    n = max(1, ph.get("n", 3) - 1)
    print(
        f"BENCH tp={comm.size} load_mode={ph['load_mode']} requests={n}: "
        f"median per request: wait_for_layer_load {med([p[0] for p in per])} ms, "
        f"rank decisions {med([p[1] for p in per])} ms, request total {med([p[2] for p in per])} ms"
        f" | bus hop (state published -> merged on the other rank, {len(hops)} states): "
        f"median {med(hops)} ms, max {max(hops) * ms if hops else 0:.2f} ms"
        f" | comm {json.dumps({k: [c, round(w * ms, 1)] for k, (c, w) in out['comm'].items()})}"
        f" (calls, ms waited)",
        flush=True,
    )


def _main(case_json: str, outdir: Path) -> int:
    from mpi4py import MPI

    from disagg.engine.reference import RankHangError
    from disagg.engine.reference.mpi import MpiComm

    case = json.loads(case_json)
    world = MPI.COMM_WORLD
    wrank, tp = world.Get_rank(), int(case.get("tp", 2))
    roles = case.get("roles", ["producer", "consumer"])
    # each role's TP size ("tps": unequal TP), its ranks after the previous role's
    sizes = [int(case.get("tps", {}).get(r, tp)) for r in roles]
    if world.Get_size() != sum(sizes):
        raise SystemExit(f"launch {sum(sizes)} processes, not {world.Get_size()}")
    which = next(i for i in range(len(roles)) if wrank < sum(sizes[: i + 1]))
    role = roles[which]
    comm = MpiComm(world.Split(which, wrank), hang_timeout_s=case.get("hang_s", HANG_S))
    if case.get("kind") == "diverge":
        return _diverge(case, comm, outdir)
    result: dict[str, Any] = {"role": role, "rank": comm.rank, "phases": []}
    status = "ok"
    try:
        for i, ph in enumerate(case["phases"]):
            result["phases"].append(_run_phase(i, ph, role, comm, world))
    except RankHangError as exc:
        status = f"hang: {exc}"
    except BaseException:
        status = traceback.format_exc()
    result["status"] = status
    (outdir / f"{role}{comm.rank}.pkl").write_bytes(pickle.dumps(result))
    if status != "ok":
        print(f"{role} rank {comm.rank}: {status}", file=sys.stderr, flush=True)
        comm.abort(3)  # the others may sit in a collective this rank will never join
    return 0


def _diverge(case: dict[str, Any], comm: Any, outdir: Path) -> int:
    """One instance (a producer, no peer needed); rank 1's ``save_kv_layer`` raises at
    layer 0, rank 0's does not: rank 1 fails its batch and goes on to ``get_finished``,
    rank 0 runs layer 1 and waits for rank 1's heads, which never come; rank 1 waits in
    the broadcast of ``request_finished`` (failing the batch), which rank 0 never joins."""
    from harness import SHAPE, prompts

    from disagg.engine.reference import Engine, EngineConfig, RankHangError
    from disagg.producer.service import _services

    cfg = EngineConfig(**dict(SHAPE, device="cpu"), tp=comm.size)
    name = "pdiverge"
    conf = {
        "role": "producer",
        "instance_id": name,
        "producer": {"control": "tcp://127.0.0.1:0", "store_size": "16MiB"},
    }
    eng = Engine(cfg, _spec("producer", conf), comm=comm)
    if comm.rank == 1:
        worker = eng.driver.workers[0]

        def save_kv_layer(layer_idx: int, stream: Any) -> None:
            raise RuntimeError("injected: rank 1 alone fails save_kv_layer")

        worker.save_kv_layer = save_kv_layer
    status = "no hang"
    try:
        eng.generate(prompts(n=1), 2)
    except RankHangError as exc:
        status = f"hang: {exc}"
    except BaseException:
        status = traceback.format_exc()
    (outdir / f"producer{comm.rank}.pkl").write_bytes(pickle.dumps({"status": status}))
    _services[name].close()
    if status.startswith("hang"):
        # the other rank is in a collective this one left for good; let it time out and
        # write its own report (it waits no longer than we did), then end the job
        deadline = time.monotonic() + case.get("hang_s", HANG_S) + 10
        other = outdir / f"producer{1 - comm.rank}.pkl"
        while not other.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        print(f"rank {comm.rank}: {status}", file=sys.stderr, flush=True)
        comm.abort(3)
    return 0


# --------------------------------------------------------------------------------------
# pytest side
# --------------------------------------------------------------------------------------
def _unavailable() -> str | None:
    try:
        from disagg.engine.reference.mpi import mpi_unavailable
    except ImportError as exc:  # pragma: no cover
        return str(exc)
    return mpi_unavailable()


needs_mpi = pytest.mark.skipif(
    _unavailable() is not None,
    reason=f"MPI TP mode: {_unavailable()} (CI: install the 'mpi' extra)",
)


def _mpirun(case: dict[str, Any], outdir: Path, nprocs: int = 4) -> tuple[int, str, dict]:
    """Run the case; returns (exit status, output, {"producer0": result, ...}). A job
    still running after ``JOB_TIMEOUT_S`` is killed and fails the test (a hang)."""
    from disagg.engine.reference.mpi import mpirun

    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PYTHONUNBUFFERED="1",
        DISAGG_TEST_DEVICE="cpu",
    )
    cmd = [
        str(mpirun()),
        "-n",
        str(nprocs),
        "--oversubscribe",
        sys.executable,
        __file__,
        json.dumps(case),
        str(outdir),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the TP job hung (killed after {JOB_TIMEOUT_S} s):\n{output[-4000:]}")
    results = {p.stem: pickle.loads(p.read_bytes()) for p in outdir.glob("*.pkl")}
    return proc.returncode, output, results


def _ok(rc: int, output: str, results: dict, nprocs: int = 4) -> dict:
    bad = {k: v["status"] for k, v in results.items() if v["status"] != "ok"}
    assert rc == 0 and not bad and len(results) == nprocs, f"rc={rc} {bad}\n{output[-4000:]}"
    return results


def _mono(kv_manager: str, n: int = 3, max_tokens: int = 6) -> list[list[int]]:
    from harness import SHAPE, prompts

    from disagg.engine.reference import Engine, EngineConfig

    ps = prompts(n=n)
    sim = Engine(EngineConfig(**SHAPE, tp=2, kv_manager=kv_manager)).generate(ps, max_tokens)
    one = Engine(EngineConfig(**SHAPE, tp=1, kv_manager=kv_manager)).generate(ps, max_tokens)
    assert sim == one
    return sim


@needs_mpi
@pytest.mark.parametrize("kv_manager", ["v1", "v2"])
def test_tp2_processes_tokens_and_pages_match_monolithic(tmp_path, kv_manager):
    combos = [(kv_manager, "async"), (kv_manager, "sync")]  # one job: two instance pairs
    case = {"phases": [{"kv_manager": km, "load_mode": lm} for km, lm in combos]}
    res = _ok(*_mpirun(case, tmp_path))
    for i, (km, lm) in enumerate(combos):
        mono = _mono(km)
        prod = [res[f"producer{r}"]["phases"][i] for r in (0, 1)]
        cons = [res[f"consumer{r}"]["phases"][i] for r in (0, 1)]
        for r in (0, 1):
            c, p = cons[r], prod[r]
            assert c["errors"] == [None] * 3, (km, lm, r)
            assert c["tokens"] == mono, (km, lm, r)
            assert all(n > 0 for n in c["matched"]), (km, lm, r)
            for req, (loaded, computed) in enumerate(zip(c["loaded"], p["computed"])):
                assert loaded, f"{km}/{lm}: consumer rank {r} loaded no page of request {req}"
                for where, data in loaded.items():
                    # this rank's shard only: half a simulated page, its own producer rank's
                    assert data == computed[where], f"{km}/{lm} rank {r} page {where} differs"
            assert c["metrics"]["pages_loaded"] > 0
            assert p["metrics"]["pages_pushed"] > 0
            assert (p["metrics"].get("pushes_layerwise", 0) > 0) == (lm == "sync")
            assert p["leases_back"] and p["pins_back"], f"producer rank {r} leases/pins"
        # the two ranks moved different shards (a rank loading the other's would differ)
        where = next(iter(cons[0]["loaded"][0]))
        assert cons[0]["loaded"][0][where] != cons[1]["loaded"][0][where]
        # only rank 0 ran the scheduler (its answers were broadcast)
        assert cons[0]["calls"]["get_num_new_matched_tokens"] == 3
        assert "get_num_new_matched_tokens" not in cons[1]["calls"]
        assert cons[1]["calls"]["get_finished"] == cons[0]["calls"]["get_finished"] > 0


@needs_mpi
@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_tp2_processes_one_rank_failure_fails_the_request_on_both(tmp_path, load_mode):
    """Consumer rank 1's load of the second request fails (its transfer is aborted, as
    when producer rank 1 dies mid-push); rank 0's lands. Both rank processes fail that
    request through the bus, the others match; then producer rank 1 stops pushing
    altogether (its plane closed after offering): rank 1's load times out, both fail."""
    case = {
        "phases": [
            {
                "kv_manager": "v2",  # auto policy: the request fails, the engine goes on
                "load_mode": load_mode,
                "batches": [[0], [1], [2]],  # a failed request fails its whole batch
                "fail_rank1": 1,
                "max_tokens": 5,
            },
            {
                "kv_manager": "v2",
                "load_mode": load_mode,
                "n": 1,
                "batches": [[0]],
                "producer_rank1_plane_closed": True,
                "consumer": {"load_timeout_s": 1.0},
                "max_tokens": 4,
            },
        ]
    }
    res = _ok(*_mpirun(case, tmp_path))
    mono = _mono("v2", max_tokens=5)
    c0, c1 = (res[f"consumer{r}"]["phases"][0] for r in (0, 1))
    p = [res[f"producer{r}"]["phases"][0] for r in (0, 1)]
    assert c1["hit"], "the failure was not injected"
    for r, c in ((0, c0), (1, c1)):
        assert c["errors"][0] is None and c["errors"][2] is None, (r, c["errors"])
        assert c["tokens"][0] == mono[0] and c["tokens"][2] == mono[2], r
        err = c["errors"][1]
        assert err is not None and "request 2" in err, (r, err)
        assert c["tokens"][1] == [], r  # never a token computed on pages that did not land
        assert c["took"][1] < 5.0, r  # decided from rank 1's report, not a timeout
        for k in (0, 2):
            for where, data in c["loaded"][k].items():
                assert data == p[r]["computed"][k][where], f"rank {r} request {k} {where}"
    assert "TP rank 1" in c0["errors"][1] and "injected" in c0["errors"][1]
    assert c1["metrics"]["loads_failed"] >= 1
    assert c0["metrics"]["loads_failed_on_other_rank"] == 1
    assert c0["metrics"].get("rank_outcome_timeouts", 0) == 0
    assert c1["metrics"].get("rank_outcome_timeouts", 0) == 0
    for r in (0, 1):
        assert p[r]["leases_back"] and p[r]["pins_back"], f"producer rank {r}"

    # phase 2: producer rank 1 offered its blocks, then never pushes
    c0, c1 = (res[f"consumer{r}"]["phases"][1] for r in (0, 1))
    for r, c in ((0, c0), (1, c1)):
        err = c["errors"][0]
        assert err is not None and "request 1" in err, (r, err)
        assert c["tokens"][0] == [], r
        assert c["matched"][0] > 0, r  # it was offered
    assert c1["metrics"]["loads_failed"] == 1 and c0["metrics"].get("loads_failed", 0) == 0
    assert res["producer0"]["phases"][1]["leases_back"]


@needs_mpi
def test_tp2_processes_prefix_reservations(tmp_path):
    """Prefix reservations (TensorRT-LLM main) across real rank processes: rank 0's
    scheduler reserves on both producer ranks, each rank process loads its own shard from
    its plan and reports it in its own ``get_finished_prefix_loads``; the engine retires a
    load once both ranks reported it. Tokens and each rank's pages match (async, sync);
    then a load failing on rank 1 alone fails its request on both processes (async,
    sync), bounded, with no token."""
    base = {"kv_manager": "v2", "prefix": True}
    fail = {"batches": [[0], [1], [2]], "fail_rank1": 1, "max_tokens": 5}
    combos = [("async", {}), ("sync", {}), ("async", fail), ("sync", fail)]
    case = {"phases": [{**base, "load_mode": lm, **extra} for lm, extra in combos]}
    res = _ok(*_mpirun(case, tmp_path))
    mono = {6: _mono("v2"), 5: _mono("v2", max_tokens=5)}
    for i, (lm, extra) in enumerate(combos):
        prod = [res[f"producer{r}"]["phases"][i] for r in (0, 1)]
        cons = [res[f"consumer{r}"]["phases"][i] for r in (0, 1)]
        want = mono[extra.get("max_tokens", 6)]
        bad = {1} if extra else set()
        for r in (0, 1):
            c, p = cons[r], prod[r]
            for k in range(3):
                if k in bad:  # failed on both ranks, by name, from rank 1's report
                    err = c["errors"][k]
                    assert err is not None and f"request {k + 1}" in err, (lm, r, err)
                    assert "injected" in err and c["tokens"][k] == [], (lm, r, err)
                    assert c["took"][k] < 5.0, (lm, r)
                    continue
                assert c["errors"][k] is None and c["tokens"][k] == want[k], (lm, r, k)
                assert c["matched"][k] > 0 and c["loaded"][k], (lm, r, k)
                for where, data in c["loaded"][k].items():  # this rank's shard
                    assert data == p["computed"][k][where], f"{lm} rank {r} req {k} {where}"
            assert c["calls"]["get_finished_prefix_loads"] > 0
            assert p["leases_back"] and p["pins_back"], f"{lm}: producer rank {r}"
        if extra:
            assert cons[1]["hit"], "the failure was not injected"
            assert "TP rank 1" in cons[0]["errors"][1]
            assert cons[0]["metrics"]["loads_failed_on_other_rank"] == 1
        # rank 0 alone reserved, and released each accepted range once retired
        assert cons[0]["calls"]["reserve_prefix"] == 3
        assert cons[0]["calls"]["release_prefix_reservation"] == 3
        assert "reserve_prefix" not in cons[1]["calls"]
        assert cons[0]["calls"].get("get_num_new_matched_tokens", 0) == 0


@needs_mpi
def test_tp2_processes_divergent_hook_is_a_hang_not_a_pass(tmp_path):
    """The layers' collective is real: rank 1 alone raising in a forward hook leaves rank
    0 waiting for its heads; the job fails (RankHangError naming the layer), never passes."""
    case = {"kind": "diverge", "roles": ["producer"], "hang_s": 4.0}
    rc, output, res = _mpirun(case, tmp_path, nprocs=2)
    assert rc != 0, output[-3000:]
    r0 = res.get("producer0", {}).get("status", "")
    assert r0.startswith("hang:") and "layer 1 attention heads" in r0, (r0, output[-3000:])
    r1 = res.get("producer1", {}).get("status")
    if r1 is not None:  # rank 1 failed its batch and waits in the executor's broadcast
        assert r1.startswith("hang:") and "request_finished" in r1, r1


def test_bus_wait_polls_a_load_dispatched_while_the_bus_idles():
    """A rank's own load is polled by the bus thread's tick; a wait must not sit out the
    thread's idle poll (50 ms) first. Measured across processes before the fix: a TP=2
    layer-wise load's ``wait_for_layer_load`` took ~40 ms per request, 1 ms at TP=1."""
    from disagg.consumer.rank_bus import RankBus

    ticked = threading.Event()
    dispatched = threading.Event()
    seen: list[float] = []

    def tick() -> bool:  # the service's: poll our loads in flight (none until dispatched)
        if dispatched.is_set() and not seen:
            seen.append(time.monotonic())
            bus.record(5, 0, "")
        ticked.set()
        return False

    bus = RankBus(0, 1, tick)
    try:
        for _ in range(3):  # the thread is past a pass and into its idle poll
            ticked.clear()
            assert ticked.wait(2.0)
        t0 = time.monotonic()
        dispatched.set()  # a load starts on the engine thread, which then waits on it
        assert bus.wait(5, None, t0 + 2.0) == ("", -1)
        assert seen and seen[0] - t0 < 0.025, f"polled {1000 * (seen[0] - t0):.0f} ms late"
    finally:
        bus.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: harness
    sys.exit(_main(sys.argv[1], Path(sys.argv[2])))


@needs_mpi
@pytest.mark.parametrize("tps", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_unequal_tp_rank_processes_match_monolithic(tmp_path, tps):
    """A producer of TP P and a consumer of TP D, every rank its own process: each consumer
    rank loads its KV heads from the producer rank(s) holding them (D < P: both producer
    ranks' halves of its page; D > P: its half of the producer's page)."""
    p, d = tps
    case = {
        "tps": {"producer": p, "consumer": d},
        "phases": [{"kv_manager": "v2", "load_mode": "async"}],
    }
    res = _ok(*_mpirun(case, tmp_path, nprocs=p + d), nprocs=p + d)
    mono = _mono("v2")
    for r in range(d):
        c = res[f"consumer{r}"]["phases"][0]
        assert c["errors"] == [None] * 3 and c["tokens"] == mono, r
        assert all(n > 0 for n in c["matched"]), f"consumer rank {r} recomputed"
        assert c["metrics"]["pages_loaded"] > 0
    for r in range(p):
        prod = res[f"producer{r}"]["phases"][0]
        assert prod["metrics"]["pages_pushed"] > 0, f"producer rank {r} pushed nothing"
        assert prod["leases_back"] and prod["pins_back"], f"producer rank {r} leases/pins"
