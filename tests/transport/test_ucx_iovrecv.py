"""Scatter-gather receives over tcp (ucx/receive.py; on under the hardened tcp settings,
``DISAGG_UCX_TCP_IOV_RECV=0`` turns it off): a tcp receiver posts each packed segment
for host slots as ONE iov receive straight into the slots (``iov.tag_recv_exact``),
instead of a receive into scratch and a row copy.
Checked: the entries (``page_iov``), pushes between two processes byte for byte (one
region, two strided regions, the switch off), an abort while receives straight into the
slots are in flight from a stalled producer (iov receives, and runs landing in place:
the plane severs the producer's connection, nothing lands when it resumes, and the next
push lands whole), and UCX's truncation of a message longer than the iov. Skipped
without ucxx."""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np
import pytest
import torch
from harness import spawn_context

pytest.importorskip(
    "disagg.transport.ucx.plane", reason="ucxx is not installed (pip install disagg[ucx])"
)
from disagg.transport.dataplane import StoreRows  # noqa: E402
from disagg.transport.ucx import iov, settings  # noqa: E402
from disagg.transport.ucx.plane import UcxDataPlane  # noqa: E402

pytestmark = pytest.mark.timeout(120)

PB = 64 << 10
SLOTS = 160


def _slab(rows: int, width: int, salt: int = 0) -> torch.Tensor:
    from harness import pattern_rows

    return torch.from_numpy(pattern_rows(rows, width, salt * 29))


def test_page_iov_entries():
    regions = [(1000, 300, 100), (50_000, 64, 40)]  # strided rows, two regions
    e = iov.page_iov(regions, np.array([3, 0, 7]))
    assert e.shape == (3, 2, 2) and e.dtype == np.uint64
    assert e.reshape(-1, 2).tolist() == [
        [1900, 100], [50_192, 40],
        [1000, 100], [50_000, 40],
        [3100, 100], [50_448, 40],
    ]  # fmt: skip
    # a segment's entries are a view of its pages, C-contiguous as UCX wants them
    seg = e[1:3].reshape(-1, 2)
    assert seg.flags.c_contiguous and np.shares_memory(seg, e)
    assert iov.page_iov(regions, np.array([], dtype=np.int64)).shape == (0, 2, 2)


def test_iov_recv_default(monkeypatch):
    """On under the hardened tcp settings (large am segments), off under UCX's own
    defaults (put rendezvous, 8 KiB segments: nothing to gain); the switch wins."""
    default = settings.tcp_iov_recv_default
    monkeypatch.delenv("DISAGG_UCX_TCP_IOV_RECV", raising=False)
    for k in ("UCX_RNDV_SCHEME", "UCX_TCP_TX_SEG_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert default(settings.TCP_HARDENING) and not default({})
    monkeypatch.setenv("DISAGG_UCX_TCP_IOV_RECV", "0")
    assert not default(settings.TCP_HARDENING)
    monkeypatch.setenv("DISAGG_UCX_TCP_IOV_RECV", "1")
    assert default(settings.TCP_HARDENING) and default({})


def _pool(layout: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The receiver's memory and its regions: one [SLOTS, PB] region, or two regions
    (40 KiB and 24 KiB columns) that are strided views of one wider buffer."""
    if layout == "one":
        pool = torch.zeros(SLOTS, PB, dtype=torch.uint8)
        return pool, [pool]
    wide = torch.zeros(SLOTS, PB + 4096, dtype=torch.uint8)
    return wide, [wide[:, 4096 : 4096 + (40 << 10)], wide[:, 4096 + (40 << 10) :]]


def _view(buf: np.ndarray, layout: str) -> np.ndarray:
    """The pages as the sender sent them ([SLOTS, PB]) out of the receiver's memory."""
    return buf if layout == "one" else buf[:, 4096:]


def _receiver(layout, env, transfers, q_out, q_in):
    os.environ.update(env)
    plane = UcxDataPlane(channel="tcp")
    mem, regions = _pool(layout)
    plane.register_regions([regions])
    q_out.put((plane.endpoint, plane.capabilities, plane.tcp_iov_recvs))
    for tid, pages in transfers:
        plane.expect(tid, 3, b"tok", [pages], 60)
        q_out.put("expecting")
        st = plane.wait(tid, 60)
        q_out.put((st.state.value, st.error, mem.numpy().copy(), plane.stats["iov_recvs"]))
    q_in.get(timeout=60)
    plane.close()


def _sender(endpoint, caps, pushes, q_out, q_go):
    plane = UcxDataPlane(channel="tcp")
    for tid, rows, dst, salt in pushes:
        q_go.get(timeout=60)
        slab = _slab(2 * SLOTS, PB, salt)
        src = StoreRows(slab, np.asarray(rows, dtype=np.int64), ((0, PB),))
        h = plane.post_push(endpoint, tid, 3, b"tok", [(0, src, dst)], 60, caps)
        st = plane.wait_push(h, 60)
        q_out.put((st.state.value, st.error))
    q_go.get(timeout=60)
    plane.close()


def _stop(procs):
    from harness import stop_processes

    stop_processes(procs)


@pytest.mark.parametrize(
    "layout, env, want_iov",
    [
        ("one", {}, True),  # the default
        ("two", {}, True),
        ("one", {"DISAGG_UCX_TCP_IOV_RECV": "0"}, False),
    ],
    ids=["one-region", "two-strided-regions", "switched-off"],
)
def test_packed_segments_land_byte_exact(layout, env, want_iov):
    """Random store rows into random slots (a few skipped, and a run of 20 adjacent
    slots: one entry per page either way): 2 MiB packed segments of 32 pages land byte
    for byte, as iov receives straight into the slots (counted in ``iov_recvs``), or,
    switched off, into scratch and the row copy; a second push lands over the first."""
    rng = np.random.default_rng(21)
    ctx = spawn_context()
    q_r, q_s, q_in, q_go = (ctx.Queue() for _ in range(4))
    rows = np.concatenate([rng.permutation(2 * SLOTS)[:100], np.arange(200, 220)])
    dst = np.concatenate([rng.permutation(np.arange(40, SLOTS))[:100], np.arange(0, 20)])
    dst[[5, 60]] = -1
    rows2, dst2 = rng.permutation(2 * SLOTS)[:64], rng.permutation(SLOTS)[:64]
    n1, n2 = int((dst >= 0).sum()), 64
    r = ctx.Process(target=_receiver, args=(layout, env, [(1, n1), (2, n2)], q_r, q_in))
    r.start()
    ep, caps, iov_on = q_r.get(timeout=30)
    pushes = [(1, rows.tolist(), dst.tolist(), 1), (2, rows2.tolist(), dst2.tolist(), 2)]
    s = ctx.Process(target=_sender, args=(ep, caps, pushes, q_s, q_go))
    s.start()
    try:
        got = []
        for _ in pushes:
            assert q_r.get(timeout=30) == "expecting"
            q_go.put(None)
            got.append((q_r.get(timeout=60), q_s.get(timeout=60)))
    finally:
        q_in.put(None)
        q_go.put(None)
        _stop([s, r])
    assert iov_on is want_iov
    want = np.zeros((SLOTS, PB), dtype=np.uint8)
    for k, (rw, ds, salt) in enumerate([(rows, dst, 1), (rows2, dst2, 2)]):
        keep = ds >= 0
        want[ds[keep]] = _slab(2 * SLOTS, PB, salt).numpy()[rw[keep]]
        (state, err, mem, iovs), (tstate, terr) = got[k]
        assert (state, err) == ("done", None), err
        assert (tstate, terr) == ("done", None), terr
        np.testing.assert_array_equal(_view(mem, layout), want)
    # push 1: 98 scattered pages and the run of 20, all packed (the receiver offers
    # iov_recv) into 4 segments; push 2: 64 pages, 2 packed segments
    assert got[-1][0][3] == (6 if want_iov else 0)


@pytest.mark.parametrize("sender_packs", [True, False], ids=["packed", "not-offered"])
def test_runs_up_to_a_segment_are_packed_for_an_iov_receiver(sender_packs):
    """A receiver taking packed segments as iov receives offers ``iov_recv``; a sender
    given that packs runs up to a segment (2 MiB) instead of sending each run of 1 MiB+
    alone (``TCP_PACK_DIRECT_MIN``, headers under ``HDR_TCP_PACK_TAG``): four runs of
    20 adjacent 64 KiB slots travel as 4 packed segments, all iov receives. Given the
    same capabilities without ``iov_recv``, the sender sends the runs alone, which the
    same receiver lands in place. Byte for byte either way."""
    ctx = spawn_context()
    q_r, q_s, q_in, q_go = (ctx.Queue() for _ in range(4))
    dst = np.concatenate([np.arange(k, k + 20) for k in (0, 40, 80, 120)])
    rows = np.random.default_rng(5).permutation(2 * SLOTS)[: dst.size]
    r = ctx.Process(target=_receiver, args=("one", {}, [(1, dst.size)], q_r, q_in))
    r.start()
    ep, caps, iov_on = q_r.get(timeout=30)
    assert iov_on and caps.iov_recv
    if not sender_packs:
        caps = msgspec.structs.replace(caps, iov_recv=False)
    s = ctx.Process(
        target=_sender, args=(ep, caps, [(1, rows.tolist(), dst.tolist(), 1)], q_s, q_go)
    )
    s.start()
    try:
        assert q_r.get(timeout=30) == "expecting"
        q_go.put(None)
        (state, err, mem, iovs), sent = q_r.get(timeout=60), q_s.get(timeout=60)
    finally:
        q_in.put(None)
        q_go.put(None)
        _stop([s, r])
    assert (state, err) == ("done", None), err
    assert sent == ("done", None)
    want = np.zeros((SLOTS, PB), dtype=np.uint8)
    want[dst] = _slab(2 * SLOTS, PB, 1).numpy()[rows]
    np.testing.assert_array_equal(_view(mem, "one"), want)
    assert iovs == (4 if sender_packs else 0)


def test_no_iov_recv_offered_without_iov_receives(monkeypatch):
    """``iov_recv`` is offered only by a tcp plane that takes iov receives and has only
    host regions: with them off, senders keep runs alone."""
    monkeypatch.setenv("DISAGG_UCX_TCP_IOV_RECV", "0")
    with UcxDataPlane(channel="tcp") as plane:
        plane.register_regions([[torch.zeros(4, PB, dtype=torch.uint8)]])
        caps = plane.capabilities
        assert caps.tcp_rx_segment_bytes == 2 << 20 and not caps.iov_recv
    monkeypatch.delenv("DISAGG_UCX_TCP_IOV_RECV")
    with UcxDataPlane(channel="tcp") as plane:
        assert plane.tcp_iov_recvs
        plane.register_regions([[torch.zeros(4, PB, dtype=torch.uint8)]])
        assert plane.capabilities.iov_recv


# ------------------------------ abort mid-transfer ---------------------------------------
BIG = 2048  # 128 MiB of 64 KiB pages: 64 segments


def _abort_receiver(env, q_out, q_in):
    os.environ.update(env)
    plane = UcxDataPlane(channel="tcp")
    plane.abort_wait_s = 0.3  # waited out in full: the stalled producer's receives never end
    pool = torch.zeros(BIG, PB, dtype=torch.uint8)
    plane.register_regions([[pool]])
    q_out.put((plane.endpoint, plane.capabilities))
    plane.expect(9, 3, b"tok", [4], 60)  # warm-up: the producer's endpoint is wired up
    q_out.put("expecting")
    assert plane.wait(9, 60).done
    plane.expect(1, 3, b"tok", [BIG], 60)
    q_out.put("expecting")
    assert q_in.get(timeout=60) == "stalled"  # the producer's UCX stopped mid-push
    rx = plane._book.rx[1]
    before = rx.inflight  # receives posted into the slots, waiting for its data
    left = plane.abort(1, "test abort")
    stats = dict(plane.stats)
    q_out.put(("aborted", before, left, rx.inflight, plane.poll(1).state.value, stats))
    assert q_in.get(timeout=60) == "resumed"
    settled = pool.numpy().copy()
    time.sleep(1.0)  # whatever the resumed producer still sends has had time to land
    quiet = bool(np.array_equal(settled, pool.numpy()))
    q_out.put(("settled", rx.inflight, quiet, plane.poll(1).state.value))
    # the plane serves on: the producer reconnects, its next push lands whole
    plane.expect(2, 3, b"tok", [BIG], 60)
    q_out.put("expecting")
    st = plane.wait(2, 60)
    q_out.put((st.state.value, st.error, pool.numpy().copy()))
    q_in.get(timeout=60)
    plane.close()


def _stalling_sender(endpoint, caps, pushes, q_out, q_go, stall_after, stalled, resume):
    """``_sender`` whose UCX progress thread stops once ``stall_after`` data messages
    of the push in flight completed (sets ``stalled``, then waits for ``resume``): the
    producer's UCX goes quiet mid-push, with the rest of the push posted (a push posts
    every segment at once) and its data partly on the wire, as under SIGSTOP, but at a
    point of the push's own (a SIGSTOP from outside raced the whole push on a fast
    machine)."""
    from disagg.transport.ucx.send import Sender

    send, reqs = iov.tag_send, []

    def tag_send(*args, **kwargs):
        reqs.append(send(*args, **kwargs))
        return reqs[-1]

    reap = Sender.reap

    def tx_reap(self):
        more = reap(self)
        if not stalled.is_set() and sum(r.completed for r in reqs[1:]) >= stall_after:
            stalled.set()  # (reqs[0] is the warm-up's)
            resume.wait(120)
        return more

    iov.tag_send = tag_send  # the sender calls iov.tag_send by attribute
    Sender.reap = tx_reap
    # a small socket buffer: one progress call cannot write the whole push (with the
    # kernel's auto-tuned one a fast box took it all before the stall)
    os.environ["UCX_TCP_SNDBUF"] = "256k"
    _sender(endpoint, caps, pushes, q_out, q_go)


def _stall_scenario(env, dst_order):
    """One run of test_abort_severs_a_stalled_producer; returns what both sides saw."""
    ctx = spawn_context()
    q_r, q_s, q_in, q_go = (ctx.Queue() for _ in range(4))
    stalled, resume = ctx.Event(), ctx.Event()
    r = ctx.Process(target=_abort_receiver, args=(env, q_r, q_in))
    r.start()
    ep, caps = q_r.get(timeout=30)
    rows1 = np.random.default_rng(3).permutation(2 * SLOTS * 16)[:BIG] % (2 * SLOTS)
    dst = np.random.default_rng(4).permutation(BIG) if dst_order == "random" else np.arange(BIG)
    pushes = [
        (9, [1, 3, 5, 7], [0, 2, 4, 6], 1),  # warm-up: one iov message
        (1, rows1.tolist(), dst.tolist(), 1),
        (2, rows1.tolist(), dst.tolist(), 2),
    ]
    s = ctx.Process(target=_stalling_sender, args=(ep, caps, pushes, q_s, q_go, 8, stalled, resume))
    s.start()
    try:
        assert q_r.get(timeout=30) == "expecting"
        q_go.put(None)
        assert q_s.get(timeout=60) == ("done", None)  # the warm-up
        assert q_r.get(timeout=30) == "expecting"
        q_go.put(None)
        assert stalled.wait(60)
        time.sleep(0.2)  # its last rendezvous requests reach the receiver, get matched
        q_in.put("stalled")
        _, before, left, inflight, state, stats = q_r.get(timeout=60)
        resume.set()
        q_in.put("resumed")
        _, inflight_after, quiet, state_after = q_r.get(timeout=60)
        push1 = q_s.get(timeout=60)  # the producer's side of push 1
        assert q_r.get(timeout=30) == "expecting"
        q_go.put(None)
        state2, err2, pool = q_r.get(timeout=60)
        push2 = q_s.get(timeout=60)
    finally:
        resume.set()
        q_in.put(None)
        q_go.put(None)
        _stop([s, r])
    return dict(
        before=before, left=left, inflight=inflight, state=state, stats=stats,
        inflight_after=inflight_after, quiet=quiet, state_after=state_after, push1=push1,
        state2=state2, err2=err2, pool=pool, push2=push2, rows1=rows1, dst=dst,
    )  # fmt: skip


@pytest.mark.parametrize(
    "env, dst_order",
    [({}, "random"), ({"DISAGG_UCX_TCP_IOV_RECV": "0"}, "runs")],
    ids=["iov-receives", "runs-in-place"],
)
def test_abort_severs_a_stalled_producer(env, dst_order):
    """A producer whose UCX stops (a stalled process) once 8 of the 64 segments of a
    128 MiB push were sent leaves receives posted straight into the slots: iov
    receives (random slots), or, with those off, 2 MiB runs of adjacent slots received
    in place. UCX cannot revoke a matched receive, so they outlive the abort's wait;
    ``abort`` then severs the producer's connection, and they end: it returns 0 (the
    slots are free), the transfer is FAILED, nothing changes in the pool when the
    producer resumes, and the producer's next push (a new connection) lands byte for
    byte."""
    for _attempt in range(4):
        got = _stall_scenario(env, dst_order)
        if got["before"]:
            break
        # the stall came after the receiver had every byte it asked for (UCX wrote
        # the whole push in one progress call): nothing to sever; that run must
        # still end clean, and another run gets a stall with receives in flight
        assert got["left"] == 0 and got["quiet"], got["stats"]
    before, left, inflight, stats = got["before"], got["left"], got["inflight"], got["stats"]
    state, state_after, quiet = got["state"], got["state_after"], got["quiet"]
    inflight_after, push1, push2 = got["inflight_after"], got["push1"], got["push2"]
    state2, err2, pool, rows1, dst = (got[k] for k in ("state2", "err2", "pool", "rows1", "dst"))
    # the path under test was taken: receives into the slots outlived the wait
    assert before > 0
    assert stats.get("iov_recvs", 0) > 0 if dst_order == "random" else True
    assert stats.get("severed", 0) >= 1, stats
    assert (left, inflight) == (0, 0)
    assert state == "failed" and state_after == "failed"
    assert inflight_after == 0 and quiet
    assert push1[0] == "failed"  # its connection was closed under it
    assert (state2, err2) == ("done", None), err2
    assert push2 == ("done", None)
    want = np.empty((BIG, PB), dtype=np.uint8)
    want[dst] = _slab(2 * SLOTS, PB, 2).numpy()[rows1]
    np.testing.assert_array_equal(pool, want)


def test_longer_message_than_the_iov_is_truncated_not_written_past():
    """``tag_recv_exact`` into an iov shorter than the message (the plane never posts
    one: it checks the length first): UCX ends the receive with an error and writes
    nothing beyond the iov's entries, over the hardened tcp settings (3 MiB: the
    active-message rendezvous) and for an eager-sized message."""
    import ucxx._lib.libucxx as u
    from ucxx._lib.arr import Array

    cfg = {"NET_DEVICES": "lo", **settings.TCP_HARDENING}
    ctx = u.UCXContext(config_dict=cfg, feature_flags=(u.Feature.TAG,))
    wa, wb = u.UCXWorker(ctx), u.UCXWorker(ctx)
    accepted: list = []
    holder: list = []

    def on_connect(cr):
        accepted.append(holder[0].create_endpoint_from_conn_request(cr, True))

    lst = u.UCXListener.create(worker=wa, port=0, cb_func=on_connect)
    holder.append(lst)
    ep = u.UCXEndpoint.create(wb, "127.0.0.1", lst.port, True)
    for _ in range(2000):
        if accepted:
            break
        wa.progress()
        wb.progress()
        time.sleep(0.001)
    assert accepted
    sends: list = []
    for size, tag in ((3 << 20, 11), (4 << 10, 12)):
        src = np.full(size, 7, dtype=np.uint8)
        sends.append((ep.tag_send(Array(src), u.UCXXTag(tag)), src))  # kept alive
        seen = None
        for _ in range(5000):
            wa.progress()
            wb.progress()
            seen = iov.probe_length(wa.handle, tag, (1 << 64) - 1)
            if seen is not None:
                break
        assert seen == (tag, size)
        dst = np.zeros(size, dtype=np.uint8)
        half = size // 4
        base = dst.ctypes.data
        # two entries, a gap between them, a quarter of the message each
        entries = np.array([[base, half], [base + 2 * half, half]], dtype=np.uint64)
        try:
            req = iov.tag_recv_exact(wa.handle, tag, iov.IovBuf(entries, 2 * half, dst))
        except RuntimeError as exc:  # refused at once (the rendezvous: its length is known)
            assert "ucs_status -9" in str(exc)  # UCS_ERR_MESSAGE_TRUNCATED
            req = None
        for _ in range(2000):
            wa.progress()
            wb.progress()
            if req is None or req.completed:
                break
        if req is not None:
            assert req.completed
            with pytest.raises(RuntimeError, match="receive failed: ucs_status -9"):
                req.check_error()
        assert not dst[half : 2 * half].any() and not dst[3 * half :].any()
    del ep, accepted[:], holder[:], lst
