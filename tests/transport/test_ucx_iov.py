"""Scatter-gather sends (ucx_iov): the ctypes mirror of ucp.h, the iov builder, and
pushes of StoreRows between two processes landing byte-exactly, with and without the
iov path (fallback: gather). Skipped without ucxx."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
ucx_plane = pytest.importorskip(
    "disagg.transport.ucx_plane", reason="ucxx is not installed (pip install disagg[ucx])"
)
from disagg.transport import ucx_iov  # noqa: E402
from disagg.transport.dataplane import StoreRows  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def _ucp_include() -> str | None:
    try:
        import libucx
    except ImportError:
        return None
    inc = os.path.join(os.path.dirname(libucx.__file__), "include")
    return inc if os.path.exists(os.path.join(inc, "ucp", "api", "ucp.h")) else None


def test_loads_on_this_install():
    assert ucx_iov.available(), ucx_iov.unavailable_reason()


def test_request_param_layout_matches_ucp_h(tmp_path):
    """The ctypes struct against a C compile of the installed header (skipped when no
    compiler or header is around; the product never compiles anything)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    inc = _ucp_include()
    if cc is None or inc is None:
        pytest.skip("no C compiler or ucp.h")
    fields = list(ucx_iov.PARAM_LAYOUT)
    src = tmp_path / "probe.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <ucp/api/ucp.h>\nint main(void){\n"
        'printf("%zu %zu %zu %d %d %d %lu\\n", sizeof(ucp_request_param_t), '
        "sizeof(ucp_dt_iov_t), sizeof(ucs_status_t), UCP_OP_ATTR_FIELD_DATATYPE, "
        "UCP_OP_ATTR_FIELD_MEMORY_TYPE, UCS_MEMORY_TYPE_HOST, "
        "(unsigned long)ucp_dt_make_iov());\n"
        + "".join(f'printf("%zu\\n", offsetof(ucp_request_param_t, {f}));\n' for f in fields)
        + "return 0;}\n"
    )
    exe = tmp_path / "probe"
    subprocess.run([cc, f"-I{inc}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    size, iov_size, status_size, f_dt, f_mt, host, dt_iov = map(int, out[:7])
    assert size == ucx_iov.PARAM_SIZE
    assert iov_size == ucx_iov.IOV_ENTRY_SIZE
    assert status_size == 1  # read as int8 (ctypes.c_int8)
    assert (f_dt, f_mt, host, dt_iov) == (1 << 3, 1 << 6, 0, 2)
    assert dict(zip(fields, map(int, out[7:]))) == ucx_iov.PARAM_LAYOUT


def test_iov_entries_merge_adjacent_spans():
    # full-width rows: adjacent rows merge into one entry
    e = ucx_iov.iov_entries(1000, 100, np.array([3, 4, 5, 9, 2]), ((0, 100),))
    assert e.tolist() == [[1300, 300], [1900, 100], [1200, 100]]
    # two columns making the whole row: the same
    e = ucx_iov.iov_entries(1000, 100, np.array([3, 4]), ((0, 40), (40, 60)))
    assert e.tolist() == [[1300, 200]]
    # a column of a row (not full width): one entry per page, even for adjacent rows
    e = ucx_iov.iov_entries(0, 100, np.array([1, 2]), ((10, 30),))
    assert e.tolist() == [[110, 30], [210, 30]]
    # columns out of order inside a page: never merged across the jump
    e = ucx_iov.iov_entries(0, 100, np.array([1]), ((50, 50), (0, 50)))
    assert e.tolist() == [[150, 50], [100, 50]]
    assert ucx_iov.iov_entries(0, 100, np.array([], dtype=np.int64), ((0, 100),)).shape == (0, 2)


SLOTS = 96


def _slab(rows: int, width: int) -> torch.Tensor:
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(width, dtype=np.int64)[None, :]
    return torch.from_numpy(((r * 131 + c * 7) % 251).astype(np.uint8))


def _receiver(channel, pb, expected, q_out, q_in):
    # the iov sends are what is tested: a receiver that does not offer RMA reads (an
    # RMA-capable shm receiver reads StoreRows itself, test_ucx_rma.py)
    os.environ["DISAGG_UCX_RMA"] = "0"
    from disagg.transport.ucx_plane import UcxDataPlane

    plane = UcxDataPlane(channel=channel)
    pool = torch.zeros(SLOTS, pb, dtype=torch.uint8)
    plane.register_regions([[pool]])
    plane.expect(7, 3, b"tok", [expected], 20)
    q_out.put(plane.endpoint)
    st = plane.wait(7, 30)
    q_out.put((st.state.value, st.error, pool.numpy().copy()))
    q_in.get(timeout=30)
    plane.close()


def _sender(endpoint, width, rows, cols, dst, iov_on, q_out):
    if not iov_on:
        os.environ["DISAGG_UCX_IOV"] = "0"
    from disagg.transport import ucx_iov
    from disagg.transport.ucx_plane import UcxDataPlane

    plane = UcxDataPlane(channel="shm" if endpoint.startswith("ucx+shm") else "tcp")
    slab = _slab(2 * SLOTS, width)
    src = StoreRows(slab, np.asarray(rows, dtype=np.int64), cols)
    h = plane.post_push(endpoint, 7, 3, b"tok", [(0, src, dst)], deadline_s=20)
    st = plane.wait_push(h, 30)
    # counted as posted (h.plan is emptied once the push is final: reading it after
    # post_push raced a push that finished first, under load)
    iov_msgs = plane.stats["iov_sends"]
    q_out.put((st.state.value, st.error, iov_msgs, ucx_iov.available()))
    plane.close()


def _push(channel, width, rows, cols, dst, iov_on=True):
    pb = sum(c for _, c in cols)
    ctx = mp.get_context("spawn")
    q_r, q_s, q_in = ctx.Queue(), ctx.Queue(), ctx.Queue()
    expected = sum(1 for d in dst if d >= 0)
    r = ctx.Process(target=_receiver, args=(channel, pb, expected, q_r, q_in))
    r.start()
    ep = q_r.get(timeout=30)
    s = ctx.Process(target=_sender, args=(ep, width, rows, cols, dst, iov_on, q_s))
    s.start()
    rx = q_r.get(timeout=60)
    tx = q_s.get(timeout=60)
    q_in.put(None)
    for p in (s, r):
        p.join(15)
        if p.is_alive():
            p.kill()
    return rx, tx


def _expect(width, rows, cols, dst, pb):
    slab = _slab(2 * SLOTS, width).numpy()
    want = np.zeros((SLOTS, pb), dtype=np.uint8)
    for r, d in zip(rows, dst):
        if d >= 0:
            want[d] = np.concatenate([slab[r, o : o + c] for o, c in cols])
    return want


@pytest.mark.parametrize("channel", ["tcp", "shm"])
@pytest.mark.parametrize("iov_on", [True, False])
def test_store_rows_land_byte_exact(channel, iov_on):
    """Random store rows into random slots (some skipped), 4 KiB pages packed into one
    segment, plus a run of adjacent rows: iov sends (shm), or numpy gathers (tcp, and
    the fallback when ucx_iov is off) land every byte where it belongs."""
    rng = np.random.default_rng(5)
    width = 4096
    rows = np.concatenate([rng.permutation(2 * SLOTS)[:60], np.arange(10, 30)])
    dst = rng.permutation(SLOTS)[:80]
    dst[[3, 17]] = -1
    cols = ((0, width),)
    (state, err, pool), (tstate, terr, iov_msgs, avail) = _push(
        channel, width, rows.tolist(), cols, dst.tolist(), iov_on
    )
    assert (state, err) == ("done", None), err
    assert (tstate, terr) == ("done", None), terr
    assert avail is iov_on
    # iov sends on shm only (over tcp UCX cuts them into 8 KiB copies: numpy gathers)
    assert (iov_msgs > 0) is (iov_on and channel == "shm")
    np.testing.assert_array_equal(pool, _expect(width, rows, cols, dst, width))


@pytest.mark.parametrize("channel", ["tcp", "shm"])
def test_store_rows_columns_of_a_row(channel):
    """Pages made of two column spans of wider rows (out of order): one iov entry per
    span on shm, a per-column numpy gather over tcp."""
    rng = np.random.default_rng(6)
    width = 3000
    cols = ((2000, 700), (100, 1300))
    rows = rng.permutation(2 * SLOTS)[:40]
    dst = rng.permutation(SLOTS)[:40]
    (state, err, pool), (tstate, terr, iov_msgs, _) = _push(
        channel, width, rows.tolist(), cols, dst.tolist()
    )
    assert (state, err) == ("done", None), err
    assert (tstate, terr) == ("done", None), terr
    assert (iov_msgs > 0) is (channel == "shm")
    np.testing.assert_array_equal(pool, _expect(width, rows, cols, dst, 2000))


def test_store_rows_bad_input_named():
    from disagg.transport.ucx_plane import UcxDataPlane

    plane = UcxDataPlane(channel="tcp")
    try:
        slab = _slab(8, 64)
        bad = StoreRows(slab, np.array([1, 8]), ((0, 64),))
        with pytest.raises(ValueError, match="source rows outside"):
            plane.post_push("ucx+tcp://127.0.0.1:1?tcpam=1", 1, 1, b"t", [(0, bad, [0, 1])])
        bad = StoreRows(slab, np.array([1, 2]), ((10, 64),))
        with pytest.raises(ValueError, match="columns"):
            plane.post_push("ucx+tcp://127.0.0.1:1?tcpam=1", 1, 1, b"t", [(0, bad, [0, 1])])
        bad = StoreRows(slab, np.array([1, 2, 3]), ((0, 64),))
        with pytest.raises(ValueError, match="3 source rows for 2"):
            plane.post_push("ucx+tcp://127.0.0.1:1?tcpam=1", 1, 1, b"t", [(0, bad, [0, 1])])
    finally:
        plane.close()
