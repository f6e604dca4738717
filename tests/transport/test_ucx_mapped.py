"""The UCX shm plane's mapped path: a producer store from ``register_source`` lives in
memory UCX allocated (shared memory), the consumer maps it through the key
(``ucp_rkey_ptr``) and copies the pages with the C row copy instead of reading them
with gets. Byte-exact landing across processes, the get path for other stores, forged
headers naming rows past the producer's segment (refused by name, never read), abort,
the ``DISAGG_UCX_MAPPED`` switch, and a returned store that outlives its plane.
Skipped without ucxx."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from harness import spawn_context

pytest.importorskip(
    "disagg.transport.ucx.plane", reason="ucxx is not installed (pip install disagg[ucx])"
)
from test_ucx_rma import _slab, abort_mid_pull_then_carry_on  # noqa: E402

from disagg.transport.dataplane import StoreRows  # noqa: E402
from disagg.transport.ucx import native_rma, wire  # noqa: E402

pytestmark = [
    pytest.mark.timeout(120),
    # the C loop is optional at install (CI requires it); without it there is no RMA
    pytest.mark.skipif(
        getattr(native_rma, "_ucxrma", None) is None, reason="the _ucxrma extension is not built"
    ),
]

SLOTS = 160


def _want(slab: np.ndarray, rows, cols, dst, slots: int = SLOTS) -> np.ndarray:
    pb = sum(c for _, c in cols)
    want = np.zeros((slots, pb), dtype=np.uint8)
    for r, d in zip(rows, dst):
        want[d] = np.concatenate([slab[r, o : o + c] for o, c in cols])
    return want


def _receiver(sizes, expected, q_out, q_in):
    from disagg.transport.ucx.plane import UcxDataPlane

    plane = UcxDataPlane(channel="shm")
    regions = [torch.zeros(SLOTS, n, dtype=torch.uint8) for n in sizes]
    plane.register_regions([regions])
    plane.expect(7, 3, b"tok", [expected], 20)
    q_out.put((plane.endpoint, plane.capabilities))
    st = plane.wait(7, 30)
    pool = torch.cat(regions, dim=1).numpy().copy()
    q_out.put((st.state.value, st.error, st.pages, pool, dict(plane.stats)))
    q_in.get(timeout=60)
    plane.close()


def _producer(endpoint, caps, width, rows, cols, dst, q_out):
    from disagg.transport.ucx.plane import UcxDataPlane

    plane = UcxDataPlane(channel="shm")
    slab = _slab(2 * SLOTS, width)
    store = plane.register_source(slab)
    moved = store.data_ptr() != slab.data_ptr() and torch.equal(store, slab)
    src = StoreRows(store, rows, cols)
    h = plane.post_push(endpoint, 7, 3, b"tok", [(0, src, dst)], caps=caps)
    st = plane.wait_push(h, 30)
    q_out.put((st.state.value, st.error, moved, dict(plane.stats)))
    plane.close()


def test_mapped_store_lands_scattered_rows_byte_exact_across_processes():
    """A producer process's store from ``register_source`` (a copy in UCX-allocated
    shared memory, same bytes); random rows (and a run) into random slots, each page two
    column spans of the row landing across two regions, in several batches: every byte
    lands where it belongs, through the mapped copy only (no get is posted)."""
    width, cols, sizes = 3000, ((2000, 700), (100, 1300)), [1500, 500]
    rng = np.random.default_rng(11)
    rows = np.concatenate([rng.permutation(2 * SLOTS)[:120], np.arange(10, 30)])
    dst = rng.permutation(SLOTS)[:140]
    ctx = spawn_context()
    q_r, q_s, q_in = ctx.Queue(), ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=_receiver, args=(sizes, rows.size, q_r, q_in))
    r.start()
    try:
        ep, caps = q_r.get(timeout=30)
        s = ctx.Process(target=_producer, args=(ep, caps, width, rows, cols, dst.tolist(), q_s))
        s.start()
        state, err, pages, pool, rstats = q_r.get(timeout=60)
        tstate, terr, moved, tstats = q_s.get(timeout=60)
    finally:
        q_in.put(None)
        for p in (r, s):
            p.join(15)
            if p.is_alive():
                p.kill()
    assert (state, err, tstate, terr) == ("done", None, "done", None), (err, terr)
    assert moved and pages == rows.size
    np.testing.assert_array_equal(pool, _want(_slab(2 * SLOTS, width).numpy(), rows, cols, dst))
    # 64 pages, then the rest: both batches copied from the mapping, no get posted
    assert rstats["rma_mapped_batches"] == 2, rstats
    assert rstats["rma_mapped_bytes"] == rows.size * 2000
    assert rstats.get("rma_reads", 0) == 0 and rstats.get("rma_unmapped_keys", 0) == 0
    assert tstats["rma_mem_alloc"] == 1 and tstats.get("rma_mem_map", 0) == 0


def _pair():
    from disagg.transport.ucx.plane import UcxDataPlane

    return UcxDataPlane(channel="shm"), UcxDataPlane(channel="shm")


def _push(rx, tx, tid, store, rows, dst, pb):
    rx.expect(tid, 3, b"tok", [len(rows)], 20)
    src = StoreRows(store, np.asarray(rows), ((0, pb),))
    h = tx.post_push(
        rx.endpoint, tid, 3, b"tok", [(0, src, list(map(int, dst)))], caps=rx.capabilities
    )
    return rx.wait(tid, 20), tx.wait_push(h, 20)


def test_store_not_from_register_source_is_read_with_gets():
    """A plain host store (not UCX-allocated): the consumer's ``rkey_ptr`` fails, it
    remembers that for the key and reads with gets, byte-exact; a mapped store from the
    same producer then goes through the mapping."""
    rx, tx = _pair()
    try:
        pool = torch.zeros(SLOTS, 4096, dtype=torch.uint8)
        rx.register_regions([[pool]])
        plain = _slab(2 * SLOTS, 4096, salt=1)
        rng = np.random.default_rng(2)
        for tid in (1, 2):  # twice: the failed mapping is looked up once per key
            rows, dst = rng.permutation(2 * SLOTS)[:100], rng.permutation(SLOTS)[:100]
            st, pst = _push(rx, tx, tid, plain, rows, dst, 4096)
            assert st.done and pst.done, (st.error, pst.error)
            np.testing.assert_array_equal(pool.numpy()[dst], plain.numpy()[rows])
        assert rx.stats["rma_reads"] >= 200 and rx.stats.get("rma_mapped_batches", 0) == 0
        assert rx.stats["rma_unmapped_keys"] == 1
        mapped = tx.register_source(_slab(2 * SLOTS, 4096, salt=2))
        reads = rx.stats["rma_reads"]
        st, pst = _push(rx, tx, 3, mapped, rows, dst, 4096)
        assert st.done and pst.done
        np.testing.assert_array_equal(pool.numpy()[dst], mapped.numpy()[rows])
        assert rx.stats["rma_reads"] == reads and rx.stats["rma_mapped_batches"] >= 1
    finally:
        rx.close()
        tx.close()


@pytest.mark.parametrize("when", ["first", "after"])
@pytest.mark.parametrize("how", ["rows", "base"])
def test_header_past_the_producers_segment_fails_by_name_and_reads_nothing(when, how):
    """A header (authenticated: it carries the transfer's token) whose slab runs past
    the producer's mapped segment (``rows``: more rows than the segment holds; ``base``:
    an address beyond it), as the first header of its key or after good ones: the
    transfer fails naming the range, nothing is copied or read (no segfault), and the
    consumer serves the next transfer byte-exactly."""
    rx, tx = _pair()
    try:
        pb = 4096
        pool = torch.zeros(SLOTS, pb, dtype=torch.uint8)
        rx.register_regions([[pool]])
        store = tx.register_source(_slab(2 * SLOTS, pb, salt=3))
        rows, dst = np.arange(0, 2 * SLOTS, 2)[:SLOTS], np.arange(SLOTS)
        if when == "after":
            st, pst = _push(rx, tx, 1, store, rows, dst, pb)
            assert st.done and pst.done
            pool.zero_()
        reg = tx._mapped._alloc[0][0]
        nrows, base = 2 * SLOTS, reg.address
        if how == "rows":
            nrows = 1 << 20  # 4 GiB of rows: the last one far past the segment
        else:
            base += 1 << 30
        body = wire.rma_frame(
            *(9, 3, b"tok", 0, pb, 0),
            *(base, nrows, pb, pb),
            reg.rkey,
            tx.endpoint,
            ((0, pb),),
            np.arange(4, dtype=np.int64),
            np.array([0, 1, 2, nrows - 1], dtype=np.int64),
        )[4:].tobytes()
        rx.expect(9, 3, b"tok", [4], 10)
        mapped = rx.stats.get("rma_mapped_batches", 0)
        rx._link.submit(lambda: rx._rma.on_header(body))
        st = rx.wait(9, 5)
        assert st.failed and "outside the producer's mapped segment" in (st.error or ""), st
        assert f"at {base:#x}" in st.error
        assert rx.stats.get("rma_mapped_batches", 0) == mapped
        assert rx.stats.get("rma_reads", 0) == 0 and not pool.any()
        # the consumer carries on
        st, pst = _push(rx, tx, 10, store, rows, dst, pb)
        assert st.done and pst.done, (st.error, pst.error)
        np.testing.assert_array_equal(pool.numpy()[dst], store.numpy()[rows])
    finally:
        rx.close()
        tx.close()


def test_abort_during_mapped_copies_writes_nothing_after():
    """``abort`` mid-pull on the mapped path returns with nothing under way (the copies
    are synchronous on the progress thread, counted in ``inflight``); see
    ``abort_mid_pull_then_carry_on``."""
    rx, tx = _pair()
    try:
        abort_mid_pull_then_carry_on(rx, tx, tx.register_source(_slab(1024, 65536)))
        assert rx.stats["rma_mapped_batches"] >= 32 and rx.stats.get("rma_reads", 0) == 0
    finally:
        rx.close()
        tx.close()


def test_register_source_keeps_other_tensors_where_they_are(monkeypatch):
    """tcp, ``DISAGG_UCX_MAPPED=0``, a non-contiguous tensor: the tensor comes back
    unchanged; another dtype is mapped with its shape, dtype and values."""
    from disagg.transport.ucx.plane import UcxDataPlane

    t = _slab(8, 64)
    with UcxDataPlane(channel="tcp") as p:
        assert p.register_source(t) is t
    with UcxDataPlane(channel="shm") as p:
        u = t.t()
        assert p.register_source(u) is u  # non-contiguous: unchanged
        f = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        g = p.register_source(f)  # other dtypes: same shape, dtype and values
        assert g.data_ptr() != f.data_ptr() and g.dtype == f.dtype and torch.equal(g, f)
    monkeypatch.setenv("DISAGG_UCX_MAPPED", "0")
    with UcxDataPlane(channel="shm") as p:
        assert p.register_source(t) is t


def test_returned_store_outlives_its_plane():
    """The tensor ``register_source`` returned stays valid after the plane closed (and
    was collected): written and read back; its memory is freed once it is gone. A
    store dropped before close is freed at close. In a subprocess: a dangling tensor
    would crash it."""
    code = """
import gc, torch
from disagg.transport.ucx.plane import UcxDataPlane
p = UcxDataPlane(channel="shm")
s = p.register_source(torch.full((64, 4096), 5, dtype=torch.uint8))
v = s[3:9]
reg = p._mapped._alloc[0][0]
p.close(); del p; gc.collect()
assert not reg.closed
v.fill_(9); s[0].fill_(1)
print(int(s.sum()), int(v.sum()))
del s; gc.collect()
assert not reg.closed  # the view still holds it
del v; gc.collect()
print(reg.closed)
p = UcxDataPlane(channel="shm")
s = p.register_source(torch.ones(8, 64, dtype=torch.uint8))
reg = p._mapped._alloc[0][0]
del s; gc.collect()
p.close()
print(reg.closed, p.stats["rma_mem_free"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    want = 64 * 4096 * 5 + 6 * 4096 * 4 - 4096 * 4
    assert out.stdout.split("\n")[:3] == [f"{want} {6 * 4096 * 9}", "True", "True 1"]
