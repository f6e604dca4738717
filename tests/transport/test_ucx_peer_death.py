"""A producer that dies while the consumer reads its store on the UCX plane's shm *get*
path (``ucp_get_nbx`` over cma: a store not from ``register_source``, e.g. a pinned host
store): the consumer must survive, fail the transfer by name, count no wrong page as
landed, and go on serving. Without ``cma_guard.guard_cma`` UCX aborted the consumer here
(``cma_ep.c: process_vm_readv ... No such process``, SIGABRT): shm endpoints run without
UCX error handling, so UCX logged the failed copy as FATAL. ``DISAGG_UCX_CMA_GUARD=0``
brings the old behaviour back (the tests below then fail). The mirror image on the shm
*tag* path (``DISAGG_UCX_RMA=0``: the producer writes rendezvous payloads into the
consumer with ``process_vm_writev``), a consumer killed under those writes, used to
abort the producer the same way; the second half of this file tests that the producer
now fails the push by name and serves on. Skipped without ucxx or the ``_ucxrma``
extension (which carries the guard)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from harness import spawn_context

pytest.importorskip(
    "disagg.transport.ucx.plane", reason="ucxx is not installed (pip install disagg[ucx])"
)
sys.path.insert(0, os.path.dirname(__file__))
from test_ucx_rma import SLOTS, _slab, _want  # noqa: E402

from disagg.transport.dataplane import StoreRows  # noqa: E402
from disagg.transport.ucx import cma_guard, native_rma  # noqa: E402

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        getattr(native_rma, "_ucxrma", None) is None, reason="the _ucxrma extension is not built"
    ),
]

WIDTH, N = 1 << 20, 48  # 48 MiB per transfer: several ms of cma reads


def _sender(q_ep, transfer, salt, rows, dst, q_out, hold):
    """Producer with a plain host store (not ``register_source``): the consumer reads it
    with gets (cma). Answers "ready" once its plane is up, then takes the consumer's
    endpoint from ``q_ep`` and pushes (so a transfer's deadline, which runs from the
    consumer's ``expect``, never covers this process's start: under load a spawn and
    its imports take seconds). ``hold``: wait there (the test kills this process)."""
    from disagg.transport.ucx.plane import UcxDataPlane

    plane = UcxDataPlane(channel="shm")
    slab = _slab(N, WIDTH, salt)
    src = StoreRows(slab, np.asarray(rows, dtype=np.int64), ((0, WIDTH),))
    q_out.put("ready")
    endpoint, caps = q_ep.get(timeout=300)
    h = plane.post_push(endpoint, transfer, 3, b"tok", [(0, src, dst)], 60, caps)
    if hold is not None:
        q_out.put("posted")
        hold.wait(120)
    st = plane.wait_push(h, 70)
    q_out.put((st.state.value, st.error))
    plane.close()


def _kill_during_reads(victim):
    """Make this process's first RMA reader post about 4 MiB of reads, then SIGKILL the
    producer (pid from ``victim``, set by the test once the sender started) and wait
    until it is gone (a zombie has no memory left to read), then go on reading: the
    remaining reads meet a dead process, deterministically."""
    import threading

    orig = native_rma.RmaPull.step
    fired = threading.Lock()

    def step(self, worker_handle, max_bytes=0):
        if not fired.acquire(blocking=False):
            return orig(self, worker_handle, max_bytes)
        got = orig(self, worker_handle, 4 << 20)
        t_end = time.time() + 10
        while victim.value == 0 and time.time() < t_end:
            time.sleep(0.001)
        pid = victim.value
        os.kill(pid, signal.SIGKILL)
        while time.time() < t_end:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        break
            except OSError:
                break
            time.sleep(0.001)
        return got + orig(self, worker_handle, max_bytes)

    native_rma.RmaPull.step = step


def _stall_first_pull(q_out):
    """Fault injection: the progress thread's share of this process's first RMA batch
    never reports its reads complete (as a request that never completes would: its
    reads are still reaped, only ``drive`` keeps answering "1 in flight"), so that
    batch can never end; "reading" goes to ``q_out`` when it starts. Lanes' shares are
    left alone."""
    import threading

    orig = native_rma.RmaPull.drive
    stalled: list = []
    lock = threading.Lock()

    def drive(self, worker_handle, rounds):
        left = orig(self, worker_handle, rounds)
        if threading.current_thread().name.startswith("disagg-ucx-read"):
            return left
        with lock:
            if not stalled:
                stalled.append(self)
                q_out.put("reading")
        return max(left, 1) if stalled[0] is self else left

    native_rma.RmaPull.drive = drive


def _receiver(n_transfers, deadline_s, q_out, q_in, victim, stall=False):
    """Consumer: serves transfers 7, 8, ... one after another on one plane: for each,
    waits for "go" on ``q_in`` (the test's producer is up by then), expects it (with
    ``deadline_s``, or its own entry when ``deadline_s`` is a list), reports its
    endpoint, then (state, error, pages, pool, stats); with ``victim``, the first
    one's producer is killed during its reads (``_kill_during_reads``); with ``stall``,
    the first batch never ends on the progress thread (``_stall_first_pull``)."""
    from disagg.transport.ucx.plane import UcxDataPlane

    if victim is not None:
        _kill_during_reads(victim)
    if stall:
        _stall_first_pull(q_out)
    plane = UcxDataPlane(channel="shm")
    pool = torch.zeros(SLOTS, WIDTH, dtype=torch.uint8)
    plane.register_regions([[pool]])
    q_out.put("ready")
    deadlines = deadline_s if isinstance(deadline_s, list) else [deadline_s] * n_transfers
    for k in range(n_transfers):
        assert q_in.get(timeout=300) == "go"
        pool.zero_()
        plane.expect(7 + k, 3, b"tok", [N], deadlines[k])
        q_out.put((plane.endpoint, plane.capabilities))
        st = plane.wait(7 + k, deadlines[k] + 10)
        q_out.put((st.state.value, st.error, st.pages, pool.numpy().copy(), dict(plane.stats)))
    q_in.get(timeout=60)
    plane.close()
    q_out.put("closed")


def _stop_all(procs, grace=0.0):
    """Test cleanup: each process still running after ``grace`` seconds is resumed (it
    may be SIGSTOPped) and killed, then reaped."""
    for p in procs:
        if grace:
            p.join(grace)
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.join(5)


def _answer(q, proc, timeout):
    """The consumer's next answer (``_get``)."""
    return _get(q, proc, timeout, "consumer")


def _second_producer_lands(q_r, r, q_in, q_ep2, q_s2, rows2, dst2, within_s=None):
    """After the first producer's failure: the same consumer serves the second producer
    (already started) byte-exact (within ``within_s`` when given), then closes cleanly."""
    start = time.monotonic()
    _serve(q_r, r, q_in, q_ep2)
    state, err2, pages, pool, stats = _answer(q_r, r, 60)
    assert (state, err2, pages) == ("done", None, N), (err2, stats)
    if within_s is not None:
        assert time.monotonic() - start < within_s
    want = _want(_slab(N, WIDTH, 2).numpy(), rows2, ((0, WIDTH),), dst2, WIDTH)
    np.testing.assert_array_equal(pool[dst2], want[dst2])
    assert q_s2.get(timeout=30) == ("done", None)
    q_in.put(None)
    assert _answer(q_r, r, 30) == "closed"
    r.join(15)
    assert r.exitcode == 0


def _reads(stats):
    return stats.get("rma_reads", 0) + stats.get("rma_lane_reads", 0)


def _check_failed(answer, rows, dst, salt):
    """FAILED with a reason; every page the consumer counted as landed is right."""
    state, err, pages, pool, stats = answer
    assert stats.get("rma_mapped_batches", 0) == 0, stats  # the get path, not a mapping
    assert state == "failed" and err, (state, err)
    if "UCS_ERR_IO_ERROR" in err:  # a failed copy: some read was posted (a kill before the
        # first header leaves none; one before the endpoint or rkey is made fails those)
        assert _reads(stats) > 0, stats
    want = _want(_slab(N, WIDTH, salt).numpy(), rows, ((0, WIDTH),), dst, WIDTH)
    good = sum(np.array_equal(pool[d], want[d]) for d in dst)
    assert good >= pages, (good, pages)
    return err


def _pair(ctx, transfer, salt, rows, dst, hold):
    """A producer process (``_sender``), up and waiting for the consumer's endpoint:
    (process, its answers, the queue the endpoint goes in)."""
    q_s, q_ep = ctx.Queue(), ctx.Queue()
    s = ctx.Process(target=_sender, args=(q_ep, transfer, salt, rows, dst, q_s, hold))
    s.start()
    assert _get(q_s, s, 120, "producer") == "ready"
    return s, q_s, q_ep


def _serve(q_r, r, q_in, q_ep):
    """Tell the consumer to expect its next transfer; hand its endpoint to the producer."""
    q_in.put("go")
    q_ep.put(_answer(q_r, r, 60))


def _held_pair(ctx, procs, transfer, salt, rows, dst):
    """A producer (``_pair``) that waits after posting until the test kills it, added to
    ``procs``. Its event stays referenced here until the child answered "ready" (it has
    unpickled the event by then)."""
    hold = ctx.Event()
    s, q_s, q_ep = _pair(ctx, transfer, salt, rows, dst, hold)
    procs.append(s)
    return s, q_s, q_ep


def _serve_posted(q_r, r, q_in, q_ep, q_s):
    """``_serve``, then wait until the producer posted its push."""
    _serve(q_r, r, q_in, q_ep)
    assert q_s.get(timeout=60) == "posted"


def test_producer_killed_during_get_reads_fails_by_name_and_consumer_serves_on():
    """The producer (a plain host store: gets over cma) is SIGKILLed after the consumer
    posted its first ~4 MiB of reads, and the rest are read from the dead process: the
    consumer's transfer ends FAILED naming the read's failure (UCS_ERR_IO_ERROR and the
    cma call's ``No such process``), no page counted as landed is wrong, and the same
    consumer process then serves a second producer's transfer byte-exact and closes
    cleanly. Before the guard (``DISAGG_UCX_CMA_GUARD=0``) UCX aborted the consumer here
    every time (exit code -6)."""
    ctx = spawn_context()
    q_r, q_in = ctx.Queue(), ctx.Queue()
    victim = ctx.Value("i", 0)
    rng = np.random.default_rng(5)
    rows = rng.permutation(N).tolist()
    dst = rng.permutation(SLOTS)[:N].tolist()
    rows2 = rng.permutation(N).tolist()
    dst2 = rng.permutation(SLOTS)[:N].tolist()
    r = ctx.Process(target=_receiver, args=(2, 20.0, q_r, q_in, victim))
    r.start()
    procs = [r]
    try:
        assert _answer(q_r, r, 120) == "ready"
        s, q_s, q_ep = _held_pair(ctx, procs, 7, 1, rows, dst)
        victim.value = s.pid
        s2, q_s2, q_ep2 = _pair(ctx, 8, 2, rows2, dst2, None)  # up before transfer 8
        procs.append(s2)
        _serve_posted(q_r, r, q_in, q_ep, q_s)
        err = _check_failed(_answer(q_r, r, 60), rows, dst, 1)
        # names the producer, and why: the failed cma copy, or (a reader lane that makes
        # its endpoint only after the kill, seen under load) the producer's shm segment
        assert err.startswith(("RMA read from ucx+shm://", "RMA reads from ucx+shm://")), err
        cma = "UCS_ERR_IO_ERROR" in err and "No such process" in err
        assert cma or "UCXXShmemSegmentError" in err, err
        # the same consumer, a new producer: byte-exact
        _second_producer_lands(q_r, r, q_in, q_ep2, q_s2, rows2, dst2)
    finally:
        _stop_all(procs, grace=1.0)


def test_batch_that_never_ends_does_not_wedge_the_consumer():
    """A dead producer can never wedge the consumer: the progress thread's share of the
    first producer's batch never completes (``_stall_first_pull``: as a request to a
    dead or stopped peer that never completes would), the producer is SIGSTOPped (so
    no TransferDone comes either), the consumer's transfer misses its deadline, and the
    producer is killed; a second producer's transfer to the same consumer then lands
    byte-exact within its deadline (the batch of an ended transfer no longer holds the
    progress thread on the oldest batch: ``UcxDataPlane._rma_reap``). Before that fix
    the second transfer missed its deadline with 0 of 48 pages received."""
    ctx = spawn_context()
    q_r, q_in = ctx.Queue(), ctx.Queue()
    rng = np.random.default_rng(9)
    rows = rng.permutation(N).tolist()
    dst = rng.permutation(SLOTS)[:N].tolist()
    rows2 = rng.permutation(N).tolist()
    dst2 = rng.permutation(SLOTS)[:N].tolist()
    # the first transfer can only miss its deadline (its batch never ends; its reads
    # start within ms of the push): a short one; the second lands in under 1 s: 8 s
    r = ctx.Process(target=_receiver, args=(2, [3.0, 8.0], q_r, q_in, None, True))
    r.start()
    procs = [r]
    try:
        assert _answer(q_r, r, 120) == "ready"
        s, q_s, q_ep = _held_pair(ctx, procs, 7, 1, rows, dst)
        s2, q_s2, q_ep2 = _pair(ctx, 8, 2, rows2, dst2, None)
        procs.append(s2)
        _serve_posted(q_r, r, q_in, q_ep, q_s)
        assert _answer(q_r, r, 60) == "reading"  # the consumer reads its batch
        os.kill(s.pid, signal.SIGSTOP)
        state, err, pages, _, stats = _answer(q_r, r, 60)
        assert state == "failed" and "deadline" in err, (state, err)
        assert stats.get("rma_reads", 0) > 0, stats  # its batch was being read
        _gone(s)
        _second_producer_lands(q_r, r, q_in, q_ep2, q_s2, rows2, dst2, within_s=8.0)
    finally:
        _stop_all(procs)


@pytest.mark.slow
def test_producer_killed_at_timed_moments_never_takes_the_consumer_down():
    """16 producers with plain host stores are SIGKILLed 0-14 ms after posting their
    48 MiB push (so kills land before, during and after the consumer's cma reads), each
    against a fresh consumer: every consumer answers (FAILED with a reason, or DONE when
    the reads and TransferDone beat the kill), counts no wrong page, and exits cleanly;
    at least one kill met reads in flight (reads were posted, and it failed). Before the
    guard (``DISAGG_UCX_CMA_GUARD=0``) 7 of 15 such consumers were aborted by UCX
    (exit code -6) in the run that set this test up. ~100 s."""
    ctx = spawn_context()
    rng = np.random.default_rng(3)
    rows = rng.permutation(N).tolist()
    dst = rng.permutation(SLOTS)[:N].tolist()
    outcomes, met_reads = [], 0
    for i in range(16):
        q_r, q_in = ctx.Queue(), ctx.Queue()
        r = ctx.Process(target=_receiver, args=(1, 10.0, q_r, q_in, None))
        r.start()
        procs = [r]
        try:
            assert _answer(q_r, r, 120) == "ready"
            s, q_s, q_ep = _held_pair(ctx, procs, 7, 0, rows, dst)
            _serve_posted(q_r, r, q_in, q_ep, q_s)
            time.sleep(0.002 * (i % 8))
            os.kill(s.pid, signal.SIGKILL)
            answer = _answer(q_r, r, 60)
            state, err, pages = answer[:3]
            if state == "done":  # finished before the kill: every page right
                want = _want(_slab(N, WIDTH, 0).numpy(), rows, ((0, WIDTH),), dst, WIDTH)
                np.testing.assert_array_equal(answer[3][dst], want[dst])
            else:
                _check_failed(answer, rows, dst, 0)
                met_reads += _reads(answer[4]) > 0
            outcomes.append(err or "done")
            q_in.put(None)
            assert _answer(q_r, r, 30) == "closed"
            r.join(15)
            assert r.exitcode == 0, f"kill {i}: consumer exit code {r.exitcode}"
        finally:
            for p in procs:
                p.join(1)
                if p.is_alive():
                    p.kill()
    assert met_reads and any("RMA read" in o for o in outcomes), outcomes


def test_guard_takes_cma_fatal_messages_only(tmp_path):
    """In a fresh interpreter with ucxx loaded: the guard is on, a FATAL message from
    cma_ep.c (sent through ucs_log_dispatch as UCX sends it) is counted and the process
    goes on; a FATAL message from any other file still aborts it (UCS's own handler:
    the guard takes nothing else)."""
    code = (
        "import ctypes, sys\n"
        "import ucxx._lib.libucxx\n"
        "from disagg.transport.ucx import cma_guard\n"
        "assert cma_guard.guard_cma(), cma_guard.cma_guard_reason()\n"
        "ucs = cma_guard._libucs()\n"
        "d = ctypes.cast(ucs.ucs_log_dispatch, ctypes.c_void_p).value\n"
        "comp = ctypes.addressof(ctypes.c_char.in_dll(ucs, 'ucs_global_opts'))\n"
        "cma_guard._ucxrma.cma_log_test(d, comp, sys.argv[1])\n"
        "print('alive', cma_guard.cma_failures(), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def run(file):
        return subprocess.run(
            [sys.executable, "-c", code, file], env=env, capture_output=True, text=True, timeout=60
        )

    ok = run("/x/src/uct/sm/scopy/cma/cma_ep.c")
    assert ok.returncode == 0, ok.stderr
    assert "alive (1, 'process_vm_readv(test) returned -1: No such process')" in ok.stdout
    other = run("/x/src/uct/sm/mm/base/mm_ep.c")
    assert other.returncode == -signal.SIGABRT, (other.returncode, other.stdout, other.stderr)
    assert "alive" not in other.stdout


# ---- the mirror image: a consumer killed during the producer's cma writes (tag path) ----
# With the one-sided reads off (DISAGG_UCX_RMA=0, or _ucxrma not built) a shm push goes as
# tag messages; a contiguous message (a span of store rows sent as a view, or a segment
# gathered into the send ring) is a rendezvous that the *producer* completes with
# process_vm_writev into the consumer's receive buffer (UCX's "zero-copy flushed write to
# remote" over cma). Before the guard, a consumer killed under those writes made UCX abort
# the producer (``cma_ep.c: process_vm_writev ... No such process``, SIGABRT).


def _tag_env(ring: bool) -> None:
    """This child's UCX plane on the shm tag path (read once, at first use)."""
    os.environ["DISAGG_UCX_RMA"] = "0"
    if ring:
        os.environ["DISAGG_UCX_IOV"] = "0"  # scattered rows: gathered into the send ring


def _tag_producer(ring, q_in, q_out):
    """Producer on the shm tag path, serving pushes one after another on one plane:
    each command ``(endpoint, caps, transfer, rows, dst, salt, deadline_s)`` answers
    "posted", then ``(state, error, cma failures taken, stats)``; None closes it."""
    _tag_env(ring)
    from disagg.transport.ucx.plane import UcxDataPlane

    plane = UcxDataPlane(channel="shm")
    while (cmd := q_in.get(timeout=300)) is not None:
        ep, caps, transfer, rows, dst, salt, deadline_s = cmd
        slab = _slab(N, WIDTH, salt)
        src = StoreRows(slab, np.asarray(rows, dtype=np.int64), ((0, WIDTH),))
        h = plane.post_push(ep, transfer, 3, b"tok", [(0, src, dst)], deadline_s, caps)
        q_out.put("posted")
        st = plane.wait_push(h, deadline_s + 10)
        q_out.put((st.state.value, st.error, cma_guard.cma_failures(), dict(plane.stats)))
    plane.close()
    q_out.put("closed")


def _stop_producer_at_first_receive(producer, q_out):
    """The first time this consumer posts the receive of an arrived payload message (a
    rendezvous: posting it sends the producer UCX's ready-to-receive, after which the
    producer writes with cma), SIGSTOP the producer (pid from ``producer``) first, so no
    byte of that message is written yet, and report "stopped" 0.3 s later (this
    thread's progress has flushed the ready-to-receive by then). The test then kills
    this process and resumes the producer: its writes meet a dead process,
    deterministically."""
    import threading

    from disagg.transport.ucx.receive import Receiver

    orig = Receiver.post
    fired = threading.Lock()

    def post(self, probe, p):
        if not fired.acquire(blocking=False):
            return orig(self, probe, p)
        pid = producer.value
        os.kill(pid, signal.SIGSTOP)
        t_end = time.time() + 10
        while time.time() < t_end:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            time.sleep(0.001)
        ok = orig(self, probe, p)
        threading.Timer(0.3, q_out.put, ("stopped",)).start()
        return ok

    Receiver.post = post


def _tag_consumer(ring, transfer, deadline_s, q_out, q_in, producer):
    """Consumer on the shm tag path: expects one transfer of N pages, reports its
    endpoint, then ``(state, error, pages, pool, stats)``; with ``producer``, stops the
    producer at its first payload receive (``_stop_producer_at_first_receive``)."""
    _tag_env(ring)
    from disagg.transport.ucx.plane import UcxDataPlane

    if producer is not None:
        _stop_producer_at_first_receive(producer, q_out)
    plane = UcxDataPlane(channel="shm")
    pool = torch.zeros(SLOTS, WIDTH, dtype=torch.uint8)
    plane.register_regions([[pool]])
    plane.expect(transfer, 3, b"tok", [N], deadline_s)
    q_out.put((plane.endpoint, plane.capabilities))
    st = plane.wait(transfer, deadline_s + 10)
    q_out.put((st.state.value, st.error, st.pages, pool.numpy().copy(), dict(plane.stats)))
    q_in.get(timeout=60)
    plane.close()


def _get(q, proc, timeout, who):
    """The next item from ``q``, or AssertionError naming ``who``'s exit code when it
    died first (UCX's abort: -6) or never answered."""
    t_end = time.time() + timeout
    while time.time() < t_end:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            if not proc.is_alive():
                try:
                    return q.get(timeout=1)
                except queue.Empty:
                    raise AssertionError(f"the {who} died (exit code {proc.exitcode})") from None
    raise AssertionError(f"the {who} never answered (alive: {proc.is_alive()})")


def _gone(proc, timeout=15.0):
    """Kill ``proc`` (SIGKILL) and wait until it is reaped: its memory is gone."""
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout)
    assert not proc.is_alive()


def _start_tag_consumer(ctx, ring, transfer, deadline_s, producer):
    """A ``_tag_consumer`` process, started: (process, its answers, its commands)."""
    q_r, q_in = ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=_tag_consumer, args=(ring, transfer, deadline_s, q_r, q_in, producer))
    r.start()
    return r, q_r, q_in


def _tag_push_indices(rng, ring):
    """Source rows (scattered through the ring, or one run) and destination slots."""
    rows = rng.permutation(N).tolist() if ring else list(range(N))
    return rows, rng.permutation(SLOTS)[:N].tolist()


def _producer_closes(q_cmd, q_p, p):
    """Tell the tag producer to close: it says so and exits 0."""
    q_cmd.put(None)
    assert _get(q_p, p, 30, "producer") == "closed"
    p.join(15)
    assert p.exitcode == 0


def _serve_new_consumer(ctx, p, q_p, q_cmd, ring, rng, transfer, salt):
    """The producer ``p`` pushes N pages to a new consumer: byte-exact, both DONE."""
    r, q_r, q_in = _start_tag_consumer(ctx, ring, transfer, 20.0, None)
    try:
        ep, caps = _get(q_r, r, 60, "consumer")
        assert caps.rma == 0  # the tag path
        rows, dst = _tag_push_indices(rng, ring)
        q_cmd.put((ep, caps, transfer, rows, dst, salt, 20.0))
        assert _get(q_p, p, 60, "producer") == "posted"
        state, err, pages, pool, _ = _get(q_r, r, 60, "consumer")
        assert (state, err, pages) == ("done", None, N), err
        want = _want(_slab(N, WIDTH, salt).numpy(), rows, ((0, WIDTH),), dst, WIDTH)
        np.testing.assert_array_equal(pool[dst], want[dst])
        state, err, _, _ = _get(q_p, p, 60, "producer")
        assert (state, err) == ("done", None), err
        q_in.put(None)
        r.join(15)
        assert r.exitcode == 0
    finally:
        if r.is_alive():
            r.kill()


@pytest.mark.parametrize("ring", [False, True], ids=["span", "ring"])
def test_consumer_killed_during_tag_path_cma_writes_fails_push_and_producer_serves_on(ring):
    """Tag path on shm (``DISAGG_UCX_RMA=0``): 48 MiB of store rows, sent as three 16 MiB
    rendezvous messages (``span``: one run of rows, sent as views; ``ring``: random rows
    gathered into the send ring, ``DISAGG_UCX_IOV=0``) that the producer writes into the
    consumer with cma. The producer is stopped just before the consumer's first
    ready-to-receive, the consumer is killed and reaped, and the producer resumed: its
    process_vm_writev meets a dead process. The producer survives, its push FAILS at
    once (not at its 20 s deadline) naming the consumer's endpoint and the cma failure,
    and the same producer then serves a new consumer byte-exact and closes cleanly.
    Without the guard (``DISAGG_UCX_CMA_GUARD=0``) UCX aborts the producer (-6)."""
    ctx = spawn_context()
    rng = np.random.default_rng(17)
    q_cmd, q_p = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_tag_producer, args=(ring, q_cmd, q_p))
    p.start()
    producer = ctx.Value("i", p.pid)
    r, q_r, q_in = _start_tag_consumer(ctx, ring, 7, 30.0, producer)
    try:
        ep, caps = _get(q_r, r, 60, "consumer")
        assert caps.rma == 0  # the tag path
        rows, dst = _tag_push_indices(rng, ring)
        q_cmd.put((ep, caps, 7, rows, dst, 1, 20.0))
        # (the producer may be stopped before its "posted" left its queue's feeder)
        assert _get(q_r, r, 60, "consumer") == "stopped"
        _gone(r)
        start = time.monotonic()
        os.kill(p.pid, signal.SIGCONT)
        assert _get(q_p, p, 60, "producer") == "posted"
        state, err, (n_cma, last), stats = _get(q_p, p, 30, "producer")
        took = time.monotonic() - start
        assert state == "failed" and err, (state, err)
        assert err.startswith(f"send to {ep} failed"), err  # names the consumer
        assert n_cma >= 1 and "process_vm_writev" in last and "No such process" in last, last
        assert "process_vm_writev" in err and "No such process" in err, err
        assert took < 10, took  # the failed write, not the 20 s deadline
        # the same producer, a new consumer: byte-exact, twice
        _serve_new_consumer(ctx, p, q_p, q_cmd, ring, rng, 8, 2)
        _serve_new_consumer(ctx, p, q_p, q_cmd, ring, rng, 9, 3)
        _producer_closes(q_cmd, q_p, p)
    finally:
        _stop_all((r, p))


@pytest.mark.slow
def test_consumers_killed_at_timed_moments_never_take_the_tag_path_producer_down():
    """One producer on the shm tag path (``DISAGG_UCX_RMA=0``; a run of rows: 16 MiB
    rendezvous messages written with cma) pushes 48 MiB to 16 consumers in turn, each
    SIGKILLed 0-14 ms after the push was posted (before, during and after the cma
    writes): the producer survives every kill, each push ends FAILED with a reason
    (or DONE when it finished first), at least one failure names the failed
    ``process_vm_writev``, and the same producer then serves a new consumer byte-exact
    and closes cleanly. Without the guard (``DISAGG_UCX_CMA_GUARD=0``) UCX aborts the
    producer at the first kill that meets a write. ~90 s."""
    ctx = spawn_context()
    rng = np.random.default_rng(4)
    q_cmd, q_p = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_tag_producer, args=(False, q_cmd, q_p))
    p.start()
    outcomes = []
    try:
        for i in range(16):
            r, q_r, q_in = _start_tag_consumer(ctx, False, 7, 30.0, None)
            try:
                ep, caps = _get(q_r, r, 60, "consumer")
                dst = rng.permutation(SLOTS)[:N].tolist()
                q_cmd.put((ep, caps, 7, list(range(N)), dst, 0, 3.0))
                assert _get(q_p, p, 60, f"producer (kill {i})") == "posted"
                time.sleep(0.002 * (i % 8))
                _gone(r)
                state, err, _, _ = _get(q_p, p, 30, f"producer (kill {i})")
                assert state == "done" or (state == "failed" and err), (i, state, err)
                if state == "failed":
                    assert err.startswith(f"send to {ep} failed") or ep in err, err
                outcomes.append(err or "done")
            finally:
                if r.is_alive():
                    r.kill()
                r.join(5)
        kinds = [
            "cma" if "process_vm_writev" in o else "deadline" if "deadline" in o else o
            for o in outcomes
        ]
        print("outcomes:", {k: kinds.count(k) for k in set(kinds)})
        assert any("process_vm_writev" in o for o in outcomes), outcomes
        _serve_new_consumer(ctx, p, q_p, q_cmd, False, rng, 8, 2)
        _producer_closes(q_cmd, q_p, p)
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)
