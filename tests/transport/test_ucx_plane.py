"""UcxDataPlane between two processes: byte-exact pushes over tcp and shared memory,
scattered and contiguous runs, refused slots, deadlines. Skipped without ucxx."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
ucx_plane = pytest.importorskip(
    "disagg.transport.ucx_plane", reason="ucxx is not installed (pip install disagg[ucx])"
)

pytestmark = pytest.mark.timeout(60)

SLOTS = 64


def _page(i: int, pb: int) -> np.ndarray:
    return ((np.arange(pb, dtype=np.int64) * 7 + i * 131) % 251).astype(np.uint8)


def _receiver(channel, pb, expected, two_regions, deadline_s, q_out, q_in):
    from disagg.transport.ucx_plane import UcxDataPlane

    plane = UcxDataPlane(channel=channel)
    if two_regions:  # a group of two regions: pages land via scratch + index_copy_
        half = pb // 2
        regs = [
            torch.zeros(SLOTS, half, dtype=torch.uint8),
            torch.zeros(SLOTS, pb - half, dtype=torch.uint8),
        ]
    else:
        regs = [torch.zeros(SLOTS, pb, dtype=torch.uint8)]
    plane.register_regions([regs])
    plane.expect(7, 3, b"tok", [expected], deadline_s)
    q_out.put(plane.endpoint)
    st = plane.wait(7, deadline_s + 10)
    pool = torch.cat(regs, dim=1).numpy()
    q_out.put((st.state.value, st.error, pool.copy(), dict(plane.stats)))
    q_in.get(timeout=30)
    plane.close()


def _sender(endpoint, pb, src_idx, dst, q_out):
    from disagg.transport.ucx_plane import UcxDataPlane

    plane = UcxDataPlane(channel="shm" if endpoint.startswith("ucx+shm") else "tcp")
    store = torch.from_numpy(np.stack([_page(i, pb) for i in range(SLOTS)]))
    rows = store[torch.as_tensor(src_idx, dtype=torch.long)]
    try:
        h = plane.post_push(endpoint, 7, 3, b"tok", [(0, rows, dst)], deadline_s=10)
        st = plane.wait_push(h, 15)
        q_out.put((st.state.value, st.error))
    except ValueError as e:
        q_out.put(("valueerror", str(e)))
    plane.close()


def _run(
    channel, pb, src_idx, dst, *, expected=None, two_regions=False, deadline_s=10.0, send=True
):
    ctx = mp.get_context("spawn")
    q_r, q_s, q_in = ctx.Queue(), ctx.Queue(), ctx.Queue()
    if expected is None:
        expected = sum(1 for d in dst if d >= 0)
    r = ctx.Process(
        target=_receiver, args=(channel, pb, expected, two_regions, deadline_s, q_r, q_in)
    )
    r.start()
    ep = q_r.get(timeout=30)
    s = None
    if send:
        s = ctx.Process(target=_sender, args=(ep, pb, src_idx, dst, q_s))
        s.start()
    res = q_r.get(timeout=deadline_s + 30)
    q_in.put(None)
    sres = q_s.get(timeout=30) if send else None
    r.join(30)
    if s is not None:
        s.join(30)
    return res, sres, ep


def _check_pool(pool, pb, src_idx, dst):
    for s, d in zip(src_idx, dst, strict=True):
        if d >= 0:
            assert np.array_equal(pool[d], _page(s, pb)), f"slot {d}"
    untouched = set(range(SLOTS)) - {d for d in dst if d >= 0}
    for d in untouched:
        assert not pool[d].any()


@pytest.mark.parametrize("channel", ["tcp", "shm"])
def test_push_scattered_and_contiguous(channel):
    pb = 300 << 10  # >= DIRECT_MIN: contiguous runs land zero-copy
    rng = np.random.default_rng(1)
    src_idx = list(range(0, 40))
    # a contiguous run of 8, then scattered single pages, one -1 skip
    dst = list(range(10, 18)) + [int(x) for x in rng.permutation(np.arange(20, SLOTS))[:32]]
    dst[20] = -1
    (state, err, pool, stats), (sstate, serr), ep = _run(channel, pb, src_idx, dst)
    assert ep.startswith(f"ucx+{channel}://")
    assert state == "done", err
    assert sstate == "done", serr
    _check_pool(pool, pb, src_idx, dst)


@pytest.mark.parametrize("channel", ["tcp", "shm"])
def test_push_small_pages_multi_region(channel):
    pb = 16 << 10  # small runs packed into scratch segments and scattered
    src_idx = list(range(SLOTS - 1, 13, -1))
    dst = [int(x) for x in np.random.default_rng(2).permutation(SLOTS)[: len(src_idx)]]
    (state, err, pool, _), (sstate, serr), _ = _run(channel, pb, src_idx, dst, two_regions=True)
    assert state == "done", err
    assert sstate == "done", serr
    _check_pool(pool, pb, src_idx, dst)


def test_out_of_range_slot_refused_before_write():
    pb = 300 << 10
    src_idx = [0, 1, 2]
    dst = [5, 6, SLOTS + 3]  # last one out of range: nothing of the batch may land
    (state, err, pool, stats), _, _ = _run("tcp", pb, src_idx, dst, expected=3, deadline_s=5)
    assert state == "failed"
    assert "outside" in err
    assert not pool.any()
    assert stats.get("rejected_batch") == 1


def test_bad_slot_refused_by_sender():
    (state, err, pool, _), (sstate, serr), _ = _run(
        "tcp", 4096, [0, 1], [3, -2], expected=1, deadline_s=2
    )
    assert sstate == "valueerror" and ">= -1" in serr
    assert state == "failed" and "deadline" in err
    assert not pool.any()


def test_deadline_fails_without_sender():
    (state, err, pool, _), _, _ = _run("shm", 4096, [], [], expected=2, deadline_s=0.5, send=False)
    assert state == "failed" and "deadline" in err


def test_push_to_absent_peer_fails():
    from disagg.transport.ucx_plane import UcxDataPlane

    with UcxDataPlane() as plane:
        rows = torch.zeros(2, 4096, dtype=torch.uint8)
        h = plane.post_push("ucx+tcp://127.0.0.1:9", 1, 1, b"t", [(0, rows, [0, 1])], deadline_s=1)
        st = plane.wait_push(h, 10)
        assert st.failed and st.error


def test_abort_and_refuse_foreign_token():
    from disagg.transport.ucx_plane import UcxDataPlane

    with UcxDataPlane(channel="shm") as rx, UcxDataPlane(channel="shm") as tx:
        pool = torch.zeros(8, 4096, dtype=torch.uint8)
        rx.register_regions([[pool]])
        rx.expect(1, 1, b"right", [2], 5)
        rows = torch.full((2, 4096), 9, dtype=torch.uint8)
        h = tx.post_push(rx.endpoint, 1, 1, b"wrong", [(0, rows, [0, 1])], deadline_s=2)
        tx.wait_push(h, 5)
        assert rx.poll(1).state.value == "pending"
        rx.abort(1, "test abort")
        st = rx.poll(1)
        assert st.failed and st.error == "test abort"
        assert not pool.any()
        assert rx.stats["rejected_unknown"] >= 1


@pytest.mark.parametrize("dst", [[2, 3], [0, 0]])
def test_promised_slots_enforced(dst):
    """slots_by_group: a transfer may write only the slots it was promised, each once."""
    from disagg.transport.ucx_plane import UcxDataPlane

    with UcxDataPlane(channel="shm") as rx, UcxDataPlane(channel="shm") as tx:
        pool = torch.zeros(8, 4096, dtype=torch.uint8)
        rx.register_regions([[pool]])
        rx.expect(1, 1, b"tok", [2], 5, slots_by_group=[[0, 1]])
        rows = torch.full((2, 4096), 9, dtype=torch.uint8)
        h = tx.post_push(rx.endpoint, 1, 1, b"tok", [(0, rows, dst)], deadline_s=5)
        tx.wait_push(h, 10)
        st = rx.wait(1, 10)
        assert st.failed and ("not given" in st.error or "twice" in st.error), st.error
        assert not pool.any()
        assert rx.stats["rejected_batch"] == 1
