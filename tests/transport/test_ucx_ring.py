"""The UCX sender's ring of gather buffers (ucx/send.py ``Sender.pump``/``_ring_take``):
scattered rows gathered on the progress thread into a few reusable send buffers, each
reused only once its send completed. Segments are made small (``SEG_BYTES`` and
``TCP_SEG_BYTES`` patched in both processes, which cut batches the same way) so a push has many more segments than
the ring has buffers. Skipped without ucxx."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from harness import spawn_context

pytest.importorskip(
    "disagg.transport.ucx.plane", reason="ucxx is not installed (pip install disagg[ucx])"
)
from disagg.transport.dataplane import StoreRows  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SEG = 64 << 10  # segment size in both processes: 16 pages of 4 KiB
BUFS = 2  # send ring size in the sender
SLOTS = 512


def _small_segments(bufs: int | None = None) -> None:
    from disagg.transport.ucx import send, wire

    wire.SEG_BYTES = SEG
    wire.TCP_SEG_BYTES = SEG
    if bufs is not None:
        send.SEND_BUFS = bufs


def _slab(rows: int, width: int, salt: int = 0) -> torch.Tensor:
    from harness import pattern_rows

    return torch.from_numpy(pattern_rows(rows, width, salt))


def _expect(slab: np.ndarray, rows, cols, dst, pb: int) -> np.ndarray:
    want = np.zeros((SLOTS, pb), dtype=np.uint8)
    for r, d in zip(rows, dst):
        if d >= 0:
            want[d] = np.concatenate([slab[r, o : o + c] for o, c in cols])
    return want


def _receiver(pb, transfers, stop_after_first_segment, q_out, q_in):
    """``transfers``: [(transfer_id, expected pages)]. ``stop_after_first_segment``: the
    process stops itself (SIGSTOP) right after its first segment lands, so the sender
    has sends in flight when the test kills it. Scratch receives (at most 4 posted at
    once), not iov receives: an iov receiver takes every arrived segment at once, so a
    push this small would be all sent (DONE at the sender) before the receiver stops,
    leaving no sends in flight for these tests of the sender."""
    os.environ["DISAGG_UCX_TCP_IOV_RECV"] = "0"
    _small_segments()
    from harness import stop_after_first_landing

    from disagg.transport.ucx.plane import UcxDataPlane

    if stop_after_first_segment:
        stop_after_first_landing(q_out)
    plane = UcxDataPlane(channel="tcp")
    pool = torch.zeros(SLOTS, pb, dtype=torch.uint8)
    plane.register_regions([[pool]])
    for tid, n in transfers:
        plane.expect(tid, 3, b"tok", [n], 60)
    q_out.put((plane.endpoint, plane.capabilities))
    for tid, _ in transfers:
        st = plane.wait(tid, 60)
        q_out.put((tid, st.state.value, st.error, pool.numpy().copy()))
    q_in.get(timeout=60)
    plane.close()


def _sender(pushes, width, q_out, q_go, iov=False):
    """``pushes``: [((endpoint, caps), transfer_id, rows, cols, dst, salt, wait_before)]: posted
    in order; a push with ``wait_before`` is posted only after every earlier push ended.
    Reports (state, error, gathered segments) per push and the ring's allocations.
    ``iov``: scattered segments go as iov messages from the rows (a tcp plane's default,
    "Scatter-gather sends over tcp"); else through the ring (what most cases here test)."""
    os.environ["DISAGG_UCX_TCP_IOV"] = "1" if iov else "0"
    _small_segments(BUFS)
    from disagg.transport.ucx.hostcopy import GatherSeg
    from disagg.transport.ucx.plane import UcxDataPlane

    plane = UcxDataPlane(channel="tcp")
    handles, out = [], []
    for (ep, caps), tid, rows, cols, dst, salt, wait_before in pushes:
        if wait_before:
            for h in handles:
                out.append(plane.wait_push(h, 60))
            handles = []
        slab = _slab(2 * SLOTS, width, salt)
        src = StoreRows(slab, np.asarray(rows, dtype=np.int64), cols)
        h = plane.post_push(ep, tid, 3, b"tok", [(0, src, dst)], deadline_s=60, caps=caps)
        gathered = sum(isinstance(b, GatherSeg) for b, _ in h.plan)
        q_out.put(("posted", tid, gathered))
        handles.append(h)
    for h in handles:
        out.append(plane.wait_push(h, 60))
    q_out.put(
        (
            [(s.state.value, s.error) for s in out],
            plane.stats["ucx_send_bufs"],
        )
    )
    q_go.get(timeout=60)
    plane.close()


def _spawn(ctx, target, *args):
    p = ctx.Process(target=target, args=args)
    p.start()
    return p


def _stop(procs):
    from harness import stop_processes

    stop_processes(procs)


@pytest.mark.parametrize(
    "cols",
    [((0, 4096),), ((3000, 1000), (200, 2000), (4000, 1096))],
    ids=["whole-rows", "three-spans"],
)
def test_scattered_rows_reuse_the_ring_byte_exact(cols):
    """Random store rows into random slots over tcp, many more gathered segments than
    ring buffers (so each buffer is reused several times): every byte lands where it
    belongs, and the ring never grew past its bound."""
    rng = np.random.default_rng(11)
    width = 5096 if len(cols) > 1 else 4096
    pb = sum(c for _, c in cols)
    rows = rng.permutation(2 * SLOTS)[:400]
    dst = rng.permutation(SLOTS)[:400]
    dst[[5, 77, 300]] = -1
    ctx = spawn_context()
    q_r, q_s, q_in, q_go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    r = _spawn(ctx, _receiver, pb, [(7, int((dst >= 0).sum()))], False, q_r, q_in)
    ep = q_r.get(timeout=30)
    push = (ep, 7, rows.tolist(), cols, dst.tolist(), 0, False)
    s = _spawn(ctx, _sender, [push], width, q_s, q_go)
    try:
        _, _, gathered = q_s.get(timeout=60)
        tid, state, err, pool = q_r.get(timeout=60)
        results, allocated = q_s.get(timeout=60)
    finally:
        q_in.put(None)
        q_go.put(None)
        _stop([s, r])
    assert gathered > 4 * BUFS  # each ring buffer carried several segments
    assert (state, err) == ("done", None), err
    assert results == [("done", None)]
    assert 1 <= allocated <= BUFS
    slab = _slab(2 * SLOTS, width).numpy()
    np.testing.assert_array_equal(pool, _expect(slab, rows, cols, dst, pb))


@pytest.mark.parametrize("iov", [False, True], ids=["ring", "iov"])
def test_push_failing_midway_does_not_corrupt_later_pushes(iov):
    """Push A goes to a receiver that stops dead after its first segment lands and is
    then killed, while push B (other rows, other bytes) shares the sender's ring with
    it; push C goes after A failed. A fails; B and C land byte-exactly (a buffer UCX
    might still read for A is never handed to B or C). With iov sends nothing is
    gathered: A's requests fail with the peer and B, C still land."""
    rng = np.random.default_rng(12)
    width, cols = 4096, ((0, 4096),)
    ctx = spawn_context()
    q_a, q_b, q_s, q_in, q_go = (ctx.Queue() for _ in range(5))
    a_rows, a_dst = rng.permutation(2 * SLOTS)[:480], rng.permutation(SLOTS)[:480]
    b_rows, b_dst = rng.permutation(2 * SLOTS)[:256], rng.permutation(SLOTS)[:256]
    c_rows = rng.permutation(2 * SLOTS)[:256]
    c_dst = np.setdiff1d(np.arange(SLOTS), b_dst)[rng.permutation(SLOTS - 256)]
    a = _spawn(ctx, _receiver, width, [(1, 480)], True, q_a, q_in)
    b = _spawn(ctx, _receiver, width, [(2, 256), (3, 256)], False, q_b, q_in)
    ep_a, ep_b = q_a.get(timeout=30), q_b.get(timeout=30)
    pushes = [
        (ep_a, 1, a_rows.tolist(), cols, a_dst.tolist(), 1, False),
        (ep_b, 2, b_rows.tolist(), cols, b_dst.tolist(), 2, False),
        (ep_b, 3, c_rows.tolist(), cols, c_dst.tolist(), 3, True),
    ]
    s = _spawn(ctx, _sender, pushes, width, q_s, q_go, iov)
    try:
        assert q_a.get(timeout=60) == "stopping"
        a.kill()  # the peer is gone with A's sends in flight
        a.join(15)
        posted = [q_s.get(timeout=60) for _ in range(3)]
        _, state2, err2, _ = q_b.get(timeout=90)
        _, state3, err3, pool = q_b.get(timeout=90)
        results, allocated = q_s.get(timeout=90)
    finally:
        q_in.put(None)
        q_in.put(None)
        q_go.put(None)
        _stop([s, b, a])
    assert all((g == 0) if iov else (g > BUFS) for _, _, g in posted), posted
    assert results[0][0] == "failed", results
    assert results[1:] == [("done", None), ("done", None)], results
    assert (state2, err2) == ("done", None), err2
    assert (state3, err3) == ("done", None), err3
    # A's buffers in flight left the ring; replacements are bounded by what A held
    assert (allocated == 0) if iov else (1 <= allocated <= 2 * BUFS)
    want = np.zeros((SLOTS, width), dtype=np.uint8)
    want[b_dst] = _slab(2 * SLOTS, width, 2).numpy()[b_rows]
    want[c_dst] = _slab(2 * SLOTS, width, 3).numpy()[c_rows]
    np.testing.assert_array_equal(pool, want)


@pytest.mark.parametrize("iov", [False, True], ids=["ring", "iov"])
def test_stalled_peer_does_not_hold_back_other_peers(iov):
    """Push A goes to a receiver that stops reading (SIGSTOP, alive: its sends never
    complete until A's deadline) after A's sends took the whole ring; push B to another
    receiver, posted right after, still lands at once and byte-exactly (it gets a
    one-off buffer; with iov sends it needs none) instead of waiting for A's deadline."""
    rng = np.random.default_rng(13)
    width, cols = 4096, ((0, 4096),)
    ctx = spawn_context()
    q_a, q_b, q_s, q_in, q_go = (ctx.Queue() for _ in range(5))
    a_rows, a_dst = rng.permutation(2 * SLOTS)[:480], rng.permutation(SLOTS)[:480]
    b_rows, b_dst = rng.permutation(2 * SLOTS)[:256], rng.permutation(SLOTS)[:256]
    a = _spawn(ctx, _receiver, width, [(1, 480)], True, q_a, q_in)
    b = _spawn(ctx, _receiver, width, [(2, 256)], False, q_b, q_in)
    ep_a, ep_b = q_a.get(timeout=30), q_b.get(timeout=30)
    pushes = [
        (ep_a, 1, a_rows.tolist(), cols, a_dst.tolist(), 1, False),
        (ep_b, 2, b_rows.tolist(), cols, b_dst.tolist(), 2, False),
    ]
    s = _spawn(ctx, _sender, pushes, width, q_s, q_go, iov)
    try:
        assert q_a.get(timeout=60) == "stopping"
        # A's deadline is 60 s: B must not wait for it
        _, state_b, err_b, pool = q_b.get(timeout=20)
        a.kill()
        a.join(15)
        [q_s.get(timeout=60) for _ in range(2)]
        results, _ = q_s.get(timeout=90)
    finally:
        q_in.put(None)
        q_in.put(None)
        q_go.put(None)
        _stop([s, b, a])
    assert (state_b, err_b) == ("done", None), err_b
    assert results[0][0] == "failed" and results[1] == ("done", None), results
    want = np.zeros((SLOTS, width), dtype=np.uint8)
    want[b_dst] = _slab(2 * SLOTS, width, 2).numpy()[b_rows]
    np.testing.assert_array_equal(pool, want)
