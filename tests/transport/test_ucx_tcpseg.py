"""Packed segments over tcp: a tcp receiver offers ``TCP_SEG_BYTES`` segments in its
capabilities (``tcp_segment_bytes``); a sender given that cuts host batches into them
and sends their headers under ``HDR_TCP_SEG_TAG`` (so the receiver cuts them the same
way), and one given no capabilities keeps ``SEG_BYTES``. The gather into the send ring
and the scatter out of scratch use the C row copy where it is built. Pushes between two
processes are checked byte for byte. Skipped without ucxx."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from harness import pattern_rows, spawn_context

pytest.importorskip(
    "disagg.transport.ucx.plane", reason="ucxx is not installed (pip install disagg[ucx])"
)
from disagg.transport import page_copy  # noqa: E402
from disagg.transport.dataplane import StoreRows  # noqa: E402
from disagg.transport.receiver import build_groups  # noqa: E402
from disagg.transport.ucx import hostcopy, wire  # noqa: E402
from disagg.transport.ucx.plane import UcxDataPlane  # noqa: E402

pytestmark = pytest.mark.timeout(120)

PB = 64 << 10
SLOTS = 256
N = 200  # 12.5 MiB: one SEG_BYTES segment, seven TCP_SEG_BYTES ones


def _slab(rows: int) -> torch.Tensor:
    return torch.from_numpy(pattern_rows(rows, PB))


def _receiver(q_out, q_in):
    plane = UcxDataPlane(channel="tcp")
    pool = torch.zeros(SLOTS, PB, dtype=torch.uint8)
    plane.register_regions([[pool]])
    q_out.put((plane.endpoint, plane.capabilities))
    for _ in range(2):
        tid = q_in.get(timeout=60)
        plane.expect(tid, 3, b"tok", [N], 60)
        q_out.put("expecting")
        st = plane.wait(tid, 60)
        q_out.put((st.state.value, st.error, pool.numpy().copy()))
        pool.zero_()
    q_in.get(timeout=60)
    plane.close()


def _sender(pushes, q_out, q_go):
    plane = UcxDataPlane(channel="tcp")
    slab = _slab(2 * SLOTS)
    for ep, caps, tid, rows, dst in pushes:
        q_go.get(timeout=60)
        src = StoreRows(slab, np.asarray(rows, dtype=np.int64), ((0, PB),))
        h = plane.post_push(ep, tid, 3, b"tok", [(0, src, dst)], deadline_s=60, caps=caps)
        hdrs = [tag for b, tag in h.plan if not tag & wire.DATA_BIT]
        sizes = [b.nbytes for b, tag in h.plan if tag & wire.DATA_BIT]
        st = plane.wait_push(h, 60)
        q_out.put((st.state.value, st.error, hdrs, sizes))
    q_go.get(timeout=60)
    plane.close()


def test_offered_small_segments_are_used_and_no_offer_keeps_big_ones():
    """Random store rows into random slots, pushed once with the receiver's capabilities
    without ``iov_recv`` (headers under ``HDR_TCP_SEG_TAG``, segments of at most
    ``TCP_SEG_BYTES``; test_ucx_iovrecv.py covers the packed cut) and once with none (the
    base cut: ``HDR_TAG``, one ``SEG_BYTES`` segment): both land byte for byte."""
    rng = np.random.default_rng(5)
    ctx = spawn_context()
    q_r, q_rin, q_s, q_go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=_receiver, args=(q_r, q_rin))
    r.start()
    ep, caps = q_r.get(timeout=30)
    assert caps.tcp_segment_bytes == wire.TCP_SEG_BYTES
    assert caps.iov_recv  # it takes iov receives: runs up to 2 MiB packed
    pushes = []
    seg_caps = msgspec.structs.replace(caps, iov_recv=False)
    for tid, c in ((1, seg_caps), (2, None)):
        rows = rng.permutation(2 * SLOTS)[:N]
        dst = rng.permutation(SLOTS)[:N]
        pushes.append((ep, c, tid, rows.tolist(), dst.tolist()))
    s = ctx.Process(target=_sender, args=(pushes, q_s, q_go))
    s.start()
    try:
        out = []
        for _, _, tid, rows, dst in pushes:
            q_rin.put(tid)
            assert q_r.get(timeout=60) == "expecting"
            q_go.put(None)
            sent = q_s.get(timeout=60)
            got = q_r.get(timeout=60)
            out.append((rows, dst, sent, got))
    finally:
        q_rin.put(None)
        q_go.put(None)
        for p in (s, r):
            p.join(15)
            if p.is_alive():
                p.kill()
    slab = _slab(2 * SLOTS).numpy()
    small, big = out
    for rows, dst, (s_state, s_err, _, _), (state, err, pool) in out:
        assert (s_state, s_err) == ("done", None)
        assert (state, err) == ("done", None), err
        want = np.zeros((SLOTS, PB), dtype=np.uint8)
        want[dst] = slab[rows]
        np.testing.assert_array_equal(pool, want)
    _, _, (_, _, hdrs, sizes), _ = small
    assert hdrs[0] == wire.HDR_TCP_SEG_TAG and hdrs[-1] == wire.HDR_TAG
    assert max(sizes) <= wire.TCP_SEG_BYTES and sum(sizes) == N * PB and len(sizes) > 1
    _, _, (_, _, hdrs, sizes), _ = big
    assert set(hdrs) == {wire.HDR_TAG}
    assert sizes == [N * PB]


def test_segments_follow_the_cut_size():
    """``segments`` packs up to ``seg_bytes`` per message: the cut both sides make
    from a header under ``HDR_TCP_SEG_TAG``."""
    pb = 64 << 10
    runs = [(i * 3, 1) for i in range(100)] + [(1000, 40)]  # 100 scattered, one 2.5 MiB run
    small = wire.segments(runs, pb, wire.DIRECT_MIN, wire.TCP_SEG_BYTES)
    big = wire.segments(runs, pb, wire.DIRECT_MIN)
    for segs in (small, big):
        assert sum(s.pages for s in segs) == 140
    assert all(s.pages * pb <= wire.TCP_SEG_BYTES for s in small)
    assert [s.pages for s in small] == [32, 32, 32, 4, 32, 8]
    assert [s.pages for s in big] == [100, 40]


@pytest.mark.parametrize("native", [True, False], ids=["rowcopy", "numpy"])
def test_gather_and_scatter_byte_exact(native, monkeypatch):
    """A gathered segment (``GatherSeg.gather_into``) and its scatter into the slots
    (``scatter_host``), with the C row copy and without it (numpy fallback): the same
    bytes; a slot outside the region is refused before a byte moves (C row copy)."""
    if native and page_copy._rowcopy is None:
        pytest.skip("_rowcopy is not built")
    if not native:
        monkeypatch.setattr(page_copy, "_rowcopy", None)
    rng = np.random.default_rng(2)
    slab = _slab(64).numpy()
    rows = rng.permutation(64)[:10].astype(np.int64)
    seg = hostcopy.GatherSeg(slab, rows, ((0, PB),), 10 * PB)
    out = np.zeros(10 * PB, dtype=np.uint8)
    seg.gather_into(out)
    np.testing.assert_array_equal(out.reshape(10, PB), slab[rows])
    pool = torch.zeros(32, PB, dtype=torch.uint8)
    (grp,) = build_groups([[pool]])
    runs = ((3, 2), (20, 1), (7, 4), (30, 2), (0, 1))
    s = wire.Segment(runs, 0, 10, False)
    hostcopy.scatter_host(grp, s, out)
    want = np.zeros((32, PB), dtype=np.uint8)
    want[[3, 4, 20, 7, 8, 9, 10, 30, 31, 0]] = slab[rows]
    np.testing.assert_array_equal(pool.numpy(), want)
    if native:
        bad = wire.Segment(((31, 2),), 0, 2, False)
        pool.zero_()
        with pytest.raises(IndexError, match="destination row 32"):
            hostcopy.scatter_host(grp, bad, out[: 2 * PB])
        assert not pool.numpy().any()
